"""The tiers' bytes: a CPU slab of block-sized slots and the SSD folder, in the process that holds
vLLM's KV cache (the connector's worker side).

:class:`TierStore` executes the byte-level part of the planner's operations (see
:mod:`offload_agent.tiers.planner`): spill a slot to a file, promote a file into a slot, read a
file into a staging buffer, delete a file. Copies between a slot and vLLM's paged KV cache are the
connector's (they need torch); they call :meth:`TierStore.slot` for the slot's memory and
:meth:`TierStore.mark`/:meth:`TierStore.holds` to keep each slot's key.

Every read is checked: a slot must hold the key the operation names, a file must pass
:func:`offload_agent.tiers.ssd_file.read_block_file`. A corrupt or truncated file is deleted, so it
is never served; each failure is recorded (:attr:`TierStore.failures`) for the planner to forget.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from offload_agent.tiers.keys import TierFingerprint
from offload_agent.tiers.shm_slab import ShmSlab
from offload_agent.tiers.ssd_file import (READ_AHEAD_BYTES, READ_TASK_BYTES, CorruptBlockError, block_path,
                                          prefetch_block_files, read_block_file, write_block_file)

log = logging.getLogger("kvroute.tiers")


class TierStore:
    """CPU slots over ``slab`` (a writable buffer of ``num_slots * block_bytes`` bytes) and, when
    ``ssd_root`` is given, the SSD folder ``ssd_root/<fingerprint dir>``.

    With ``shm`` (the agent's :class:`~offload_agent.tiers.shm_slab.ShmSlab`), the slots are that
    file's slab and each slot's key lives in its slot table (``slab`` is then ignored), written
    with the seqlock protocol so that the agent can copy a slot while the slot changes: every
    write into a slot comes between :meth:`begin` and :meth:`mark`.

    ``failures``: ``(key, tier, slot or None)`` of every failed read or write since the last
    :meth:`take_failures` (recorded from any thread). ``io_threads``: parallel file reads in
    :meth:`read_ssd_many` (the reads and the checksum release the GIL). Raises ValueError when the
    slab's size does not match.
    """

    def __init__(self, slab, num_slots: int, block_bytes: int, fingerprint: TierFingerprint,
                 ssd_root: Path | None = None, io_threads: int = 4, shm: ShmSlab | None = None) -> None:
        self._shm = shm
        self._slab = memoryview(shm.slab if shm is not None else slab).cast("B")
        if self._slab.nbytes != num_slots * block_bytes:
            raise ValueError(f"slab of {self._slab.nbytes} bytes, expected {num_slots} x {block_bytes}")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint
        self._fp = fingerprint.digest()
        self._slot_keys: list[bytes | None] = [None] * num_slots
        self.failures: list[tuple[bytes, str, int | None]] = []
        self._failures_lock = threading.Lock()
        self.fp_dir: Path | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._io_threads = max(1, io_threads)
        if ssd_root is not None:
            self.fp_dir = Path(ssd_root) / fingerprint.dir_name()
            self.fp_dir.mkdir(parents=True, exist_ok=True)
            meta = self.fp_dir / "fingerprint.json"
            if not meta.exists():
                meta.write_text(fingerprint.to_json())

    # ---- slots -------------------------------------------------------------------------------------
    def slot(self, slot: int) -> memoryview:
        """The ``block_bytes`` of ``slot`` (writable)."""
        return self._slab[slot * self.block_bytes:(slot + 1) * self.block_bytes]

    def holds(self, slot: int, key: bytes) -> bool:
        """Whether ``slot`` holds ``key`` (and is not being written)."""
        if self._shm is not None:
            return self._shm.key_of(slot) == key
        return self._slot_keys[slot] == key

    def begin(self, slot: int) -> None:
        """``slot`` is about to be written: it holds nothing valid until :meth:`mark`."""
        if self._shm is not None:
            self._shm.begin_write(slot)
        else:
            self._slot_keys[slot] = None

    def mark(self, slot: int, key: bytes | None) -> None:
        """Record that ``slot`` now holds ``key`` (None: nothing valid)."""
        if self._shm is not None:
            self._shm.end_write(slot, key)
        else:
            self._slot_keys[slot] = key

    def fail(self, key: bytes, tier: str, slot: int | None = None) -> None:
        with self._failures_lock:
            self.failures.append((key, tier, slot))

    def take_failures(self) -> list[tuple[bytes, str, int | None]]:
        with self._failures_lock:
            out, self.failures = self.failures, []
        return out

    # ---- SSD ---------------------------------------------------------------------------------------
    def spill_bytes(self, slot: int, key: bytes, out: bytearray | None = None) -> bytearray | None:
        """A copy of ``slot``'s bytes (into ``out``, ``block_bytes``, when given), to be written as
        ``key``'s file by :meth:`write_ssd` later (the slot may be reused meanwhile); None (and a
        recorded SSD failure) when the slot does not hold ``key`` or there is no SSD tier."""
        if self.fp_dir is None or not self.holds(slot, key):
            self.fail(key, "ssd")
            return None
        if out is None:
            return bytearray(self.slot(slot))
        out[:] = self.slot(slot)
        return out

    def write_ssd(self, key: bytes, data) -> bool:
        """Write ``data`` (``block_bytes``) as ``key``'s file (atomically: readers see the old
        file, none, or the whole new one); False (and a recorded SSD failure) when there is no SSD
        tier or the disk refuses. Thread-safe."""
        if self.fp_dir is None:
            self.fail(key, "ssd")
            return False
        try:
            write_block_file(self.fp_dir, key, self._fp, data)
        except OSError as exc:
            log.warning("SSD tier: cannot write block %s: %s", key.hex(), exc)
            self.fail(key, "ssd")
            return False
        return True

    def read_ssd(self, key: bytes, out) -> bool:
        """Read ``key``'s file into ``out`` (``block_bytes``), checked; False when missing or bad
        (a bad file is deleted; an SSD failure is recorded)."""
        if self.fp_dir is None:
            self.fail(key, "ssd")
            return False
        try:
            read_block_file(self.fp_dir, key, self._fp, out)
            return True
        except FileNotFoundError:
            log.warning("SSD tier: block %s is missing", key.hex())
        except (CorruptBlockError, OSError) as exc:
            log.warning("SSD tier: block %s not served: %s (deleted)", key.hex(), exc)
            self.drop_ssd(key)
        self.fail(key, "ssd")
        return False

    def read_ssd_many(self, keys: list[bytes], outs: list) -> list[bool]:
        """:meth:`read_ssd` of each key into the matching buffer, up to ``io_threads`` at a time, a
        thread taking ``READ_TASK_BYTES`` of blocks (at least one) per task: for small blocks, a task
        per block costs more than the block's read.

        When the threads alone would have less than ``READ_AHEAD_BYTES`` in flight (one thread, or
        small blocks), the keys go in windows of that size (at least a task per thread) and the
        next window's files are announced to the kernel (:func:`prefetch_block_files`) while this
        one is read, so that the disk has many reads queued while each block is read and checked
        (one small read at a time leaves it idle). With enough threads on large blocks, the
        announcement only adds work."""
        if len(keys) <= 1 or self.fp_dir is None:
            return [self.read_ssd(k, o) for k, o in zip(keys, outs)]
        if self._io_threads > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvroute-ssd")
        per_task = max(1, READ_TASK_BYTES // self.block_bytes)

        def read_some(lo: int, hi: int) -> list[bool]:
            return [self.read_ssd(keys[i], outs[i]) for i in range(lo, hi)]

        def in_tasks(lo: int, end: int):  # the pool's results of keys[lo:end], lazily
            los = range(lo, end, per_task)
            return self._pool.map(read_some, los, [min(end, x + per_task) for x in los])

        oks: list[bool] = []
        if self._pool is not None and self._io_threads * self.block_bytes >= READ_AHEAD_BYTES:
            for part in in_tasks(0, len(keys)):
                oks += part
            return oks
        step = max(READ_AHEAD_BYTES // self.block_bytes, per_task * self._io_threads)
        prefetch_block_files(self.fp_dir, keys[:step])
        for i in range(0, len(keys), step):
            end = min(len(keys), i + step)
            if self._pool is None:
                prefetch_block_files(self.fp_dir, keys[end:end + step])
                oks += read_some(i, end)
                continue
            parts = in_tasks(i, end)
            prefetch_block_files(self.fp_dir, keys[end:end + step])  # while the threads read
            for part in parts:
                oks += part
        return oks

    def put(self, slot: int, key: bytes, data) -> None:
        """Copy ``data`` (``block_bytes``, e.g. a block read ahead from SSD) into ``slot`` as ``key``."""
        self.begin(slot)
        self.slot(slot)[:] = memoryview(data).cast("B")
        self.mark(slot, key)

    def promote(self, key: bytes, slot: int) -> bool:
        """Read ``key``'s file into ``slot``; on failure the slot holds nothing and both the SSD
        copy and the slot's CPU copy are recorded failed."""
        self.begin(slot)
        ok = self.read_ssd(key, self.slot(slot))
        self.mark(slot, key if ok else None)
        if not ok:
            self.fail(key, "cpu", slot)
        return ok

    def drop_ssd(self, key: bytes) -> None:
        """Delete ``key``'s file if present."""
        if self.fp_dir is None:
            return
        try:
            os.unlink(block_path(self.fp_dir, key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("SSD tier: cannot delete block %s: %s", key.hex(), exc)
