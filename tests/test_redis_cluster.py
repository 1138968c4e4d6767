"""The Redis index sharded over a real 3-shard Redis Cluster (kvcore.index.redis_cluster and
redis_cluster_mirror): partitions on every shard, the same answers as the memory index for random
ops (plain and mirrored, and a mirror following another client's writes), the encoding and layout
checks, a shard restart (of the meta shard, and of another) after which the agent's republish and
the mirror's reload give the truth again, and a shard losing its data with no outage (the partition
epochs make the agent republish and the mirror reload).

Each cluster is 3 ``redis-server --cluster-enabled yes`` on loopback (nothing persisted) joined by
``redis-cli --cluster create``; every wait polls a condition with a deadline, and the servers have
hard deadlines (``Proc``) and are stopped at teardown."""
from __future__ import annotations

import random
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import redis
from conftest import Proc, free_ports, kvroute_argv, wait_redis, wait_until
from kv_replay_publisher import ReplayPublisher, capture_payloads, until

from kvcore.block_keys import ENCODING_VERSION, block_keys
from kvcore.index.base import TierMatch
from kvcore.index.errors import IndexEncodingMismatch, IndexLayoutMismatch, IndexUnavailable
from kvcore.index.factory import make_index
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex
from kvcore.index.redis_cluster import PARTITIONS, RedisClusterIndex
from kvcore.index.redis_cluster_mirror import RedisClusterMirrorIndex
from kvcore.kv_events.ingest import EventIngestor

CLUSTER_DEADLINE_S = 300


class Cluster:
    """3 cluster-enabled redis-servers on loopback, their slots assigned by ``--cluster create``."""

    def __init__(self, root: Path, shards: int = 3) -> None:
        self.root = root
        self.exe = shutil.which("redis-server")
        assert self.exe and shutil.which("redis-cli"), "redis-server / redis-cli not on PATH"
        ports = free_ports(2 * shards)  # a client port and a cluster bus port each
        self.ports, self.bus = ports[:shards], dict(zip(ports[:shards], ports[shards:]))
        self.procs: dict[int, Proc] = {}
        for port in self.ports:
            self.start(port)
        run = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                              "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        self.wait_ok()

    def start(self, port: int) -> None:
        d = self.root / f"node-{port}"
        d.mkdir(exist_ok=True)
        p = Proc(f"redis-cluster-{port}-{len(self.procs)}", [
            self.exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--cluster-enabled", "yes",
            "--cluster-port", str(self.bus[port]),
            "--cluster-config-file", str(d / "nodes.conf"), "--save", "", "--appendonly", "no"],
            self.root, deadline_s=CLUSTER_DEADLINE_S)
        wait_redis(port, p)
        self.procs[port] = p

    def stop(self, port: int) -> None:
        self.procs[port].stop()

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def wait_ok(self, timeout_s: float = 30) -> None:
        def ok() -> bool:
            try:
                return all(self.client(p).execute_command("CLUSTER INFO")["cluster_state"] == "ok" for p in self.ports)
            except redis.RedisError:
                return False
        wait_until(ok, timeout_s, "cluster_state:ok on every node")

    def owner(self, slot: int) -> int:
        """The port of the node serving ``slot``."""
        for lo, hi, primary, *_ in self.client(self.ports[0]).execute_command("CLUSTER SLOTS"):
            if lo <= slot <= hi:
                return int(primary[1])
        raise AssertionError(f"slot {slot} unassigned")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[1]}/0"

    def close(self) -> None:
        for p in self.procs.values():
            p.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("rcluster"))
    yield c
    c.close()


def ns() -> str:
    return f"c{uuid.uuid4().hex[:8]}"


