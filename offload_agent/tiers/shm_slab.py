"""The CPU tier in shared memory: one file (normally under ``/dev/shm``) that the offload agent
creates and owns, and that the vLLM process's KV connector maps to store blocks in.

Layout of the file (little-endian; all offsets multiples of 4096 so the slab can be pinned or
registered for DMA)::

    offset       size                 field
    0            4                    magic b"KVRS"
    4            2                    format version (1)
    6            2                    zero
    8            16                   fingerprint digest (:meth:`TierFingerprint.digest`)
    24           8                    block_bytes: bytes of one block (all layers)
    32           8                    num_slots
    40           8                    table_offset (4096)
    48           8                    slab_offset
    56           8                    table_version: +1 after every completed slot write
    64           8                    created_unix_ns
    ...          up to 4096           zero
    table_offset num_slots x 32       slot table, one row per slot:
                                        0  16  tier key of the block in the slot (zero: none)
                                        16  8  seq: even when the row and the slot are stable,
                                               odd while the writer changes them
                                        24  8  zero
    slab_offset  num_slots x block_bytes  the slots' bytes

Ownership rules (one file per vLLM worker):

- **The agent creates and frees the file.** :meth:`ShmSlab.create` makes it (or reuses one left
  by an agent that stopped, when its header matches; a mismatching header means another layout:
  the file is cleared). It is removed only by the agent (:meth:`ShmSlab.unlink`) when told to at
  its clean stop; an unlinked file's memory lives until the last mapping closes, so a running
  vLLM keeps its tier when the agent goes.
- **The connector places and evicts.** The connector's scheduler side (its
  :class:`offload_agent.tiers.planner.TierPlanner`) is the only one that decides which block goes
  in which slot and which leaves; its worker side is the only writer of slots and rows. It writes a
  slot with the seqlock protocol: :meth:`begin_write` (seq odd, key zeroed), the bytes, then
  :meth:`end_write` (key, seq even, table_version + 1).
- **The agent only reads**, to serve blocks to peers: :meth:`read_consistent` copies a slot
  and returns it only when the row held the expected key with the same even seq before and after
  the copy (a torn copy is refused, never served); the checksum sent to a peer is computed over that
  consistent copy. Or it lends the slot in place: :meth:`stable_seq` before the kernel reads it and
  :meth:`unchanged` after its checksum is taken bracket the send the same way.
- After a vLLM restart the connector finds the file again through the agent and rebuilds its
  planner from the stable rows (:meth:`stable_slots`): the CPU tier survives a worker restart.

The seqlock relies on aligned 8-byte stores being single stores and on store order being kept
(x86-64; the CPU build this is tested on). Standard library only: this module also runs inside
vLLM's interpreter.
"""
from __future__ import annotations

import errno
import mmap
import os
import struct
import time
from pathlib import Path

MAGIC = b"KVRS"
VERSION = 1
PAGE_BYTES = 4096
ROW_BYTES = 32
KEY_BYTES = 16
_HEADER = struct.Struct("<4sHH16sQQQQQQ")
_SEQ = struct.Struct("<Q")
_ZERO_KEY = bytes(KEY_BYTES)
_VERSION_AT = 56


class SlabMismatch(Exception):
    """The file is not a CPU tier of the expected layout (bad magic or version, another
    fingerprint or block size, or too short). The message says which."""


def _round_up(n: int, to: int = PAGE_BYTES) -> int:
    return (n + to - 1) // to * to


