"""In-process index backend: bitmasks of worker slots per key, so a lookup costs
O(prompt blocks + workers), whatever the number of workers holding each block.

Layout and memory:

- every worker gets a slot number (bit ``1 << slot``);
- ``_masks[key]`` is a 4-list ``[gpu_mask, cpu_mask, ssd_mask, speculative_mask]``;
- ``_owned[slot][tier]`` is the set of keys the worker holds in that tier (for clear/stats);
- a second (third...) copy of the same (key, slot, tier) goes to ``_extra_refs`` only when it
  happens (vLLM duplicates are rare), so the common case stores no counter at all.

Measured with ``sys.getsizeof`` on CPython 3.11 (x86_64): a key held by one worker in one tier
costs about 200 bytes (dict entry + int key + 4-list + small ints: ~120 B, plus the set entry in
``_owned``: ~80 B); each further worker holding the same key adds ~80 B (set entry; the mask ints
stay a few dozen bytes up to 64 workers). ``max_keys`` bounds the distinct keys: beyond it new
keys are not indexed (the index may under-report, never over-report) and ``dropped_keys`` counts
them.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

from kvcore.index.base import TIERS, KVIndex, TierMatch, WorkerIndexStats, check_tier

_SPEC = 3  # position of the speculative mask in a key's mask list
BYTES_PER_BLOCK_ESTIMATE = 200


class MemoryIndex(KVIndex):
    """The embedded index. ``max_keys``: bound on distinct keys (see module docstring);
    ``clock``: seconds, monotonic (injectable for tests)."""

    def __init__(self, max_keys: int = 20_000_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_keys = max_keys
        self._clock = clock
        self._masks: dict[int, list[int]] = {}
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._owned: dict[int, list[set[int]]] = {}
        self._extra_refs: dict[tuple[int, int, int], int] = {}
        self._spec_expiry: dict[tuple[int, int], float] = {}
        self._spec_heap: list[tuple[float, int, int]] = []
        self.dropped_keys = 0

    # ---- slots --------------------------------------------------------------------------------
    def _slot(self, worker: str) -> int:
        slot = self._slots.get(worker)
        if slot is None:
            slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._slots)
            self._slots[worker] = slot
            self._owned[slot] = [set() for _ in TIERS] + [set()]
        return slot

    # ---- writes -------------------------------------------------------------------------------
    async def store(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        self.store_sync(worker, tier, keys)

    def store_sync(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        """Synchronous :meth:`store` (the embedded agent calls it from its own loop)."""
        t = check_tier(tier)
        slot = self._slot(worker)
        bit = 1 << slot
        owned = self._owned[slot][t]
        masks = self._masks
        for key in keys:
            entry = masks.get(key)
            if entry is None:
                if len(masks) >= self.max_keys:
                    self.dropped_keys += 1
                    continue
                entry = masks[key] = [0, 0, 0, 0]
            if entry[t] & bit:
                ref = (key, slot, t)
                self._extra_refs[ref] = self._extra_refs.get(ref, 1) + 1
            else:
                entry[t] |= bit
                owned.add(key)

    async def remove(self, worker: str, tier: str, keys: Sequence[int]) -> int:
        return self.remove_sync(worker, tier, keys)

    def remove_sync(self, worker: str, tier: str, keys: Sequence[int]) -> int:
        """Synchronous :meth:`remove`; returns how many keys were not present."""
        t = check_tier(tier)
        slot = self._slots.get(worker)
        if slot is None:
            return len(keys)
        bit = 1 << slot
        owned = self._owned[slot][t]
        missing = 0
        for key in keys:
            entry = self._masks.get(key)
            if entry is None or not entry[t] & bit:
                missing += 1
                continue
            ref = (key, slot, t)
            n = self._extra_refs.get(ref)
            if n is not None:
                if n > 2:
                    self._extra_refs[ref] = n - 1
                else:
                    del self._extra_refs[ref]
                continue
            entry[t] &= ~bit
            owned.discard(key)
            if not any(entry):
                del self._masks[key]
        return missing

    async def clear_worker(self, worker: str, tier: str | None = None) -> None:
        self.clear_worker_sync(worker, tier)

    def clear_worker_sync(self, worker: str, tier: str | None = None) -> None:
        """Synchronous :meth:`clear_worker`; clearing all tiers also frees the worker's slot."""
        slot = self._slots.get(worker)
        if slot is None:
            return
        bit = 1 << slot
        positions = [check_tier(tier)] if tier is not None else [0, 1, 2, _SPEC]
        for t in positions:
            for key in self._owned[slot][t]:
                entry = self._masks.get(key)
                if entry is None:
                    continue
                entry[t] &= ~bit
                if not any(entry):
                    del self._masks[key]
            self._owned[slot][t].clear()
            if t == _SPEC:
                for k in [k for k in self._spec_expiry if k[1] == slot]:
                    del self._spec_expiry[k]
        if self._extra_refs:
            for ref in [r for r in self._extra_refs if r[1] == slot and r[2] in positions]:
                del self._extra_refs[ref]
        if tier is None:
            del self._slots[worker]
            del self._owned[slot]
            heapq.heappush(self._free_slots, slot)

    async def store_speculative(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        self.store_speculative_sync(worker, keys, ttl_s)

    def store_speculative_sync(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        """Synchronous :meth:`store_speculative`."""
        now = self._clock()
        self._expire(now)
        slot = self._slot(worker)
        bit = 1 << slot
        owned = self._owned[slot][_SPEC]
        expiry = now + ttl_s
        for key in keys:
            entry = self._masks.get(key)
            if entry is None:
                if len(self._masks) >= self.max_keys:
                    self.dropped_keys += 1
                    continue
                entry = self._masks[key] = [0, 0, 0, 0]
            entry[_SPEC] |= bit
            owned.add(key)
            self._spec_expiry[(key, slot)] = expiry
            heapq.heappush(self._spec_heap, (expiry, key, slot))

    def _expire(self, now: float) -> None:
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            _, key, slot = heapq.heappop(heap)
            current = self._spec_expiry.get((key, slot))
            if current is None or current > now:
                continue  # refreshed since, or already cleared
            del self._spec_expiry[(key, slot)]
            entry = self._masks.get(key)
            if entry is not None:
                entry[_SPEC] &= ~(1 << slot)
                if not any(entry):
                    del self._masks[key]
            owned = self._owned.get(slot)
            if owned is not None:
                owned[_SPEC].discard(key)

    # ---- reads --------------------------------------------------------------------------------
    async def match(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        return self.match_sync(keys)

    def match_sync(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        """Synchronous :meth:`match`. Three running ANDs of bitmasks from block 0: gpu
        (+speculative), gpu|cpu, and any tier; a worker's run in a chain ends where its bit drops
        out. One pass that stops at the first block no worker holds; a block held only in gpu by
        every still-running worker costs one AND and a compare."""
        if self._spec_heap:
            self._expire(self._clock())
        if not keys or not self._slots:
            return {}
        get = self._masks.get
        e = get(keys[0])
        if e is None:
            return {}
        g = e[0] | e[3]
        gc = g | e[1]
        a = gc | e[2]
        drops: list[tuple[int, int, int, int]] = []
        end = len(keys)
        for i, e in enumerate(map(get, keys[1:]), 1):
            if e is None:
                end = i
                break
            if e[1] or e[2] or e[3]:
                ng, ngc, na = g & (e[0] | e[3]), gc & (e[0] | e[1] | e[3]), a & (e[0] | e[1] | e[2] | e[3])
                if ng == g and ngc == gc and na == a:
                    continue
            else:
                m = e[0]
                if a & m == a:  # every running worker holds it (g and gc are subsets of a)
                    continue
                ng, ngc, na = g & m, gc & m, a & m
            drops.append((g & ~ng, gc & ~ngc, a & ~na, i))
            g, gc, a = ng, ngc, na
            if not a:
                end = i
                break
        names = {slot: name for name, slot in self._slots.items()}
        return tier_matches(drops, (g, gc, a), end, names, 1)

    async def stats(self) -> dict[str, WorkerIndexStats]:
        return self.stats_sync()

    def stats_sync(self) -> dict[str, WorkerIndexStats]:
        """Synchronous :meth:`stats`."""
        if self._spec_heap:
            self._expire(self._clock())
        out = {}
        for worker, slot in self._slots.items():
            owned = self._owned[slot]
            out[worker] = WorkerIndexStats(
                blocks={t: len(owned[i]) for i, t in enumerate(TIERS)},
                speculative_blocks=len(owned[_SPEC]))
        return out

    def __len__(self) -> int:
        """Distinct keys indexed."""
        return len(self._masks)



def tier_matches(drops: Sequence[tuple[int, int, int, int]], alive: tuple[int, int, int], end: int,
                 names: dict[int, str], stride: int) -> dict[str, TierMatch]:
    """Per worker :class:`TierMatch` from one pass of the three chains (gpu, gpu|cpu, any).

    ``drops``: ``(gpu bits, gpu|cpu bits, any bits, i)`` that left each chain at block ``i``;
    ``alive``: the chains' bits still set after block ``end - 1``. A worker's bit sits at position
    ``stride * slot``; ``names``: slot -> worker id (unknown slots are left out).
    """
    runs: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
    for dg, dgc, da, i in drops:
        if dg:
            _record(runs[0], dg, i)
        if dgc:
            _record(runs[1], dgc, i)
        if da:
            _record(runs[2], da, i)
    for chain, bits in enumerate(alive):
        if bits:
            _record(runs[chain], bits, end)
    gpu_run, gc_run, any_run = runs
    out: dict[str, TierMatch] = {}
    for pos, total in any_run.items():
        worker = names.get(pos // stride)
        if worker is None:
            continue
        g = gpu_run.get(pos, 0)
        gc = max(gc_run.get(pos, 0), g)
        out[worker] = TierMatch(gpu=g, cpu=gc - g, ssd=total - gc)
    return out


def _record(lengths: dict[int, int], bits: int, length: int) -> None:
    while bits:
        low = bits & -bits
        lengths[low.bit_length() - 1] = length
        bits ^= low
