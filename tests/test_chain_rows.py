"""kvcore.index.chain_rows: the matrix form of a lookup's three chains gives, worker for worker,
the same tier split as the Python-int walk (run_chains + tier_matches) it stands in for."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvcore.index.base import TierMatch
from kvcore.index.chain_rows import matches_from_runs, run_lengths
from kvcore.index.memory import run_chains, tier_matches


def _walk(masks: list[int], starts: list[int], end: int, slots: int) -> dict[str, TierMatch]:
    sel = sum(1 << (4 * s) for s in range(slots))
    drops, alive, end = run_chains(masks[0], zip(starts[1:], masks[1:]), end, sel)
    return tier_matches(drops, alive, end, {s: f"w{s}" for s in range(slots)}, 4)


def _rows(masks: list[int], slots: int) -> np.ndarray:
    words = -(-4 * slots // 64)
    raw = b"".join(m.to_bytes(words * 8, "little") for m in masks)
    return np.frombuffer(raw, np.uint64).reshape(len(masks), words)


def _matrix(masks: list[int], starts: list[int], end: int, slots: int) -> dict[str, TierMatch]:
    runs = run_lengths(_rows(masks, slots), np.array(starts, np.int64), end)
    return matches_from_runs(runs, {s: f"w{s}" for s in range(slots)})


def test_a_ladder_held_in_gpu_then_cpu_then_ssd_gives_each_worker_its_split():
    # worker s holds blocks [0, 2s + 2) in gpu, 3 more in cpu, then 1 in ssd (tier bits 0, 1, 2)
    slots, end = 40, 200
    starts = list(range(end))
    masks = []
    for b in starts:
        m = 0
        for s in range(slots):
            g = 2 * s + 2
            tier = 0 if b < g else 1 if b < g + 3 else 2 if b < g + 4 else None
            if tier is not None:
                m |= 1 << (4 * s + tier)
        masks.append(m)
    got = _matrix(masks, starts, end, slots)
    assert got == {f"w{s}": TierMatch(2 * s + 2, 3, 1) for s in range(slots)}
    assert got == _walk(masks, starts, end, slots)


def test_a_worker_that_comes_back_keeps_the_run_it_had_before_its_first_hole():
    # w0 holds rows 0, 1, 3, 4 (a hole at row 2: starts 10..); w1 every row; w2 from row 1 only
    masks = [0b0001 | 0b0001 << 4, 0b0001 | 0b0001 << 4 | 0b0001 << 8, 0b0001 << 4 | 0b0001 << 8,
             0b0001 | 0b0001 << 4 | 0b0001 << 8, 0b0010 | 0b0010 << 4 | 0b0001 << 8]
    starts, end = [0, 5, 10, 12, 20], 30
    got = _matrix(masks, starts, end, 3)
    assert got == {"w0": TierMatch(10, 0, 0), "w1": TierMatch(20, 10, 0)}
    assert got == _walk(masks, starts, end, 3)


def test_speculative_bits_count_as_gpu_and_many_slots_leave_one_word_at_once():
    # 16 slots share word 0: all leave at row 1 together; slot 16 (word 1) holds speculatively
    first = sum(1 << (4 * s) for s in range(16)) | 1 << (4 * 16 + 3)
    masks = [first, 1 << (4 * 16 + 3), 1 << (4 * 16 + 1)]
    starts, end = [0, 7, 9], 11
    got = _matrix(masks, starts, end, 17)
    assert got == {**{f"w{s}": TierMatch(7, 0, 0) for s in range(16)}, "w16": TierMatch(9, 2, 0)}
    assert got == _walk(masks, starts, end, 17)


def random_rows(rng: random.Random, slots: int, n: int,
                tier_sets: tuple[int, ...] = (1, 1, 1, 2, 4, 8, 3, 6, 9)) -> tuple[list[int], list[int], int]:
    """``n`` rows of holder bits over ``slots`` workers (each row a nibble from ``tier_sets`` per
    holder; a worker leaves or comes back with chance 0.03 per row), their increasing starts from
    0 and the run's end. No row is empty: callers end the run before one."""
    starts = [0] + sorted(rng.sample(range(1, 5 * n), n - 1))
    end = starts[-1] + rng.randint(1, 5)
    masks = []
    holders = {s: rng.random() < 0.8 for s in range(slots)}
    for _ in range(n):
        m = 0
        for s in range(slots):
            if rng.random() < 0.03:
                holders[s] = not holders[s]  # a worker leaves, or comes back
            if holders[s]:
                m |= rng.choice(tier_sets) << (4 * s)
        masks.append(m or 1)
    return masks, starts, end


@pytest.mark.parametrize("seed", range(8))
def test_random_rows_answer_as_the_python_walk(seed):
    rng = random.Random(seed)
    slots = rng.choice((3, 16, 17, 70, 300))
    masks, starts, end = random_rows(rng, slots, rng.randint(1, 120))
    assert _matrix(masks, starts, end, slots) == _walk(masks, starts, end, slots)


@pytest.mark.parametrize("tier_bits", [0b0010, 0b0100, 0b0110])
def test_rows_held_in_cpu_or_ssd_only_give_no_gpu_run(tier_bits):
    # no row holds a gpu or speculative bit (nor, for ssd, a cpu one): those chains are empty
    slots = 20
    masks = [sum(tier_bits << (4 * s) for s in range(slots - r)) for r in range(10)]
    starts, end = list(range(0, 30, 3)), 30
    got = _matrix(masks, starts, end, slots)
    assert got == _walk(masks, starts, end, slots)
    assert got["w0"].gpu == 0 and got["w0"].total == 30 and got["w19"].total == 3
