"""Exact byte-level BPE token ids through tiktoken, for the tokenizers where they provably agree.

Block keys hash token ids, so the gateway needs exactly the ids ``tokenizers`` gives
(``Tokenizer.encode(text, add_special_tokens).ids``). For byte-level BPE (GPT-2, Llama 3, Qwen 2
and their kin) the same two steps, a regex split and byte pair merges, run in tiktoken (OpenAI's
encoder, Rust) with much less work per token. :class:`FastBPE` builds a ``tiktoken.Encoding``
from a ``tokenizers.Tokenizer`` and uses it only where its ids are the same; everything else goes
through ``tokenizers`` unchanged. :func:`fast_bpe_unsupported_reason` says why a tokenizer cannot.

Why the ids are the same
------------------------
``tokenizers`` (``models/bpe/word.rs``, ``Word::merge_all``) merges, again and again, the adjacent
pair of symbols whose *listed merge* has the lowest index (the leftmost on ties) until no adjacent
pair is a listed merge. tiktoken (``_byte_pair_merge``) merges the adjacent pair whose
*concatenation* has the lowest rank (the leftmost on ties) until no concatenation is a token; each
token's rank here is its id.

1. Listed pairs are taken in the same order when the ids of the merges' results never decrease
   along the merge list (checked). Two merges with one result at different places leave the same
   state whichever goes first (what either creates ranks above that result).
2. So the two can only part where tiktoken takes an adjacent pair ``(x, y)`` that is not a listed
   merge although ``t = x + y`` is a token. Symbols are only ever made by merges inside their own
   bytes, and the merges inside ``t``'s bytes come in the order of a run over ``t``'s bytes alone;
   so that lone run passes through ``[x, y]``, where it stops with two symbols (nothing left to
   merge). Checked: ``tokenizers``' own BPE of every token alone never ends in two symbols.
3. tiktoken gives a piece that is itself a token as that token; ``tokenizers`` does too when the
   model sets ``ignore_merges``, and otherwise only if the lone run ends in the token itself:
   checked for every token then (this implies 2).
4. The split: the pre-tokenizer is ``ByteLevel`` with its GPT-2 regex, or one or more ``Split``
   steps (isolated, not inverted) by a regex followed by ``ByteLevel`` without one; no prefix
   space is added. tiktoken splits by the last regex; the ones before it (DeepSeek V3 cuts digit
   runs and CJK text first) cut the text in Python's ``regex`` first, as ``tokenizers`` does,
   each piece then encoded on its own (a piece that one of them would cut at an empty match goes
   to ``tokenizers``; a piece the last regex matches nowhere in is one BPE run, as in
   ``tokenizers``, which keeps what a ``Split`` does not match as a piece).
   tiktoken runs that regex in ``fancy-regex``, ``tokenizers`` in Oniguruma; their Unicode tables
   are not the same, so only ASCII text takes this path (``\\s``, ``\\p{L}``, ``\\p{N}`` agree on
   ASCII; checked at load on every ASCII character in the contexts the patterns tell apart). The
   engines also read ``^`` and ``$`` differently (Oniguruma: at any line break), and Oniguruma's
   Ruby dialect reads some syntax otherwise, so a regex with an anchor, a word boundary or such
   syntax (:func:`_regex_unsupported_reason`) is refused; where a regex leaves
   characters unmatched (``tokenizers`` keeps them as a piece, tiktoken drops them) a piece's ids
   must spell all of its bytes, else it goes to ``tokenizers``, as does a piece tiktoken fails
   on. The normalizer is none, a Unicode normal form (NFC, NFD, NFKC, NFKD) or a sequence of them,
   which leave ASCII as it is.
5. Added tokens: ``tokenizers`` cuts the raw text at its non-normalized added tokens first
   (leftmost-longest) and encodes each piece between them on its own (:mod:`kvcore.token_cache`
   derives this); the same cut is made here. A piece that is not ASCII, or holds a normalized
   added token (its content or its normalized content: NFKC finds "ﬁ" as "fi"), is encoded by
   ``tokenizers`` itself.
"""
from __future__ import annotations

import json
import re
from typing import Any

import regex
import tiktoken
from tokenizers import models as tk_models

from kvcore.token_cache import NO_CUTS, added_tokens_re, cache_unsupported_reason, encode_ids, special_wrap

