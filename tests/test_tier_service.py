"""The agent as owner of the tiers (offload_agent/tier_service.py), without vLLM: two agents'
tier services over a real Redis index, driven through their Unix sockets exactly as the KV
connector drives them (offload_agent/agent_link.py), with blocks written into the shared CPU tier
as the connector writes them."""
from __future__ import annotations

import array
import asyncio
import contextlib
import hashlib
import itertools
import random
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest

from kvcore.block_keys import block_keys
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex
from offload_agent.agent_link import AgentLink, AgentLinkError
from offload_agent import tier_service
from offload_agent.peer.server import PeerServer
from offload_agent.tier_service import TierService
from offload_agent.tiers import TierFingerprint, TierStore, tier_block_keys, tier_root
from offload_agent.tiers.shm_slab import ShmSlab

BS = 4
FP = TierFingerprint(model="m", num_layers=2, dtype="bfloat16", block_size=BS, block_bytes=512)
BLOCK_BYTES = 512
PULL_BYTES = 64 * BLOCK_BYTES  # each worker shard's pull area (reserved whole: keep it small)


def hello(link: AgentLink) -> dict:
    return link.call({"op": "hello", "role": "worker", "pid": 1, "block_bytes": BLOCK_BYTES,
                      "fingerprint": asdict(FP), "fingerprint_digest": FP.digest().hex()})


def payload(i: int) -> bytes:
    return bytes([(i * 7 + j) % 251 for j in range(BLOCK_BYTES)])


async def run(tmp_path: Path, redis_url: str, body) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    idx = {w: RedisIndex(redis_url, namespace=ns, socket_timeout_s=5) for w in ("a", "b")}
    svc = {w: TierService(w, "tiny", BS, tmp_path / f"{w}.sock", tmp_path / f"{w}.shm", 64 * BLOCK_BYTES, idx[w],
                          serve=("127.0.0.1", 0), secret=b"s3cret", peer_pull_max_bytes=PULL_BYTES) for w in ("a", "b")}
    try:
        for s in svc.values():
            await s.start()
        await body(svc, idx)
    finally:
        for w in svc:
            await svc[w].stop()
            await idx[w].close()


def test_hello_makes_the_shared_cpu_tier_and_reuses_it(tmp_path: Path, redis_url: str) -> None:
    async def body(svc, idx):
        link = AgentLink(str(tmp_path / "a.sock"))
        answer = await asyncio.to_thread(hello, link)
        assert answer == {"ok": True, "worker_id": "a", "shm_path": str(tmp_path / "a.shm"), "num_slots": 64,
                          "ssd_dir": None, "ssd_tier_bytes": 0, "peer_pull": True,
                          "serves_peers": True, "pull_path": str(tmp_path / "a.shm-pull"), "pull_bytes": PULL_BYTES}
        shm = ShmSlab.attach(answer["shm_path"])
        assert (shm.num_slots, shm.block_bytes, shm.fingerprint_digest) == (64, BLOCK_BYTES, FP.digest())
        again = await asyncio.to_thread(hello, AgentLink(str(tmp_path / "a.sock")))  # the other side
        assert again["shm_path"] == answer["shm_path"]
        state = svc["a"].state()
        assert state["peer"]["serve"].startswith("127.0.0.1:") and state["peer"]["block_bytes"] == BLOCK_BYTES
        assert state["peer"]["fingerprint"] == FP.digest().hex()
        assert state["tiers"]["hellos"] == 2
        bad = await asyncio.to_thread(link.call, {"op": "pull", "peer": "b", "payload_bytes": 0})
        assert bad["ok"] and bad["blocks"] == 0 and "does not serve" in bad["error"]
        assert (await asyncio.to_thread(link.call, {"op": "what"}))["ok"] is False
        shm.close()
    asyncio.run(run(tmp_path, redis_url, body))


