"""Peer pull in the default set-up on two real vLLM servers (CPU build): ``kvroute up --engine vllm
--cpu-tier-bytes N`` with the gateway's embedded index (no Redis). `kvroute up` starts an agent per
worker that owns its tiers and uses the gateway as its index; worker w1 then loads a prefix that
w0 computed from w0's agent instead of recomputing it, with the same greedy output.
(test_peer_pull_vllm.py covers the Redis index, corruption and restarts.)"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx

from e2e.conftest import vllm_python
from e2e.tier_checks import TINY_BLOCK_BYTES, cached_by_source, random_tokens, same_output
from conftest import ADMIN_TOKEN, Proc, free_port, kvroute_argv, wait_until

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

BLOCK = 32
PROMPT_TOKENS = 900                 # 28 creditable blocks: (900 - 1) // 32
N = 28
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_kvroute_up_pulls_between_workers_with_the_embedded_index(tmp_path):
    py = vllm_python()
    model = ensure_model("tiny", py)
    port = free_port()
    up = Proc("up", kvroute_argv(
        "up", "--engine", "vllm", "--vllm-python", py, "--workers", "2", "--model", str(model),
        "--served-model-name", "tiny", "--port", str(port), "--block-size", str(BLOCK),
        "--num-gpu-blocks-override", "96", "--max-model-len", "1024", "--cpu-tier-bytes", str(400 * TINY_BLOCK_BYTES),
        # which bytes a pull brings is checked, not how fast: on two shared cores the agent may take
        # longer than the default 100 ms to say which peer holds the prefix (vLLM then computes it)
        "--tier-option", "peer_locate_timeout_ms=5000",
        "--vllm-args", "--enforce-eager --dtype bfloat16", "--log-dir", str(tmp_path / "up"),
        "--ready-timeout-s", "600"), tmp_path, env={"KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN}, deadline_s=900)
    try:
        def ready():
            if not up.alive():
                raise AssertionError(f"kvroute up exited:\n{up.log_tail()}")
            m = re.search(r"gateway ready: (http://\S+)/v1", up.log_path.read_text(errors="replace"))
            return m.group(1) if m else None
        base = wait_until(ready, 660, "kvroute up ready", interval_s=1.0)

        def admin(method: str, path: str, body: dict | None = None) -> dict:
            r = httpx.request(method, base + path, headers=AUTH, json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        def serving() -> dict | None:
            ws = {w["id"]: w for w in admin("GET", "/admin/workers")["workers"]}
            return ws if all((w["peer"] or {}).get("fingerprint") and w["peer"]["serve"] for w in ws.values()) else None
        workers = wait_until(serving, 60, "both agents' peer states after their connectors' hellos")
        assert workers["w0"]["peer"]["fingerprint"] == workers["w1"]["peer"]["fingerprint"]

        tokens = random_tokens(11, PROMPT_TOKENS)
        body = {"model": "tiny", "prompt": tokens, "max_tokens": 8, "temperature": 0, "logprobs": 3}
        first = httpx.post(workers["w0"]["url"] + "/v1/completions", json=body, timeout=300)
        assert first.status_code == 200 and not (first.json()["usage"].get("prompt_tokens_details") or {}).get(
            "cached_tokens")
        # the connector saves every computed prompt block in w0's CPU tier; the gateway hears it
        wait_until(lambda: admin("GET", "/admin/index")["workers"]["w0"]["blocks"]["cpu"] >= N, 60,
                   "w0's blocks in its CPU tier, by the gateway's index")
        assert admin("POST", "/admin/workers/w0/drain", {})["draining"] is True

        explain = admin("POST", "/admin/explain", {"model": "tiny", "prompt": tokens, "max_tokens": 1})
        w1 = next(c for c in explain["candidates"] if c["worker"] == "w1")
        assert (explain["chosen"], w1["peer_blocks"], w1["peer_worker"]) == ("w1", N, "w0")

        before = cached_by_source(workers["w1"]["url"]).get("p2p", 0.0)
        r = httpx.post(base + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200 and r.headers["x-kvroute-worker"] == "w1"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == N * BLOCK
        same_output(first.json(), r.json())
        assert cached_by_source(workers["w1"]["url"]).get("p2p", 0.0) - before == N * BLOCK
        agent_log = (tmp_path / "up" / "agent-w1.log").read_text(errors="replace")
        assert "published to gateway" in agent_log
    finally:
        up.stop(timeout_s=60)
