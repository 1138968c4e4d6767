"""EventTranslator on the real vLLM 0.32 frames and on crafted events: keys equal the gateway's,
removals, duplicates, re-announcements, salts, LoRA, tokenless placeholders, chains."""
from __future__ import annotations

import pytest
from kv_replay_publisher import capture_payloads

from kvcore.block_keys import BlockExtras, block_keys
from kvcore.index.memory import MemoryIndex
from kvcore.kv_events.ingest import write_ops
from kvcore.kv_events.translate import EventTranslator
from kvcore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch

BS = 32
MODEL = "tiny"


@pytest.fixture(scope="module")
def frames(capture):
    return [decode_batch(p) for p in capture_payloads(capture)]


def tokens_of(capture, name: str) -> list[int]:
    step = next(s for s in capture["steps"] if s["name"] == name)
    return step["tokenize_response"]["tokens"]


def stored(hashes, tokens, parent=None, medium="GPU", lora=None, extra=None, block_size=BS):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=block_size, lora_id=None, medium=medium, lora_name=lora, extra_keys=extra)


async def run_frames(frames, upto: int) -> tuple[EventTranslator, MemoryIndex]:
    tr, index = EventTranslator(MODEL, BS), MemoryIndex()
    for batch in frames[:upto + 1]:
        await write_ops(index, "w0", tr.translate(batch))
    return tr, index


async def test_agent_keys_equal_gateway_keys_for_every_captured_request(capture, frames):
    tr, index = await run_frames(frames, 4)
    checked = 0
    for name in ("completion_A", "chat_1", "chat_2_multiturn", "completion_B_evicts"):
        keys = block_keys(tokens_of(capture, name), BS, MODEL)  # what the gateway computes
        match = await index.match(keys)
        assert match["w0"].gpu == len(keys), name
        checked += len(keys)
    assert checked == 18 + 6 + 6 + 16
    # completion_B's decode filled one more block (frame 4, chained through its parent)
    assert tr.counters.unknown_parents == 0 and tr.counters.blocks_stored == 18 + 6 + 1 + 16 + 1


async def test_eviction_frame_removes_exactly_the_evicted_blocks(capture, frames):
    keys_a = block_keys(tokens_of(capture, "completion_A"), BS, MODEL)
    _, before = await run_frames(frames, 4)
    assert (await before.match(keys_a))["w0"].gpu == 18
    tr, after = await run_frames(frames, 5)
    # frame 5 evicts completion_A's blocks 4..17: the prefix run stops at block 4
    assert (await after.match(keys_a))["w0"].gpu == 4
    evicted = set(keys_a[4:])
    held = set(after._masks)
    assert not evicted & held
    assert set(keys_a[:4]) <= held
    assert tr.counters.blocks_removed == 14 and tr.counters.unknown_removals == 0


async def test_salted_request_keys_differ_and_match_the_gateway_salted_keys(capture, frames):
    tokens_a = tokens_of(capture, "completion_A")
    tr = EventTranslator(MODEL, BS)
    ops = [op for b in frames[:6] for op in tr.translate(b)]
    salted_store = ops[-1]
    assert salted_store[0] == "store" and len(salted_store[2]) == 18
    gateway_salted = block_keys(tokens_a, BS, MODEL, BlockExtras(cache_salt="tenant-1"))
    assert salted_store[2] == gateway_salted
    assert not set(gateway_salted) & set(block_keys(tokens_a, BS, MODEL))


async def test_all_blocks_cleared_leaves_only_the_last_store(capture, frames):
    tr, index = await run_frames(frames, 6)
    keys_a = block_keys(tokens_of(capture, "completion_A"), BS, MODEL)
    assert set(index._masks) == set(keys_a)
    assert (await index.stats())["w0"].blocks == {"gpu": 18, "cpu": 0, "ssd": 0}
    assert tr.held_blocks() == {"gpu": 18, "cpu": 0, "ssd": 0}
    assert tr.counters.clears == 1


async def test_full_report_reannouncement_adds_no_copy_but_the_recomputed_block_does(capture, frames):
    tr, index = await run_frames(frames, 2)
    assert tr.counters.reannounced_blocks == 5 and tr.counters.duplicate_blocks == 1
    chat = frames[1].events[0].block_hashes  # chat_1's six engine hashes
    keys = block_keys(tokens_of(capture, "chat_1"), BS, MODEL)
    # one removal of block 4 (re-announced, one physical copy) drops it ...
    await write_ops(index, "w0", tr.translate(EventBatch(0.0, [BlockRemoved([chat[4]], "GPU")])))
    assert (await index.match(keys))["w0"].gpu == 4
    # ... block 5 was recomputed (a second physical copy): it needs two removals
    await write_ops(index, "w0", tr.translate(EventBatch(0.0, [BlockRemoved([chat[5]], "GPU")])))
    assert keys[5] in index._masks
    await write_ops(index, "w0", tr.translate(EventBatch(0.0, [BlockRemoved([chat[5]], "GPU")])))
    assert keys[5] not in index._masks


