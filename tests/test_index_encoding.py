"""The block-key encoding version stored in the Redis index (issue 11): written when absent, accepted
when equal, refused with :class:`IndexEncodingMismatch` (naming both versions and the fix) when
different, at start-up (``open``) and on first use; checked again after Redis lost its data; the
agent exits 1 on it without writing anything. Real redis-server (the session's, one namespace or
database per test)."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import uuid

import pytest
import redis
from conftest import kvroute_argv

from kvcore.block_keys import ENCODING_VERSION
from kvcore.index import MemoryIndex
from kvcore.index.base import TierMatch
from kvcore.index.errors import IndexEncodingMismatch, IndexUnavailable
from kvcore.index.redis import RedisIndex

K = list(range(900, 908))
OTHER = str(ENCODING_VERSION + 1)


@pytest.fixture
def namespace() -> str:
    return f"enc{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sync_redis(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _keys(client: redis.Redis, namespace: str) -> set[bytes]:
    return set(client.scan_iter(match=f"{namespace}:*"))


async def test_absent_version_is_written_at_open(redis_url, sync_redis, namespace):
    idx = RedisIndex(redis_url, namespace=namespace, socket_timeout_s=5)
    try:
        await idx.open()
        assert sync_redis.get(f"{namespace}:meta:block_key_encoding") == str(ENCODING_VERSION).encode()
        assert idx.encoding_key == f"{namespace}:meta:block_key_encoding"
        await idx.store("w", "gpu", K)
        assert await idx.match(K) == {"w": TierMatch(8, 0, 0)}
    finally:
        await idx.close()


async def test_absent_version_is_written_on_first_use_without_open(redis_url, sync_redis, namespace):
    idx = RedisIndex(redis_url, namespace=namespace, socket_timeout_s=5)
    try:
        assert await idx.match(K) == {}  # a reader's first lookup
        assert sync_redis.get(f"{namespace}:meta:block_key_encoding") == str(ENCODING_VERSION).encode()
    finally:
        await idx.close()


async def test_same_version_is_accepted_and_left_alone(redis_url, sync_redis, namespace):
    key = f"{namespace}:meta:block_key_encoding"
    sync_redis.set(key, str(ENCODING_VERSION))
    writer = RedisIndex(redis_url, namespace=namespace, socket_timeout_s=5)
    reader = RedisIndex(redis_url, namespace=namespace, socket_timeout_s=5)
    try:
        await writer.open()
        await reader.open()
        await writer.store("w", "gpu", K)
        assert await reader.match(K) == {"w": TierMatch(8, 0, 0)}
        assert writer.encoding_error is None and reader.available
        assert sync_redis.get(key) == str(ENCODING_VERSION).encode()
    finally:
        await writer.close()
        await reader.close()


async def test_other_version_refuses_open_with_both_versions_and_the_fix(redis_url, sync_redis, namespace, caplog):
    key = f"{namespace}:meta:block_key_encoding"
    sync_redis.set(key, OTHER)
    idx = RedisIndex(redis_url, namespace=namespace, socket_timeout_s=5, retry_after_s=30)
    try:
        with caplog.at_level(logging.ERROR, logger="kvroute.index.redis"):
            with pytest.raises(IndexEncodingMismatch) as info:
                await idx.open()
        err = info.value
        assert isinstance(err, IndexUnavailable)  # running callers fall back as for an outage
        assert (err.stored, err.expected, err.key) == (OTHER, ENCODING_VERSION, key)
        msg = str(err)
        assert f"version {OTHER}" in msg and f"version {ENCODING_VERSION}" in msg
        assert key in msg and redis_url in msg
        assert "same kvroute release" in msg and f"--pattern '{namespace}:*'" in msg
        assert [r.levelno for r in caplog.records] == [logging.ERROR]
        # every later call says the same (not a plain outage), and writes nothing
        with pytest.raises(IndexEncodingMismatch):
            await idx.store("w", "gpu", K)
        with pytest.raises(IndexEncodingMismatch):
            await idx.match(K)
        assert idx.available is False and idx.encoding_error is not None
        assert _keys(sync_redis, namespace) == {key.encode()}
        assert sync_redis.get(key) == OTHER.encode()  # never overwritten
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1  # logged once
    finally:
        await idx.close()


async def test_other_version_refuses_the_first_call_without_open_and_recovers_once_fixed(
        redis_url, sync_redis, namespace):
    key = f"{namespace}:meta:block_key_encoding"
    sync_redis.set(key, OTHER)
    idx = RedisIndex(redis_url, namespace=namespace, socket_timeout_s=5, retry_after_s=0.1)
    try:
        with pytest.raises(IndexEncodingMismatch):
            await idx.store("w", "gpu", K)
        assert _keys(sync_redis, namespace) == {key.encode()}
        sync_redis.delete(key)  # the operator moved the namespace to this version
        await asyncio.sleep(0.15)  # past retry_after_s: checked again
        await idx.store("w", "gpu", K)
        assert await idx.match(K) == {"w": TierMatch(8, 0, 0)}
        assert idx.encoding_error is None and idx.available is True
        assert sync_redis.get(key) == str(ENCODING_VERSION).encode()
    finally:
        await idx.close()


async def test_version_is_checked_again_after_redis_lost_the_namespace(redis_url, sync_redis, namespace):
    """Redis restarted empty (or was flushed) and a process on another version wrote first: the
    agent notices at its next heartbeat (the published marker is gone), a gateway at its next
    lookup (the slot table's epoch changed)."""
    key = f"{namespace}:meta:block_key_encoding"
    agent = RedisIndex(redis_url, namespace=namespace, socket_timeout_s=5, retry_after_s=30)
    gateway = RedisIndex(redis_url, namespace=namespace, socket_timeout_s=5, retry_after_s=30)
    try:
        await agent.open()
        await gateway.open()
        await agent.store("w", "gpu", K)
        assert await agent.heartbeat("w", mark_published=True) is False  # first publication
        assert await agent.heartbeat("w") is True
        assert await gateway.match(K) == {"w": TierMatch(8, 0, 0)}
        sync_redis.delete(*_keys(sync_redis, namespace))
        # another worker's agent, on the other version, writes first
        sync_redis.set(key, OTHER)
        sync_redis.hset(f"{namespace}:slots", "x", 0)
        sync_redis.set(f"{namespace}:epoch", "2.0")
        assert await agent.heartbeat("w") is False  # the marker is gone: republish, check first
        with pytest.raises(IndexEncodingMismatch):
            await agent.clear_worker("w")
        with pytest.raises(IndexEncodingMismatch):
            await gateway.match(K)
    finally:
        await agent.close()
        await gateway.close()


async def test_memory_index_open_is_a_no_op():
    idx = MemoryIndex()
    await idx.open()
    await idx.store("w", "gpu", K)
    assert await idx.match(K) == {"w": TierMatch(8, 0, 0)}


def test_agent_exits_1_on_another_encoding_and_writes_nothing(redis_url):
    # a database of its own: the agent uses the default namespace, which other tests use in db 0
    url = redis_url.rsplit("/", 1)[0] + "/7"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
        client.set("kvr:meta:block_key_encoding", OTHER)
        argv = kvroute_argv("agent", "--worker-id", "w", "--events", "tcp://127.0.0.1:1", "--index", url,
                            "--model", "tiny", "--block-size", "32")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, r.stderr
        assert "not starting" in r.stderr and "encoding mismatch" in r.stderr
        assert f"version {OTHER}" in r.stderr and f"version {ENCODING_VERSION}" in r.stderr
        assert set(client.keys("*")) == {b"kvr:meta:block_key_encoding"}
    finally:
        client.flushdb()
        client.close()


def test_gateway_refuses_to_start_on_another_encoding(redis_url, tmp_path, tiny_model):
    """`kvroute serve` on a Redis index written by another encoding exits non-zero, naming both
    versions, and writes nothing."""
    import yaml

    from conftest import free_port

    url = redis_url.rsplit("/", 1)[0] + "/8"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
        client.set("kvr:meta:block_key_encoding", OTHER)
        cfg = {"listen": {"host": "127.0.0.1", "port": free_port()}, "index": {"backend": "redis", "url": url},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": 32}]}
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        r = subprocess.run(kvroute_argv("serve", "--config", str(path)), capture_output=True, text=True, timeout=120)
        assert r.returncode != 0
        out = r.stdout + r.stderr
        assert "encoding mismatch" in out and f"version {OTHER}" in out and f"version {ENCODING_VERSION}" in out
        assert set(client.keys("*")) == {b"kvr:meta:block_key_encoding"}
    finally:
        client.flushdb()
        client.close()