def test_b_locates_and_pulls_a_prefix_that_a_holds(tmp_path: Path, redis_url: str) -> None:
    tokens = [random.Random(5).randrange(1000) for _ in range(10 * BS + 2)]   # 10 full blocks
    tier_keys = tier_block_keys(tokens, BS, tier_root(FP.digest()))

    async def body(svc, idx):
        la, lb = AgentLink(str(tmp_path / "a.sock")), AgentLink(str(tmp_path / "b.sock"))
        a_info = await asyncio.to_thread(hello, la)
        await asyncio.to_thread(hello, lb)
        # A's connector computed the prompt: its 10 blocks in A's CPU tier slots 5..14 ...
        store = TierStore(None, 64, BLOCK_BYTES, FP, shm=ShmSlab.attach(a_info["shm_path"]))
        for i, k in enumerate(tier_keys):
            store.put(5 + i, k, payload(i))
        # ... and A's events put the index's block keys for A (its agent's ingestor does this)
        await idx["a"].store("a", "cpu", block_keys(tokens, BS, "tiny"))
        for w in ("a", "b"):
            await idx[w].heartbeat(w, 10.0, state=svc[w].state())
        toks = array.array("I", tokens[:10 * BS])

        def locate(first: int, n: int) -> dict:
            return lb.call({"op": "locate", "start_block": first, "max_blocks": n, "cache_salt": None},
                           memoryview(toks).cast("B")[:4 * (first + n) * BS])

        assert await asyncio.to_thread(locate, 0, 10) == {"ok": True, "peer": "a", "blocks": 10}
        assert await asyncio.to_thread(locate, 3, 7) == {"ok": True, "peer": "a", "blocks": 7}
        # A never asks itself
        self_loc = await asyncio.to_thread(la.call, {"op": "locate", "start_block": 0, "max_blocks": 10},
                                           memoryview(toks).cast("B"))
        assert self_loc == {"ok": True, "peer": None, "blocks": 0}

        out = bytearray(10 * BLOCK_BYTES)
        answer = await asyncio.to_thread(lb.call, {"op": "pull", "peer": "a", "deadline_ms": 5000},
                                         memoryview(b"".join(tier_keys)), None, memoryview(out))
        assert answer["ok"] and answer["blocks"] == 10 and answer["error"] is None
        assert answer["payload_bytes"] == 10 * BLOCK_BYTES
        assert bytes(out) == b"".join(payload(i) for i in range(10))
        # a slot overwritten with another block: the pull stops there (a prefix chain)
        store.put(5 + 4, b"\x01" * 16, payload(99))
        answer = await asyncio.to_thread(lb.call, {"op": "pull", "peer": "a", "deadline_ms": 5000},
                                         memoryview(b"".join(tier_keys)), None, memoryview(out))
        assert answer["blocks"] == 4 and answer["error"].startswith("miss")
        st = svc["b"].state()["peer"]
        assert st["pulls"] == 2 and st["pulled_blocks"] == 14 and st["failed_pulls"] == 1
        assert st["link_bytes_per_s"] is None and st["pull_overhead_ms"] > 0   # too small to measure a rate
        served = svc["a"].state()["peer"]["served"]
        assert served["blocks_served"] == served["blocks_lent"] == 14   # sent from the CPU tier in place
        assert served["torn"] == 0
    asyncio.run(run(tmp_path, redis_url, body))


def test_the_connector_side_fails_cleanly_without_an_agent(tmp_path: Path) -> None:
    link = AgentLink(str(tmp_path / "absent.sock"), timeout_s=0.5)
    with pytest.raises(AgentLinkError, match="absent.sock"):
        hello(link)


def test_a_restarted_agent_gets_the_hello_again_and_reuses_the_tier_file(tmp_path: Path, redis_url: str) -> None:
    async def main():
        idx = RedisIndex(redis_url, namespace=f"t{uuid.uuid4().hex[:8]}", socket_timeout_s=5)
        shm_path = tmp_path / "a.shm"

        def service() -> TierService:
            return TierService("a", "tiny", BS, tmp_path / "a.sock", shm_path, 64 * BLOCK_BYTES, idx,
                               peer_pull_max_bytes=PULL_BYTES)
        first = service()
        await first.start()
        link = AgentLink(str(tmp_path / "a.sock"))
        await asyncio.to_thread(hello, link)
        store = TierStore(None, 64, BLOCK_BYTES, FP, shm=ShmSlab.attach(shm_path))
        store.put(3, b"k" * 16, payload(3))
        await first.stop()                          # crashed or restarted: the file stays
        second = service()
        await second.start()
        try:
            assert second.shm is None               # no layout until a connector says hello
            # the connector's next request reconnects, says hello again first, then asks
            answer = await asyncio.to_thread(link.call, {"op": "locate", "start_block": 0, "max_blocks": 0})
            assert answer == {"ok": True, "peer": None, "blocks": 0}
            assert second.counters["hellos"] == 1 and second.shm.stable_slots() == [(3, b"k" * 16)]
            out = bytearray(BLOCK_BYTES)
            assert second.source.read_block(b"k" * 16, memoryview(out)) and bytes(out) == payload(3)
        finally:
            await second.stop()
            await idx.close()
    asyncio.run(main())


