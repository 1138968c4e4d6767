"""kvcore.bpe_fast: tiktoken's ids equal tokenizers' own wherever FastBPE uses it, and a
tokenizer where they could differ is refused at build.

Tokenizers: the generated GPT-2-style fixture (ByteLevel with its regex, special chat markers), and
one trained here in the Llama 3 / Qwen 2 shape (NFC, a Split by a cl100k-style regex, then
ByteLevel without one, ``ignore_merges``). Texts: random mixes of ASCII letters, digits,
punctuation, every kind of ASCII whitespace and contractions, some with non-ASCII characters (those
pieces go to tokenizers), with and without the added tokens between them."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvcore.bpe_fast import FastBPE, fast_bpe_unsupported_reason
from kvcore.token_cache import PrefixTokenCache, encode_ids
from kvcore.tokenization import PromptTokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-model"
CL100K_LIKE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# DeepSeek V3's last split regex (its tokenizer.json): no \p{N}, the digits are cut off before it
DEEPSEEK_LIKE = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                 r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
WORDS = ["the", "cache", "block", "prefill", "decode", "router", "worker", "token", "It", "HTTP", "x", "42",
         "3.14", "don't", "we're", "they'll", "I'd", "you've", "I'm", "it's", "(a)", "[b]", "{c}", "#", "->", "==",
         "__init__", "self.x", "f(x)", "a_b", "CamelCase", "ALLCAPS", "1234567", "'", "''", "'s"]
SPACES = [" ", "  ", "\n", "\n\n", "\t", "\r\n", " \n ", "\x0b", "\x0c", "   \t"]
NON_ASCII = ["é", "naïve", "中文", "\u00a0", "—", "🙂", "\u2028", "Ω"]


def _texts(seed: int, n: int, non_ascii: float, specials: list[str]) -> list[str]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rnd.randint(1, 40)):
            r = rnd.random()
            if r < non_ascii:
                parts.append(rnd.choice(NON_ASCII))
            elif r < non_ascii + 0.05 and specials:
                parts.append(rnd.choice(specials))
            elif r < 0.45:
                parts.append(rnd.choice(SPACES))
            elif r < 0.55:
                parts.append(chr(rnd.randrange(128)))
            else:
                parts.append(rnd.choice(WORDS))
        out.append("".join(parts))
    return out


def _corpus() -> list[str]:
    return _texts(7, 400, 0.0, []) + ["The quick brown fox jumps over the lazy dog. " * 20]


@pytest.fixture(scope="module")
def gpt2_style() -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


@pytest.fixture(scope="module")
def llama3_style() -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(CL100K_LIKE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|begin_of_text|>", "<|eot_id|>"], show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    return tok


@pytest.fixture(scope="module")
def deepseek_style() -> Tokenizer:
    """DeepSeek V3's shape: an empty normalizer Sequence, Splits by digit runs of 1-3 and by CJK
    runs before the last regex, ByteLevel without a regex."""
    Regex = __import__("tokenizers").Regex
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(r"\p{N}{1,3}"), behavior="isolated", invert=False),
        pre_tokenizers.Split(pattern=Regex("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"), behavior="isolated",
                             invert=False),
        pre_tokenizers.Split(pattern=Regex(DEEPSEEK_LIKE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    return tok


@pytest.fixture(scope="module")
def nfkc_style(gpt2_style) -> Tokenizer:
    """The GPT-2-shaped fixture with an NFKC normalizer (as Anthropic's published tokenizer has)."""
    spec = json.loads(gpt2_style.to_str())
    spec["normalizer"] = {"type": "NFKC"}
    return Tokenizer.from_str(json.dumps(spec))


def _specials(tok: Tokenizer) -> list[str]:
    return [t.content for t in tok.get_added_tokens_decoder().values()]


@pytest.mark.parametrize("name", ["gpt2_style", "llama3_style", "deepseek_style", "nfkc_style"])
def test_fast_ids_equal_tokenizers_ids(name, request):
    tok = request.getfixturevalue(name)
    fast = FastBPE.build(tok)
    specials = _specials(tok)
    assert specials
    texts = _texts(1, 600, 0.0, specials) + _texts(2, 300, 0.08, specials)
    for add in (False, True):
        got = fast.encode_many(texts, add)
        want = encode_ids(tok, texts, add)
        bad = [t for t, g, w in zip(texts, got, want) if g != w]
        assert not bad, (name, add, bad[:1])
    # the ASCII pieces went through tiktoken, the others through tokenizers
    assert fast.fast_pieces > 1000 and fast.slow_pieces > 50
    assert sum(len(w) for w in want) > 20_000


def test_digit_runs_the_last_regex_does_not_match_are_one_bpe_run_each(deepseek_style):
    # DeepSeek's last regex has no \p{N}: a digit group cut off by the first Split is a piece
    # tokenizers keeps whole; tiktoken's split would drop it, so it is BPE'd on its own
    fast = FastBPE.build(deepseek_style)
    texts = ["1234567", "x = 42; y = 3.14159", "in 2026, 1000000 tokens", "a1b22c333d4444"]
    assert fast.encode_many(texts, False) == encode_ids(deepseek_style, texts, False)
    assert (fast.fast_pieces, fast.slow_pieces) == (4, 0)
    digits = [deepseek_style.id_to_token(i) for i in fast.encode_many(["1234567"], False)[0]]
    assert "".join(digits) == "1234567" and all(len(d) <= 3 for d in digits)  # cut 123|456|7 first


def test_non_ascii_text_is_left_to_tokenizers(gpt2_style):
    fast = FastBPE.build(gpt2_style)
    text = "caf\u00e9 au lait<|im_end|>plain ascii tail"
    assert fast.encode_many([text], False) == encode_ids(gpt2_style, [text], False)
    assert (fast.slow_pieces, fast.fast_pieces) == (1, 1)


def _bpe(vocab_tokens: list[str], merges: list[tuple[str, str]], **pre) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for t in vocab_tokens:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=pre.get("prefix", False), use_regex=True)
    return tok


