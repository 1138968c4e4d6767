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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from offload_agent.tiers.keys import TierFingerprint
from offload_agent.tiers.ssd_file import CorruptBlockError, block_path, read_block_file, write_block_file

log = logging.getLogger("kvroute.tiers")


class TierStore:
    """CPU slots over ``slab`` (a writable buffer of ``num_slots * block_bytes`` bytes) and, when
    ``ssd_root`` is given, the SSD folder ``ssd_root/<fingerprint dir>``.

    ``failures``: ``(key, tier, slot or None)`` of every failed read or write since the last
    :meth:`take_failures`. ``io_threads``: parallel file reads in :meth:`read_ssd_many` (the
    reads and the checksum release the GIL). Raises ValueError when the slab's size does not match.
    """

    def __init__(self, slab, num_slots: int, block_bytes: int, fingerprint: TierFingerprint,
                 ssd_root: Path | None = None, io_threads: int = 4) -> None:
        self._slab = memoryview(slab).cast("B")
        if self._slab.nbytes != num_slots * block_bytes:
            raise ValueError(f"slab of {self._slab.nbytes} bytes, expected {num_slots} x {block_bytes}")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint
        self._fp = fingerprint.digest()
        self._slot_keys: list[bytes | None] = [None] * num_slots
        self.failures: list[tuple[bytes, str, int | None]] = []
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
        return self._slot_keys[slot] == key

    def mark(self, slot: int, key: bytes | None) -> None:
        """Record that ``slot`` now holds ``key`` (None: nothing valid)."""
        self._slot_keys[slot] = key

    def fail(self, key: bytes, tier: str, slot: int | None = None) -> None:
        self.failures.append((key, tier, slot))

    def take_failures(self) -> list[tuple[bytes, str, int | None]]:
        out, self.failures = self.failures, []
        return out

    # ---- SSD ---------------------------------------------------------------------------------------
    def spill(self, slot: int, key: bytes) -> bool:
        """Write ``slot`` to ``key``'s file; False (and a recorded SSD failure) when the slot does
        not hold ``key``, there is no SSD tier or the disk refuses."""
        if self.fp_dir is None or not self.holds(slot, key):
            self.fail(key, "ssd")
            return False
        try:
            write_block_file(self.fp_dir, key, self._fp, self.slot(slot))
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
        """:meth:`read_ssd` of each key into the matching buffer, up to ``io_threads`` at a time."""
        if len(keys) <= 1 or self._io_threads == 1:
            return [self.read_ssd(k, o) for k, o in zip(keys, outs)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvroute-ssd")
        return list(self._pool.map(self.read_ssd, keys, outs))

    def put(self, slot: int, key: bytes, data) -> None:
        """Copy ``data`` (``block_bytes``, e.g. a block read ahead from SSD) into ``slot`` as ``key``."""
        self.slot(slot)[:] = memoryview(data).cast("B")
        self.mark(slot, key)

    def promote(self, key: bytes, slot: int) -> bool:
        """Read ``key``'s file into ``slot``; on failure the slot holds nothing and both the SSD
        copy and the slot's CPU copy are recorded failed."""
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
