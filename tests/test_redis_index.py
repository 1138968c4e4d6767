"""What only the Redis backend has: heartbeat TTL, purge of a removed worker, IndexUnavailable
while Redis is down and recovery after, and the agent's state republished into a restarted Redis.
(The shared semantics are parametrized over both backends in test_index_memory.py.)"""
from __future__ import annotations

import asyncio
import shutil
import time
import uuid

import pytest
from conftest import free_port, free_ports, redis_argv, wait_redis
from kv_replay_publisher import ReplayPublisher, capture_payloads, until

from kvcore.block_keys import block_keys
from kvcore.index.base import TierMatch
from kvcore.index.errors import IndexUnavailable
from kvcore.index.redis import RedisIndex
from kvcore.kv_events.ingest import EventIngestor

K = list(range(500, 510))


@pytest.fixture
async def rindex(redis_url):
    idx = RedisIndex(redis_url, namespace=f"t{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=0.4, socket_timeout_s=5)
    yield idx
    await idx.close()


async def test_heartbeat_ttl_expiry_stops_a_worker_counting(rindex):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await rindex.store("dead", "gpu", K)  # a store heartbeats (TTL 0.4 s): "dead" counts until then
    await rindex.store("live", "gpu", K[:5])
    assert set(await rindex.match(K)) == {"dead", "live"}

    async def dead_expired() -> bool:  # only "live" keeps heartbeating
        assert await rindex.heartbeat("live") is False  # never marked as published
        return "dead" not in await rindex.match(K)
    await until(dead_expired, timeout_s=5, what='"dead" expired')
    assert loop.time() - t0 >= 0.4 - 0.01  # not before its TTL
    assert await rindex.match(K) == {"live": TierMatch(5, 0, 0)}
    assert await rindex.live_workers() == {"live"}
    await rindex.heartbeat("dead")  # its agent comes back: entries count again
    assert (await rindex.match(K))["dead"] == TierMatch(10, 0, 0)


async def test_an_expired_worker_drops_out_of_a_long_prompt_with_many_holder_changes(rindex):
    # 40 live workers, each its own prefix length (the matrix path: kvcore.index.chain_rows),
    # and one whose heartbeat lapses while it holds the whole prompt, past every live prefix
    prompt = list(range(1000, 1100))
    await rindex.store("dead", "gpu", prompt)
    for w in range(40):
        await rindex.store(f"w{w}", "gpu", prompt[:w + 10])
        await rindex.store(f"w{w}", "ssd", prompt[w + 10:w + 12])
    assert (await rindex.match(prompt))["dead"] == TierMatch(100, 0, 0)

    async def dead_expired() -> bool:
        for w in range(40):
            await rindex.heartbeat(f"w{w}")
        return "dead" not in await rindex.match(prompt)
    await until(dead_expired, timeout_s=5, what='"dead" expired')
    assert await rindex.match(prompt) == {f"w{w}": TierMatch(w + 10, 0, 2) for w in range(40)}


async def test_published_marker_tells_the_agent_to_republish(rindex):
    assert await rindex.heartbeat("w", mark_published=True) is False
    assert await rindex.heartbeat("w") is True
    await rindex.clear_worker("w")  # purged (or Redis lost it): the next heartbeat says so
    assert await rindex.heartbeat("w") is False


async def test_published_ingest_state_is_read_back_with_its_age_and_expires_with_the_heartbeat(rindex):
    state = {"worker": "w", "last_seq": 41, "gaps": 2, "replays": 1, "resyncs": 0, "last_event_age_s": 0.5,
             "blocks": {"gpu": 7, "cpu": 1, "ssd": 0}}
    assert await rindex.worker_states() == {}
    await rindex.heartbeat("w", ttl_s=30, state=state)
    await rindex.heartbeat("quiet", ttl_s=30)  # a heartbeat without a state publishes none
    await asyncio.sleep(0.1)
    got = await rindex.worker_states()
    assert list(got) == ["w"]
    w = got["w"]
    assert {k: w[k] for k in state if k != "last_event_age_s"} == {k: v for k, v in state.items() if k != "last_event_age_s"}
    # ages measured on Redis's clock: at least the 0.1 s slept since the heartbeat
    assert w["published_age_s"] >= 0.1
    assert w["last_event_age_s"] == pytest.approx(0.5 + w["published_age_s"], abs=0.002)
    await rindex.heartbeat("w", ttl_s=30)  # a heartbeat without a state keeps the last one
    assert (await rindex.worker_states())["w"]["last_seq"] == 41
    t0 = asyncio.get_running_loop().time()
    await rindex.heartbeat("w", ttl_s=0.2, state=dict(state, last_seq=42))
    assert (await rindex.worker_states())["w"]["last_seq"] == 42

    async def gone() -> bool:  # past the TTL the agent is gone, and so is its state
        return await rindex.worker_states() == {}
    await until(gone, timeout_s=5, what="the state expired")
    assert asyncio.get_running_loop().time() - t0 >= 0.2 - 0.01
    assert await rindex.live_workers() == {"quiet"}
    await rindex.heartbeat("w", ttl_s=30, state=state)
    assert list(await rindex.worker_states()) == ["w"]
    await rindex.clear_worker("w")  # a purge drops it at once
    assert await rindex.worker_states() == {}


async def test_a_reader_sees_a_worker_added_after_its_last_lookup(rindex, redis_url):
    reader = RedisIndex(redis_url, namespace=rindex.prefix[:-1], socket_timeout_s=5)
    try:
        assert await reader.match(K) == {}  # nothing yet: an empty slot table
        await rindex.store("a", "gpu", K[:3])
        assert await reader.match(K) == {"a": TierMatch(3, 0, 0)}
        await rindex.store("b", "cpu", K)  # a new slot: the reader's table is stale, the lookup notices
        assert await reader.match(K) == {"a": TierMatch(3, 0, 0), "b": TierMatch(0, 10, 0)}
        await rindex.store_speculative("c", K[:4], ttl_s=30)  # the writer's own guess, not the reader's
        assert "c" not in await reader.match(K)
        await reader.store_speculative("c", K[:4], ttl_s=30)
        await reader.store_speculative("a", K[3:5], ttl_s=30)  # a's speculative blocks extend its gpu run
        assert await reader.match(K) == {"a": TierMatch(5, 0, 0), "b": TierMatch(0, 10, 0), "c": TierMatch(4, 0, 0)}
        assert await reader.match([999] + K) == {}
    finally:
        await reader.close()


async def test_a_gpu_removal_drops_the_speculative_entry_too(rindex):
    await rindex.store_speculative("a", K[:4], ttl_s=30)
    await rindex.store("a", "gpu", K[:4])
    await rindex.remove("a", "gpu", K[2:4])  # evicted: the local guess goes with it
    assert await rindex.match(K) == {"a": TierMatch(2, 0, 0)}
    await rindex.apply_ops("a", [("remove", "cpu", K[:2])])  # another tier's removal leaves it
    await rindex.remove("a", "gpu", K[:2])
    assert "a" not in await rindex.match(K)


async def test_dropping_speculative_entries_keeps_what_redis_holds(rindex):
    await rindex.store("a", "gpu", K[:2])
    await rindex.store_speculative("a", K[:5], ttl_s=30)
    await rindex.store_speculative("b", K[:3], ttl_s=30)
    assert (await rindex.match(K))["a"] == TierMatch(5, 0, 0)
    await rindex.drop_speculative("a", K[:5])  # refused there: the local guess goes, Redis keeps its own
    assert await rindex.match(K) == {"a": TierMatch(2, 0, 0), "b": TierMatch(3, 0, 0)}


async def test_removing_a_worker_purges_its_keys(rindex):
    await rindex.store("a", "gpu", K)
    await rindex.store("a", "gpu", K[:2])
    await rindex.store("a", "cpu", K)
    await rindex.store("b", "gpu", K[:3])
    r = rindex._redis
    before = {k async for k in r.scan_iter(match=rindex.prefix + "*")}
    await rindex.clear_worker("a")
    after = {k async for k in r.scan_iter(match=rindex.prefix + "*")}
    slot_a = (await rindex._slot_table())["a"]
    assert not [k for k in after if k.decode(errors="replace").startswith(
        (f"{rindex.prefix}o:{slot_a}:", f"{rindex.prefix}rc:{slot_a}:", f"{rindex.prefix}hb:{slot_a}"))]
    bitmaps = [k for k in after if k.startswith((rindex.prefix + "b:").encode())]
    assert len(bitmaps) == 3  # only b's three blocks are left
    assert len(before) > len(after)
    await rindex.heartbeat("b")  # its TTL is 0.4 s: the scans above may outlast it on a busy server
    assert await rindex.match(K) == {"b": TierMatch(3, 0, 0)}


def _redis_server(procs, port: int):
    exe = shutil.which("redis-server")
    assert exe, "redis-server not on PATH"
    p = procs(f"redis-{port}-{time.monotonic_ns()}", redis_argv(exe, port))
    wait_redis(port, p)
    return p


async def test_redis_down_raises_index_unavailable_then_recovers(procs):
    port = free_port()
    server = _redis_server(procs, port)
    idx = RedisIndex(f"redis://127.0.0.1:{port}/0", retry_after_s=0.2, socket_timeout_s=0.3)
    try:
        await idx.store("w", "gpu", K)
        assert (await idx.match(K))["w"] == TierMatch(10, 0, 0)
        server.stop()
        with pytest.raises(IndexUnavailable):
            await idx.match(K)
        assert idx.available is False and idx.unavailable_errors == 1
        with pytest.raises(IndexUnavailable):  # fail-fast window: no new connection attempt
            await idx.store("w", "gpu", K)
        assert idx.unavailable_errors == 2
        _redis_server(procs, port)  # back, empty: usable again once the fail-fast window (0.2 s) is over

        async def recovered():
            try:
                return await idx.match(K) == {}
            except IndexUnavailable:
                return False
        await until(recovered, timeout_s=5, what="index usable again")
        assert idx.available is True
        other = RedisIndex(f"redis://127.0.0.1:{port}/0")
        await other.store("other", "gpu", K)  # takes slot 0 in the new Redis, which "w" had before
        await other.close()
        await idx.store("w", "gpu", K[:2])
        assert await idx.match(K) == {"w": TierMatch(2, 0, 0), "other": TierMatch(10, 0, 0)}
    finally:
        await idx.close()


async def test_agent_state_is_republished_into_a_restarted_redis(procs, capture):
    port, pub_port, replay_port = free_ports(3)
    server = _redis_server(procs, port)
    url = f"redis://127.0.0.1:{port}/0"
    pub = ReplayPublisher(pub_port, replay_port)
    index = RedisIndex(url, heartbeat_ttl_s=0.6, retry_after_s=0.1, socket_timeout_s=0.3)
    reader = RedisIndex(url, retry_after_s=0.1, socket_timeout_s=0.3)
    ing = EventIngestor("w0", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", index,
                        "tiny", 32, heartbeat_ttl_s=0.6, replay_timeout_s=0.5)
    payloads = capture_payloads(capture)
    tokens = next(s for s in capture["steps"] if s["name"] == "completion_A")["tokenize_response"]["tokens"]
    keys_a = block_keys(tokens, 32, "tiny")
    keys_b = block_keys(next(s for s in capture["steps"] if s["name"] == "completion_B_evicts")
                        ["tokenize_response"]["tokens"], 32, "tiny")
    try:
        await ing.start()
        await until(lambda: ing.subscriber.connected)
        await pub.subscribed()
        await pub.publish(payloads[0])
        await until(lambda: ing.subscriber.last_seq == 0)
        assert (await reader.match(keys_a))["w0"].gpu == 18
        server.stop()
        await pub.publish(payloads[3])  # applied to the agent's state while Redis is down
        await until(lambda: ing.subscriber.last_seq == 1 and ing.index_errors >= 1, what="write failed")
        _redis_server(procs, port)  # an empty Redis: the agent must publish everything again

        async def republished():
            try:
                return (await reader.match(keys_a)).get("w0") == TierMatch(18, 0, 0) and \
                    (await reader.match(keys_b)).get("w0") == TierMatch(16, 0, 0)
            except IndexUnavailable:
                return False
        await until(republished, timeout_s=10, what="republish")
        assert ing.state()["index_synced"] and ing.republishes >= 2
    finally:
        await ing.stop()
        await pub.close()
        await index.close()
        await reader.close()
