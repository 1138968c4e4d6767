"""The gateway's per-worker background loops: a health probe and an engine-load scrape every
interval (:mod:`router.workers.calls` makes each call), as registry task factories
(``factory(registration) -> coroutine``). Among the processes of ``kvroute serve --processes N``
one makes the calls for all and the others apply its results (:class:`ProbeSharing`,
:mod:`router.shared.probe_table`).
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from kvcore.ticks import ticks
from router.config.schema import HealthConfig, LoadScrapeConfig
from router.shared.load_table import MAX_WORKERS
from router.shared.probe_table import SharedProbeTable, stale_after_s
from router.upstream_http import UpstreamHTTP
from router.workers.calls import probe_once, scrape_once
from router.workers.registry import WorkerRegistration

log = logging.getLogger("kvroute.probes")


def _too_old(at: float, cfg: HealthConfig | LoadScrapeConfig, now: float) -> bool:
    """Whether a record written at ``at`` (monotonic s) is past :func:`router.shared.probe_table.stale_after_s`."""
    return now - at > stale_after_s(cfg.interval_s, cfg.timeout_s)


_UNSEEN = np.uint64(2**64 - 1)  # a slot's applied ``changes`` before any result was applied here


@dataclass
class ProbeSharing:
    """This process's part in probing for its sibling processes (:mod:`router.shared.probe_table`):
    the shared file and whether this process is the prober now
    (:meth:`router.processes.group.ProcessGroup.is_prober`). The prober's per-worker loops call the
    workers and publish; in the other processes those loops call a worker only when its record is
    too old, and :meth:`follow` (one task per process) applies the prober's results. ``calls``:
    the probes and scrapes this process made itself, by kind (``health``, ``scrape``);
    ``applied``: the prober's results it applied (those that moved a record's ``changes``)."""

    table: SharedProbeTable
    is_prober: Callable[[], bool]

    def __post_init__(self) -> None:
        self.calls = {"health": 0, "scrape": 0}
        self.applied = {"health": 0, "scrape": 0}
        self._seen: dict[str, weakref.WeakKeyDictionary] = {"health": weakref.WeakKeyDictionary(),
                                                           "scrape": weakref.WeakKeyDictionary()}
        # the same per slot, for the vectorised pass of follow (_UNSEEN: apply whatever is there)
        self._seen_cols = {"health": np.full(MAX_WORKERS, _UNSEEN, dtype=np.uint64),
                           "scrape": np.full(MAX_WORKERS, _UNSEEN, dtype=np.uint64)}
        self._followed: tuple[WorkerRegistration, ...] = ()
        self._slots = np.zeros(0, dtype=np.intp)
        self._turn: asyncio.Future[None] | None = None  # what idle per-worker loops wait on

    async def wait_turn(self) -> None:
        """Wait until :meth:`follow` finds that this process must call workers itself: it became
        the prober, or a record went stale. A follower's per-worker loops wait here instead of
        waking every interval to find nothing to do."""
        if self._turn is None or self._turn.done():
            self._turn = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._turn)  # one loop cancelled (its worker removed) leaves the others waiting

    def _wake_turns(self) -> None:
        if self._turn is not None and not self._turn.done():
            self._turn.set_result(None)

    @staticmethod
    def stale(result, cfg: HealthConfig | LoadScrapeConfig) -> bool:
        """Whether ``result`` is missing or too old to follow
        (:func:`router.shared.probe_table.stale_after_s`): then this process calls the worker itself."""
        return result is None or _too_old(result.at, cfg, time.monotonic())

    def take_new(self, kind: str, reg: WorkerRegistration, result, cfg: HealthConfig | LoadScrapeConfig) -> bool:
        """Whether ``result`` is fresh and its ``changes`` not applied to ``reg`` here yet (then it
        counts as applied)."""
        if self.stale(result, cfg) or self._seen[kind].get(reg) == result.changes:
            return False
        self._seen[kind][reg] = result.changes
        if reg.shared is not None:
            self._seen_cols[kind][reg.shared[1]] = result.changes
        return True

    async def apply(self, reg: WorkerRegistration, health: HealthConfig, scrape: LoadScrapeConfig | None,
                    on_change: Callable[[WorkerRegistration], Awaitable[None]] | None = None) -> bool:
        """Apply the prober's new results for ``reg`` (each once): its health probe through
        :meth:`~router.workers.registry.WorkerRegistration.record_probe` (``on_change`` awaited when
        that turned the worker up or down), its scrape through ``record_scrape``; then judge this
        process's own KV-event stream (``check_events``). Returns whether a record was too old to
        follow (:meth:`stale`: this process's own loop for ``reg`` must call the worker)."""
        slot = reg.shared[1]
        result = self.table.read_probe(slot)
        stale = self.stale(result, health)
        if self.take_new("health", reg, result, health):
            self.applied["health"] += 1
            before = reg.healthy
            reg.record_probe(result.ok, health.fail_threshold, health.rise_threshold, result.error)
            if on_change is not None and before is not None and reg.healthy is not before:
                await on_change(reg)
        if scrape is not None:
            got = self.table.read_scrape(slot)
            stale = stale or self.stale(got, scrape)
            if self.take_new("scrape", reg, got, scrape):
                self.applied["scrape"] += 1
                if got.ok:
                    reg.record_scrape(got.running, got.waiting, got.kv_usage)
                else:
                    reg.forget_scrape()
            if got is not None and got.ok and not self.stale(got, scrape):
                reg.last_scrape_monotonic = got.at  # the figures held still: they are this recent
        reg.check_events(time.monotonic())
        return stale

    def _track(self, regs: tuple[WorkerRegistration, ...]) -> None:
        """Follow ``regs`` from now on: their slots, and for a registration with nothing applied
        here yet, its slot marked unseen (a worker added again may reuse a slot)."""
        self._followed = regs
        self._slots = np.fromiter((r.shared[1] for r in regs), dtype=np.intp, count=len(regs))
        for kind, cols in self._seen_cols.items():
            for reg in regs:
                if reg not in self._seen[kind]:
                    cols[reg.shared[1]] = _UNSEEN

    async def follow_once(self, regs: list[WorkerRegistration], health: HealthConfig,
                          scrape: LoadScrapeConfig | None,
                          on_change: Callable[[WorkerRegistration], Awaitable[None]] | None = None,
                          refresh: bool = True) -> bool:
        """One pass over ``regs`` (registrations with a slot): one vectorised read of the file's
        ``changes`` and times (:meth:`~router.shared.probe_table.SharedProbeTable.columns`) picks
        the workers whose records moved or went stale, and only those are read and applied
        (:meth:`apply`). ``refresh``: also bring every worker's scrape age and KV-event state up
        to date (``follow`` does once per interval, not every pass). Returns whether a record was
        too old to follow."""
        followed = tuple(regs)
        if followed != self._followed:
            self._track(followed)
        slots = self._slots
        cols = self.table.columns()
        now = time.monotonic()
        due = cols.probe_changes[slots] != self._seen_cols["health"][slots]
        due |= now - cols.probe_at[slots] > stale_after_s(health.interval_s, health.timeout_s)
        if scrape is not None:
            scrape_stale_s = stale_after_s(scrape.interval_s, scrape.timeout_s)
            due |= cols.scrape_changes[slots] != self._seen_cols["scrape"][slots]
            due |= now - cols.scrape_at[slots] > scrape_stale_s
        stale = False
        picked = set(np.flatnonzero(due).tolist())
        for i in picked:
            reg = followed[i]
            try:
                stale = await self.apply(reg, health, scrape, on_change) or stale
            except Exception:  # one worker's trouble must not stop the others' results
                log.exception("applying the prober's results for worker %s failed", reg.id)
        if refresh:
            # an unmoved ok scrape still confirms the figures held (skipped: stale ones, applied above)
            fresh = (cols.scrape_ok[slots] == 1.0).tolist() if scrape is not None else None
            times = cols.scrape_at[slots].tolist() if scrape is not None else None
            for i, reg in enumerate(followed):
                if i in picked:
                    continue
                if fresh is not None and fresh[i]:
                    reg.last_scrape_monotonic = times[i]
                reg.check_events(now)
        return stale

    async def follow(self, workers: Callable[[], list[WorkerRegistration]], health: HealthConfig,
                     scrape: LoadScrapeConfig | None,
                     on_change: Callable[[WorkerRegistration], Awaitable[None]] | None = None) -> None:
        """Run until cancelled: every half of the shorter interval, while this process is not the
        prober, :meth:`follow_once` over every worker with a slot (a half interval: no result is
        overwritten before it is read; scrape ages and KV-event states every other pass); when
        this process is the prober, or a record was too old, wake the per-worker loops waiting in
        :meth:`wait_turn`."""
        period = min(health.interval_s, scrape.interval_s if scrape is not None else health.interval_s) / 2
        await asyncio.sleep(0)  # the workers' own tasks first (each KV-event ingestor attaches itself at once)
        passes = 0
        while True:
            wake = self.is_prober()
            if not wake:
                regs = [r for r in workers() if r.shared is not None and not r.removed]
                try:
                    wake = await self.follow_once(regs, health, scrape, on_change, refresh=passes % 2 == 0)
                except Exception:
                    log.exception("following the prober's results failed")
                passes += 1
            if wake:
                self._wake_turns()
            await ticks().wait(period)  # on the probe loops' ticks: no wake-up of its own


async def _shared_call(kind: str, call, read, publish, client: UpstreamHTTP, reg: WorkerRegistration,
                       cfg: HealthConfig | LoadScrapeConfig, sharing: ProbeSharing) -> bool:
    """The prober makes ``call`` and publishes its result (``publish(slot, ok)``); another process
    makes it only when the prober's record for ``reg`` (``read(slot)``) is too old
    (:meth:`ProbeSharing.stale`; it publishes nothing then). Returns whether it called the worker."""
    slot = reg.shared[1] if reg.shared is not None else None
    prober = slot is None or sharing.is_prober()
    if not prober and not sharing.stale(read(slot), cfg):
        return False
    sharing.calls[kind] += 1
    ok = await call(client, reg, cfg)
    if prober and slot is not None:
        publish(slot, ok)
        sharing.take_new(kind, reg, read(slot), cfg)  # its own result: applied
    return True


async def shared_probe_once(client: UpstreamHTTP, reg: WorkerRegistration, cfg: HealthConfig,
                            sharing: ProbeSharing) -> bool:
    """:func:`probe_once` made by the prober for every process (:func:`_shared_call`)."""
    table = sharing.table
    return await _shared_call("health", probe_once, table.read_probe,
                              lambda slot, ok: table.write_probe(slot, ok, reg.health.last_error,
                                                                 repeats_shown=max(cfg.fail_threshold, cfg.rise_threshold)),
                              client, reg, cfg, sharing)


async def shared_scrape_once(client: UpstreamHTTP, reg: WorkerRegistration, cfg: LoadScrapeConfig,
                             sharing: ProbeSharing) -> bool:
    """:func:`scrape_once` made by the prober for every process (:func:`_shared_call`)."""
    table = sharing.table
    return await _shared_call("scrape", scrape_once, table.read_scrape,
                              lambda slot, ok: table.write_scrape(slot, ok, reg.engine_running, reg.engine_waiting,
                                                                  reg.kv_usage, in_flight=reg.total_in_flight),
                              client, reg, cfg, sharing)


def periodic_task(step, client: UpstreamHTTP, cfg: HealthConfig | LoadScrapeConfig,
                  sharing: ProbeSharing | None = None, read=None):
    """A registry task factory running ``step(client, reg, cfg)`` at once and then at every
    multiple of ``cfg.interval_s`` seconds on the loop's clock (one timer for all workers,
    :mod:`kvcore.ticks`), for as long as the worker is registered. With ``sharing``
    (``read(slot)``: the prober's record of the worker), a process that is not the prober and
    holds a fresh record waits in :meth:`ProbeSharing.wait_turn` instead of the interval."""

    async def run(reg: WorkerRegistration) -> None:
        while True:
            await step(client, reg, cfg)
            if (sharing is not None and reg.shared is not None and not sharing.is_prober()
                    and not sharing.stale(read(reg.shared[1]), cfg)):
                await sharing.wait_turn()
            else:
                await ticks().wait(cfg.interval_s)

    return run


def health_probe_task(client: UpstreamHTTP, cfg: HealthConfig,
                      on_change: Callable[[WorkerRegistration], Awaitable[None]] | None = None,
                      sharing: ProbeSharing | None = None):
    """Task factory: :func:`probe_once` every ``cfg.interval_s`` (with ``sharing``:
    :func:`shared_probe_once`); ``on_change(reg)`` is awaited after a probe that turned the
    worker up or down (not after its first probe)."""

    async def step(client: UpstreamHTTP, reg: WorkerRegistration, cfg: HealthConfig) -> None:
        before = reg.healthy
        if sharing is None:
            await probe_once(client, reg, cfg)
        else:
            await shared_probe_once(client, reg, cfg, sharing)
        if on_change is not None and before is not None and reg.healthy is not before:
            await on_change(reg)

    return periodic_task(step, client, cfg, sharing, sharing.table.read_probe if sharing is not None else None)


def load_scrape_task(client: UpstreamHTTP, cfg: LoadScrapeConfig, sharing: ProbeSharing | None = None):
    """Task factory: :func:`scrape_once` every ``cfg.interval_s`` (with ``sharing``:
    :func:`shared_scrape_once`)."""
    if sharing is None:
        return periodic_task(scrape_once, client, cfg)

    async def step(client: UpstreamHTTP, reg: WorkerRegistration, cfg: LoadScrapeConfig) -> None:
        await shared_scrape_once(client, reg, cfg, sharing)

    return periodic_task(step, client, cfg, sharing, sharing.table.read_scrape)
