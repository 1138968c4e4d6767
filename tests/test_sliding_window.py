"""Hybrid models (full plus sliding-window attention): the window group's KV events become window
keys in the index, and the gateway credits a prefix only where vLLM's window rule lets it hit.

The recorded frames (``fixtures/hybrid_sw64_events.json``) are real vLLM 0.32 events of a generated
hybrid model (64-token window, block size 32) for five prompts with the cached tokens vLLM reported;
replaying them into the index must predict exactly those."""
from __future__ import annotations

import json
import random
import subprocess
import uuid
from pathlib import Path

import msgspec
import pytest
from conftest import kvroute_argv
from kv_replay_publisher import until

from kvcore.block_keys import block_keys
from kvcore.index.base import KVIndex
from kvcore.index.errors import IndexUnavailable
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex
from kvcore.index.redis_mirror import RedisMirrorIndex
from kvcore.kv_events.ingest import write_ops
from kvcore.kv_events.translate import EventTranslator
from kvcore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from kvcore.sliding_window import declared_window_tokens, window_blocks, window_hits, window_key, window_keys
from router.config.schema import ModelConfig
from router.route.prompt_blocks import check_sliding_window

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "hybrid_sw64_events.json").read_text())
BS, WINDOW, MODEL = 32, 64, "tiny-hybrid"


