"""A worker whose KV-event endpoint is wrong (nobody publishes there): the gateway says so in
/admin/workers and a metric, warns in its log, and gives that worker's index entries no credit
until events flow; once a publisher appears on the endpoint (a real ZMQ PUB here), it counts again."""
from __future__ import annotations

import httpx
import pytest
import zmq

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, serve_gateway, wait_http, wait_until

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _entry(base: str) -> dict:
    return httpx.get(base + "/admin/workers", headers=AUTH, timeout=10).json()["workers"][0]


def _gauge(base: str) -> float | None:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith('kvroute_worker_events_live{worker="w0"} '):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def gateway(tmp_path, tiny_model):
    sim_port, gw_port, events_port = free_ports(3)
    started: list[Proc] = []
    try:
        sim = Proc("sim", kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny", "--port",
                                       str(sim_port), "--block-size", "32", "--speedup", "10",
                                       "--enable-prompt-tokens-details"), tmp_path)
        started.append(sim)
        wait_http(f"http://127.0.0.1:{sim_port}/health", sim, timeout_s=180)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port}, "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": 32}],
               "workers": [{"id": "w0", "url": f"http://127.0.0.1:{sim_port}", "model": "tiny",
                            "events": f"tcp://127.0.0.1:{events_port}"}],  # nobody publishes there
               "health": {"interval_s": 0.2}, "load_scrape": {"enabled": False}}
        base, _, gw = serve_gateway(cfg, tmp_path, started)
        yield base, gw, events_port
    finally:
        for p in reversed(started):
            p.stop()


def test_wrong_event_endpoint_is_reported_and_not_credited_until_events_flow(gateway):
    base, gw, events_port = gateway
    entry = wait_until(lambda: (e := _entry(base))["events_live"] is False and e, timeout_s=30,
                       what="events reported not live")
    assert f"tcp://127.0.0.1:{events_port}" in entry["events_problem"]
    assert entry["kv_events"]["connected"] is False and entry["kv_events"]["batches_received"] == 0
    assert _gauge(base) == 0
    assert "its prefix evidence is not credited until events flow" in gw.log_tail(50)
    # the gateway's own speculative entries for a prompt it just routed are not credited either
    body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 1}
    assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    explained = httpx.post(base + "/admin/explain", json=body, headers=AUTH, timeout=30).json()
    w0 = explained["candidates"][0]
    assert sum(w0["matched_blocks"].values()) > 0 and w0.get("note") == "evidence distrusted"
    assert explained["reason"] == "load"
    # a publisher appears on the endpoint: the subscriber connects and the worker counts again
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        pub.bind(f"tcp://127.0.0.1:{events_port}")
        wait_until(lambda: _entry(base)["events_live"] is True, timeout_s=30, what="events live again")
        assert _entry(base)["events_problem"] is None and _gauge(base) == 1
    finally:
        pub.close(0)
        ctx.term()
