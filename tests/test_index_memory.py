"""The index contract (kvcore/index/base.py) on both backends: refcounts, tiers, match split by
tier, clear, speculative TTL; plus what only the memory backend has (max_keys, slot reuse)."""
from __future__ import annotations

import random
import uuid

import pytest

from kvcore.index.base import TierMatch
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture(params=["memory", "redis"])
async def index(request, clock):
    if request.param == "memory":
        yield MemoryIndex(clock=clock)
        return
    # a generous timeout: this machine is shared, and a slow answer is not what these tests check
    idx = RedisIndex(request.getfixturevalue("redis_url"), namespace=f"t{uuid.uuid4().hex[:8]}", clock=clock,
                     socket_timeout_s=5)
    yield idx
    await idx.close()


K = [101, 102, 103, 104, 105, 106]


async def test_match_is_the_run_from_block_zero(index):
    await index.store("a", "gpu", K[:4])
    await index.store("b", "gpu", [K[0], K[1], K[3]])  # hole at block 2
    await index.store("c", "gpu", K[1:])  # no block 0: absent
    assert await index.match(K) == {"a": TierMatch(4, 0, 0), "b": TierMatch(2, 0, 0)}
    assert await index.match([999] + K) == {}
    assert await index.match([]) == {}


async def test_match_split_by_best_tier(index):
    await index.store("w", "gpu", K[:2])
    await index.store("w", "cpu", K[1:4])  # block 1 in both: gpu wins
    await index.store("w", "ssd", K[4:5])
    await index.store("x", "ssd", K[:1])
    await index.store("x", "gpu", K[1:3])  # gpu after an ssd block counts as ssd
    m = await index.match(K)
    assert m["w"] == TierMatch(gpu=2, cpu=2, ssd=1)
    assert m["x"] == TierMatch(gpu=0, cpu=0, ssd=3)
    st = await index.stats()
    assert st["w"].blocks == {"gpu": 2, "cpu": 3, "ssd": 1}


async def test_duplicates_are_reference_counted_per_key_and_tier(index):
    await index.store("w", "gpu", K[:2])
    await index.store("w", "gpu", K[:1])  # second copy of block 0
    await index.store("w", "cpu", K[:1])
    assert await index.remove("w", "gpu", K[:1]) == 0
    assert (await index.match(K))["w"] == TierMatch(2, 0, 0)  # one gpu copy left
    assert await index.remove("w", "gpu", K[:1]) == 0
    assert (await index.match(K))["w"] == TierMatch(0, 2, 0)  # the cpu copy is untouched
    assert await index.remove("w", "gpu", [K[0], 999]) == 2
    assert await index.remove("nobody", "gpu", K[:3]) == 3
    await index.remove("w", "cpu", K[:1])
    assert await index.match(K) == {}


async def test_clear_worker_by_tier_and_whole_leaves_others(index):
    await index.store("a", "gpu", K)
    await index.store("a", "cpu", K)
    await index.store("a", "gpu", K[:1])  # a duplicate dies with the clear too
    await index.store("b", "gpu", K[:3])
    await index.clear_worker("a", "gpu")
    m = await index.match(K)
    assert m["a"] == TierMatch(0, 6, 0) and m["b"] == TierMatch(3, 0, 0)
    await index.clear_worker("a")
    assert await index.match(K) == {"b": TierMatch(3, 0, 0)}
    assert set(await index.stats()) == {"b"}
    await index.store("a", "gpu", K[:1])  # usable again; no leftover reference counts
    await index.remove("a", "gpu", K[:1])
    assert await index.match(K) == {"b": TierMatch(3, 0, 0)}


async def test_speculative_entries_count_as_gpu_until_their_ttl(index, clock):
    await index.store("a", "cpu", K[:3])
    await index.store_speculative("a", K[:2], ttl_s=5.0)
    await index.store_speculative("s", K[:4], ttl_s=5.0)
    m = await index.match(K)
    assert m["a"] == TierMatch(2, 1, 0) and m["s"] == TierMatch(4, 0, 0)
    assert (await index.stats())["s"].speculative_blocks == 4
    clock.now += 3
    await index.store_speculative("s", K[:1], ttl_s=5.0)  # refresh block 0 only
    clock.now += 3
    m = await index.match(K)
    assert m["a"] == TierMatch(0, 3, 0) and m["s"] == TierMatch(1, 0, 0)
    clock.now += 10
    assert await index.match(K) == {"a": TierMatch(0, 3, 0)}