def test_a_vocabulary_where_tiktoken_would_merge_an_unlisted_pair_is_refused():
    # "abc" is made from ("a", "bc"), but ("a", "b") ranks first: tokenizers stops at ["ab", "c"]
    tok = _bpe(["ab", "bc", "abc"], [("a", "b"), ("b", "c"), ("a", "bc")])
    assert [tok.id_to_token(i) for i in tok.encode("abc").ids] == ["ab", "c"]
    ranks = {t.encode(): i for t, i in tok.get_vocab().items()}  # these tokens are plain ASCII
    naive = tiktoken.Encoding("naive", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    assert naive.encode_ordinary("abc") == [tok.token_to_id("abc")]   # what the check guards against
    with pytest.raises(ValueError, match="'abc' is not what BPE makes of its own bytes"):
        FastBPE.build(tok)


def test_other_shapes_are_refused_with_the_reason(gpt2_style):
    spec = json.loads(gpt2_style.to_str())
    cases = {
        "adds a prefix space": lambda s: s["pre_tokenizer"].update(add_prefix_space=True),
        "normalizer 'Lowercase'": lambda s: s.update(normalizer={"type": "Lowercase"}),
        "normalizer 'Replace'": lambda s: s.update(normalizer={"type": "Sequence", "normalizers": [
            {"type": "NFKC"}, {"type": "Replace", "pattern": {"String": "a"}, "content": "b"}]}),
        "pre-tokenizer 'Whitespace'": lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
        "ids decrease": lambda s: s["model"]["merges"].reverse(),
        "dropout": lambda s: s["model"].update(dropout=0.1),
    }
    for reason, edit in cases.items():
        changed = json.loads(json.dumps(spec))
        edit(changed)
        got = fast_bpe_unsupported_reason(Tokenizer.from_str(json.dumps(changed)))
        assert got is not None and reason in got, (reason, got)
    assert fast_bpe_unsupported_reason(gpt2_style) is None


def test_prompt_tokenizer_encodes_through_it_with_the_prefix_cache(gpt2_style):
    tok = PromptTokenizer(FIXTURE)
    assert tok.fast_bpe is not None and tok.token_cache is not None
    body = {"messages": [{"role": "system", "content": "You route requests. " * 40},
                         {"role": "user", "content": "Where is block 7's prefix held?"}]}
    text = tok.render_chat(body)
    want = encode_ids(gpt2_style, [text], False)[0]
    assert tok.encode_chat(body) == want
    assert tok.encode_chat(body) == want                  # again, from the prefix cache
    assert tok.cache_stats().hits == 1
    before = tok.fast_bpe.fast_pieces
    longer = {"messages": body["messages"] + [{"role": "assistant", "content": "On worker w1."},
                                              {"role": "user", "content": "And the next turn's?"}]}
    assert tok.encode_chat(longer) == encode_ids(gpt2_style, [tok.render_chat(longer)], False)[0]
    assert tok.fast_bpe.fast_pieces > before              # only the new turn's text was encoded


def test_the_prefix_cache_takes_the_fast_encoder(gpt2_style):
    fast = FastBPE.build(gpt2_style)
    cache = PrefixTokenCache(gpt2_style, encoder=fast.encode_many, min_text_chars=0)
    text = "<|im_start|>user\n" + "hello there, " * 30 + "<|im_end|>"
    assert cache.encode(text, True) == encode_ids(gpt2_style, [text], True)[0]
    assert fast.fast_pieces >= 1


def _split_bpe(pattern: str) -> Tokenizer:
    """Byte alphabet plus "QQ" and "ZZ", split by ``pattern`` then ByteLevel without its regex."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["QQ"], vocab["ZZ"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Q", "Q"), ("Z", "Z")]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


@pytest.mark.parametrize("pattern, text", [(r"QQ$|\S|\s+", "QQ\nx"), (r"^QQ|\S|\s+", "x\nQQ")])
def test_a_split_regex_with_anchors_is_refused(pattern, text):
    # Oniguruma (tokenizers) anchors ^ and $ at every line break, fancy-regex (tiktoken) at the text's ends
    tok = _split_bpe(pattern)
    ranks = {t.encode(): i for t, i in tok.get_vocab().items() if t.isascii() and t.isprintable()}
    ranks.update({b"\n": tok.token_to_id("\u010a")})
    naive = tiktoken.Encoding("naive", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    assert naive.encode_ordinary(text) != tok.encode(text).ids
    with pytest.raises(ValueError, match="anchor"):
        FastBPE.build(tok)


def test_characters_a_split_regex_leaves_unmatched_are_not_lost():
    # "ZZZ": no alternative matches the first Z; tokenizers keeps it as a piece, tiktoken drops it
    tok = _split_bpe(r"[^Z]|Z(?!ZZ)|\s")
    fast = FastBPE.build(tok)
    assert fast.encode_many(["ZZZ", "aZZ b"], False) == encode_ids(tok, ["ZZZ", "aZZ b"], False)
    assert fast.encode_many(["ZZZ"], False) == [[tok.token_to_id("Z")] * 3]
    assert (fast.slow_pieces, fast.fast_pieces) == (2, 1)   # "ZZZ" twice through tokenizers


def test_a_split_regex_that_can_match_nothing_is_refused_not_a_crash():
    with pytest.raises(ValueError, match="tiktoken fails on the split regex"):
        FastBPE.build(_split_bpe(r"\w*|\s+|[^\w\s]"))   # tiktoken panics in Rust on an empty match


def _splits_bpe(patterns: list[str], merges: list[tuple[str, str]], normalizer=None) -> Tokenizer:
    """Byte alphabet plus ``merges``' results, Split by each of ``patterns`` in turn, then ByteLevel
    without its regex."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    Regex = __import__("tokenizers").Regex
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(pattern=Regex(p), behavior="isolated", invert=False) for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


# found by a helper trying to break the leading splits: each read otherwise by Oniguruma than by
# Python's regex (leading) or fancy-regex (last), and each gave other ids before it was refused
@pytest.mark.parametrize("leading, last, merge, text, reason", [
    ([r"(?i:\ufb01)"], r"\S+|\s+", ("i", "x"), "fix", "non-ASCII"),          # Oniguruma folds ﬁ to "fi"
    ([r"(?i:ß)"], r"\S+|\s+", ("s", "k"), "ssk", "non-ASCII"),                # and ß to "ss"
    ([r"q(?i)j|k"], r"\S+|\s+", ("k", "w"), "kw", "group or flag"),           # Ruby: q(?i:j|k)
    ([r"y\d{3}?"], r"\S+|\s+", ("y", "2"), "y2", "counted repetition"),        # Ruby: (?:\d{3})?
    ([r"\p{N}{1,3}+"], r"[^\p{N}\s]+|\s+", ("3", "5"), "1235", "counted repetition"),  # Ruby: (?:..{1,3})+
    ([r"[a-z&&[^q]]"], r"\S+|\s+", ("k", "w"), "kw", "class intersection"),
    ([r"\h+"], r"\S+|\s+", ("k", "f"), "kf", "escape"),                       # Oniguruma: a hex digit
    ([r"\N+"], r"\S+|\s+", ("k", "N"), "kN", "escape"),                       # Oniguruma: not a newline
    ([], r"(?i:\ufb01)|\S|\s+", ("f", "i"), "fix", "non-ASCII"),
    ([], r"x(?i)y|\S|\s+", ("q", "j"), "qj", "group or flag"),
    ([], r"\p{N}{1,3}+|[^\p{N}\s]+|\s+", ("3", "5"), "1235", "counted repetition"),
])
def test_regexes_the_engines_read_differently_are_refused(monkeypatch, leading, last, merge, text, reason):
    import kvcore.bpe_fast as bpe_fast

    tok = _splits_bpe([*leading, last], [merge])
    with pytest.raises(ValueError, match=reason):
        FastBPE.build(tok)
    monkeypatch.setattr(bpe_fast, "_regex_unsupported_reason", lambda pattern, leading=False: None)
    unchecked = FastBPE.build(tok)   # what the check prevents: other ids than tokenizers'
    assert unchecked.encode_many([text], False)[0] != encode_ids(tok, [text], False)[0]


def test_a_leading_split_that_could_backtrack_without_end_is_refused():
    # Python's regex has no backtracking limit: on "a" * 40 this runs for minutes (Oniguruma panics)
    with pytest.raises(ValueError, match="repeats a group"):
        FastBPE.build(_splits_bpe([r"(?:a|a)+b", r"\S+|\s+"], [("a", "b")]))


@pytest.mark.parametrize("normalizer, content, text", [
    (normalizers.NFKC(), "\ufb01", "xfiy"),        # the ligature ﬁ is "fi" after NFKC
    (normalizers.NFC(), "\u212aqz", "xKqzy"),       # the Kelvin sign is "K" after NFC
])
def test_a_normalized_added_token_is_found_by_its_normalized_form(normalizer, content, text):
    tok = _splits_bpe([r"\S+|\s+"], [("a", "b")], normalizer)
    tok.add_tokens([__import__("tokenizers").AddedToken(content, normalized=True)])
    fast = FastBPE.build(tok)
    want = encode_ids(tok, [text], False)[0]
    assert tok.token_to_id(content) in want             # tokenizers matched it in the ASCII text
    assert fast.encode_many([text], False)[0] == want
    assert (fast.fast_pieces, fast.slow_pieces) == (0, 1)