# tokenizers' ByteLevel pre-tokenizer regex (pre_tokenizers/byte_level.rs), GPT-2's
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Unicode normal forms: every ASCII character is its own NFC/NFD/NFKC/NFKD form and composes with
# nothing ASCII, so on a piece that is ASCII throughout they change nothing
_ASCII_STABLE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of ``ByteLevel`` vocabularies."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _probe_texts() -> list[str]:
    """ASCII texts that put every ASCII character in each context the split patterns tell apart
    (after a letter, a digit, a space, a newline, an apostrophe; repeated; at the ends)."""
    chars = [chr(c) for c in range(128)]
    out = []
    for c in chars:
        out.append(f"a{c}b {c}{c}1{c}\n{c} 'x{c}'s {c}  z{c}\r\n\t{c}")
    out.append("".join(chars) + " " + "".join(reversed(chars)))
    out.append("Hello, world! It's 2026: don't   stop\n\n  the   3.14 tokens' run.\t\tok\r\n")
    out.append(" ".join("1234567890"[:n] for n in range(1, 11)) + " a12b123c1234.12345,123456_1234567")
    return out


def _merge_pairs(merges: list[Any]) -> list[tuple[str, str]]:
    """``tokenizer.json``'s merges ("a b" strings or [a, b] lists) as pairs."""
    out = []
    for m in merges:
        if isinstance(m, str):
            a, _, b = m.partition(" ")
        else:
            a, b = m
        out.append((a, b))
    return out


def _split_patterns(pre: dict[str, Any] | None) -> tuple[list[str], str | None]:
    """``(regexes, None)`` for a supported byte-level pre-tokenizer, else ``([], reason)``: the
    last regex is the one tiktoken splits by, those before it (DeepSeek V3's digit and CJK splits)
    cut the text first, each piece on its own after."""
    def byte_level(p: dict[str, Any], with_regex: bool) -> str | None:
        if p.get("type") != "ByteLevel":
            return f"pre-tokenizer step {p.get('type')!r} is not ByteLevel"
        if p.get("add_prefix_space"):
            return "ByteLevel adds a prefix space"
        if bool(p.get("use_regex", True)) != with_regex:
            return "ByteLevel's use_regex is not as expected"
        return None

    if pre is None:
        return [], "no pre-tokenizer"
    if pre.get("type") == "ByteLevel":
        reason = byte_level(pre, True)
        return ([], reason) if reason else ([GPT2_PATTERN], None)
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else []
    if len(steps) >= 2:
        *splits, last = steps
        patterns = []
        for split in splits:
            pattern = (split.get("pattern") or {}).get("Regex") if split.get("type") == "Split" else None
            if pattern is None or split.get("behavior") != "Isolated" or split.get("invert"):
                return [], "a pre-tokenizer step before ByteLevel is not an isolated, non-inverted regex Split"
            patterns.append(pattern)
        reason = byte_level(last, False)
        return ([], reason) if reason else (patterns, None)
    return [], f"pre-tokenizer {pre.get('type')!r} is not a byte-level split this path knows"


def _isolate(pieces: list[str], split: Any) -> list[str] | None:
    """``pieces`` cut by ``split`` (a compiled regex) as a ``Split`` with the ``Isolated``
    behaviour cuts: each match a piece, the text between matches pieces, no empty piece; None
    when a match is empty (left to tokenizers)."""
    out: list[str] = []
    for piece in pieces:
        pos = 0
        for m in split.finditer(piece):
            start, end = m.span()
            if start == end:
                return None
            if start > pos:
                out.append(piece[pos:start])
            out.append(piece[start:end])
            pos = end
        if pos < len(piece):
            out.append(piece[pos:])
    return out


