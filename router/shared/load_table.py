"""In-flight load that every gateway process of one ``kvroute serve --processes N`` sees.

Each process counts its own dispatches (:class:`~router.workers.registry.WorkerRegistration`); with
several processes on one port, each must also see the others' requests, or two processes send
to one idle worker at once (the dispatch queue opens a worker when *its* requests have no
prefill left). The engines' own ``/metrics`` show the others' requests too, but a scrape is up to
``load_scrape.interval_s`` old, and the dispatch queue decides in milliseconds, so the processes
share their counts through a memory-mapped file instead (``/dev/shm`` when present), written
and read without locks or system calls on the request path:

- one *row* per process: a heartbeat (``time.monotonic()`` of its last write; Linux's
  monotonic clock is system-wide) and per worker *slot* six float64 fields: requests in flight,
  predicted prefill tokens before their first byte, requests decoding, the latest predicted
  end of a prefill (monotonic s; ``inf`` when one is unpredicted, 0 when none), requests before
  their first byte or held for the worker by the dispatch queue (*pending*), and when the newest
  of those was sent or held (monotonic s, 0 when none);
- each process writes only its own row (one writer per field: an aligned 8-byte store is never
  seen half-written on the platforms kvroute runs on), and sums the others' rows when it reads;
  a row whose heartbeat is older than :data:`STALE_S` (a dead process) counts as empty;
- a worker id gets its slot from a name table at the start of the file, under an exclusive
  ``flock`` (only when a process first meets the id); ids keep their slot for the file's life;
- a dispatch queue takes a worker under the same ``flock`` (:meth:`SharedLoadTable.claim`): it
  checks the worker is still open and publishes its hold in one step, so two processes woken by
  the same event (a first byte, a predicted opening both read from this table) never both take
  it: a second request sent on a decision that did not count the first can make the first wait
  out the second's prefill (runs without it: docs/tuning/dispatch_queue.md).

Layout (all little-endian)::

    [0, NAMES_BYTES)                      MAX_WORKERS names of SLOT_NAME_BYTES, NUL-padded UTF-8
    [NAMES_BYTES, +8 x processes)         heartbeat per row (float64)
    then processes x MAX_WORKERS x 6      float64 fields, row-major

Pure mmap: no processes are started here (:mod:`router.processes.supervisor` makes the file).
"""
from __future__ import annotations

import fcntl
import math
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from router.shared.files import create_zeroed, map_whole

MAX_WORKERS = 4096
SLOT_NAME_BYTES = 128
FIELDS = 6  # in_flight, prefill_tokens, decoding, prefill_end_s, pending, newest_pending_s
NAMES_BYTES = MAX_WORKERS * SLOT_NAME_BYTES
STALE_S = 5.0  # a row not written for this long belongs to a dead process
_DOUBLE = struct.Struct("<d")
_ROW = struct.Struct(f"<{FIELDS}d")


def table_bytes(processes: int) -> int:
    """Size in bytes of the file for ``processes`` rows."""
    return NAMES_BYTES + 8 * processes + processes * MAX_WORKERS * FIELDS * 8


def create_table(path: Path, processes: int) -> Path:
    """Create (or truncate) the shared file at ``path`` for ``processes`` rows, zero-filled.
    Raises ValueError when ``processes`` < 1, OSError when the file cannot be made."""
    if processes < 1:
        raise ValueError("processes must be >= 1")
    return create_zeroed(path, table_bytes(processes))


@dataclass(frozen=True)
class OthersLoad:
    """The other processes' load on one worker: sums, the latest predicted prefill end
    (monotonic s; ``inf`` when one is unpredicted; 0.0 when none), requests pending (before
    their first byte, or held by a dispatch queue) and when the newest of them was sent or held
    (monotonic s; 0.0 when none)."""

    in_flight: int = 0
    prefill_tokens: int = 0
    decoding: int = 0
    prefill_end_s: float = 0.0
    pending: int = 0
    newest_pending_s: float = 0.0


