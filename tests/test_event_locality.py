"""vLLM 0.32's ``locality`` on BlockStored/BlockRemoved (``vllm/distributed/kv_events.py``: LOCAL or
REMOTE relative to the publisher, None unspecified): a REMOTE copy lives outside the worker, so it
is never credited as the worker's cpu or ssd tier, and its removal never removes the worker's own
copy; LOCAL and absent locality are credited by medium as before. Real events over ZMQ through the
ingest path into both index backends; the index's tier counts per worker for the blocks' keys."""
from __future__ import annotations

import uuid

import msgspec
import pytest
from conftest import free_ports
from kv_replay_publisher import ReplayPublisher, until

from kvcore.block_keys import block_keys
from kvcore.index.base import TierMatch
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex
from kvcore.kv_events.ingest import EventIngestor
from kvcore.kv_events.translate import EventTranslator
from kvcore.kv_events.wire import BlockRemoved, BlockStored, EventBatch

BS = 32
MODEL = "tiny"
TOKENS = list(range(500, 500 + 3 * BS))
KEYS = block_keys(TOKENS, BS, MODEL)
HASHES = [101, 102, 103]


def gpu_store(hashes=HASHES, tokens=TOKENS) -> dict:
    """The prefix cache's store, as vLLM 0.32 sends it (no locality)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def tier_store(medium: str, locality: str | None, hashes=HASHES, tokens=TOKENS, ownership: str | None = None) -> dict:
    """A secondary tier's store as vLLM 0.32's OffloadingEventsTracker sends it: self-describing
    (tokens and parent) when it has the request's metadata."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
          "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0,
          "kv_cache_spec_kind": "full_attention"}
    if locality is not None:
        ev["locality"] = locality
    if ownership is not None:
        ev["ownership"] = ownership
    return ev


def placeholder(medium: str, locality: str | None, hashes=HASHES) -> dict:
    """vLLM's tokenless placeholder store (no metadata for the offload key)."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
          "block_size": 0, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
    if locality is not None:
        ev["locality"] = locality
    return ev


def removed(medium: str, locality: str | None = None, hashes=HASHES) -> dict:
    ev = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}
    if locality is not None:
        ev["locality"] = locality
    return ev


def payload(*events) -> bytes:
    return msgspec.msgpack.encode([1700000000.0, list(events), 0])


@pytest.fixture(params=["memory", "redis"])
async def index(request):
    if request.param == "memory":
        yield MemoryIndex()
        return
    idx = RedisIndex(request.getfixturevalue("redis_url"), namespace=f"t{uuid.uuid4().hex[:8]}", socket_timeout_s=5)
    yield idx
    await idx.close()


class Stream:
    """One worker's events on a real PUB socket, ingested into ``index``."""

    def __init__(self, index, worker: str) -> None:
        self.index = index
        self.worker = worker
        pub_port, replay_port = free_ports(2)
        self.pub = ReplayPublisher(pub_port, replay_port, topic=b"")
        self.ing = EventIngestor(worker, self.pub.events_url, self.pub.replay_url, index, MODEL, BS,
                                 replay_timeout_s=5.0, heartbeat_ttl_s=5.0)

    async def start(self) -> None:
        await self.ing.start()
        await until(lambda: self.ing.subscriber.connected, what="SUB connected")
        await self.pub.subscribed()

    async def send(self, *events) -> None:
        seq = await self.pub.publish(payload(*events))
        await until(lambda: self.ing.subscriber.last_seq >= seq, what=f"seq {seq} applied")

    async def tiers(self) -> dict[str, int]:
        """The index's match of the blocks' keys for this worker, by tier (all 0 when absent)."""
        return (await self.index.match(KEYS)).get(self.worker, TierMatch()).as_dict()

    async def held(self) -> dict[str, int]:
        stats = (await self.index.stats()).get(self.worker)
        return dict(stats.blocks) if stats else {"gpu": 0, "cpu": 0, "ssd": 0}

    async def close(self) -> None:
        await self.ing.stop()
        await self.pub.close()


@pytest.fixture
async def streams(index):
    made: list[Stream] = []

    async def make(worker: str) -> Stream:
        s = Stream(index, worker)
        made.append(s)
        await s.start()
        return s

    yield make
    for s in made:
        await s.close()


