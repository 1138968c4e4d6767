"""Embedded mode: the gateway subscribes to each worker's KV events itself and writes the
in-process index, so one host needs no agent processes (``index: {backend: memory}`` and workers
with ``events:``); with ``--processes N``, one process writes the host's shared index for all.
With a shared index (Redis) the agents write it instead and this is not used.

One :class:`kvcore.kv_events.EventIngestor` per worker registration: started when the worker is
added (config, admin API, SIGHUP), stopped when it is removed (the gateway then purges the
worker's index entries). The ingestor is kept on the registration (``reg.ingest``) so
``/admin/workers`` and ``/admin/index`` show its seq, event age, gaps, replays and resyncs.
"""
from __future__ import annotations

import asyncio
import logging

from kvcore.index.base import KVIndex
from kvcore.index.host import HostIndex
from kvcore.kv_events.ingest import EventIngestor
from router.shared.ingest import IngestBoard, PublishedIngest
from router.workers.registry import TaskFactory, WorkerRegistration

log = logging.getLogger("kvroute.embedded_events")


def embedded_ingest_task(index: KVIndex, block_size_by_model: dict[str, int],
                         board: IngestBoard | None = None) -> TaskFactory:
    """A registry task factory running one event ingestor per worker that names ``events``.

    ``block_size_by_model``: each served model's engine block size in tokens (keys are made with
    it, so it must equal the workers' ``--block-size``). With the host index of ``--processes N``
    (:class:`kvcore.index.host.HostIndex`) only its writer ingests: in the other processes the
    task keeps the writer's published view on the registration (``board``,
    :mod:`router.shared.ingest`) until this process takes the index over, then ingests.
    """

    async def run(reg: WorkerRegistration) -> None:
        if reg.cfg.events is None:
            return
        if isinstance(index, HostIndex) and not index.writer:
            if board is not None:
                reg.ingest = PublishedIngest(board, reg.id)  # type: ignore[assignment]
            await index.wait_writer()
            log.info("worker %s: this process now writes the host index; subscribing", reg.id)
        ingestor = EventIngestor(reg.id, reg.cfg.events, reg.cfg.replay, index, reg.model,
                                 block_size_by_model[reg.model])
        reg.ingest = ingestor
        await ingestor.start()
        log.info("worker %s: subscribed to KV events at %s", reg.id, reg.cfg.events)
        try:
            await asyncio.Event().wait()  # runs until the registry cancels the task
        finally:
            await ingestor.stop()

    return run
