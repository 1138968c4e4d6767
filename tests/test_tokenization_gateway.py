"""The gateway's tokenization step (router/route/prompt_blocks.py) against real vLLM's /tokenize answers in the
capture, and the block keys it derives (salt and LoRA mixed in, fallbacks, bad prompts)."""
from __future__ import annotations

import asyncio

import pytest

from kvcore.block_keys import BlockExtras, block_keys
from kvcore.tokenization import BadPrompt
from router.config.schema import ModelConfig
from router.route.prompt_blocks import TokenizerPool

BLOCK = 32


@pytest.fixture(scope="module")
def model(tiny_model) -> ModelConfig:
    return ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK, lora_adapters=["sql-lora"])


@pytest.fixture(scope="module")
def pool(model):
    p = TokenizerPool([model], threads=2)
    asyncio.run(p.load())
    yield p
    p.close()


def _run(coro):
    return asyncio.run(coro)


def _steps_with_tokens(capture):
    return [s for s in capture["steps"] if s.get("tokenize_response")]


def test_tokens_equal_real_vllm_tokenize(pool, model, capture):
    steps = _steps_with_tokens(capture)
    assert {s["name"] for s in steps} >= {"completion_A", "chat_1", "chat_2_multiturn", "completion_B_evicts"}
    for step, inline in ((s, inline) for s in steps for inline in (False, True)):  # pool thread, event loop
        kind = "chat" if step["path"] == "/v1/chat/completions" else "completion"
        got = _run(pool.prompt_blocks(model, kind, step["request"], inline=inline))
        want = step["tokenize_response"]["tokens"]
        assert got.fallback is None
        assert got.token_ids == [want], step["name"]
        assert got.prompt_tokens == step["tokenize_response"]["count"]
        assert got.keys == [block_keys(want, BLOCK, "tiny")]
        assert len(got.first_keys) == len(want) // BLOCK
    assert pool.engine_totals()["tiktoken"] > 0   # these ids came through kvcore.bpe_fast


def test_cache_salt_changes_every_key_from_block_0(pool, model, capture):
    step = next(s for s in capture["steps"] if s["name"] == "completion_salted")
    plain_step = next(s for s in capture["steps"] if s["name"] == "completion_A")
    salted = _run(pool.prompt_blocks(model, "completion", step["request"]))
    plain = _run(pool.prompt_blocks(model, "completion", plain_step["request"]))
    tokens = plain_step["tokenize_response"]["tokens"]
    assert salted.token_ids == plain.token_ids == [tokens]
    assert salted.keys == [block_keys(tokens, BLOCK, "tiny", BlockExtras(cache_salt="tenant-1"))]
    assert all(a != b for a, b in zip(salted.first_keys, plain.first_keys))


def test_lora_adapter_name_is_mixed_in_and_tagged(pool, model, capture):
    body = next(s for s in capture["steps"] if s["name"] == "completion_A")["request"]
    tokens = next(s for s in capture["steps"] if s["name"] == "completion_A")["tokenize_response"]["tokens"]
    lora = _run(pool.prompt_blocks(model, "completion", body, lora_name="sql-lora"))
    as_salt = _run(pool.prompt_blocks(model, "completion", {**body, "cache_salt": "sql-lora"}))
    assert lora.keys == [block_keys(tokens, BLOCK, "tiny", BlockExtras(lora_name="sql-lora"))]
    assert lora.first_keys[0] != as_salt.first_keys[0]


def test_completion_prompt_forms(pool, model):
    ids = list(range(5, 5 + 70))
    got = _run(pool.prompt_blocks(model, "completion", {"prompt": ids}))
    assert got.token_ids == [ids] and len(got.first_keys) == 2
    many = _run(pool.prompt_blocks(model, "completion", {"prompt": [ids, ids[:40]]}))
    assert many.token_ids == [ids, ids[:40]]
    assert many.keys == [block_keys(ids, BLOCK, "tiny"), block_keys(ids[:40], BLOCK, "tiny")]
    assert many.prompt_tokens == 110


@pytest.mark.parametrize("part, fallback", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "multimodal"),  # for vLLM to render
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "multimodal"),
    ({"type": "file", "file": {"file_data": "AAAA"}}, "unsupported_prompt"),
])
def test_media_and_other_parts_fall_back_without_failing(pool, model, part, fallback):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, part]}]}
    got = _run(pool.prompt_blocks(model, "chat", body))
    assert got.token_ids is None and got.keys == [] and got.fallback == fallback
    assert got.prompt_tokens is None


@pytest.mark.parametrize("kind,body", [
    ("chat", {"messages": []}),
    ("chat", {"messages": "hello"}),
    ("chat", {"messages": [{"content": "no role"}]}),
    ("completion", {"prompt": 42}),
    ("completion", {}),
    ("completion", {"prompt": [-1] + list(range(40))}),
    ("completion", {"prompt": "x", "cache_salt": 7}),
])
def test_bad_prompts_raise_bad_prompt(pool, model, kind, body):
    with pytest.raises(BadPrompt):
        _run(pool.prompt_blocks(model, kind, body))


def test_no_tokenizer_routes_by_load():
    m = ModelConfig(name="opaque", tokenizer=None, block_size=16)
    p = TokenizerPool([m])
    try:
        got = _run(p.prompt_blocks(m, "chat", {"messages": [{"role": "user", "content": "hi"}]}))
    finally:
        p.close()
    assert got.token_ids is None and got.fallback == "no_tokenizer"


def test_concurrent_tokenization_is_exact(pool, model, capture):
    """Many prompts at once through the pool threads give each its own exact tokens."""
    steps = _steps_with_tokens(capture)

    async def many():
        jobs = []
        for i in range(48):
            step = steps[i % len(steps)]
            kind = "chat" if step["path"] == "/v1/chat/completions" else "completion"
            jobs.append(pool.prompt_blocks(model, kind, step["request"]))
        return await asyncio.gather(*jobs)

    results = _run(many())
    for i, got in enumerate(results):
        assert got.token_ids == [steps[i % len(steps)]["tokenize_response"]["tokens"]]
