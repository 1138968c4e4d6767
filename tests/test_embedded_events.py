"""Embedded mode: `kvroute serve` with `index: memory` subscribes to each worker's KV events itself.

Real `kvroute sim` workers publish vLLM-format events on real ZMQ sockets; the gateway's index must
follow them: blocks a worker cached without the gateway's knowledge attract the prompt, a prefix
cache reset forgets them, and a removed worker's entries are purged.
"""
from __future__ import annotations

import json
import random
import time

import httpx
import pytest
from openai import OpenAI

from conftest import ADMIN_TOKEN, free_ports, kvroute_argv, wait_http

BLOCK = 32
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _prompt(seed: int, words: int = 300) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice("red green blue cyan teal gold grey pink".split()) for _ in range(words))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    from conftest import Proc

    log_dir = tmp_path_factory.mktemp("embedded")
    procs: list = []
    sims = {}
    try:
        ports = iter(free_ports(7))  # 3 per simulator (HTTP, events, replay), then the gateway
        for name in ("w0", "w1"):
            port, ev, rp = next(ports), next(ports), next(ports)
            events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                          "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"}
            p = Proc(name, kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny",
                                        "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK),
                                        "--num-gpu-blocks-override", "512", "--enable-prompt-tokens-details",
                                        "--speedup", "50", "--kv-events-config", json.dumps(events_cfg)), log_dir)
            procs.append(p)
            sims[name] = {"id": name, "url": f"http://127.0.0.1:{port}", "model": "tiny",
                          "events": f"tcp://127.0.0.1:{ev}", "replay": f"tcp://127.0.0.1:{rp}"}
            wait_http(sims[name]["url"] + "/health", p)
        gw_port = next(ports)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
               "index": {"backend": "memory"}, "workers": list(sims.values()),
               # no load scrape noise: decisions depend on the index only
               "policy": {"name": "kv_aware"}}
        cfg_path = log_dir / "gw.yaml"
        cfg_path.write_text(json.dumps(cfg))
        gw = Proc("gateway", kvroute_argv("serve", "--config", str(cfg_path)), log_dir)
        procs.append(gw)
        base = f"http://127.0.0.1:{gw_port}"
        wait_http(base + "/health", gw)
        yield base, sims
    finally:
        for p in reversed(procs):
            p.stop()


def _index(base: str) -> dict:
    r = httpx.get(base + "/admin/index", headers=AUTH)
    assert r.status_code == 200
    return r.json()["workers"]


def _wait(cond, timeout_s: float = 10.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    return cond()


def test_subscribes_to_every_worker(cluster):
    base, _ = cluster
    workers = _wait(lambda: all((w.get("kv_events") or {}).get("connected") for w in _index(base).values())
                    and _index(base))
    assert set(workers) == {"w0", "w1"}
    for w in workers.values():
        assert w["kv_events"]["connected"] is True


def test_blocks_cached_behind_the_gateways_back_attract_the_prompt(cluster):
    base, sims = cluster
    prompt = _prompt(1)
    direct = httpx.post(sims["w1"]["url"] + "/v1/completions",
                        json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).json()
    n_tokens = direct["usage"]["prompt_tokens"]
    full_blocks = n_tokens // BLOCK
    assert full_blocks >= 4
    # the events reach the gateway's index: w1 now holds every full block on gpu
    assert _wait(lambda: _index(base)["w1"]["blocks"]["gpu"] >= full_blocks)
    explain = httpx.post(base + "/admin/explain", headers=AUTH,
                         json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).json()
    by_worker = {c["worker"]: c for c in explain["candidates"]}
    assert explain["chosen"] == "w1"
    assert by_worker["w1"]["matched_blocks"]["gpu"] == full_blocks
    assert by_worker["w0"]["matched_blocks"]["gpu"] == 0
    cli = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = cli.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=1)
    assert r.headers["x-kvroute-worker"] == "w1"
    # vLLM caps a hit at prompt_len - 1 tokens; here the prompt is not block aligned, so all blocks hit
    assert r.parse().usage.prompt_tokens_details.cached_tokens == min(full_blocks * BLOCK, n_tokens - 1) // BLOCK * BLOCK


def test_reset_prefix_cache_clears_the_workers_entries(cluster):
    base, sims = cluster
    held = httpx.post(sims["w1"]["url"] + "/v1/completions",  # w1 holds a prompt of its own
                      json={"model": "tiny", "prompt": _prompt(1), "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert _wait(lambda: _index(base)["w1"]["blocks"]["gpu"] >= held // BLOCK >= 4)
    clears = _index(base)["w1"]["kv_events"]["clears"]
    assert httpx.post(sims["w1"]["url"] + "/reset_prefix_cache").status_code == 200
    # as in vLLM, AllBlocksCleared goes out with the next engine step's batch
    other = _prompt(9, words=100)
    n = httpx.post(sims["w1"]["url"] + "/v1/completions",
                   json={"model": "tiny", "prompt": other, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert _wait(lambda: _index(base)["w1"]["kv_events"]["clears"] == clears + 1)
    assert _wait(lambda: _index(base)["w1"]["blocks"]["gpu"] == n // BLOCK)
    explain = httpx.post(base + "/admin/explain", headers=AUTH,
                         json={"model": "tiny", "prompt": _prompt(1), "max_tokens": 1}).json()
    assert all(c["matched_blocks"]["gpu"] == 0 for c in explain["candidates"] if c["worker"] == "w1")


def test_removed_worker_is_purged_and_a_readded_worker_recovers_its_state_by_replay(cluster):
    base, sims = cluster
    prompt = _prompt(2)
    n = httpx.post(sims["w0"]["url"] + "/v1/completions",
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert _wait(lambda: _index(base)["w0"]["blocks"]["gpu"] == n // BLOCK)
    assert httpx.delete(base + "/admin/workers/w0", headers=AUTH).status_code == 200
    assert "w0" not in _index(base)
    explain = httpx.post(base + "/admin/explain", headers=AUTH,
                         json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).json()
    assert [c["worker"] for c in explain["candidates"]] == ["w1"]
    r = httpx.post(base + "/admin/workers", headers=AUTH, json=sims["w0"])
    assert r.status_code == 201
    # the new subscription joins mid-stream (seq > 0), asks the replay socket for everything
    # from seq 0 and rebuilds the worker's blocks exactly
    assert _wait(lambda: _index(base).get("w0", {}).get("blocks", {}).get("gpu") == n // BLOCK)
    state = _index(base)["w0"]["kv_events"]
    assert state["replays"] >= 1
    explain = httpx.post(base + "/admin/explain", headers=AUTH,
                         json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).json()
    assert explain["chosen"] == "w0"
