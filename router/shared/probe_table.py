"""Workers' health probes and load scrapes made once per host for every gateway process.

Alone, a gateway process probes each worker's health and scrapes its ``/metrics`` every interval.
With ``kvroute serve --processes N`` every process did the same, so the workers answered N times
the calls and the host spent N times the CPU (a vLLM ``/metrics`` page is ~48 kB of text to
render, send and parse). Here one process, the *prober*, makes the calls and writes each result
into a memory-mapped file; the others read it and apply it as if they had made the call
themselves (:meth:`~router.workers.registry.WorkerRegistration.record_probe` and ``record_scrape``, so
each keeps its own hysteresis, callbacks and ``/admin/workers`` view).

- The prober is the live process of lowest index in the shared load table
  (:meth:`router.shared.load_table.SharedLoadTable.first_live_row`): process 0 while it beats, the next
  one within :data:`router.shared.load_table.STALE_S` after it stops.
- A record is one worker's (its slot in the load table's name table): the health probe's result
  (a sequence number, ok, when, the error text) and the scrape's (a sequence number, ok, running,
  waiting, KV usage, when). A process applies a result once, when its sequence number moved.
- A process that finds a record older than :func:`stale_after_s` (a new worker the prober has
  not reached yet, a prober stuck or gone) makes the call itself, so a worker is never left
  unprobed; it writes nothing then (the prober owns the file's records).
- Writes take the file's ``flock`` and bump the record's sequence number to odd before and to
  even after the fields (a seqlock); a reader takes no lock and retries while the number is odd
  or moved under it.

Layout: ``MAX_WORKERS`` records of :data:`RECORD_BYTES`, slot-major (pure mmap; the supervisor
makes the file with :func:`create_table`).
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
from router.shared.load_table import MAX_WORKERS

_PROBE = struct.Struct("<Qdd")            # seq, ok (1.0/0.0), at (monotonic s)
_SCRAPE = struct.Struct("<Qdddddd")       # seq, ok, running, waiting, kv_usage (NaN: absent), at, spare
ERROR_BYTES = 160
_SCRAPE_AT = _PROBE.size
_SEQ = struct.Struct("<Q")
_ERROR_AT = _SCRAPE_AT + _SCRAPE.size
RECORD_BYTES = 256
assert _ERROR_AT + ERROR_BYTES <= RECORD_BYTES
_READ_TRIES = 8


def table_bytes() -> int:
    """Size in bytes of the file."""
    return MAX_WORKERS * RECORD_BYTES


def create_table(path: Path) -> Path:
    """Create (or truncate) the file at ``path``, zero-filled (every record unwritten). Raises
    OSError when it cannot be made."""
    return create_zeroed(path, table_bytes())


def stale_after_s(interval_s: float, timeout_s: float) -> float:
    """How old a record may be before a reader makes the call itself: three intervals, and at
    least one interval plus the call's timeout (a prober waiting out a slow worker is not gone)."""
    return max(3 * interval_s, interval_s + timeout_s + 1.0)


@dataclass(frozen=True)
class ProbeResult:
    """One health probe: ``seq`` (moves with each write), ``ok``, ``at`` (monotonic s), ``error``."""

    seq: int
    ok: bool
    at: float
    error: str | None


@dataclass(frozen=True)
class ScrapeResult:
    """One load scrape: ``seq``, ``ok`` (False: the scrape failed), the engine figures (None:
    absent from the page), ``at`` (monotonic s)."""

    seq: int
    ok: bool
    running: int | None
    waiting: int | None
    kv_usage: float | None
    at: float


def _opt(x: float | None) -> float:
    return math.nan if x is None else float(x)


def _back(x: float) -> float | None:
    return None if math.isnan(x) else x


