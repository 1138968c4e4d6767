"""EventIngestor over real ZMQ sockets: the captured vLLM frames replayed on a local PUB leave the
index in the state they describe; dropped frames are replayed; uncovered gaps and publisher
restarts resync the worker; start order does not matter. Both index backends."""
from __future__ import annotations

import uuid

import pytest
from conftest import free_ports
from kv_replay_publisher import ReplayPublisher, capture_payloads, until

from kvcore.block_keys import block_keys
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex
from kvcore.kv_events.ingest import EventIngestor

BS = 32


def keys_of(capture, name: str) -> list[int]:
    step = next(s for s in capture["steps"] if s["name"] == name)
    return block_keys(step["tokenize_response"]["tokens"], BS, "tiny")


@pytest.fixture(params=["memory", "redis"])
async def index(request):
    if request.param == "memory":
        yield MemoryIndex()
        return
    redis_url = request.getfixturevalue("redis_url")
    idx = RedisIndex(redis_url, namespace=f"t{uuid.uuid4().hex[:8]}", socket_timeout_s=5)
    yield idx
    await idx.close()


class Setup:
    """``replay_timeout_s``: 5 s by default, so that a loaded machine (the parallel suite keeps
    both cores busy) answers every replay that is answered at all; a test of a replay nobody
    answers passes a short one."""

    def __init__(self, index, replay: bool = True, buffer_steps: int = 10_000, replay_timeout_s: float = 5.0) -> None:
        self.index = index
        self.pub_port, self.replay_port = free_ports(2)
        self.replay = replay
        self.buffer_steps = buffer_steps
        self.pub: ReplayPublisher | None = None
        self.ingestor = EventIngestor("w0", f"tcp://127.0.0.1:{self.pub_port}",
                                      f"tcp://127.0.0.1:{self.replay_port}" if replay else None,
                                      index, "tiny", BS, replay_timeout_s=replay_timeout_s, heartbeat_ttl_s=5.0)

    def start_publisher(self) -> ReplayPublisher:
        self.pub = ReplayPublisher(self.pub_port, self.replay_port if self.replay else None,
                                   buffer_steps=self.buffer_steps)
        return self.pub

    async def connected(self) -> None:
        """The SUB socket connected, its subscription reached the PUB side, and the subscriber's
        start-up replay was answered (or failed): a batch published before that replay is
        answered would come through it, not live, and no gap would be seen."""
        sub = self.ingestor.subscriber
        await until(lambda: sub.connected, what="SUB connected")
        if self.pub is not None:
            await self.pub.subscribed()  # the subscription reaches the PUB side shortly after the connect
        if sub.replay_url:
            await until(lambda: sub.replays + sub.replay_failures >= 1, timeout_s=30, what="start-up replay")

    async def applied(self, seq: int) -> None:
        await until(lambda: self.ingestor.subscriber.last_seq >= seq, what=f"seq {seq} applied")

    async def close(self) -> None:
        await self.ingestor.stop()
        if self.pub is not None:
            await self.pub.close()


