"""One index per host, in shared memory: every gateway process of the host looks up in the same
copy; one of them (the writer) applies the workers' KV events to it.

``kvroute serve --processes N`` with the embedded index puts it in the supervisor's run folder
(``<run dir>/index``, on ``/dev/shm``), so memory does not grow with the process count and only
one process pays for event ingest.

File layout (all little-endian, fixed at creation from ``max_keys``, ``max_workers`` and
``max_holder_sets``):

- a header of :data:`HEADER_BYTES`: magic, layout version, sizes, the seqlock word, counters;
- the worker table: per slot, the worker id (:data:`NAME_BYTES` of UTF-8, zero-padded) and its
  confirmed block counts per tier (int64 x 3);
- the key table, open addressing with linear probing over ``capacity = ceil(max_keys / 0.7)``
  slots: the block keys (uint64), each key's holder-set id (uint32, 0 = empty slot) and its use
  mark (a byte, for eviction). The home slot of key ``k`` is ``(k * 0x9E3779B97F4A7C15 mod 2**64) mod capacity``.
  Deletion shifts later entries back (no tombstones);
- the holder sets: set ``s`` is one bit mask of ``4 * max_workers`` bits, bit ``4*slot + tier``
  set when worker ``slot`` holds the key in that tier (0 gpu, 1 cpu, 2 ssd; bit 3 unused here: the
  speculative bit of :class:`kvcore.index.memory.MemoryIndex`'s layout, which this module shares).
  Keys with the same holders share one set (a prompt's blocks usually do), so an entry costs the
  key table's 13 bytes / 0.7 per distinct block, whatever the number of workers holding it, plus
  its share of the sets. Set 1 is the empty set, kept for keys being deleted.

Consistency, per key: readers take no lock and write nothing, and a lookup may see a write
half-applied (some blocks of a batch before it, others after), as if each block were looked up
just before or just after the write. What a reader does read is a real state of each key:

- the writer fills a slot key first, then its set id, and clears the id before reusing a slot;
  a reader reads a slot's key, its set id, then the key again, and takes the id only when both
  reads of the key are the one it looks for (else the slot is a miss or a step past it);
- a set's mask never changes while keys name it, and a freed set id is reused only
  :data:`SET_QUARANTINE_S` seconds later, so an id read during a lookup names the same holders
  until the lookup ends;
- a key moved back by a deletion's shift while a reader probes past it is missed by that
  lookup: the index under-reports one block, once.

The writer still brackets each change with two increments of the header's sequence number (odd
while writing): a new writer that finds it odd knows its predecessor died mid-change.

Who writes: the process holding an exclusive ``lockf`` lock on the file's first byte (the kernel
drops it when the process dies). :meth:`HostIndex.try_become_writer` takes it when free, then
rebuilds the writer's private state from the file (the interned sets, their reference counts, the
per-worker counts) and repairs what a writer that died mid-change may have left (a key copied
forward by a deletion's shift but not yet cleared). Duplicate copies of a block (vLLM storing one
block twice) are counted in the writer's memory only: a new writer starts with one copy each.

Workers get their slot from any process (under a ``lockf`` lock on the file's second byte): a
process that routes speculatively to a worker with no events yet needs a slot for it.

Speculative entries stay in the process that made them (:class:`MemoryIndex` with this file's
slots, looked up together with the shared entries); a removal event reaching the writer drops
the writer's own speculative entries only (the others expire with their TTL).

Bounded: at most ``max_keys`` distinct keys. A store of a new key into a full table first evicts
one key (``evicted_keys``), by second chance: each key has a use mark (a byte beside its slot) that
every store reaching it sets; a clock hand sweeping the key table clears the marks it passes and
takes the first unmarked key held in no gpu tier, or after :data:`EVICT_SCAN` keys without one,
the first unmarked key it passed: keys stored since the hand last passed stay, gpu keys go last. A key whose new holders would
need a set when all ``max_holder_sets`` are in use is not stored (``dropped_keys``). Either way the
index under-reports (a worker holds a block the index does not show), never over-reports.
"""
from __future__ import annotations

import asyncio
import fcntl
import math
import mmap
import os
import struct
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import numpy as np

from kvcore.index.base import TIERS, KVIndex, TierMatch, WorkerIndexStats, check_tier
import kvcore.index.chain_rows as chain_rows
from kvcore.index.chain_rows import row_matches, scratch
from kvcore.index.memory import MemoryIndex, drop_extra_copy, gpu_positions, run_chains, tier_matches
from kvcore.ticks import ticks