class SharedProbeTable:
    """One process's view of the file (module docstring). Raises ValueError when the file has
    another size."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd, self._mm = map_whole(self.path, table_bytes(), f"{MAX_WORKERS} workers' records")

    def close(self) -> None:
        self._mm.close()
        os.close(self._fd)

    # ---- writes (the prober) -------------------------------------------------------------------
    @contextmanager
    def _writing(self, at: int) -> Iterator[int]:
        """Hold the file's ``flock`` and the seqlock of the part at byte ``at`` (its sequence number
        first): yields the odd number the fields are written under, made even afterwards."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            (seq,) = struct.unpack_from("<Q", self._mm, at)
            seq += 1 if seq % 2 == 0 else 2  # odd while writing (a writer that died mid-way left it odd)
            struct.pack_into("<Q", self._mm, at, seq)
            yield seq
            struct.pack_into("<Q", self._mm, at, seq + 1)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def write_probe(self, slot: int, ok: bool, error: str | None, now: float | None = None) -> None:
        """Publish one health probe's result for the worker in ``slot``."""
        at = slot * RECORD_BYTES
        text = (error or "").encode("utf-8", "replace")[:ERROR_BYTES - 1]
        with self._writing(at) as seq:
            _PROBE.pack_into(self._mm, at, seq, 1.0 if ok else 0.0, time.monotonic() if now is None else now)
            self._mm[at + _ERROR_AT:at + _ERROR_AT + ERROR_BYTES] = text.ljust(ERROR_BYTES, b"\0")

    def write_scrape(self, slot: int, ok: bool, running: int | None = None, waiting: int | None = None,
                     kv_usage: float | None = None, now: float | None = None) -> None:
        """Publish one load scrape's result for the worker in ``slot`` (``ok`` False: it failed)."""
        at = slot * RECORD_BYTES + _SCRAPE_AT
        with self._writing(at) as seq:
            _SCRAPE.pack_into(self._mm, at, seq, 1.0 if ok else 0.0, _opt(running), _opt(waiting), _opt(kv_usage),
                              time.monotonic() if now is None else now, 0.0)

    # ---- reads (every process) -----------------------------------------------------------------
    def seqs(self, slot: int) -> tuple[int, int]:
        """The sequence numbers of ``slot``'s probe and scrape records (0: none yet; odd: a write
        in progress), read alone: a reader compares them with those it applied before reading a
        record whole."""
        at = slot * RECORD_BYTES
        return _SEQ.unpack_from(self._mm, at)[0], _SEQ.unpack_from(self._mm, at + _SCRAPE_AT)[0]

    def read_probe(self, slot: int) -> ProbeResult | None:
        """The last health probe published for ``slot``; None when none was, or no stable read
        came in a few tries (a write in progress)."""
        at = slot * RECORD_BYTES
        for _ in range(_READ_TRIES):
            seq, ok, when = _PROBE.unpack_from(self._mm, at)
            if seq == 0:
                return None
            if seq % 2:
                continue
            raw = bytes(self._mm[at + _ERROR_AT:at + _ERROR_AT + ERROR_BYTES])
            if struct.unpack_from("<Q", self._mm, at)[0] != seq:
                continue
            text = raw.rstrip(b"\0").decode("utf-8", "replace")
            return ProbeResult(seq, ok == 1.0, when, text or None)
        return None

    def read_scrape(self, slot: int) -> ScrapeResult | None:
        """The last load scrape published for ``slot``; None as :meth:`read_probe`."""
        at = slot * RECORD_BYTES + _SCRAPE_AT
        for _ in range(_READ_TRIES):
            seq, ok, running, waiting, usage, when, _ = _SCRAPE.unpack_from(self._mm, at)
            if seq == 0:
                return None
            if seq % 2 or struct.unpack_from("<Q", self._mm, at)[0] != seq:
                continue
            r, w = _back(running), _back(waiting)
            return ScrapeResult(seq, ok == 1.0, None if r is None else int(r), None if w is None else int(w),
                                _back(usage), when)
        return None
