"""Where each block lives in the CPU and SSD tiers, and the copy operations that keep it so.

:class:`TierPlanner` is the tiers' single owner and the only one that evicts. It runs in vLLM's
scheduler (the connector's scheduler side); it never touches KV bytes. Each call returns
operations (records of :mod:`offload_agent.tiers.ops`) that the connector's worker side executes
*in order*, on the CPU slab and the SSD folder; the planner's state is always "as if every
operation handed out has run". The worker checks every read (slot holds the key, file checksum)
and reports what failed, which the planner then forgets (:meth:`TierPlanner.forget`).

Capacities are in blocks: ``cpu_slots`` = CPU tier bytes // block bytes (a slab of that many
block-sized slots), ``ssd_slots`` = SSD tier bytes // (header + block bytes). Policy:

- save: a block not held in any tier gets a CPU slot; with none free, the least recently used
  CPU block is spilled to SSD (already on SSD: its CPU copy is just dropped), making room on SSD by
  deleting the least recently used SSD block; without an SSD tier it is dropped;
- load: a CPU hit copies from its slot; an SSD hit is promoted (read into a CPU slot, then copied)
  when a slot can be had without evicting a block of the same load, else read straight from SSD;
- recency: :meth:`touch_chain` refreshes a request's blocks from last to first, so a prefix's
  first blocks are the most recent and a chain is evicted from its tail (a tail without its head is
  useless; a head without its tail still serves a shorter prefix hit).

Residency changes (:class:`Change`) carry vLLM's engine hash of the block when known; the connector
turns them into vLLM ``BlockStored``/``BlockRemoved`` events with medium ``CPU``/``STORAGE``.
Blocks found on disk at start have no engine hash until a request hits them; they are announced
then. After vLLM's prefix cache reset (whose ``AllBlocksCleared`` makes consumers forget every
tier), :meth:`TierPlanner.unannounce_all` marks every block unannounced; each is announced again
when a request next hits or re-offers it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from offload_agent.tiers.ops import DropSsd, FailBlock, LoadCpu, LoadSsd, Promote, Save, Spill, TierOp

CPU, SSD = "cpu", "ssd"

EngineHash = int | bytes
"""vLLM's hash of a block as its KV events carry it (``maybe_convert_block_hash``): a uint64 int,
or the raw digest bytes; the same as :data:`kvcore.kv_events.wire.EngineHash` (not imported: this package
runs in vLLM's interpreter on the standard library alone)."""


@dataclass(frozen=True)
class Change:
    """A block entered (``stored``) or left (``removed``) a tier; ``engine_hash`` as vLLM's events
    carry it (None when unknown; such changes are not published)."""

    op: str
    tier: str
    key: bytes
    engine_hash: EngineHash | None


class _Entry:
    __slots__ = ("cpu_slot", "on_ssd", "engine_hash", "announced")

    def __init__(self) -> None:
        self.cpu_slot: int | None = None
        self.on_ssd = False
        self.engine_hash: EngineHash | None = None
        self.announced = False


class TierPlanner:
    """Bookkeeping of the CPU and SSD tiers for one vLLM engine (not thread-safe).

    ``cpu_slots`` >= 1; ``ssd_slots`` >= 0 (0: no SSD tier). Raises ValueError otherwise.
    """

    def __init__(self, cpu_slots: int, ssd_slots: int = 0) -> None:
        if cpu_slots < 1:
            raise ValueError(f"the CPU tier needs room for at least one block (cpu_slots={cpu_slots})")
        if ssd_slots < 0:
            raise ValueError(f"ssd_slots must be >= 0, got {ssd_slots}")
        self.cpu_slots = cpu_slots
        self.ssd_slots = ssd_slots
        self._entries: dict[bytes, _Entry] = {}
        self._cpu_lru: OrderedDict[bytes, None] = OrderedDict()
        self._ssd_lru: OrderedDict[bytes, None] = OrderedDict()
        self._free_slots = list(range(cpu_slots - 1, -1, -1))
        self._changes: list[Change] = []

    # ---- state ----------------------------------------------------------------------------------
    def tier_of(self, key: bytes) -> str | None:
        """``"cpu"`` when the key has a CPU copy, else ``"ssd"`` when on SSD, else None."""
        e = self._entries.get(key)
        if e is None:
            return None
        return CPU if e.cpu_slot is not None else SSD

    def cpu_slot_of(self, key: bytes) -> int | None:
        e = self._entries.get(key)
        return None if e is None else e.cpu_slot

    def counts(self) -> dict[str, int]:
        """Blocks held: ``{"cpu": n, "ssd": n}`` (a block may be in both)."""
        return {CPU: len(self._cpu_lru), SSD: len(self._ssd_lru)}

    def take_changes(self) -> list[Change]:
        """Residency changes since the last call, in order."""
        out, self._changes = self._changes, []
        return out

    # ---- start-up ----------------------------------------------------------------------------------
    def add_ssd_blocks(self, keys_oldest_first: Iterable[bytes]) -> list[bytes]:
        """Register blocks found on disk (oldest first); returns the keys beyond capacity, oldest
        first, which the caller deletes. Call before any operation is handed out."""
        keys = [k for k in keys_oldest_first if k not in self._entries]
        excess = keys[:max(0, len(keys) - (self.ssd_slots - len(self._ssd_lru)))]
        for k in keys[len(excess):]:
            e = self._entries[k] = _Entry()
            e.on_ssd = True
            self._ssd_lru[k] = None
        return excess

    def add_cpu_blocks(self, slot_keys: Iterable[tuple[int, bytes]]) -> int:
        """Register blocks found in a CPU tier that outlived its vLLM process (the agent's shared
        slab: ``(slot, key)`` of each stable row); returns how many were taken. Slots outside the
        tier, taken twice, or keys already held are skipped. Call before any operation is handed
        out (after :meth:`add_ssd_blocks` is fine)."""
        free = set(self._free_slots)
        taken = 0
        for slot, key in slot_keys:
            if slot not in free:
                continue
            e = self._entries.get(key)
            if e is not None and e.cpu_slot is not None:
                continue
            if e is None:
                e = self._entries[key] = _Entry()
            free.discard(slot)
            e.cpu_slot = slot
            self._cpu_lru[key] = None
            taken += 1
        self._free_slots = [s for s in self._free_slots if s in free]
        return taken

    # ---- lookups and plans ------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tiers of the longest run of held keys from ``keys[0]`` (no side effects)."""
        out = []
        for k in keys:
            t = self.tier_of(k)
            if t is None:
                break
            out.append(t)
        return out

    def plan_load(self, keys: Sequence[bytes], gpu_blocks: Sequence[int],
                  engine_hashes: Sequence[EngineHash | None] | None = None,
                  promote: bool = True) -> tuple[list[TierOp], list[str]]:
        """Operations that copy ``keys`` into vLLM's ``gpu_blocks`` (same length), and the tier each
        came from (``"cpu"``, ``"ssd"``, or ``"miss"`` when the key is gone: that block is
        reported failed, so vLLM recomputes from there). ``promote`` False: SSD hits are read
        straight into vLLM's blocks (:class:`LoadSsd`), never into a CPU slot (an asynchronous load,
        whose reads run while later steps' operations reuse slots)."""
        ops: list[TierOp] = []
        tiers: list[str] = []
        pins = set(keys)
        for i, (k, g) in enumerate(zip(keys, gpu_blocks)):
            e = self._entries.get(k)
            if e is None:
                ops.append(FailBlock(g))
                tiers.append("miss")
                continue
            if engine_hashes is not None:
                self.set_engine_hash(k, engine_hashes[i])
            if e.cpu_slot is not None:
                ops.append(LoadCpu(e.cpu_slot, k, g))
                tiers.append(CPU)
                continue
            tiers.append(SSD)
            slot = self._alloc_slot(ops, pins) if promote else None
            if slot is None:
                ops.append(LoadSsd(k, g))
                continue
            ops.append(Promote(k, slot))
            self._put_cpu(k, e, slot)
            ops.append(LoadCpu(slot, k, g))
        self.touch_chain(keys)
        return ops, tiers

    def plan_save(self, key: bytes, gpu_block: int, engine_hash: EngineHash | None = None) -> list[TierOp]:
        """Operations saving vLLM's ``gpu_block`` as ``key`` (none when the key is already held)."""
        e = self._entries.get(key)
        if e is not None:
            if engine_hash is not None:
                self.set_engine_hash(key, engine_hash)
            return []
        ops: list[TierOp] = []
        slot = self._alloc_slot(ops, frozenset())
        assert slot is not None  # nothing is pinned, and cpu_slots >= 1
        e = self._entries[key] = _Entry()
        e.engine_hash = engine_hash
        e.announced = engine_hash is not None
        self._put_cpu(key, e, slot)
        ops.append(Save(slot, key, gpu_block))
        return ops

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Mark held ``keys`` (a prefix chain, first block first) used now, the first most recent."""
        for k in reversed(keys):
            if k in self._cpu_lru:
                self._cpu_lru.move_to_end(k)
            if k in self._ssd_lru:
                self._ssd_lru.move_to_end(k)

    def set_engine_hash(self, key: bytes, engine_hash: EngineHash | None) -> None:
        """Record vLLM's hash of a held block; an unannounced block is announced in its tiers."""
        e = self._entries.get(key)
        if e is None or engine_hash is None or e.announced:
            return
        e.engine_hash = engine_hash
        e.announced = True
        if e.cpu_slot is not None:
            self._changes.append(Change("stored", CPU, key, engine_hash))
        if e.on_ssd:
            self._changes.append(Change("stored", SSD, key, engine_hash))

    def unannounce_all(self) -> None:
        """Consumers forgot every tier (vLLM's prefix cache reset): publish nothing more about a
        block until it is announced again (:meth:`set_engine_hash`)."""
        for e in self._entries.values():
            e.announced = False

    def forget(self, key: bytes, tier: str, slot: int | None = None) -> None:
        """Drop ``key``'s copy in ``tier`` after the worker reported it unusable (for ``cpu``, only
        if it still sits in ``slot``); the worker has already deleted a bad SSD file."""
        e = self._entries.get(key)
        if e is None:
            return
        if tier == CPU and e.cpu_slot is not None and (slot is None or e.cpu_slot == slot):
            self._drop_cpu(key, e)
        elif tier == SSD and e.on_ssd:
            self._drop_ssd(key, e)

    def clear(self) -> list[TierOp]:
        """Forget every block; returns the operations deleting the SSD files."""
        ops: list[TierOp] = []
        for k in list(self._entries):
            e = self._entries[k]
            if e.on_ssd:
                ops.append(DropSsd(k))
                self._drop_ssd(k, e)
            if k in self._entries and e.cpu_slot is not None:
                self._drop_cpu(k, e)
        return ops

    # ---- internals --------------------------------------------------------------------------------
    def _put_cpu(self, key: bytes, e: _Entry, slot: int) -> None:
        e.cpu_slot = slot
        self._cpu_lru[key] = None
        if e.announced:
            self._changes.append(Change("stored", CPU, key, e.engine_hash))

    def _drop_cpu(self, key: bytes, e: _Entry) -> None:
        self._free_slots.append(e.cpu_slot)
        e.cpu_slot = None
        del self._cpu_lru[key]
        if e.announced:
            self._changes.append(Change("removed", CPU, key, e.engine_hash))
        if not e.on_ssd:
            del self._entries[key]

    def _drop_ssd(self, key: bytes, e: _Entry) -> None:
        e.on_ssd = False
        del self._ssd_lru[key]
        if e.announced:
            self._changes.append(Change("removed", SSD, key, e.engine_hash))
        if e.cpu_slot is None:
            del self._entries[key]

    def _alloc_slot(self, ops: list[TierOp], pins: Iterable[bytes]) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((k for k in self._cpu_lru if k not in pins), None)
        if victim is None:
            return None
        e = self._entries[victim]
        slot = e.cpu_slot
        if not e.on_ssd and self._make_ssd_room(ops, pins):
            ops.append(Spill(slot, victim))
            e.on_ssd = True
            self._ssd_lru[victim] = None
            if e.announced:
                self._changes.append(Change("stored", SSD, victim, e.engine_hash))
        self._drop_cpu(victim, e)
        return self._free_slots.pop()

    def _make_ssd_room(self, ops: list[TierOp], pins: Iterable[bytes]) -> bool:
        if self.ssd_slots == 0:
            return False
        while len(self._ssd_lru) >= self.ssd_slots:
            victim = next((k for k in self._ssd_lru if k not in pins), None)
            if victim is None:
                return False
            ops.append(DropSsd(victim))
            self._drop_ssd(victim, self._entries[victim])
        return True
