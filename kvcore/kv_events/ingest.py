"""One worker's KV events into the index: subscriber + translator + index writes + liveness.

Used by the offload agent (``kvroute agent``, writing Redis) and by the gateway in embedded mode
(in-process, writing the memory index). Never imports the agent or the router.

Consistency: the translator's state is the truth; the index is written from it. When a write
fails (:class:`kvcore.index.errors.IndexUnavailable`), writes stop, events keep updating the
translator, and a maintenance task republishes the whole state (clear the worker, store the
snapshot) once the index answers again. With an index that has heartbeats (Redis), the same task
refreshes the worker's heartbeat every ``heartbeat_ttl_s / 3`` seconds (at most
``STATE_EVERY_S``), publishing :meth:`EventIngestor.state` with it so that the gateways' admin API
shows the agent's view, and republishes when the index lost the worker's entries (Redis restarted
or flushed, worker purged).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import zmq.asyncio

from kvcore.index.base import TIERS, KVIndex
from kvcore.index.errors import IndexUnavailable
from kvcore.kv_events.subscriber import EventSubscriber
from kvcore.kv_events.translate import EventTranslator, IndexOp
from kvcore.kv_events.wire import EventBatch

log = logging.getLogger("kvroute.kv_events")
STATE_EVERY_S = 1.0  # longest interval between heartbeats (each carries the ingest state)


@runtime_checkable
class SupportsApplyOps(Protocol):
    """An index that writes a run of store/remove ops in one round trip (Redis)."""

    async def apply_ops(self, worker: str, ops: Sequence[tuple[str, str, Sequence[int]]]) -> int: ...


@runtime_checkable
class SupportsHeartbeat(Protocol):
    """An index that forgets a worker whose writer stops heartbeating (Redis); each heartbeat may
    carry the writer's ingest state (a JSON-serialisable dict) for the gateways' admin API."""

    async def heartbeat(self, worker: str, ttl_s: float | None = None, mark_published: bool = False,
                        state: dict[str, Any] | None = None) -> bool: ...


_BATCHED: dict[type, bool] = {}  # isinstance() against a runtime Protocol is slow: cache per type


def _batched(index: KVIndex) -> bool:
    kind = type(index)
    hit = _BATCHED.get(kind)
    if hit is None:
        hit = _BATCHED[kind] = isinstance(index, SupportsApplyOps)
    return hit


async def write_ops(index: KVIndex, worker: str, ops: Sequence[IndexOp]) -> None:
    """Apply translator ops to ``index`` in order. ``clear`` drops the worker's entries in every
    tier (the memory index also drops its speculative entries; a batched index keeps the worker's
    heartbeat). Raises whatever the index raises (IndexUnavailable)."""
    if _batched(index):
        run: list[tuple[str, str, Sequence[int]]] = []
        for op, tier, keys in ops:
            if op != "clear":
                run.append((op, tier, keys))  # type: ignore[arg-type]
                continue
            if run:
                await index.apply_ops(worker, run)
                run = []
            for t in TIERS:
                await index.clear_worker(worker, t)
        if run:
            await index.apply_ops(worker, run)
        return
    for op, tier, keys in ops:
        if op == "store":
            await index.store(worker, tier, keys)  # type: ignore[arg-type]
        elif op == "remove":
            await index.remove(worker, tier, keys)  # type: ignore[arg-type]
        else:
            await index.clear_worker(worker)


class EventIngestor:
    """Keeps ``index`` in step with worker ``worker_id``'s KV events.

    ``events_url``/``replay_url``: vLLM's ``--kv-events-config`` endpoints as seen from here
    (``tcp://host:port``; replay optional). ``model``: served model name; ``block_size``: the
    engine's block size in tokens (both must match the gateway's, or keys never match).
    ``heartbeat_ttl_s``: liveness TTL for indexes with heartbeats. ``extra_state``: called for
    each :meth:`state`; its JSON-serialisable dict is merged in (the agent adds its tiers and peer
    pull figures there, so they reach the gateways with the heartbeats). Call :meth:`start` and
    :meth:`stop` from the event loop that should run it; :meth:`state` is for /admin.
    """

    def __init__(self, worker_id: str, events_url: str, replay_url: str | None, index: KVIndex, model: str,
                 block_size: int, *, topic: bytes = b"", heartbeat_ttl_s: float = 10.0,
                 replay_timeout_s: float = 2.0, ctx: zmq.asyncio.Context | None = None,
                 extra_state: Callable[[], dict[str, Any]] | None = None) -> None:
        self.worker_id = worker_id
        self.extra_state = extra_state
        self.index = index
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.translator = EventTranslator(model, block_size)
        self.subscriber = EventSubscriber(events_url, replay_url, self, topic=topic,
                                          replay_timeout_s=replay_timeout_s, ctx=ctx, name=worker_id)
        self._lock = asyncio.Lock()
        self._synced = False
        self._tasks: list[asyncio.Task[None]] = []
        self._index_down = False  # an index failure was logged and nothing succeeded since
        self.index_errors = 0
        self.republishes = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Clear whatever the index holds for this worker (left by an earlier run), then start
        subscribing. Does not raise when the index is down (it is published when it returns)."""
        await self._republish()
        self._tasks = [asyncio.create_task(self.subscriber.run(), name=f"kv-events-{self.worker_id}"),
                       asyncio.create_task(self._maintain(), name=f"kv-index-{self.worker_id}")]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """Log a task that stopped with an error (ERROR): nothing else would (a subscriber that
        cannot open its sockets ends at once, and the worker's events are no longer followed)."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s: %s stopped; this worker's KV events are no longer followed: %r",
                  self.worker_id, task.get_name(), task.exception())

    async def stop(self, purge: bool = False) -> None:
        """Stop subscribing; ``purge``: also drop the worker's index entries (best effort)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.subscriber.close()
        if purge:
            try:
                await self.index.clear_worker(self.worker_id)
            except IndexUnavailable as exc:
                log.warning("%s: could not purge index entries: %s", self.worker_id, exc)

    @property
    def running(self) -> bool:
        return any(not t.done() for t in self._tasks)

    # ---- sink ---------------------------------------------------------------------------------
    async def on_batch(self, seq: int, batch: EventBatch) -> None:
        async with self._lock:
            try:
                ops = self.translator.translate(batch)
            except Exception:  # a bug must not stop the stream: start this worker over
                log.exception("%s: failed to translate batch %d; resetting the worker", self.worker_id, seq)
                self.translator.reset()
                self._synced = False
                return
            if ops and self._synced:
                await self._write(ops)

    async def on_reset(self, reason: str) -> None:
        async with self._lock:
            self.translator.reset()
            if self._synced:
                await self._write([("clear", None, [])])

    # ---- index --------------------------------------------------------------------------------
    def _index_failed(self, what: str, exc: IndexUnavailable) -> None:
        """Count a failed index call and stop writing until a republish succeeds. Logged once
        per outage (WARNING); the retries of the same outage, every maintenance tick, at DEBUG."""
        self._synced = False
        self.index_errors += 1
        if self._index_down:
            log.debug("%s: %s: %s", self.worker_id, what, exc)
            return
        self._index_down = True
        log.warning("%s: %s; events still apply here, the state is republished when the index "
                    "answers: %s", self.worker_id, what, exc)

    async def _write(self, ops: Sequence[IndexOp]) -> None:
        try:
            await write_ops(self.index, self.worker_id, ops)
        except IndexUnavailable as exc:
            self._index_failed("index write failed", exc)

    async def restore_if_continuous(self) -> bool:
        """Publish this ingestor's view of the worker again (after the index was purged while
        the worker's HTTP side was down) when the event stream never broke meanwhile: still
        connected, with no disconnect since the last batch, so the same engine (and its cache)
        is there. Returns whether it did; False leaves the index to be rebuilt by new events."""
        if not self.subscriber.continuous:
            return False
        await self._republish()
        return self._synced

    async def _republish(self) -> None:
        async with self._lock:
            try:
                await self.index.clear_worker(self.worker_id)
                await write_ops(self.index, self.worker_id, self.translator.snapshot())
                if isinstance(self.index, SupportsHeartbeat):
                    state = self.state()  # as it is once this heartbeat succeeds
                    state.update(index_synced=True, republishes=self.republishes + 1)
                    await self.index.heartbeat(self.worker_id, self.heartbeat_ttl_s, mark_published=True, state=state)
            except IndexUnavailable as exc:
                self._index_failed("index unavailable, entries not published", exc)
                return
            if self.republishes:
                log.info("%s: republished %s blocks to the index", self.worker_id, self.translator.held_blocks())
            self.republishes += 1
            self._synced = True
            self._index_down = False

    async def _maintain(self) -> None:
        interval_s = max(0.05, min(self.heartbeat_ttl_s / 3, STATE_EVERY_S))
        while True:
            await asyncio.sleep(interval_s)
            if not self._synced:
                await self._republish()
                continue
            if not isinstance(self.index, SupportsHeartbeat):
                continue
            try:
                published = await self.index.heartbeat(self.worker_id, self.heartbeat_ttl_s, state=self.state())
            except IndexUnavailable as exc:
                self._index_failed("heartbeat failed", exc)
                continue
            if not published:
                log.warning("%s: the index lost this worker's entries; republishing", self.worker_id)
                await self._republish()

    # ---- admin --------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Per-worker ingest state for /admin: stream position and age, counters, blocks held by
        tier (as this ingestor knows them), whether the index is in step. JSON-serialisable."""
        sub = self.subscriber
        age = None if sub.last_batch_monotonic_s is None else round(time.monotonic() - sub.last_batch_monotonic_s, 3)
        out: dict[str, Any] = {
            "worker": self.worker_id, "events": sub.events_url, "replay": sub.replay_url,
            "last_event_unix_s": sub.last_batch_wall_s, "last_event_age_s": age,
            "index_synced": self._synced, "index_errors": self.index_errors,
            "republishes": self.republishes, "blocks": self.translator.held_blocks(),
        }
        out.update(sub.counters())
        out.update(self.translator.counters_dict())
        if self.extra_state is not None:
            out.update(self.extra_state())
        return out
