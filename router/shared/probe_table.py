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
  waiting, KV usage, when), each with a *changes* counter. The prober writes every result (its
  time keeps the record fresh) but moves ``changes`` only when a follower would change state by
  applying it: a health result unlike the one before, or one of the first ``repeats_shown`` of a
  run of equal ones (so a follower's hysteresis counts a run as far as any threshold reaches); a
  scrape with other figures than the last, or one taken while the gateway had requests on the
  worker or had had some at the last such write (what part of the worker's queue is the gateway's
  own then depends on the moment a process applies it). A process
  applies a result once, when ``changes`` moved; an idle cluster's records then move nothing, and
  a follower reads them all in one vectorised pass over the file (:meth:`SharedProbeTable.columns`)
  instead of one call per worker.
- A process that finds a record older than :func:`stale_after_s` (a new worker the prober has
  not reached yet, a prober stuck or gone) makes the call itself, so a worker is never left
  unprobed; it writes nothing then (the prober owns the file's records).
- Writes take the file's ``flock`` and bump the record's sequence number to odd before and to
  even after the fields (a seqlock); a reader takes no lock and retries while the number is odd
  or moved under it.

Layout: ``MAX_WORKERS`` records of :data:`RECORD_BYTES`, slot-major (pure mmap; the supervisor
makes the file with :func:`create_table`); the two ``changes`` counters are the record's last 16
bytes.
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
from typing import NamedTuple

import numpy as np

from router.shared.files import create_zeroed, map_whole
from router.shared.load_table import MAX_WORKERS

_PROBE = struct.Struct("<Qdd")            # seq, ok (1.0/0.0), at (monotonic s)
_SCRAPE = struct.Struct("<Qdddddd")       # seq, ok, running, waiting, kv_usage (NaN: absent), at, spare
ERROR_BYTES = 160
_SCRAPE_AT = _PROBE.size
_SEQ = struct.Struct("<Q")
_ERROR_AT = _SCRAPE_AT + _SCRAPE.size
# byte offsets of the fields the vectorised reads take (SharedProbeTable.columns), from the layouts above
_PROBE_WHEN = 16
_SCRAPE_OK = _SCRAPE_AT + 8
_SCRAPE_WHEN = _SCRAPE_AT + 40
_PROBE_CHANGES = 240
_SCRAPE_CHANGES = 248
RECORD_BYTES = 256
assert _ERROR_AT + ERROR_BYTES <= _PROBE_CHANGES and _SCRAPE_CHANGES + 8 == RECORD_BYTES
assert _PROBE.size == _PROBE_WHEN + 8 and _SCRAPE.size == _SCRAPE_WHEN - _SCRAPE_AT + 16
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
    """One health probe: ``seq`` (moves with each write), ``ok``, ``at`` (monotonic s), ``error``,
    ``changes`` (moves when applying it changes a follower's state; module docstring)."""

    seq: int
    ok: bool
    at: float
    error: str | None
    changes: int = 0


@dataclass(frozen=True)
class ScrapeResult:
    """One load scrape: ``seq``, ``ok`` (False: the scrape failed), the engine figures (None:
    absent from the page), ``at`` (monotonic s), ``changes`` (as :class:`ProbeResult`'s)."""

    seq: int
    ok: bool
    running: int | None
    waiting: int | None
    kv_usage: float | None
    at: float
    changes: int = 0


class Columns(NamedTuple):
    """Arrays of ``MAX_WORKERS`` (one element per slot, 0 where unwritten): the probe record's
    ``changes`` (uint64) and ``at`` (float64, monotonic s); the scrape record's ``changes``,
    ``at`` and ``ok`` (1.0 / 0.0)."""

    probe_changes: np.ndarray
    probe_at: np.ndarray
    scrape_changes: np.ndarray
    scrape_at: np.ndarray
    scrape_ok: np.ndarray


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
        self._views: Columns | None = Columns(*(
            np.ndarray((MAX_WORKERS,), dtype=dtype, buffer=self._mm, offset=offset, strides=(RECORD_BYTES,))
            for dtype, offset in (("<u8", _PROBE_CHANGES), ("<f8", _PROBE_WHEN), ("<u8", _SCRAPE_CHANGES),
                                  ("<f8", _SCRAPE_WHEN), ("<f8", _SCRAPE_OK))))
        # the prober's memory of what it wrote last per slot: (result, how many in a row)
        self._last_probe: dict[int, tuple[tuple[bool, str | None], int]] = {}
        self._last_scrape: dict[int, tuple[tuple[bool, int | None, int | None, float | None], int]] = {}

    def close(self) -> None:
        self._views = None  # the views hold the mapping's buffer
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

    def _bump(self, at: int) -> None:
        (n,) = _SEQ.unpack_from(self._mm, at)
        _SEQ.pack_into(self._mm, at, n + 1)

    def write_probe(self, slot: int, ok: bool, error: str | None, now: float | None = None,
                    repeats_shown: int = 1) -> bool:
        """Publish one health probe's result for the worker in ``slot``; ``changes`` moves unless
        it is past the first ``repeats_shown`` of a run of equal results (module docstring).
        Returns whether it moved."""
        at = slot * RECORD_BYTES
        text = (error or "").encode("utf-8", "replace")[:ERROR_BYTES - 1]
        result = (ok, text.decode("utf-8", "replace") or None)
        last = self._last_probe.get(slot)
        run = last[1] + 1 if last is not None and last[0] == result else 1
        self._last_probe[slot] = (result, run)
        moved = run <= max(1, repeats_shown)
        with self._writing(at) as seq:
            _PROBE.pack_into(self._mm, at, seq, 1.0 if ok else 0.0, time.monotonic() if now is None else now)
            self._mm[at + _ERROR_AT:at + _ERROR_AT + ERROR_BYTES] = text.ljust(ERROR_BYTES, b"\0")
            if moved:
                self._bump(at + _PROBE_CHANGES)
        return moved

    def write_scrape(self, slot: int, ok: bool, running: int | None = None, waiting: int | None = None,
                     kv_usage: float | None = None, now: float | None = None, in_flight: int = 0) -> bool:
        """Publish one load scrape's result for the worker in ``slot`` (``ok`` False: it failed);
        ``in_flight``: the gateway's requests on the worker now, through every process. ``changes``
        moves when the figures differ from the last written, or ``in_flight`` is above zero now or
        was at the last write (module docstring). Returns whether it moved."""
        at = slot * RECORD_BYTES + _SCRAPE_AT
        result = (ok, running, waiting, kv_usage)
        last = self._last_scrape.get(slot)
        moved = last is None or last[0] != result or in_flight > 0 or last[1] > 0
        self._last_scrape[slot] = (result, in_flight)
        with self._writing(at) as seq:
            _SCRAPE.pack_into(self._mm, at, seq, 1.0 if ok else 0.0, _opt(running), _opt(waiting), _opt(kv_usage),
                              time.monotonic() if now is None else now, 0.0)
            if moved:
                self._bump(slot * RECORD_BYTES + _SCRAPE_CHANGES)
        return moved

    # ---- reads (every process) -----------------------------------------------------------------
    def columns(self) -> Columns:
        """Every slot's record fields as :class:`Columns`: views of the file, read without the
        seqlock, so a value may be from a write in progress. Use them to pick the slots to read
        whole (:meth:`read_probe`, :meth:`read_scrape`) or for a figure where a torn value does
        no harm (a time, an ok flag). Raises ValueError after :meth:`close`."""
        if self._views is None:
            raise ValueError("the probe table is closed")
        return self._views

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
            (changes,) = _SEQ.unpack_from(self._mm, at + _PROBE_CHANGES)
            if struct.unpack_from("<Q", self._mm, at)[0] != seq:
                continue
            text = raw.rstrip(b"\0").decode("utf-8", "replace")
            return ProbeResult(seq, ok == 1.0, when, text or None, changes)
        return None

    def read_scrape(self, slot: int) -> ScrapeResult | None:
        """The last load scrape published for ``slot``; None as :meth:`read_probe`."""
        at = slot * RECORD_BYTES + _SCRAPE_AT
        for _ in range(_READ_TRIES):
            seq, ok, running, waiting, usage, when, _ = _SCRAPE.unpack_from(self._mm, at)
            if seq == 0:
                return None
            (changes,) = _SEQ.unpack_from(self._mm, slot * RECORD_BYTES + _SCRAPE_CHANGES)
            if seq % 2 or struct.unpack_from("<Q", self._mm, at)[0] != seq:
                continue
            r, w = _back(running), _back(waiting)
            return ScrapeResult(seq, ok == 1.0, None if r is None else int(r), None if w is None else int(w),
                                _back(usage), when, changes)
        return None
