"""Admission control for the gateway as a whole with ``kvroute serve --processes N``.

Alone, a gateway counts its admission slots and its queue in memory (:class:`router.route.admission.
Admission`). With N processes on one port each counted its own, so ``max_in_flight_per_worker:
1`` let N requests reach a one-worker cluster at once and ``max_queued: Q`` queued N x Q. Here
every process keeps its counts in a small memory-mapped file in the supervisor's run folder (made
by :func:`create_table`, beside the load table of :mod:`router.shared.load_table`), and every decision
that takes a slot or a place in the queue is made under the file's exclusive ``flock``, so the
counts it reads and the count it writes are one step to every other process (no check-then-act
race: two processes can never both take the last slot):

- one *row* per process: the slots it holds (requests admitted and unfinished), the requests
  waiting in its queue, and the ticket of its oldest waiter (0 when none). Only the row's process
  writes it, always under the lock;
- a request is admitted at once when the slots held by all processes are below the limit
  (``max_in_flight_per_worker`` x routable workers) and no request waits anywhere; else it
  waits when fewer than ``max_queued`` wait in all processes together (with a ticket from the
  file's counter: arrival order across processes), else 429 at once, as alone;
- a freed slot goes to this process's longest waiter when that waiter is older than every other
  process's oldest one (more exactly: while more slots are free than there are other processes
  whose oldest waiter is older), so a queue in one process is not overtaken by a newer one in
  another. Another process's waiters learn of a slot freed here within :data:`POLL_S` (each
  process looks again, under the lock, that often while it has waiters): the only cost of being
  N processes is that hand-over delay;
- a process that dies (even by ``SIGKILL``) leaves its row behind, so each process holds an
  exclusive ``flock`` on its own *life file* (``<file>.p<row>.alive``) for its whole life, which
  the kernel drops when the process dies. When another process's counts stand between a request
  and a slot (or a place in the queue), the deciding process tries that process's life lock: it
  gets it only if the process is gone, and then zeroes the row (under the file lock), so a dead
  process's slots and queue places are released at the next decision that needs them, at once,
  without waiting for a heartbeat; a restarted process also starts from an empty row. A live
  process that is merely slow (its event loop busy) keeps its slots: its requests may still be in
  flight.

Layout (little-endian)::

    [0, 8)                              next ticket (uint64)
    [HEADER_BYTES, + ROW_BYTES x N)     per process: slots, waiting, oldest ticket (int64 each)

Metrics: each process exports its own ``kvroute_admission_in_flight`` and ``_queued`` (what its
row holds) and its own ``kvroute_admission_rejected_total``; ``GET /metrics`` merges them with
a ``process`` label, and their sum over ``process`` is the gateway's total (every slot and every
waiter is held by exactly one process, and a dead process's row is dropped as its series leave
the merged exposition).
"""
from __future__ import annotations

import asyncio
import fcntl
import math
import os
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from router.config.schema import AdmissionConfig
from router.route.admission import _SERVICE_EWMA_ALPHA, Admission, overloaded
from router.shared.files import create_zeroed, map_whole
from router.telemetry.metrics import GatewayMetrics

HEADER_BYTES = 64
ROW_BYTES = 32
_TICKET = struct.Struct("<Q")
_ROW = struct.Struct("<qqq")  # slots held, waiting, oldest waiter's ticket (0: none)
POLL_S = 0.005  # while a process has waiters: how often it looks for slots freed elsewhere
LIFE_WAIT_S = 10.0  # how long a (re)starting process waits for its own life lock


def table_bytes(processes: int) -> int:
    """Size in bytes of the file for ``processes`` rows."""
    return HEADER_BYTES + ROW_BYTES * processes


def create_table(path: Path, processes: int) -> Path:
    """Create (or truncate) the file at ``path`` for ``processes`` rows, zero-filled. Raises
    ValueError when ``processes`` < 1, OSError when the file cannot be made."""
    if processes < 1:
        raise ValueError("processes must be >= 1")
    return create_zeroed(path, table_bytes(processes))


def life_path(path: Path, row: int) -> Path:
    """The life file of process ``row`` (its holder's exclusive ``flock`` says it is alive)."""
    return path.with_name(f"{path.name}.p{row}.alive")


@dataclass(frozen=True)
class OthersAdmission:
    """The other processes' rows summed: slots held, requests waiting, and each one's oldest
    waiter's ticket (only those with waiters)."""

    in_flight: int = 0
    queued: int = 0
    oldest: tuple[int, ...] = ()

    @property
    def any(self) -> bool:
        return self.in_flight > 0 or self.queued > 0


