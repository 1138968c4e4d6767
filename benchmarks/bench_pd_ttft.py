#!/usr/bin/env python3
"""TTFT of a 2k-token prompt served prefill-decode disaggregated (1 prefill worker, 1 decode
worker, real vLLM CPU build) against the same prompt computed whole on one worker, side by side.

    KVR_VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python benchmarks/bench_pd_ttft.py \\
        [--connector kvroute|nixl|both] [--rounds 8] [--prompt-tokens 2048] [--json FILE]

Set-ups (every process runs in its own session under ``--deadline-s`` and is killed at the end):

- ``kvroute``: ``kvroute up --engine vllm --prefill-workers 1 --decode-workers 1 --cpu-tier-bytes``
  (the "small" generated model, block 32, ``--enforce-eager``): workers ``p0`` and ``d0`` with our
  connector and one agent each, the gateway with P/D on. ``pd`` = a fresh prompt through the
  gateway, which must answer ``x-kvroute-prefill-worker: p0`` and ``x-kvroute-worker: d0``.
- ``nixl``: two vLLM servers with vLLM's ``NixlConnector`` (``kv_role`` kv_both, ``kv_buffer_device``
  cpu, UCX over loopback); the two legs of vLLM's protocol are sent by this script as the gateway
  sends them: ``pd`` = from sending the prefill leg to the decode leg's first token.

In each round, in an order alternating per round, with fresh random tokens each (nothing cached by
accident): ``pd`` as above, and ``whole``, a prompt sent straight to the decode worker and
computed there (the unified worker's recompute). TTFT = seconds to the first SSE chunk of a
streaming completion (max_tokens 2, temperature 0), read to its end before the next request; a
pause of ``--settle-s`` between requests lets the previous one's after-work finish. The script
prints each case's median and the ratio pd / whole per set-up and round, and for each ``pd``
request where the decode worker's prompt tokens came from (``vllm:prompt_tokens_by_source_total``
deltas: ``external_kv_transfer`` when the KV was loaded, ``local_compute`` when computed).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402
from kvbench.workers import samples_by_source  # noqa: E402
from kvroute.up import free_ports  # noqa: E402

BLOCK = 32
TOKEN = "bench-pd-ttft"
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


def free_port() -> int:
    return free_ports(1)[0]


def spawn(argv: list[str], log: Path, env: dict[str, str], deadline_s: int) -> subprocess.Popen:
    return subprocess.Popen(["timeout", "-s", "KILL", str(deadline_s), *argv], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def wait_ok(url: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s}s")


def prompt(rnd: random.Random, n: int) -> list[int]:
    return [10 + rnd.randrange(480) for _ in range(n)]


def ttft_s(url: str, body: dict, headers: dict | None = None) -> tuple[float, dict]:
    """Seconds to the first SSE chunk of ``body`` streamed from ``url``; the response headers."""
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data:") and first is None:
                first = time.perf_counter() - t0
    return first, dict(r.headers)


def sources(url: str) -> dict[str, float]:
    """The worker's ``vllm:prompt_tokens_by_source_total`` by source (local_compute,
    local_cache_hit, external_kv_transfer, ...): where its prompt tokens came from, summed."""
    return samples_by_source(url, "vllm:prompt_tokens_by_source_total", timeout_s=10)


def loaded(url: str, send):
    """``send()``'s result and what the worker at ``url`` says of its prompt tokens meanwhile
    (``{source: tokens}``): proof that a decode leg loaded the KV rather than computing it."""
    before = sources(url)
    out = send()
    after = sources(url)
    return out, {k: int(after[k] - before.get(k, 0.0)) for k in after if after[k] != before.get(k, 0.0)}


def body_of(tokens: list[int]) -> dict:
    return {"model": "small", "prompt": tokens, "max_tokens": 2, "temperature": 0}


def run_kvroute(args, model: Path, logs: Path) -> list[dict]:
    port = free_port()
    env = {"KVROUTE_ADMIN_TOKEN": TOKEN, "KVR_VLLM_PYTHON": args.vllm_python}
    argv = [sys.executable, "-m", "kvroute", "up", "--engine", "vllm", "--model", str(model),
            "--served-model-name", "small", "--prefill-workers", "1", "--decode-workers", "1",
            "--cpu-tier-bytes", str(args.cpu_tier_bytes), "--max-model-len", str(args.max_model_len),
            "--num-gpu-blocks-override", str(args.gpu_blocks), "--port", str(port),
            "--vllm-args", "--enforce-eager --dtype bfloat16", "--log-dir", str(logs / "up")]
    procs = [spawn(argv, logs / "up.log", env, args.deadline_s)]
    gw = f"http://127.0.0.1:{port}"
    try:
        wait_ok(gw + "/health", procs, 600)
        workers = httpx.get(gw + "/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}).json()["workers"]
        d_url = next(w["url"] for w in workers if w["id"] == "d0")

        def pd(tokens):
            (t, h), where = loaded(d_url, lambda: ttft_s(gw, body_of(tokens)))
            print(f"    kvroute decode leg: prompt tokens by source {where}", flush=True)
            if (h.get("x-kvroute-prefill-worker"), h.get("x-kvroute-worker")) != ("p0", "d0"):
                raise RuntimeError(f"not split: {h.get('x-kvroute-prefill-worker')} -> {h.get('x-kvroute-worker')}")
            return t
        return rounds(args, pd, lambda tokens: ttft_s(d_url, body_of(tokens))[0])
    finally:
        stop(procs)


def run_nixl(args, model: Path, logs: Path) -> list[dict]:
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    urls, procs = {}, []
    for core, name in enumerate(("p", "d")):
        port = free_port()
        argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", "small", "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(args.max_model_len), "--block-size", str(BLOCK), "--enable-prefix-caching",
                "--dtype", "bfloat16", "--enforce-eager", "--num-gpu-blocks-override", str(args.gpu_blocks),
                "--kv-transfer-config", json.dumps(kv)]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
               "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        procs.append(spawn(argv, logs / f"nixl-{name}.log", env, args.deadline_s))
        urls[name] = f"http://127.0.0.1:{port}"
    try:
        for url in urls.values():
            wait_ok(url + "/health", procs, 600)

        def pd(tokens):
            t0 = time.perf_counter()
            pre = httpx.post(urls["p"] + "/v1/completions", timeout=300, json={
                **body_of(tokens), "max_tokens": 1, "kv_transfer_params": dict(PREFILL_LEG)}).json()
            params = pre.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise RuntimeError(f"the prefill leg answered no kv_transfer_params: {str(pre)[:300]}")
            prefill_s = time.perf_counter() - t0
            (t, _), where = loaded(urls["d"], lambda: ttft_s(urls["d"], {**body_of(tokens), "kv_transfer_params": params}))
            print(f"    nixl decode leg: prompt tokens by source {where}", flush=True)
            return prefill_s + t
        return rounds(args, pd, lambda tokens: ttft_s(urls["d"], body_of(tokens))[0])
    finally:
        stop(procs)


def rounds(args, pd, whole) -> list[dict]:
    rnd = random.Random(args.seed)
    for _ in range(2):  # warm-up: first requests pay one-time costs on both paths
        pd(prompt(rnd, args.prompt_tokens))
        whole(prompt(rnd, args.prompt_tokens))
    out = []
    for i in range(args.rounds):
        row = {}
        for case in (("pd", "whole") if i % 2 == 0 else ("whole", "pd")):
            time.sleep(args.settle_s)
            row[case] = (pd if case == "pd" else whole)(prompt(rnd, args.prompt_tokens))
        row["ratio"] = row["pd"] / row["whole"]
        print(f"  round {i}: pd {row['pd'] * 1000:.0f} ms, whole {row['whole'] * 1000:.0f} ms, "
              f"ratio {row['ratio']:.2f}", flush=True)
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("KVR_VLLM_PYTHON", "python"))
    ap.add_argument("--connector", choices=("kvroute", "nixl", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-blocks", type=int, default=1024)
    ap.add_argument("--cpu-tier-bytes", type=int, default=1 << 30)
    ap.add_argument("--settle-s", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--deadline-s", type=int, default=1800)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = ensure_model("small", args.vllm_python)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-pd-ttft-") as tmp:
        for name in (("kvroute", "nixl") if args.connector == "both" else (args.connector,)):
            logs = Path(tmp) / name
            logs.mkdir()
            print(f"{name}: 1 prefill + 1 decode worker, {args.prompt_tokens}-token prompts, {args.rounds} rounds",
                  flush=True)
            try:
                rows = (run_kvroute if name == "kvroute" else run_nixl)(args, model, logs)
            except Exception as e:  # noqa: BLE001 - report the set-up's failure with its logs, go on
                tails = {p.name: p.read_text(errors="replace")[-1500:] for p in logs.glob("*.log")}
                print(f"{name}: FAILED: {e}\n" + "\n".join(f"--- {k}\n{v}" for k, v in tails.items()))
                results[name] = {"error": str(e)}
                continue
            med = {k: statistics.median(r[k] for r in rows) for k in ("pd", "whole", "ratio")}
            print(f"{name}: median pd {med['pd'] * 1000:.0f} ms, whole {med['whole'] * 1000:.0f} ms, "
                  f"ratio of medians {med['pd'] / med['whole']:.2f}, median ratio {med['ratio']:.2f}", flush=True)
            results[name] = {"rounds": rows, "median": med}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
