"""Small HTTP helpers for a running vLLM OpenAI server, shared by the e2e tests and benchmarks.

Uses httpx and prometheus-client (the gateway's dependencies), nothing from vLLM.
"""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_samples(url: str, timeout_s: float = 30) -> dict[str, float]:
    """``GET url/metrics`` as ``sample name -> value`` summed over label sets (e.g.
    ``vllm:prefix_cache_hits_total``, ``vllm:num_requests_running``)."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def reset_prefix_cache(url: str, model: str, timeout_s: float = 60) -> None:
    """Empty the server's prefix cache (``POST /reset_prefix_cache``, needs
    ``VLLM_SERVER_DEV_MODE=1``), retrying while vLLM answers ``{"success": false}`` (blocks of a
    finished request not freed yet). vLLM publishes the ``AllBlocksCleared`` KV event with its next
    engine step, so one request shorter than a block (which stores nothing) follows.
    Raises TimeoutError after ``timeout_s``, httpx.HTTPError on transport errors."""
    end = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url.rstrip("/") + "/reset_prefix_cache", timeout=timeout_s)
        r.raise_for_status()
        if r.json().get("success"):
            break
        if time.monotonic() > end:
            raise TimeoutError(f"{url}: /reset_prefix_cache kept failing for {timeout_s}s")
        time.sleep(0.25)
    r = httpx.post(url.rstrip("/") + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
                   timeout=timeout_s)
    r.raise_for_status()