def test_connector_settings_for_the_agent(tmp_path: Path) -> None:
    from offload_agent.connector.config import TierSettings, kv_transfer_config

    cfg = kv_transfer_config(1 << 20, agent_socket=tmp_path / "a.sock", peer_pull_deadline_ms=250)
    extra = cfg["kv_connector_extra_config"]
    assert extra == {"cpu_tier_bytes": 1 << 20, "agent_socket": str((tmp_path / "a.sock").resolve()),
                     "peer_pull_deadline_ms": 250}
    st = TierSettings.from_extra(extra)
    assert (st.agent_socket, st.peer_pull_deadline_ms, st.agent_wait_s, st.peer_locate_timeout_ms,
            st.peer_pull_min_blocks, st.peer_connect_timeout_ms) == (extra["agent_socket"], 250.0, 10.0, 100.0, 4.0,
                                                                     1000.0)
    longer = TierSettings.from_extra({"cpu_tier_bytes": 1, "peer_connect_timeout_ms": 5000})
    assert longer.peer_connect_timeout_ms == 5000.0
    for bad in ({"peer_pull_deadline_ms": -1}, {"agent_wait_s": True}, {"peer_locate_timeout_ms": "x"},
                {"peer_connect_timeout_ms": -2}, {"agent_socket": 5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TierSettings.from_extra({"cpu_tier_bytes": 1, **bad})


def test_hello_fails_cleanly_when_the_tier_file_cannot_be_made(tmp_path: Path, redis_url: str) -> None:
    async def main():
        idx = RedisIndex(redis_url, namespace=f"t{uuid.uuid4().hex[:8]}", socket_timeout_s=5)
        svc = TierService("a", "tiny", BS, tmp_path / "a.sock", tmp_path / "missing" / "dir" / "a.shm",
                          64 * BLOCK_BYTES, idx)
        await svc.start()
        try:
            answer = await asyncio.to_thread(hello, AgentLink(str(tmp_path / "a.sock")))
            assert answer["ok"] is False and "hello" in answer["error"] and "No such file" in answer["error"]
            assert svc.shm is None      # the connector keeps asking, then runs local tiers
        finally:
            await svc.stop()
            await idx.close()
    asyncio.run(main())


def test_the_served_map_follows_slot_rewrites(tmp_path: Path) -> None:
    from offload_agent.tier_service import SlabSource

    owner = ShmSlab.create(tmp_path / "t.shm", FP.digest(), BLOCK_BYTES, 8)
    writer = ShmSlab.attach(tmp_path / "t.shm")
    source = SlabSource(owner, None)
    out = memoryview(bytearray(BLOCK_BYTES))
    k = [bytes([i]) * 16 for i in range(1, 6)]

    def put(slot: int, key: bytes | None, data: bytes = b"") -> None:
        writer.begin_write(slot)
        if data:
            writer.slot_view(slot)[:] = data
        writer.end_write(slot, key)

    put(2, k[0], payload(0))
    put(5, k[1], payload(1))
    assert source.read_block(k[0], out) and bytes(out) == payload(0)
    assert source.read_block(k[1], out) and bytes(out) == payload(1)
    put(2, k[2], payload(2))                     # slot 2 now holds another block
    assert not source.read_block(k[0], out)      # the old key is gone from the map
    assert source.read_block(k[2], out) and bytes(out) == payload(2)
    put(5, None)                                 # emptied
    assert not source.read_block(k[1], out)
    writer.begin_write(7)                        # mid-write: not served until finished
    writer.slot_view(7)[:] = payload(3)
    assert not source.read_block(k[3], out)
    writer.end_write(7, k[3])
    assert source.read_block(k[3], out) and bytes(out) == payload(3)
    assert source._slots == {k[2]: 2, k[3]: 7}
    # lent in place: the check says whether the slot changed since the lend
    view, unchanged = source.lend_block(k[2])
    assert bytes(view) == payload(2) and unchanged()
    assert source.lend_block(k[0]) is None       # not held
    writer.begin_write(2)                        # the owner starts rewriting the lent slot
    assert not unchanged() and source.lend_block(k[2]) is None
    writer.end_write(2, k[2])                    # same key again, but a new write: still changed
    assert not unchanged()
    again, unchanged_again = source.lend_block(k[2])
    assert unchanged_again()
    del view, again
    writer.close()
    owner.close()


def test_blocks_rewritten_while_lent_are_never_handed_on_torn(tmp_path: Path) -> None:
    """A writer thread rewrites the CPU tier's slots (same keys; each write fills a whole block with
    one byte value) while a real peer server lends them to a real client: every block handed on is
    one whole write, never a mix of two, and no pull fails its checksum (a slot that changed while
    sent is reported torn and asked for again; one that keeps changing ends the pull short)."""
    from offload_agent.peer.client import PeerClient
    from offload_agent.tier_service import SlabSource

    block_bytes, n = 256 << 10, 8
    owner = ShmSlab.create(tmp_path / "t.shm", FP.digest(), block_bytes, n)
    writer = ShmSlab.attach(tmp_path / "t.shm")
    keys = [bytes([i + 1]) * 16 for i in range(n)]
    fills = [bytes([v]) * block_bytes for v in range(1, 5)]

    def put(slot: int, version: int) -> None:
        writer.begin_write(slot)
        writer.slot_view(slot)[:] = fills[version % len(fills)]
        writer.end_write(slot, keys[slot])

    for slot in range(n):
        put(slot, 0)
    stop = threading.Event()
    rewrites = itertools.count()

    def rewrite() -> None:
        while not stop.is_set():
            i = next(rewrites)
            put(i % n, i)

    async def body() -> None:
        server, client = PeerServer(SlabSource(owner, None)), PeerClient()
        host, port = await server.start()
        handed: list[bool] = []  # per block handed on: whether it is one whole write
        kinds: list[str | None] = []
        thread = threading.Thread(target=rewrite, daemon=True)
        thread.start()
        try:
            # 20 pulls, and on until one block was handed on: a rewrite at every turn can make every
            # block of 20 pulls unstable on a busy host (none handed on, nothing checked)
            end = time.monotonic() + 60
            while len(kinds) < 20 or (not handed and time.monotonic() < end):
                res = await client.pull(f"{host}:{port}", FP.digest(), block_bytes, keys, 10.0,
                                        lambda i, data: handed.append(bytes(data).count(data[0]) == block_bytes),
                                        into=bytearray(n * block_bytes))
                kinds.append(res.kind)
        finally:
            stop.set()
            thread.join(10)
            await client.close()
            await server.close()
        assert handed and all(handed)                                       # one byte value per block
        assert "checksum" not in kinds and set(kinds) <= {None, "source", "miss"}, kinds
        assert server.stats()["blocks_served"] > 0 and next(rewrites) > 0

    asyncio.run(body())
    writer.close()
    owner.close()


# ---- one CPU tier file per KV shard (tensor and pipeline parallel) ---------------------------------
ENGINE = hashlib.blake2b(b"engine", digest_size=16).digest()


def shard_digest(pp: int, tp: int) -> bytes:
    return hashlib.blake2b(f"shard pp{pp} tp{tp}".encode(), digest_size=16).digest()


def shard_hello(link: AgentLink, role: str, tp: int = 0, tp_size: int = 2, pp: int = 0, pp_size: int = 1,
                digest: bytes | None = None) -> dict:
    """A connector's hello for shard (pp, tp) of an engine of tp_size x pp_size shards of BLOCK_BYTES."""
    return link.call({"op": "hello", "role": role, "pid": 1, "block_bytes": BLOCK_BYTES, "fingerprint": asdict(FP),
                      "fingerprint_digest": (digest or shard_digest(pp, tp)).hex(),
                      "shard": {"tp_rank": tp, "tp_size": tp_size, "pp_rank": pp, "pp_size": pp_size},
                      "engine_digest": ENGINE.hex(), "engine_block_bytes": BLOCK_BYTES * tp_size * pp_size})


def file_id(path: Path) -> tuple[int, bytes]:
    """Inode and header of a CPU tier file: both change when the file is made again."""
    return path.stat().st_ino, path.read_bytes()[:72]


@pytest.mark.parametrize("order", list(itertools.permutations(["scheduler", 0, 1])))
def test_each_tp_rank_gets_its_own_file_whatever_the_order_of_hellos(tmp_path: Path, order) -> None:
    files = {0: tmp_path / "a.shm", 1: tmp_path / "a.shm-pp0-tp1"}

    async def main():
        svc = TierService("a", "tiny", BS, tmp_path / "a.sock", files[0], 64 * BLOCK_BYTES, MemoryIndex(),
                          peer_pull_max_bytes=PULL_BYTES)
        await svc.start()
        made: dict[int, tuple[int, bytes]] = {}
        try:
            for who in order:
                link = AgentLink(str(tmp_path / "a.sock"))
                if who == "scheduler":
                    answer = await asyncio.to_thread(shard_hello, link, "scheduler")
                    # the scheduler is told shard (0, 0)'s file and makes none
                    assert (answer["ok"], answer["shm_path"], answer["num_slots"]) == (True, str(files[0]), 32)
                    assert files[0].exists() == (0 in made)
                else:
                    answer = await asyncio.to_thread(shard_hello, link, "worker", who)
                    assert (answer["ok"], answer["shm_path"], answer["num_slots"]) == (True, str(files[who]), 32)
                    made[who] = file_id(files[who])
                    writer = ShmSlab.attach(files[who])     # the rank's connector stores a block
                    writer.begin_write(who)
                    writer.slot_view(who)[:] = payload(who)
                    writer.end_write(who, bytes([who + 1]) * 16)
                    writer.close()
            for rank, path in files.items():
                shm = ShmSlab.attach(path)
                assert (shm.fingerprint_digest, shm.block_bytes, shm.num_slots) == (
                    shard_digest(0, rank), BLOCK_BYTES, 32)
                assert shm.stable_slots() == [(rank, bytes([rank + 1]) * 16)]   # never made again
                assert file_id(path)[0] == made[rank][0]
                shm.close()
            assert svc.counters["hellos"] == 3
            st = svc.state()
            assert st["peer"]["fingerprint"] == shard_digest(0, 0).hex()
            assert st["peer"]["engine_fingerprint"] == ENGINE.hex() and st["peer"]["block_bytes"] == 2 * BLOCK_BYTES
            assert st["peer"]["fingerprints"] == [shard_digest(0, 0).hex(), shard_digest(0, 1).hex()]
            assert [(s["pp_rank"], s["tp_rank"], s["shm"]) for s in st["tiers"]["shards"]] == [
                (0, 0, str(files[0])), (0, 1, str(files[1]))]
        finally:
            await svc.stop()
    asyncio.run(main())


def test_pipeline_stages_get_their_own_files_and_a_new_layout_remakes_only_its_shard(tmp_path: Path) -> None:
    async def main():
        svc = TierService("a", "tiny", BS, tmp_path / "a.sock", tmp_path / "a.shm", 64 * BLOCK_BYTES, MemoryIndex(),
                          peer_pull_max_bytes=PULL_BYTES, remove_on_exit=True)
        await svc.start()
        link = AgentLink(str(tmp_path / "a.sock"))
        try:
            for pp in (0, 1):
                answer = await asyncio.to_thread(shard_hello, link, "worker", 0, 1, pp, 2)
                assert answer["shm_path"] == str(tmp_path / ("a.shm" if pp == 0 else "a.shm-pp1-tp0"))
            assert answer["pull_path"] == str(tmp_path / "a.shm-pp1-tp0-pull")
            stage0, stage1 = file_id(tmp_path / "a.shm"), file_id(tmp_path / "a.shm-pp1-tp0")
            assert ShmSlab.attach(tmp_path / "a.shm-pp1-tp0").fingerprint_digest == shard_digest(1, 0)
            # stage 1 comes back with another layout: only its file is made again
            other = hashlib.blake2b(b"other", digest_size=16).digest()
            await asyncio.to_thread(shard_hello, link, "worker", 0, 1, 1, 2, other)
            assert file_id(tmp_path / "a.shm") == stage0 and file_id(tmp_path / "a.shm-pp1-tp0") != stage1
            assert ShmSlab.attach(tmp_path / "a.shm-pp1-tp0").fingerprint_digest == other
            assert svc.source_for(other) is svc.shards[(1, 0)].source and svc.source_for(shard_digest(1, 0)) is None
            bad = await asyncio.to_thread(link.call, {**{"op": "hello", "role": "worker", "block_bytes": 8,
                                                         "fingerprint_digest": other.hex()},
                                                      "shard": {"tp_rank": 2, "tp_size": 2, "pp_rank": 0, "pp_size": 1},
                                                      "engine_digest": ENGINE.hex(), "engine_block_bytes": 16})
            assert bad["ok"] is False and "tp 2/2" in bad["error"]
        finally:
            await svc.stop()
        assert not any(tmp_path.glob("a.shm*"))       # both tier files and both pull areas
    asyncio.run(main())


def test_each_tp_rank_pulls_its_own_shard_from_the_peer(tmp_path: Path, redis_url: str) -> None:
    tokens = [random.Random(7).randrange(1000) for _ in range(6 * BS)]
    tier_keys = tier_block_keys(tokens, BS, tier_root(ENGINE))

    def rank_payload(rank: int, i: int) -> bytes:
        return bytes([(rank * 101 + i * 7 + j) % 251 for j in range(BLOCK_BYTES)])

    async def body(svc, idx):
        for w in ("a", "b"):
            for rank in (1, 0):
                await asyncio.to_thread(shard_hello, AgentLink(str(tmp_path / f"{w}.sock")), "worker", rank)
        for rank in (0, 1):         # A's rank r holds its own heads of the prompt's blocks
            shm = ShmSlab.attach(svc["a"].shard_path(0, rank))
            for i, k in enumerate(tier_keys):
                shm.begin_write(i)
                shm.slot_view(i)[:] = rank_payload(rank, i)
                shm.end_write(i, k)
            shm.close()
        st = svc["a"].state()["peer"]
        assert st["fingerprints"] == [shard_digest(0, 0).hex(), shard_digest(0, 1).hex()]
        for w in ("a", "b"):
            await idx[w].heartbeat(w, 10.0, state=svc[w].state())
        links = {r: AgentLink(str(tmp_path / "b.sock")) for r in (0, 1)}   # each rank's own link
        for rank in (1, 0):
            await asyncio.to_thread(shard_hello, links[rank], "worker", rank)
            counts: list[int] = []
            got = await asyncio.to_thread(links[rank].pull, "a", tier_keys, shard_digest(0, rank), 5000,
                                          None, counts.append)
            assert (got.blocks, got.error, counts[-1]) == (6, None, 6) and counts == sorted(set(counts))
            assert bytes(got.view) == b"".join(rank_payload(rank, i) for i in range(6))
            assert bytes(links[rank].pull_area()[:6 * BLOCK_BYTES]) == bytes(got.view)   # read where it landed
        unknown = await asyncio.to_thread(links[0].call, {"op": "pull", "peer": "a", "stream": True,
                                                          "fingerprint_digest": shard_digest(0, 5).hex()},
                                          memoryview(b"".join(tier_keys)))
        assert unknown["ok"] is False and shard_digest(0, 5).hex() in unknown["error"]
        other = await asyncio.to_thread(links[0].pull, "a", tier_keys, shard_digest(0, 1), 5000)  # not its shard
        assert other == (0, "fingerprint_digest is not this link's shard (its hello's)", None)
        served = svc["a"].state()["peer"]["served"]
        assert served["blocks_served"] == served["blocks_lent"] == 12
    asyncio.run(run(tmp_path, redis_url, body))


def test_both_tp_ranks_first_pulls_at_once_each_get_their_shard(tmp_path: Path, redis_url: str) -> None:
    """Every rank of a TP engine pulls the same blocks in the same step: the first pulls of both
    ranks reach the agent together, before it knows its peers; both must find the peer (one
    refresh of the peer list, the other waiting for it) and get their own heads."""
    tokens = [random.Random(8).randrange(1000) for _ in range(6 * BS)]
    tier_keys = tier_block_keys(tokens, BS, tier_root(ENGINE))

    async def body(svc, idx):
        for w in ("a", "b"):
            for rank in (0, 1):
                await asyncio.to_thread(shard_hello, AgentLink(str(tmp_path / f"{w}.sock")), "worker", rank)
        for rank in (0, 1):
            shm = ShmSlab.attach(svc["a"].shard_path(0, rank))
            for i, k in enumerate(tier_keys):
                shm.begin_write(i)
                shm.slot_view(i)[:] = bytes([rank + 1]) * BLOCK_BYTES
                shm.end_write(i, k)
            shm.close()
        for w in ("a", "b"):
            await idx[w].heartbeat(w, 10.0, state=svc[w].state())
        links = {r: AgentLink(str(tmp_path / "b.sock")) for r in (0, 1)}
        for r in (0, 1):
            await asyncio.to_thread(shard_hello, links[r], "worker", r)
        got = await asyncio.gather(*(asyncio.to_thread(links[r].pull, "a", tier_keys, shard_digest(0, r), 5000)
                                     for r in (0, 1)))
        for r in (0, 1):
            assert (got[r].blocks, got[r].error) == (6, None)
            assert bytes(got[r].view) == bytes([r + 1]) * (6 * BLOCK_BYTES)
    asyncio.run(run(tmp_path, redis_url, body))


# ---- pulls streamed through the agent's pull area ----------------------------------------------------
class HeldSource:
    """A peer's BlockSource of ``blocks`` (key -> bytes); the read of key number ``hold_at`` waits
    for ``release`` (at most 30 s)."""

    def __init__(self, keys: list[bytes], hold_at: int | None = None, missing: int | None = None) -> None:
        self.fingerprint_digest = FP.digest()
        self.block_bytes = BLOCK_BYTES
        self.blocks = {k: payload(i) for i, k in enumerate(keys) if i != missing}
        self.hold_key = keys[hold_at] if hold_at is not None else None
        self.release = threading.Event()

    def read_block(self, key: bytes, out: memoryview) -> bool:
        if key == self.hold_key:
            self.release.wait(30)
        if key not in self.blocks:
            return False
        out[:] = self.blocks[key]
        return True


class PeerIndex(MemoryIndex):
    """An index whose only other worker is the peer ``p`` serving at ``addr``."""

    def __init__(self, addr: str) -> None:
        super().__init__()
        self.addr = addr

    async def worker_states(self) -> dict:
        return {"p": {"peer": {"serve": self.addr, "engine_fingerprint": FP.digest().hex()}}}


async def pull_rig(tmp_path: Path, source: HeldSource, body, **svc_kw) -> None:
    """Agent B (TierService, a worker's hello said) pulling from a bare PeerServer over ``source``."""
    server = PeerServer(source)
    host, port = await server.start()
    svc = TierService("b", "tiny", BS, tmp_path / "b.sock", tmp_path / "b.shm", 64 * BLOCK_BYTES,
                      PeerIndex(f"{host}:{port}"), **{"peer_pull_max_bytes": PULL_BYTES, **svc_kw})
    await svc.start()
    link = AgentLink(str(tmp_path / "b.sock"), timeout_s=10)
    try:
        assert (await asyncio.to_thread(hello, link))["ok"]
        await body(svc, link)
    finally:
        source.release.set()
        link.close()
        await svc.stop()
        await server.close()


def test_a_streamed_pull_lands_the_exact_blocks_into_the_callers_buffer(tmp_path: Path) -> None:
    keys = [bytes([i + 1]) * 16 for i in range(40)]

    async def body(svc, link):
        into = bytearray(40 * BLOCK_BYTES + 7)
        counts: list[int] = []
        got = await asyncio.to_thread(link.pull, "p", keys, FP.digest(), 5000, memoryview(into), counts.append)
        assert (got.blocks, got.error) == (40, None) and bytes(got.view) == b"".join(payload(i) for i in range(40))
        assert got.view.obj is into and into[-7:] == bytes(7)
        assert counts == [40]           # progress frames every 1 MiB: none for 20 KiB, the answer's count

        # a buffer too small (or read-only) is refused before asking the agent; the link still works
        small = await asyncio.to_thread(link.pull, "p", keys, FP.digest(), 5000, memoryview(bytearray(100)))
        assert small == (0, f"into: 100 bytes, 40 blocks need {40 * BLOCK_BYTES}", None)
        ro = await asyncio.to_thread(link.pull, "p", keys[:1], FP.digest(), 5000, memoryview(bytes(BLOCK_BYTES)))
        assert ro.blocks == 0 and "read-only" in ro.error
        again = await asyncio.to_thread(link.pull, "p", keys[:3], FP.digest(), 5000)
        assert again.blocks == 3 and bytes(again.view) == b"".join(payload(i) for i in range(3))
        assert svc.counters["pulls"] == 2 and svc.counters["pulled_blocks"] == 43
    asyncio.run(pull_rig(tmp_path, HeldSource(keys), body))


def test_a_streamed_pull_stops_at_the_first_missing_block(tmp_path: Path) -> None:
    keys = [bytes([i + 1]) * 16 for i in range(10)]

    async def body(svc, link):
        got = await asyncio.to_thread(link.pull, "p", keys, FP.digest(), 5000)
        assert got.blocks == 6 and got.error.startswith("miss: block 6 not held")
        assert bytes(got.view) == b"".join(payload(i) for i in range(6))
        assert svc.counters["failed_pulls"] == 1
        none = await asyncio.to_thread(link.pull, "q", keys, FP.digest(), 5000)   # no such peer
        assert none == (0, "peer 'q' does not serve this layout", None)
    asyncio.run(pull_rig(tmp_path, HeldSource(keys, missing=6), body))


def test_a_streamed_pull_keeps_what_came_by_its_deadline(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tier_service, "PROGRESS_EVERY_BYTES", 1)   # a progress frame per block
    keys = [bytes([i + 1]) * 16 for i in range(10)]
    source = HeldSource(keys, hold_at=4)

    async def body(svc, link):
        warm = await asyncio.to_thread(link.pull, "p", keys[:2], FP.digest(), 5000)   # the peer connection made
        assert warm.blocks == 2
        counts: list[int] = []
        got = await asyncio.to_thread(link.pull, "p", keys, FP.digest(), 1000, None, counts.append)
        assert got.blocks == 4 and got.error.startswith("deadline") and counts == [1, 2, 3, 4]   # as they came
        assert bytes(got.view) == b"".join(payload(i) for i in range(4))
        source.release.set()                # the peer's read ends; the next pull is served in full
        full = await asyncio.to_thread(link.pull, "p", keys, FP.digest(), 5000)
        assert (full.blocks, full.error) == (10, None)
    asyncio.run(pull_rig(tmp_path, source, body))


def test_a_pull_larger_than_the_pull_area_brings_what_fits(tmp_path: Path) -> None:
    keys = [bytes([i + 1]) * 16 for i in range(10)]

    async def body(svc, link):
        got = await asyncio.to_thread(link.pull, "p", keys, FP.digest(), 5000)
        assert got.blocks == 3 and got.error == "room: the pull area holds 3 blocks of 10"
        assert bytes(got.view) == b"".join(payload(i) for i in range(3))
        assert link.hello_answer["pull_bytes"] == 3 * BLOCK_BYTES + 100
    asyncio.run(pull_rig(tmp_path, HeldSource(keys), body, peer_pull_max_bytes=3 * BLOCK_BYTES + 100))


def test_a_pull_area_that_cannot_be_made_turns_peer_pull_off_for_its_shard(tmp_path: Path) -> None:
    async def main():
        (tmp_path / "a.shm-pull").mkdir()            # in the way: the area cannot be made there
        svc = TierService("a", "tiny", BS, tmp_path / "a.sock", tmp_path / "a.shm", 64 * BLOCK_BYTES, MemoryIndex(),
                          peer_pull_max_bytes=PULL_BYTES)
        await svc.start()
        link = AgentLink(str(tmp_path / "a.sock"))
        try:
            answer = await asyncio.to_thread(hello, link)
            assert answer["ok"] and answer["peer_pull"] is False and "pull_path" not in answer
            assert ShmSlab.attach(answer["shm_path"]).num_slots == 64       # the CPU tier is there all the same
            got = await asyncio.to_thread(link.pull, "b", [b"k" * 16], FP.digest(), 1000)
            assert got == (0, "no pull area (peer pull is off, or the area could not be reserved)", None)
            rank1 = await asyncio.to_thread(shard_hello, AgentLink(str(tmp_path / "a.sock")), "worker", 1)
            # its own area is fine, as large as its CPU tier (32 slots) where that is below PULL_BYTES
            assert rank1["peer_pull"] is True and rank1["pull_bytes"] == 32 * BLOCK_BYTES
        finally:
            await svc.stop()
    asyncio.run(main())


class Gate:
    """A real listening socket in front of a peer's server: while ``answering`` it relays each
    connection to the peer; while not (a peer that died behind a socket the kernel still accepts
    on, or hung) it takes connections and never answers. Counts the connections it took."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.answering, self.connections = target, True, 0
        self._held: list[asyncio.StreamWriter] = []
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if not self.answering:
            self._held.append(writer)       # silent until the test ends
            return
        up_r, up_w = await asyncio.open_connection(*self.target)

        async def relay(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()
        await asyncio.gather(relay(reader, up_w), relay(up_r, writer))

    async def close(self) -> None:
        for w in self._held:
            w.close()
        self._server.close()


@contextlib.asynccontextmanager
async def gated_agent(tmp_path: Path, keys: list[bytes], connect_timeout_s: float | None = None):
    """Agent "b" (a :class:`TierService` with a link to it) whose one peer "p" is a PeerServer
    holding ``keys`` behind a :class:`Gate`; yields ``(svc, link, gate, addr)``, all stopped after."""
    server = PeerServer(HeldSource(keys))
    gate = Gate(await server.start())
    addr = await gate.start()
    svc = TierService("b", "tiny", BS, tmp_path / "b.sock", tmp_path / "b.shm", 64 * BLOCK_BYTES,
                      PeerIndex(addr), peer_pull_max_bytes=PULL_BYTES)
    if connect_timeout_s is not None:
        svc.client.connect_timeout_s = connect_timeout_s
    await svc.start()
    link = AgentLink(str(tmp_path / "b.sock"), timeout_s=30)
    try:
        yield svc, link, gate, addr
    finally:
        link.close()
        await svc.stop()
        await gate.close()
        await server.close()


async def until(cond, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_peer_that_stops_answering_is_skipped_for_a_growing_back_off_then_retried(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """After a pull from a peer that stopped answering waited out its deadline, the next pulls from
    it are answered at once (the breaker: no connection is even tried) until the back-off ends; the
    pull after it is tried again, a second failure doubles the back-off, and a pull that brings
    blocks closes the breaker. A locate does not offer a peer being skipped."""
    monkeypatch.setattr(tier_service, "PEERS_TTL_S", 0.0)
    monkeypatch.setattr(tier_service, "BREAKER_FIRST_S", 60.0, raising=False)   # open for the whole first part
    deadline_ms = 2000
    keys = [bytes([i + 1]) * 16 for i in range(4)]

    async def main():
        # the agent's own connect bound is long: the handshake waits for the whole deadline
        async with gated_agent(tmp_path, keys, connect_timeout_s=30.0) as (svc, link, gate, addr):
            tokens = list(range(100, 100 + 4 * BS))
            svc.index.store_sync("p", "cpu", block_keys(tokens, BS, "tiny"))   # the peer holds the prompt

            def locate() -> dict:
                return link.call({"op": "locate", "start_block": 0, "max_blocks": 4, "cache_salt": None},
                                 memoryview(array.array("I", tokens)).cast("B"))

            async def pull():
                t0 = time.monotonic()
                got = await asyncio.to_thread(link.pull, "p", keys, FP.digest(), deadline_ms)
                return got, time.monotonic() - t0

            assert (await asyncio.to_thread(hello, link))["ok"]
            assert await asyncio.to_thread(locate) == {"ok": True, "peer": "p", "blocks": 4}
            got, _ = await pull()
            assert (got.blocks, got.error) == (4, None)
            gate.answering = False
            await svc.client.close()                # the kept connection goes: the next pull connects again
            got, waited = await pull()              # the first pull from the dead peer waits its deadline
            assert got.blocks == 0 and got.error.startswith("deadline") and waited >= deadline_ms / 1000 * 0.9
            tried = gate.connections
            for _ in range(5):                      # skipped: answered at once, no connection tried
                got, took = await pull()
                assert took < deadline_ms / 1000 / 2 and got.blocks == 0
                assert got.error.startswith("breaker: peer 'p' skipped for ")
            assert gate.connections == tried
            st = svc.breaker.state()["p"]
            assert st["failures"] == 1 and st["addr"] == addr and not st["trying"] and st["open_s"] > 20
            assert svc.counters["breaker_opens"] == 1 and svc.counters["breaker_skips"] == 5
            assert svc.counters["failed_pulls"] == 1 + 5
            assert svc.state()["peer"]["breakers"]["p"]["failures"] == 1
            assert await asyncio.to_thread(locate) == {"ok": True, "peer": None, "blocks": 0}   # not offered

            skew = [0.0]                            # the back-off ends (its clock moved past it) ...
            svc.breaker.clock = lambda: time.monotonic() + skew[0]
            svc.breaker.first_s, svc.breaker.max_s = 0.25, 0.5
            skew[0] = 61.0
            assert svc.breaker.state()["p"]["open_s"] == 0
            got, waited = await pull()              # ... so the next pull is tried again, and fails again
            assert got.error.startswith("deadline") and gate.connections == tried + 1
            st = svc.breaker.state()["p"]
            assert st["failures"] == 2 and 0 < st["open_s"] <= 0.5   # doubled (0.25 x 2), here capped at 0.5
            assert svc.counters["breaker_opens"] == 2

            gate.answering = True                   # the peer is back: after the back-off a pull brings it all
            await until(lambda: svc.breaker.state()["p"]["open_s"] == 0)
            await svc.client.close()
            got, _ = await pull()
            assert (got.blocks, got.error) == (4, None)
            assert svc.breaker.state() == {} and svc.counters["breaker_skips"] == 5
            assert await asyncio.to_thread(locate) == {"ok": True, "peer": "p", "blocks": 4}
    asyncio.run(main())


def test_the_breaker_counts_only_failures_that_blame_the_peer() -> None:
    now = [100.0]
    b = tier_service.PeerBreaker(first_s=1.0, max_s=4.0, clock=lambda: now[0])
    assert b.allow("p", "h:1") is None
    for kind in ("miss", "busy", "refused", "checksum", "protocol", "auth", "source", None):   # alive: not remembered
        assert not b.record("p", "h:1", 0, kind) and b.state() == {}
    assert not b.record("p", "h:1", 3, "deadline")      # blocks came: alive
    opens = [b.record("p", "h:1", 0, "connection") for _ in range(4)]
    assert opens == [True] * 4 and b.state()["p"]["open_s"] == 4.0   # 1, 2, 4, 4 (capped)
    assert b.allow("p", "h:1") == 4.0 and b.is_open("p")
    now[0] += 4.0
    assert b.allow("p", "h:1") is None                   # the retry goes, one at a time
    assert b.allow("p", "h:1") == 0.0 and b.is_open("p")
    b.abandon("p")
    assert b.allow("p", "h:1") is None
    assert b.allow("p", "h:2") is None and b.state() == {}   # moved: starts afresh


def test_a_pull_bounds_the_peer_handshake_by_the_connectors_setting(tmp_path: Path, monkeypatch) -> None:
    """The pull header's ``connect_timeout_ms`` (the connector's ``peer_connect_timeout_ms``) bounds
    the agent's connect and handshake with the peer within the pull's deadline: a peer that takes
    the connection and never answers fails the pull after that bound, not the agent's default."""
    monkeypatch.setattr(tier_service, "PEERS_TTL_S", 0.0)
    keys = [bytes([i + 1]) * 16 for i in range(4)]

    async def main():
        async with gated_agent(tmp_path, keys) as (_svc, link, gate, _addr):
            gate.answering = False
            assert (await asyncio.to_thread(hello, link))["ok"]
            t0 = time.monotonic()
            got = await asyncio.to_thread(link.pull, "p", keys, FP.digest(), 20_000, None, None, 300)
            took = time.monotonic() - t0
            assert got.blocks == 0 and got.error.startswith("connection: handshake timed out after 0.3 s"), got
            assert took < 10 and gate.connections == 1
    asyncio.run(main())