async def test_a_gpu_removal_drops_the_speculative_entry_too(index, clock):
    await index.store_speculative("a", K[:4], ttl_s=5.0)  # routed there: guessed held
    await index.store("a", "gpu", K[:4])  # the engine's events confirm
    await index.remove("a", "gpu", K[2:4])  # then it evicts blocks 2 and 3
    assert await index.match(K) == {"a": TierMatch(2, 0, 0)}  # the guess does not outlive the eviction
    assert (await index.stats())["a"].speculative_blocks == 2
    await index.remove("a", "cpu", K[:2])  # another tier's removal leaves the guess alone
    assert await index.match(K) == {"a": TierMatch(2, 0, 0)}
    clock.now += 10
    assert await index.match(K) == {"a": TierMatch(2, 0, 0)}


async def test_dropping_speculative_entries_leaves_confirmed_ones_and_other_workers(index, clock):
    await index.store("a", "cpu", K[:2])
    await index.store("a", "gpu", K[:1])
    await index.store_speculative("a", K[:4], ttl_s=5.0)  # routed there, then refused
    await index.store_speculative("b", K[:3], ttl_s=5.0)
    await index.drop_speculative("a", K[:4])
    assert await index.match(K) == {"a": TierMatch(1, 1, 0), "b": TierMatch(3, 0, 0)}
    assert (await index.stats())["a"].speculative_blocks == 0
    await index.drop_speculative("nobody", K)  # a worker the index never saw: nothing to do
    await index.drop_speculative("b", K[1:2])  # a hole: b's run ends at block 1
    assert (await index.match(K))["b"] == TierMatch(1, 0, 0)


async def test_many_workers_and_long_prompts(index):
    keys = list(range(10_000, 10_512))
    for w in range(70):  # more workers than one 64-bit word
        await index.store(f"w{w}", "gpu", keys[:w * 7 % 512])
    m = await index.match(keys)
    expected = {f"w{w}": TierMatch(w * 7 % 512, 0, 0) for w in range(70) if w * 7 % 512}
    assert m == expected


async def test_bad_tier_is_a_value_error(index):
    with pytest.raises(ValueError):
        await index.store("w", "nvme", K)


def test_memory_max_keys_bounds_distinct_keys_and_never_over_reports():
    idx = MemoryIndex(max_keys=3)
    idx.store_sync("w", "gpu", K)
    assert len(idx) == 3 and idx.dropped_keys == 3
    assert idx.match_sync(K) == {"w": TierMatch(3, 0, 0)}


def test_memory_slot_is_reused_after_clear_without_leaking_bits():
    idx = MemoryIndex()
    idx.store_sync("a", "gpu", K[:2])
    idx.store_sync("b", "gpu", K[:1])
    idx.clear_worker_sync("a")
    idx.store_sync("c", "gpu", K[1:3])  # takes a's slot; must not inherit a's block 0
    assert idx.match_sync(K) == {"b": TierMatch(1, 0, 0)}
    assert idx.match_sync(K[1:]) == {"c": TierMatch(2, 0, 0)}


def test_the_index_gives_the_cyclic_collector_nothing_to_walk():
    """Every per-key structure (the masks, each worker's key holdings per tier, its speculative
    entries) stays untracked by Python's cyclic GC after stores, speculative entries, removals,
    a bulk load and a clear, so a full collection costs nothing per indexed block (sets, always
    tracked, would make each one walk every entry: docs/tuning/memory_index.md)."""
    import gc
    import struct as _struct

    idx = MemoryIndex()
    keys = list(range(1, 5001))
    idx.store_sync("a", "gpu", keys)
    idx.store_sync("a", "cpu", keys[:100])
    idx.store_sync("b", "ssd", keys[50:200])
    idx.store_speculative_sync("b", keys[:10], ttl_s=60)
    idx.remove_sync("a", "gpu", keys[:7])
    gc.collect()
    containers = [idx._masks] + [c for holding in idx._owned.values() for c in holding]
    assert len(containers) == 1 + 2 * 4
    assert not any(gc.is_tracked(c) for c in containers)
    assert sorted(idx.owned_keys("b", "ssd")) == keys[50:200] and 7 not in idx.owned_keys("a", "gpu")
    assert len(idx.owned_keys("nobody", "gpu")) == 0
    idx.clear_worker_sync("a", "cpu")
    assert len(idx.owned_keys("a", "cpu")) == 0 and not gc.is_tracked(idx._owned[idx._slots["a"]][1])

    bulk = MemoryIndex()
    packed = _struct.pack(f">{len(keys)}Q", *keys)
    for _ in bulk.load_steps([("a", "gpu", packed), ("b", "cpu", packed[:800])], step_keys=1000):
        pass
    assert bulk.match_sync(keys[:3]) == {"a": TierMatch(3, 0, 0), "b": TierMatch(0, 3, 0)}
    assert not any(gc.is_tracked(c) for c in [bulk._masks] + [c for h in bulk._owned.values() for c in h])


