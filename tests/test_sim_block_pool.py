"""The simulator's block pool against vLLM's prefix-cache rules (unit level, no I/O)."""
from __future__ import annotations

import pytest

from kvcore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, MEDIUM_GPU
from simulator.block_pool import BlockPool, engine_block_hashes

BS = 4
SEED = 7


def run_request(pool: BlockPool, tokens: list[int], extra_keys=None):
    """Admit ``tokens`` like the engine does: hit, allocate the rest, cache full blocks.
    Returns (blocks, hashes, hit block count)."""
    hashes = engine_block_hashes(tokens, BS, SEED, extra_keys)
    hit = pool.longest_hit(hashes, len(tokens))
    pool.touch(hit)
    blocks = hit + pool.allocate(-(-len(tokens) // BS) - len(hit))
    pool.cache_full_blocks(blocks, hashes, tokens, len(hit), len(tokens) // BS, extra_keys)
    return blocks, hashes, len(hit)


def test_hashes_chain_and_salt_changes_every_block():
    toks = list(range(12))
    plain = engine_block_hashes(toks, BS, SEED)
    assert len(plain) == 3 and len(set(plain)) == 3
    assert all(0 <= h < 2**64 for h in plain)
    # a later block's hash depends on its parent: same tokens after a different block 0 differ
    other = engine_block_hashes([99] + toks[1:], BS, SEED)
    assert other[1] != plain[1] and other[2] != plain[2]
    salted = engine_block_hashes(toks, BS, SEED, [["tenant-1"]])
    assert all(a != b for a, b in zip(plain, salted))
    # resuming from block 1 with block 0 as parent gives the same chain
    assert engine_block_hashes(toks, BS, SEED, start=1, parent=plain[0]) == plain[1:]
    assert engine_block_hashes(toks, BS, SEED + 1) != plain


def test_stored_event_fields_and_hit_capped_below_prompt_length():
    pool = BlockPool(num_blocks=10, block_size=BS)
    toks = list(range(100, 112))  # exactly 3 full blocks
    blocks, hashes, hit = run_request(pool, toks)
    assert hit == 0
    (ev,) = pool.take_events()
    assert ev == BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks, block_size=BS,
                             lora_id=None, medium=MEDIUM_GPU, lora_name=None, extra_keys=[None] * 3,
                             group_idx=0, kv_cache_spec_kind="full_attention")
    pool.free(blocks)
    # the same prompt again: vLLM recomputes the last block (hit capped at len-1 tokens)
    assert len(pool.longest_hit(hashes, len(toks))) == 2
    # a longer prompt with the same start hits all three
    assert len(pool.longest_hit(hashes + [123], len(toks) + 5)) == 3
    # a different first block hits nothing
    assert pool.longest_hit([1] + hashes[1:], len(toks)) == []


def test_second_request_stores_only_new_blocks_with_parent():
    pool = BlockPool(num_blocks=10, block_size=BS)
    a, ha, _ = run_request(pool, list(range(8)))
    pool.free(a)
    pool.take_events()
    b, hb, hit = run_request(pool, list(range(8)) + [50, 51, 52, 53, 54])
    assert hit == 2 and hb[:2] == ha
    (ev,) = pool.take_events()
    assert ev.block_hashes == [hb[2]] and ev.parent_block_hash == ha[1] and ev.token_ids == [50, 51, 52, 53]
    assert b[:2] == a[:2]  # the very same blocks were reused
    assert pool.usage() == pytest.approx(4 / 9)  # 3 full blocks + a partial one held


def test_eviction_is_lazy_lru_tail_first():
    pool = BlockPool(num_blocks=5, block_size=BS)  # 4 usable blocks
    a, ha, _ = run_request(pool, list(range(8)))  # 2 blocks
    b, hb, _ = run_request(pool, list(range(20, 28)))  # 2 blocks
    pool.free(a)
    pool.free(b)
    pool.take_events()
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    # freeing removes nothing; taking one block evicts a's tail block first (freed first, tail first)
    (blk,) = pool.allocate(1)
    assert pool.take_events() == [BlockRemoved(block_hashes=[ha[1]], medium=MEDIUM_GPU, group_idx=0)]
    assert blk.block_id == a[1].block_id
    # a's block 0 still hits (the chain stops at the evicted block 1)
    assert [x.block_id for x in pool.longest_hit(ha, 9)] == [a[0].block_id]
    pool.allocate(2)
    assert [e.block_hashes for e in pool.take_events()] == [[ha[0]], [hb[1]]]
    with pytest.raises(ValueError):
        pool.allocate(2)


def test_held_blocks_are_never_evicted_and_hits_leave_the_free_queue():
    pool = BlockPool(num_blocks=4, block_size=BS)  # 3 usable
    a, ha, _ = run_request(pool, list(range(8)))
    pool.free(a)
    b, _, hit = run_request(pool, list(range(8)) + [9])  # hits both blocks, takes 1 more
    assert hit == 2 and pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.free(b)
    assert pool.num_free_blocks == 3


def test_duplicate_blocks_are_announced_twice():
    pool = BlockPool(num_blocks=10, block_size=BS)
    toks = list(range(8))
    run_request(pool, toks)
    run_request(pool, toks)  # concurrent miss: both compute block 0 and 1 (hit capped to block 0)
    evs = pool.take_events()
    assert [e.block_hashes for e in evs] == [engine_block_hashes(toks, BS, SEED),
                                             engine_block_hashes(toks, BS, SEED)[1:]]
    assert pool.num_cached_blocks == 3


def test_reset_refused_while_held_then_clears_everything():
    pool = BlockPool(num_blocks=6, block_size=BS)
    a, ha, _ = run_request(pool, list(range(8)))
    pool.take_events()
    assert pool.reset() is False
    assert pool.take_events() == []
    pool.free(a)
    assert pool.reset() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.longest_hit(ha, 9) == [] and pool.num_cached_blocks == 0
    # cleared blocks are reused without BlockRemoved
    pool.allocate(5)
    assert pool.take_events() == []


def test_announce_full_report_and_disabled_events():
    pool = BlockPool(num_blocks=6, block_size=BS)
    toks = list(range(8))
    hashes = engine_block_hashes(toks, BS, SEED, [["s"]])
    pool.announce(hashes, toks, 2, [["s"]])
    (ev,) = pool.take_events()
    assert ev.parent_block_hash is None and ev.extra_keys == [["s"], None] and ev.token_ids == toks
    quiet = BlockPool(num_blocks=6, block_size=BS, enable_events=False)
    blocks, _, _ = run_request(quiet, toks)
    quiet.free(blocks)
    quiet.allocate(5)
    assert quiet.reset() is False  # blocks are held
    assert quiet.take_events() == []
