"""Prompts with media: the render endpoint's answer, block keys with multimodal items (the gateway's
from a rendered prompt equal the agent's from vLLM's KV events), and the fallback to load when no
render endpoint answers. Real vLLM renders in ``tests/e2e/test_multimodal_vllm.py``."""
from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import msgspec
import pytest

from conftest import free_port, running_up
from kvcore.block_keys import BlockExtras, block_keys
from kvcore.kv_events.translate import EventTranslator
from kvcore.kv_events.wire import BlockStored, EventBatch, decode_batch
from router.route.render import RenderedPrompt, parse_rendered

BS, MODEL = 32, "vlm"
AUTH = {"Authorization": "Bearer mm-token"}


def answer(ids, hashes, places):
    return {"request_id": "x", "token_ids": ids, "features": {"mm_hashes": hashes, "mm_placeholders": places,
                                                               "kwargs_data": None, "mm_metadata": None}}


def test_render_answer_becomes_token_ids_and_items_in_prompt_order():
    ids = list(range(200))
    got = parse_rendered(answer(ids, {"image": ["b", "a"], "audio": ["c"]},
                                {"image": [{"offset": 120, "length": 64}, {"offset": 10, "length": 64}],
                                 "audio": [{"offset": 80, "length": 5}]}))
    assert got == RenderedPrompt(ids, (("a", 10, 64), ("c", 80, 5), ("b", 120, 64)))
    assert parse_rendered({"token_ids": [1, 2], "features": None}) == RenderedPrompt([1, 2], ())


@pytest.mark.parametrize("bad", [
    {"token_ids": []},
    {"token_ids": [1, -2]},
    answer([1] * 10, {"image": ["a"]}, {}),
    answer([1] * 10, {"image": ["a", "b"]}, {"image": [{"offset": 0, "length": 2}]}),
    answer([1] * 10, {"image": ["a"]}, {"image": [{"offset": 8, "length": 4}]}),  # past the prompt
    answer([1] * 10, {"image": [7]}, {"image": [{"offset": 0, "length": 4}]}),
    ["not", "an", "object"],
])
def test_render_answers_that_cannot_be_keyed_are_refused(bad):
    with pytest.raises(ValueError):
        parse_rendered(bad)


def vllm_extra_keys(media, n_blocks):
    """What vLLM 0.32 publishes per block (``to_event_extra_keys`` of
    ``generate_block_hash_extra_keys``): ``(identifier, item start - block start)`` for each item
    overlapping the block, in prompt order; None for a block without one."""
    out = []
    for b in range(n_blocks):
        lo, hi = b * BS, (b + 1) * BS
        items = [(ident, start - lo) for ident, start, length in media if start < hi and start + length > lo]
        out.append(tuple(items) or None)
    return out


@pytest.mark.parametrize("salt", [None, "tenant-1"])
def test_keys_from_kv_events_equal_the_gateways_keys_of_the_rendered_prompt(salt):
    rnd = random.Random(11)
    ids = [rnd.randrange(500) for _ in range(10 * BS + 7)]
    # an image from token 40 over 64 tokens (blocks 1-3), another from 130 over 64 (blocks 4-6),
    # a short audio clip inside block 7
    media = (("img-a", 40, 64), ("img-b", 130, 64), ("clip", 230, 5))
    gateway = block_keys(ids, BS, MODEL, BlockExtras(cache_salt=salt, mm_hashes=media))
    extra = vllm_extra_keys(media, 10)
    if salt is not None:  # vLLM puts the salt after the items, on block 0
        extra[0] = (*(extra[0] or ()), salt)
    # the worker publishes the blocks in two events, the second chained to the first
    tr = EventTranslator(MODEL, BS)
    hashes = list(range(100, 110))
    ops = tr.translate(EventBatch(0.0, [
        BlockStored(block_hashes=hashes[:5], parent_block_hash=None, token_ids=ids[:5 * BS], block_size=BS,
                    lora_id=None, medium="GPU", lora_name=None, extra_keys=[list(e) if e else None for e in extra[:5]]),
        BlockStored(block_hashes=hashes[5:], parent_block_hash=hashes[4], token_ids=ids[5 * BS:10 * BS],
                    block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[list(e) if e else None for e in extra[5:]])]))
    assert ops == [("store", "gpu", gateway)]
    # the same tokens with the first image swapped: equal up to block 1, where it starts
    swapped = block_keys(ids, BS, MODEL, BlockExtras(cache_salt=salt, mm_hashes=(("img-z", 40, 64),) + media[1:]))
    assert swapped[0] == gateway[0] and all(a != b for a, b in zip(swapped[1:], gateway[1:]))
    # and the text-only keys of the same ids differ from block 1 on
    plain = block_keys(ids, BS, MODEL, BlockExtras(cache_salt=salt))
    assert plain[0] == gateway[0] and plain[1] != gateway[1]


def test_recorded_vllm_render_and_kv_events_give_the_same_keys():
    """Real vLLM 0.32 frames: the render answer's keys are the keys the agent makes from the
    worker's KV events for that prompt, image blocks included."""
    recorded = json.loads((Path(__file__).parent / "fixtures" / "vlm_mm_events.json").read_text())
    rendered = parse_rendered(recorded["render"])
    (ident, start, length), = rendered.media
    assert (start, length) == (189, 67)  # the image's placeholder range, blocks 5-7
    gateway = block_keys(rendered.token_ids, BS, MODEL, BlockExtras(mm_hashes=rendered.media))
    tr = EventTranslator(MODEL, BS)
    ops = [op for b in recorded["batches"] for op in tr.translate(decode_batch(msgspec.msgpack.encode(b)))]
    assert ops == [("clear", None, []), ("store", "gpu", gateway)]
    assert gateway[:5] == block_keys(rendered.token_ids, BS, MODEL)[:5]  # text blocks before the image


@pytest.fixture(scope="module")
def sim_up(tmp_path_factory, tiny_model):
    with running_up("up", ["--workers", "1", "--model", str(tiny_model), "--served-model-name", "tiny",
                           "--port", str(free_port()), "--speedup", "50"],
                    tmp_path_factory.mktemp("mm-up"), {"KVROUTE_ADMIN_TOKEN": "mm-token"}) as base:
        yield base


def test_without_a_render_endpoint_media_prompts_fall_back_to_load_and_the_endpoint_rests(sim_up):
    body = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}

    def explain() -> dict:
        r = httpx.post(sim_up + "/admin/explain", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    first = explain()  # the simulator has no render endpoint: 404
    assert first["tokenization_fallback"] == "render_refused" and first["prompt_tokens"] is None
    # left alone for routing.render_retry_s: no second call
    assert explain()["tokenization_fallback"] == "multimodal"
    text_only = {"model": "tiny", "messages": [{"role": "user", "content": "what is this"}]}
    r = httpx.post(sim_up + "/admin/explain", json=text_only, headers=AUTH, timeout=30)
    assert r.json()["tokenization_fallback"] is None and r.json()["prompt_tokens"] > 0