class FastBPE:
    """``backend.encode(text, add_special_tokens).ids`` exactly, through tiktoken where the module
    docstring's conditions hold and through ``backend`` (a ``tokenizers.Tokenizer``) elsewhere.

    Build with :meth:`build`, which raises ValueError naming the condition a tokenizer fails (it
    runs BPE over every vocabulary token once, at load). Thread-safe (tiktoken and
    ``tokenizers`` are). ``fast_pieces`` / ``slow_pieces`` count the text pieces each engine
    encoded (a statistic: updated without a lock)."""

    def __init__(self, backend: Any, encoding: Any, special: dict[str, int], normalized: list[str],
                 wrap: tuple[list[int], list[int]] | None, leading: list[Any] | None = None) -> None:
        self._backend = backend
        self._encode_ascii = encoding.encode_ordinary
        self._encode_whole = encoding._encode_single_piece  # one BPE run, no split (tiktoken's core)
        self._decode_bytes = encoding.decode_bytes
        self._special = special
        self._special_re = added_tokens_re(special) if special else None
        self._normalized_re = re.compile("|".join(re.escape(s) for s in normalized)) if normalized else None
        self._wrap = wrap
        self._leading = leading or []
        self.fast_pieces = 0
        self.slow_pieces = 0

    @classmethod
    def build(cls, backend: Any) -> FastBPE:
        """The encoder of ``backend``; raises ValueError (why not) when the ids could differ."""
        reason, parts = _parts(backend)
        if reason is not None:
            raise ValueError(reason)
        fast = cls(backend, *parts)
        for text in _probe_texts():
            try:
                got = fast._encode_split(text)
            except BaseException as exc:  # noqa: BLE001 - tiktoken's Rust panics are BaseExceptions
                _reraise_unless_engine_error(exc)
                raise ValueError(f"tiktoken fails on the split regex ({type(exc).__name__}: {exc})") from None
            if got is None or len(fast._decode_bytes(got)) != len(text):
                continue  # text the runtime leaves to tokenizers (characters the regex leaves unmatched)
            if got != encode_ids(backend, [text], False)[0]:
                raise ValueError(f"the split regex parts from tokenizers' on ASCII text: {text[:40]!r}")
        fast.fast_pieces = fast.slow_pieces = 0
        return fast

    def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """``[backend.encode(t, add_special_tokens=...).ids for t in texts]``; raises what the
        tokenizer raises."""
        if add_special_tokens and self._wrap is None:
            return encode_ids(self._backend, texts, True)
        out = [self._raw(t) for t in texts]
        if add_special_tokens:
            head, tail = self._wrap  # type: ignore[misc]
            if head or tail:
                out = [head + ids + tail for ids in out]
        return out

    def _raw(self, text: str) -> list[int]:
        if self._special_re is None:
            return self._piece(text)
        out: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                out += self._piece(text[pos:m.start()])
            out.append(self._special[m.group()])
            pos = m.end()
        if pos < len(text):
            out += self._piece(text[pos:])
        return out

    def _piece(self, text: str) -> list[int]:
        """Ids of text holding no non-normalized added token (encoded on its own by tokenizers)."""
        if text.isascii() and (self._normalized_re is None or self._normalized_re.search(text) is None):
            try:
                ids = self._encode_split(text)
            except BaseException as exc:  # noqa: BLE001 - tiktoken's Rust panics are BaseExceptions
                _reraise_unless_engine_error(exc)
                ids = None
            # all bytes spelt: where the regex leaves characters unmatched, tiktoken drops them
            if ids is not None and len(self._decode_bytes(ids)) == len(text):
                self.fast_pieces += 1
                return ids
        self.slow_pieces += 1
        return encode_ids(self._backend, [text], False)[0]

    def _encode_split(self, text: str) -> list[int] | None:
        """tiktoken's ids of ASCII ``text`` after the leading splits (None: left to tokenizers)."""
        if not self._leading:
            return self._encode_ascii(text)
        pieces: list[str] | None = [text]
        for split in self._leading:
            pieces = _isolate(pieces, split)  # type: ignore[arg-type]
            if pieces is None:
                return None
        out: list[int] = []
        for piece in pieces:  # type: ignore[union-attr]
            # a piece the last regex matches nowhere in (a digit run under a regex without \p{N}):
            # tokenizers keeps it whole, one BPE run, where tiktoken would drop it
            out += self._encode_ascii(piece) or self._encode_whole(piece)
        return out


def fast_bpe_unsupported_reason(backend: Any) -> str | None:
    """Why :class:`FastBPE` cannot encode ``backend`` exactly (the first condition it fails), or
    None. Does the whole check, so it costs what :meth:`FastBPE.build` costs."""
    try:
        FastBPE.build(backend)
    except ValueError as exc:
        return str(exc)
    return None


