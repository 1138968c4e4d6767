"""The most any router could hit with the cluster's KV memory: an upper bound on the prefix hit
rate of a workload when all workers together hold ``capacity_blocks`` blocks.

The ideal hit rate (:func:`kvbench.workload.ideal_cached_tokens`) assumes a cache that
never evicts. Under KV pressure that is out of reach for any router, and a target written against
it (or against a peer) cannot tell "the router placed badly" from "no placement could do
better". This bound answers the second: the prompts, in send order, go through one cache of
``capacity_blocks`` blocks shared by every worker, run with Belady's rule (evict the block whose
next use is furthest away: the optimal eviction for hits when the future is known; L. A. Belady,
"A study of replacement algorithms for a virtual-storage computer", IBM Systems Journal 5(2),
1966), and every cached block of a prompt counts, contiguous from block 0 or not.

Why it bounds every router on N workers of ``capacity_blocks / N`` blocks each, whatever their
eviction: the blocks the N caches hold at any moment fit in one cache of the total, so a request's
hit on its worker is also a hit in the shared cache; Belady maximises the shared cache's block
hits; a prefix hit counts only blocks contiguous from block 0, a subset. The bound is loose where
real engines lose room: generated tokens' blocks, blocks pinned by running requests and vLLM's
null block are not charged, and no block is ever recomputed twice.

Pure computation, no I/O.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvcore.block_keys import block_keys


def capacity_cached_tokens(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int) -> list[int]:
    """For each prompt in send order, the tokens a shared cache of ``capacity_blocks`` blocks run
    with Belady's rule would serve (module docstring): its cached full blocks among the first
    ``(len - 1) // block_size`` (vLLM computes at least the last prompt token), times
    ``block_size``.

    ``prompts``: token id lists; ``block_size`` > 0 tokens; ``capacity_blocks`` >= 0 (0: nothing
    is ever cached). Returns ints, multiples of ``block_size``, each at most the ideal's
    (:func:`kvbench.workload.ideal_cached_tokens`). Raises ValueError on a block size < 1 or a
    negative capacity.
    """
    if block_size < 1 or capacity_blocks < 0:
        raise ValueError("block_size must be >= 1 and capacity_blocks >= 0")
    chains = [list(dict.fromkeys(block_keys(list(ids), block_size, "bench"))) for ids in prompts]
    never = len(chains)
    next_use: list[list[int]] = [[] for _ in chains]  # per request, per block: next request using it
    later: dict[int, int] = {}
    for i in range(len(chains) - 1, -1, -1):
        next_use[i] = [later.get(key, never) for key in chains[i]]
        for key in chains[i]:
            later[key] = i
    cached: dict[int, int] = {}  # block key -> its next use
    furthest: list[tuple[int, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    out = []
    for i, (ids, keys) in enumerate(zip(prompts, chains)):
        creditable = (len(ids) - 1) // block_size if ids else 0
        out.append(sum(1 for key in keys[:creditable] if key in cached) * block_size)
        for depth, (key, nxt) in enumerate(zip(keys, next_use[i])):
            cached[key] = nxt
            heapq.heappush(furthest, (-nxt, -depth, key))
        while len(cached) > capacity_blocks:
            neg_next, _, key = heapq.heappop(furthest)
            if cached.get(key) == -neg_next:
                del cached[key]
    return out


def capacity_hit_rate(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int) -> float:
    """:func:`capacity_cached_tokens` over all prompt tokens (0 for no tokens): the bound on the
    hit rate any router reaches with ``capacity_blocks`` KV blocks in the whole cluster."""
    total = sum(len(ids) for ids in prompts)
    return sum(capacity_cached_tokens(prompts, block_size, capacity_blocks)) / total if total else 0.0
