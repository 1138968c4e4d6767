"""One vLLM server's KV event stream, delivered in order with every loss either repaired or
announced: ZMQ SUB for live batches, a DEALER on vLLM's replay socket for the missing ones.

Wire format: :mod:`kvcore.kv_events.wire` (``[topic, seq 8B big-endian, payload]``; replay request
``[b"", start seq 8B]``, answers ``[b"", topic, seq, payload]`` ending with seq -1).

What :class:`EventSubscriber` guarantees its sink (:class:`EventSink`):

- ``on_batch(seq, batch)`` is called for consecutive seqs of one publisher, each once;
- ``on_reset(reason)`` is called whenever that cannot hold (the sink must then forget the worker),
  and batches that follow start a new history. The sink's state is then a subset of the worker's
  real state (it may under-report, never over-report), until vLLM sends more events.

How:

- Start: subscribe, then ask the replay socket for everything from seq 0 (vLLM keeps its last
  ``buffer_steps`` batches), so an agent started after vLLM learns what is already cached. Start
  order does not matter: ZMQ reconnects until the publisher is up.
- Gap (a seq beyond last applied + 1): replay from the last applied seq. The first answer must be
  that seq with the same payload (its xxh3 fingerprint is kept), which proves it is the same
  publisher; the rest is applied. If the replay cannot cover it (the oldest buffered seq is past
  the wanted one, the payload differs, or no replay socket / no answer within
  ``replay_timeout_s``), the sink is reset and whatever the replay returned (or the live batch) is
  applied as the start of a new history.
- Publisher restart: seqs on the SUB socket only grow for one publisher, so a seq at or below the
  last one received on it means a new publisher (seq back to 0): reset, then catch up from 0. A
  restart can also hide behind a reconnect with seqs that keep growing; so after the SUB socket
  reports a disconnect, the next batch is checked against the replay socket as for a gap.
- Batches that arrive live after a replay already applied them are skipped (``duplicates``).
- An undecodable payload (not a batch at all) resets the sink (its events are lost). An event
  inside a batch that does not decode (a type we do not know, or a known one malformed) is left
  out and the rest of the batch applied (:func:`kvcore.kv_events.wire.decode_batch`); such events are
  counted by reason and type (``events_not_decoded``) and each type is logged once (WARNING) per
  subscriber.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from typing import Any, Protocol

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvcore.kv_events.wire import (REPLAY_END_SEQ, UNKNOWN_TYPE, EventBatch, EventDecodeError, SkippedEvent,
                                   decode_batch, seq_bytes, seq_from_bytes)

log = logging.getLogger("kvroute.kv_events")
_NOBLOCK, _EVENTS, _FD, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.FD), int(zmq.POLLIN)
SKIPPED_TYPES_KEPT = 32  # distinct event types counted by name per reason (the rest: OTHER_TYPES)
OTHER_TYPES = "(other)"


_contexts: dict[int, zmq.asyncio.Context] = {}  # pid -> this process's subscriber context


def default_context() -> zmq.asyncio.Context:
    """This process's ZMQ context for subscribers, made on first use (again after a fork) with its
    socket limit (``zmq.MAX_SOCKETS``) raised from libzmq's default to the process's open-file
    limit: each subscriber holds three sockets (SUB, its monitor and the monitor's peer), so under
    the default a gateway following a few hundred workers could not open the rest (their ingest
    tasks failed and those workers never subscribed). The open-file limit itself is first raised
    to the hard limit (at most 65,536) when it is lower. The limit can only be set before a
    context's first socket, hence a context of our own rather than ``Context.instance()``."""
    pid = os.getpid()
    ctx = _contexts.get(pid)
    if ctx is None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
        if soft != resource.RLIM_INFINITY and soft < want:  # e.g. 1,024: three sockets per worker
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                soft = want
            except (ValueError, OSError):
                log.warning("open-file limit %d (hard %s): a gateway can follow about %d workers' "
                            "KV events; raise it (ulimit -n)", soft, hard, soft // 4)
        ctx = zmq.asyncio.Context()
        ctx.set(zmq.MAX_SOCKETS, max(1023, soft if 0 < soft < 1 << 20 else 1 << 16))
        _contexts.clear()
        _contexts[pid] = ctx
    return ctx


def _set_done(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class EventSink(Protocol):
    """Receiver of an ordered event stream (see the module docstring)."""

    async def on_batch(self, seq: int, batch: EventBatch) -> None: ...

    async def on_reset(self, reason: str) -> None: ...


class EventSubscriber:
    """Subscribe to ``events_url`` (``tcp://host:port``), repair gaps through ``replay_url``
    (optional), deliver to ``sink``. ``topic``: SUB prefix filter (b"" = all). ``ctx``: the
    context to make sockets in (default :func:`default_context`).
    ``replay_timeout_s``: longest wait for each replay answer. Run :meth:`run` as a task;
    :meth:`close` stops it. Counters are plain attributes (see :meth:`counters`)."""

    def __init__(self, events_url: str, replay_url: str | None, sink: EventSink, *, topic: bytes = b"",
                 replay_timeout_s: float = 2.0, ctx: zmq.asyncio.Context | None = None, name: str = "") -> None:
        self.events_url = events_url
        self.replay_url = replay_url or None
        self.sink = sink
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.name = name or events_url
        self._ctx = ctx or default_context()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._suspect = False  # a disconnect happened: verify continuity at the next batch
        self._reconnect_pending = False  # set on a connect that follows a disconnect
        self._wake: asyncio.Future[None] | None = None  # what the run loop waits on, if it waits
        self._reader_fd: tuple[asyncio.AbstractEventLoop, int] | None = None  # the FD watched
        self.connected = False
        self.last_seq = -1  # last applied seq of the current history (-1: none)
        self._last_fingerprint: int | None = None
        self._sub_last: int | None = None  # last seq received on the SUB socket
        self.last_batch_wall_s: float | None = None  # wall clock of the last applied batch
        self.last_batch_monotonic_s: float | None = None
        self.batches_received = 0
        self.last_received_monotonic_s: float | None = None  # monotonic time of the last batch read
        self.batches_applied = 0
        self.gaps = 0
        self.replays = 0
        self.replay_failures = 0
        self.restarts = 0
        self.resyncs = 0
        self.duplicates = 0
        self.decode_errors = 0
        # reason ("unknown_type" | "malformed") -> event type -> events left out of their batch
        self.events_not_decoded: dict[str, dict[str, int]] = {}

    @property
    def continuous(self) -> bool:
        """Connected, and no disconnect seen since the last batch: the same publisher's history
        goes on (a restarted one would have dropped the connection)."""
        return self.connected and not self._suspect

    def counters(self) -> dict[str, Any]:
        """Stream counters and state for /admin (JSON-serialisable); ``events_not_decoded``:
        reason (``unknown_type``, ``malformed``) -> event type -> events left out of batches."""
        return {
            "connected": self.connected, "last_seq": self.last_seq,
            "batches_received": self.batches_received, "batches_applied": self.batches_applied,
            "gaps": self.gaps, "replays": self.replays, "replay_failures": self.replay_failures,
            "restarts": self.restarts, "resyncs": self.resyncs, "duplicates": self.duplicates,
            "decode_errors": self.decode_errors,
            "events_not_decoded": {reason: dict(by_type) for reason, by_type in self.events_not_decoded.items()},
        }

    # ---- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Subscribe and deliver until cancelled or :meth:`close` is called.

        Live batches are read without a future each: a plain socket on the same libzmq socket
        (``zmq.Socket.shadow``) takes every queued message with ``NOBLOCK``, and only when the
        queue is empty does the loop wait, on the socket's ``ZMQ_FD`` through the event loop's
        reader (:meth:`_wait_readable`)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.events_url)
        self._sub = sub
        reader = zmq.Socket.shadow(sub.underlying)  # the same socket, read without futures
        monitor_task = asyncio.create_task(self._watch_connection())
        try:
            if self.replay_url:
                await self._catch_up()
            while True:
                if self._reconnect_pending:
                    self._reconnect_pending = False
                    await self._verify_after_reconnect()
                if not reader.getsockopt(_EVENTS) & _POLLIN:  # also clears the FD's signal
                    await self._wait_readable(reader)
                    continue
                try:
                    frames = reader.recv_multipart(_NOBLOCK)
                except zmq.Again:
                    continue
                if len(frames) != 3:
                    log.warning("%s: ignoring a message with %d frames", self.name, len(frames))
                    continue
                await self._on_message(seq_from_bytes(frames[1]), frames[2])
        finally:
            monitor_task.cancel()
            self.close()

    async def _wait_readable(self, reader: zmq.Socket) -> None:
        """Return once ``reader``'s ``ZMQ_FD`` is signalled (a message may have come: the caller
        reads ``ZMQ_EVENTS`` first, which clears the signal) or a reconnect is pending. The FD
        stays watched between waits; signalled while nothing waits (a batch is being applied),
        it is unwatched at once, so the event loop does not spin on it, and watched again at the
        next wait."""
        if self._reconnect_pending:
            return
        loop = asyncio.get_running_loop()
        wake = loop.create_future()
        self._wake = wake
        if self._reader_fd is None:
            fd = reader.getsockopt(_FD)
            loop.add_reader(fd, self._on_readable)
            self._reader_fd = (loop, fd)
        try:
            await wake
        finally:
            self._wake = None

    def _on_readable(self) -> None:
        if self._wake is None:
            self._drop_reader()
        else:
            _set_done(self._wake)

    def _drop_reader(self) -> None:
        if self._reader_fd is not None:
            loop, fd = self._reader_fd
            self._reader_fd = None
            if not loop.is_closed():
                loop.remove_reader(fd)

    async def _verify_after_reconnect(self) -> None:
        """The publisher's socket came back after a disconnect: ask its replay buffer at once
        whether it is the same history (catch up on what the SUB socket missed) or a restarted
        publisher (start over from its buffer), rather than wait for its next live batch, which
        may be long in coming (an idle engine publishes nothing) or the very batch that was
        missed while the socket reconnected."""
        if not self.replay_url or self.last_seq < 0:
            return
        if await self._catch_up():
            self._suspect = False
            self._sub_last = self.last_seq

    def close(self) -> None:
        """Close the sockets (idempotent)."""
        self._drop_reader()
        if self._sub is not None:
            try:
                self._sub.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sub.close(0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None
        self.connected = False

    async def _watch_connection(self) -> None:
        mon = self._monitor
        while mon is not None:
            try:
                event = parse_monitor_message(await mon.recv_multipart())["event"]
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                if self._suspect:
                    self._reconnect_pending = True  # the run loop verifies the history at once
                    _set_done(self._wake)
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self._suspect = True

    # ---- stream logic -------------------------------------------------------------------------
    async def _on_message(self, seq: int, payload: bytes) -> None:
        self.batches_received += 1
        self.last_received_monotonic_s = time.monotonic()
        if self._sub_last is not None and seq <= self._sub_last:
            self.restarts += 1
            await self._reset(f"publisher restarted: seq {seq} after {self._sub_last}", routine=True)
        self._sub_last = seq
        suspect, self._suspect = self._suspect, False
        if not suspect:
            if seq == self.last_seq + 1:
                await self._apply(seq, payload)
                return
            if seq <= self.last_seq:
                self.duplicates += 1
                return
        if seq > self.last_seq + 1 and self.last_seq >= 0:
            self.gaps += 1
            # repaired by the replay below when it can; a loss it cannot repair logs a resync
            log.info("%s: gap: got seq %d after %d", self.name, seq, self.last_seq)
        answered = await self._catch_up() if self.replay_url else False
        if seq == self.last_seq + 1:
            await self._apply(seq, payload)
        elif seq <= self.last_seq:
            self.duplicates += 1
        else:
            if self.last_seq >= 0 or answered:
                await self._reset(f"seq {seq} cannot follow {self.last_seq} (no replay covers it)")
            await self._apply(seq, payload)

    async def _catch_up(self) -> bool:
        """Replay from the last applied seq (verifying it) or from 0; returns whether the replay
        socket answered."""
        start = max(self.last_seq, 0)
        items = await self._replay(start)
        if items is None:
            self.replay_failures += 1
            return False
        self.replays += 1
        if not items:
            if self.last_seq >= 0:
                # the publisher has neither our last batch nor any after it: a new history
                self.restarts += 1
                await self._reset(f"publisher restarted: its replay buffer ends before seq {start}", routine=True)
                return await self._catch_up()
            return True
        first_seq, first_payload = items[0]
        if self.last_seq >= 0:
            if first_seq == self.last_seq and xxhash.xxh3_64_intdigest(first_payload) == self._last_fingerprint:
                items = items[1:]
            elif first_seq == self.last_seq:
                # Same seq, other payload: a new publisher. Start over from its oldest batch.
                self.restarts += 1
                await self._reset(f"publisher restarted: payload at seq {first_seq} differs", routine=True)
                return await self._catch_up()
            else:
                await self._reset(f"replay cannot cover the gap: oldest replayed seq {first_seq} > wanted {start}")
        expected = None
        for seq, payload in items:
            if expected is not None and seq != expected:
                await self._reset(f"replay skipped from {expected} to {seq}")
            await self._apply(seq, payload)
            expected = seq + 1
        return True

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the replay socket for batches from ``start``; None when it does not answer."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_url)
        timeout_ms = int(self.replay_timeout_s * 1000)
        items: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", seq_bytes(start)])
            while True:
                if not await sock.poll(timeout_ms, zmq.POLLIN):
                    log.warning("%s: replay from %d: no answer from %s in %.1fs", self.name, start,
                                self.replay_url, self.replay_timeout_s)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    log.warning("%s: replay answered %d frames; ignoring the replay", self.name, len(frames))
                    return None
                seq = seq_from_bytes(frames[2])
                if seq == REPLAY_END_SEQ:
                    return items
                if seq >= start:
                    items.append((seq, frames[3]))
        finally:
            sock.close(0)

    def _count_skipped(self, seq: int, skipped: list[SkippedEvent]) -> None:
        """Count events left out of batch ``seq``; log each (reason, type) the first time. Past
        :data:`SKIPPED_TYPES_KEPT` types per reason the rest are counted as type ``"(other)"``."""
        for ev in skipped:
            by_type = self.events_not_decoded.setdefault(ev.reason, {})
            kind = ev.type if ev.type in by_type or len(by_type) < SKIPPED_TYPES_KEPT else OTHER_TYPES
            seen = by_type.get(kind, 0)
            by_type[kind] = seen + 1
            if not seen:
                if ev.reason == UNKNOWN_TYPE:
                    log.warning("%s: skipping KV events of unknown type %r (first at seq %d); the "
                                "batches' other events still apply", self.name, kind, seq)
                else:
                    log.warning("%s: skipping malformed %r KV events (first at seq %d): %s", self.name,
                                kind, seq, ev.error)

    async def _apply(self, seq: int, payload: bytes) -> None:
        skipped: list[SkippedEvent] = []
        try:
            batch = decode_batch(payload, skipped)
        except EventDecodeError as exc:
            self.decode_errors += 1
            await self._reset(f"undecodable batch at seq {seq}: {exc}")
            self.last_seq = seq
            self._last_fingerprint = xxhash.xxh3_64_intdigest(payload)
            return
        if skipped:
            self._count_skipped(seq, skipped)
        await self.sink.on_batch(seq, batch)
        self.last_seq = seq
        self._last_fingerprint = xxhash.xxh3_64_intdigest(payload)
        self.batches_applied += 1
        self.last_batch_wall_s = time.time()
        self.last_batch_monotonic_s = time.monotonic()

    async def _reset(self, reason: str, routine: bool = False) -> None:
        """Start the worker over (the sink forgets it). ``routine``: the publisher restarted (its
        cache is empty too: INFO); otherwise events were lost or unreadable and the index
        under-reports the worker until its blocks are stored again (WARNING)."""
        self.resyncs += 1
        self.last_seq = -1
        self._last_fingerprint = None
        log.log(logging.INFO if routine else logging.WARNING, "%s: resync: %s", self.name, reason)
        await self.sink.on_reset(reason)
