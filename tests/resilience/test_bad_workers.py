"""Workers that misbehave, behind one gateway (`kvroute serve`), next to a healthy `kvroute sim`:
one that never answers, one that stalls mid-stream, one that answers garbage, one that sheds
load with 429 + Retry-After. Each gets an OpenAI-shaped answer bounded by the configured
timeouts (or its own answer, unchanged), none is retried elsewhere, and none delays the others."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx
import orjson
import pytest

from conftest import Proc, free_ports, kvroute_argv, metric, serve_gateway, wait_http

BLOCK = 32
TESTS = Path(__file__).resolve().parents[1]
BAD = ("hang", "stall", "garbage", "busy")
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_model) -> str:
    log_dir = tmp_path_factory.mktemp("bad-workers")
    sim_port, gw_port, *bad_ports = free_ports(2 + len(BAD))
    started: list[Proc] = []
    try:
        sim = Proc("sim", kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny", "--port",
                                       str(sim_port), "--block-size", str(BLOCK), "--speedup", "10"), log_dir)
        started.append(sim)
        workers = [{"id": "w0", "url": f"http://127.0.0.1:{sim_port}", "model": "tiny"}]
        for name, port in zip(BAD, bad_ports):
            mode = "status" if name == "busy" else name
            started.append(Proc(name, [sys.executable, str(TESTS / "bad_worker.py"), "--port", str(port),
                                       "--mode", mode], log_dir))
            workers.append({"id": name, "url": f"http://127.0.0.1:{port}", "model": name})
        for p, w in zip(started, workers):
            wait_http(w["url"] + "/health", p, timeout_s=180)
        models = [{"name": n, "tokenizer": str(tiny_model), "block_size": BLOCK} for n in ("tiny", *BAD)]
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port}, "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
               "models": models, "workers": workers, "load_scrape": {"enabled": False},
               "timeouts": {"first_byte_s": 2, "stream_idle_s": 1, "worker_call_s": 1}}
        base, _, _ = serve_gateway(cfg, log_dir, started)
        yield base
    finally:
        for p in reversed(started):
            p.stop()


def _openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return err


def test_a_worker_that_never_answers_gets_504_after_first_byte_s(gateway):
    r = httpx.post(gateway + "/v1/chat/completions", json={**CHAT, "model": "hang"}, timeout=60)
    _openai_error(r, 504, "upstream_timeout")
    assert r.headers["x-kvroute-worker"] == "hang"


def test_a_worker_that_answers_garbage_gets_502(gateway):
    retries = metric(gateway, "kvroute_upstream_retries_total")
    r = httpx.post(gateway + "/v1/chat/completions", json={**CHAT, "model": "garbage"}, timeout=60)
    _openai_error(r, 502, "upstream_failure")
    assert r.headers["x-kvroute-worker"] == "garbage"
    assert metric(gateway, "kvroute_upstream_retries_total") == retries


def test_a_stream_that_stalls_ends_with_an_error_event(gateway):
    """Headers and one event, then silence: after stream_idle_s the client gets an error event and
    [DONE], a clean end it can parse, not a hang or a cut connection."""
    before = metric(gateway, "kvroute_broken_streams_total", reason="idle_timeout", worker="stall")
    r = httpx.post(gateway + "/v1/chat/completions", json={**CHAT, "model": "stall", "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] == "stall"
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0].startswith(b'data: {"id":"x"')  # the worker's own event came through first
    error = orjson.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_timeout" and error["type"] == "upstream_error"
    assert events[2:] == [b"data: [DONE]"]
    assert metric(gateway, "kvroute_broken_streams_total", reason="idle_timeout", worker="stall") == before + 1


def test_a_workers_429_and_retry_after_pass_through_unretried(gateway):
    retries = metric(gateway, "kvroute_upstream_retries_total")
    r = httpx.post(gateway + "/v1/chat/completions", json={**CHAT, "model": "busy"}, timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] == "7" and r.headers["x-kvroute-worker"] == "busy"
    assert r.json() == {"error": {"message": "server busy", "type": "ServiceUnavailableError", "param": None,
                                  "code": 429}}  # the worker's body, unchanged
    assert metric(gateway, "kvroute_upstream_retries_total") == retries


def test_bad_workers_never_delay_the_healthy_one(gateway):
    """While a request waits on the hanging worker and a stream on the stalling one, requests to
    the healthy worker are answered, and the model listing comes without the bad workers' cards."""
    stuck: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        stuck[name] = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=60)

    threads = [threading.Thread(target=send, args=("hang", {**CHAT, "model": "hang"})),
               threading.Thread(target=send, args=("stall", {**CHAT, "model": "stall", "stream": True}))]
    for t in threads:
        t.start()
    try:
        healthy = [httpx.post(gateway + "/v1/chat/completions", json={**CHAT, "model": "tiny"}, timeout=60)
                   for _ in range(5)]
        assert [r.status_code for r in healthy] == [200] * 5
        assert {r.headers["x-kvroute-worker"] for r in healthy} == {"w0"}
        listed = httpx.get(gateway + "/v1/models", timeout=60)
        assert [m["id"] for m in listed.json()["data"]] == ["tiny"]  # the others are not vLLM: skipped
    finally:
        for t in threads:
            t.join(60)
    assert stuck["hang"].status_code == 504 and stuck["stall"].status_code == 200