def _reraise_unless_engine_error(exc: BaseException) -> None:
    """Re-raise ``exc`` unless tiktoken raised it (an Exception, or pyo3's ``PanicException``,
    which derives from BaseException), so an interrupt is never swallowed."""
    if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
        raise exc


# groups the engines read alike: (?: (?= (?! (?<= (?<! (?> and case-insensitive (?i: (never a bare
# (?i): Oniguruma's Ruby syntax makes "q(?i)j|k" mean q(?i:j|k))
_GROUP_RE = re.compile(r"\(\?(?:[=!:>]|<[=!]|i:)")
# escapes the engines read alike: classes, Unicode properties, control characters, \xHH, \uHHHH and
# escaped punctuation (Oniguruma reads \h as a hex digit and \N as any non-newline, Python's
# regex otherwise; backreferences and the rest are refused)
_ESCAPE_RE = re.compile(r"\\(?:[sSdDwWrntfv]|[pP]\{[A-Za-z_]+\}|x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|[^0-9A-Za-z])")
_COUNTED_RE = re.compile(r"\{\d+(?:,\d*)?\}")


def _regex_unsupported_reason(pattern: str, leading: bool = False) -> str | None:
    r"""Why a split regex may match otherwise in fancy-regex (tiktoken) or Python's ``regex``
    (leading splits) than in Oniguruma (``tokenizers``), or None. Refused: an anchor (``^`` or
    ``$`` outside a class, ``\A``, ``\z``, ``\Z``, ``\G``) or word boundary (Oniguruma anchors at
    line breaks), an escape outside :data:`_ESCAPE_RE`, a group other than plain, lookaround,
    atomic or ``(?i:...)``, a non-ASCII character in a case-insensitive group (multi-character
    case folding: Oniguruma's ``(?i:ﬁ)`` matches "fi", the others' do not), a nested class or
    ``&&`` in a class, and a counted repetition followed by ``?`` or ``+`` (Ruby syntax: ``{3}?``
    is optional, ``{1,3}+`` repeats the repetition). ``leading``: a Split before the last one, run
    in Python's ``regex``, which has no backtracking limit: a repeated group (``(?:a|a)+b`` takes
    exponential time where Oniguruma gives up) is refused too."""
    in_class = False
    folding: list[bool] = []  # per open group: case-insensitive
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        fold = bool(folding) and folding[-1]
        if c == "\\":
            if not in_class and pattern[i + 1:i + 2] in ("A", "z", "Z", "G", "b", "B"):
                return f"the split regex has an anchor or word boundary (\\{pattern[i + 1]})"
            m = _ESCAPE_RE.match(pattern, i)
            if m is None:
                return f"the split regex has an escape the engines read differently ({pattern[i:i + 2]!r})"
            esc = m.group()
            code = int(esc[2:], 16) if esc[1] in "xu" else (ord(esc[1]) if len(esc) == 2 else 0)
            if fold and code > 0x7F:
                return "a case-insensitive group of the split regex holds a non-ASCII character"
            i = m.end()
            continue
        if fold and ord(c) > 0x7F:
            return "a case-insensitive group of the split regex holds a non-ASCII character"
        if in_class:
            if c == "]":
                in_class = False
            elif c == "[" or pattern.startswith("&&", i):
                return "the split regex has a nested class or a class intersection"
            i += 1
            continue
        if c == "[":
            in_class = True
            i += 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):
                return "the split regex has a class opening with ']'"
            continue
        if c in "^$":
            return f"the split regex has an anchor ({c}), which the engines read differently"
        if c == "(":
            m = _GROUP_RE.match(pattern, i) if pattern.startswith("(?", i) else None
            if pattern.startswith("(?", i) and m is None:
                return f"the split regex has a group or flag this path does not take ({pattern[i:i + 4]}...)"
            folding.append(fold or (m is not None and m.group() == "(?i:"))
            i = m.end() if m is not None else i + 1
            continue
        if c == ")" and leading and pattern[i + 1:i + 2] in ("*", "+", "?", "{"):
            return "a leading split regex repeats a group (Python's regex has no backtracking limit)"
        if c == ")" and folding:
            folding.pop()
        elif c == "{" and (m := _COUNTED_RE.match(pattern, i)) and pattern[m.end():m.end() + 1] in ("?", "+"):
            return "the split regex has a counted repetition followed by '?' or '+' (Ruby syntax reads it otherwise)"
        i += 1
    return None