class AdmissionTable:
    """One process's view of the shared admission file: it writes row ``row`` (always under
    :meth:`locked`) and reads the others. Takes this row's life lock (waiting up to
    :data:`LIFE_WAIT_S` for a process checking it to let go) and clears the row. Raises
    ValueError when ``row`` is outside ``[0, processes)`` or the file has another size,
    TimeoutError when the life lock stays held (another live process has this row)."""

    def __init__(self, path: str | Path, processes: int, row: int) -> None:
        if not 0 <= row < processes:
            raise ValueError(f"row {row} outside 0..{processes - 1}")
        self.path = Path(path)
        self.processes = processes
        self.row = row
        self._fd, self._mm = map_whole(self.path, table_bytes(processes), f"{processes} rows")
        self._life_fds: dict[int, int] = {}  # other rows' life files, opened on first check
        self._own_life = os.open(life_path(self.path, row), os.O_RDWR | os.O_CREAT, 0o600)
        end = time.monotonic() + LIFE_WAIT_S
        while True:
            try:
                fcntl.flock(self._own_life, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    self.close()
                    raise TimeoutError(f"{life_path(self.path, row)} stays locked: another live process has row {row}")
                time.sleep(0.001)  # a process checking whether this row's last holder died
        with self.locked():
            self.write(0, 0, 0)

    def close(self) -> None:
        """Unmap the file and let go of the life lock (the supervisor removes the files)."""
        for fd in self._life_fds.values():
            os.close(fd)
        self._life_fds.clear()
        if self._own_life >= 0:
            os.close(self._own_life)
            self._own_life = -1
        if not self._mm.closed:
            self._mm.close()
            os.close(self._fd)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the file's exclusive ``flock`` (blocking; held by any process only while it reads
        the rows and writes its own, microseconds)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _at(self, row: int) -> int:
        return HEADER_BYTES + row * ROW_BYTES

    def write(self, in_flight: int, queued: int, oldest: int) -> None:
        """This process's slots, waiters and oldest waiter's ticket (call under :meth:`locked`)."""
        _ROW.pack_into(self._mm, self._at(self.row), in_flight, queued, oldest)

    def read(self, row: int) -> tuple[int, int, int]:
        """Row ``row`` as ``(slots, waiting, oldest ticket)``."""
        return _ROW.unpack_from(self._mm, self._at(row))

    def take_ticket(self) -> int:
        """The next waiter's ticket, 1 and up (call under :meth:`locked`)."""
        (last,) = _TICKET.unpack_from(self._mm, 0)
        _TICKET.pack_into(self._mm, 0, last + 1)
        return last + 1

    def others(self) -> OthersAdmission:
        """The other rows summed (call under :meth:`locked` for a consistent view)."""
        in_flight = queued = 0
        oldest: list[int] = []
        for row in range(self.processes):
            if row == self.row:
                continue
            f, q, t = _ROW.unpack_from(self._mm, self._at(row))
            in_flight += f
            queued += q
            if q > 0 and t > 0:
                oldest.append(t)
        return OthersAdmission(in_flight, queued, tuple(oldest))

    def alive(self, row: int) -> bool:
        """Whether the process of ``row`` is alive: it holds its life lock (tried without
        waiting; when we get it the process is gone, and we let go of it at once)."""
        fd = self._life_fds.get(row)
        if fd is None:
            fd = self._life_fds[row] = os.open(life_path(self.path, row), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def drop_dead(self) -> list[int]:
        """Zero the rows of processes that are gone (call under :meth:`locked`); returns them."""
        dropped = []
        for row in range(self.processes):
            if row == self.row:
                continue
            if any(_ROW.unpack_from(self._mm, self._at(row))) and not self.alive(row):
                _ROW.pack_into(self._mm, self._at(row), 0, 0, 0)
                dropped.append(row)
        return dropped


class GroupAdmission(Admission):
    """:class:`~router.route.admission.Admission` for one of N gateway processes: the same slots,
    queue and answers, counted for the gateway as a whole through ``table`` (module docstring).
    ``in_flight`` and ``queued`` stay this process's own (its row)."""

    def __init__(self, cfg: AdmissionConfig, routable_workers: Callable[[], int], metrics: GatewayMetrics,
                 table: AdmissionTable, clock: Callable[[], float] | None = None) -> None:
        super().__init__(cfg, routable_workers, metrics, clock)
        self.table = table
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()  # type: ignore[assignment]  # (ticket, future)
        self._poller: asyncio.Task | None = None
        self._seen = (0, 0)  # gateway-wide (slots held, waiting) at the last refusal

    def retry_after_s(self) -> int:
        """As alone, by the gateway-wide queue ahead."""
        return max(1, math.ceil(self._service_s * (self._seen[1] + 1) / self.limit()))

    async def acquire(self) -> float:
        """As :meth:`Admission.acquire`, with every process's slots and waiters counted."""
        start = self._clock()
        if not self.enabled:
            return start
        with self.table.locked():
            self._fill()  # slots freed elsewhere, or workers back, since this process last looked
            got = self._admit()
        if got is None:
            return start
        if got is False:
            self._metrics.admission_rejected.labels("queue_full").inc()
            raise overloaded(f"The gateway is at capacity ({self._seen[0]} requests in flight, "
                             f"{self._seen[1]} queued); retry later.", self.retry_after_s())
        waiter = got
        self._ensure_poller()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.cfg.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with self.table.locked():
                if waiter.done():
                    self.in_flight -= 1  # a slot came as the wait ended: pass it on
                else:
                    self._remove(waiter)
                    waiter.cancel()
                self._publish()
                self._fill()
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._metrics.admission_rejected.labels("queue_timeout").inc()
            self._seen = (self._seen[0], self.queued)
            raise overloaded(f"The gateway is at capacity: no slot freed within {self.cfg.queue_timeout_s} s; "
                             "retry later.", self.retry_after_s()) from None
        finally:
            self._metrics.admission_wait_s.observe(self._clock() - start)
        return self._clock()

    def release(self, admitted_at: float) -> None:
        """Give back a slot taken by :meth:`acquire`; the longest waiter of the gateway gets it
        (here at once, in another process within :data:`POLL_S`)."""
        if not self.enabled:
            return
        held_s = self._clock() - admitted_at
        self._service_s += _SERVICE_EWMA_ALPHA * (held_s - self._service_s)
        with self.table.locked():
            self.in_flight -= 1
            self._publish()
            self._fill()

    def close(self) -> None:
        """Stop looking for slots (gateway shutdown)."""
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    # ---- under the table's lock ------------------------------------------------------------------
    def _publish(self) -> None:
        self.table.write(self.in_flight, len(self._waiters), self._waiters[0][0] if self._waiters else 0)

    def _admit(self) -> asyncio.Future | bool | None:
        """Decide a newcomer: None admitted (a slot taken), a future to wait on (queued), False
        refused (the gateway's queue is full). Other processes' counts that stand in the way are
        checked for dead processes first."""
        limit = self.limit()
        checked = False
        while True:
            others = self.table.others()
            in_flight, queued = self.in_flight + others.in_flight, len(self._waiters) + others.queued
            if queued == 0 and in_flight < limit:
                self.in_flight += 1
                self._publish()
                return None
            if queued < self.cfg.max_queued and (queued > 0 or not others.any):
                break  # it waits either way (behind live waiters, or for its own process's slots)
            if checked or not others.any or not self.table.drop_dead():
                if queued >= self.cfg.max_queued:
                    self._seen = (in_flight, queued)
                    return False
                break
            checked = True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((self.table.take_ticket(), waiter))
        self._publish()
        return waiter

    def _fill(self) -> None:
        """Hand free gateway slots to this process's waiters, oldest first, leaving one for each
        other process whose oldest waiter is older; dead processes' rows are dropped when they
        stand in the way."""
        if not self._waiters:
            return
        limit = self.limit()
        checked = False
        changed = False
        while True:
            others = self.table.others()
            free = limit - self.in_flight - others.in_flight
            while self._waiters and free > 0:
                ticket, waiter = self._waiters[0]
                if free <= sum(1 for t in others.oldest if t < ticket):
                    break
                self._waiters.popleft()
                self.in_flight += 1
                free -= 1
                changed = True
                waiter.set_result(None)
            if not self._waiters or checked or not others.any or not self.table.drop_dead():
                break
            checked = True
        if changed:
            self._publish()

    def _remove(self, waiter: asyncio.Future) -> None:
        for i, (_, w) in enumerate(self._waiters):
            if w is waiter:
                del self._waiters[i]
                return

    # ---- slots freed in other processes ---------------------------------------------------------
    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="admission-poller")

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(POLL_S)
            with self.table.locked():
                self._fill()