async def test_partitions_land_on_every_shard(cluster):
    idx = RedisClusterIndex(cluster.url, namespace=ns(), socket_timeout_s=5)
    try:
        await idx.open()
        keys = [random.getrandbits(64) for _ in range(2048)]
        await idx.store("w", "gpu", keys)
        by_node = idx.shard_of_partitions()
        assert {port for _, port in by_node} == set(cluster.ports)
        # the tags are spread over the slot space: the 3 equal slot ranges get 5 or 6 partitions each
        assert sorted(len(v) for v in by_node.values()) == [5, 5, 6]
        for part, prefix in enumerate(idx.part_prefixes):
            tag = prefix[1:prefix.index("}")]
            slot = cluster.client(cluster.ports[0]).execute_command("CLUSTER KEYSLOT", prefix + "b:x")
            assert slot == idx.part_slots[part]
            assert cluster.client(cluster.ports[0]).execute_command("CLUSTER KEYSLOT", tag) == slot
            owner = cluster.owner(slot)
            assert (("127.0.0.1", owner) in by_node) and part in by_node[("127.0.0.1", owner)]
            n = sum(1 for k in keys if k % PARTITIONS == part)  # block keys + owned set + seq, log, epochs
            assert cluster.client(owner).execute_command("CLUSTER COUNTKEYSINSLOT", slot) >= n
        sizes = {p: cluster.client(p).dbsize() for p in cluster.ports}
        assert all(s > 500 for s in sizes.values()), sizes
        assert sum(sizes.values()) >= 2048
        assert (await idx.match(keys)) == {"w": TierMatch(2048, 0, 0)}
    finally:
        await idx.close()


async def _answers(index, probes: list[list[int]]):
    return ([await index.match(p) for p in probes], [await index.gpu_holders(p[:40]) for p in probes],
            await index.stats())


async def test_random_ops_answer_as_the_memory_index_plain_mirror_and_a_following_mirror(cluster):
    rnd = random.Random(7)
    pool = [rnd.getrandbits(64) for _ in range(96)]
    workers = [f"w{i}" for i in range(5)]
    mem = MemoryIndex()
    plain = make_index({"backend": "redis", "cluster": True, "mirror": False, "url": cluster.url,
                        "namespace": ns(), "socket_timeout_s": 5})
    mirror_ns = ns()
    mirror = make_index({"backend": "redis", "cluster": True, "url": cluster.url, "namespace": mirror_ns,
                         "socket_timeout_s": 5})
    follower = RedisClusterMirrorIndex(f"redis://127.0.0.1:{cluster.ports[2]}/0", namespace=mirror_ns,
                                       socket_timeout_s=5)
    assert type(plain) is RedisClusterIndex and type(mirror) is RedisClusterMirrorIndex
    probes = [pool, pool[:30], pool[10:50]]
    try:
        await plain.open()
        await mirror.open()
        await follower.open()
        for step in range(160):
            w, tier = rnd.choice(workers), rnd.choice(["gpu", "gpu", "cpu", "ssd"])
            r = rnd.random()
            if r < 0.45:
                keys = pool[:rnd.randint(1, len(pool))] if rnd.random() < 0.6 else rnd.sample(pool, rnd.randint(1, 20))
                for idx in (mem, plain, mirror):
                    await idx.store(w, tier, keys)
            elif r < 0.75:
                keys = rnd.sample(pool, rnd.randint(1, 30)) + [rnd.getrandbits(64)]
                got = {await idx.remove(w, tier, keys) for idx in (mem, plain, mirror)}
                assert len(got) == 1, (step, got)
            elif r < 0.83:
                for idx in (mem, plain, mirror):
                    await idx.clear_worker(w, tier)
            elif r < 0.88:
                for idx in (mem, plain, mirror):
                    await idx.clear_worker(w)
            else:
                keys = pool[:rnd.randint(1, 50)]
                for idx in (mem, plain, mirror):
                    await idx.store_speculative(w, keys, ttl_s=600)
            if step % 8 == 7:
                want = await _answers(mem, probes)
                assert await _answers(plain, probes) == want, step
                assert await _answers(mirror, probes) == want, step
        want = await _answers(mem, probes)
        assert want[0][0], "the ops left something to match"
        await mirror.flush()

        async def follower_caught_up() -> bool:
            return await _answers(follower, probes) == want
        await until(follower_caught_up, timeout_s=10, what="the other client's mirror follows the writes")
        await until(lambda: follower.mirror_state()["partition_seqs"] == mirror.mirror_state()["partition_seqs"],
                    timeout_s=10, what="the follower applied every partition's log as far as the writer's mirror")
        state = follower.mirror_state()
        assert state["synced"] and follower.resyncs == 1 and follower.gaps == 0
        assert state["applied_seq"] == sum(state["partition_seqs"]) > 0
    finally:
        for idx in (plain, mirror, follower):
            await idx.close()


