"""``kvroute agent`` as a real process: the captured vLLM frames on a local PUB socket end up in
Redis under the gateway's keys; a killed agent's worker stops counting after the heartbeat TTL; a
stopped agent purges its entries; bad arguments exit 2; an unknown event kind in a batch is skipped
and counted, and remote tier copies are not credited."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid

import pytest
from conftest import free_ports, kvroute_argv
from kv_replay_publisher import ReplayPublisher, capture_payloads, until

from kvcore.block_keys import BlockExtras, block_keys
from kvcore.index.base import TierMatch
from kvcore.index.redis import RedisIndex

BS = 32


def keys_of(capture, name: str, salt: str | None = None) -> list[int]:
    step = next(s for s in capture["steps"] if s["name"] == name)
    return block_keys(step["tokenize_response"]["tokens"], BS, "tiny", BlockExtras(cache_salt=salt))


@pytest.fixture
async def publisher():
    pub = ReplayPublisher(*free_ports(2))
    yield pub
    await pub.close()


def agent_argv(pub: ReplayPublisher, redis_url: str, worker: str, ttl_s: float = 1.0) -> list[str]:
    return kvroute_argv("agent", "--worker-id", worker,
                        "--events", pub.events_url, "--replay", pub.replay_url,
                        "--index", redis_url, "--model", "tiny", "--block-size", str(BS),
                        "--heartbeat-ttl-s", str(ttl_s))


async def test_agent_writes_the_gateway_keys_to_redis_and_stops_counting_when_killed(
        procs, redis_url, capture, publisher):
    worker = f"agent-{uuid.uuid4().hex[:6]}"
    reader = RedisIndex(redis_url, socket_timeout_s=5)
    payloads = capture_payloads(capture)
    try:
        for p in payloads[:3]:  # before the agent starts: it must catch up through replay
            await publisher.publish(p)
        agent = procs("agent", agent_argv(publisher, redis_url, worker, ttl_s=1.0))
        keys_a, keys_chat = keys_of(capture, "completion_A"), keys_of(capture, "chat_1")

        async def holds(keys, n):
            return (await reader.match(keys)).get(worker) == TierMatch(n, 0, 0)
        await until(lambda: holds(keys_a, 18), timeout_s=30, what=f"agent state in Redis\n{agent.log_tail()}")
        # the chat's batch follows completion_A's: applied in order, maybe a moment later
        await until(lambda: holds(keys_chat, 6), timeout_s=10, what=f"the chat's blocks\n{agent.log_tail()}")
        for p in payloads[3:6]:  # completion_B, its decode block, then eviction + salted prompt
            await publisher.publish(p)
        await until(lambda: holds(keys_of(capture, "completion_A", salt="tenant-1"), 18), timeout_s=20,
                    what="salted prompt")
        assert await holds(keys_a, 4)  # blocks 4..17 evicted
        assert await holds(keys_of(capture, "completion_B_evicts"), 16)
        stats = (await reader.stats())[worker]
        assert stats.blocks == {"gpu": 4 + 6 + 16 + 1 + 18, "cpu": 0, "ssd": 0}
        # the agent publishes its view with its heartbeats (gateways show it in /admin)

        async def published():
            st = (await reader.worker_states()).get(worker)
            return st is not None and st["last_seq"] == publisher.seq - 1
        await until(published, timeout_s=10, what="agent state in Redis")
        st = (await reader.worker_states())[worker]
        assert st["blocks"] == stats.blocks and st["index_synced"] is True
        # every batch applied, none lost for good (a frame sent before the subscription reached the
        # PUB socket would be a gap repaired by replay, so gaps is not pinned to 0)
        assert st["batches_applied"] == 6 and st["resyncs"] == 0 and st["gaps"] < st["replays"]
        agent.signal(signal.SIGKILL)
        agent.popen.wait(10)
        # nobody heartbeats any more: the worker stops counting when its last heartbeat's TTL
        # (1 s) runs out, not before (a kill purges nothing) and not long after
        await _expires_with_the_last_heartbeat(reader, keys_a, worker, ttl_s=1.0)
        assert worker not in await reader.live_workers()
        assert worker not in await reader.worker_states()  # its published state expired with it
    finally:
        await reader.close()


async def _absent(reader: RedisIndex, keys: list[int], worker: str) -> bool:
    return worker not in await reader.match(keys)


async def _expires_with_the_last_heartbeat(reader: RedisIndex, keys: list[int], worker: str, ttl_s: float) -> None:
    """For a worker whose agent is dead: its entries stop counting ``ttl_s`` after its last
    heartbeat (whose age Redis reports with the published state), within a polling margin."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    age = (await reader.worker_states())[worker]["published_age_s"]
    assert 0 <= age < ttl_s
    left = ttl_s - age  # the heartbeat key expires this long after t0, or a little later
    await until(lambda: _absent(reader, keys, worker), timeout_s=left + 10, what="TTL expiry")
    elapsed = loop.time() - t0
    assert elapsed >= left - 0.05, (age, elapsed)  # not before the TTL (no upper bound: the machine is shared)