async def test_unknown_removal_is_counted_and_does_not_abort_the_batch():
    tr, index = EventTranslator(MODEL, BS), MemoryIndex()
    toks = list(range(3 * BS))
    keys = block_keys(toks, BS, MODEL)
    await write_ops(index, "w", tr.translate(EventBatch(0.0, [stored([11, 12, 13], toks)])))
    batch = EventBatch(0.0, [BlockRemoved([999, 13], "GPU"), BlockRemoved([12, 12], "GPU")])
    await write_ops(index, "w", tr.translate(batch))
    assert tr.counters.unknown_removals == 2  # 999, and the second removal of 12
    assert (await index.match(keys))["w"].gpu == 1
    assert set(index._masks) == {keys[0]}
    assert tr.held_blocks() == {"gpu": 1, "cpu": 0, "ssd": 0}


async def test_chain_continues_through_parent_hash_like_one_event():
    toks = [(7 * i) % 300 for i in range(5 * BS)]
    whole = block_keys(toks, BS, MODEL)
    tr = EventTranslator(MODEL, BS)
    ops = tr.translate(EventBatch(0.0, [stored([1, 2], toks[:2 * BS]), stored([3, 4, 5], toks[2 * BS:], parent=2)]))
    assert ops == [("store", "gpu", whole)]
    assert tr.lookup(5) == (whole[4], 4)
    # an unknown parent cannot be keyed: counted and skipped
    assert tr.translate(EventBatch(0.0, [stored([9], toks[:BS], parent=12345)])) == []
    assert tr.counters.unknown_parents == 1


async def test_lora_and_salt_mixed_as_the_gateway_mixes_them():
    toks = list(range(100, 100 + 3 * BS))
    tr = EventTranslator(MODEL, BS)
    extra = [["my-lora", "salt-1"], ["my-lora"], ["my-lora"]]
    ops = tr.translate(EventBatch(0.0, [stored([1, 2, 3], toks, lora="my-lora", extra=extra)]))
    gateway = block_keys(toks, BS, MODEL, BlockExtras(lora_name="my-lora", cache_salt="salt-1"))
    assert ops == [("store", "gpu", gateway)]
    assert gateway != block_keys(toks, BS, MODEL, BlockExtras(lora_name="my-lora"))
    # a continuation of the salted chain does not re-apply the salt but inherits it
    more = list(range(400, 400 + BS))
    ops = tr.translate(EventBatch(0.0, [stored([4], more, parent=3, lora="my-lora", extra=[["my-lora"]])]))
    full = block_keys(toks + more, BS, MODEL, BlockExtras(lora_name="my-lora", cache_salt="salt-1"))
    assert ops == [("store", "gpu", full[3:])]


async def test_multimodal_extra_keys_never_equal_gateway_keys():
    toks = list(range(2 * BS))
    tr = EventTranslator(MODEL, BS)
    ops = tr.translate(EventBatch(0.0, [stored([1, 2], toks, extra=[None, [["img-abc", 3]]])]))
    plain = block_keys(toks, BS, MODEL)
    assert ops[0][2][0] == plain[0] and ops[0][2][1] != plain[1]


async def test_tokenless_placeholder_resolved_through_the_map_into_its_tier():
    toks = list(range(2 * BS))
    keys = block_keys(toks, BS, MODEL)
    tr, index = EventTranslator(MODEL, BS), MemoryIndex()
    await write_ops(index, "w", tr.translate(EventBatch(0.0, [stored([1, 2], toks)])))
    cpu = BlockStored(block_hashes=[1, 2, 77], parent_block_hash=None, token_ids=[], block_size=0,
                      lora_id=None, medium="CPU", lora_name=None)
    await write_ops(index, "w", tr.translate(EventBatch(0.0, [cpu, BlockRemoved([1, 2], "GPU")])))
    assert tr.counters.unresolved_tokenless == 1
    assert (await index.match(keys))["w"].as_dict() == {"gpu": 0, "cpu": 2, "ssd": 0}
    ssd = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                      medium="STORAGE", lora_name=None)
    await write_ops(index, "w", tr.translate(EventBatch(0.0, [ssd, BlockRemoved([1], "CPU")])))
    # block 0 now in ssd, block 1 in cpu: the run from block 0 is only complete counting ssd
    assert (await index.match(keys))["w"].as_dict() == {"gpu": 0, "cpu": 0, "ssd": 2}
    assert (await index.stats())["w"].blocks == {"gpu": 0, "cpu": 1, "ssd": 1}
    assert tr.held_blocks() == {"gpu": 0, "cpu": 1, "ssd": 1}