async def test_a_withdrawal_leaves_every_partition_of_the_mirrors_that_follow(cluster):
    rnd = random.Random(11)
    keys = [rnd.getrandbits(64) for _ in range(64)]  # spread over the partitions
    name = ns()
    opened = [RedisClusterMirrorIndex(cluster.url, namespace=name, socket_timeout_s=5) for _ in range(2)]
    a, b = opened

    async def holds(index, n: int) -> bool:
        return (await index.match(keys)).get("w") == (TierMatch(n, 0, 0) if n else None)
    try:
        for idx in opened:
            await idx.open()
        await a.store_speculative("w", keys, ttl_s=600)
        assert await a.flush(5)
        await until(lambda: holds(b, 64), timeout_s=10, what="the speculative entry in every partition of b")
        await a.drop_speculative("w", keys[16:])  # a refused request's keys past a held run of 16
        assert await holds(a, 16)
        assert await a.flush(5)
        await until(lambda: holds(b, 16), timeout_s=10, what="the withdrawal applied by every partition of b")
        c = RedisClusterMirrorIndex(cluster.url, namespace=name, socket_timeout_s=5)
        opened.append(c)
        await c.open()  # its bootstrap replays the logs' entries less the withdrawn keys
        await until(lambda: holds(c, 16), timeout_s=10, what="a new mirror's replay without the withdrawn keys")
        await until(lambda: holds(a, 16), timeout_s=10,
                    what="a, having read the log back, without the withdrawn keys")
        assert (await b.match(keys[16:])).get("w") is None
    finally:
        for idx in opened:
            await idx.close()


async def test_encoding_partitions_and_cluster_mode_mismatches_refuse(cluster, redis_url):
    name = ns()
    meta_port = cluster.owner(cluster.client(cluster.ports[0]).execute_command("CLUSTER KEYSLOT", f"{{{name}}}"))
    cluster.client(meta_port).set(f"{{{name}}}:meta:block_key_encoding", str(ENCODING_VERSION + 1))
    idx = RedisClusterIndex(cluster.url, namespace=name, socket_timeout_s=5)
    with pytest.raises(IndexEncodingMismatch, match="encoding mismatch") as exc:
        await idx.open()
    assert type(exc.value) is IndexEncodingMismatch and exc.value.stored == str(ENCODING_VERSION + 1)
    with pytest.raises(IndexEncodingMismatch):  # every call refuses too, until checked again
        await idx.match([1, 2])
    await idx.close()

    name = ns()
    first = RedisClusterIndex(cluster.url, namespace=name, socket_timeout_s=5)
    await first.open()
    await first.close()
    other = RedisClusterIndex(cluster.url, namespace=name, socket_timeout_s=5, partitions=8)
    with pytest.raises(IndexLayoutMismatch, match="partition count mismatch") as exc:
        await other.open()
    assert exc.value.stored == str(PARTITIONS) and exc.value.expected == 8
    with pytest.raises(IndexLayoutMismatch, match="partition count mismatch"):
        await other.store("w", "gpu", [1])
    await other.close()

    standalone = RedisIndex(cluster.url, namespace=ns(), socket_timeout_s=5)
    with pytest.raises(IndexLayoutMismatch, match="is a Redis Cluster node.*cluster: true"):
        await standalone.open()
    await standalone.close()
    on_standalone = RedisClusterIndex(redis_url, namespace=ns(), socket_timeout_s=5)
    with pytest.raises(IndexLayoutMismatch, match="not a Redis Cluster node"):
        await on_standalone.open()
    await on_standalone.close()


