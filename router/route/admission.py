"""Admission control: a bounded number of requests in flight through the gateway, a bounded
FIFO queue in front of them, and a fast 429 beyond it.

Without it an overloaded cluster queues every request inside the engines, where a request that
will miss any TTFT target still takes its turn (and its KV blocks) before the ones behind it.
With it, requests past ``max_in_flight_per_worker x routable workers`` wait here, in arrival
order, and are routed only when a slot frees, so the routing decision sees the load as it is
when the request leaves; a request that would wait past ``queue_timeout_s``, or find
``max_queued`` ahead of it, gets 429 with ``Retry-After`` (OpenAI's status for "slow down", in
its error shape) at once instead of a late answer.

Pure asyncio, one event loop; no I/O. With ``kvroute serve --processes N`` the gateway's
processes count slots and queue together instead (:class:`router.route.shared_admission.GroupAdmission`,
same answers). Off when ``max_in_flight_per_worker`` is 0 (the default:
a drop-in gateway does not shed until told the cluster's capacity).
"""
from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable

from router.config.schema import AdmissionConfig
from router.errors import GatewayError
from router.telemetry.metrics import GatewayMetrics

_SERVICE_EWMA_ALPHA = 0.1  # weight of the newest admitted request's time in flight


def overloaded(message: str, retry_after_s: int) -> GatewayError:
    """429 in the OpenAI shape; ``retry_after_s`` goes into the ``Retry-After`` header."""
    return GatewayError(429, message, "rate_limit_error", "gateway_overloaded",
                        headers=[(b"retry-after", str(retry_after_s).encode())])


class Admission:
    """Slots for requests in flight. ``limit()`` gives the current number of slots (it follows the
    routable workers); :meth:`acquire` takes one (waiting in FIFO order), :meth:`release` gives
    it back, to the longest waiter first."""

    def __init__(self, cfg: AdmissionConfig, routable_workers: Callable[[], int], metrics: GatewayMetrics,
                 clock: Callable[[], float] | None = None) -> None:
        self.cfg = cfg
        self._routable_workers = routable_workers
        self._metrics = metrics
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._service_s = 1.0  # EWMA of an admitted request's time in flight, seconds

    @property
    def enabled(self) -> bool:
        return self.cfg.max_in_flight_per_worker > 0

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._waiters)

    def limit(self) -> int:
        """Slots now: ``max_in_flight_per_worker`` per routable worker (at least one, so a
        request still reaches the router and gets its own 503 when no worker is up)."""
        return max(1, self.cfg.max_in_flight_per_worker * self._routable_workers())

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free for a newcomer: the queue ahead, served by every
        slot at the recent time in flight; at least 1 (``Retry-After`` takes whole seconds)."""
        return max(1, math.ceil(self._service_s * (self.queued + 1) / self.limit()))

    async def acquire(self) -> float:
        """Take a slot; returns when it is taken, with the clock's time then (s; give it to
        :meth:`release`). Raises GatewayError 429 when ``max_queued`` requests wait already or
        no slot frees within ``queue_timeout_s``. Cancelling the wait (the client left) gives up
        its place, or the slot if one had just been handed to it."""
        start = self._clock()
        if not self.enabled:
            return start
        self._fill()  # workers may have come back since the last release
        if self.in_flight < self.limit() and not self._waiters:
            self.in_flight += 1
            return start
        if len(self._waiters) >= self.cfg.max_queued:
            self._metrics.admission_rejected.labels("queue_full").inc()
            raise overloaded(f"The gateway is at capacity ({self.in_flight} requests in flight, "
                             f"{len(self._waiters)} queued); retry later.", self.retry_after_s())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)  # only waiting futures are in the queue
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.cfg.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done():
                self._free_one()  # a slot came as the wait ended: pass it on
            else:
                self._waiters.remove(waiter)
                waiter.cancel()
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._metrics.admission_rejected.labels("queue_timeout").inc()
            raise overloaded(f"The gateway is at capacity: no slot freed within {self.cfg.queue_timeout_s} s; "
                             "retry later.", self.retry_after_s()) from None
        finally:
            self._metrics.admission_wait_s.observe(self._clock() - start)
        return self._clock()

    def release(self, admitted_at: float) -> None:
        """Give back a slot taken by :meth:`acquire` (``admitted_at``: what it returned)."""
        if not self.enabled:
            return
        held_s = self._clock() - admitted_at
        self._service_s += _SERVICE_EWMA_ALPHA * (held_s - self._service_s)
        self._free_one()

    def close(self) -> None:
        """Nothing to stop alone (:class:`router.route.shared_admission.GroupAdmission` stops its poller)."""

    def _free_one(self) -> None:
        self.in_flight -= 1
        self._fill()

    def _fill(self) -> None:
        """Hand free slots to the longest waiters (the slot count follows the routable workers)."""
        while self._waiters and self.in_flight < self.limit():
            self.in_flight += 1
            self._waiters.popleft().set_result(None)
