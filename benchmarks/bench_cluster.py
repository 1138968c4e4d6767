#!/usr/bin/env python3
"""A large cluster on one host: ``kvroute up --workers 64`` (simulated workers, each with its
``kvroute agent`` writing a Redis index) behind a gateway of ``--processes 2``, replaying the
Mooncake conversation slice, and what it costs.

Printed (and written with ``--json``/``--plot``):

- routing quality: TTFT p50/p90/p99, prefix-hit rate against the infinite-cache ideal of the slice;
- gateway CPU per request: user + system CPU of the gateway's processes over the replay / requests,
  and the same beyond what the gateway spends with no traffic (measured for ``--idle-s`` first:
  health probes and load scrapes of every worker, per process, grow with the cluster);
- index lookups: the gateway's own ``kvroute_index_lookup_seconds`` (p50/p99 interpolated in its
  buckets, every process), and lookups timed here on an index built from the same config
  (``index.match`` of every prompt of the slice and of a 2,048-block prompt, p50/p99);
- events ingested per second: the agents' ``events_applied`` (``/admin/index``), over the replay;
- Redis memory (``INFO memory``: used_memory) and index bytes per block (used_memory after the run
  less before it, over the blocks the index holds, every worker and tier).

Usage: python benchmarks/bench_cluster.py [--workers 64] [--processes 2] [--limit 400]
       [--time-scale 2] [--json F] [--plot DIR]
Everything runs on loopback (its own redis-server) and stops by itself (each process has a deadline).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvbench.arrivals import Arrivals
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures
from lab.process_sampler import tree_cpu_s
from kvbench.runner import RunSettings, Target, run_target
from kvbench.workers import stop_groups, wait_ready
from kvroute.up import free_ports

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 3600
TOKEN = "bench"


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(["timeout", "-s", "KILL", str(DEADLINE_S)] + argv, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "KVROUTE_ADMIN_TOKEN": TOKEN})


def admin(base: str, path: str) -> dict:
    r = httpx.get(base + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    r.raise_for_status()
    return r.json()


def redis_info(url: str) -> dict:
    import redis

    return redis.Redis.from_url(url).info("memory")


def gateway_cpu_s(up: subprocess.Popen) -> float:
    """CPU seconds of the ``kvroute serve`` processes (supervisor and gateways) below ``kvroute up``."""
    return tree_cpu_s(up.pid, "serve")


def histogram_quantiles(metrics_text: str, name: str, qs: tuple[float, ...]) -> dict[float, float]:
    """Quantiles (seconds) of Prometheus histogram ``name`` summed over every series, by linear
    interpolation inside the bucket (as PromQL's histogram_quantile)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0.0
    out = {}
    for q in qs:
        rank, lo, lo_count = q * total, 0.0, 0.0
        out[q] = float("nan")
        for le in edges:
            if buckets[le] >= rank:
                hi = le if le != float("inf") else lo
                span = buckets[le] - lo_count
                out[q] = lo + (hi - lo) * ((rank - lo_count) / span if span else 0.0)
                break
            lo, lo_count = le, buckets[le]
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def time_lookups(index_cfg: dict, prompts: list[list[int]], block_size: int, model: str,
                       long_blocks: int, repeats: int, workers: list[str]) -> dict[str, list[float]]:
    """``index.match`` latency (ms) from a fresh index built from ``index_cfg`` (the gateway's),
    for every prompt's block keys, and for a ``long_blocks``-block prompt held whole by every one
    of ``workers`` (the worst case: written as speculative entries for 120 s, after the replay)."""
    from kvcore.block_keys import block_keys
    from kvcore.index import make_index

    index = make_index(index_cfg)
    await index.open()
    try:
        sync = getattr(index, "wait_synced", None)
        if sync is not None:
            await sync(60)
        keys = [block_keys(p, block_size, model) for p in prompts]
        rnd = random.Random(3)
        long_tokens = [rnd.randrange(5, 30000) for _ in range(long_blocks * block_size)]
        long_keys = block_keys(long_tokens, block_size, model)
        for w in workers:
            await index.store_speculative(w, long_keys, 120.0)
        long_name = f"{long_blocks}-block prompt held by {len(workers)} workers"
        if sync is not None:  # the mirror has applied the entries once a match sees them all
            deadline = time.monotonic() + 60
            while len((await index.match(long_keys))) < len(workers) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        out: dict[str, list[float]] = {"slice prompts": [], long_name: []}
        for _ in range(repeats):
            for k in keys:
                t0 = time.perf_counter()
                await index.match(k)
                out["slice prompts"].append((time.perf_counter() - t0) * 1e3)
            for _ in range(20):
                t0 = time.perf_counter()
                got = await index.match(long_keys)
                out[long_name].append((time.perf_counter() - t0) * 1e3)
        if min(m.total for m in got.values()) != long_blocks or len(got) != len(workers):
            raise RuntimeError("the long prompt is not held whole by every worker: the timing would be wrong")
        return out
    finally:
        await index.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--processes", type=int, default=2, help="gateway processes (kvroute serve --processes)")
    ap.add_argument("--model", default=str(ROOT / ".cache/models/small-seed0"), help="model directory (tokenizer)")
    ap.add_argument("--limit", type=int, default=400, help="requests of the Mooncake slice")
    ap.add_argument("--block-tokens", type=int, default=64, help="one-token words per 512-token trace block")
    ap.add_argument("--time-scale", type=float, default=2.0, help="arrivals at the trace's rate times this")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-gpu-blocks", type=int, default=3072, help="KV blocks per simulated worker")
    ap.add_argument("--speedup", type=float, default=4.0, help="the sims run this many times faster")
    ap.add_argument("--policy", default="ttft")
    ap.add_argument("--lookup-repeats", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds the gateway's idle CPU is measured before the replay")
    add_output_args(ap)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what was started (the finally below)
    redis_exe = shutil.which("redis-server")
    if redis_exe is None:
        print("bench_cluster: redis-server not on PATH (make install-system)", file=sys.stderr)
        return 1
    from kvcore.tokenization import PromptTokenizer
    from kvbench import trace
    from kvbench.words import OneTokenWords

    workload = trace.expand_trace(trace.read_trace(trace.DEFAULT_TRACE, args.limit),
                                  OneTokenWords(PromptTokenizer(args.model)), args.block_tokens,
                                  args.block_size, args.time_scale, None, None, None)
    tmp = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    procs: list[subprocess.Popen] = []
    figures = new_figures("bench_cluster", args)
    try:
        redis_port, gw_port = free_ports(2)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        procs.append(start([redis_exe, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no"], tmp / "redis.log"))
        deadline = time.monotonic() + 30
        while True:
            try:
                redis_info(redis_url)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        used_before = redis_info(redis_url)["used_memory"]
        t0 = time.monotonic()
        up = start([sys.executable, "-m", "kvroute", "up", "--workers", str(args.workers), "--model", args.model,
                    "--served-model-name", "small", "--port", str(gw_port), "--block-size", str(args.block_size),
                    "--index", redis_url, "--processes", str(args.processes), "--policy", args.policy,
                    "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--speedup", str(args.speedup),
                    "--max-model-len", "32768",
                    "--log-dir", str(tmp / "up"), "--ready-timeout-s", "1500"], tmp / "up.log")
        procs.append(up)
        base = f"http://127.0.0.1:{gw_port}"
        wait_ready(base + "/health/ready", up, tmp / "up.log", 1500)
        deadline = time.monotonic() + 300
        while sum(1 for w in admin(base, "/admin/workers")["workers"] if w["healthy"]) < args.workers:
            if time.monotonic() > deadline:
                raise TimeoutError("not every worker healthy")
            time.sleep(1)
        startup_s = time.monotonic() - t0
        print(f"{args.workers} sim workers + agents, Redis index, {args.processes} gateway processes: "
              f"ready in {startup_s:.0f} s; logs in {tmp}")
        idle0, idle_t0 = gateway_cpu_s(up), time.monotonic()
        time.sleep(args.idle_s)  # what the gateway spends with no traffic: probes, scrapes, index upkeep
        idle_cpu_share = (gateway_cpu_s(up) - idle0) / (time.monotonic() - idle_t0)
        events_before = sum((w.get("kv_events") or {}).get("events_applied", 0)
                            for w in admin(base, "/admin/index")["workers"].values())
        cpu_before, wall_before = gateway_cpu_s(up), time.monotonic()
        settings = RunSettings(model="small", arrivals=Arrivals("trace"), progress=False)
        result = run_target(Target("kvroute", base), workload, settings)
        replay_s = time.monotonic() - wall_before
        gateway_cpu = gateway_cpu_s(up) - cpu_before
        time.sleep(2)  # the last events reach the agents (figures only; nothing waits on it)
        index_state = admin(base, "/admin/index")
        events_after = sum((w.get("kv_events") or {}).get("events_applied", 0) for w in index_state["workers"].values())
        blocks = sum(sum(w["blocks"].values()) for w in index_state["workers"].values())
        used_after = redis_info(redis_url)["used_memory"]
        metrics_text = httpx.get(base + "/metrics", timeout=30).text
        q = histogram_quantiles(metrics_text, "kvroute_index_lookup_seconds", (0.5, 0.99))
        index_cfg = {"backend": "redis", "url": redis_url}
        lookups = asyncio.run(time_lookups(index_cfg, [r.prompt_token_ids for r in workload.requests],
                                           args.block_size, "small", 2048, args.lookup_repeats,
                                           list(index_state["workers"])))
        ok = result["requests"] - result["errors"]
        errors = [rec["error"] for rec in result["records"] if rec.get("error")]
        if errors:
            print(f"{len(errors)} request(s) failed, the first: {errors[0]}")
        rows = add_table(figures, "cluster", [{
            "workers": args.workers, "gateway_processes": args.processes, "requests": result["requests"],
            "errors": result["errors"], "ttft_p50_ms": result["ttft_ms"]["p50"], "ttft_p90_ms": result["ttft_ms"]["p90"],
            "ttft_p99_ms": result["ttft_ms"]["p99"], "hit_rate": result["hit_rate"],
            "ideal_hit_rate": result["ideal_hit_rate"], "hit_rate_of_ideal": result["hit_rate_of_ideal"],
            "gateway_cpu_per_request_ms": gateway_cpu / max(1, ok) * 1e3,
            "gateway_idle_cpu_share": idle_cpu_share,
            "gateway_cpu_per_request_net_ms": max(0.0, gateway_cpu - idle_cpu_share * replay_s) / max(1, ok) * 1e3,
            "events_applied_per_s": (events_after - events_before) / replay_s,
            "gateway_lookup_p50_ms": q[0.5] * 1e3, "gateway_lookup_p99_ms": q[0.99] * 1e3,
            "redis_used_memory_bytes": used_after, "index_blocks": blocks,
            "index_bytes_per_block": (used_after - used_before) / blocks if blocks else None,
            "startup_s": startup_s, "replay_s": replay_s}])
        lookup_rows = add_table(figures, "lookups", [
            {"prompt": name, "lookups": len(ms), "p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99),
             "mean_ms": statistics.fmean(ms)} for name, ms in lookups.items()])
        add_chart(figures, "bars", "lookups.png", table="lookups", group_by="prompt", values=["p50_ms", "p99_ms"],
                  ylabel="ms", title=f"index.match at {args.workers} workers (Redis index, as configured)")
        r = rows[0]
        print(f"replay: {r['requests']} requests ({r['errors']} errors) in {replay_s:.0f} s; TTFT p50/p90/p99 "
              f"{r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms; hit rate {r['hit_rate']:.3f} "
              f"of an ideal {r['ideal_hit_rate']:.3f} ({r['hit_rate_of_ideal']:.2f})")
        print(f"gateway CPU per request {r['gateway_cpu_per_request_ms']:.2f} ms ({args.processes} processes), "
              f"{r['gateway_cpu_per_request_net_ms']:.2f} ms beyond its idle use ({r['gateway_idle_cpu_share']:.0%} "
              f"of a CPU with no traffic: health probes and load scrapes of {args.workers} workers per process, "
              f"the index's upkeep); events applied {r['events_applied_per_s']:.0f}/s")
        print(f"gateway lookups (its histogram): p50 {r['gateway_lookup_p50_ms']:.3f} ms, p99 "
              f"{r['gateway_lookup_p99_ms']:.3f} ms")
        for row in lookup_rows:
            print(f"lookups timed here, {row['prompt']}: p50 {row['p50_ms']:.3f} ms, p99 {row['p99_ms']:.3f} ms "
                  f"({row['lookups']} lookups)")
        print(f"Redis used_memory {used_after / 2**20:.1f} MiB; {blocks} blocks in the index; "
              f"{r['index_bytes_per_block'] or float('nan'):.0f} bytes per block")
        emit(figures, args)
        return 0
    finally:
        stop_groups(procs, grace_s=60)  # kvroute up stops its 64 workers and agents first


if __name__ == "__main__":
    sys.exit(main())
