"""The gateway's lifecycle through a real `kvroute serve` and a slow `kvroute sim`: readiness apart
from liveness, a drain that reports when the worker's last request ends, and SIGTERM that refuses
new connections at once and lets the requests in flight finish before the process exits."""
from __future__ import annotations

import signal
import socket
import threading

import httpx
import psutil
import pytest

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, serve_gateway, wait_http, wait_until

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TOKENS = 60  # at 50 ms a token, a stream lasts ~3 s: long enough to act while it runs


def _stream_body(tag: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"tell a story {tag}"}],
            "max_tokens": TOKENS, "stream": True, "ignore_eos": True}


@pytest.fixture
def cluster(tmp_path, tiny_model):
    sim_port, gw_port = free_ports(2)
    started: list[Proc] = []
    try:
        sim = Proc("sim", kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny", "--port",
                                       str(sim_port), "--block-size", "32", "--decode-ms-per-token", "50"), tmp_path)
        started.append(sim)
        sim_url = f"http://127.0.0.1:{sim_port}"
        wait_http(sim_url + "/health", sim, timeout_s=180)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port}, "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": 32}],
               "workers": [{"id": "w0", "url": sim_url, "model": "tiny"}], "load_scrape": {"enabled": False},
               "timeouts": {"shutdown_grace_s": 60}}
        base, _, gw = serve_gateway(cfg, tmp_path, started)
        yield base, gw, sim_url
    finally:
        for p in reversed(started):
            p.stop()


def _in_flight(base: str) -> int:
    return httpx.get(base + "/admin/workers", headers=AUTH, timeout=10).json()["workers"][0]["in_flight"]


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _content_chunks(data: bytes) -> int:
    return sum(1 for e in data.split(b"\n\n") if b'"delta":{"content"' in e)


def test_readiness_follows_routable_workers_and_liveness_does_not(cluster):
    base, _, sim_url = cluster
    assert httpx.get(base + "/health/ready", timeout=10).json() == {"status": "ready", "workers": 1, "routable": 1}
    assert httpx.post(base + "/admin/workers/w0/drain", headers=AUTH, timeout=10).status_code == 200
    r = httpx.get(base + "/health/ready", timeout=10)
    assert r.status_code == 503 and r.json() == {"status": "not_ready", "workers": 1, "routable": 0}
    assert httpx.get(base + "/health", timeout=10).status_code == 200  # alive all the same
    assert httpx.delete(base + "/admin/workers/w0", headers=AUTH, timeout=10).status_code == 200
    assert httpx.post(base + "/admin/workers", json={"id": "w0", "url": sim_url, "model": "tiny"}, headers=AUTH,
                      timeout=30).status_code == 201
    assert httpx.get(base + "/health/ready", timeout=10).status_code == 200


def test_drain_reports_when_the_last_request_ends(cluster):
    base, _, _ = cluster
    got: dict = {}

    def stream() -> None:
        got["stream"] = httpx.post(base + "/v1/chat/completions", json=_stream_body("drain"), timeout=60)

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: _in_flight(base) == 1, what="stream in flight")
    at_once = httpx.post(base + "/admin/workers/w0/drain", headers=AUTH, timeout=10).json()
    assert at_once["draining"] is True and at_once["in_flight"] == 1 and at_once["drained"] is False
    waited = httpx.post(base + "/admin/workers/w0/drain?wait_s=60", headers=AUTH, timeout=90).json()
    assert waited["in_flight"] == 0 and waited["drained"] is True
    t.join(60)
    assert got["stream"].status_code == 200 and _content_chunks(got["stream"].content) == TOKENS
    bad = httpx.post(base + "/admin/workers/w0/drain?wait_s=-1", headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "wait_s"


def test_sigterm_refuses_new_connections_and_finishes_requests_in_flight(cluster):
    base, gw, _ = cluster
    port = int(base.rsplit(":", 1)[1])
    with httpx.stream("POST", base + "/v1/chat/completions", json=_stream_body("term"), timeout=60) as s:
        it = s.iter_raw()
        received = next(it)
        assert _in_flight(base) == 1  # under way when the signal comes
        # the gateway itself (the child of `timeout`, which would die of the signal if it got it)
        psutil.Process(gw.popen.pid).children()[0].send_signal(signal.SIGTERM)
        wait_until(lambda: _refused(port), what="listening socket closed")
        received += b"".join(it)
    assert _content_chunks(received) == TOKENS and received.endswith(b"data: [DONE]\n\n")
    # it exits by itself once its last request ends (uvicorn re-raises the signal after its
    # graceful shutdown, so the status is the signal's; `timeout` passes it on)
    assert gw.popen.wait(60) == -signal.SIGTERM
    assert "Traceback" not in gw.log_tail(200)
