"""The capacity bound on the hit rate (kvbench.capacity): Belady's eviction on one cache of
the cluster's KV blocks, checked by hand on small sequences and against LRU caches split over
workers, which it must never fall below."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvcore.block_keys import block_keys
from kvbench.capacity import capacity_cached_tokens, capacity_hit_rate
from kvbench.report import capacity_note, table
from kvbench.workload import BenchRequest, Workload, ideal_cached_tokens

A = [1, 2, 3, 4, 5]   # blocks of 2: (1, 2), (3, 4); a hit is capped at (5 - 1) // 2 = 2 blocks
B = [6, 7, 8, 9, 10]


def test_belady_keeps_the_prompt_coming_back_first():
    # capacity 2: after A then B, B's blocks are the ones used furthest ahead (B comes back last),
    # so A's stay and A's second visit hits both blocks; an LRU cache would have kept B's
    assert capacity_cached_tokens([A, B, A, B], 2, 2) == [0, 0, 4, 0]
    assert capacity_cached_tokens([A, B, A, B], 2, 4) == [0, 0, 4, 4]
    assert capacity_cached_tokens([A, B, A, B], 2, 0) == [0, 0, 0, 0]


def test_the_hit_is_capped_as_vllm_caps_it():
    # 4 tokens in blocks of 2: the last token is always computed, so one block of 2 at most
    assert capacity_cached_tokens([[1, 2, 3, 4], [1, 2, 3, 4]], 2, 10) == [0, 2]
    assert capacity_cached_tokens([[], [1]], 2, 10) == [0, 0]


def test_with_room_for_everything_it_is_the_ideal():
    rng = random.Random(3)
    prompts = _conversations(rng, conversations=6, turns=4, block_size=4)
    distinct = len({k for p in prompts for k in block_keys(p, 4, "bench")})
    assert capacity_cached_tokens(prompts, 4, distinct) == ideal_cached_tokens(prompts, 4)
    smaller = capacity_cached_tokens(prompts, 4, distinct // 3)
    assert sum(smaller) < sum(ideal_cached_tokens(prompts, 4))
    assert all(s <= i for s, i in zip(smaller, ideal_cached_tokens(prompts, 4)))


@pytest.mark.parametrize("seed", range(5))
def test_no_placement_over_lru_workers_beats_it(seed):
    rng = random.Random(seed)
    prompts = _conversations(rng, conversations=10, turns=5, block_size=4)
    per_worker = 12
    bound = sum(capacity_cached_tokens(prompts, 4, 2 * per_worker))
    for draw in range(20):
        place = random.Random(seed * 100 + draw)
        sticky = {}
        hits = _lru_prefix_hits(prompts, 4, [per_worker, per_worker],
                                lambda i, p: sticky.setdefault(p[0], place.randrange(2)) if draw % 2 else place.randrange(2))
        assert hits <= bound
    assert bound > 0


def test_rate_and_workload_summary():
    prompts = [A, B, A, B]
    assert capacity_hit_rate(prompts, 2, 2) == pytest.approx(4 / 20)
    assert capacity_hit_rate([], 2, 2) == 0.0
    w = Workload("t", [BenchRequest(i, "completions", {}, p, 1) for i, p in enumerate(prompts)], 2)
    assert "capacity_hit_rate" not in w.summary()
    s = w.summary(2)
    assert (s["capacity_blocks"], s["capacity_hit_rate"], s["ideal_hit_rate"]) == (2, 0.2, 0.4)
    assert capacity_note(s) == ", at most 0.200 in 2 KV blocks"
    assert capacity_note(w.summary()) == ""
    target = {"name": "kvroute:ttft", "requests": 4, "errors": 0, "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0},
              "itl_ms": {"p50": 1.0, "p99": 2.0}, "throughput_tokens_per_s": 9.0, "goodput": 1.0,
              "hit_rate": 0.2, "hit_rate_of_ideal": 0.5, "requests_max_over_mean": 1.0,
              "prefill_max_over_mean": 1.0, "ttft_target_ms": 1000.0, "records": []}
    header = table({"workload": s, "arrivals": "closed loop", "targets": [target]}).splitlines()[0]
    assert "ideal hit rate 0.400, at most 0.200 in 2 KV blocks; arrivals" in header


def test_bad_arguments():
    with pytest.raises(ValueError):
        capacity_cached_tokens([A], 0, 2)
    with pytest.raises(ValueError):
        capacity_cached_tokens([A], 2, -1)


def _conversations(rng: random.Random, conversations: int, turns: int, block_size: int) -> list[list[int]]:
    """Chats re-sending their history, rounds shuffled (the rig's multiturn shape), small ids."""
    history = {c: [1000 * (c + 1) + t for t in range(3 * block_size)] for c in range(conversations)}
    prompts = []
    for t in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            history[c] = history[c] + [rng.randrange(10**6) for _ in range(rng.randrange(1, 2 * block_size))]
            prompts.append(list(history[c]))
    return prompts


def _lru_prefix_hits(prompts, block_size, capacities, choose) -> int:
    """Prefix-hit tokens of per-worker LRU caches (vLLM's order: a finished prompt's blocks are
    freed tail first, so the tail goes first), worker ``choose(i, prompt)`` for prompt i."""
    caches = [OrderedDict() for _ in capacities]
    hits = 0
    for i, ids in enumerate(prompts):
        w = choose(i, ids)
        keys = block_keys(ids, block_size, "bench")
        run = 0
        while run < min(len(keys), (len(ids) - 1) // block_size) and keys[run] in caches[w]:
            run += 1
        hits += run * block_size
        for key in reversed(keys):
            caches[w].pop(key, None)
            caches[w][key] = True
        while len(caches[w]) > capacities[w]:
            caches[w].popitem(last=False)
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_it_is_the_best_any_eviction_gets(seed):
    # exhaustive search over every choice of evictions on short sequences: no eviction order
    # serves more blocks than the bound (and the bound's own order is one of them)
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 4) for _ in range(3)] for _ in range(3)]
    prompts = [stems[rng.randrange(3)][:rng.randrange(2, 4)] + [rng.randrange(1, 4)] for _ in range(6)]
    capacity = 2 + seed % 2
    assert sum(capacity_cached_tokens(prompts, 1, capacity)) == _best_any_eviction(prompts, capacity)


def _best_any_eviction(prompts, capacity) -> int:
    """Most served blocks (block size 1, capped as vLLM caps) over every eviction choice."""
    from itertools import combinations

    chains = [list(dict.fromkeys(block_keys(p, 1, "bench"))) for p in prompts]

    def best(i: int, cached: frozenset) -> int:
        if i == len(chains):
            return 0
        keys = chains[i]
        served = sum(1 for k in keys[:len(prompts[i]) - 1] if k in cached)
        full = cached | set(keys)
        over = len(full) - capacity
        if over <= 0:
            return served + best(i + 1, frozenset(full))
        return served + max(best(i + 1, full - set(drop)) for drop in combinations(sorted(full), over))
    return best(0, frozenset())
