"""Token ids of text prefixes, cached at special-token boundaries so a request pays only for its new text.

Multi-turn chat re-sends the whole history every turn; the chat template renders it to the same text
as last turn plus a tail, and tokenizing that text again is most of the gateway's CPU per request.
:class:`PrefixTokenCache` wraps one HF fast tokenizer (``tokenizers.Tokenizer``) and returns exactly
``tokenizer.encode(text, add_special_tokens).ids`` while encoding only the part of ``text`` past the
longest prefix it has seen before.

Why a cut is exact
------------------
The token ids of a prefix of a text are not in general a prefix of the text's ids (BPE merges and
the pre-tokenizer's regex look across any cut). The cache therefore only cuts where the tokenizer
itself cuts. ``tokenizers`` (``Tokenizer::encode`` -> ``AddedVocabulary::extract_and_normalize``
in ``tokenizers/src/tokenizer/added_vocabulary.rs``, read at 0.23) first splits the raw text on the
*non-normalized* added tokens (the chat markers ``<|im_start|>``, ``<|eot_id|>``, ...) with a
leftmost-longest Aho-Corasick scan; every piece between them is then normalized, split on the
normalized added tokens, pre-tokenized and run through the model on its own, and the ids are the
pieces' ids in order. Nothing crosses a piece boundary; the one thing a piece's ids may depend on
besides its text is whether it starts the whole input (a ``Metaspace`` ``prepend_scheme="first"``).

Take a text ``X`` and a position ``p`` (``0 < p < len(X)``) such that

(a) a non-normalized added token ``t`` occurs at ``p`` (``X.startswith(t, p)``), and
(b) no occurrence of any non-normalized added token starts before ``p`` and ends after it.

By (b) every occurrence lies wholly in ``X[:p]`` or wholly in ``X[p:]``, so the leftmost-longest
scan of ``X`` picks exactly the matches of ``X[:p]`` plus those of ``X[p:]`` (a left-to-right scan
never sees an occurrence that straddles ``p``); by (a) the scan of ``X[p:]`` picks a match at its
start, so ``p`` is a piece boundary of ``X``. The pieces of ``X`` are the pieces of ``X[:p]``
followed by those of ``X[p:]``; the first piece of ``X[p:]`` is the added token itself (never
normalized nor pre-tokenized), so no piece changes whether it starts the input. Hence::

    encode(X, add_special_tokens=False) == encode(X[:p], False) + encode(X[p:], False)

The cache checks (a) and (b) on the *current* request's text at every cut it uses, so cached ids of
``X[:p]`` (from any earlier text with the same prefix) are combined only where the identity holds.
It applies when no non-normalized added token is ``lstrip``/``rstrip``/``single_word`` (those look
at neighbouring characters), ``encode_special_tokens`` is off, there is no truncation or padding,
and the model is deterministic (BPE without dropout); otherwise :func:`cache_unsupported_reason`
says why and the caller encodes without a cache. ``add_special_tokens=True`` adds the
post-processor's fixed ids around the text's ids (``TemplateProcessing``, ``BertProcessing``,
``RobertaProcessing``, ``ByteLevel``): found once by probing, applied around the cached result.

Plain text (a completions prompt without special tokens) has no such cut, so it is encoded whole
unless it repeats exactly (a verified overlap window would only be a heuristic: the pre-tokenizer's
regex and BPE merges may look arbitrarily far); a completions prompt that contains special tokens
is cut like a chat. Most plain texts are never sent twice, and storing one costs more than its
lookup (the ids copied into the cache's shared ints, the entry, an eviction), so a plain text is
stored at its second sighting: the digests of the last :data:`SEEN_ONCE_MAX` plain texts seen once
are kept, and only a text among them is stored (from its third sighting on it is a hit).

Structure
---------
Keys are a 128-bit BLAKE2b digest of the UTF-8 text prefix ``X[:p]`` (computed in one streaming
pass over the text, a copy of the hash state at each candidate cut). An entry holds the ids of one
segment ``X[q:p]`` and the key of ``X[:q]`` (its parent; None when ``q == 0``); the ids of a
prefix are its chain's segments concatenated, so a conversation's turns share their history and a
10-turn chat holds its tokens once. Segments are tuples of ``int`` objects shared by the whole
cache (one per vocabulary id), so an id held costs 8 bytes and a hit copies references. Cuts are
stored at most every ``min_segment_chars`` characters, always at the last special token (where the
next turn continues) and at the end of the text (an identical text is then not encoded at all).
Memory is bounded by ``max_tokens``: each entry counts its ids plus :data:`ENTRY_OVERHEAD_TOKENS`,
the least recently used go first, and a request's whole chain is touched root last, so an entry is
evicted before its ancestors. A digest collision (two
different prefixes with one key) has probability about ``n**2 / 2**129`` for ``n`` distinct
prefixes looked up: negligible, and the only way a wrong id could come out.

Thread-safe: encoding runs outside the lock; the lock guards the map and the counters.
"""
from __future__ import annotations

