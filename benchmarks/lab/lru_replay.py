"""What placement alone can do against workers that evict least-recently-used blocks: replay a
workload's prompts, in send order, through one LRU prefix cache per worker, under a given
placement (which worker each request goes to), and search the static placements of its
conversations for the best hit rate.

:mod:`kvbench.capacity` bounds every router by Belady's eviction over the cluster's
memory. Real engines do not evict that way: vLLM keeps free blocks in one queue and takes the
least recently freed first, a finished request's blocks freed tail first (vLLM v1
``KVCacheManager.free``: "free blocks in reverse order so that the tail blocks are evicted
first"), so a prompt loses its end before its start. A router only chooses where requests go.
This module answers how much of the Belady bound that choice can reach on a given workload: if
the best placement found still leaves the median request uncached, no router reaches a TTFT
median far below round robin's there, whatever it knows.

The model: a request hits the longest run of its full blocks from block 0 that its worker holds,
capped like vLLM at ``(len - 1) // block_size`` blocks; then all its blocks are touched, last
block first, and the least recently touched blocks beyond the worker's capacity are dropped.
Requests run one after another (no overlap, no blocks pinned by running requests), so it is a
model of eviction order, not of timing.

Pure computation, no I/O.
"""
from __future__ import annotations

import random
import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcore.block_keys import block_keys


class LRUPrefixCache:
    """One worker's prefix cache of ``capacity_blocks`` blocks (>= 0) with vLLM's eviction order
    (module docstring). Keys are any hashables (block keys)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict = OrderedDict()  # least recently touched first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key) -> bool:
        return key in self._blocks

    def cached_blocks(self, keys: Sequence, limit: int) -> int:
        """How many of ``keys[:limit]`` the cache holds contiguously from the first."""
        n = 0
        for key in keys[:max(0, limit)]:
            if key not in self._blocks:
                break
            n += 1
        return n

    def run(self, keys: Sequence) -> None:
        """A request over ``keys`` ran: touch them, last first, then evict down to capacity."""
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


def touched_blocks(ids: Sequence[int], block_size: int, output_tokens: int, request: int) -> list:
    """The blocks a request over prompt ``ids`` leaves cached: its full prompt blocks' keys, then
    one key of its own per full block its ``output_tokens`` complete (request number
    ``request`` makes them unique: no later prompt matches generated tokens)."""
    generated = (len(ids) + output_tokens) // block_size - len(ids) // block_size
    return block_keys(list(ids), block_size, "bench") + [("generated", request, j) for j in range(generated)]


@dataclass(frozen=True)
class Replay:
    """One replay's outcome: ``cached_tokens`` and ``uncached_tokens`` per request (send order);
    ``hit_rate`` is cached over all prompt tokens (0.0 for no tokens)."""

    cached_tokens: list[int]
    uncached_tokens: list[int]
    hit_rate: float

    @property
    def median_uncached_tokens(self) -> float:
        """The median request's tokens to prefill (0.0 for no requests)."""
        return float(statistics.median(self.uncached_tokens)) if self.uncached_tokens else 0.0


def replay(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int,
           placement: Sequence[int], output_tokens: int = 0) -> Replay:
    """Send prompt ``i`` (token ids) to worker ``placement[i]`` (0-based), in order, through one
    :class:`LRUPrefixCache` of ``capacity_blocks`` per worker. ``output_tokens`` generated per
    request: the full blocks they complete after the prompt's are cached too (vLLM caches a
    block once it is full, generated tokens included) and take room, though no later prompt
    matches them. Raises ValueError on a block size < 1, negative output tokens, or a placement
    of another length than ``prompts`` or with a negative worker."""
    if len(placement) != len(prompts) or any(w < 0 for w in placement):
        raise ValueError("placement needs one worker index >= 0 per prompt")
    workers = max(placement, default=-1) + 1
    return _replay(prompts, block_size, capacity_blocks, workers, output_tokens,
                   lambda i, caches, keys, limit: placement[i])