@pytest.mark.parametrize("shard", ["meta", "other"])
async def test_a_shard_restart_fails_lookups_then_the_agent_republishes_and_the_mirror_reloads(
        tmp_path, capture, shard):
    c = Cluster(tmp_path)
    index = reader = mirror = ing = pub = None
    try:
        name = ns()
        pub_port, replay_port = free_ports(2)
        pub = ReplayPublisher(pub_port, replay_port)
        kw = dict(namespace=name, retry_after_s=0.1, socket_timeout_s=0.5)
        index = RedisClusterIndex(c.url, heartbeat_ttl_s=0.6, **kw)
        reader = RedisClusterIndex(c.url, **kw)
        ing = EventIngestor("w0", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", index,
                            "tiny", 32, heartbeat_ttl_s=0.6, replay_timeout_s=0.5)
        payloads = capture_payloads(capture)
        steps = {s["name"]: s["tokenize_response"]["tokens"] for s in capture["steps"] if s.get("tokenize_response")}
        keys_a = block_keys(steps["completion_A"], 32, "tiny")
        keys_b = block_keys(steps["completion_B_evicts"], 32, "tiny")
        await ing.start()
        await until(lambda: ing.subscriber.connected)
        await pub.subscribed()
        await pub.publish(payloads[0])
        await until(lambda: ing.subscriber.last_seq == 0)
        assert (await reader.match(keys_a))["w0"] == TierMatch(18, 0, 0)
        mirror = RedisClusterMirrorIndex(c.url, poll_interval_s=0.1, stale_after_s=1.0, **kw)
        await mirror.open()
        assert await mirror.match(keys_a) == await reader.match(keys_a)
        # "meta": the shard holding the meta group (slot table, heartbeats, published markers,
        # encoding) and some of the prompt's partitions, the worst one to lose; "other": a shard
        # holding partitions only (the agent learns of the loss from the partition epochs)
        meta_port = c.owner(index.meta_slot)
        port = meta_port if shard == "meta" else next(p for p in c.ports if p != meta_port)
        lost_parts = [p for p, addr in enumerate(index._part_nodes) if addr[1] == port]
        assert {k % PARTITIONS for k in keys_a} & set(lost_parts)
        c.stop(port)

        async def unavailable(idx) -> bool:
            try:
                await idx.match(keys_a)
            except IndexUnavailable:
                return True
            return False
        await until(lambda: unavailable(reader), timeout_s=5, what="plain lookups raise IndexUnavailable")
        await until(lambda: unavailable(mirror), timeout_s=5, what="mirror lookups raise IndexUnavailable")
        await pub.publish(payloads[3])  # applied to the agent's state while a shard is down
        await until(lambda: ing.subscriber.last_seq == 1 and ing.index_errors >= 1, what="write failed")
        c.start(port)  # same port and nodes.conf (its slots), no data
        c.wait_ok()

        truth = MemoryIndex()  # the agent's view, as the memory index holds it
        for op in ing.translator.snapshot():
            if op[0] == "store":
                await truth.store("w0", op[1], op[2])
        want_a, want_b = await truth.match(keys_a), await truth.match(keys_b)
        assert want_a == {"w0": TierMatch(18, 0, 0)} and want_b == {"w0": TierMatch(16, 0, 0)}

        async def restored(idx) -> bool:
            try:
                return await idx.match(keys_a) == want_a and await idx.match(keys_b) == want_b
            except IndexUnavailable:
                return False
        await until(lambda: restored(reader), timeout_s=20, what="plain lookups give the truth again")
        await until(lambda: restored(mirror), timeout_s=20, what="the mirror gives the truth again")
        assert ing.state()["index_synced"] and ing.republishes >= 2
        if shard == "meta":  # the partitions on the shards that kept their data held the lost slot numbers
            assert index.partition_wipes >= len(index.part_prefixes) - len(lost_parts)
        else:  # the slot table survived: nothing to wipe
            assert index.partition_wipes == 0
        assert mirror.resyncs >= 2 and mirror.gaps >= 1
        assert await mirror.stats() == await reader.stats() == await truth.stats()
    finally:
        if ing is not None:
            await ing.stop()
        if pub is not None:
            await pub.close()
        for idx in (index, reader, mirror):
            if idx is not None:
                await idx.close()
        c.close()


def test_the_cluster_config_key_is_checked_by_the_config_and_the_factory():
    from pydantic import ValidationError

    from router.config.schema import IndexConfig
    assert IndexConfig(backend="redis", url="redis://h:1/0", cluster=True).model_dump()["cluster"] is True
    with pytest.raises(ValidationError, match="cluster must be true or false"):
        IndexConfig(backend="redis", cluster="yes")
    with pytest.raises(ValidationError, match="needs backend: redis"):
        IndexConfig(backend="memory", cluster=True)
    assert type(make_index({"backend": "memory", "cluster": False})) is MemoryIndex
    assert type(make_index({"backend": "redis", "cluster": False, "mirror": False})) is RedisIndex
    with pytest.raises(ValueError, match="has no cluster mode"):
        make_index({"backend": "memory", "cluster": True})
    with pytest.raises(ValueError, match="cluster must be true or false"):
        make_index({"backend": "redis", "cluster": 1})
    with pytest.raises(ValueError, match="bad arguments"):  # the mirror's options only with the mirror
        make_index({"backend": "redis", "cluster": True, "mirror": False, "poll_interval_s": 1})
    idx = make_index({"backend": "redis", "cluster": True, "namespace": "n", "partitions": 8})
    assert type(idx) is RedisClusterMirrorIndex and idx.partitions == 8 and len(idx.part_prefixes) == 8