def test_tier_matches_for_hundreds_of_workers_equal_the_one_by_one_path(monkeypatch):
    """Past _MANY_WORKERS the run lengths go through numpy bit matrices; the answer must be the
    per-bit path's, for drops of one worker and of many, gpu/cpu/any chains apart."""
    from kvcore.index import memory

    rnd = random.Random(11)
    slots = 300
    names = {s: f"w{s}" for s in range(slots) if s % 7}  # some slots have no name
    for _ in range(20):
        order = list(range(slots))
        rnd.shuffle(order)
        any_left = set(order)
        gc_left = {s for s in any_left if rnd.random() < 0.8}
        g_left = {s for s in gc_left if rnd.random() < 0.8}
        drops = []
        for i in range(1, 60):
            picked = []
            for chain in (g_left, gc_left, any_left):
                k = rnd.choice((0, 1, 1, 5, 40))
                out = set(rnd.sample(sorted(chain), min(k, len(chain))))
                picked.append(out)
            dg, dgc, da = picked
            dgc |= da & gc_left
            dg |= (dgc | da) & g_left
            for chain, out in zip((g_left, gc_left, any_left), (dg, dgc, da)):
                chain -= out
            bits = [sum(1 << (4 * s) for s in out) for out in (dg, dgc, da)]
            if any(bits):
                drops.append((*bits, i))
        alive = tuple(sum(1 << (4 * s) for s in chain) for chain in (g_left, gc_left, any_left))
        many = memory._tier_matches_many(drops, alive, 60, names, 4)
        monkeypatch.setattr(memory, "_MANY_WORKERS", 10**9)
        one_by_one = memory.tier_matches(drops, alive, 60, names, 4)
        monkeypatch.undo()
        assert many == one_by_one
        assert len(many) == len(names)


def _brute_match(held: dict[tuple[str, int], set[str]], workers: list[str], prompt: list[int]) -> dict[str, TierMatch]:
    """Per worker, block by block from block 0: the gpu run (gpu or speculative), the gpu|cpu
    run and the any-tier run, split as TierMatch."""
    out = {}
    for w in workers:
        runs = []
        for tiers in ({"gpu", "spec"}, {"gpu", "cpu", "spec"}, {"gpu", "cpu", "ssd", "spec"}):
            n = 0
            while n < len(prompt) and held.get((w, prompt[n]), set()) & tiers:
                n += 1
            runs.append(n)
        g, gc, total = runs[0], max(runs[1], runs[0]), runs[2]
        if total:
            out[w] = TierMatch(g, gc - g, total - gc)
    return out


def _holder_ops(workers: int, seed: int, speculative: bool):
    """A random cluster's writes over one long prompt: each worker a prefix split gpu / cpu /
    ssd, some with a hole, some (``speculative``) with speculative entries. Returns (prompt,
    worker names, ops as (method, args), what each worker holds per key)."""
    rnd = random.Random(seed)
    names = [f"w{i}" for i in range(workers)]
    prompt = [rnd.getrandbits(63) for _ in range(rnd.choice((64, 200, 700)))]
    held: dict[tuple[str, int], set[str]] = {}
    ops: list[tuple[str, tuple]] = []
    for w in names:
        n = rnd.randrange(len(prompt) + 1)
        cut = sorted(rnd.sample(range(n + 1), 2)) if n else [0, 0]
        for tier, keys in (("gpu", prompt[:cut[0]]), ("cpu", prompt[cut[0]:cut[1]]), ("ssd", prompt[cut[1]:n])):
            if keys:
                ops.append(("store", (w, tier, keys)))
            for k in keys:
                held.setdefault((w, k), set()).add(tier)
        if n > 3 and rnd.random() < 0.3:  # a hole
            k = prompt[rnd.randrange(n)]
            for tier in sorted(held[(w, k)]):
                ops.append(("remove", (w, tier, [k])))
            held[(w, k)] = set()
        if speculative and rnd.random() < 0.1:
            spec = prompt[:rnd.randrange(1, len(prompt))]
            ops.append(("store_speculative", (w, spec, 30.0)))
            for k in spec:
                held.setdefault((w, k), set()).add("spec")
    return prompt, names, ops, held


