"""KV-event batches with events this version cannot read: an unknown type (vLLM adds kinds every
few releases; workers are upgraded one at a time) or a malformed known one is left out and
counted, and the batch's other events still apply. Decoder units on real msgpack bytes; the same
batch over real ZMQ into the ingest path and into a real gateway (``kvroute serve``, embedded
index) with its ``/metrics`` counter."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, metric, wait_http
from kv_replay_publisher import ReplayPublisher, until

from kvcore.block_keys import block_keys
from kvcore.index.memory import MemoryIndex
from kvcore.kv_events import wire as kv_events
from kvcore.kv_events.ingest import EventIngestor
from kvcore.kv_events.wire import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventDecodeError,
                                   SkippedEvent, decode_batch, encode_batch)

BS = 32
MODEL = "tiny"
TOKENS_A = list(range(100, 100 + BS))
TOKENS_B = list(range(200, 200 + BS))
KEYS = block_keys(TOKENS_A + TOKENS_B, BS, MODEL)  # A is block 0, B block 1 (chained through A)


def stored_map(hashes, tokens, parent=None, **extra) -> dict:
    """A BlockStored as vLLM 0.32 puts it on the wire (a map tagged by ``type``)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def stored_array(hashes, tokens, parent=None) -> list:
    """A BlockStored as vLLM <= 0.11 put it on the wire (an array in declaration order)."""
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU"]


UNKNOWN = {"type": "BlockPinned", "block_hashes": [7], "pinned_by": "session-1"}
A = stored_map([11], TOKENS_A)
B = stored_map([12], TOKENS_B, parent=11)


def payload(*events, rank=0) -> bytes:
    return msgspec.msgpack.encode([1700000000.5, list(events), rank])


def stored(hashes, tokens, parent=None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                       lora_id=None, medium="GPU", lora_name=None)


# ---- decoder ------------------------------------------------------------------------------------
def test_unknown_event_type_between_two_stores_is_left_out_and_reported():
    skipped: list[SkippedEvent] = []
    batch = decode_batch(payload(A, UNKNOWN, B), skipped)
    assert batch.events == [stored([11], TOKENS_A), stored([12], TOKENS_B, parent=11)]
    assert batch.ts == 1700000000.5 and batch.data_parallel_rank == 0
    assert skipped == [SkippedEvent("BlockPinned", "unknown_type", "")]


def test_array_shaped_unknown_type_and_a_mixed_batch_with_unknown_keys_decode_per_event():
    skipped: list[SkippedEvent] = []
    # vLLM <= 0.11 shape, an unknown kind among them
    batch = decode_batch(payload(stored_array([11], TOKENS_A), ["BlockPinned", [7], "x"],
                                 ["BlockRemoved", [11], "GPU"]), skipped)
    assert batch.events == [stored([11], TOKENS_A), BlockRemoved([11], "GPU")]
    assert skipped == [SkippedEvent("BlockPinned", "unknown_type", "")]
    # both shapes in one batch, a future key on a map event and a trailing field on an array one
    skipped.clear()
    batch = decode_batch(payload(stored_map([11], TOKENS_A, priority=3, locality="LOCAL"),
                                 stored_array([12], TOKENS_B, parent=11) + [None] * 8 + ["future"],
                                 {"type": "AllBlocksCleared", "reason": "reset"}), skipped)
    want_a = stored([11], TOKENS_A)
    want_a.locality = "LOCAL"
    assert batch.events == [want_a, stored([12], TOKENS_B, parent=11), AllBlocksCleared()]
    assert skipped == []


def test_array_shaped_events_keep_every_field_in_vllm_declaration_order():
    ev = ["BlockRemoved", [5], "STORAGE", 0, "REMOTE", "fs"]
    st = stored_array([5], TOKENS_A) + [None, [None], 0, "full_attention", None, "REMOTE", "fs", "s1"]
    for batch in (payload(ev, st), payload(ev, UNKNOWN, st)):  # the whole-batch path, the per-event one
        removed, got = decode_batch(batch).events
        assert removed == BlockRemoved([5], "STORAGE", 0, "REMOTE", "fs")
        assert (got.group_idx, got.kv_cache_spec_kind, got.locality, got.ownership, got.session_id) == \
            (0, "full_attention", "REMOTE", "fs", "s1")