import functools
import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_TOKENS = 2_000_000
ENTRY_OVERHEAD_TOKENS = 32  # ~250 bytes measured (map slot, key, entry, tuple header), in 8-byte units
DEFAULT_MIN_TEXT_CHARS = 512  # shorter texts encode in ~0.05 ms: a lookup would save nothing
SEEN_ONCE_MAX = 4096  # plain texts remembered (by digest, 16 bytes) until they are seen again
DEFAULT_MIN_SEGMENT_CHARS = 256
_KEY_BYTES = 16
_KNOWN_POST_PROCESSORS = {"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel"}


NO_CUTS = "no non-normalized added tokens to cut at"  # cache_unsupported_reason: nothing to cut at, nothing wrong


class UnsupportedTokenizer(ValueError):
    """The tokenizer's pipeline can look across a special token, so cuts there are not exact."""


@dataclass(frozen=True)
class TokenCacheStats:
    """Counters of a :class:`PrefixTokenCache` since it was made.

    ``hits``: encodes that reused a cached prefix; ``misses``: encodes that found none (texts
    shorter than ``min_text_chars`` are not looked up and not counted); ``fallbacks``: encodes whose
    longest cached prefix failed the junction check on the new text and were encoded whole;
    ``hit_tokens``: ids taken from the cache instead of encoded; ``entries``, ``cached_tokens``
    (ids held, without overhead), ``size_tokens`` (what the bound counts) and ``max_tokens``.
    """

    hits: int
    misses: int
    fallbacks: int
    hit_tokens: int
    entries: int
    cached_tokens: int
    size_tokens: int
    max_tokens: int


class _Entry:
    """One cached segment: ids of ``X[q:p]`` keyed by ``X[:p]``; ``parent`` is the key of ``X[:q]``."""

    __slots__ = ("parent", "ids")

    def __init__(self, parent: bytes | None, ids: tuple[int, ...]) -> None:
        self.parent = parent
        self.ids = ids


def cache_unsupported_reason(backend: Any) -> str | None:
    """Why ``backend`` (a ``tokenizers.Tokenizer``) cannot be cut at special tokens exactly, or None.

    See the module docstring for the conditions; a tokenizer without non-normalized added tokens
    has nothing to cut at."""
    if backend.truncation is not None or backend.padding is not None:
        return "truncation or padding is set on the tokenizer"
    if getattr(backend, "encode_special_tokens", False):
        return "encode_special_tokens is on"
    if getattr(backend.model, "dropout", None):
        return "the BPE model has dropout"
    raw = [t for t in backend.get_added_tokens_decoder().values() if not t.normalized and t.content]
    if not raw:
        return NO_CUTS
    odd = [t.content for t in raw if t.lstrip or t.rstrip or t.single_word]
    if odd:
        return f"added tokens with lstrip/rstrip/single_word: {odd[:5]}"
    return None