@pytest.mark.parametrize("workers,seed", [(12, 1), (40, 2), (150, 3), (150, 4)])
async def test_long_prompts_with_many_holder_changes_match_the_block_by_block_answer(index, workers, seed):
    """Prompts of 64 blocks and more go through the matrix of holder rows when holders change
    often or workers are many (kvcore.index.chain_rows); holes, tiers and speculative entries
    included, the answer is the one a block-by-block walk gives, on both backends."""
    for speculative in (False, True):
        prompt, names, ops, held = _holder_ops(workers, seed, speculative)
        names = [f"{w}-{speculative}" for w in names]  # a fresh set of workers per round
        held = {(f"{w}-{speculative}", k): t for (w, k), t in held.items()}
        for method, (w, *rest) in ops:
            await getattr(index, method)(f"{w}-{speculative}", *rest)
        assert await index.match(prompt) == _brute_match(held, names, prompt)
        assert await index.match(prompt[:70]) == _brute_match(held, names, prompt[:70])
        for w in names:
            await index.clear_worker(w)


def test_past_64_slots_keys_with_the_same_holders_share_one_mask_and_unheld_masks_are_swept():
    index = MemoryIndex()
    for w in range(100):  # slots 0..99: masks up to 400 bits wide
        index.store_sync(f"w{w}", "gpu", [10_000 + w])
    prompt = list(range(1, 301))
    for w in (3, 70, 99):
        index.store_sync(f"w{w}", "gpu", prompt)
    index.store_sync("w99", "cpu", prompt[:10])
    masks = index._masks
    assert all(masks[k] is masks[prompt[10]] for k in prompt[10:])
    assert all(masks[k] is masks[prompt[0]] for k in prompt[:10])
    assert masks[prompt[0]] is not masks[prompt[10]]
    # churn: 12,000 holder sets of one key, each a value no key keeps once it is gone
    for i in range(12_000):
        holders = [f"w{64 + j}" for j in range(14) if i >> j & 1]
        for w in holders:
            index.store_sync(w, "ssd", [7])
        for w in holders:
            index.remove_sync(w, "ssd", [7])
    assert index.match_sync(prompt) == {"w3": TierMatch(300), "w70": TierMatch(300), "w99": TierMatch(300)}
    live = {id(v) for v in masks.values()}
    assert len(live) == 100 + 2  # one value per single-holder key, two for the prompt
    assert all(index._shared[v] is v for v in masks.values() if v.bit_length() > 256)
    assert len(index._shared) < 2 * len(live) + 4096 + 1  # swept when it doubled


async def test_a_long_prompt_held_only_in_cpu_and_ssd_by_many_workers(index):
    # past 128 slots and with many holder changes (the matrix path), no block in gpu: the gpu
    # chain is empty, the others are not
    prompt = list(range(5_000, 5_100))
    for w in range(140):
        await index.store(f"c{w}", "cpu", prompt[:w % 70 + 1])
        await index.store(f"c{w}", "ssd", prompt[w % 70 + 1:w % 70 + 5])
    want = {f"c{w}": TierMatch(0, w % 70 + 1, min(4, 100 - (w % 70 + 1))) for w in range(140)}
    assert await index.match(prompt) == want
    for w in range(140):
        await index.clear_worker(f"c{w}", "cpu")
    assert await index.match(prompt) == {}  # block 0 was held in cpu only
    assert await index.match(prompt[1:]) == {"c0": TierMatch(0, 0, 4), "c70": TierMatch(0, 0, 4)}  # ssd from block 1