MAGIC = 0x31_54_53_4F_48_52_56_4B  # "KVRHOST1" little-endian
LAYOUT_VERSION = 1
HEADER_BYTES = 4096
NAME_BYTES = 64
LOAD_FACTOR = 0.7
WRITER_POLL_S = 0.5  # how often a reader tries to take over the writer lock
SET_QUARANTINE_S = 0.5  # a freed holder set waits this long before it names other holders
EVICT_SCAN = 64
MUL = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
_STRIDE = 4
_EMPTY_SET = 1  # the set with no holders (a key on its way out)
# a lookup reads the holder sets as one matrix (kvcore.index.chain_rows) from this many holder
# changes along the prompt, or this many 64-bit words of named slots (16 slots each)
_MANY_CHANGES = 32
_MANY_WORDS = 8
_SCALAR_TAIL = 48  # keys left after a probe round that are finished one slot at a time

# header words (uint64 each)
(_H_MAGIC, _H_VERSION, _H_CAPACITY, _H_MAX_WORKERS, _H_MAX_SETS, _H_SEQ, _H_KEYS, _H_SETS_HIGH,
 _H_DROPPED, _H_EVICTED, _H_WORKERS_VERSION, _H_HAND, _H_WRITER_PID, _H_MAX_KEYS, _H_TAKEOVERS,
 _H_SETS_LIVE) = range(16)


def layout_bytes(max_keys: int, max_workers: int, max_holder_sets: int) -> dict[str, int]:
    """Byte offsets and sizes of the file's parts for these bounds (see the module docstring)."""
    capacity = math.ceil(max_keys / LOAD_FACTOR)
    words = math.ceil(_STRIDE * max_workers / 64)
    names = HEADER_BYTES
    counts = names + max_workers * NAME_BYTES
    keys = _align(counts + max_workers * 3 * 8)
    ids = keys + capacity * 8
    used = ids + capacity * 4
    sets = _align(used + capacity)
    total = sets + max_holder_sets * words * 8
    return {"capacity": capacity, "words": words, "names": names, "counts": counts, "keys": keys,
            "ids": ids, "used": used, "sets": sets, "total": total}


