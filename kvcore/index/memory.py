"""In-process index backend: one int of worker bits per key, so a lookup costs
O(prompt blocks + workers), whatever the number of workers holding each block.

Layout and memory:

- every worker gets a slot number ``s``; a key's entry ``_masks[key]`` is one int whose bit
  ``4*s + t`` is set when worker ``s`` holds the key in tier ``t`` (0 gpu, 1 cpu, 2 ssd,
  3 speculative), the same layout as the Redis backend's bitmaps. One int (not a list of four)
  means one object per key: fewer memory loads per lookup step, and nothing for Python's cyclic
  garbage collector to traverse (a list per key made every full collection walk millions of
  objects while the gateway served);
- ``_owned[slot][tier]`` is the set of keys the worker holds in that tier (for clear/stats);
- a second (third...) copy of the same (key, slot, tier) goes to ``_extra_refs`` only when it
  happens (vLLM duplicates are rare), so the common case stores no counter at all.

Memory (CPython 3.11, x86_64): ``benchmarks/bench_agent.py`` measures ~190 B of RSS per (block,
worker) entry with 64 workers x 100k distinct blocks (dict entry + int key + int value, ~60 B of
them the value int at 64 workers, plus the set entry in ``_owned``); a list of four masks per key
cost ~270 B. Each further worker holding the same key adds a set entry (~80 B). ``max_keys``
bounds the distinct keys: beyond it new keys are not indexed (the index may under-report, never
over-report) and ``dropped_keys`` counts them.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

from kvcore.index.base import TIERS, KVIndex, TierMatch, WorkerIndexStats, check_tier

_SPEC = 3  # bit of a slot's nibble for speculative entries (after gpu, cpu, ssd)
_STRIDE = 4  # bits per slot in a key's int


class MemoryIndex(KVIndex):
    """The embedded index. ``max_keys``: bound on distinct keys (see module docstring);
    ``clock``: seconds, monotonic (injectable for tests)."""

    def __init__(self, max_keys: int = 20_000_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_keys = max_keys
        self._clock = clock
        self._masks: dict[int, int] = {}
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._owned: dict[int, list[set[int]]] = {}
        self._extra_refs: dict[tuple[int, int, int], int] = {}
        self._spec_expiry: dict[tuple[int, int], float] = {}
        self._spec_heap: list[tuple[float, int, int]] = []
        self._gpu_sel = 0  # bit 4*s for every slot s below the highest one handed out
        self.dropped_keys = 0

    # ---- slots --------------------------------------------------------------------------------
    def _slot(self, worker: str) -> int:
        slot = self._slots.get(worker)
        if slot is None:
            slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._slots)
            self._slots[worker] = slot
            self._owned[slot] = [set() for _ in TIERS] + [set()]
            self._gpu_sel |= 1 << (_STRIDE * slot)
        return slot

    # ---- writes -------------------------------------------------------------------------------
    async def store(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        self.store_sync(worker, tier, keys)

    def store_sync(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        """Synchronous :meth:`store`, for callers outside an event loop (benchmarks, tests).
        Raises ValueError on an unknown tier."""
        t = check_tier(tier)
        slot = self._slot(worker)
        bit = 1 << (_STRIDE * slot + t)
        owned = self._owned[slot][t]
        masks = self._masks
        for key in keys:
            v = masks.get(key)
            if v is None:
                if len(masks) >= self.max_keys:
                    self.dropped_keys += 1
                    continue
                v = 0
            if v & bit:
                ref = (key, slot, t)
                self._extra_refs[ref] = self._extra_refs.get(ref, 1) + 1
            else:
                masks[key] = v | bit
                owned.add(key)

    async def remove(self, worker: str, tier: str, keys: Sequence[int]) -> int:
        return self.remove_sync(worker, tier, keys)

    def remove_sync(self, worker: str, tier: str, keys: Sequence[int]) -> int:
        """Synchronous :meth:`remove`; returns how many keys were not present."""
        t = check_tier(tier)
        slot = self._slots.get(worker)
        if slot is None:
            return len(keys)
        if t == 0 and self._owned[slot][_SPEC]:
            self._drop_speculative(slot, keys)
        bit = 1 << (_STRIDE * slot + t)
        owned = self._owned[slot][t]
        masks = self._masks
        missing = 0
        for key in keys:
            v = masks.get(key)
            if v is None or not v & bit:
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
            owned.discard(key)
            v ^= bit
            if v:
                masks[key] = v
            else:
                del masks[key]
        return missing

    async def clear_worker(self, worker: str, tier: str | None = None) -> None:
        self.clear_worker_sync(worker, tier)

    def clear_worker_sync(self, worker: str, tier: str | None = None) -> None:
        """Synchronous :meth:`clear_worker`; clearing all tiers also frees the worker's slot."""
        slot = self._slots.get(worker)
        if slot is None:
            return
        positions = [check_tier(tier)] if tier is not None else [0, 1, 2, _SPEC]
        masks = self._masks
        for t in positions:
            keep = ~(1 << (_STRIDE * slot + t))
            for key in self._owned[slot][t]:
                v = masks.get(key)
                if v is None:
                    continue
                v &= keep
                if v:
                    masks[key] = v
                else:
                    del masks[key]
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
        now = self._clock()
        self._expire(now)
        slot = self._slot(worker)
        bit = 1 << (_STRIDE * slot + _SPEC)
        owned = self._owned[slot][_SPEC]
        masks = self._masks
        expiry = now + ttl_s
        for key in keys:
            v = masks.get(key)
            if v is None:
                if len(masks) >= self.max_keys:
                    self.dropped_keys += 1
                    continue
                v = 0
            masks[key] = v | bit
            owned.add(key)
            self._spec_expiry[(key, slot)] = expiry
            heapq.heappush(self._spec_heap, (expiry, key, slot))

    def _drop_speculative(self, slot: int, keys: Sequence[int]) -> None:
        """Clear ``slot``'s speculative bit of each key (its heap entries then expire as stale)."""
        spec_owned = self._owned[slot][_SPEC]
        bit = 1 << (_STRIDE * slot + _SPEC)
        for key in keys:
            if key not in spec_owned:
                continue
            spec_owned.discard(key)
            self._spec_expiry.pop((key, slot), None)
            v = self._masks.get(key)
            if v is not None:
                v &= ~bit
                if v:
                    self._masks[key] = v
                else:
                    del self._masks[key]

    def _expire(self, now: float) -> None:
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            _, key, slot = heapq.heappop(heap)
            current = self._spec_expiry.get((key, slot))
            if current is None or current > now:
                continue  # refreshed since, or already cleared
            del self._spec_expiry[(key, slot)]
            v = self._masks.get(key)
            if v is not None:
                v &= ~(1 << (_STRIDE * slot + _SPEC))
                if v:
                    self._masks[key] = v
                else:
                    del self._masks[key]
            owned = self._owned.get(slot)
            if owned is not None:
                owned[_SPEC].discard(key)

    # ---- reads --------------------------------------------------------------------------------
    async def match(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        return self.match_sync(keys)

    def match_sync(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        """Synchronous :meth:`match`. Three running ANDs of worker bits (at position ``4*slot``)
        from block 0: gpu (+speculative), gpu|cpu, and any tier; a worker's run in a chain ends
        where its bit drops out. One pass that stops at the first block no worker holds; a block
        that every still-running worker holds in gpu costs one AND and a compare."""
        if self._spec_heap:
            self._expire(self._clock())
        if not keys or not self._slots:
            return {}
        get = self._masks.get
        v = get(keys[0])
        if v is None:
            return {}
        sel = self._gpu_sel
        g = (v | v >> 3) & sel
        gc = (v | v >> 1 | v >> 3) & sel
        a = (v | v >> 1 | v >> 2 | v >> 3) & sel
        drops: list[tuple[int, int, int, int]] = []
        end = len(keys)
        for i, v in enumerate(map(get, keys[1:]), 1):
            if v is None:
                end = i
                break
            if a & v == a:  # every running worker holds it in gpu (g and gc are subsets of a)
                continue
            ng, ngc, na = g & (v | v >> 3), gc & (v | v >> 1 | v >> 3), a & (v | v >> 1 | v >> 2 | v >> 3)
            if ng == g and ngc == gc and na == a:
                continue
            drops.append((g & ~ng, gc & ~ngc, a & ~na, i))
            g, gc, a = ng, ngc, na
            if not a:
                end = i
                break
        names = {slot: name for name, slot in self._slots.items()}
        return tier_matches(drops, (g, gc, a), end, names, _STRIDE)

    async def stats(self) -> dict[str, WorkerIndexStats]:
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
    # run length per chain, keyed by bit position + 1 (int.bit_length of a one-bit int)
    gpu_run: dict[int, int] = {}
    gc_run: dict[int, int] = {}
    any_run: dict[int, int] = {}
    for dg, dgc, da, i in drops:  # mostly one worker per chain per drop: no loop, no call
        if dg:
            if dg & (dg - 1):
                _record(gpu_run, dg, i)
            else:
                gpu_run[dg.bit_length()] = i
        if dgc:
            if dgc & (dgc - 1):
                _record(gc_run, dgc, i)
            else:
                gc_run[dgc.bit_length()] = i
        if da:
            if da & (da - 1):
                _record(any_run, da, i)
            else:
                any_run[da.bit_length()] = i
    for run, bits in zip((gpu_run, gc_run, any_run), alive):
        if bits:
            _record(run, bits, end)
    out: dict[str, TierMatch] = {}
    for pos, total in any_run.items():
        worker = names.get((pos - 1) // stride)
        if worker is None:
            continue
        g = gpu_run.get(pos, 0)
        gc = gc_run.get(pos, 0)
        if gc < g:
            gc = g
        out[worker] = TierMatch(g, gc - g, total - gc)  # gpu, cpu, ssd
    return out


def _record(lengths: dict[int, int], bits: int, length: int) -> None:
    while bits:
        low = bits & -bits
        lengths[low.bit_length()] = length
        bits ^= low