async def test_stopped_agent_purges_its_entries(procs, redis_url, capture, publisher):
    worker = f"agent-{uuid.uuid4().hex[:6]}"
    reader = RedisIndex(redis_url, socket_timeout_s=5)
    try:
        await publisher.publish(capture_payloads(capture)[0])
        agent = procs("agent", agent_argv(publisher, redis_url, worker, ttl_s=30))
        keys_a = keys_of(capture, "completion_A")
        await until(lambda: _has(reader, keys_a, worker), timeout_s=30, what=f"agent up\n{agent.log_tail()}")
        agent.signal(signal.SIGTERM)
        assert agent.popen.wait(15) == 0
        assert await reader.match(keys_a) == {}
        assert worker not in await reader.stats()
    finally:
        await reader.close()


def test_a_stop_signal_after_the_stop_does_not_end_the_process_by_the_signal():
    """`kill` of a process group under `timeout` delivers SIGTERM twice (once direct, once
    forwarded); the second can come after the agent's loop closed, which put back the default
    handler: the agent then died by SIGTERM (-15) after a clean stop."""
    code = (
        "import asyncio, os, signal, sys\n"
        "from offload_agent.agent import _ignore_stop_signals, _stop_event_on_signals\n"
        "async def main():\n"
        "    stop = _stop_event_on_signals()\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    await asyncio.wait_for(stop.wait(), 30)\n"
        "    _ignore_stop_signals()\n"
        "asyncio.run(main())\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"  # after the loop closed
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('exited cleanly')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "exited cleanly\n"), r.stderr


async def _has(reader: RedisIndex, keys: list[int], worker: str) -> bool:
    return worker in await reader.match(keys)


@pytest.mark.parametrize("bad", [["--index", "memory"], ["--index", "redis://127.0.0.1:1/0", "--block-size", "0"]])
def test_bad_arguments_exit_2(bad):
    argv = kvroute_argv("agent", "--worker-id", "w", "--events", "tcp://127.0.0.1:1", "--index", "redis://x",
                        "--model", "tiny", "--block-size", "32") + bad
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "kvroute agent: error:" in r.stderr


async def test_agent_skips_an_unknown_event_type_and_credits_no_remote_tier(procs, redis_url, publisher):
    """A batch ``[BlockStored A, an unknown kind, BlockStored B, remote and local STORAGE copies]``
    from the worker: the agent writes A and B, credits only the local ssd copy, logs the unknown
    type once and publishes its count with the heartbeat."""
    import msgspec

    worker = f"agent-{uuid.uuid4().hex[:6]}"
    reader = RedisIndex(redis_url, socket_timeout_s=5)
    toks = list(range(700, 700 + 2 * BS))
    keys = block_keys(toks, BS, "tiny")

    def store(hashes, tokens, parent=None, medium="GPU", **extra):
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None, **extra}

    unknown = {"type": "BlockPinned", "block_hashes": [1]}
    batch = [store([1], toks[:BS]), unknown, store([2], toks[BS:], parent=1),
             store([1, 2], toks, medium="STORAGE", locality="REMOTE"),
             store([1], toks[:BS], medium="STORAGE", locality="LOCAL")]
    try:
        agent = procs("agent", agent_argv(publisher, redis_url, worker, ttl_s=5))
        await publisher.subscribed(timeout_s=30)
        await publisher.publish(msgspec.msgpack.encode([1.0, batch, 0]))
        await until(lambda: _has(reader, keys, worker), timeout_s=30, what=f"agent state\n{agent.log_tail()}")
        assert (await reader.match(keys))[worker] == TierMatch(2, 0, 0)
        gpu_removed = {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU"}
        await publisher.publish(msgspec.msgpack.encode([2.0, [unknown, gpu_removed], 0]))
        await until(lambda: _gpu_gone(reader, keys, worker), timeout_s=30, what="the GPU copies removed")
        assert (await reader.match(keys))[worker] == TierMatch(0, 0, 1)  # the local ssd copy of block 0
        await until(lambda: _skipped(reader, worker), timeout_s=30, what="the agent's published state")
        state = (await reader.worker_states())[worker]
        assert state["remote_events"] == 1 and state["blocks"] == {"gpu": 0, "cpu": 0, "ssd": 1}
        assert agent.log_path.read_text().count("skipping KV events of unknown type 'BlockPinned'") == 1
    finally:
        await reader.close()


async def _gpu_gone(reader: RedisIndex, keys: list[int], worker: str) -> bool:
    got = (await reader.match(keys)).get(worker)
    return got is not None and got.gpu == 0


async def _skipped(reader: RedisIndex, worker: str) -> bool:
    state = (await reader.worker_states()).get(worker) or {}
    return state.get("events_not_decoded") == {"unknown_type": {"BlockPinned": 2}}