async def test_wrong_block_size_other_groups_and_unknown_medium_are_skipped():
    toks = list(range(2 * 16))
    tr = EventTranslator(MODEL, BS)
    assert tr.translate(EventBatch(0.0, [stored([1, 2], toks, block_size=16)])) == []
    assert tr.translate(EventBatch(0.0, [stored([1], list(range(BS)), medium="NVME")])) == []
    sw = BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=list(range(BS)), block_size=BS,
                     lora_id=None, medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window")
    full = BlockStored(block_hashes=[6], parent_block_hash=None, token_ids=list(range(BS)), block_size=BS,
                       lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention")
    ops = tr.translate(EventBatch(0.0, [sw, full]))
    assert ops == [("store", "gpu", block_keys(list(range(BS)), BS, MODEL))]
    assert tr.counters.skipped_events == 3


async def test_all_blocks_cleared_op_and_snapshot_rebuilds_the_index(frames):
    tr, index = await run_frames(frames, 5)
    rebuilt = MemoryIndex()
    await write_ops(rebuilt, "w0", tr.snapshot())
    assert set(rebuilt._masks) == set(index._masks)
    assert (await rebuilt.stats())["w0"].blocks == (await index.stats())["w0"].blocks
    assert tr.held_blocks() == (await index.stats())["w0"].blocks
    ops = tr.translate(EventBatch(0.0, [AllBlocksCleared()]))
    assert ops == [("clear", None, [])] and tr.snapshot() == []
    assert tr.held_blocks() == {"gpu": 0, "cpu": 0, "ssd": 0}


async def test_older_array_shaped_events_translate_like_the_map_shaped_ones():
    import msgspec

    toks = list(range(50, 50 + 2 * BS))
    # vLLM <= 0.11 wire shape: [ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id, medium], ...], rank]
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [1, 2], None, toks, BS, None, "GPU"],
                                        ["BlockRemoved", [2], "GPU"]], 0])
    tr = EventTranslator(MODEL, BS)
    ops = tr.translate(decode_batch(old))
    keys = block_keys(toks, BS, MODEL)
    assert ops == [("store", "gpu", keys), ("remove", "gpu", keys[1:])]


async def test_a_batch_of_single_block_removals_applies_as_its_events_one_by_one():
    """vLLM sends one BlockRemoved per evicted block; the translator takes a run sharing medium,
    group and locality in one pass. Mixed runs (media, an unknown medium, another group, REMOTE,
    LOCAL, unknown and repeated hashes) leave the same index, held blocks and counters as the
    same events translated one batch each."""
    import random
    rng = random.Random(7)
    toks = [rng.randrange(1000) for _ in range(40 * BS)]
    hashes = list(range(100, 140))
    cpu = BlockStored(block_hashes=hashes[:20], parent_block_hash=None, token_ids=[], block_size=0,
                      lora_id=None, medium="CPU", lora_name=None)
    setup = [stored(hashes, toks), cpu, stored(hashes[:5], toks[:5 * BS], parent=hashes[-1] + 1)]
    removals = []
    for _ in range(120):
        removals.append(BlockRemoved([rng.choice(hashes + [999])], rng.choice(["GPU", "GPU", "CPU", "NVME"]),
                                     group_idx=rng.choice([0, 0, 0, None, 3]),
                                     locality=rng.choice([None, None, "LOCAL", "REMOTE"])))
    whole_tr, whole_ix = EventTranslator(MODEL, BS), MemoryIndex()
    one_tr, one_ix = EventTranslator(MODEL, BS), MemoryIndex()
    first = stored(hashes[:1], toks[:BS])
    first.group_idx, first.kv_cache_spec_kind = 0, "full_attention"  # the indexed group is 0
    for tr, ix in ((whole_tr, whole_ix), (one_tr, one_ix)):
        await write_ops(ix, "w", tr.translate(EventBatch(0.0, [first] + setup)))
    await write_ops(whole_ix, "w", whole_tr.translate(EventBatch(0.0, removals)))
    for ev in removals:
        await write_ops(one_ix, "w", one_tr.translate(EventBatch(0.0, [ev])))
    assert whole_tr.counters == one_tr.counters
    assert whole_tr.held_blocks() == one_tr.held_blocks() == (await whole_ix.stats())["w"].blocks
    assert whole_ix._masks == one_ix._masks
    assert whole_tr.snapshot() == one_tr.snapshot()
    c = whole_tr.counters
    # every kind of run occurred, and some removals applied
    assert c.remote_events and c.skipped_events and c.unknown_removals and c.blocks_removed
    assert c.events_applied == 1 + len(setup) + len(removals)
