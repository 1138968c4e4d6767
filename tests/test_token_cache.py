"""The prefix token cache (kvcore/token_cache.py): cached ids equal the tokenizer's own, always.

Property tests render random multi-turn conversations with the project's chat templates (the tiny
fixture and the generated "small" model) and compare every turn's cached ids with a plain encode;
message texts are built from adversarial fragments (partial special tokens, partial words, spaces,
combining marks, emoji, scripts). Junctions the cache must refuse use a tokenizer whose extra added
tokens straddle the chat markers. Also: the memory bound, the add_special_tokens wrap, threads,
tokenizers the cache refuses, and the gateway's counter.
"""
from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

import kvcore.token_cache as token_cache
from kvcore.token_cache import ENTRY_OVERHEAD_TOKENS, PrefixTokenCache, UnsupportedTokenizer, encode_ids
from kvcore.tokenization import PromptTokenizer
from router.config.schema import ModelConfig
from router.route.prompt_blocks import TokenizerPool
from router.telemetry.metrics import GatewayMetrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

TINY = REPO / "tests/fixtures/tiny-model"
EXAMPLES = int(os.environ.get("KVR_TOKEN_CACHE_EXAMPLES", "150"))  # more for a long soak
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|im", "_start|>", "im_end|>", "<|", "|>", "<", ">", "<s>",
             "</s>", "</s", "s>", "<tool_call>", "</tool_call>", "tool_call>", "<tool_", " ", "  ", "   ",
             "\n", "\n\n", "\t", " \n ", "the", " the", "ing", "hel", "lo", "wor", "ld", "'s", "'t", "'ll",
             "é", "e\u0301", "ñ", "日本語", "中文", "한국어", "русский", "🚀", "👍🏽", "🇫🇷", "😀😀",
             "\u200b", "0", "12", "345", ".", ",", "!?", "{\"a\": 1}", "user", "assistant", "system"]


def _text(max_parts: int = 12):
    return st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=max_parts).map("".join)


def _conversation():
    """A list of (role, content) turns: optional system, then user/assistant alternating."""
    msg = st.tuples(st.sampled_from(["user", "assistant"]), _text())
    return st.tuples(st.one_of(st.none(), _text()), st.lists(msg, min_size=1, max_size=8))


@pytest.fixture(scope="module")
def small_model() -> Path:
    py = os.environ.get("KVR_VLLM_PYTHON") or str(REPO / ".venv-vllm/bin/python")
    return ensure_model("small", py)


@pytest.fixture(scope="module")
def tiny_tok() -> PromptTokenizer:
    return PromptTokenizer(TINY, cache_max_tokens=0)


@pytest.fixture(scope="module")
def small_tok(small_model) -> PromptTokenizer:
    return PromptTokenizer(small_model, cache_max_tokens=0)


def _plain(tok: PromptTokenizer, text: str, special: bool = False) -> list[int]:
    return tok._backend.encode(text, add_special_tokens=special).ids


def _bodies(system: str | None, turns: list[tuple[str, str]]) -> list[dict]:
    """One chat body per turn, as a client re-sends its growing history (plus a regenerate)."""
    msgs = [{"role": "system", "content": system}] if system is not None else []
    out = []
    for role, content in turns:
        msgs.append({"role": role, "content": content})
        out.append({"messages": list(msgs), "add_generation_prompt": role == "user"})
    return out


def _check_conversations(tok: PromptTokenizer, cache: PrefixTokenCache, conv) -> None:
    system, turns = conv
    for body in _bodies(system, turns):
        text = tok.render_chat(body)
        assert cache.encode(text, False) == _plain(tok, text), repr(text)
    assert cache.stats().size_tokens <= cache.max_tokens


# ---- the batch encoder gives the plain encoder's ids ---------------------------------------------
@SETTINGS
@given(texts=st.lists(_text(24), min_size=1, max_size=4), special=st.booleans())
def test_encode_ids_equals_plain_encode(tiny_tok, small_tok, texts, special):
    """encode_ids (encode_batch_fast: no offsets) returns what Tokenizer.encode(...).ids does, for
    both models' tokenizers, with and without the post-processor's special tokens, on texts mixing
    chat markers, unicode and whitespace; and PromptTokenizer.encode_text (no cache) goes through it."""
    for tok in (tiny_tok, small_tok):
        want = [_plain(tok, t, special) for t in texts]
        assert encode_ids(tok._backend, texts, special) == want
        assert [tok.encode_text(t, special) for t in texts] == want


