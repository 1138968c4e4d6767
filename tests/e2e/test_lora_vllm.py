"""LoRA adapters on real vLLM: both e2e workers serve the generated model and two generated
adapters (``kvroute up --lora-modules``). A prompt on adapter ``sql`` is credited only to ``sql``:
its repeat goes to the holder, and vLLM reports exactly the predicted tokens as cached; the same
token ids on adapter ``chat`` or on the base model get no credit anywhere, and vLLM confirms none
was cached. Both indexes key the blocks by adapter: the gateway's (fed by vLLM's KV events) and the
agents' Redis (``kvroute agent``), whose keys for the adapter's blocks match the gateway's
``BlockExtras(lora_name="sql")`` keys and nothing without it. The three answers differ, so the
adapters were applied."""
from __future__ import annotations

from kvcore.block_keys import BlockExtras, block_keys
from kvcore.tokenization import PromptTokenizer

from .bodies import MODEL, words
from .conftest import BLOCK_SIZE, redis_match

from conftest import wait_until


def _body(model: str) -> dict:
    return {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": "LoRA check. " + words(300, 7100)},
                         {"role": "user", "content": words(8, 7101)}]}


def _send(cluster, model: str):
    body = _body(model)
    planned = cluster.explain(body)
    raw = cluster.openai().chat.completions.with_raw_response.create(**body)
    return planned, raw.headers["x-kvroute-worker"], raw.parse()


def test_models_lists_the_adapters(cluster):
    cards = {c.id: c for c in cluster.openai().models.list().data}
    assert sorted(cards) == sorted(["chat", MODEL, "sql"])
    assert cards["sql"].model_extra["parent"] == MODEL and cards["sql"].model_extra["root"] == str(cluster.lora_dirs["sql"])


def test_an_adapter_is_credited_only_its_own_blocks(cluster):
    cluster.reset_prefix_caches()
    ids = PromptTokenizer(cluster.model_dir).encode_chat(_body("sql"))
    full = len(ids) // BLOCK_SIZE
    assert full >= 8
    hit = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE  # vLLM computes the prompt's last token again

    planned, worker, first = _send(cluster, "sql")
    assert (first.model, worker, first.usage.prompt_tokens) == ("sql", planned["chosen"], len(ids))
    assert planned["predicted_cached_tokens"] == first.usage.prompt_tokens_details.cached_tokens == 0

    lora_keys = block_keys(ids, BLOCK_SIZE, MODEL, BlockExtras(lora_name="sql"))
    base_keys = block_keys(ids, BLOCK_SIZE, MODEL)
    wait_until(lambda: redis_match(cluster.redis_url, lora_keys).get(worker), 30, "the agent's Redis entries")
    assert redis_match(cluster.redis_url, lora_keys)[worker].gpu == full
    assert sum(m.gpu for m in redis_match(cluster.redis_url, base_keys).values()) == 0
    wait_until(lambda: cluster.explain(_body("sql"))["predicted_cached_tokens"], 30, "the gateway's index entries")

    planned, again_worker, again = _send(cluster, "sql")
    assert (again_worker, planned["predicted_cached_tokens"]) == (worker, hit)
    assert again.usage.prompt_tokens_details.cached_tokens == hit
    assert again.choices[0].message.content == first.choices[0].message.content

    texts = {"sql": first.choices[0].message.content}
    for other in ("chat", MODEL):
        planned, _, answer = _send(cluster, other)
        assert answer.model == other and answer.usage.prompt_tokens == len(ids)
        assert planned["predicted_cached_tokens"] == 0
        assert [sum(c["matched_blocks"].values()) for c in planned["candidates"]] == [0, 0], planned
        assert answer.usage.prompt_tokens_details.cached_tokens == 0, other
        texts[other] = answer.choices[0].message.content
    assert len(set(texts.values())) == 3, texts  # each adapter changed the model's output
