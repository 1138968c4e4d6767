"""Test helper: a stand-in for vLLM's ZmqEventPublisher that sends given payload bytes (e.g. the
real captured frames) on a real PUB socket and answers the replay protocol on a real ROUTER
socket, with knobs to drop a frame on the wire or shrink the replay buffer."""
from __future__ import annotations

import asyncio
import base64
from collections import deque

import zmq
import zmq.asyncio

from kvcore.kv_events.wire import REPLAY_END_SEQ, EventBatch, encode_batch, seq_bytes, seq_from_bytes


def capture_payloads(capture: dict) -> list[bytes]:
    """The msgpack payload frame of every captured ZMQ message, in order."""
    return [base64.b64decode(f["frames_b64"][2]) for f in capture["frames"]]


class ReplayPublisher:
    """PUB on ``tcp://127.0.0.1:pub_port`` and replay ROUTER on ``replay_port``; seq from 0."""

    def __init__(self, pub_port: int, replay_port: int | None, topic: bytes = b"kv@tiny",
                 buffer_steps: int = 10_000) -> None:
        self.ctx = zmq.asyncio.Context()
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.pub = self.ctx.socket(zmq.XPUB)  # a PUB that also hears subscriptions (see subscribed())
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.events_url = f"tcp://127.0.0.1:{pub_port}"
        self.replay_url = f"tcp://127.0.0.1:{replay_port}" if replay_port is not None else None
        self.router = None
        self._task = None
        if replay_port is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def subscribed(self, timeout_s: float = 10.0) -> None:
        """Wait until a subscriber's subscription has reached this socket (ZMQ drops what a PUB
        sends before that). Each call consumes one subscription message."""
        end = asyncio.get_running_loop().time() + timeout_s
        while True:
            left = end - asyncio.get_running_loop().time()
            if left <= 0 or not await self.pub.poll(left * 1000):
                raise AssertionError("no subscriber subscribed")
            msg = await self.pub.recv()
            if msg[:1] == b"\x01":
                return

    async def publish(self, payload: bytes, drop: bool = False) -> int:
        """Buffer ``payload`` under the next seq and send it (unless ``drop``); returns its seq."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    async def publish_batch(self, batch: EventBatch, drop: bool = False) -> int:
        return await self.publish(encode_batch(batch), drop)

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, start = frames[0], seq_from_bytes(frames[2])
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([ident, b"", self.topic, seq_bytes(seq), payload])
            await self.router.send_multipart([ident, b"", b"", seq_bytes(REPLAY_END_SEQ), b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()


async def until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate()`` (sync or async) every 20 ms; raise AssertionError after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