def test_malformed_known_event_and_typeless_items_are_counted_not_fatal():
    skipped: list[SkippedEvent] = []
    no_hashes = {k: v for k, v in stored_map([13], TOKENS_A).items() if k != "block_hashes"}
    batch = decode_batch(payload(A, no_hashes, {"type": "BlockRemoved", "block_hashes": "x", "medium": None},
                                 {"no": "type"}, 42, B), skipped)
    assert batch.events == [stored([11], TOKENS_A), stored([12], TOKENS_B, parent=11)]
    assert [(s.type, s.reason) for s in skipped] == [("BlockStored", "malformed"), ("BlockRemoved", "malformed"),
                                                     ("?", "malformed"), ("?", "malformed")]
    assert "block_hashes" in skipped[0].error
    long_name = {"type": "X" * 500}
    decode_batch(payload(long_name), skipped)
    assert skipped[-1] == SkippedEvent("X" * 64, "unknown_type", "")


def test_a_payload_that_is_not_a_batch_still_raises():
    for bad in (b"\xc1", msgspec.msgpack.encode({"ts": 1.0}), msgspec.msgpack.encode([1.0, 5, 0])):
        with pytest.raises(EventDecodeError):
            decode_batch(bad, [])


def test_a_batch_of_known_events_never_takes_the_per_event_path(monkeypatch):
    def per_event(raw):
        raise AssertionError("per-event decode on the common path")

    monkeypatch.setattr(kv_events, "decode_event", per_event)
    normal = EventBatch(1.0, [stored([11], TOKENS_A), BlockRemoved([11], "GPU")], 0)
    assert decode_batch(encode_batch(normal), []) == normal
    old = payload(stored_array([11], TOKENS_A), ["BlockRemoved", [11], "GPU"])
    assert decode_batch(old, []).events == normal.events


# ---- over ZMQ into the ingest path --------------------------------------------------------------
async def test_mixed_batch_over_zmq_indexes_both_stores_and_counts_the_unknown_type_once(caplog):
    pub_port, replay_port = free_ports(2)
    pub = ReplayPublisher(pub_port, replay_port, topic=b"")
    index = MemoryIndex()
    ing = EventIngestor("w0", pub.events_url, pub.replay_url, index, MODEL, BS, replay_timeout_s=5.0)
    caplog.set_level(logging.WARNING, logger="kvroute.kv_events")
    try:
        await ing.start()
        await until(lambda: ing.subscriber.connected, what="SUB connected")
        await pub.subscribed()
        await pub.publish(payload(A, UNKNOWN, B))
        await until(lambda: ing.subscriber.last_seq >= 0, what="batch 0 applied")
        assert (await index.match(KEYS))["w0"].as_dict() == {"gpu": 2, "cpu": 0, "ssd": 0}
        st = ing.state()
        assert st["events_not_decoded"] == {"unknown_type": {"BlockPinned": 1}}
        assert st["resyncs"] == 0 and st["decode_errors"] == 0 and st["blocks"]["gpu"] == 2
        # more of the same type, and a malformed removal: counted, the store in between applies
        bad_removal = {"type": "BlockRemoved", "medium": "GPU"}
        await pub.publish(payload(UNKNOWN, stored_map([13], list(range(300, 300 + BS)), parent=12), UNKNOWN,
                                  bad_removal))
        await until(lambda: ing.subscriber.last_seq >= 1, what="batch 1 applied")
        assert (await index.match(block_keys(TOKENS_A + TOKENS_B + list(range(300, 300 + BS)), BS, MODEL))
                )["w0"].gpu == 3
        assert ing.state()["events_not_decoded"] == {"unknown_type": {"BlockPinned": 3},
                                                     "malformed": {"BlockRemoved": 1}}
        lines = [r.getMessage() for r in caplog.records if r.name == "kvroute.kv_events"]
        assert sum("'BlockPinned'" in m for m in lines) == 1  # once per type per worker
        assert sum("malformed 'BlockRemoved'" in m for m in lines) == 1
        assert ing.state()["resyncs"] == 0
    finally:
        await ing.stop()
        await pub.close()