async def test_remote_storage_blocks_are_not_the_workers_ssd(streams):
    s = await streams("w-remote-ssd")
    await s.send(gpu_store(), tier_store("STORAGE", "REMOTE", ownership="fs"))
    assert await s.tiers() == {"gpu": 3, "cpu": 0, "ssd": 0}
    await s.send(removed("GPU"))
    assert await s.tiers() == {"gpu": 0, "cpu": 0, "ssd": 0}
    assert await s.held() == {"gpu": 0, "cpu": 0, "ssd": 0}
    st = s.ing.state()
    assert st["blocks"] == {"gpu": 0, "cpu": 0, "ssd": 0} and st["remote_events"] == 1


async def test_local_and_unspecified_storage_blocks_stay_the_workers_ssd(streams):
    local = await streams("w-local-ssd")
    await local.send(gpu_store(), tier_store("STORAGE", "LOCAL"), removed("GPU"))
    assert await local.tiers() == {"gpu": 0, "cpu": 0, "ssd": 3}
    unspecified = await streams("w-unspecified-ssd")  # kvroute's own connector, older vLLMs
    await unspecified.send(gpu_store(), placeholder("STORAGE", None), removed("GPU"))
    assert await unspecified.tiers() == {"gpu": 0, "cpu": 0, "ssd": 3}
    assert local.ing.state()["remote_events"] == 0 and unspecified.ing.state()["remote_events"] == 0


async def test_remote_cpu_copy_is_not_credited_once_the_gpu_copy_is_evicted(streams):
    s = await streams("w-remote-cpu")
    await s.send(gpu_store(hashes=HASHES[:2], tokens=TOKENS[:2 * BS]),
                 placeholder("CPU", "REMOTE", hashes=HASHES[:2]))
    await s.send(removed("GPU", hashes=HASHES[:2]))
    assert await s.tiers() == {"gpu": 0, "cpu": 0, "ssd": 0}
    assert await s.held() == {"gpu": 0, "cpu": 0, "ssd": 0}


async def test_a_remote_removal_leaves_the_workers_local_copy_of_the_same_medium(streams):
    s = await streams("w-mixed")
    # the local CPU copy is the worker's; a remote CPU copy comes and goes (its store seen or not)
    await s.send(gpu_store(), placeholder("CPU", "LOCAL"), removed("GPU"))
    assert await s.tiers() == {"gpu": 0, "cpu": 3, "ssd": 0}
    await s.send(removed("CPU", "REMOTE"))  # the remote copy's store came before we subscribed
    assert await s.tiers() == {"gpu": 0, "cpu": 3, "ssd": 0}
    await s.send(tier_store("CPU", "REMOTE"), removed("CPU", "REMOTE"))
    assert await s.tiers() == {"gpu": 0, "cpu": 3, "ssd": 0}
    await s.send(removed("STORAGE", "REMOTE"), removed("CPU", "LOCAL", hashes=HASHES[2:]))
    assert await s.tiers() == {"gpu": 0, "cpu": 2, "ssd": 0}
    assert await s.held() == {"gpu": 0, "cpu": 2, "ssd": 0}
    assert s.ing.state()["remote_events"] == 4


def test_translator_ops_for_each_locality_and_an_unknown_one():
    def stored(medium, locality, tokens=TOKENS, hashes=HASHES):
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                           block_size=BS if tokens else 0, lora_id=None, medium=medium, lora_name=None,
                           locality=locality)

    tr = EventTranslator(MODEL, BS)
    ops = tr.translate(EventBatch(0.0, [stored("GPU", None), stored("CPU", "REMOTE", []), stored("CPU", "LOCAL", []),
                                        stored("STORAGE", "REMOTE"), stored("STORAGE", "RACK"),
                                        BlockRemoved(HASHES, "CPU", locality="REMOTE")]))
    assert ops == [("store", "gpu", KEYS), ("store", "cpu", KEYS)]
    assert tr.held_blocks() == {"gpu": 3, "cpu": 3, "ssd": 0}
    assert tr.counters.remote_events == 3 and tr.counters.skipped_events == 1
    # the snapshot a republish writes holds the same
    assert tr.snapshot() == [("store", "gpu", KEYS), ("store", "cpu", KEYS)]
