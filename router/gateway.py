"""The gateway's parts wired together, with their lifecycle and run-time changes.

:class:`Gateway` owns the index (from :func:`kvcore.index.make_index`), the worker registry and
its per-worker tasks, the tokenizer pool, the live policy, the router, the upstream client and
the metrics. Admin calls and ``SIGHUP`` go through :meth:`add_worker`, :meth:`remove_worker`,
:meth:`drain_worker`, :meth:`set_worker_role`, :meth:`set_policy` and :meth:`apply_config`.

Extension point for the embedded KV-event ingest: ``gateway.registry.add_task_factory(f)`` with
``f(registration) -> coroutine`` runs ``f`` for every worker (present and future) and cancels it
when the worker goes; ``gateway.index`` is the index to write into. Factories given to
:class:`Gateway` as ``task_factories`` are added at start.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from kvcore.index import chain_rows, make_index
from kvcore.index.base import SupportsWorkerStates
from kvcore.index.errors import IndexEncodingMismatch, IndexUnavailable
from kvcore.index.host import HostIndex
from kvcore.kv_events.ingest import EventIngestor
from kvcore.ticks import ticks
from router.config.schema import GatewayConfig, WorkerConfig, load_config, same_target
from router.errors import WorkerExists
from router.processes.group import INDEX_FILE, ProcessGroup
from router.relay.upstream import Upstream
from router.route.admission import Admission
from router.route.decision_log import DecisionLog
from router.route.dispatch_queue import DispatchQueue
from router.route.feedback import Feedback
from router.route.planner import PolicyHolder, Router
from router.route.prompt_blocks import TokenizerPool
from router.route.shared_admission import GroupAdmission
from router.route.stored_responses import StoredResponses
from router.shared.ingest import BOARD_FILE, IngestBoard, publish_loop
from router.telemetry.metrics import GatewayMetrics
from router.workers.discovery.kubernetes import KubernetesDiscovery
from router.workers.embedded_events import embedded_ingest_task
from router.workers.peer_states import PeerStateSource, PublishedPeerStates
from router.workers.peers import PeerPoller, PeerTable
from router.workers.probes import ProbeSharing, health_probe_task, load_scrape_task
from router.workers.registry import TaskFactory, WorkerRegistration, WorkerRegistry

HEARTBEAT_S = 1.0  # the shared load table's liveness beat (router.shared.load_table.STALE_S is 5 s)
log = logging.getLogger("kvroute.gateway")


class Gateway:
    """All gateway state. ``cfg``: validated config; ``config_path``: the file ``SIGHUP``
    re-reads (None: reload disabled); ``task_factories``: extra per-worker tasks."""

    def __init__(self, cfg: GatewayConfig, config_path: str | Path | None = None,
                 task_factories: list[TaskFactory] | None = None, group: ProcessGroup | None = None) -> None:
        self.cfg = cfg
        self.config_path = Path(config_path) if config_path else None
        self.admin_token = cfg.admin.resolve_token()
        self.group = group  # one of N processes (kvroute serve --processes N), None when alone
        if group is not None:
            group.admin_token = self.admin_token
        # with siblings, the embedded index is one file in the run folder that all of them read
        host_path = group.run_dir / INDEX_FILE if group is not None and cfg.index.backend == "memory" else None
        self.index = make_index(cfg.index.model_dump(), host_path=host_path)
        self.registry = WorkerRegistry(shared_load=group.table if group is not None else None)
        self.metrics = GatewayMetrics(self.registry.all)
        self.feedback = Feedback(self.registry, self.metrics)  # what answers teach (router.route.feedback)
        self.tokenizers = TokenizerPool(cfg.models, cfg.routing.tokenize_threads,
                                        cfg.routing.tokenize_cache_max_tokens)
        self.metrics.watch_tokenize_cache(self.tokenizers.cache_totals)
        self.metrics.watch_tokenize_engines(self.tokenizers.engine_totals)
        self.policy = PolicyHolder(cfg.policy)
        # workers' peer-pull states (router.workers.peers): polled from a shared index's agent states
        # and from the states agents publish here (PUT /admin/workers/{id}/peer, router.workers.peer_states)
        self.peers = PeerTable()
        self.published_peers = PublishedPeerStates()
        self.peer_source = PeerStateSource(
            self.published_peers, self.index if isinstance(self.index, SupportsWorkerStates) else None)
        self.metrics.watch_peer_links(self.peers.current)
        self._peer_poller: PeerPoller | None = None
        self.router = Router(cfg.models, self.tokenizers, self.index, self.registry, self.policy,
                             self.metrics, cfg.routing, self.peers)
        self.upstream = Upstream(cfg.timeouts, cfg.health, self.metrics)
        routable = lambda: sum(1 for r in self.registry.all() if r.routable)  # noqa: E731
        if group is not None and group.admission is not None:  # slots and queue for the whole gateway
            self.admission: Admission = GroupAdmission(cfg.admission, routable, self.metrics, group.admission)
        else:
            self.admission = Admission(cfg.admission, routable, self.metrics)
        self.metrics.watch_admission(lambda: self.admission.in_flight, lambda: self.admission.queued)
        self.dispatch_queue = DispatchQueue(self.router, self.registry, self.metrics,
                                            lambda: self.policy.policy.queue)
        self.metrics.watch_dispatch_queue(lambda: self.dispatch_queue.queued)
        self.decisions = DecisionLog(cfg.routing.decisions_kept)
        self.stored_responses = StoredResponses()  # Responses API: which worker holds a stored response
        self._extra_factories = list(task_factories or [])
        self._lock = asyncio.Lock()
        self._heartbeat: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None
        self._board_publisher: asyncio.Task | None = None
        self.discovery: KubernetesDiscovery | None = None  # when the config has discovery.kubernetes

    @property
    def model_names(self) -> set[str]:
        return {m.name for m in self.cfg.models}

    async def start(self) -> None:
        """Check the index, load tokenizers, open the upstream pool, start probes, add the
        configured workers and wait (at most one probe timeout) for their first health probe.
        Raises IndexEncodingMismatch when a shared index holds keys of another block-key
        encoding (the gateway must not start: its keys would never match); an index that is
        down only means routing on load until it answers. The agents' peer-pull states (those
        of a shared index's agents, Redis, and those published to this gateway,
        :mod:`router.workers.peer_states`) are polled every second into ``self.peers``
        (:mod:`router.workers.peers`). With ``discovery.kubernetes`` it then
        starts the pod watch (:mod:`router.workers.discovery.kubernetes`; ``self.discovery``), raising
        ValueError when no Kubernetes client configuration loads."""
        try:
            await self.index.open()
        except IndexEncodingMismatch:
            raise
        except IndexUnavailable as exc:
            log.warning("index unavailable at start-up; routing on load alone until it answers: %s", exc)
        await self.tokenizers.load()
        await self.upstream.start()
        self.router.render_session = lambda: self.upstream.session
        client = self.upstream.http  # probes and scrapes (router.workers.probes)
        sharing = None  # with siblings, one process probes and scrapes for all (router.shared.probe_table)
        if self.group is not None and self.group.probes is not None:
            sharing = ProbeSharing(self.group.probes, self.group.is_prober)
            self.metrics.watch_worker_calls(lambda: dict(sharing.calls), lambda: dict(sharing.applied))
        self.registry.add_task_factory(health_probe_task(client, self.cfg.health, self._health_changed, sharing))
        if self.cfg.load_scrape.enabled:
            self.registry.add_task_factory(load_scrape_task(client, self.cfg.load_scrape, sharing))
        if not chain_rows.NATIVE:
            log.info("index lookups over many workers take their numpy path: the C extension "
                     "kvcore/index/_chain_native.c is not built (install kvroute where a C compiler is)")
        if self.cfg.index.backend == "memory":
            blocks = {m.name: m.block_size for m in self.cfg.models}
            board = None
            if isinstance(self.index, HostIndex) and self.group is not None:  # one writer ingests for all
                board = IngestBoard(self.group.run_dir / BOARD_FILE)
                if self.index.try_become_writer():
                    log.info("this process writes the host index %s", self.index.path)
                self._board_publisher = asyncio.get_running_loop().create_task(
                    publish_loop(board, lambda: self.index.writer, self._ingestors), name="ingest-board")
            self.registry.add_task_factory(embedded_ingest_task(self.index, blocks, board))
        for factory in self._extra_factories:
            self.registry.add_task_factory(factory)
        regs = [self.registry.add(w) for w in self.cfg.workers]
        if sharing is not None:  # the prober's results, applied here while another process probes
            self._follower = asyncio.get_running_loop().create_task(
                sharing.follow(self.registry.all, self.cfg.health,
                               self.cfg.load_scrape if self.cfg.load_scrape.enabled else None,
                               self._health_changed), name="probe-follower")
        if self.group is not None and self.group.table is not None:  # a silent row counts as a dead process
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat(self.group), name="load-heartbeat")
        # agents publish their peer-pull states in a shared index and/or here (router.workers.peer_states)
        self._peer_poller = PeerPoller(self.peer_source, self.peers)
        self._peer_poller.start()
        await self._wait_first_probe(regs)
        if self.cfg.discovery.kubernetes is not None:  # pods become workers as they turn Ready
            self.discovery = KubernetesDiscovery(self, self.cfg.discovery.kubernetes)
            await self.discovery.start()

    async def refresh_peers(self) -> None:
        """Read the agents' peer-pull states into ``self.peers`` now rather than at the next poll
        (an agent just published or withdrew its state); a failure is counted as a poll's is."""
        if self._peer_poller is not None:
            await self._peer_poller.poll_once()

    async def _health_changed(self, reg: WorkerRegistration) -> None:
        """A worker went down: its index entries are purged (a worker that died lost its cache;
        nothing is routed to it while down either way). It came back: with an embedded event
        stream that never broke meanwhile (the same engine, only its HTTP side failed), the
        ingestor's view is published again; otherwise its events rebuild the index from empty."""
        try:
            if not reg.healthy:
                await self.index.clear_worker(reg.id)
                log.info("worker %s is down: its index entries were purged", reg.id)
            elif reg.ingest is not None and await reg.ingest.restore_if_continuous():
                log.info("worker %s is up; its KV-event stream never broke: index entries restored", reg.id)
        except IndexUnavailable as exc:
            log.error("worker %s changed health but its index entries could not be updated: %s", reg.id, exc)

    async def stop(self) -> None:
        """Stop every task and close connections."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._follower is not None:
            self._follower.cancel()
        if self._board_publisher is not None:
            self._board_publisher.cancel()
        if self._peer_poller is not None:
            await self._peer_poller.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        self.dispatch_queue.close()
        self.admission.close()
        await self.registry.close()
        await self.upstream.close()
        await self.index.close()
        self.tokenizers.close()
        if self.group is not None:
            self.group.close()

    def _ingestors(self) -> list[tuple[str, EventIngestor]]:
        return [(r.id, r.ingest) for r in self.registry.all() if isinstance(r.ingest, EventIngestor)]

    @staticmethod
    async def _beat(group: ProcessGroup) -> None:
        while True:
            group.table.heartbeat()  # type: ignore[union-attr]
            await ticks().wait(HEARTBEAT_S)  # on the probe loops' ticks: no wake-up of its own

    async def _wait_first_probe(self, regs: list[WorkerRegistration]) -> None:
        if not regs:
            return
        waits = [asyncio.ensure_future(r.health.first_probe.wait()) for r in regs]
        await asyncio.wait(waits, timeout=self.cfg.health.timeout_s + 1.0)
        for w in waits:
            w.cancel()

    async def add_worker(self, wcfg: WorkerConfig) -> WorkerRegistration:
        """Register a worker and wait for its first probe; serialised with the other worker
        changes (admin API, ``SIGHUP``). Raises WorkerExists (id taken) or ValueError (model
        unknown)."""
        async with self._lock:
            return await self._add_worker(wcfg)

    async def _add_worker(self, wcfg: WorkerConfig) -> WorkerRegistration:
        if wcfg.model not in self.model_names:
            raise ValueError(f"unknown model {wcfg.model!r}; models: {sorted(self.model_names)}")
        if wcfg.id in self.registry:
            raise WorkerExists(f"worker {wcfg.id!r} already exists")
        same_url = [r.id for r in self.registry.all() if same_target(r.cfg, wcfg)]
        if same_url:
            rank = "" if wcfg.data_parallel_rank is None else f" rank {wcfg.data_parallel_rank}"
            raise WorkerExists(f"worker {same_url[0]!r} already serves {wcfg.url}{rank}")
        reg = self.registry.add(wcfg)
        await self._wait_first_probe([reg])
        return reg

    async def remove_worker(self, worker_id: str) -> WorkerRegistration:
        """Unregister a worker and purge its index entries; its in-flight requests finish;
        serialised with the other worker changes. Raises KeyError when unknown."""
        async with self._lock:
            return await self._remove_worker(worker_id)

    async def _remove_worker(self, worker_id: str) -> WorkerRegistration:
        reg = await self.registry.remove(worker_id)
        try:
            await self.index.clear_worker(worker_id)
        except IndexUnavailable as exc:  # a shared index that is down: its agent purges on restart
            log.error("worker %s removed but its index entries were not purged: %s", worker_id, exc)
        return reg

    async def drain_worker(self, worker_id: str) -> WorkerRegistration:
        """Send no new requests to the worker; serialised with the other worker changes.
        Raises KeyError when unknown."""
        async with self._lock:
            reg = self.registry.get(worker_id)
            if reg is None:
                raise KeyError(worker_id)
            reg.draining = True
            return reg

    async def set_worker_role(self, worker_id: str, role: str) -> WorkerRegistration:
        """Change a worker's role (``both``, ``prefill``, ``decode``); serialised with the other
        worker changes. Raises KeyError when unknown, ValueError for a bad role."""
        async with self._lock:
            reg = self.registry.get(worker_id)
            if reg is None:
                raise KeyError(worker_id)
            reg.set_role(role)  # type: ignore[arg-type]  # checked there
            return reg

    def set_policy(self, cfg: dict[str, Any]) -> None:
        """Validate and swap the live policy atomically. Raises ValueError when ``cfg`` is bad."""
        self.policy.replace(cfg)
        self.cfg.policy = dict(cfg)

    async def apply_config(self, new: GatewayConfig) -> dict[str, list[str]]:
        """Apply a re-read config's policy and workers (other sections need a restart): new ids
        are added, missing ones removed, changed ones re-added; one change at a time with the
        admin API's (a DELETE racing a reload waits, then finds what the reload left). Returns
        what changed."""
        async with self._lock:
            self.set_policy(new.policy)
            wanted = {w.id: w for w in new.workers if w.model in self.model_names}
            changes: dict[str, list[str]] = {"added": [], "removed": [], "replaced": []}
            for reg in self.registry.all():
                if self.discovery is not None and self.discovery.owns(reg.id):
                    continue  # a discovered worker: its pod decides, not the file
                target = wanted.get(reg.id)
                if target is None:
                    await self._remove_worker(reg.id)
                    changes["removed"].append(reg.id)
                elif target != reg.cfg:
                    await self._remove_worker(reg.id)
                    await self._add_worker(target)
                    changes["replaced"].append(reg.id)
            for wid, wcfg in wanted.items():
                if wid not in self.registry:
                    await self._add_worker(wcfg)
                    changes["added"].append(wid)
            self.cfg.workers = list(new.workers)
            return changes

    async def reload(self) -> None:
        """Re-read ``config_path`` and apply it (``SIGHUP``); a bad file is logged and ignored."""
        if self.config_path is None:
            return
        try:
            new = load_config(self.config_path)
        except (OSError, ValueError) as exc:
            log.error("config reload from %s failed, keeping the running config: %s", self.config_path, exc)
            return
        try:
            changes = await self.apply_config(new)
        except Exception:  # runs in a task nobody awaits: never let it fail silently
            log.exception("config reload from %s failed part-way; the workers are as listed in "
                          "/admin/workers", self.config_path)
            return
        log.info("config reloaded from %s: policy %s, workers %s", self.config_path,
                 new.policy.get("name"), changes)
