"""A worker killed with SIGKILL behind the gateway (embedded index, real `kvroute sim` workers
publishing KV events on real ZMQ): after the health hysteresis no request goes to it and its index
entries are purged; restarted on the same ports it is admitted again, and its index entries come
back from its own events."""
from __future__ import annotations

import json
import random
import signal

import httpx
import pytest

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, serve_gateway, wait_http, wait_until

BLOCK = 32
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _body(seed: int) -> dict:
    rnd = random.Random(seed)
    words = " ".join(rnd.choice("red green blue cyan teal gold grey pink".split()) for _ in range(300))
    return {"model": "tiny", "messages": [{"role": "user", "content": words}], "max_tokens": 2}


class Cluster:
    def __init__(self, tmp_path, tiny_model) -> None:
        self.tmp_path, self.tiny_model = tmp_path, tiny_model
        self.procs: dict[str, Proc] = {}
        self.ports = {}

    def start_sim(self, name: str) -> None:
        port, ev, rp = self.ports[name]
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                  "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"}
        proc = Proc(f"{name}-{len([n for n in self.procs if n.startswith(name)])}", kvroute_argv(
            "sim", "--model", str(self.tiny_model), "--served-model-name", "tiny", "--port", str(port),
            "--block-size", str(BLOCK), "--enable-prompt-tokens-details", "--speedup", "50",
            "--kv-events-config", json.dumps(events)), self.tmp_path)
        self.procs[name] = proc
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout_s=180)

    def blocks(self, worker: str) -> int:
        idx = httpx.get(self.base + "/admin/index", headers=AUTH, timeout=10).json()["workers"]
        return sum(idx.get(worker, {}).get("blocks", {}).values())

    def healthy(self, worker: str) -> bool | None:
        entries = httpx.get(self.base + "/admin/workers", headers=AUTH, timeout=10).json()["workers"]
        return next(w["healthy"] for w in entries if w["id"] == worker)

    def send(self, body: dict) -> str:
        r = httpx.post(self.base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-kvroute-worker"]


@pytest.fixture
def cluster(tmp_path, tiny_model):
    c = Cluster(tmp_path, tiny_model)
    ports = free_ports(7)
    c.ports = {"w0": ports[0:3], "w1": ports[3:6]}
    started: list[Proc] = []
    try:
        for name in ("w0", "w1"):
            c.start_sim(name)
        workers = [{"id": n, "url": f"http://127.0.0.1:{p[0]}", "model": "tiny", "events": f"tcp://127.0.0.1:{p[1]}",
                    "replay": f"tcp://127.0.0.1:{p[2]}"} for n, p in c.ports.items()]
        cfg = {"listen": {"host": "127.0.0.1", "port": ports[6]}, "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
               "workers": workers, "load_scrape": {"enabled": False},
               "health": {"interval_s": 0.2, "timeout_s": 1, "fail_threshold": 2, "rise_threshold": 2}}
        c.base, _, _ = serve_gateway(cfg, tmp_path, started)
        yield c
    finally:
        for p in list(c.procs.values()) + started:
            p.stop()


def test_killed_worker_is_purged_avoided_and_readmitted(cluster):
    c = cluster
    assert c.send(_body(1)) and c.send(_body(2))  # a prompt on each worker (cold prompts alternate)
    for w in ("w0", "w1"):
        wait_until(lambda: c.blocks(w) > 0, what=f"{w}'s blocks indexed from its events")
    c.procs["w1"].signal(signal.SIGKILL)
    c.procs["w1"].popen.wait(10)
    wait_until(lambda: c.healthy("w1") is False, what="w1 marked down")
    assert c.blocks("w1") == 0  # purged: its cache died with it
    assert c.blocks("w0") > 0
    assert {c.send(_body(10 + i)) for i in range(6)} == {"w0"}  # nothing goes to it while down
    c.start_sim("w1")  # back on the same ports, empty cache, event seq from 0
    wait_until(lambda: c.healthy("w1") is True, what="w1 admitted again")
    assert c.blocks("w1") == 0  # nothing stale came back
    seen = {c.send(_body(20 + i)) for i in range(6)}
    assert "w1" in seen  # routed to again
    wait_until(lambda: c.blocks("w1") > 0, what="w1's index rebuilt from its new events")
