"""In-process index backend: one int of worker bits per key, so a lookup costs
O(prompt blocks + workers), whatever the number of workers holding each block.

Layout and memory:

- every worker gets a slot number ``s``; a key's entry ``_masks[key]`` is one int whose bit
  ``4*s + t`` is set when worker ``s`` holds the key in tier ``t`` (0 gpu, 1 cpu, 2 ssd,
  3 speculative), the same layout as the Redis backend's bitmaps. One int (not a list of four)
  means one object per key: fewer memory loads per lookup step, and nothing for Python's cyclic
  garbage collector to traverse (a list per key would make every full collection walk millions
  of objects while the gateway serves);
- ``_owned[slot][tier]`` holds the keys the worker holds in that tier (for clear/stats) as the
  keys of a plain dict with ``None`` values, not a set: CPython never tracks a dict of ints and
  ``None`` in its cyclic collector, while a set is always tracked and each full collection walks
  every entry (a pause for every request in flight that grows with the index);
- a second (third...) copy of the same (key, slot, tier) goes to ``_extra_refs`` only when it
  happens (vLLM duplicates are rare), so the common case stores no counter at all.

Memory: per (block, worker) entry, a dict entry, an int key and an int value (4 bits per worker
slot, so it grows with the worker count), plus the entry in ``_owned``. Each further worker
holding the same key adds an ``_owned`` entry. Once a slot numbered 64 or higher has been handed
out, the values written are shared: every mask value is one object (``_shared``) that all keys
with that value hold, so a key costs its dict entries whatever the mask's width, and a lookup
finds equal neighbours by identity; when a new value would make the table at least twice its
size after the last sweep (plus 4,096), the values no key holds any longer are swept. The dicts
in ``_owned`` take a few bytes per entry more than sets would, the price of never being walked by
the GC (bytes per entry, measured: docs/tuning/memory_index.md). ``max_keys`` bounds the distinct keys: beyond it new keys are not
indexed (the index may under-report, never over-report) and ``dropped_keys`` counts them.
"""
from __future__ import annotations

import heapq
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator, KeysView, Sequence
from itertools import compress, repeat
from operator import ne

import numpy as np

from kvcore.index.base import TIERS, KVIndex, TierMatch, WorkerIndexStats, check_tier
import kvcore.index.chain_rows as chain_rows
from kvcore.index.chain_rows import matches_from_runs, row_matches

_SPEC = 3  # bit of a slot's nibble for speculative entries (after gpu, cpu, ssd)
_STRIDE = 4  # bits per slot in a key's int
_FEW_BITS = 16  # _record peels off at most this many bits one by one
_MANY_WORKERS = 64  # tier_matches goes through numpy beyond this many workers and drops
# match_sync reads a prompt of at least _ROWS_MIN_BLOCKS blocks as rows of one matrix
# (kvcore.index.chain_rows) when its entries are wider than _NARROW_BITS bits (more than 128
# worker slots); narrower ints cost little to walk one by one
_ROWS_MIN_BLOCKS = 64
_NARROW_BITS = 4 * 128
# once a slot numbered 64 or higher is handed out (masks wider than 256 bits), every mask value
# written is one object that all keys with that value hold (MemoryIndex._share)
_SHARED_FROM_BITS = 256
_SWEEP_MIN = 4096