class SharedLoadTable:
    """One process's view of the shared file: it writes row ``row`` and reads the others.
    Raises ValueError when ``row`` is outside ``[0, processes)`` or the file has another size."""

    def __init__(self, path: str | Path, processes: int, row: int) -> None:
        if not 0 <= row < processes:
            raise ValueError(f"row {row} outside 0..{processes - 1}")
        self.path = Path(path)
        self.processes = processes
        self.row = row
        self._fd, self._mm = map_whole(self.path, table_bytes(processes), f"{processes} rows")
        self._slots: dict[str, int] = {}
        self._fields_at = NAMES_BYTES + 8 * processes
        self.clear_row()

    def close(self) -> None:
        """Unmap the file (the supervisor removes it)."""
        self._mm.close()
        os.close(self._fd)

    def slot(self, worker_id: str) -> int:
        """The slot of ``worker_id``, taken from the name table on first use. Raises ValueError
        when the id is longer than SLOT_NAME_BYTES - 1 bytes or every slot is taken."""
        got = self._slots.get(worker_id)
        if got is not None:
            return got
        name = worker_id.encode("utf-8")
        if len(name) >= SLOT_NAME_BYTES:
            raise ValueError(f"worker id {worker_id!r} is longer than {SLOT_NAME_BYTES - 1} bytes")
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            free = None
            for i in range(MAX_WORKERS):
                at = i * SLOT_NAME_BYTES
                stored = self._mm[at:at + SLOT_NAME_BYTES].rstrip(b"\0")
                if stored == name:
                    free = i
                    break
                if not stored:
                    self._mm[at:at + len(name)] = name
                    free = i
                    break
            if free is None:
                raise ValueError(f"all {MAX_WORKERS} worker slots of {self.path} are taken")
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._slots[worker_id] = free
        return free

    def _at(self, row: int, slot: int) -> int:
        return self._fields_at + (row * MAX_WORKERS + slot) * FIELDS * 8

    def publish(self, slot: int, in_flight: int, prefill_tokens: int, decoding: int, prefill_end_s: float,
                pending: int = 0, newest_pending_s: float = 0.0) -> None:
        """Write this process's load on the worker in ``slot`` (and its heartbeat)."""
        _ROW.pack_into(self._mm, self._at(self.row, slot), in_flight, prefill_tokens, decoding, prefill_end_s,
                       pending, newest_pending_s)
        self.heartbeat()

    @contextmanager
    def claim(self) -> Iterator[None]:
        """Hold the file's exclusive ``flock`` (blocking; other processes hold it only to check
        and publish one worker's hold, microseconds): what a process reads of the others and
        publishes inside is one step to every other process that claims too."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def heartbeat(self, now: float | None = None) -> None:
        """Mark this process's row alive (the gateway calls it every second as well)."""
        _DOUBLE.pack_into(self._mm, NAMES_BYTES + 8 * self.row, time.monotonic() if now is None else now)

    def clear_row(self) -> None:
        """Zero this process's row (a restarted process starts with no requests)."""
        start = self._at(self.row, 0)
        self._mm[start:start + MAX_WORKERS * FIELDS * 8] = bytes(MAX_WORKERS * FIELDS * 8)
        self.heartbeat()

    def first_live_row(self, now: float | None = None) -> int:
        """The lowest row whose heartbeat is within :data:`STALE_S` (this process's own row is
        always live): the process that probes for all (:mod:`router.shared.probe_table`)."""
        now = time.monotonic() if now is None else now
        for row in range(self.row):
            (beat,) = _DOUBLE.unpack_from(self._mm, NAMES_BYTES + 8 * row)
            if now - beat <= STALE_S:
                return row
        return self.row

    def others(self, slot: int, now: float | None = None) -> OthersLoad:
        """The other live processes' load on the worker in ``slot``."""
        now = time.monotonic() if now is None else now
        in_flight = prefill = decoding = pending = 0.0
        end = newest = 0.0
        for row in range(self.processes):
            if row == self.row:
                continue
            (beat,) = _DOUBLE.unpack_from(self._mm, NAMES_BYTES + 8 * row)
            if now - beat > STALE_S:
                continue
            f, p, d, e, n, t = _ROW.unpack_from(self._mm, self._at(row, slot))
            in_flight += f
            prefill += p
            decoding += d
            end = max(end, e)
            pending += n
            newest = max(newest, t)
        return OthersLoad(int(in_flight), int(prefill), int(decoding), end, int(pending), newest)


def prefill_end_of(ends: list[float | None]) -> float:
    """The shared-table encoding of a process's prefill ends (monotonic s, None unpredicted):
    0.0 for none, ``inf`` when one is unpredicted, else the latest."""
    if not ends:
        return 0.0
    if any(e is None for e in ends):
        return math.inf
    return max(e for e in ends if e is not None)
