"""Choosing among scored candidates: lowest first with tie-breaks, and softmax sampling. Pure
functions of their inputs; the only randomness is the caller's ``rand`` draw in [0, 1).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

EPS = 1e-9  # figures closer than this (in blocks) are equal


def lowest(items: Sequence[T], keys: Sequence[Callable[[T], float]], name: Callable[[T], str],
           rand: float) -> T:
    """The item lowest by ``keys[0]``, ties (within :data:`EPS`) broken by ``keys[1]``, and so on;
    the items still tied are put in ``name`` order and ``rand`` picks one (rand 0 -> the first), so
    equal workers share cold traffic instead of all of it going to one. ``items`` must be
    non-empty."""
    tied = list(items)
    for key in keys:
        if len(tied) == 1:  # nothing left to break: the later keys would keep it
            return tied[0]
        values = list(map(key, tied))  # each item's key once (it is read twice below)
        cut = min(values) + EPS
        tied = [i for i, v in zip(tied, values) if v <= cut]
    tied.sort(key=name)
    return tied[_index(rand, len(tied))]


def softmax_pick(costs: Sequence[float], temperature: float, rand: float) -> int:
    """Index drawn with probability proportional to ``exp(-(cost - min) / (temperature * span))``
    where ``span = max - min`` of ``costs`` (costs min-max normalised, as Dynamo does, so the
    temperature has no unit: 0.1 sharp, 1 mild, large = uniform). All costs equal -> uniform.
    ``rand`` in [0, 1) walks the cumulative distribution in the given order. ``temperature`` > 0."""
    lo, hi = min(costs), max(costs)
    span = hi - lo
    if span <= EPS:
        return _index(rand, len(costs))
    weights = [math.exp(-(c - lo) / (temperature * span)) for c in costs]
    target = min(max(rand, 0.0), 1.0) * sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if target < acc:
            return i
    return len(costs) - 1


def _index(rand: float, n: int) -> int:
    return min(n - 1, max(0, int(rand * n)))


def chosen_first(items: Sequence[T], chosen: T, key: Callable[[T], object]) -> list[T]:
    """``chosen``, then the other items sorted by ``key`` (a decision's scores, best first)."""
    return [chosen] + sorted((i for i in items if i is not chosen), key=key)