class MemoryIndex(KVIndex):
    """The embedded index. ``max_keys``: bound on distinct keys (see module docstring);
    ``clock``: seconds, monotonic (injectable for tests); ``slot_of``: worker id -> slot number,
    when another structure numbers the workers (the host index's speculative overlay,
    :mod:`kvcore.index.host`); by default this index numbers them itself, lowest free first."""

    def __init__(self, max_keys: int = 20_000_000, clock: Callable[[], float] = time.monotonic,
                 slot_of: Callable[[str], int] | None = None) -> None:
        self.max_keys = max_keys
        self._clock = clock
        self._slot_of = slot_of
        self._masks: dict[int, int] = {}
        self._slots: dict[str, int] = {}
        self._names_of_slots: dict[int, str] | None = {}  # slot -> worker; None after a change
        self._free_slots: list[int] = []
        # slot -> [gpu keys, cpu keys, ssd keys, {speculative key: expiry}]
        self._owned: dict[int, list] = {}
        self._extra_refs: dict[tuple[int, int, int], int] = {}
        # one entry per store_speculative call: (expiry, call number, slot, its keys)
        self._spec_heap: list[tuple[float, int, int, Sequence[int]]] = []
        self._spec_calls = 0
        self._gpu_sel = 0  # bit 4*s for every slot s handed out so far (never cleared)
        self.dropped_keys = 0
        self._shared: dict[int, int] = {}  # mask value -> the one object keys with it hold
        self._shared_kept = 0  # len(_shared) after the last sweep

    # ---- slots --------------------------------------------------------------------------------
    def _slot(self, worker: str) -> int:
        slot = self._slots.get(worker)
        if slot is None:
            if self._slot_of is not None:
                slot = self._slot_of(worker)
            else:
                slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._slots)
            self._slots[worker] = slot
            self._names_of_slots = None
            self._owned[slot] = [{} for _ in TIERS] + [{}]  # untracked by the cyclic GC (docstring)
            self._gpu_sel |= 1 << (_STRIDE * slot)
        return slot

    def _sharing(self) -> Callable[[int], int] | None:
        """:meth:`_share` once some slot is past the 64th (masks can be wide), else None."""
        return self._share if self._gpu_sel >> _SHARED_FROM_BITS else None

    def _share(self, v: int) -> int:
        """The one object of mask value ``v``: every key with that value holds it, so memory per
        key does not grow with the mask's width and a lookup's equal neighbours compare by
        identity. Before adding a new value to a table at least twice its size after the last
        sweep (plus :data:`_SWEEP_MIN`), sweeps the values no key holds any longer."""
        shared = self._shared
        one = shared.get(v)
        if one is None:
            if len(shared) >= 2 * self._shared_kept + _SWEEP_MIN:
                self._sweep_shared()
            shared[v] = one = v
        return one

    def _sweep_shared(self) -> None:
        """Drop the shared values only the table itself references (CPython's reference count,
        measured against a value known to be held by the table alone: :data:`_TABLE_ONLY_REFS`)."""
        shared = self._shared
        for v in [v for v, refs in _reference_counts(shared) if refs <= _TABLE_ONLY_REFS]:
            del shared[v]
        self._shared_kept = len(shared)

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
        share = self._sharing()
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
                masks[key] = share(v | bit) if share else v | bit
                owned[key] = None

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
        extra = self._extra_refs
        share = self._sharing()
        missing = 0
        for key in keys:
            v = masks.get(key)
            if v is None or not v & bit:
                missing += 1
                continue
            if extra and drop_extra_copy(extra, (key, slot, t)):
                continue
            owned.pop(key, None)
            v ^= bit
            if v:
                masks[key] = share(v) if share else v
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
        share = self._sharing()
        for t in positions:
            keep = ~(1 << (_STRIDE * slot + t))
            for key in self._owned[slot][t]:
                v = masks.get(key)
                if v is None:
                    continue
                v &= keep
                if v:
                    masks[key] = share(v) if share else v
                else:
                    del masks[key]
            self._owned[slot][t].clear()
        if self._extra_refs:
            for ref in [r for r in self._extra_refs if r[1] == slot and r[2] in positions]:
                del self._extra_refs[ref]
        if tier is None:
            del self._slots[worker]
            self._names_of_slots = None
            del self._owned[slot]
            if self._slot_of is None:
                heapq.heappush(self._free_slots, slot)

    async def store_speculative(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        self.store_speculative_sync(worker, keys, ttl_s)

    def store_speculative_sync(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        """Synchronous :meth:`store_speculative`: ``keys`` count as gpu on ``worker`` for ``ttl_s``
        seconds of this index's clock (a later call refreshes the expiry, earlier or later).
        One heap entry per call, not per key, so a long prompt's thousands of keys cost one heap
        push, not thousands (timings: docs/tuning/memory_index.md)."""
        now = self._clock()
        self._expire(now)
        slot = self._slot(worker)
        bit = 1 << (_STRIDE * slot + _SPEC)
        spec = self._owned[slot][_SPEC]
        masks = self._masks
        get = masks.get
        share = self._sharing()
        expiry = now + ttl_s
        for key in keys:
            v = get(key)
            if v is None:
                if len(masks) >= self.max_keys:
                    self.dropped_keys += 1
                    continue
                masks[key] = share(bit) if share else bit
            elif not v & bit:
                masks[key] = share(v | bit) if share else v | bit
            spec[key] = expiry
        self._spec_calls += 1
        batch = keys if isinstance(keys, tuple) else tuple(keys)
        heapq.heappush(self._spec_heap, (expiry, self._spec_calls, slot, batch))

    def _drop_speculative(self, slot: int, keys: Sequence[int]) -> None:
        """Clear ``slot``'s speculative bit of each key (its heap entries then expire as stale)."""
        spec = self._owned[slot][_SPEC]
        bit = 1 << (_STRIDE * slot + _SPEC)
        share = self._sharing()
        for key in keys:
            if spec.pop(key, None) is None:
                continue
            v = self._masks.get(key)
            if v is not None:
                v &= ~bit
                if v:
                    self._masks[key] = share(v) if share else v
                else:
                    del self._masks[key]

    def expire_sync(self) -> None:
        """Drop the speculative entries whose TTL has passed (lookups do it too; calling this
        from a background task keeps that work off them)."""
        if self._spec_heap:
            self._expire(self._clock())

    def _expire(self, now: float) -> None:
        """Drop the speculative entries past their expiry. A due heap entry names a call's keys;
        of those, each whose current expiry is past goes (a later call may have refreshed it; a
        slot freed and handed to another worker meanwhile only holds entries that are due too)."""
        heap = self._spec_heap
        masks = self._masks
        share = self._sharing()
        while heap and heap[0][0] <= now:
            _, _, slot, keys = heapq.heappop(heap)
            owned = self._owned.get(slot)
            if owned is None:
                continue
            spec = owned[_SPEC]
            if not spec:
                continue
            keep = ~(1 << (_STRIDE * slot + _SPEC))
            for key in keys:
                exp = spec.get(key)
                if exp is None or exp > now:
                    continue  # refreshed since, or already dropped
                del spec[key]
                v = masks.get(key)
                if v is not None:
                    v &= keep
                    if v:
                        masks[key] = share(v) if share else v
                    else:
                        del masks[key]

    # ---- primitives for a replica of the Redis index (kvcore.index.redis_mirror) -----------------
    def load_steps(self, parts: Sequence[tuple[str, str, bytes]], step_keys: int = 65_536) -> Iterator[None]:
        """Fill this empty index with ``parts``: ``(worker, tier, keys packed as 8-byte big-endian)``,
        one copy each (as :meth:`store_sync` of every part would). A generator: it does about
        ``step_keys`` keys of work per step, so a caller on an event loop can yield between steps
        (``for _ in idx.load_steps(parts): await asyncio.sleep(0)``).

        Unlike storing part after part, it lays the keys out grouped by their holder bits (a
        prompt's blocks usually share holders) as new, adjacent int objects sharing one mask
        object per group: lookups then touch a few cache lines per block, as in an index filled
        by events in the order prompts arrived; filled in set order (what Redis's owned sets give),
        lookups touch more cache lines and are markedly slower (docs/tuning/memory_index.md). Raises
        ValueError when the index is not empty or on an unknown tier."""
        if self._masks or self._spec_heap:
            raise ValueError("load_steps fills an empty index only")
        holders: dict[int, int] = {}  # key -> holder bits
        get = holders.get
        for worker, tier, packed in parts:
            bit = 1 << (_STRIDE * self._slot(worker) + check_tier(tier))
            for i in range(0, len(packed), 8 * step_keys):
                chunk = packed[i:i + 8 * step_keys]
                keys = struct.unpack(f">{len(chunk) // 8}Q", chunk)
                if len(holders) + len(keys) <= self.max_keys:
                    for k in keys:
                        holders[k] = get(k, 0) | bit
                else:
                    for k in keys:
                        v = get(k)
                        if v is None and len(holders) >= self.max_keys:
                            self.dropped_keys += 1
                            continue
                        holders[k] = (v or 0) | bit
                yield
        groups: dict[int, list[int]] = {}
        n = 0
        for k, v in holders.items():
            g = groups.get(v)
            if g is None:
                groups[v] = g = []
            g.append(k)
            n += 1
            if n % step_keys == 0:
                yield
        del holders
        masks = self._masks
        owned = self._owned
        share = self._sharing()
        for v, keys in groups.items():
            if share:
                v = share(v)
            for i in range(0, len(keys), step_keys):
                chunk = keys[i:i + step_keys]
                fresh = struct.unpack(f">{len(chunk)}Q", struct.pack(f">{len(chunk)}Q", *chunk))
                masks.update(zip(fresh, repeat(v)))
                bits = v
                while bits:
                    low = bits & -bits
                    slot, t = divmod(low.bit_length() - 1, _STRIDE)
                    owned[slot][t].update(zip(fresh, repeat(None)))
                    bits ^= low
                yield

    def drop_sync(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        """Drop ``worker``'s entries for ``keys`` in ``tier`` whatever their copy count, leaving the
        extra-copy counters as they are (what one batch of the Redis backend's clear script does).
        Speculative entries stay. Raises ValueError on an unknown tier."""
        t = check_tier(tier)
        slot = self._slots.get(worker)
        if slot is None:
            return
        bit = 1 << (_STRIDE * slot + t)
        owned = self._owned[slot][t]
        masks = self._masks
        share = self._sharing()
        for key in keys:
            v = masks.get(key)
            if v is None or not v & bit:
                continue
            owned.pop(key, None)
            v ^= bit
            if v:
                masks[key] = share(v) if share else v
            else:
                del masks[key]

    def drop_copies_sync(self, worker: str, tier: str) -> None:
        """Forget the extra-copy counters of ``worker`` in ``tier`` (entries stay, each now one
        copy). Raises ValueError on an unknown tier."""
        t = check_tier(tier)
        slot = self._slots.get(worker)
        if slot is None or not self._extra_refs:
            return
        for ref in [r for r in self._extra_refs if r[1] == slot and r[2] == t]:
            del self._extra_refs[ref]

    def add_copies_sync(self, worker: str, tier: str, key: int, extra: int) -> None:
        """Record ``extra`` (>= 1) more copies of a held (key, worker, tier) entry, as if stored
        ``extra`` more times. Raises ValueError on an unknown tier, KeyError when not held."""
        t = check_tier(tier)
        slot = self._slots[worker]
        if key not in self._owned[slot][t]:
            raise KeyError(key)
        ref = (key, slot, t)
        self._extra_refs[ref] = self._extra_refs.get(ref, 1) + extra

    async def drop_speculative(self, worker: str, keys: Sequence[int]) -> None:
        self.drop_speculative_sync(worker, keys)

    def drop_speculative_sync(self, worker: str, keys: Sequence[int] | None = None) -> None:
        """Drop ``worker``'s speculative entries for ``keys`` (all of them when None)."""
        slot = self._slots.get(worker)
        if slot is None:
            return
        self._drop_speculative(slot, list(self._owned[slot][_SPEC]) if keys is None else keys)

    def confirmed_bits(self, workers: Iterable[str]) -> int:
        """The entry bits of ``workers``' confirmed tiers (gpu, cpu, ssd; not speculative), for
        :meth:`match_sync`'s ``hidden``. Workers this index has never seen are skipped."""
        bits = 0
        for worker in workers:
            slot = self._slots.get(worker)
            if slot is not None:
                bits |= 0b111 << (_STRIDE * slot)
        return bits

    @property
    def worker_count(self) -> int:
        """How many workers have a slot (see :meth:`workers`)."""
        return len(self._slots)

    def workers(self) -> list[str]:
        """Every worker with a slot (holding something now, or since its last full clear)."""
        return list(self._slots)

    def owned_keys(self, worker: str, tier: str) -> KeysView[int]:
        """The keys ``worker`` holds in ``tier`` (a live view). Raises ValueError on an unknown
        tier."""
        t = check_tier(tier)
        slot = self._slots.get(worker)
        return {}.keys() if slot is None else self._owned[slot][t].keys()

    def speculative_keys(self, worker: str) -> KeysView[int]:
        """The keys ``worker`` holds speculative entries for, expired ones not yet dropped
        included (a live view)."""
        slot = self._slots.get(worker)
        return {}.keys() if slot is None else self._owned[slot][_SPEC].keys()

    def held_sync(self, worker: str) -> tuple[int, int, int]:
        """Distinct keys ``worker`` holds per confirmed tier (gpu, cpu, ssd); zeros when unknown."""
        slot = self._slots.get(worker)
        if slot is None:
            return (0, 0, 0)
        owned = self._owned[slot]
        return (len(owned[0]), len(owned[1]), len(owned[2]))

    # ---- reads --------------------------------------------------------------------------------
    async def match(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        return self.match_sync(keys)

    def match_sync(self, keys: Sequence[int], hidden: int = 0) -> dict[str, TierMatch]:
        """Synchronous :meth:`match`. Three running ANDs of worker bits (at position ``4*slot``)
        from block 0: gpu (+speculative), gpu|cpu, and any tier; a worker's run in a chain ends
        where its bit drops out. One pass that stops at the first block no worker holds; a block
        that every still-running worker holds in gpu costs one AND and a compare. Once a slot
        numbered 128 or higher has been handed out, a prompt of :data:`_ROWS_MIN_BLOCKS` blocks
        or more goes instead as rows of one matrix, one row per change of holders
        (:mod:`kvcore.index.chain_rows`; the whole prompt's entries are read first).

        ``hidden``: entry bits to ignore (from :meth:`confirmed_bits`), e.g. the confirmed tiers of
        workers whose agent's heartbeat expired (:class:`kvcore.index.redis_mirror.RedisMirrorIndex`);
        0 (the default) takes the unmasked path."""
        if self._spec_heap:
            self._expire(self._clock())
        if not keys or not self._slots:
            return {}
        get = self._masks.get
        v = get(keys[0])
        if v is None:
            return {}
        if hidden:
            keep = ~hidden
            v &= keep
            if not v:
                return {}
        width = self._gpu_sel.bit_length() + _STRIDE - 1  # entries hold no bits past the last slot
        if len(keys) < _ROWS_MIN_BLOCKS or width <= _NARROW_BITS:
            values = map(get, keys[1:])
            if hidden:
                values = (None if x is None else x & keep for x in values)
            drops, alive, end = run_chains(v, enumerate(values, 1), len(keys), self._gpu_sel)
            return tier_matches(drops, alive, end, self._names(), _STRIDE)
        # wide masks: the values where the holders change, as rows of one matrix
        nbytes = -(-width // 64) * 8
        if chain_rows.NATIVE:
            rows, starts_np, end = chain_rows.int_rows(self._masks, keys, hidden, nbytes // 8)
            return row_matches(rows, starts_np, end, self._names()) if len(rows) else {}
        held = list(map(get, keys))
        if hidden:
            held = [None if x is None else x & keep or None for x in held]
        try:
            end = held.index(None)
        except ValueError:
            end = len(held)
        starts = [0]
        starts += compress(range(1, end), map(ne, held, held[1:end]))
        raw = b"".join([held[i].to_bytes(nbytes, "little") for i in starts])
        rows = np.frombuffer(raw, np.uint64).reshape(len(starts), nbytes // 8)
        return row_matches(rows, np.array(starts, np.int64), end, self._names())

    def _names(self) -> dict[int, str]:
        """Slot -> worker, rebuilt after a slot was handed out or freed (callers only read it)."""
        names = self._names_of_slots
        if names is None:
            names = self._names_of_slots = {slot: name for name, slot in self._slots.items()}
        return names

    async def gpu_holders(self, keys: Sequence[int]) -> dict[str, int]:
        return self.gpu_holders_sync(keys)

    def gpu_holders_sync(self, keys: Sequence[int], hidden: int = 0) -> dict[str, int]:
        """Synchronous :meth:`gpu_holders`; ``hidden`` as in :meth:`match_sync`."""
        if self._spec_heap:
            self._expire(self._clock())
        values = map(self._masks.get, keys)
        if hidden:
            keep = ~hidden
            values = (None if v is None else v & keep for v in values)
        return gpu_positions(values, self._gpu_sel, self._names(), _STRIDE)

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


def drop_extra_copy(extra_refs: dict[tuple[int, int, int], int], ref: tuple[int, int, int]) -> bool:
    """Drop one of the extra copies counted for ``ref`` = (key, slot, tier) in ``extra_refs``
    (the copies beyond the first); False when it has none (the entry itself goes)."""
    n = extra_refs.get(ref)
    if n is None:
        return False
    if n > 2:
        extra_refs[ref] = n - 1
    else:
        del extra_refs[ref]
    return True


def gpu_positions(values: Iterable[int | None], sel: int, names: dict[int, str], stride: int) -> dict[str, int]:
    """:meth:`KVIndex.gpu_holders` from each block's entry bits in prompt order (layout of
    :class:`MemoryIndex`; None or 0: nobody holds it): per named worker holding some block in gpu
    (or speculatively), a mask with bit ``i`` set when it holds block ``i``. ``sel``: bit
    ``stride * slot`` of every slot; ``names``: slot -> worker id (other slots are left out)."""
    by_bit: dict[int, int] = {}
    for i, v in enumerate(values):
        if not v:
            continue
        g = (v | v >> 3) & sel
        while g:
            low = g & -g
            by_bit[low] = by_bit.get(low, 0) | 1 << i
            g ^= low
    out = {}
    for low, positions in by_bit.items():
        name = names.get((low.bit_length() - 1) // stride)
        if name is not None:
            out[name] = positions
    return out


def run_chains(v: int, steps: Iterable[tuple[int, int | None]], end: int,
               sel: int) -> tuple[list[tuple[int, int, int, int]], tuple[int, int, int], int]:
    """One pass of the three running ANDs of worker bits from block 0 (gpu + speculative,
    gpu|cpu, any tier), for :func:`tier_matches`.

    ``v``: block 0's entry bits (layout of :class:`MemoryIndex`: bit ``4*slot + tier``, tier 3 =
    speculative); ``steps``: ``(i, bits of block i)`` for later blocks in order, ``None`` bits
    ending the prompt's run at ``i`` (a block nobody holds); a step may skip blocks whose bits equal
    the step before (the chains cannot change there); ``end``: the prompt's length in blocks;
    ``sel``: bit ``4*slot`` of every slot. Returns (drops, chains' bits after the last block,
    run end): a block that every running worker holds in gpu costs one AND and a compare."""
    g = (v | v >> 3) & sel
    gc = (v | v >> 1 | v >> 3) & sel
    a = (v | v >> 1 | v >> 2 | v >> 3) & sel
    drops: list[tuple[int, int, int, int]] = []
    prev = v
    for i, v in steps:
        if v is None:
            end = i
            break
        if v == prev:  # the same holders as the block before: the chains cannot change
            continue
        prev = v
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
    return drops, (g, gc, a), end


def tier_matches(drops: Sequence[tuple[int, int, int, int]], alive: tuple[int, int, int], end: int,
                 names: dict[int, str], stride: int) -> dict[str, TierMatch]:
    """Per worker :class:`TierMatch` from one pass of the three chains (gpu, gpu|cpu, any).

    ``drops``: ``(gpu bits, gpu|cpu bits, any bits, i)`` that left each chain at block ``i``;
    ``alive``: the chains' bits still set after block ``end - 1``. A worker's bit sits at position
    ``stride * slot``; ``names``: slot -> worker id (unknown slots are left out).
    """
    if alive[2].bit_count() + len(drops) > _MANY_WORKERS:
        return _tier_matches_many(drops, alive, end, names, stride)
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


def _tier_matches_many(drops: Sequence[tuple[int, int, int, int]], alive: tuple[int, int, int], end: int,
                       names: dict[int, str], stride: int) -> dict[str, TierMatch]:
    """:func:`tier_matches` for hundreds of matching workers: run lengths in numpy arrays indexed
    by slot. A drop of one worker is one store; the drops of many workers at once (and the bits
    still alive) go as rows of one bit matrix per chain, where a slot's column has one set row
    (a bit leaves a chain once). The chains only lose bits, so block 0's bits bound the width."""
    width = max([alive[2].bit_length()] + [d[2].bit_length() for d in drops])
    nbytes = -(-width // (8 * stride)) * stride  # whole slots
    runs = np.zeros((3, nbytes * 8 // stride), np.int64)
    wide: list[list[tuple[int, int]]] = [[], [], []]  # per chain: (bits, run length)
    for *dropped, i in drops:
        for chain, bits in enumerate(dropped):
            if bits:
                if bits & (bits - 1):
                    wide[chain].append((bits, i))
                else:
                    runs[chain, (bits.bit_length() - 1) // stride] = i
    for chain, bits in enumerate(alive):
        if bits:
            wide[chain].append((bits, end))
    for chain, rows in enumerate(wide):
        if not rows:
            continue
        raw = b"".join(bits.to_bytes(nbytes, "little") for bits, _ in rows)
        matrix = np.unpackbits(np.frombuffer(raw, np.uint8).reshape(len(rows), nbytes), axis=1,
                               bitorder="little")[:, ::stride]
        cols = np.flatnonzero(matrix.any(0))
        lengths = np.array([n for _, n in rows], np.int64)
        runs[chain, cols] = lengths[matrix[:, cols].argmax(0)]
    return matches_from_runs(runs, names)


def _record(lengths: dict[int, int], bits: int, length: int) -> None:
    """``lengths[p + 1] = length`` for each set bit ``p`` of ``bits``. Many bits (a prefix held
    by hundreds of workers) go through numpy: peeling bits off a 4,096-bit int one at a time
    costs a pass over all its words per bit."""
    if bits.bit_count() <= _FEW_BITS:
        while bits:
            low = bits & -bits
            lengths[low.bit_length()] = length
            bits ^= low
        return
    raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), np.uint8)
    positions = np.flatnonzero(np.unpackbits(raw, bitorder="little")) + 1
    lengths.update(zip(positions.tolist(), repeat(length)))


def _reference_counts(table: dict[int, int]) -> list[tuple[int, int]]:
    """Each value of ``table`` with its reference count as seen from here."""
    return [(v, sys.getrefcount(v)) for v in table]


def _table_only_refs() -> int:
    """The reference count :func:`_reference_counts` sees for a value held by its table alone
    (as key and value), whatever this interpreter's counting."""
    table: dict[int, int] = {}
    value = (1 << 1000) | 7  # made at run time: a fresh object
    table[value] = value
    del value
    return _reference_counts(table)[0][1]


_TABLE_ONLY_REFS = _table_only_refs()