@pytest.fixture
async def setup_factory():
    made: list[Setup] = []

    def make(index, **kw) -> Setup:
        s = Setup(index, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


async def test_captured_frames_leave_the_index_in_the_state_they_describe(index, capture, setup_factory):
    payloads = capture_payloads(capture)
    s = setup_factory(index)
    pub = s.start_publisher()
    await s.ingestor.start()
    await s.connected()
    for p in payloads[:5]:
        await pub.publish(p)
    await s.applied(4)
    keys_a, keys_b = keys_of(capture, "completion_A"), keys_of(capture, "completion_B_evicts")
    match = await index.match(keys_a)
    assert match["w0"].gpu == 18
    assert (await index.match(keys_of(capture, "chat_2_multiturn")))["w0"].gpu == 6
    await pub.publish(payloads[5])  # evicts completion_A's blocks 4..17, stores the salted prompt
    await s.applied(5)
    assert (await index.match(keys_a))["w0"].gpu == 4
    assert (await index.match(keys_b))["w0"].gpu == 16
    await pub.publish(payloads[6])  # AllBlocksCleared, then completion_A again
    await s.applied(6)
    assert (await index.match(keys_a))["w0"].gpu == 18
    assert await index.match(keys_b) == {}
    assert (await index.stats())["w0"].blocks == {"gpu": 18, "cpu": 0, "ssd": 0}
    st = s.ingestor.state()
    assert st["last_seq"] == 6 and st["gaps"] == 0 and st["resyncs"] == 0 and st["clears"] == 1
    assert st["blocks"] == {"gpu": 18, "cpu": 0, "ssd": 0} and st["index_synced"]


async def test_dropped_frame_is_replayed(index, capture, setup_factory):
    payloads = capture_payloads(capture)
    s = setup_factory(index)
    pub = s.start_publisher()
    await s.ingestor.start()
    await s.connected()
    await pub.publish(payloads[0])
    await pub.publish(payloads[1], drop=True)  # lost on the wire, still in vLLM's replay buffer
    await pub.publish(payloads[2])
    await s.applied(2)
    st = s.ingestor.state()
    assert st["gaps"] == 1 and st["replays"] >= 2 and st["resyncs"] == 0
    assert (await index.match(keys_of(capture, "chat_1")))["w0"].gpu == 6
    assert (await index.match(keys_of(capture, "completion_A")))["w0"].gpu == 18


async def test_gap_replay_cannot_cover_resyncs_the_worker(index, capture, setup_factory):
    payloads = capture_payloads(capture)
    s = setup_factory(index, buffer_steps=1)
    pub = s.start_publisher()
    await s.ingestor.start()
    await s.connected()
    await pub.publish(payloads[0])  # completion_A
    await s.applied(0)
    await pub.publish(payloads[1], drop=True)
    await pub.publish(payloads[2], drop=True)
    await pub.publish(payloads[3])  # completion_B's 16 prompt blocks; the buffer keeps only this
    await s.applied(3)
    st = s.ingestor.state()
    assert st["gaps"] == 1 and st["resyncs"] == 1
    # the worker was cleared (completion_A gone: its later removals could be lost), then rebuilt
    # from what vLLM could still replay: under-reporting, never over-reporting
    assert await index.match(keys_of(capture, "completion_A")) == {}
    assert (await index.match(keys_of(capture, "completion_B_evicts")))["w0"].gpu == 16


async def test_publisher_restart_is_detected_and_the_worker_resynced(index, capture, setup_factory):
    payloads = capture_payloads(capture)
    s = setup_factory(index)
    pub = s.start_publisher()
    await s.ingestor.start()
    await s.connected()
    for p in payloads[:3]:
        await pub.publish(p)
    await s.applied(2)
    await pub.close()
    s.pub = None
    pub = s.start_publisher()  # vLLM restarted: empty cache, seq from 0
    await s.connected()
    await pub.publish(payloads[3])
    await until(lambda: s.ingestor.subscriber.restarts >= 1 and s.ingestor.subscriber.last_seq == 0,
                what="restart handled")
    st = s.ingestor.state()
    assert st["resyncs"] >= 1
    assert await index.match(keys_of(capture, "completion_A")) == {}
    assert await index.match(keys_of(capture, "chat_1")) == {}
    assert (await index.match(keys_of(capture, "completion_B_evicts")))["w0"].gpu == 16


async def test_restart_whose_first_batch_was_missed_is_found_at_reconnect(index, capture, setup_factory):
    """The restarted publisher's first batch goes out before the subscriber reconnects (lost on
    the SUB socket) and nothing follows: the reconnect itself asks the replay buffer, which tells
    a new history (it ends before our last seq), so the worker is resynced from it at once."""
    payloads = capture_payloads(capture)
    s = setup_factory(index)
    pub = s.start_publisher()
    await s.ingestor.start()
    await s.connected()
    for p in payloads[:3]:
        await pub.publish(p)
    await s.applied(2)
    await pub.close()
    s.pub = None
    await until(lambda: not s.ingestor.subscriber.connected, what="SUB disconnected")
    pub = s.start_publisher()
    await pub.publish(payloads[3])  # seq 0 of the new history, before anyone is subscribed: lost live
    await until(lambda: s.ingestor.subscriber.restarts >= 1 and s.ingestor.subscriber.last_seq == 0,
                what="restart found from the replay buffer")
    assert s.ingestor.subscriber.batches_received == 3  # the new batch came only through the replay
    assert await index.match(keys_of(capture, "completion_A")) == {}
    assert (await index.match(keys_of(capture, "completion_B_evicts")))["w0"].gpu == 16


async def test_agent_started_after_vllm_catches_up_through_replay(index, capture, setup_factory):
    payloads = capture_payloads(capture)
    s = setup_factory(index)
    pub = s.start_publisher()
    for p in payloads[:2]:
        await pub.publish(p)  # nobody listening yet
    await s.ingestor.start()
    await s.applied(1)
    assert (await index.match(keys_of(capture, "completion_A")))["w0"].gpu == 18
    assert (await index.match(keys_of(capture, "chat_1")))["w0"].gpu == 6
    await s.connected()
    await pub.publish(payloads[2])
    await s.applied(2)
    assert s.ingestor.state()["resyncs"] == 0


async def test_agent_started_before_vllm(index, capture, setup_factory):
    payloads = capture_payloads(capture)
    s = setup_factory(index, replay_timeout_s=0.5)
    await s.ingestor.start()  # nothing listening on either port yet
    sub = s.ingestor.subscriber
    # its catch-up asked the replay socket and got no answer (replay_timeout_s 0.5): vLLM not up
    await until(lambda: sub.replay_failures == 1, what="the catch-up's replay request timed out")
    assert (sub.connected, sub.replays, sub.last_seq) == (False, 0, -1)
    pub = s.start_publisher()
    await s.connected()
    await pub.publish(payloads[0])
    await s.applied(0)
    assert (await index.match(keys_of(capture, "completion_A")))["w0"].gpu == 18


async def test_without_replay_socket_a_gap_resyncs(capture, setup_factory):
    payloads = capture_payloads(capture)
    index = MemoryIndex()
    s = setup_factory(index, replay=False)
    pub = s.start_publisher()
    await s.ingestor.start()
    await s.connected()
    await pub.publish(payloads[0])
    await s.applied(0)
    await pub.publish(payloads[1], drop=True)
    await pub.publish(payloads[3])
    await s.applied(2)
    st = s.ingestor.state()
    assert st["gaps"] == 1 and st["resyncs"] == 1 and st["replays"] == 0
    assert await index.match(keys_of(capture, "completion_A")) == {}
    assert (await index.match(keys_of(capture, "completion_B_evicts")))["w0"].gpu == 16


async def test_a_subscriber_that_cannot_open_its_sockets_is_logged(caplog):
    """A context out of sockets (one allowed: the SUB opens, its monitor cannot) stops the
    subscriber task at once; the ingestor says so instead of leaving the worker silently
    unfollowed."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 1)
    port = free_ports(1)[0]
    ingestor = EventIngestor("w0", f"tcp://127.0.0.1:{port}", None, MemoryIndex(), "tiny", BS, ctx=ctx)
    try:
        with caplog.at_level("ERROR", logger="kvroute.kv_events"):
            await ingestor.start()
            await until(lambda: any("no longer followed" in r.getMessage() for r in caplog.records),
                        what="the failure logged")
        assert "kv-events-w0" in caplog.text
    finally:
        await ingestor.stop()
        ctx.destroy(linger=0)


async def test_batches_that_come_while_the_sink_is_busy_are_read_in_order_without_watching_the_socket():
    """The live socket is read without a future per message: a sink that holds the first batch
    while 40 more arrive gets them all, in order, once it lets go; while it holds, the socket's
    FD (signalled by the arrivals) is no longer watched, so the event loop does not spin on it."""
    import asyncio

    from kvcore.kv_events.wire import BlockRemoved, EventBatch
    from kvcore.kv_events.subscriber import EventSubscriber

    release = asyncio.Event()
    seen: list[tuple[int, list[int]]] = []

    class HoldingSink:
        async def on_batch(self, seq, batch):
            seen.append((seq, batch.events[0].block_hashes))
            if seq == 0:
                await release.wait()

        async def on_reset(self, reason):
            raise AssertionError(f"unexpected reset: {reason}")

    port = free_ports(1)[0]
    pub = ReplayPublisher(port, None)
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", None, HoldingSink())
    task = asyncio.create_task(sub.run())
    try:
        await until(lambda: sub.connected, what="SUB connected")
        await pub.subscribed()
        for i in range(41):
            await pub.publish_batch(EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[i], medium=None)]))
        await until(lambda: len(seen) == 1, what="the first batch delivered")
        await until(lambda: sub._reader_fd is None, what="the FD unwatched while the sink holds")
        release.set()
        await until(lambda: len(seen) == 41, what="all batches delivered")
        assert seen == [(i, [i]) for i in range(41)]
        assert sub.last_seq == 40 and sub.batches_applied == 41 and sub.duplicates == 0
        await pub.publish_batch(EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[99], medium=None)]))
        await until(lambda: len(seen) == 42, what="a batch after the queue drained")
        assert seen[-1] == (41, [99])
        assert sub._reader_fd is not None  # waiting again, on the FD
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()
    assert sub._reader_fd is None and sub._sub is None