# ---- exactness over random conversations ---------------------------------------------------------
@pytest.mark.parametrize("min_segment_chars", [1, 64])
def test_random_conversations_tiny(tiny_tok, min_segment_chars):
    cache = PrefixTokenCache(tiny_tok._backend, min_text_chars=0, min_segment_chars=min_segment_chars)

    @SETTINGS
    @given(_conversation())
    def check(conv):
        _check_conversations(tiny_tok, cache, conv)

    check()
    st_ = cache.stats()
    assert st_.hits > 0 and st_.misses > 0 and st_.fallbacks == 0


def test_random_conversations_small_with_tools(small_tok):
    cache = PrefixTokenCache(small_tok._backend, min_text_chars=0, min_segment_chars=8)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <|im_end|>",
                                               "parameters": {"type": "object"}}}]

    @SETTINGS
    @given(_conversation(), st.booleans())
    def check(conv, with_tools):
        system, turns = conv
        for body in _bodies(system, turns):
            if with_tools:
                body["tools"] = tools
            text = small_tok.render_chat(body)
            assert cache.encode(text, False) == _plain(small_tok, text), repr(text)
            # completions-style: BOS from the post-processor around the cached ids
            assert cache.encode(text, True) == _plain(small_tok, text, True), repr(text)

    check()
    assert cache.stats().hits > 0


def test_long_conversation_each_turn_hits(tiny_tok):
    """A 10-turn chat: after the first turn every turn reuses the history and encodes only its tail."""
    cache = PrefixTokenCache(tiny_tok._backend)
    rnd = random.Random(3)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    msgs = [{"role": "system", "content": "You are terse. " * 20}]
    for turn in range(10):
        msgs.append({"role": "user", "content": " ".join(rnd.choice(words) for _ in range(200))})
        text = tiny_tok.render_chat({"messages": msgs})
        ids = cache.encode(text, False)
        assert ids == _plain(tiny_tok, text)
        msgs.append({"role": "assistant", "content": " ".join(rnd.choice(words) for _ in range(80))})
        st_ = cache.stats()
        assert (st_.hits, st_.misses) == (turn, 1)
    last_before = cache.stats().hit_tokens
    assert cache.encode(text, False) == ids  # the identical text: every id from the cache
    assert cache.stats().hit_tokens - last_before == len(ids)


@pytest.mark.parametrize("left,right", [
    ("hel", "lo"), ("the", " cat"), (" ", " "), ("\n", "\n"), ("é", "\u0301"), ("🚀", "🚀"), ("<|im", "_end|>"),
    ("<", "|im_start|>"), ("</s", ">"), ("'", "s"), ("日本", "語"), ("", ""), ("a", "<|im_end|>b"),
])
def test_adversarial_junctions(tiny_tok, left, right):
    """Messages ending and starting with pieces that would merge across a cut."""
    cache = PrefixTokenCache(tiny_tok._backend, min_text_chars=0, min_segment_chars=1)
    msgs = [{"role": "user", "content": "x" + left}, {"role": "assistant", "content": right + "y" + left}]
    for k in range(1, 4):
        msgs.append({"role": "user", "content": right * k + left})
        text = tiny_tok.render_chat({"messages": msgs})
        assert cache.encode(text, False) == _plain(tiny_tok, text)
        assert cache.encode(text + right, False) == _plain(tiny_tok, text + right)


# ---- junctions the cache must refuse -------------------------------------------------------------
def _overlapping_tokenizer() -> Tokenizer:
    """The tiny tokenizer plus added tokens that straddle or extend the chat markers."""
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    tok.add_special_tokens(["|><|im_start|>assistant", "a<|im_start|>", "<|im_start|>user", "end|>x"])
    return tok


def test_straddling_token_counts_a_fallback_and_stays_exact():
    tok = _overlapping_tokenizer()
    cache = PrefixTokenCache(tok, min_text_chars=0, min_segment_chars=1)
    head = "<|im_start|>system\nbe brief<|im_end|>"
    first = head + "<|im_start|>tool\nok"
    assert cache.encode(first, False) == tok.encode(first, add_special_tokens=False).ids
    pos = len(head)
    assert cache.is_safe_cut(first, pos)
    # the same prefix, but now "|><|im_start|>assistant" occurs across the cut
    second = head + "<|im_start|>assistant\nsure"
    assert not cache.is_safe_cut(second, pos)
    before = cache.stats()
    assert cache.encode(second, False) == tok.encode(second, add_special_tokens=False).ids
    after = cache.stats()
    assert after.fallbacks == before.fallbacks + 1
    assert after.hits == before.hits