def longest_prefix_replay(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int,
                          workers: int, output_tokens: int = 0) -> Replay:
    """:func:`replay` where each request goes to the worker holding its longest cached prefix at
    that moment (what an exact KV-aware router does with no load to weigh), request ``i`` to
    worker ``i mod workers`` when none holds any of it. Raises ValueError as :func:`replay`
    does, and on ``workers`` < 1."""
    if workers < 1:
        raise ValueError("workers must be >= 1")

    def longest(i: int, caches: list[LRUPrefixCache], keys: list, limit: int) -> int:
        held = [c.cached_blocks(keys, limit) for c in caches]
        return held.index(max(held)) if max(held) > 0 else i % workers

    return _replay(prompts, block_size, capacity_blocks, workers, output_tokens, longest)


def _replay(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int, workers: int,
            output_tokens: int, choose: Callable[[int, list[LRUPrefixCache], list, int], int]) -> Replay:
    """The replay loop: ``choose(i, caches, keys, limit)`` picks request ``i``'s worker from the
    caches as they are when it is sent (``keys``: its blocks, ``limit``: vLLM's cap)."""
    if block_size < 1 or output_tokens < 0:
        raise ValueError("block_size must be >= 1 and output_tokens >= 0")
    caches = [LRUPrefixCache(capacity_blocks) for _ in range(workers)]
    cached, uncached = [], []
    for i, ids in enumerate(prompts):
        keys = touched_blocks(ids, block_size, output_tokens, i)
        limit = (len(ids) - 1) // block_size
        cache = caches[choose(i, caches, keys, limit)]
        hit = cache.cached_blocks(keys, limit) * block_size
        cached.append(hit)
        uncached.append(len(ids) - hit)
        cache.run(keys)
    total = sum(len(ids) for ids in prompts)
    return Replay(cached, uncached, sum(cached) / total if total else 0.0)


def static_placement(groups: Sequence[str], assignment: dict[str, int]) -> list[int]:
    """Per request, the worker its group (conversation) is assigned to."""
    return [assignment[g] for g in groups]


def best_static_placement(prompts: Sequence[Sequence[int]], groups: Sequence[str], block_size: int,
                          capacity_blocks: int, workers: int, tries: int = 400,
                          seed: int = 0, output_tokens: int = 0) -> tuple[Replay, dict[str, int]]:
    """The best hit rate found over ``tries`` random static placements of the groups
    (conversations) on ``workers`` workers, every split of group counts between the workers
    tried alike (a random count for worker 0, the rest spread evenly), plus the group-per-worker
    round robin (``output_tokens``: as in :func:`replay`). Returns the best :class:`Replay` and
    its assignment. Raises ValueError on ``workers`` < 1, ``tries`` < 0 or ``groups`` of another
    length than ``prompts``."""
    if workers < 1 or tries < 0:
        raise ValueError("workers must be >= 1 and tries >= 0")
    if len(groups) != len(prompts):
        raise ValueError("groups needs one group per prompt")
    names = list(dict.fromkeys(groups))
    rng = random.Random(seed)
    candidates = [{g: i % workers for i, g in enumerate(names)}]
    for _ in range(tries):
        order = names[:]
        rng.shuffle(order)
        first = rng.randint(min(1, len(order)), len(order)) if workers > 1 else len(order)
        assignment = {g: 0 for g in order[:first]}
        assignment.update({g: 1 + i % (workers - 1) for i, g in enumerate(order[first:])} if workers > 1 else {})
        candidates.append(assignment)
    best: tuple[Replay, dict[str, int]] | None = None
    for assignment in candidates:
        result = replay(prompts, block_size, capacity_blocks, static_placement(groups, assignment), output_tokens)
        if best is None or result.hit_rate > best[0].hit_rate:
            best = (result, assignment)
    assert best is not None
    return best