async def test_a_shard_losing_its_data_between_heartbeats_makes_the_agent_republish(cluster, capture):
    """No outage seen by anyone: one shard loses this namespace's keys (as a restart between two
    heartbeats would); the agent's next heartbeat sees the partition epochs changed and republishes,
    and the mirror's poll sees them too and reloads."""
    name = ns()
    pub_port, replay_port = free_ports(2)
    pub = ReplayPublisher(pub_port, replay_port)
    index = RedisClusterIndex(cluster.url, namespace=name, heartbeat_ttl_s=0.6, socket_timeout_s=5)
    reader = RedisClusterIndex(cluster.url, namespace=name, socket_timeout_s=5)
    mirror = RedisClusterMirrorIndex(cluster.url, namespace=name, socket_timeout_s=5, poll_interval_s=0.1)
    ing = EventIngestor("w0", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", index,
                        "tiny", 32, heartbeat_ttl_s=0.6, replay_timeout_s=0.5)
    keys_a = block_keys(next(s for s in capture["steps"] if s["name"] == "completion_A")["tokenize_response"]
                        ["tokens"], 32, "tiny")
    try:
        await ing.start()
        await until(lambda: ing.subscriber.connected)
        await pub.subscribed()
        await pub.publish(capture_payloads(capture)[0])
        await until(lambda: ing.subscriber.last_seq == 0)
        await mirror.open()
        want = {"w0": TierMatch(18, 0, 0)}
        assert await reader.match(keys_a) == want and await mirror.match(keys_a) == want
        meta_port = cluster.owner(index.meta_slot)
        port = next(p for p in cluster.ports if p != meta_port)
        lost = {p for p, addr in enumerate(index._part_nodes) if addr[1] == port}
        assert {k % PARTITIONS for k in keys_a} & lost
        node = cluster.client(port)
        doomed = [k for k in node.scan_iter(match=f"{{{name}:p*", count=1000)]
        assert doomed
        for k in doomed:
            node.delete(k)
        republishes, resyncs = ing.republishes, mirror.resyncs

        async def restored(idx) -> bool:
            try:
                return await idx.match(keys_a) == want
            except IndexUnavailable:
                return False
        await until(lambda: ing.republishes > republishes, timeout_s=10, what="the agent republished")
        assert ing.index_errors == 0  # no write or heartbeat failed: the epochs told it
        await until(lambda: restored(reader), timeout_s=10, what="plain lookups give the truth again")
        await until(lambda: restored(mirror) if mirror.resyncs > resyncs else False, timeout_s=10,
                    what="the mirror reloaded and gives the truth again")
    finally:
        await ing.stop()
        await pub.close()
        for idx in (index, reader, mirror):
            await idx.close()


async def test_the_agent_writes_to_the_cluster_with_index_cluster_and_refuses_a_mismatched_mode(
        cluster, redis_url, procs):
    def agent(index_url: str, *extra: str) -> list[str]:
        return kvroute_argv("agent", "--worker-id", "wc", "--events", "tcp://127.0.0.1:1", "--index", index_url,
                            "--model", "tiny", "--block-size", "32", *extra)
    for argv, says in ((agent(cluster.url), "is a Redis Cluster node"),
                       (agent(redis_url, "--index-cluster"), "not a Redis Cluster node")):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and says in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    proc = procs("agent-cluster", agent(cluster.url, "--index-cluster", "--heartbeat-ttl-s", "2"))
    reader = RedisClusterIndex(cluster.url, namespace="kvr", socket_timeout_s=5)
    try:
        async def live() -> bool:
            assert proc.alive(), proc.log_tail()
            return "wc" in await reader.live_workers()
        await until(live, timeout_s=30, what="the agent's heartbeat in the cluster's meta group")
        assert (await reader.worker_states())["wc"]["index_synced"] is True
    finally:
        await reader.close()