def stored(hashes, tokens, group, kind, parent=None, window=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None, group_idx=group,
                       kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def removed(hashes, group):
    return BlockRemoved(block_hashes=list(hashes), medium="GPU", group_idx=group)


async def predicted_hits(index: MemoryIndex, prompt: list[int]) -> dict[str, int]:
    """The gateway's rule (router.route.planner.Router._window_limited) in blocks, per worker."""
    keys = block_keys(prompt, BS, MODEL)
    cap = (len(prompt) - 1) // BS
    full = {w: min(m.gpu, cap) for w, m in (await index.match(keys)).items()}
    return await window_hits(full, window_keys(keys[:cap]), window_blocks(WINDOW, BS), index.gpu_holders)


# ---- the rule ---------------------------------------------------------------------------------
def hit_end(full_run: int, held, need: int) -> int:
    """vLLM's rule read literally (``SlidingWindowManager.find_longest_cache_hit`` after the
    full-attention run): the largest end whose window the group holds, ``held(i)`` per block."""
    for e in range(full_run, 0, -1):
        if all(held(i) for i in range(max(0, e - need), e)):
            return e
    return 0


def test_window_blocks_is_vllms_contiguous_block_count():
    assert window_blocks(64, 32) == 2  # ceil(63 / 32)
    assert window_blocks(65, 32) == 2 and window_blocks(66, 32) == 3
    assert window_blocks(128, 16) == 8 and window_blocks(1, 16) == 0
    with pytest.raises(ValueError):
        window_blocks(0, 16)


async def test_index_lookup_equals_vllms_rule_on_random_holdings():
    rnd = random.Random(3)
    for trial in range(300):
        n, need = rnd.randint(1, 40), rnd.randint(1, 6)
        keys = block_keys([rnd.randrange(1000) for _ in range(n * BS)], BS, MODEL)
        index = MemoryIndex()
        runs, holds = {}, {}
        for w in ("w0", "w1", "w2"):
            runs[w] = rnd.randint(0, n)
            holds[w] = {i for i in range(n) if rnd.random() < rnd.choice((0.2, 0.6, 0.95))}
            index.store_sync(w, "gpu", keys[:runs[w]])
            index.store_sync(w, "gpu", [window_key(keys[i]) for i in holds[w]])
        want = {w: hit_end(runs[w], holds[w].__contains__, need) for w in runs if runs[w]}
        assert await window_hits(runs, window_keys(keys), need, index.gpu_holders) == want, (trial, runs, need)
        # the base class's one-match-per-key lookup answers the same
        assert await window_hits(runs, window_keys(keys), need,
                                 lambda ks: KVIndex.gpu_holders(index, ks)) == want, trial


async def test_speculative_and_hidden_entries_in_the_holders_lookup():
    keys = list(range(10, 16))
    index = MemoryIndex()
    index.store_sync("w0", "gpu", keys[:2])
    index.store_sync("w0", "cpu", keys[2:3])  # window keys live in gpu only: not a holder
    index.store_sync("w1", "gpu", keys[1:2])
    await index.store_speculative("w1", keys[4:5], ttl_s=60)
    assert await index.gpu_holders(keys) == {"w0": 0b11, "w1": 0b10010}
    assert index.gpu_holders_sync(keys, hidden=index.confirmed_bits(["w1"])) == {"w0": 0b11, "w1": 0b10000}


async def test_redis_and_its_mirror_answer_the_holders_lookup_as_memory_does(redis_url):
    keys = list(range(900, 940))
    rnd = random.Random(5)
    ns = f"sw{uuid.uuid4().hex[:8]}"
    writer = RedisIndex(redis_url, namespace=ns, heartbeat_ttl_s=3600, socket_timeout_s=5)
    mirror = RedisMirrorIndex(redis_url, namespace=ns, heartbeat_ttl_s=3600, socket_timeout_s=5)
    memory = MemoryIndex()
    try:
        await mirror.open()
        for w in ("w0", "w1", "w2"):
            held = [k for k in keys if rnd.random() < 0.5]
            for idx in (writer, memory):
                await idx.store(w, "gpu", held)
                await idx.store(w, "ssd", keys[:5])
        await writer.store_speculative("w3", keys[7:9], ttl_s=60)
        await memory.store_speculative("w3", keys[7:9], ttl_s=60)
        want = await memory.gpu_holders(keys)
        assert set(want) == {"w0", "w1", "w2", "w3"} and want["w3"] == 0b11 << 7
        assert await writer.gpu_holders(keys) == want
        del want["w3"]  # speculative entries are the writing process's own

        async def mirrored() -> bool:
            try:
                return await mirror.gpu_holders(keys) == want
            except IndexUnavailable:  # not loaded yet
                return False

        await until(mirrored, 10, "the mirror to hold every worker's keys")
    finally:
        await writer.close()
        await mirror.close()


# ---- the translator on real frames -------------------------------------------------------------
def frames() -> list[EventBatch]:
    return [decode_batch(msgspec.msgpack.encode(b)) for b in FIXTURE["batches"]]


async def test_recorded_hybrid_frames_predict_what_vllm_reported():
    prompts, reported = FIXTURE["prompts"], FIXTURE["cached_tokens"]
    tr, index = EventTranslator(MODEL, BS), MemoryIndex()
    batches = frames()
    # the order sent: A (batch 0), B (1), C (2), D (stored nothing), E (3); predict before each
    plan = [("A", 0), ("B", 1), ("C", 2), ("D", None), ("E", 3)]
    for name, batch in plan:
        hits = await predicted_hits(index, prompts[name])
        assert hits.get("w0", 0) * BS == reported[name], name
        if batch is not None:
            await write_ops(index, "w0", tr.translate(batches[batch]))
    assert tr.counters_dict()["unresolved_window_blocks"] == 0
    assert tr.counters.skipped_events == 0
    # full attention alone would have credited B with its 10 shared blocks
    keys_b = block_keys(prompts["B"], BS, MODEL)
    first = EventTranslator(MODEL, BS)
    only_a = MemoryIndex()
    await write_ops(only_a, "w0", first.translate(batches[0]))
    assert (await only_a.match(keys_b))["w0"].gpu == 10
    assert await predicted_hits(only_a, prompts["B"]) == {"w0": 0}


def test_window_group_stores_come_before_their_full_attention_blocks_in_a_batch():
    # vLLM 0.32 publishes group 0 (the window group) first: its blocks are found afterwards
    batch = frames()[0]
    kinds = [(e.group_idx, e.kv_cache_spec_kind, len(e.block_hashes)) for e in batch.events]
    assert kinds == [(0, "sliding_window", 2), (1, "full_attention", 20)]
    tr = EventTranslator(MODEL, BS)
    ops = tr.translate(batch)
    keys = block_keys(FIXTURE["prompts"]["A"], BS, MODEL)
    assert ops == [("store", "gpu", keys + [window_key(keys[18]), window_key(keys[19])])]


# ---- the translator on crafted events -----------------------------------------------------------
def chain(n: int, seed: int = 0) -> tuple[list[int], list[int], list[int]]:
    """n blocks: engine hashes, tokens, our block keys."""
    rnd = random.Random(seed)
    tokens = [rnd.randrange(500) for _ in range(n * BS)]
    return [1000 + seed * 100 + i for i in range(n)], tokens, block_keys(tokens, BS, MODEL)


def test_window_removals_and_clears_follow_the_window_group():
    hashes, tokens, keys = chain(4)
    tr = EventTranslator(MODEL, BS)
    ops = tr.translate(EventBatch(0.0, [stored(hashes[2:], tokens, 0, "sliding_window", window=WINDOW),
                                        stored(hashes, tokens, 1, "full_attention")]))
    assert ops == [("store", "gpu", keys + window_keys(keys[2:]))]
    # the window group evicts block 2 (its removal names only the group)
    assert tr.translate(EventBatch(1.0, [removed([hashes[2]], 0)])) == [("remove", "gpu", [window_key(keys[2])])]
    # the full group's removal of block 3 leaves its window copy
    assert tr.translate(EventBatch(2.0, [removed([hashes[3]], 1)])) == [("remove", "gpu", [keys[3]])]
    assert sorted(k for op in tr.snapshot() for k in op[2]) == sorted(keys[:3] + [window_key(keys[3])])
    # a removal queued before a clear is applied before it
    ops = tr.translate(EventBatch(3.0, [removed([hashes[3]], 0), AllBlocksCleared()]))
    assert ops == [("remove", "gpu", [window_key(keys[3])]), ("clear", None, [])]
    assert tr.snapshot() == []


def test_blocks_count_only_when_every_window_group_holds_them():
    hashes, tokens, keys = chain(3, seed=1)
    tr = EventTranslator(MODEL, BS)
    tr.translate(EventBatch(0.0, [stored(hashes, tokens, 0, "full_attention")]))
    ops = tr.translate(EventBatch(1.0, [stored(hashes[1:], tokens, 1, "sliding_window", window=WINDOW)]))
    assert ops == [("store", "gpu", window_keys(keys[1:]))]
    # a second group with the same window appears: nothing is complete until it holds the block
    ops = tr.translate(EventBatch(2.0, [stored(hashes[2:], tokens, 2, "sliding_window", window=WINDOW)]))
    assert ops == [("remove", "gpu", window_keys(keys[1:])), ("store", "gpu", [window_key(keys[2])])]
    assert tr.translate(EventBatch(3.0, [removed([hashes[2]], 1)])) == [("remove", "gpu", [window_key(keys[2])])]


def test_unknown_blocks_and_other_windows_are_skipped_and_counted():
    hashes, tokens, keys = chain(2, seed=2)
    tr = EventTranslator(MODEL, BS)
    assert tr.translate(EventBatch(0.0, [stored(hashes, tokens, 0, "sliding_window", window=WINDOW)])) == []
    assert tr.counters_dict()["unresolved_window_blocks"] == 2
    tr.translate(EventBatch(1.0, [stored(hashes, tokens, 1, "full_attention")]))
    assert tr.translate(EventBatch(2.0, [stored(hashes, tokens, 2, "sliding_window", window=128)])) == []
    assert tr.counters.skipped_events == 1
    assert tr.translate(EventBatch(3.0, [stored(hashes, tokens, 3, "mamba")])) == []
    assert tr.counters.skipped_events == 2


# ---- configuration ----------------------------------------------------------------------------
def test_declared_window_reads_the_model_config():
    assert declared_window_tokens({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]}) == 128
    assert declared_window_tokens({"sliding_window": 512, "sliding_window_pattern": 6}) == 512
    # every layer slides (no full-attention group), or no window at all
    assert declared_window_tokens({"sliding_window": 4096, "layer_types": ["sliding_attention"] * 2}) is None
    assert declared_window_tokens({"sliding_window": 4096}) is None
    assert declared_window_tokens({"sliding_window": None, "layer_types": ["sliding_attention", "full_attention"]}) is None
    assert declared_window_tokens({}) is None


def test_gateway_refuses_a_hybrid_model_without_its_window(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}))
    with pytest.raises(ValueError, match="sliding_window_tokens: 64"):
        check_sliding_window(ModelConfig(name="m", tokenizer=str(tmp_path), block_size=32))
    with pytest.raises(ValueError, match="64-token window"):
        check_sliding_window(ModelConfig(name="m", tokenizer=str(tmp_path), block_size=32, sliding_window_tokens=128))
    check_sliding_window(ModelConfig(name="m", tokenizer=str(tmp_path), block_size=32, sliding_window_tokens=64))
    (tmp_path / "config.json").write_text(json.dumps({"sliding_window": None}))
    check_sliding_window(ModelConfig(name="m", tokenizer=str(tmp_path), block_size=32))


def test_serve_refuses_a_hybrid_model_without_its_window_at_start(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(
        {"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2}))
    config = tmp_path / "gateway.yaml"
    config.write_text(f"models: [{{name: m, tokenizer: {model_dir}, block_size: 16}}]\n"
                      "workers: [{url: 'http://127.0.0.1:9', model: m}]\n")
    done = subprocess.run(kvroute_argv("serve", "--config", str(config)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "set sliding_window_tokens: 128" in done.stderr
