"""Prefill-decode disaggregation on real vLLM (CPU build) with vLLM's own ``NixlConnector``: one
prefill worker ``p`` and one decode worker ``d`` (``kv_role`` kv_both, ``kv_buffer_device`` cpu,
NIXL over UCX on loopback), and the gateway with P/D on, which never looks inside the params.

NIXL (the ``nixl`` wheel, installed into vLLM's venv by ``tools/install_vllm.py``) runs on this
machine's CPU build: ``d`` reads the prompt's KV from ``p``'s memory instead of computing it, and
says so in ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``. The reference
answer is the same request computed whole on ``p`` with a ``cache_salt`` of its own (nothing
cached); the salt does not change the output.

1. Through the gateway, a long prompt is split (both workers named), its greedy tokens and
   logprobs equal the reference, and ``d`` loaded every prompt token over NIXL and computed none.
2. A follow-up turn whose history ``d`` now holds skips the prefill leg, with the same answer as
   computed whole.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from e2e.conftest import vllm_python
from e2e.tier_checks import random_tokens, same_output
from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, wait_http, wait_until
from kvbench.workers import samples_by_source

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

BLOCK = 32
PROMPT_TOKENS = 900
MIN_PREFILL_TOKENS = 256
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _by_source(url: str) -> dict[str, float]:
    """Where the worker's prompt tokens came from (local_compute, local_cache_hit,
    external_kv_transfer)."""
    return samples_by_source(url, "vllm:prompt_tokens_by_source_total")


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v != before.get(k, 0.0)}


def _post(url: str, body: dict) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r


def _body(tokens: list[int]) -> dict:
    return {"model": "tiny", "prompt": tokens, "max_tokens": 8, "temperature": 0, "logprobs": 3}


def _last_decision(gateway: str) -> dict:
    """The gateway's latest decision (its P/D outcome and reason) and the workers' health, for a
    failure's message."""
    decision = httpx.get(gateway + "/admin/decisions?limit=1", headers=AUTH, timeout=30).json()["decisions"]
    workers = httpx.get(gateway + "/admin/workers", headers=AUTH, timeout=30).json()
    return {"decision": decision[0].get("pd") if decision else None, "workers": workers}


@pytest.fixture(scope="module")
def nixl_pair(tmp_path_factory):
    py = vllm_python()
    has_nixl = subprocess.run([py, "-c", "import nixl"], capture_output=True, timeout=120)
    if has_nixl.returncode != 0:
        pytest.fail(f"{py} cannot import nixl: `make install-vllm` installs it (tools/install_vllm.py)")
    model = ensure_model("tiny", py)
    log_dir = tmp_path_factory.mktemp("pd-nixl")
    procs: list[Proc] = []
    try:
        p_http, p_ev, p_side, d_http, d_ev, d_side, gw_port = free_ports(7)
        urls = {}
        for core, (wid, http, ev, side) in enumerate((("p", p_http, p_ev, p_side), ("d", d_http, d_ev, d_side))):
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "", "endpoint": f"tcp://*:{ev}"}
            argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(http),
                    "--max-model-len", "1024", "--block-size", str(BLOCK), "--enable-prefix-caching",
                    "--dtype", "bfloat16", "--enforce-eager", "--num-gpu-blocks-override", "256",
                    "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
                    "--kv-transfer-config", json.dumps(NIXL)]
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(min(core, os.cpu_count() - 1)),
                   "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
            procs.append(Proc(wid, argv, log_dir, env=env))
            urls[wid] = f"http://127.0.0.1:{http}"
        for proc, url in zip(procs, urls.values()):
            wait_http(url + "/health", proc, timeout_s=480)
            # vLLM-CPU 0.32's AMX attention (bfloat16, block size a multiple of 32) dies of SIGILL
            # when its process's first forward pass computes 1 or 2 tokens, as d's first NIXL
            # request would (899 tokens loaded, 1 computed): each worker serves a prompt first
            _post(url, _body(random_tokens(299, 100)))
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
               "models": [{"name": "tiny", "tokenizer": str(model), "block_size": BLOCK}],
               "workers": [{"id": "p", "url": urls["p"], "model": "tiny", "role": "prefill",
                            "events": f"tcp://127.0.0.1:{p_ev}"},
                           {"id": "d", "url": urls["d"], "model": "tiny", "role": "decode",
                            "events": f"tcp://127.0.0.1:{d_ev}"}],
               "policy": {"name": "ttft", "pd": {"enabled": True, "min_prefill_tokens": MIN_PREFILL_TOKENS}},
               # the suite's other vLLM servers share these 2 cores: a worker's /health may take
               # seconds, and d marked down would send turn 2 whole to p (no decode pool)
               "health": {"interval_s": 2, "timeout_s": 10, "fail_threshold": 5}}
        (log_dir / "gw.yaml").write_text(json.dumps(cfg))
        procs.append(Proc("gateway", kvroute_argv("serve", "--config", str(log_dir / "gw.yaml")), log_dir))
        gateway = f"http://127.0.0.1:{gw_port}"
        wait_http(gateway + "/health", procs[-1])
        yield urls, gateway
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_nixl_moves_the_prompt_and_the_follow_up_stays_on_d(nixl_pair):
    urls, gateway = nixl_pair
    first = _body(random_tokens(300, PROMPT_TOKENS))
    ref = _post(urls["p"], {**first, "cache_salt": "reference-1"}).json()
    assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] in (0, None)
    before = _by_source(urls["d"])
    r = _post(gateway, first)
    assert (r.headers["x-kvroute-worker"], r.headers.get("x-kvroute-prefill-worker")) == ("d", "p")
    same_output(ref, r.json())
    moved = _delta(_by_source(urls["d"]), before)
    assert moved == {"external_kv_transfer": PROMPT_TOKENS}, moved  # loaded over NIXL, none computed

    # turn 2: d holds the first prompt's 28 full blocks (its KV events say so); 32 + 4 tokens left
    # to compute, fewer than MIN_PREFILL_TOKENS: served whole by d, no prefill leg
    def d_holds() -> bool:
        workers = httpx.get(gateway + "/admin/index", headers=AUTH, timeout=30).json()["workers"]
        return workers.get("d", {}).get("blocks", {}).get("gpu", 0) >= PROMPT_TOKENS // BLOCK
    assert wait_until(d_holds, 60, "d's KV events in the index")
    follow = _body(first["prompt"] + random_tokens(301, 32))
    ref2 = _post(urls["p"], {**follow, "cache_salt": "reference-2"}).json()
    r2 = _post(gateway, follow)
    legs = (r2.headers["x-kvroute-worker"], r2.headers.get("x-kvroute-prefill-worker"))
    assert legs == ("d", None), (legs, _last_decision(gateway))
    same_output(ref2, r2.json())
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_TOKENS // BLOCK * BLOCK