def reserve(fd: int, size: int, what: str) -> None:
    """Reserve every page of the file ``fd`` up to ``size`` bytes (``posix_fallocate``), so a
    shared memory file that does not fit fails now, never as a bus error on a later write; a file
    system that cannot reserve is left as it is. Raises OSError naming ``what`` and the size."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise OSError(exc.errno, f"cannot reserve {size} bytes for {what}: {exc.strerror}") from exc


def file_bytes(num_slots: int, block_bytes: int) -> int:
    """Size of the file holding ``num_slots`` slots of ``block_bytes``."""
    return _round_up(PAGE_BYTES + num_slots * ROW_BYTES) + num_slots * block_bytes


class ShmSlab:
    """A mapped CPU-tier file. Build with :meth:`create` (the agent) or :meth:`attach` (the
    connector). ``slab`` is a writable memoryview of ``num_slots * block_bytes`` bytes."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        magic, version, _, fp, block_bytes, num_slots, table_at, slab_at, _, _ = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION:
            raise SlabMismatch(f"{path}: not a kvroute CPU tier (magic {magic!r}, version {version})")
        if len(mm) < slab_at + num_slots * block_bytes:
            raise SlabMismatch(f"{path}: {len(mm)} bytes, too short for {num_slots} slots of {block_bytes}")
        self.fingerprint_digest: bytes = fp
        self.block_bytes: int = block_bytes
        self.num_slots: int = num_slots
        self._table_at = table_at
        self._slab_at = slab_at
        self._view = memoryview(mm)
        self.slab = self._view[slab_at:slab_at + num_slots * block_bytes]

    # ---- making and finding the file ----------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, fingerprint_digest: bytes, block_bytes: int,
               num_slots: int) -> "ShmSlab":
        """The agent's side: map ``path``, creating it for ``num_slots`` slots of ``block_bytes``
        with every row empty; an existing file with the same fingerprint, block size and slot
        count is reused as it is (its blocks stay). Every page is reserved at creation
        (``posix_fallocate``), so a CPU tier that does not fit fails here, never as a bus error on
        a later write or when the connector registers the file for DMA (which pins all of it).
        Raises ValueError for sizes < 1, OSError when the file cannot be made (e.g. ``/dev/shm``
        too small: the message says how many bytes were asked)."""
        if block_bytes < 1 or num_slots < 1:
            raise ValueError(f"need block_bytes >= 1 and num_slots >= 1, got {block_bytes}, {num_slots}")
        if len(fingerprint_digest) != KEY_BYTES:
            raise ValueError("fingerprint digest must be 16 bytes")
        path = Path(path)
        try:
            slab = cls.attach(path)
            if (slab.fingerprint_digest, slab.block_bytes, slab.num_slots) == (fingerprint_digest, block_bytes, num_slots):
                return slab
            slab.close()
        except (FileNotFoundError, SlabMismatch, ValueError):
            pass
        size = file_bytes(num_slots, block_bytes)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            reserve(fd, size, f"the CPU tier in {path.parent}")
            mm = mmap.mmap(fd, size)
            table_at = PAGE_BYTES
            slab_at = _round_up(table_at + num_slots * ROW_BYTES)
            _HEADER.pack_into(mm, 0, MAGIC, VERSION, 0, fingerprint_digest, block_bytes, num_slots,
                              table_at, slab_at, 0, time.time_ns())
            os.replace(tmp, path)  # a reader never sees a half-made header under the final name
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return cls(path, fd, mm)

    @classmethod
    def attach(cls, path: str | os.PathLike) -> "ShmSlab":
        """The connector's side: map an existing file read-write. Raises FileNotFoundError, or
        :class:`SlabMismatch` when it is not a CPU tier file."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < PAGE_BYTES:
                raise SlabMismatch(f"{path}: {size} bytes, shorter than the header")
            mm = mmap.mmap(fd, size)
            try:
                return cls(path, fd, mm)
            except BaseException:
                mm.close()
                raise
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Close the file and unmap it; while views of the slab handed out are still alive (a
        tensor over it, say), the mapping stays until they are gone."""
        os.close(self._fd)
        try:
            self.slab.release()
            self._view.release()
            self._mm.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        """Remove the file (the agent, at a clean stop when told to); mappings stay valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ---- the slot table ----------------------------------------------------------------------
    def _row(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        return self._table_at + slot * ROW_BYTES

    def slot_view(self, slot: int) -> memoryview:
        """The ``block_bytes`` of ``slot`` (writable)."""
        self._row(slot)
        at = slot * self.block_bytes
        return self.slab[at:at + self.block_bytes]

    def begin_write(self, slot: int) -> None:
        """Start changing ``slot``: its row holds no key and an odd seq until :meth:`end_write`."""
        row = self._row(slot)
        seq = _SEQ.unpack_from(self._mm, row + KEY_BYTES)[0]
        if not seq & 1:
            _SEQ.pack_into(self._mm, row + KEY_BYTES, seq + 1)
        self._mm[row:row + KEY_BYTES] = _ZERO_KEY

    def end_write(self, slot: int, key: bytes | None) -> None:
        """Finish changing ``slot``: it now holds ``key`` (None: nothing valid)."""
        row = self._row(slot)
        self._mm[row:row + KEY_BYTES] = key if key is not None else _ZERO_KEY
        seq = _SEQ.unpack_from(self._mm, row + KEY_BYTES)[0]
        _SEQ.pack_into(self._mm, row + KEY_BYTES, seq + 1 if seq & 1 else seq + 2)
        version = _SEQ.unpack_from(self._mm, _VERSION_AT)[0]
        _SEQ.pack_into(self._mm, _VERSION_AT, version + 1)

    def key_of(self, slot: int) -> bytes | None:
        """The key ``slot`` holds when its row is stable, else None."""
        row = self._row(slot)
        seq = _SEQ.unpack_from(self._mm, row + KEY_BYTES)[0]
        key = bytes(self._mm[row:row + KEY_BYTES])
        if seq & 1 or key == _ZERO_KEY:
            return None
        return key

    def table_version(self) -> int:
        """Completed slot writes since the file was made (readers rescan when it moves)."""
        return _SEQ.unpack_from(self._mm, _VERSION_AT)[0]

    def stable_slots(self) -> list[tuple[int, bytes]]:
        """``(slot, key)`` of every slot holding a block, in slot order."""
        out = []
        table = self.table_bytes()
        for slot in range(self.num_slots):
            at = slot * ROW_BYTES
            key = table[at:at + KEY_BYTES]
            if key != _ZERO_KEY and not _SEQ.unpack_from(table, at + KEY_BYTES)[0] & 1:
                out.append((slot, key))
        return out

    def table_bytes(self) -> bytes:
        """A copy of the whole slot table (``num_slots x 32`` bytes, rows as in the module
        docstring), for a reader that diffs it against its last copy."""
        return bytes(self._mm[self._table_at:self._table_at + self.num_slots * ROW_BYTES])

    def stable_seq(self, slot: int, key: bytes) -> int | None:
        """The seq of ``slot`` when its row is stable and holds ``key``, else None: the start of a
        seqlock-checked read that :meth:`unchanged` ends."""
        row = self._row(slot)
        seq = _SEQ.unpack_from(self._mm, row + KEY_BYTES)[0]
        if seq & 1 or self._mm[row:row + KEY_BYTES] != key:
            return None
        return seq

    def unchanged(self, slot: int, key: bytes, seq: int) -> bool:
        """True when ``slot`` still holds ``key`` with seq ``seq`` (from :meth:`stable_seq`): no
        write began since, so every read of its bytes in between saw the block whole."""
        row = self._row(slot)
        return (_SEQ.unpack_from(self._mm, row + KEY_BYTES)[0] == seq
                and self._mm[row:row + KEY_BYTES] == key)

    def read_consistent(self, slot: int, key: bytes, out) -> bool:
        """Copy ``slot`` into ``out`` (``block_bytes``, writable) if it holds ``key`` and was not
        changed during the copy; False otherwise (``out`` then holds garbage)."""
        row = self._row(slot)
        seq_at = row + KEY_BYTES
        before = _SEQ.unpack_from(self._mm, seq_at)[0]
        if before & 1 or self._mm[row:row + KEY_BYTES] != key:
            return False
        memoryview(out).cast("B")[:] = self.slot_view(slot)
        return (_SEQ.unpack_from(self._mm, seq_at)[0] == before
                and self._mm[row:row + KEY_BYTES] == key)
