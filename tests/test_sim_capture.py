"""`kvroute sim` replays the real vLLM 0.32 capture: same tokens, same event shapes and types on the
wire, same cached_tokens, and a replay socket that answers like vLLM's.

The sim runs as a real subprocess with the capture's settings (48 blocks of 32 tokens, 1024 context).
"""
from __future__ import annotations

import base64
import json

import httpx
import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from conftest import Proc, free_ports, kvroute_argv, wait_http
from kvcore.kv_events.wire import (AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, seq_bytes,
                           seq_from_bytes)


def start_sim(procs, tiny_model, blocks: int, max_model_len: int = 1024, extra: tuple[str, ...] = ()):
    """Start a sim with events on; returns (base url, events endpoint, replay endpoint)."""
    port, ev, rp = free_ports(3)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
           "replay_endpoint": f"tcp://*:{rp}", "topic": "kv@tiny"}
    argv = kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny",
                        "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
                        "--num-gpu-blocks-override", str(blocks), "--max-model-len", str(max_model_len),
                        "--enable-prompt-tokens-details", "--speedup", "1000", "--kv-events-config",
                        json.dumps(cfg), *extra)
    proc = procs("sim", argv)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return url, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}"


def subscribe(events: str, timeout_s: float = 10.0) -> zmq.Socket:
    """A SUB socket on ``events`` (every topic) whose ZMTP handshake with the sim's PUB socket has
    completed. Its subscription is queued before the connect and goes out with the handshake, so
    it reaches the sim well before the sim can publish anything for a request sent after this
    returns (the sim publishes nothing unprompted, so there is no message to probe with)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(events)
        assert monitor.poll(int(timeout_s * 1000)), f"no handshake with the sim's PUB socket in {timeout_s}s"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sub.disable_monitor()
        monitor.close(0)
    return sub


def recv_all(sub: zmq.Socket, quiet_s: float = 0.3) -> list[list[bytes]]:
    """Every message until the socket is quiet for ``quiet_s``."""
    out = []
    while sub.poll(int(quiet_s * 1000)):
        out.append(sub.recv_multipart())
    return out


def shape(ev) -> tuple:
    """What must match between vLLM and the sim: type, block count, tokens per block, parent or not."""
    if isinstance(ev, BlockStored):
        return ("BlockStored", len(ev.block_hashes), len(ev.token_ids) // ev.block_size, ev.block_size,
                ev.parent_block_hash is None, ev.medium, ev.group_idx, ev.kv_cache_spec_kind,
                [bool(k) for k in ev.extra_keys])
    if isinstance(ev, BlockRemoved):
        return ("BlockRemoved", ev.medium, ev.group_idx)
    return (type(ev).__name__,)


def raw_keys(payload: bytes) -> list[tuple]:
    """Per event of a batch, its type and the keys of its untyped msgpack map, in order."""
    return [(e["type"], *sorted(e)) for e in msgspec.msgpack.decode(payload)[1]]


def collapse(shapes: list[tuple]) -> list[tuple]:
    """Runs of BlockRemoved become one entry (vLLM's count depends on its free-queue history)."""
    out: list[tuple] = []
    for s in shapes:
        if not (out and s[0] == "BlockRemoved" and out[-1] == s):
            out.append(s)
    return out


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory):
    """Like conftest's ``procs``, for one module: every process is stopped at module teardown."""
    started: list[Proc] = []
    log_dir = tmp_path_factory.mktemp("sim")

    def start(name: str, argv: list[str]) -> Proc:
        started.append(Proc(name, argv, log_dir))
        return started[-1]

    yield start
    for p in reversed(started):
        p.stop()


@pytest.fixture(scope="module")
def replayed(module_procs, tiny_model, capture):
    """Run every capture step against one fresh sim; returns (capture, responses, sim frames, replay
    endpoint). The tests only read what it produced."""
    url, events, replay = start_sim(module_procs, tiny_model, blocks=48)
    sub = subscribe(events)
    responses, frames_per_step = [], []
    with httpx.Client(base_url=url, timeout=30) as client:
        for step in capture["steps"]:
            r = client.post(step["path"], json=step["request"])
            assert r.status_code == 200, r.text
            responses.append(r.json())
            frames_per_step.append(recv_all(sub))
    sub.close(0)
    return capture, responses, frames_per_step, replay