def encode_ids(backend: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """``[backend.encode(t, add_special_tokens=...).ids for t in texts]`` for a
    ``tokenizers.Tokenizer``, through ``encode_batch_fast`` where the library has it (tokenizers
    >= 0.21): the same pipeline and ids without the per-token offsets, which nothing here reads.
    Raises what the tokenizer raises."""
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None:
        return [backend.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]
    return [e.ids for e in fast(texts, add_special_tokens=add_special_tokens)]


class PrefixTokenCache:
    """Exact ``backend.encode(text, add_special_tokens).ids`` with prefixes cached at special tokens.

    ``backend``: a ``tokenizers.Tokenizer`` (``PreTrainedTokenizerFast.backend_tokenizer``);
    ``max_tokens``: the bound on cached ids plus :data:`ENTRY_OVERHEAD_TOKENS` per entry (about 8
    bytes each, measured: 2M tokens ~ 16 MB); ``min_text_chars``: texts shorter than this are
    encoded directly; ``min_segment_chars``: the least distance between two stored cuts (the last
    special token and the end of the text are stored regardless); ``encoder``: what encodes the
    text past a cached prefix, ``(texts, add_special_tokens) -> ids per text``, the same ids as
    :func:`encode_ids` on ``backend`` (default: that; :class:`kvcore.bpe_fast.FastBPE`'s
    ``encode_many`` where it applies). Raises :class:`UnsupportedTokenizer` when
    :func:`cache_unsupported_reason` gives a reason. Safe to call from many threads.
    """

    def __init__(self, backend: Any, max_tokens: int = DEFAULT_MAX_TOKENS,
                 min_text_chars: int = DEFAULT_MIN_TEXT_CHARS,
                 min_segment_chars: int = DEFAULT_MIN_SEGMENT_CHARS,
                 encoder: Callable[[list[str], bool], list[list[int]]] | None = None) -> None:
        reason = cache_unsupported_reason(backend)
        if reason is not None:
            raise UnsupportedTokenizer(reason)
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self._backend = backend
        self._encode = encoder or functools.partial(encode_ids, backend)
        self.max_tokens = max_tokens
        self.min_text_chars = min_text_chars
        self.min_segment_chars = max(1, min_segment_chars)
        raw = sorted({t.content for t in backend.get_added_tokens_decoder().values()
                      if not t.normalized and t.content}, key=lambda s: (-len(s), s))
        self._anchor_re = added_tokens_re(raw)
        # proper prefix -> the tokens it starts: an occurrence straddling p has one of these ending at p
        straddle: dict[str, list[str]] = {}
        for s in raw:
            for k in range(1, len(s)):
                straddle.setdefault(s[:k], []).append(s)
        self._straddle = {k: tuple(v) for k, v in straddle.items()}
        self._max_token_chars = max(len(s) for s in raw)
        self._wrap = special_wrap(backend, raw[0])
        self._ints = list(range(backend.get_vocab_size(with_added_tokens=True)))
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._seen_once: OrderedDict[bytes, None] = OrderedDict()  # plain texts' digests (docstring)
        self._size_tokens = 0
        self._cached_tokens = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._fallbacks = self._hit_tokens = 0

    # ---- public -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``backend.encode(text, add_special_tokens=...).ids``, exactly; raises what the tokenizer
        raises. Ids are ``int`` in ``0..2**32-1``."""
        if add_special_tokens and self._wrap is None:
            return self._encode([text], True)[0]
        if len(text) < self.min_text_chars or self.max_tokens == 0:
            return self._encode([text], add_special_tokens)[0]
        ids = self._encode_raw(text)
        if add_special_tokens:
            head, tail = self._wrap  # type: ignore[misc]
            return head + ids + tail if (head or tail) else ids
        return ids

    def is_safe_cut(self, text: str, pos: int) -> bool:
        """True when ``encode(text) == encode(text[:pos]) + encode(text[pos:])`` is guaranteed:
        conditions (a) and (b) of the module docstring hold at ``pos`` (a character index)."""
        if pos <= 0 or pos >= len(text):
            return False
        m = self._anchor_re.match(text, pos)
        return m is not None and not self._straddles(text, pos)

    def stats(self) -> TokenCacheStats:
        """The counters and the current size."""
        with self._lock:
            return TokenCacheStats(self._hits, self._misses, self._fallbacks, self._hit_tokens,
                                   len(self._entries), self._cached_tokens, self._size_tokens,
                                   self.max_tokens)

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self._seen_once.clear()
            self._size_tokens = self._cached_tokens = 0

    # ---- internals ----------------------------------------------------------------------------
    def _straddles(self, text: str, pos: int) -> bool:
        """Condition (b) fails: an added token occurs starting before ``pos`` and ending after it."""
        table = self._straddle
        for k in range(1, min(self._max_token_chars - 1, pos) + 1):
            starts = table.get(text[pos - k:pos])
            if starts is not None:
                for s in starts:
                    if len(s) > k and text.startswith(s, pos - k):
                        return True
        return False

    def _encode_raw(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens added, through the cache."""
        cuts = [m.start() for m in self._anchor_re.finditer(text) if m.start() > 0]
        cuts.append(len(text))  # the whole text: an identical text is a hit with nothing to encode
        keys: list[bytes] = []
        h = hashlib.blake2b(digest_size=_KEY_BYTES)
        prev = 0
        for pos in cuts:
            h.update(text[prev:pos].encode("utf-8", "surrogatepass"))
            keys.append(h.copy().digest())
            prev = pos

        # the longest cached prefix whose chain is whole
        base_i = -1
        segments: list[tuple[int, ...]] = []
        chain: list[bytes] = []
        with self._lock:
            entries = self._entries
            for i in range(len(keys) - 1, -1, -1):
                if keys[i] not in entries:
                    continue
                found = self._chain(keys[i])
                if found is None:  # an ancestor was evicted: this entry is of no use any more
                    self._drop(keys[i])
                    continue
                base_i, chain = i, found
                segments = [entries[k].ids for k in chain]
                break
        if base_i < 0 and len(cuts) == 1 and not self._second_sighting(keys[0]):
            return self._encode([text], False)[0]  # a plain text seen for the first time: not stored
        base_pos = cuts[base_i] if base_i >= 0 else 0
        if base_i >= 0 and base_pos < len(text) and self._straddles(text, base_pos):
            with self._lock:
                self._fallbacks += 1
            return self._encode([text], False)[0]

        out: list[int] = []
        for seg in segments:
            out.extend(seg)
        base_tokens = len(out)

        # cuts to store past the base: spaced out, plus the last special token and the end
        store: list[int] = []  # indexes into cuts
        last_pos = base_pos
        last_anchor = len(cuts) - 2
        for i in range(base_i + 1, len(cuts) - 1):
            pos = cuts[i]
            if (pos - last_pos >= self.min_segment_chars or i == last_anchor) and not self._straddles(text, pos):
                store.append(i)
                last_pos = pos
        if base_i < len(cuts) - 1:
            store.append(len(cuts) - 1)

        new: list[tuple[bytes, _Entry]] = []
        parent = keys[base_i] if base_i >= 0 else None
        bounds = [base_pos] + [cuts[i] for i in store]
        pieces = self._encode([text[a:b] for a, b in zip(bounds, bounds[1:])], False) if store else []
        for i, ids in zip(store, pieces):
            seg = self._shared(ids)
            out.extend(seg)
            new.append((keys[i], _Entry(parent, seg)))
            parent = keys[i]

        with self._lock:
            if base_i >= 0:
                self._hits += 1
                self._hit_tokens += base_tokens
            else:
                self._misses += 1
            entries = self._entries
            for key, entry in new:
                old = entries.pop(key, None)
                if old is not None:
                    self._account(old, -1)
                entries[key] = entry
                self._account(entry, +1)
            # most recent last; the root ends up the most recent, so leaves are evicted first
            for key in reversed(chain + [k for k, _ in new]):
                if key in entries:
                    entries.move_to_end(key)
            while self._size_tokens > self.max_tokens and entries:
                _, gone = entries.popitem(last=False)
                self._account(gone, -1)
        return out

    def _second_sighting(self, key: bytes) -> bool:
        """Whether the plain text of digest ``key`` (not in the cache) was seen once before, and
        so is to be stored now; otherwise it is remembered and counted as a miss."""
        with self._lock:
            seen = self._seen_once
            if key in seen:
                del seen[key]
                return True
            seen[key] = None
            if len(seen) > SEEN_ONCE_MAX:
                seen.popitem(last=False)
            self._misses += 1
            return False

    def _shared(self, ids: list[int]) -> tuple[int, ...]:
        """``ids`` as a tuple of the shared ``int`` objects of :attr:`_ints` (8 bytes per id held,
        and a hit copies references instead of making ints)."""
        try:
            return tuple(map(self._ints.__getitem__, ids))
        except IndexError:  # an id past the vocabulary size: keep the tokenizer's own ints
            return tuple(ids)

    def _chain(self, key: bytes) -> list[bytes] | None:
        """Keys from the root to ``key`` (lock held), None when an ancestor is missing."""
        entries = self._entries
        path = [key]
        parent = entries[key].parent
        while parent is not None:
            entry = entries.get(parent)
            if entry is None:
                return None
            path.append(parent)
            parent = entry.parent
            if len(path) > len(entries):  # a cycle: only a digest collision could make one
                return None
        path.reverse()
        return path

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._account(entry, -1)

    def _account(self, entry: _Entry, sign: int) -> None:
        self._cached_tokens += sign * len(entry.ids)
        self._size_tokens += sign * (len(entry.ids) + ENTRY_OVERHEAD_TOKENS)


def added_tokens_re(contents: Any) -> re.Pattern[str]:
    """A regex matching the added tokens ``contents`` as ``tokenizers`` finds them in raw text:
    leftmost, and the longest at a place (alternatives longest first)."""
    return re.compile("|".join(re.escape(s) for s in sorted(set(contents), key=lambda s: (-len(s), s))))


def special_wrap(backend: Any, anchor: str) -> tuple[list[int], list[int]] | None:
    """The fixed ids the post-processor puts before and after a text's ids when
    ``add_special_tokens=True``, found by probing; None when the post-processor is not one known to
    add only fixed ids, or the probes disagree (then such encodes bypass the cache)."""
    proc = backend.post_processor
    if proc is not None and type(proc).__name__ not in _KNOWN_POST_PROCESSORS:
        return None
    empty = backend.encode("", add_special_tokens=True).ids
    splits = set(range(len(empty) + 1))
    for probe in ("a", "hello world", f"x{anchor}y z", f"{anchor} {anchor}"):
        plain = backend.encode(probe, add_special_tokens=False).ids
        full = backend.encode(probe, add_special_tokens=True).ids
        splits &= {k for k in splits if empty[:k] + plain + empty[k:] == full}
    if len(splits) != 1:
        return None
    k = splits.pop()
    return list(empty[:k]), list(empty[k:])


__all__ = ["DEFAULT_MAX_TOKENS", "PrefixTokenCache", "TokenCacheStats", "UnsupportedTokenizer",
           "NO_CUTS", "added_tokens_re", "cache_unsupported_reason", "encode_ids", "special_wrap"]
