"""The gateway's workers: health with hysteresis, draining, in-flight counts, scraped engine load.

Each :meth:`WorkerRegistry.add` makes a new :class:`WorkerRegistration`; a request holds the
registration it was counted on (through an :class:`InFlight` handle), so removing a worker and
adding it again under the same id starts from zero and a late finish of an old request never
touches the new counts. Counts never go negative: a handle releases at most once.

Per-worker background tasks (health probe, load scrape, and later the KV-event subscriber of the
embedded mode) come from *task factories*: ``factory(registration) -> coroutine``, started when a
worker is added and cancelled when it is removed.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from router.config.schema import WORKER_ROLES, WorkerConfig, WorkerRole
from router.estimates.evidence import EvidenceTrust
from router.estimates.prefill_rate import MODEL_LINE_TOLERANCE, PrefillRateEstimator
from router.policies.base import WorkerLoad
from router.shared.load_table import OthersLoad, SharedLoadTable, prefill_end_of
from router.workers.event_watch import EVENTS_GRACE_S, EventStreamWatch
from router.workers.health import ProbeHealth

if TYPE_CHECKING:
    from kvcore.kv_events.ingest import EventIngestor

log = logging.getLogger("kvroute.registry")
_NO_OTHERS = OthersLoad()

TaskFactory = Callable[["WorkerRegistration"], Coroutine[Any, Any, None]]


class WorkerRegistration:
    """One registration of a worker (a new object each time the worker is added).

    Health: ``health`` (:class:`~router.workers.health.ProbeHealth`), fed by :meth:`record_probe`;
    ``healthy`` is None until the first probe result. ``events``: whether its KV events flow
    (:class:`~router.workers.event_watch.EventStreamWatch`, judged by :meth:`check_events`).
    Load: ``in_flight`` requests sent and unfinished; ``prefill_tokens`` predicted uncached prompt
    tokens of in-flight requests still before their first byte; ``decoding`` in-flight requests
    past it; ``engine_*`` from the worker's ``/metrics``, ``unseen_*`` the part of the scraped
    running / waiting requests that were not the gateway's own at that moment. ``ingest``: the
    worker's KV-event ingestor when one runs in this process. ``prefill_rate`` learns the worker's
    TTFT line from its streamed requests; ``evidence`` judges its index entries by the cached
    tokens it reports.
    """

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg.model_copy()  # its own copy: set_role changes it at run time
        self.id: str = cfg.id or cfg.url
        self.url = cfg.url
        self.model = cfg.model
        self.health = ProbeHealth(self.id)
        self.draining = False
        self.removed = False
        self.in_flight = 0
        self.prefill_tokens = 0
        self.decoding = 0
        self.engine_running: int | None = None
        self.engine_waiting: int | None = None
        self.kv_usage: float | None = None
        self.unseen_running = 0
        self.unseen_waiting = 0
        self.prefill_rate = PrefillRateEstimator()
        self.evidence = EvidenceTrust()
        self.last_scrape_monotonic: float | None = None
        self.scrape_filtered: bool | None = None  # the filtered /metrics page works here (calls.scrape_once)
        self.ingest: EventIngestor | None = None  # the KV-event ingestor in embedded mode
        self.tasks: list[asyncio.Task] = []
        self.added_monotonic = time.monotonic()
        self.events = EventStreamWatch(self.id, cfg.events)
        # requests before their first byte, each with its predicted prefill end (monotonic s,
        # None when unpredicted), and places the dispatch queue holds for requests on their way
        self.prefilling: dict[InFlight, float | None] = {}
        self.reserved: dict[object, tuple[float | None, float]] = {}  # key -> (predicted end, taken at)
        self.on_prefill_done: Callable[[], None] | None = None  # set by the dispatch queue
        # the other gateway processes' load on this worker (kvroute serve --processes N)
        self.shared: tuple[SharedLoadTable, int] | None = None

    @property
    def role(self) -> WorkerRole:
        """``both``, ``prefill`` or ``decode`` (:class:`~router.config.schema.WorkerConfig`), as
        ``cfg.role``: :meth:`set_role` changes both."""
        return self.cfg.role

    def set_role(self, role: WorkerRole) -> None:
        """Change the worker's role at run time (``PUT /admin/workers/{id}/role``); requests in
        flight keep the leg they were sent for. Raises ValueError for a role not in ``WORKER_ROLES``."""
        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {', '.join(WORKER_ROLES)}, got {role!r}")
        if role != self.cfg.role:
            log.info("worker %s: role %s -> %s", self.id, self.cfg.role, role)
        self.cfg.role = role

    @property
    def has_events(self) -> bool:
        """True when the worker publishes KV events (else the index is approximate for it)."""
        return self.cfg.events is not None

    @property
    def routable(self) -> bool:
        """Healthy, not draining, still registered."""
        return self.healthy is True and not self.draining and not self.removed

    @property
    def healthy(self) -> bool | None:
        return self.health.healthy

    @healthy.setter
    def healthy(self, value: bool | None) -> None:
        self.health.healthy = value

    def record_probe(self, ok: bool, fail_threshold: int, rise_threshold: int, error: str | None = None) -> bool:
        """Apply one probe result (:meth:`router.workers.health.ProbeHealth.record`); returns True
        when ``healthy`` changed."""
        return self.health.record(ok, fail_threshold, rise_threshold, error)

    @property
    def evidence_credited(self) -> bool:
        """Whether the policies may credit this worker's index entries: its reported cached
        tokens agree with them (``evidence``) and its KV events flow (``events.live`` not False)."""
        return self.evidence.trusted and self.events.live is not False

    def check_events(self, now: float, grace_s: float = EVENTS_GRACE_S) -> bool | None:
        """Re-judge whether the worker's KV events flow (:meth:`router.workers.event_watch.
        EventStreamWatch.judge`; ``now``: ``time.monotonic()``); None without an ingestor here."""
        sub = self.ingest.subscriber if self.ingest is not None else None
        return self.events.judge(sub, now - self.added_monotonic, grace_s, now)

    def event_state(self) -> dict[str, Any] | None:
        """The embedded KV-event ingestor's state (seq, event age, gaps, replays, resyncs,
        blocks by tier as the events say), or None when no ingestor runs for this worker."""
        return self.ingest.state() if self.ingest is not None else None

    def others(self) -> OthersLoad:
        """The other gateway processes' requests on this worker (none with one process)."""
        if self.shared is None:
            return _NO_OTHERS
        table, slot = self.shared
        return table.others(slot)

    def publish_load(self) -> None:
        """Tell the other gateway processes this process's load on the worker (a no-op with one
        process); called whenever in-flight counts or predicted prefill ends change."""
        if self.shared is None:
            return
        table, slot = self.shared
        table.publish(slot, self.in_flight, self.prefill_tokens, self.decoding,
                      prefill_end_of(self._pending_ends()),
                      len(self.prefilling) + len(self.reserved), self._own_newest_pending_s())

    def claim(self) -> AbstractContextManager[None]:
        """Context in which reading this worker's load and publishing a hold on it is one step
        to every gateway process (:meth:`~router.shared.load_table.SharedLoadTable.claim`; nothing to
        hold with one process)."""
        return self.shared[0].claim() if self.shared is not None else nullcontext()

    def reserve(self, key: object, end_s: float | None, now_s: float) -> None:
        """Hold a place for a request on its way here (the dispatch queue's reservation), its
        first byte predicted at ``end_s`` (monotonic s; None: unpredicted), taken at ``now_s``."""
        self.reserved[key] = (end_s, now_s)
        self.publish_load()

    def unreserve(self, key: object) -> bool:
        """Give up the place ``key`` held; False when it held none (any more)."""
        if self.reserved.pop(key, None) is None:
            return False
        self.publish_load()
        return True

    def _own_newest_pending_s(self) -> float:
        newest = 0.0  # plain loops: the dispatch queue asks every worker at each look
        for handle in self.prefilling:
            if handle.dispatch_s > newest:
                newest = handle.dispatch_s
        for _, at in self.reserved.values():
            if at > newest:
                newest = at
        return newest

    def _pending_ends(self) -> list[float | None]:
        return [*self.prefilling.values(), *(end for end, _ in self.reserved.values())]

    def newest_pending_s(self) -> float:
        """When the newest request before its first byte here was sent, or its place held
        (monotonic s), through any gateway process; 0.0 when none is pending."""
        return max(self._own_newest_pending_s(), self.others().newest_pending_s)

    @property
    def total_in_flight(self) -> int:
        """Requests in flight on the worker through every gateway process."""
        return self.in_flight + self.others().in_flight

    def load(self) -> WorkerLoad:
        """A snapshot of the load the policies see: this process's requests plus the other
        gateway processes' (:mod:`router.shared.load_table`)."""
        o = self.others()
        # positional (once per candidate per decision; keywords cost more, docs/tuning/gateway_cpu.md): in_flight,
        # prefill_tokens, decoding, engine_running, engine_waiting, kv_usage, unseen_running, unseen_waiting
        return WorkerLoad(self.in_flight + o.in_flight, self.prefill_tokens + o.prefill_tokens, self.decoding + o.decoding,
                          self.engine_running, self.engine_waiting, self.kv_usage, self.unseen_running,
                          self.unseen_waiting)

    def record_scrape(self, running: int | None, waiting: int | None, kv_usage: float | None) -> None:
        """Store one ``/metrics`` scrape, and how much of it was not the gateway's own requests
        now. Each of ours is taken off once: those before their first byte off ``waiting`` first
        (as many as it shows), the rest of ours off ``running``. Ours: every gateway process's."""
        self.engine_running, self.engine_waiting, self.kv_usage = running, waiting, kv_usage
        o = self.others()
        in_flight, decoding = self.in_flight + o.in_flight, self.decoding + o.decoding
        ours_waiting = min(waiting or 0, max(0, in_flight - decoding))
        self.unseen_waiting = (waiting or 0) - ours_waiting
        self.unseen_running = max(0, (running or 0) - (in_flight - ours_waiting))
        self.last_scrape_monotonic = time.monotonic()

    def forget_scrape(self) -> None:
        """The last scrape failed: the engine figures are unknown again (``scrape_age_s`` still
        tells how old the last good one is)."""
        self.engine_running = self.engine_waiting = self.kv_usage = None
        self.unseen_running = self.unseen_waiting = 0

    def begin(self, prefill_tokens: int = 0, predicted_ttft_ms: float | None = None) -> "InFlight":
        """Count one request as in flight with ``prefill_tokens`` uncached prompt tokens, its
        first byte predicted ``predicted_ttft_ms`` from now (None: unpredicted); the handle
        remembers the queue it joined (for learning the worker's TTFT line)."""
        handle = InFlight(self, prefill_tokens)
        self.in_flight += 1
        self.prefill_tokens += prefill_tokens
        self.prefilling[handle] = (None if predicted_ttft_ms is None
                                   else handle.dispatch_s + max(0.0, predicted_ttft_ms) / 1000.0)
        self.publish_load()
        return handle

    def prefills_pending(self) -> int:
        """Requests before their first byte here, or with a place held by a dispatch queue,
        through every gateway process."""
        return len(self.prefilling) + len(self.reserved) + self.others().pending

    def prefill_left_ms(self, now: float) -> float:
        """Predicted milliseconds until the last of this worker's requests before their first
        byte (and of the dispatch queue's reservations) gets it: 0 when there are none; ``inf``
        when one has no prediction or is past its predicted end without a first byte (the
        prediction was short: only the first byte tells). The other gateway processes' requests
        count too. ``now``: ``time.monotonic()``."""
        latest = self.others().prefill_end_s  # 0.0: none; plain loops, as above
        if 0.0 < latest < now:
            return math.inf
        for end in self.prefilling.values():
            if end is None or end < now:
                return math.inf
            if end > latest:
                latest = end
        for end, _ in self.reserved.values():
            if end is None or end < now:
                return math.inf
            if end > latest:
                latest = end
        return 0.0 if latest == 0.0 else (latest - now) * 1000.0

    def _prefill_done(self, handle: "InFlight") -> None:
        if self.prefilling.pop(handle, False) is not False and self.on_prefill_done is not None:
            self.on_prefill_done()
        self.publish_load()

    def describe(self) -> dict[str, Any]:
        """The ``GET /admin/workers`` entry (DESIGN.md); counts are every gateway process's."""
        now = time.monotonic()
        load = self.load()
        return {
            "id": self.id, "url": self.url, "model": self.model, "role": self.role,
            "events": self.cfg.events, "replay": self.cfg.replay,
            "healthy": bool(self.healthy), "draining": self.draining, "in_flight": load.in_flight,
            "drained": self.draining and load.in_flight == 0,
            "prefill_tokens": load.prefill_tokens, "decoding": load.decoding,
            "prefill_left_ms": _finite_ms(self.prefill_left_ms(now)),
            "engine": {"running": self.engine_running, "waiting": self.engine_waiting,
                       "kv_cache_usage": self.kv_usage,
                       "scrape_age_s": _age(self.last_scrape_monotonic, now),
                       "scrape_filtered": self.scrape_filtered},
            "last_probe_error": self.health.last_error,
            "kv_events": self.event_state(),
            "events_live": self.events.live, "events_problem": self.events.problem,
            "prefill_rate": self.prefill_rate.state(),
            "evidence": self.evidence.state(),
        }


def _finite_ms(ms: float) -> float | None:
    """``ms`` rounded, None when unknown (``inf``: a request awaits its first byte unpredicted)."""
    return round(ms, 1) if ms != float("inf") else None


def _age(t: float | None, now: float) -> float | None:
    return None if t is None else round(now - t, 3)


class InFlight:
    """One request's share of a registration's counts; :meth:`first_byte` and :meth:`finish` are
    idempotent, so cancellation paths can call them freely.

    What the request met at dispatch, for learning the worker's TTFT line: ``queued_tokens``
    (the worker's predicted prefill tokens not yet past first byte, before this one),
    ``decoding`` (requests past first byte), ``dispatch_s`` (monotonic seconds); ``ttft_ms``:
    dispatch to first byte, None before it; ``streamed``: the answer was an event stream (only
    then is the first byte the first token)."""

    __slots__ = ("reg", "_prefill", "_decoding", "_done", "queued_tokens", "decoding", "dispatch_s",
                 "ttft_ms", "streamed")

    def __init__(self, reg: WorkerRegistration, prefill_tokens: int) -> None:
        self.reg = reg
        self._prefill = prefill_tokens
        self._decoding = False
        self._done = False
        others = reg.others()
        self.queued_tokens = max(0, reg.prefill_tokens + others.prefill_tokens)
        self.decoding = reg.decoding + others.decoding
        self.dispatch_s = time.monotonic()
        self.ttft_ms: float | None = None
        self.streamed = False

    def first_byte(self) -> None:
        """The worker started answering: its prefill is done, the request now decodes."""
        if self._done or self._decoding:
            return
        self.ttft_ms = (time.monotonic() - self.dispatch_s) * 1000.0
        self.presume_prefilled()

    def presume_prefilled(self) -> None:
        """Count the request as decoding without a first byte (a non-streamed answer shows none
        before its end): called once its predicted TTFT has passed."""
        if self._done or self._decoding:
            return
        self._decoding = True
        self.reg.prefill_tokens -= self._prefill
        self.reg.decoding += 1
        self.reg._prefill_done(self)

    def finish(self) -> None:
        """The request ended (any way); release its counts once."""
        if self._done:
            return
        self._done = True
        reg = self.reg
        reg.in_flight -= 1
        if self._decoding:
            reg.decoding -= 1
            reg.publish_load()
        else:
            reg.prefill_tokens -= self._prefill
            reg._prefill_done(self)


class WorkerRegistry:
    """Workers by id. ``task_factories``: per-worker background tasks (see module docstring);
    ``shared_load``: the table the gateway processes share their load through (None: one
    process)."""

    def __init__(self, task_factories: list[TaskFactory] | None = None,
                 shared_load: SharedLoadTable | None = None) -> None:
        self._workers: dict[str, WorkerRegistration] = {}
        self._factories: list[TaskFactory] = list(task_factories or [])
        self.shared_load = shared_load
        self._model_rates: dict[str, PrefillRateEstimator] = {}

    def add_task_factory(self, factory: TaskFactory) -> None:
        """Run ``factory`` for every worker added from now on and for those already present."""
        self._factories.append(factory)
        for reg in self._workers.values():
            self._start(reg, factory)

    def add(self, cfg: WorkerConfig) -> WorkerRegistration:
        """Register a worker and start its tasks. Raises ValueError when the id is taken.
        Must be called on the event loop."""
        reg = WorkerRegistration(cfg)
        if reg.id in self._workers:
            raise ValueError(f"worker {reg.id!r} already exists")
        if self.shared_load is not None:
            reg.shared = (self.shared_load, self.shared_load.slot(reg.id))
        self._workers[reg.id] = reg
        for factory in self._factories:
            self._start(reg, factory)
        return reg

    def _start(self, reg: WorkerRegistration, factory: TaskFactory) -> None:
        task = asyncio.get_running_loop().create_task(factory(reg), name=f"worker-{reg.id}")
        reg.tasks.append(task)

    async def remove(self, worker_id: str) -> WorkerRegistration:
        """Unregister and stop its tasks; in-flight requests finish on their own. Raises KeyError."""
        reg = self._workers.pop(worker_id)
        reg.removed = True
        for task in reg.tasks:
            task.cancel()
        await asyncio.gather(*reg.tasks, return_exceptions=True)
        reg.tasks.clear()
        return reg

    def model_rate(self, model: str) -> PrefillRateEstimator:
        """The TTFT line of base model ``model`` learned from every one of its workers' requests
        (made on first use). ``ttft`` predicts every worker by this line, scaled by the worker's
        own speed factor against it (:meth:`router.estimates.prefill_rate.PrefillRateEstimator.speed_factor`):
        one estimator learns from all workers, so a gateway knows its hardware after a handful of
        requests rather than after a handful per worker, and one line fitted to many TTFTs is
        steadier than one per worker. Its line is published with a dead band
        (:data:`~router.estimates.prefill_rate.MODEL_LINE_TOLERANCE`): each republished line
        makes every worker's speed factor be computed again."""
        rate = self._model_rates.get(model)
        if rate is None:
            rate = self._model_rates[model] = PrefillRateEstimator(tolerance=MODEL_LINE_TOLERANCE)
        return rate

    def prefill_speed(self, reg: WorkerRegistration) -> tuple[float, int] | None:
        """``reg``'s speed factor against its model's learned line, with its sample count
        (:meth:`router.estimates.prefill_rate.PrefillRateEstimator.speed_factor`); None until both are known."""
        model_line = self.model_rate(reg.model).learned
        return reg.prefill_rate.speed_factor(model_line) if model_line is not None else None

    def get(self, worker_id: str) -> WorkerRegistration | None:
        """The current registration of ``worker_id``, or None."""
        return self._workers.get(worker_id)

    def all(self) -> list[WorkerRegistration]:
        """Every registration, in insertion order."""
        return list(self._workers.values())

    def routable(self, model: str) -> list[WorkerRegistration]:
        """Healthy, non-draining workers serving base model ``model``."""
        return [r for r in self._workers.values() if r.model == model and r.routable]

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    async def close(self) -> None:
        """Remove every worker (stops all tasks)."""
        for worker_id in list(self._workers):
            await self.remove(worker_id)