# ---- a real gateway ------------------------------------------------------------------------------
async def test_gateway_indexes_a_mixed_batch_and_exports_the_skipped_counter(tiny_model, tmp_path):
    pub_port, replay_port, worker_port, gw_port = free_ports(4)
    pub = ReplayPublisher(pub_port, replay_port, topic=b"")
    cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
           "models": [{"name": MODEL, "tokenizer": str(tiny_model), "block_size": BS}],
           "index": {"backend": "memory"}, "load_scrape": {"enabled": False},
           "health": {"interval_s": 0.2, "timeout_s": 0.5, "rise_threshold": 1},
           "workers": [{"id": "w0", "url": f"http://127.0.0.1:{worker_port}", "model": MODEL,
                        "events": pub.events_url, "replay": pub.replay_url}]}
    path = tmp_path / "gw.yaml"
    path.write_text(json.dumps(cfg))
    # a worker that is healthy (so /admin/explain has a candidate) and answers nothing else
    worker = Proc("worker", [sys.executable, str(Path(__file__).parent / "bad_worker.py"), "--port",
                             str(worker_port), "--mode", "hang", "--life-s", "300"], tmp_path)
    gw = Proc("gateway", kvroute_argv("serve", "--config", str(path)), tmp_path)
    base = f"http://127.0.0.1:{gw_port}"
    try:
        await asyncio.to_thread(wait_http, base + "/health", gw, 180)
        await pub.subscribed(timeout_s=60)
        await pub.publish(payload(A, UNKNOWN, B))
        series = {"worker": "w0", "type": "BlockPinned", "reason": "unknown_type"}
        await until(lambda: metric(base, "kvroute_worker_event_skipped_total", **series) == 1, timeout_s=30,
                    what=f"the skipped counter\n{gw.log_tail()}")
        await until(lambda: httpx.get(base + "/health/ready").status_code == 200, timeout_s=30,
                    what="the worker healthy")
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
            idx = (await client.get(base + "/admin/index")).json()["workers"]["w0"]
            assert idx["blocks"] == {"gpu": 2, "cpu": 0, "ssd": 0}
            assert idx["kv_events"]["events_not_decoded"] == {"unknown_type": {"BlockPinned": 1}}
            # A's and B's keys: a prompt of their tokens matches both blocks on w0
            plan = (await client.post(base + "/admin/explain",
                                      json={"model": MODEL, "prompt": TOKENS_A + TOKENS_B, "max_tokens": 1})).json()
            w0 = next(c for c in plan["candidates"] if c["worker"] == "w0")
            assert w0["matched_blocks"] == {"gpu": 2, "cpu": 0, "ssd": 0}
        assert "skipping KV events of unknown type 'BlockPinned'" in gw.log_path.read_text()
        assert metric(base, "kvroute_worker_event_resyncs_total", worker="w0") == 0
    finally:
        gw.stop()
        worker.stop()
        await pub.close()


def test_skipped_types_counted_by_name_are_bounded_per_worker(caplog):
    from kvcore.kv_events.subscriber import OTHER_TYPES, SKIPPED_TYPES_KEPT, EventSubscriber

    sub = EventSubscriber("tcp://127.0.0.1:9", None, sink=None, name="w0")  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="kvroute.kv_events")
    names = [f"Kind{i}" for i in range(SKIPPED_TYPES_KEPT + 8)]
    sub._count_skipped(3, [SkippedEvent(n, "unknown_type", "") for n in names + names])
    counted = sub.counters()["events_not_decoded"]["unknown_type"]
    assert len(counted) == SKIPPED_TYPES_KEPT + 1 and counted[OTHER_TYPES] == 16
    assert all(counted[n] == 2 for n in names[:SKIPPED_TYPES_KEPT])
    assert len(caplog.records) == SKIPPED_TYPES_KEPT + 1  # once per name, once for the rest