def test_overlapping_tokens_random_texts():
    tok = _overlapping_tokenizer()
    cache = PrefixTokenCache(tok, min_text_chars=0, min_segment_chars=1)
    extra = ["|><|im_start|>assistant", "a<|im_start|>", "<|im_start|>user", "end|>x", "end|>", "a", "x"]

    @SETTINGS
    @given(st.lists(st.lists(st.sampled_from(FRAGMENTS + extra), max_size=10).map("".join), min_size=1, max_size=6))
    def check(parts):
        text = ""
        for p in parts:  # a growing text, as turns re-send their history
            text += p
            assert cache.encode(text, False) == tok.encode(text, add_special_tokens=False).ids, repr(text)

    check()


# ---- bound, threads, wrap, refusal ---------------------------------------------------------------
def test_memory_bound_holds_and_lru_keeps_the_live_chain(tiny_tok):
    bound = 3000
    cache = PrefixTokenCache(tiny_tok._backend, max_tokens=bound, min_text_chars=0, min_segment_chars=32)
    rnd = random.Random(5)
    convs = [[{"role": "system", "content": f"conversation {c}"}] for c in range(12)]
    for step in range(8):
        for c, msgs in enumerate(convs):
            msgs.append({"role": "user" if step % 2 == 0 else "assistant",
                         "content": " ".join(rnd.choice(["cache", "block", "ünï", "🚀"]) for _ in range(30))})
            text = tiny_tok.render_chat({"messages": msgs})
            assert cache.encode(text, False) == _plain(tiny_tok, text)
            st_ = cache.stats()
            assert st_.size_tokens <= bound
            assert st_.size_tokens == st_.cached_tokens + st_.entries * ENTRY_OVERHEAD_TOKENS
    assert cache.stats().hits == 0  # 12 interleaved conversations do not fit: each was evicted
    # one conversation alone: after one miss it keeps hitting (its chain is the most recently used)
    msgs = convs[0]
    for turn in range(5):
        msgs.append({"role": "user", "content": "and then?"})
        text = tiny_tok.render_chat({"messages": msgs})
        before = cache.stats().hits
        assert cache.encode(text, False) == _plain(tiny_tok, text)
        assert cache.stats().hits == before + (turn > 0)
        assert cache.stats().size_tokens <= bound
    cache.clear()
    assert cache.stats().entries == cache.stats().size_tokens == 0


def test_a_plain_text_is_stored_at_its_second_sighting_and_hits_from_its_third(tiny_tok):
    """A completions prompt without special tokens has no cut: the first sighting encodes it and
    keeps only its digest, the second stores its ids, the third takes every id from the cache."""
    cache = PrefixTokenCache(tiny_tok._backend, min_text_chars=0)
    text = " ".join(f"word{i}" for i in range(300))
    want = _plain(tiny_tok, text)
    seen = []
    for _ in range(3):
        assert cache.encode(text, False) == want
        st_ = cache.stats()
        seen.append((st_.hits, st_.misses, st_.entries, st_.hit_tokens))
    assert seen == [(0, 1, 0, 0), (0, 2, 1, 0), (1, 2, 1, len(want))]
    # a chat (cut at its special tokens) is stored at its first sighting, as before
    chat = tiny_tok.render_chat({"messages": [{"role": "user", "content": text}]})
    assert cache.encode(chat, False) == _plain(tiny_tok, chat)
    assert cache.stats().entries > 1


def test_plain_texts_seen_once_are_remembered_within_a_bound(tiny_tok, monkeypatch):
    monkeypatch.setattr(token_cache, "SEEN_ONCE_MAX", 2)
    cache = PrefixTokenCache(tiny_tok._backend, min_text_chars=0)
    a, b, c = (f"text {name} " * 40 for name in "abc")
    for t in (a, b, c, a):  # a was forgotten when c came: its second sighting is a first one again
        assert cache.encode(t, False) == _plain(tiny_tok, t)
    assert cache.stats().entries == 0
    assert cache.encode(c, False) == _plain(tiny_tok, c)  # c is still remembered: stored now
    assert cache.stats().entries == 1
    cache.clear()
    assert cache.encode(a, False) == _plain(tiny_tok, a) and cache.stats().entries == 0


def test_zero_bound_caches_nothing(tiny_tok):
    cache = PrefixTokenCache(tiny_tok._backend, max_tokens=0, min_text_chars=0)
    text = tiny_tok.render_chat({"messages": [{"role": "user", "content": "hi " * 50}]})
    assert cache.encode(text, False) == cache.encode(text, False) == _plain(tiny_tok, text)
    assert cache.stats().entries == 0


