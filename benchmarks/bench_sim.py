#!/usr/bin/env python3
"""How many short requests per second one ``kvroute sim`` serves, its memory, and how many sims fit.

Starts one sim (tiny model, ``--speedup 1000``), warms it up, then for each concurrency sends short
completions (non-streaming and streaming, ~40-token prompts, 8 output tokens) with aiohttp and
prints requests/s side by side, plus the sim's RSS, its CPU seconds per request, its idle CPU, start
time, and how many sims this machine holds by memory and by idle CPU (goal: 16).

    python benchmarks/bench_sim.py [--requests 2000] [--concurrency 1,16,64] [--speedup 1000]
        [--json FILE] [--plot DIR]

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``throughput`` (per
concurrency and mode: ``requests_per_s``, ``sim_cpu_per_request_ms``,
``client_cpu_per_request_ms``) and table ``sim`` (one row: ``start_s``, ``rss_idle_bytes``,
``rss_loaded_bytes``, ``idle_cpu_core_share``, ``mem_available_bytes``, ``sims_fit_by_memory``,
...). ``--plot DIR`` draws ``requests_per_s.png``, ``cpu_per_request.png`` and ``rss.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from lab.figures import add_chart, add_output_args, add_table, emit, new_figures
from kvroute.up import free_ports

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny-model"
GOAL_SIMS = 16
IDLE_WINDOW_S = 5.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


async def load(url: str, n: int, concurrency: int, stream: bool) -> tuple[float, float]:
    """Send ``n`` requests with ``concurrency`` in flight; returns (requests/s, client CPU ms/req)."""
    body = {"model": "tiny", "prompt": "", "max_tokens": 8, "ignore_eos": True, "stream": stream}
    counter = iter(range(n))
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker() -> None:
            for i in counter:
                b = dict(body, prompt=f"request {i} of the benchmark: " + "word " * 30)
                async with session.post(url + "/v1/completions", json=b) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

        t0, p0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0), (time.process_time() - p0) / n * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--speedup", type=float, default=1000.0)
    add_output_args(ap)
    args = ap.parse_args()
    fig = new_figures("bench_sim", args)
    port, ev_port = free_ports(2)
    argv = [sys.executable, "-m", "kvroute", "sim", "--model", str(TINY), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--block-size", "32", "--max-model-len", "4096",
            "--num-gpu-blocks-override", "4096", "--speedup", str(args.speedup),
            "--enable-prompt-tokens-details", "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{ev_port}"})]
    t0 = time.perf_counter()
    proc = subprocess.Popen(["timeout", "-s", "KILL", "900"] + argv, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
            if time.perf_counter() - t0 > 60 or proc.poll() is not None:
                print("sim did not start", file=sys.stderr)
                return 1
        start_s = time.perf_counter() - t0
        pid = int(subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()[0])  # the python under timeout
        rss_idle = rss_bytes(pid)
        time.sleep(1.0)  # let start-up finish
        c0 = cpu_s(pid)
        time.sleep(IDLE_WINDOW_S)
        idle_cpu_frac = (cpu_s(pid) - c0) / IDLE_WINDOW_S
        asyncio.run(load(url, 200, 8, False))  # warm-up (tokenizer, caches)
        rows = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            for stream in (False, True):
                c0 = cpu_s(pid)
                rps, client_ms = asyncio.run(load(url, args.requests, c, stream))
                cpu_per_req_ms = (cpu_s(pid) - c0) / args.requests * 1000
                rows.append((c, "stream" if stream else "plain", rps, cpu_per_req_ms, client_ms))
        rss_loaded = rss_bytes(pid)
        print(f"kvroute sim, tiny model, --speedup {args.speedup:g}, {args.requests} requests per row, "
              f"~40-token prompts, 8 output tokens, client on the same {os.cpu_count()}-core machine")
        print(f"{'concurrency':>11} {'mode':>7} {'requests/s':>11} {'sim CPU ms/req':>15} {'client CPU ms/req':>18}")
        for c, mode, rps, cpu_ms, client_ms in rows:
            print(f"{c:>11} {mode:>7} {rps:>11.0f} {cpu_ms:>15.2f} {client_ms:>18.2f}")
        avail = mem_available_bytes()
        print(f"start time {start_s:.1f} s; RSS idle {rss_idle / 2**20:.0f} MiB, after load "
              f"{rss_loaded / 2**20:.0f} MiB; idle CPU {idle_cpu_frac * 100:.1f}% of a core")
        fit_mem = int(avail // max(rss_loaded, 1))
        print(f"sims that fit by memory ({avail / 2**30:.1f} GiB available): {fit_mem} "
              f"(goal {GOAL_SIMS}: {'ok' if fit_mem >= GOAL_SIMS else 'NOT met'}); "
              f"{GOAL_SIMS} idle sims use {GOAL_SIMS * idle_cpu_frac * 100:.0f}% of a core; under load "
              f"the machine's {os.cpu_count()} cores serve about "
              f"{os.cpu_count() * 1000 / max(min(r[3] for r in rows), 1e-9):.0f} short requests/s in total")
        add_table(fig, "throughput", [{"concurrency": c, "mode": mode, "requests": args.requests,
                                       "requests_per_s": rps, "sim_cpu_per_request_ms": cpu_ms,
                                       "client_cpu_per_request_ms": client_ms}
                                      for c, mode, rps, cpu_ms, client_ms in rows])
        add_table(fig, "sim", [{"sim": "kvroute sim", "start_s": start_s, "rss_idle_bytes": rss_idle,
                                "rss_loaded_bytes": rss_loaded, "idle_cpu_core_share": idle_cpu_frac,
                                "mem_available_bytes": avail, "sims_fit_by_memory": fit_mem, "goal_sims": GOAL_SIMS,
                                "goal_idle_sims_cpu_core_share": GOAL_SIMS * idle_cpu_frac,
                                "machine_short_requests_per_s": os.cpu_count() * 1000 / max(min(r[3] for r in rows),
                                                                                             1e-9)}])
        title = f"kvroute sim, tiny model, --speedup {args.speedup:g}, {args.requests} requests per bar"
        add_chart(fig, "bars", "requests_per_s.png", table="throughput", group_by="concurrency",
                  series_by="mode", values=["requests_per_s"], ylabel="requests/s", title=title + "; by concurrency")
        add_chart(fig, "bars", "cpu_per_request.png", table="throughput", group_by=["concurrency", "mode"],
                  values=["sim_cpu_per_request_ms", "client_cpu_per_request_ms"], ylabel="CPU ms per request",
                  title=title + "; by concurrency, mode")
        add_chart(fig, "bars", "rss.png", table="sim", group_by="sim", values=["rss_idle_bytes", "rss_loaded_bytes"],
                  scale=1 / 2**20, ylabel="RSS (MiB)", title="the sim's resident memory, idle and after the load")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