def test_frames_decode_to_the_same_structure_as_vllm(replayed):
    capture, _, frames_per_step, _ = replayed
    real = [capture["frames"][i] for i in range(len(capture["frames"]))]
    for step, sim_frames in zip(capture["steps"], frames_per_step):
        real_frames = [[base64.b64decode(f) for f in real[i]["frames_b64"]] for i in step["frames"]]
        assert len(sim_frames) == len(real_frames), step["name"]
        for sf, rf in zip(sim_frames, real_frames):
            assert len(sf) == 3 and sf[0] == rf[0] == b"kv@tiny" and len(sf[1]) == 8
            sim_batch, real_batch = decode_batch(sf[2]), decode_batch(rf[2])
            assert type(sim_batch.ts) is float and sim_batch.data_parallel_rank == real_batch.data_parallel_rank == 0
            assert collapse([shape(e) for e in sim_batch.events]) == collapse([shape(e) for e in real_batch.events])
            # every event's untyped msgpack map carries the same keys (same fields present / omitted)
            assert collapse(raw_keys(sf[2])) == collapse(raw_keys(rf[2]))
            assert {type(h) for e in sim_batch.events if not isinstance(e, AllBlocksCleared)
                    for h in e.block_hashes} == {int}
    seqs = [seq_from_bytes(f[1]) for step_frames in frames_per_step for f in step_frames]
    assert seqs == list(range(len(capture["frames"])))


def test_stored_token_ids_and_salt_match_vllm(replayed):
    capture, _, frames_per_step, _ = replayed
    by_name = dict(zip([s["name"] for s in capture["steps"]], frames_per_step))
    real = capture["frames"]
    for name in ("completion_A", "chat_1", "completion_salted", "after_reset_completion_A"):
        step = next(s for s in capture["steps"] if s["name"] == name)
        sim_events = [e for f in by_name[name] for e in decode_batch(f[2]).events if isinstance(e, BlockStored)]
        real_events = [e for i in step["frames"] for e in decode_batch(base64.b64decode(real[i]["frames_b64"][2])).events
                       if isinstance(e, BlockStored)]
        assert [e.token_ids for e in sim_events] == [e.token_ids for e in real_events], name
        assert [e.extra_keys for e in sim_events] == [e.extra_keys for e in real_events], name
    # the prompt part of the block B filled during decode matches too (its last 2 tokens are output)
    b_sim = decode_batch(by_name["completion_B_evicts"][1][2]).events[0]
    b_real = decode_batch(base64.b64decode(real[4]["frames_b64"][2])).events[0]
    assert b_sim.token_ids[:30] == b_real.token_ids[:30]
    # eviction: every removed hash is one completion_A stored earlier; reset then re-stores A's chain
    a_hashes = set(decode_batch(by_name["completion_A"][0][2]).events[0].block_hashes)
    salted = decode_batch(by_name["completion_salted"][0][2]).events
    removed = [h for e in salted if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= a_hashes
    after = decode_batch(by_name["after_reset_completion_A"][0][2]).events
    assert isinstance(after[0], AllBlocksCleared) and set(after[1].block_hashes) == a_hashes


def test_usage_and_cached_tokens_match_vllm(replayed):
    capture, responses, _, _ = replayed
    for step, got in zip(capture["steps"], responses):
        want = step["response"]
        if "usage" not in want:
            assert got == {"success": True}
            continue
        assert got["object"] == want["object"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"], step["name"]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], step["name"]
        assert (got["usage"]["prompt_tokens_details"]["cached_tokens"]
                == want["usage"]["prompt_tokens_details"]["cached_tokens"]), step["name"]
        # the prompt's full blocks less its hit, on chat only (192 / 32 / 0 in the capture)
        assert (got["usage"]["prompt_tokens_details"].get("created_cache_tokens")
                == want["usage"]["prompt_tokens_details"]["created_cache_tokens"]), step["name"]
        assert [c["finish_reason"] for c in got["choices"]] == [c["finish_reason"] for c in want["choices"]]


def test_replay_returns_missed_batches_then_end(replayed):
    capture, _, frames_per_step, replay = replayed
    published = [f for step_frames in frames_per_step for f in step_frames]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        for start in (0, 3):
            dealer.send_multipart([b"", seq_bytes(start)])
            got = []
            while True:
                assert dealer.poll(10_000), "replay did not answer"
                msg = dealer.recv_multipart()
                assert len(msg) == 4 and msg[0] == b""
                if seq_from_bytes(msg[2]) == -1:
                    assert msg[1] == b"" and msg[3] == b""
                    break
                got.append(msg[1:])
            assert got == [f for f in published if seq_from_bytes(f[1]) >= start]
        # the capture's own replay ends the same way
        last = capture["replay_from_0"][-1]
        assert [base64.b64decode(x) for x in last] == [b"", b"", seq_bytes(-1), b""]
    finally:
        dealer.close(0)