def test_threads_share_one_cache(tiny_tok):
    cache = PrefixTokenCache(tiny_tok._backend, max_tokens=20_000, min_text_chars=0, min_segment_chars=16)
    rnd = random.Random(9)
    texts = []
    for c in range(6):
        msgs = [{"role": "system", "content": "shared system prompt " * 10}]
        for t in range(6):
            content = f"c{c} t{t} " + " ".join(rnd.choice(["a", "bb", "é"]) for _ in range(40))
            msgs.append({"role": "user", "content": content})
            texts.append(tiny_tok.render_chat({"messages": msgs}))
            msgs.append({"role": "assistant", "content": "ok " * rnd.randint(1, 20)})
    want = {t: _plain(tiny_tok, t) for t in texts}
    errors: list[str] = []

    def work(seed: int) -> None:
        order = list(texts) * 3
        random.Random(seed).shuffle(order)
        for t in order:
            if cache.encode(t, False) != want[t]:
                errors.append(t)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    st_ = cache.stats()
    assert st_.hits + st_.misses + st_.fallbacks == 4 * 3 * len(texts)
    assert st_.size_tokens <= 20_000


def test_refuses_tokenizers_it_cannot_cut_exactly(tiny_tok):
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
    with pytest.raises(UnsupportedTokenizer, match="lstrip"):
        PrefixTokenCache(tok)
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    tok.enable_truncation(16)
    with pytest.raises(UnsupportedTokenizer, match="truncation"):
        PrefixTokenCache(tok)


def test_prompt_tokenizer_uses_the_cache(small_model, small_tok):
    cached = PromptTokenizer(small_model)
    assert cached.token_cache is not None and small_tok.token_cache is None
    msgs = [{"role": "system", "content": "Be exact. " * 80}, {"role": "user", "content": "first"}]
    cached.encode_chat({"messages": msgs})
    msgs += [{"role": "assistant", "content": "one"}, {"role": "user", "content": "second"}]
    assert cached.encode_chat({"messages": msgs}) == small_tok.encode_chat({"messages": msgs})
    prompt = {"prompt": "<|im_start|>user\n" + "long text " * 100}
    assert cached.encode_completion(prompt) == small_tok.encode_completion(prompt)
    assert cached.cache_stats().hits >= 1


def test_pool_counts_and_gateway_exports_them(tiny_model):
    pool = TokenizerPool([ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=16)], threads=1)
    asyncio.run(pool.load())
    metrics = GatewayMetrics(lambda: [])
    metrics.watch_tokenize_cache(pool.cache_totals)
    metrics.watch_tokenize_engines(pool.engine_totals)
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=16)
    try:
        plain = PromptTokenizer(tiny_model, cache_max_tokens=0)
        msgs = [{"role": "user", "content": "tell me a long story " * 60}]
        first = asyncio.run(pool.prompt_blocks(model, "chat", {"messages": msgs}))
        assert first.token_ids == [plain.encode_chat({"messages": msgs})]
        msgs += [{"role": "assistant", "content": "once"}, {"role": "user", "content": "more"}]
        second = asyncio.run(pool.prompt_blocks(model, "chat", {"messages": msgs}))
        assert second.token_ids == [plain.encode_chat({"messages": msgs})]
        assert pool.cache_totals() == {"hit": 1, "miss": 1, "fallback": 0}
        text = metrics.exposition().decode()
        assert 'kvroute_tokenize_cache_total{result="hit"} 1.0' in text
        assert 'kvroute_tokenize_cache_total{result="fallback"} 0.0' in text
        # the fixture is a byte-level BPE kvcore.bpe_fast applies to; the chats are ASCII
        engines = pool.engine_totals()
        assert engines["tiktoken"] > 0 and engines["tokenizers"] == 0
        assert f'kvroute_tokenize_pieces_total{{engine="tiktoken"}} {float(engines["tiktoken"])}' in text
        asyncio.run(pool.prompt_blocks(model, "completion", {"prompt": "caf\u00e9 " * 200}))
        assert pool.engine_totals() == {"tiktoken": engines["tiktoken"], "tokenizers": 1}
    finally:
        pool.close()
    off = TokenizerPool([model], threads=1, cache_max_tokens=0)
    asyncio.run(off.load())
    try:
        assert off.tokenizer("tiny").token_cache is None
        assert off.cache_totals() == {"hit": 0, "miss": 0, "fallback": 0}
    finally:
        off.close()