def _parts(backend: Any) -> tuple[str | None, tuple]:
    """``(None, (encoding, special, normalized, wrap, leading))`` or ``(reason, ())``: ``leading``
    the compiled Split regexes before tiktoken's."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"the model is {model.get('type')!r}, not BPE", ()
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        return "the BPE model has dropout, byte fallback or subword affixes", ()
    reason = _normalizer_unsupported_reason(spec.get("normalizer"))
    if reason is not None:
        return reason, ()
    patterns, reason = _split_patterns(spec.get("pre_tokenizer"))
    for k, pattern in enumerate(patterns):
        reason = reason or _regex_unsupported_reason(pattern, leading=k < len(patterns) - 1)
    if reason is not None:
        return reason, ()
    *leading, pattern = patterns
    try:
        leading_res = [regex.compile(p) for p in leading]
    except regex.error as exc:
        return f"a leading split regex does not compile in Python's regex ({exc})", ()
    if any(r.search("") is not None for r in leading_res):
        return "a leading split regex matches the empty string", ()
    cut = cache_unsupported_reason(backend)
    if cut is not None and cut != NO_CUTS:
        return cut, ()
    vocab: dict[str, int] = model["vocab"]
    merges = _merge_pairs(model.get("merges") or [])
    to_char = _byte_to_char()
    from_char = {c: b for b, c in to_char.items()}
    if any(c not in vocab for c in to_char.values()):
        return "a byte of the ByteLevel alphabet is not in the vocabulary", ()
    last = -1
    for a, b in merges:
        result = vocab.get(a + b)
        if result is None:
            return f"merge {a!r} {b!r} makes no vocabulary token", ()
        if result < last:
            return f"merge results' ids decrease along the merge list (at {a + b!r})", ()
        last = result
    # without ignore_merges a token that is neither a byte nor a merge's result never comes out of
    # tokenizers' BPE (an added token's entry, say): tiktoken is not given it either
    whole = not model.get("ignore_merges")
    made = {a + b for a, b in merges}
    kept = {tok: i for tok, i in vocab.items() if len(tok) == 1 or not whole or tok in made}
    try:
        ranks = {bytes(from_char[c] for c in tok): i for tok, i in kept.items()}
    except KeyError:
        return "a vocabulary token has a character outside the ByteLevel alphabet", ()
    if len(ranks) != len(kept):
        return "two vocabulary tokens have the same bytes", ()
    lone = tk_models.BPE(vocab=vocab, merges=merges, ignore_merges=False)
    for tok in kept:
        if len(tok) < 2:
            continue
        n = len(lone.tokenize(tok))
        if n == 2 or (whole and n != 1):
            return f"token {tok!r} is not what BPE makes of its own bytes", ()
    try:
        encoding = tiktoken.Encoding("kvroute", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    except Exception as exc:  # noqa: BLE001 - fancy-regex refusing the pattern, say
        return f"tiktoken refuses the tokenizer ({exc})", ()
    added = backend.get_added_tokens_decoder()
    special = {t.content: i for i, t in added.items() if not t.normalized and t.content}
    # tokenizers matches a normalized added token's normalized content in the normalized text:
    # "ﬁ" under NFKC is found as "fi" in ASCII text, so both forms send a piece to tokenizers
    norm = backend.normalizer
    normalized = sorted({form for t in added.values() if t.normalized and t.content
                         for form in (t.content, norm.normalize_str(t.content) if norm is not None else "") if form})
    wrap = special_wrap(backend, next(iter(special), "a"))
    return None, (encoding, special, normalized, wrap, leading_res)


def _normalizer_unsupported_reason(normalizer: dict[str, Any] | None) -> str | None:
    """None when the normalizer leaves ASCII text unchanged: none, a Unicode normal form, or a
    Sequence of those (an empty one included)."""
    if normalizer is None:
        return None
    kind = normalizer.get("type")
    if kind == "Sequence":
        for step in normalizer.get("normalizers") or []:
            reason = _normalizer_unsupported_reason(step)
            if reason is not None:
                return reason
        return None
    if kind in _ASCII_STABLE_NORMALIZERS:
        return None
    return f"normalizer {kind!r} (only none and the Unicode normal forms leave ASCII unchanged)"


__all__ = ["FastBPE", "GPT2_PATTERN", "fast_bpe_unsupported_reason"]