def _align(n: int, to: int = 4096) -> int:
    return -(-n // to) * to


class HostIndex(KVIndex):
    """The index file at ``path``, created at these bounds when absent (or empty).

    ``max_keys``: distinct block keys held at most (eviction beyond, module docstring);
    ``max_workers``: worker slots (each holder set is ``max_workers / 2`` bytes);
    ``max_holder_sets``: distinct holder sets at most; ``clock``: seconds, monotonic (speculative
    TTLs, the quarantine of freed sets). The file's pages are reserved when it is created
    (:func:`layout_bytes`; ~79 MiB at the defaults). Raises ValueError when the file exists with
    other bounds or is not an index file, or when its filesystem has no room for it; OSError when
    it cannot be created or mapped.

    A new instance reads only; :meth:`try_become_writer` makes it the writer when no live process
    is. Write methods called on a reader change only this process's speculative entries (what a
    gateway that is not the writer does when told a worker went away)."""

    def __init__(self, path: str | Path, max_keys: int = 4_000_000, max_workers: int = 256,
                 max_holder_sets: int = 65_536, clock: Callable[[], float] | None = None) -> None:
        if max_keys < 1 or max_workers < 1 or max_holder_sets < 4:
            raise ValueError("host index: max_keys and max_workers must be >= 1, max_holder_sets >= 4")
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._lay = layout_bytes(max_keys, max_workers, max_holder_sets)
            self._create_or_check(max_keys, max_workers, max_holder_sets)
            self._mm = mmap.mmap(self._fd, self._lay["total"])
        except BaseException:
            os.close(self._fd)
            raise
        lay = self._lay
        self.max_keys, self.max_workers, self.max_holder_sets = max_keys, max_workers, max_holder_sets
        self.capacity = lay["capacity"]
        self._words = lay["words"]
        self._set_bytes = self._words * 8
        mm = self._mm
        self._header = memoryview(mm)[:HEADER_BYTES].cast("Q")
        self._counts = memoryview(mm)[lay["counts"]:lay["counts"] + max_workers * 24].cast("q")
        self._keys = memoryview(mm)[lay["keys"]:lay["keys"] + self.capacity * 8].cast("Q")
        self._ids = memoryview(mm)[lay["ids"]:lay["ids"] + self.capacity * 4].cast("I")
        self._used = memoryview(mm)[lay["used"]:lay["used"] + self.capacity]
        self._keys_np = np.frombuffer(mm, np.uint64, self.capacity, lay["keys"])
        self._ids_np = np.frombuffer(mm, np.uint32, self.capacity, lay["ids"])
        self._sets_off = lay["sets"]
        self._sets_np = np.frombuffer(mm, np.uint64, max_holder_sets * self._words, lay["sets"]).reshape(
            max_holder_sets, self._words)
        self._cap_u64 = np.uint64(self.capacity)
        self._names: dict[int, str] = {}
        self._slots: dict[str, int] = {}
        self._names_version = -1
        self._named_words = 1
        self._sel_all = sum(1 << (_STRIDE * s) for s in range(max_workers))
        self._now = time.monotonic if clock is None else clock
        self.speculative = MemoryIndex(slot_of=self.slot, clock=self._now)  # this process's own entries
        self.writer = False
        self._election: asyncio.Task[None] | None = None
        # the writer's private state (rebuilt from the file on taking over)
        self._intern: dict[int, int] = {}
        self._set_int: list[int] = []
        self._refs: list[int] = []
        self._free_sets: deque[tuple[float, int]] = deque()  # (freed at, set id), oldest first
        self._extra_refs: dict[tuple[int, int, int], int] = {}

    # ---- file --------------------------------------------------------------------------------
    def _create_or_check(self, max_keys: int, max_workers: int, max_sets: int) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 1)
        try:
            size = os.fstat(self._fd).st_size
            want = (MAGIC, LAYOUT_VERSION, self._lay["capacity"], max_workers, max_sets)
            if size == 0:
                try:  # reserve every page now: a full tmpfs must refuse the start, not SIGBUS later
                    os.posix_fallocate(self._fd, 0, self._lay["total"])
                except OSError as exc:
                    os.ftruncate(self._fd, 0)
                    raise ValueError(
                        f"host index {self.path}: cannot reserve {self._lay['total'] / 2**20:.0f} MiB there "
                        f"({exc.strerror}); give that filesystem more room (a container's --shm-size) or "
                        f"lower index max_keys / max_workers / max_holder_sets") from None
                with mmap.mmap(self._fd, HEADER_BYTES) as mm:
                    head = memoryview(mm).cast("Q")
                    head[_H_VERSION], head[_H_CAPACITY], head[_H_MAX_WORKERS] = want[1:4]
                    head[_H_MAX_SETS], head[_H_MAX_KEYS], head[_H_SETS_HIGH] = max_sets, max_keys, 2
                    head[_H_MAGIC] = MAGIC  # last: a reader that sees it sees the rest
                    head.release()
                return
            if size < HEADER_BYTES:
                raise ValueError(f"host index {self.path}: not an index file ({size} bytes)")
            with mmap.mmap(self._fd, HEADER_BYTES) as mm:
                head = memoryview(mm).cast("Q")
                got = tuple(head[i] for i in range(5)) + (head[_H_MAX_KEYS],)
                head.release()
            if got[0] != MAGIC or got[1] != LAYOUT_VERSION:
                raise ValueError(f"host index {self.path}: not a layout-{LAYOUT_VERSION} index file")
            if got[2:] != want[2:] + (max_keys,):
                raise ValueError(
                    f"host index {self.path} was made for max_keys={got[5]}, max_workers={got[3]}, "
                    f"max_holder_sets={got[4]}; this process asks for {max_keys}, {max_workers}, "
                    f"{max_sets}: every process of a host must use the same index settings")
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 1)

    async def close(self) -> None:
        if self._election is not None:
            self._election.cancel()
        self.close_sync()

    def close_sync(self) -> None:
        """Unmap the file and drop the writer lock (the file stays for the other processes)."""
        if self._fd < 0:
            return
        for view in (self._header, self._counts, self._keys, self._ids, self._used):
            view.release()
        del self._keys_np, self._ids_np, self._sets_np
        try:
            self._mm.close()
        except BufferError:  # a numpy view still alive somewhere; the mapping goes with it
            pass
        os.close(self._fd)
        self._fd = -1
        self.writer = False

    def __del__(self) -> None:
        try:
            self.close_sync()
        except Exception:  # interpreter shutdown: the kernel closes what is left
            pass

    def file_bytes(self) -> dict[str, int]:
        """``mapped``: the file's size; ``resident``: its pages in memory (tmpfs blocks)."""
        st = os.fstat(self._fd)
        return {"mapped": st.st_size, "resident": st.st_blocks * 512}

    # ---- slots -------------------------------------------------------------------------------
    def _refresh_names(self) -> None:
        version = self._header[_H_WORKERS_VERSION]
        if version == self._names_version:
            return
        base = self._lay["names"]
        names: dict[int, str] = {}
        for slot in range(self.max_workers):
            raw = self._mm[base + slot * NAME_BYTES:base + (slot + 1) * NAME_BYTES]
            if raw[0]:
                names[slot] = raw.rstrip(b"\0").decode("utf-8", "replace")
        self._names = names
        self._slots = {name: slot for slot, name in names.items()}
        self._named_words = min(self._words, max(names, default=0) // (64 // _STRIDE) + 1)
        self._names_version = version

    def slot(self, worker: str) -> int:
        """``worker``'s slot, handed out now (lowest free) when it has none. Raises ValueError when
        the id is over :data:`NAME_BYTES` bytes of UTF-8 or every slot is taken."""
        self._refresh_names()
        slot = self._slots.get(worker)
        if slot is not None:
            return slot
        raw = worker.encode()
        if not raw or len(raw) > NAME_BYTES:
            raise ValueError(f"host index: worker id {worker!r} must be 1-{NAME_BYTES} bytes of UTF-8")
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 1)
        try:
            self._names_version = -1
            self._refresh_names()
            slot = self._slots.get(worker)
            if slot is not None:
                return slot
            free = next((s for s in range(self.max_workers) if s not in self._names), None)
            if free is None:
                raise ValueError(f"host index: all {self.max_workers} worker slots are taken (max_workers)")
            base = self._lay["names"] + free * NAME_BYTES
            self._mm[base:base + NAME_BYTES] = raw.ljust(NAME_BYTES, b"\0")
            for t in range(3):
                self._counts[free * 3 + t] = 0
            self._header[_H_WORKERS_VERSION] += 1
            self._names_version = -1
            self._refresh_names()
            return free
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 1)

    def _free_slot(self, slot: int) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 1)
        try:
            base = self._lay["names"] + slot * NAME_BYTES
            self._mm[base:base + NAME_BYTES] = bytes(NAME_BYTES)
            self._header[_H_WORKERS_VERSION] += 1
            self._names_version = -1
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 1)

    def workers(self) -> list[str]:
        """Every worker with a slot."""
        self._refresh_names()
        return list(self._slots)

    # ---- the writer --------------------------------------------------------------------------
    def try_become_writer(self) -> bool:
        """Take the writer lock if no live process holds it; True when this process is (or just
        became) the writer. Taking over rebuilds the writer's state from the file (module
        docstring); the lock goes with the process."""
        if self.writer:
            return True
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError:
            return False
        self._rebuild()
        self.writer = True
        return True

    async def wait_writer(self) -> None:
        """Return once this process is the writer: tries the lock every :data:`WRITER_POLL_S`
        seconds (one polling task for all callers of this instance)."""
        if self.writer:
            return
        if self._election is None or self._election.done():
            self._election = asyncio.get_running_loop().create_task(self._elect(), name="host-index-writer")
        await asyncio.shield(self._election)

    async def _elect(self) -> None:
        while not self.try_become_writer():
            await ticks().wait(WRITER_POLL_S)  # on the gateway's shared ticks: no wake-up of its own

    def _set_view(self, sid: int) -> np.ndarray:
        off = self._sets_off + sid * self._set_bytes
        return np.frombuffer(self._mm, np.uint64, self._words, off)

    def _read_set(self, sid: int) -> int:
        off = self._sets_off + sid * self._set_bytes
        return int.from_bytes(self._mm[off:off + self._set_bytes], "little")

    def _rebuild(self) -> None:
        head = self._header
        torn = head[_H_SEQ] & 1
        head[_H_SEQ] += 1 if not torn else 0  # odd while repairing
        if torn:
            self._drop_duplicate_keys()
        ids = self._ids_np
        high = max(int(head[_H_SETS_HIGH]), 2)
        refs = np.bincount(ids[ids > 1], minlength=high).tolist()
        self._refs = refs
        self._set_int = [0] * high
        self._intern = {}
        self._free_sets = deque()
        now = self._now()
        counts = [0] * (self.max_workers * 3)
        for sid in range(2, high):
            if not refs[sid]:
                self._free_sets.append((now, sid))  # a reader may be mid-lookup
                continue
            mask = self._read_set(sid)
            self._set_int[sid] = mask
            self._intern[mask] = sid
            bits = mask
            while bits:
                low = bits & -bits
                slot, t = divmod(low.bit_length() - 1, _STRIDE)
                if t < 3:
                    counts[slot * 3 + t] += refs[sid]
                bits ^= low
        for i, c in enumerate(counts):
            self._counts[i] = c
        empty = np.flatnonzero(ids == _EMPTY_SET)
        for key in self._keys_np[empty].tolist():  # keys a dead writer was deleting
            pos = self._find(key)
            if pos >= 0:
                self._delete_at(pos)
        head[_H_KEYS] = int(np.count_nonzero(ids))
        head[_H_SETS_LIVE] = len(self._intern)
        head[_H_WRITER_PID] = os.getpid()
        head[_H_TAKEOVERS] += 1
        self._extra_refs = {}
        head[_H_SEQ] += 1

    def _drop_duplicate_keys(self) -> None:
        """Keys present twice (a deletion's shift copied one back and died before clearing the
        old slot): keep the copy a lookup finds, delete the other."""
        live = np.flatnonzero(self._ids_np)
        keys = self._keys_np[live]
        uniq, counts = np.unique(keys, return_counts=True)
        for key in uniq[counts > 1].tolist():
            first = self._find(key)
            for pos in live[keys == np.uint64(key)].tolist():
                if pos != first and self._keys[pos] == key and self._ids[pos]:
                    self._delete_at(pos)

    def _begin(self) -> None:
        self._header[_H_SEQ] += 1

    _end = _begin

    # ---- the key table (writer) ----------------------------------------------------------------
    def _home(self, key: int) -> int:
        return (key * MUL & _M64) % self.capacity

    def _find(self, key: int) -> int:
        """Slot of ``key``, or ``-1 - insertion slot`` when absent."""
        ids, keys, cap = self._ids, self._keys, self.capacity
        pos = (key * MUL & _M64) % cap
        while ids[pos]:
            if keys[pos] == key:
                return pos
            pos += 1
            if pos == cap:
                pos = 0
        return -1 - pos

    def _delete_at(self, pos: int) -> None:
        """Empty slot ``pos`` and shift back the entries after it that belong before it."""
        ids, keys, cap = self._ids, self._keys, self.capacity
        i = pos
        while True:
            ids[i] = 0
            j = i
            while True:
                j += 1
                if j == cap:
                    j = 0
                if not ids[j]:
                    self._header[_H_KEYS] -= 1
                    return
                home = (keys[j] * MUL & _M64) % cap
                if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                    break
            keys[i] = keys[j]
            self._used[i] = self._used[j]
            ids[i] = ids[j]
            i = j

    def _intern_set(self, mask: int) -> int:
        """Id of the set ``mask`` (0 when none is free; the empty mask is :data:`_EMPTY_SET`)."""
        if not mask:
            return _EMPTY_SET
        sid = self._intern.get(mask)
        if sid is not None:
            return sid
        free = self._free_sets
        if free and free[0][0] <= self._now() - SET_QUARANTINE_S:
            sid = free.popleft()[1]
        else:
            sid = len(self._refs)
            if sid >= self.max_holder_sets:
                return 0
            self._refs.append(0)
            self._set_int.append(0)
            self._header[_H_SETS_HIGH] = sid + 1
        self._set_view(sid)[:] = np.frombuffer(mask.to_bytes(self._set_bytes, "little"), np.uint64)
        self._set_int[sid] = mask
        self._intern[mask] = sid
        self._header[_H_SETS_LIVE] += 1
        return sid

    def _unref(self, sid: int, n: int = 1) -> None:
        if sid == _EMPTY_SET:
            return
        left = self._refs[sid] - n
        self._refs[sid] = left
        if not left:
            del self._intern[self._set_int[sid]]
            self._set_int[sid] = 0
            self._free_sets.append((self._now(), sid))
            self._header[_H_SETS_LIVE] -= 1

    def _count(self, old: int, new: int, n: int = 1) -> None:
        """Per-worker counts for ``n`` keys going from holders ``old`` to ``new``."""
        bits = old ^ new
        while bits:
            low = bits & -bits
            slot, t = divmod(low.bit_length() - 1, _STRIDE)
            self._counts[slot * 3 + t] += n if new & low else -n
            bits ^= low

    def _evict_one(self) -> None:
        """Evict one key (module docstring): the clock hand clears the use mark of each key it
        passes (set by every store that reaches it) and stops at the first unmarked key; when
        that key is in some gpu tier, the next :data:`EVICT_SCAN` keys are looked at (marks left
        as they are) for an unmarked one held in no gpu tier, which goes instead."""
        ids, used, cap = self._ids, self._used, self.capacity
        gpu, set_int = self._sel_all, self._set_int
        pos = self._header[_H_HAND] % cap
        for _ in range(2 * cap + 1):  # at most two turns: the first clears every mark
            if ids[pos]:
                if not used[pos]:
                    break
                used[pos] = 0
            pos = pos + 1 if pos + 1 < cap else 0
        else:
            return  # empty table
        chosen = hand = pos
        if set_int[ids[pos]] & gpu:
            seen = 0
            while seen < EVICT_SCAN:
                pos = pos + 1 if pos + 1 < cap else 0
                if pos == hand:
                    break
                if ids[pos]:
                    seen += 1
                    if not used[pos] and not set_int[ids[pos]] & gpu:
                        chosen = pos
                        break
        sid = ids[chosen]
        key = self._keys[chosen]
        self._count(self._set_int[sid], 0)
        bits = self._set_int[sid]
        while bits and self._extra_refs:
            low = bits & -bits
            slot, t = divmod(low.bit_length() - 1, _STRIDE)
            self._extra_refs.pop((key, slot, t), None)
            bits ^= low
        self._unref(sid)
        self._delete_at(chosen)
        self._header[_H_EVICTED] += 1
        self._header[_H_HAND] = hand if chosen != hand else (hand + 1) % cap

    # ---- writes ------------------------------------------------------------------------------
    async def store(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        self.store_sync(worker, tier, keys)

    def store_sync(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        """Add one copy of each (key, worker, tier); the writer only (a reader ignores it: its
        events are not its to apply). Raises ValueError on an unknown tier."""
        t = check_tier(tier)
        if not self.writer or not keys:
            return
        slot = self.slot(worker)
        bit = 1 << (_STRIDE * slot + t)
        head, ids, table_keys, used = self._header, self._ids, self._keys, self._used
        moves: dict[int, int] = {}  # old set -> new set, for this call
        set_int, refs = self._set_int, self._refs
        self._begin()
        try:
            for key in keys:
                pos = self._find(key)
                if pos >= 0:
                    old = ids[pos]
                    if set_int[old] & bit:
                        ref = (key, slot, t)
                        self._extra_refs[ref] = self._extra_refs.get(ref, 1) + 1
                        continue
                else:
                    old = 0
                    if head[_H_KEYS] >= self.max_keys:
                        self._evict_one()
                        moves.clear()  # the eviction may have freed a set named there
                        pos = self._find(key)
                new = moves.get(old)
                if new is None:
                    new = self._intern_set(set_int[old] | bit if old else bit)
                    if not new:
                        head[_H_DROPPED] += 1
                        continue
                    moves[old] = new
                if pos < 0:
                    pos = -1 - pos
                    table_keys[pos] = key
                    ids[pos] = new
                    head[_H_KEYS] += 1
                else:
                    ids[pos] = new
                    self._unref(old)
                used[pos] = 1
                refs[new] += 1
                self._counts[slot * 3 + t] += 1
        finally:
            self._end()

    async def remove(self, worker: str, tier: str, keys: Sequence[int]) -> int:
        return self.remove_sync(worker, tier, keys)

    def remove_sync(self, worker: str, tier: str, keys: Sequence[int]) -> int:
        """Drop one copy of each (key, worker, tier) (the writer; a reader returns 0); a gpu
        removal also drops this process's speculative entries. Returns how many keys were not
        present. Raises ValueError on an unknown tier."""
        t = check_tier(tier)
        if t == 0:
            self.speculative.drop_speculative_sync(worker, keys)
        if not self.writer:
            return 0
        self._refresh_names()
        slot = self._slots.get(worker)
        if slot is None:
            return len(keys)
        bit = 1 << (_STRIDE * slot + t)
        ids, set_int, refs = self._ids, self._set_int, self._refs
        moves: dict[int, int] = {}
        extra = self._extra_refs
        missing = 0
        self._begin()
        try:
            for key in keys:
                pos = self._find(key)
                if pos < 0 or not set_int[ids[pos]] & bit:
                    missing += 1
                    continue
                if extra and drop_extra_copy(extra, (key, slot, t)):
                    continue
                old = ids[pos]
                new = moves.get(old)
                if new is None:
                    new = self._intern_set(set_int[old] & ~bit)
                    if not new:  # no set free for the smaller holder set: drop the key whole
                        self._count(set_int[old], 0)
                        self._unref(old)
                        self._delete_at(pos)
                        self._header[_H_DROPPED] += 1
                        continue
                    moves[old] = new
                self._counts[slot * 3 + t] -= 1
                self._unref(old)
                if new == _EMPTY_SET:
                    self._delete_at(pos)
                else:
                    ids[pos] = new
                    refs[new] += 1
        finally:
            self._end()
        return missing

    async def clear_worker(self, worker: str, tier: str | None = None) -> None:
        self.clear_worker_sync(worker, tier)

    def clear_worker_sync(self, worker: str, tier: str | None = None) -> None:
        """Forget ``worker``'s entries (in ``tier`` only when given): this process's speculative
        ones always; the shared ones when this process is the writer, which also frees the
        worker's slot when all tiers are cleared. One pass over the live holder sets and one
        vectorized remap of the key table; keys left with no holder are deleted one by one."""
        self.speculative.clear_worker_sync(worker, tier)
        if not self.writer:
            return
        self._refresh_names()
        slot = self._slots.get(worker)
        if slot is None:
            return
        tiers = [check_tier(tier)] if tier is not None else [0, 1, 2]
        drop = sum(1 << (_STRIDE * slot + t) for t in tiers)
        self._begin()
        try:
            remap: dict[int, int] = {}
            for sid, mask in enumerate(self._set_int):
                if mask & drop and self._refs[sid]:
                    remap[sid] = 0
            for sid in list(remap):
                mask = self._set_int[sid]
                new = self._intern_set(mask & ~drop)
                n = self._refs[sid]
                self._count(mask, mask & ~drop, n)
                if not new:  # no set free: these keys go whole
                    self._count(mask & ~drop, 0, n)
                    new = _EMPTY_SET
                remap[sid] = new
                if new != _EMPTY_SET:
                    self._refs[new] += n
                self._unref(sid, n)
            if remap:
                table = np.arange(len(self._refs), dtype=np.uint32)
                for sid, new in remap.items():
                    table[sid] = new
                ids = self._ids_np
                live = np.flatnonzero(ids)
                ids[live] = table[ids[live]]
                for key in self._keys_np[live[ids[live] == _EMPTY_SET]].tolist():
                    self._delete_at(self._find(key))
            if self._extra_refs:
                for ref in [r for r in self._extra_refs if r[1] == slot and r[2] in tiers]:
                    del self._extra_refs[ref]
            if tier is None:
                for t in range(3):
                    self._counts[slot * 3 + t] = 0
                self._free_slot(slot)
        finally:
            self._end()

    async def store_speculative(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        self.speculative.store_speculative_sync(worker, keys, ttl_s)

    def store_speculative_sync(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        """This process's speculative entries (module docstring)."""
        self.speculative.store_speculative_sync(worker, keys, ttl_s)

    async def drop_speculative(self, worker: str, keys: Sequence[int]) -> None:
        """From this process's speculative entries (module docstring)."""
        self.speculative.drop_speculative_sync(worker, keys)

    # ---- reads -------------------------------------------------------------------------------
    def _find_many(self, keys: np.ndarray) -> np.ndarray:
        """Holder-set id of each key (uint32; 0 when absent). Vectorized rounds, one slot per
        unresolved key each (a slot holding the key or an empty slot resolves it), until at most
        :data:`_SCALAR_TAIL` keys are left in long runs; those go one slot at a time."""
        cap = self.capacity
        pos = ((keys * np.uint64(MUL)) % self._cap_u64).astype(np.int64)
        out = np.zeros(len(keys), np.uint32)
        todo = np.arange(len(keys))
        table_ids, table_keys = self._ids_np, self._keys_np
        p = pos
        while True:
            want = keys[todo]
            before = table_keys[p]
            sid = table_ids[p]
            hit = (before == want) & (table_keys[p] == want)  # the key stayed while its id was read
            out[todo[hit]] = sid[hit]
            more = ~hit & (sid != 0)
            todo = todo[more]
            if todo.size <= _SCALAR_TAIL:
                break
            p = p[more] + 1
            p[p == cap] = 0
        if todo.size:  # the few keys in long runs: one slot at a time costs less than a round
            ids, table = self._ids, self._keys
            for i, pos_i in zip(todo.tolist(), p[more].tolist()):
                key = int(keys[i])
                for _ in range(cap):
                    pos_i = pos_i + 1 if pos_i + 1 < cap else 0
                    before = table[pos_i]
                    sid = ids[pos_i]
                    if not sid:
                        break
                    if before == key and table[pos_i] == key:
                        out[i] = sid
                        break
        return out

    def _snapshot(self, keys: Sequence[int]) -> tuple[np.ndarray, dict[int, int]]:
        """Holder-set ids of ``keys`` and the masks of the sets among them (0 and the empty set
        map to 0)."""
        ids = self._ids_of(keys)
        return ids, self._masks_of(ids)

    def _ids_of(self, keys: Sequence[int]) -> np.ndarray:
        """Holder-set id of each of ``keys`` (uint32; 0 when absent): the C probe of
        :mod:`kvcore.index.chain_rows` when it is built, else :meth:`_find_many`."""
        if chain_rows.NATIVE:
            out = np.empty(len(keys), np.uint32)
            chain_rows.native.probe_ids(keys, self._keys_np, self._ids_np, MUL, out)
            return out
        return self._find_many(np.frombuffer(struct.pack(f"{len(keys)}Q", *keys), np.uint64))

    def _masks_of(self, ids: np.ndarray) -> dict[int, int]:
        masks = {sid: self._read_set(sid) for sid in np.unique(ids).tolist() if sid > 1}
        masks[0] = masks[_EMPTY_SET] = 0
        return masks

    def _match_rows(self, ids: np.ndarray, change: np.ndarray, end: int) -> dict[str, TierMatch]:
        """:meth:`match_sync` over many holder changes or many named slots: the sets at the
        changes read as rows of one matrix straight from the file
        (:mod:`kvcore.index.chain_rows`), only as many words as the highest named slot needs."""
        names = self._names_now()
        words = self._named_words
        starts = np.concatenate((np.zeros(1, np.int64), change))
        rows = scratch.get("rows", (starts.size, self._words), np.uint64)
        np.take(self._sets_np, ids[starts], axis=0, out=rows, mode="clip")  # ids < max_holder_sets
        if words < self._words:
            rows = rows[:, :words]
        return row_matches(rows, starts, end, names)

    def _names_now(self) -> dict[int, str]:
        self._refresh_names()
        return self._names

    async def match(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        return self.match_sync(keys)

    def match_sync(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        """Per worker, the longest run of ``keys`` from block 0 held in some tier, split by tier
        (:meth:`KVIndex.match`), over the shared entries and this process's speculative ones.
        The holder-set ids of all keys come from one vectorized probe; the run ends at the first
        block nobody holds. With no speculative entries and many holder changes or many workers,
        the sets at the changes are read as rows of one matrix (:meth:`_match_rows`); else the
        chains walk the changes one Python int at a time (and every block, with speculative
        entries of this process to merge)."""
        if not keys:
            return {}
        spec = self.speculative
        spec.expire_sync()
        ids = self._ids_of(keys)
        spec_masks = spec._masks
        if spec_masks:
            masks = self._masks_of(ids)
            get = spec_masks.get
            values = [masks[sid] | get(k, 0) for sid, k in zip(ids.tolist(), keys)]
            v = values[0]
            if not v:
                return {}
            steps = ((i, values[i] or None) for i in range(1, len(values)))
            end = len(keys)
        else:
            absent = np.flatnonzero(ids <= _EMPTY_SET)
            end = int(absent[0]) if absent.size else len(keys)
            if not end:
                return {}
            change = np.flatnonzero(ids[1:end] != ids[:end - 1]) + 1
            self._refresh_names()
            if change.size >= _MANY_CHANGES or self._named_words >= _MANY_WORDS:
                return self._match_rows(ids, change, end)
            read = self._read_set
            sid = int(ids[0])
            v = read(sid)
            masks = {sid: v}
            points = change.tolist()
            sids = ids[change].tolist()
            for sid in sids:
                if sid not in masks:
                    masks[sid] = read(sid)
            steps = zip(points, map(masks.__getitem__, sids))
        drops, alive, end = run_chains(v, steps, end, self._sel_all)
        return tier_matches(drops, alive, end, self._names_now(), _STRIDE)

    async def gpu_holders(self, keys: Sequence[int]) -> dict[str, int]:
        return self.gpu_holders_sync(keys)

    def gpu_holders_sync(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker holding any of ``keys`` in gpu (speculative included), a bit mask over
        positions (:meth:`KVIndex.gpu_holders`)."""
        if not keys:
            return {}
        spec = self.speculative
        spec.expire_sync()
        ids, masks = self._snapshot(keys)
        get = spec._masks.get
        values = (masks[sid] | get(key, 0) for sid, key in zip(ids.tolist(), keys))
        return gpu_positions(values, self._sel_all, self._names_now(), _STRIDE)

    async def stats(self) -> dict[str, WorkerIndexStats]:
        return self.stats_sync()

    def stats_sync(self) -> dict[str, WorkerIndexStats]:
        """Per worker with a slot: confirmed blocks per tier (shared) and this process's
        speculative entries."""
        spec = {w: s.speculative_blocks for w, s in self.speculative.stats_sync().items()}
        out = {}
        for slot, name in self._names_now().items():
            blocks = {t: int(self._counts[slot * 3 + i]) for i, t in enumerate(TIERS)}
            out[name] = WorkerIndexStats(blocks=blocks, speculative_blocks=spec.get(name, 0))
        return out

    def counters(self) -> dict[str, int]:
        """The file's counters: ``keys`` (distinct keys held), ``holder_sets`` (in use),
        ``evicted_keys``, ``dropped_keys``, ``takeovers`` (writers that took the file over),
        ``writer_pid`` (the last process to take it over)."""
        head = self._header
        return {"keys": int(head[_H_KEYS]), "holder_sets": int(head[_H_SETS_LIVE]), "evicted_keys": int(head[_H_EVICTED]),
                "dropped_keys": int(head[_H_DROPPED]), "takeovers": int(head[_H_TAKEOVERS]),
                "writer_pid": int(head[_H_WRITER_PID])}

    @property
    def dropped_keys(self) -> int:
        """Keys not stored for want of a free holder set (module docstring)."""
        return int(self._header[_H_DROPPED])

    def __len__(self) -> int:
        """Distinct keys held in the shared table."""
        return int(self._header[_H_KEYS])
