"""The simulator's KV event publisher: vLLM 0.32's ``ZmqEventPublisher`` on the wire.

- ``--kv-events-config`` is vLLM's ``KVEventsConfig`` JSON (``enable_kv_cache_events``,
  ``publisher``, ``endpoint`` default ``tcp://*:5557``, ``replay_endpoint``, ``buffer_steps``
  default 10000, ``hwm`` default 100000, ``max_queue_size``, ``topic`` default "").
- PUB socket: bound when the endpoint has ``*`` or ``::`` or is ipc/inproc, else connected (so a
  collector may bind). Each batch is ``[topic, seq (8-byte big-endian, from 0), payload]`` with
  payload = msgpack ``[ts, [events...], data_parallel_rank]`` (:func:`kvcore.kv_events.wire.encode_batch`).
- Replay ROUTER socket (always bound): a DEALER's ``[b"", start_seq (8B)]`` gets one
  ``[b"", topic, seq, payload]`` per buffered batch with seq >= start_seq, then
  ``[b"", b"", seq -1, b""]``. Requests with another frame count are ignored, as in vLLM.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass

from kvcore.kv_events.wire import REPLAY_END_SEQ, EventBatch, KVCacheEvent, encode_batch, seq_bytes, seq_from_bytes


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields (``vllm/config/kv_events.py``) with vLLM's defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str | None) -> "KVEventsConfig":
        """Parse the ``--kv-events-config`` JSON object. Raises ValueError on bad JSON or an
        unknown field (vLLM rejects those too)."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {sorted(unknown)}")
        cfg = cls(**raw)
        if cfg.publisher is None:
            cfg.publisher = "zmq" if cfg.enable_kv_cache_events else "null"
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: unknown publisher {cfg.publisher!r}")
        return cfg

    @property
    def active(self) -> bool:
        """Whether events are published over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB + replay ROUTER sockets on the running asyncio loop. ``publish`` never blocks (a PUB
    drops at its high-water mark, as in vLLM). Call :meth:`start` inside the loop, :meth:`close`
    at shutdown."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq
        import zmq.asyncio

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, config.buffer_steps))
        self._seq = 0
        self._task: asyncio.Task | None = None

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def start(self) -> None:
        """Start answering replay requests (needs a running loop)."""
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        import zmq

        payload = encode_batch(EventBatch(ts=time.time() if ts is None else ts, events=events,
                                          data_parallel_rank=self.data_parallel_rank))
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
        return seq

    async def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start_raw = frames
            start = seq_from_bytes(start_raw)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart((ident, b"", self._topic, seq_bytes(seq), payload))
            await sock.send_multipart((ident, b"", b"", seq_bytes(REPLAY_END_SEQ), b""))

    def close(self) -> None:
        """Stop the replay task and close both sockets."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """The publisher for ``config`` (batches tagged ``data_parallel_rank``), or None when events
    are off (vLLM's null publisher)."""
    return ZmqEventPublisher(config, data_parallel_rank) if config.active else None
