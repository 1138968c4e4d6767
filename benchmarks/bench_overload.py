#!/usr/bin/env python3
"""Goodput at twice the cluster's capacity, with and without admission control (issue 12).

``--workers`` simulated vLLM servers (``kvroute sim``, each running at most ``--max-num-seqs``
sequences; every request streams ``--output-tokens`` tokens at ``--decode-ms`` per step, so a
worker serves about max_num_seqs / (output_tokens x decode_ms) requests/s) sit behind two
gateways (``kvroute serve``) at once: one with ``admission: {max_in_flight_per_worker: K,
max_queued: Q, queue_timeout_s: T}`` and one without.

1. Idle TTFT: ``--idle-requests`` requests one after another (through the plain gateway).
2. Capacity: Poisson arrivals at rising fractions of the nominal capacity, ``--step-s`` each,
   through the plain gateway; capacity = the highest rate whose TTFT p50 stays within
   ``--near-idle-ms`` of the idle p50 (default: 4 decode steps, since under continuous batching a
   newcomer's first token waits for the step under way and shares its own step with the decodes)
   with every request completed.
3. Overload: Poisson arrivals at ``--overload`` x capacity for ``--window-s`` (open loop: a request
   is sent at its time whatever happened to the others; the same seeded times for both), through
   the admission gateway, then (once the workers are idle again) through the plain one. Every
   request is waited for. Printed per gateway: offered rate, completed, 429s, TTFT p50/p99 of the
   completed requests, and goodput = requests completed with TTFT <= ``--ttft-target-s``, per
   second of the arrival window.

Usage: .venv/bin/python benchmarks/bench_overload.py [--window-s 30] [--workers 2] [--json out.json]
       [--plot DIR]
Everything runs on loopback and stops by itself (each process has a deadline). The figures are
wall-clock: on a busy machine run it alone.

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``capacity`` (one row:
``idle_ttft_p50_ms``, ``nominal_per_s``, ``capacity_per_s``, ``offered_per_s``), table ``sweep``
(per rate: ``rate_per_s``, ``completed``, ``ttft_p50_ms``, ``ttft_p99_ms``, ``near_idle``), table
``overload`` (per gateway: ``offered_per_s``, ``completed``, ``rejected_429``, ``ttft_p50_ms``,
``ttft_p99_ms``, ``goodput_per_s``, ``drain_s``), ``samples.ttft_ms`` (every completed overload
request's TTFT per gateway) and, as before, ``args`` and the raw figures (``idle_ttft_p50_s``,
``capacity_rps``, ``sweep``, ``runs``, ...). ``--plot DIR`` draws ``goodput.png``,
``overload_ttft.png``, ``ttft_cdf.png`` (TTFT CDF per gateway under overload) and
``capacity_sweep.png`` (TTFT p50/p99 against the offered rate).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import yaml

from lab.figures import (add_chart, add_output_args, add_samples, add_series, add_table, emit,
                                   new_figures)
from kvbench.stats import percentile
from kvbench.workers import wait_ready
from kvroute.up import free_ports

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests/fixtures/tiny-model"
DEADLINE_S = 3600
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


# ---- processes ------------------------------------------------------------------------------------
def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(["timeout", "-s", "KILL", str(DEADLINE_S)] + argv, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "KVROUTE_ADMIN_TOKEN": "bench", "KVROUTE_API_KEYS": ""})


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def engine_busy(sim_urls: list[str]) -> float:
    """Requests running or waiting over every sim (their vLLM gauges)."""
    total = 0.0
    for url in sim_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_idle(sim_urls: list[str], timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while engine_busy(sim_urls) > 0:
        if time.monotonic() > end:
            raise TimeoutError("workers still busy")
        await asyncio.sleep(0.2)


# ---- load -----------------------------------------------------------------------------------------
def body(i: int, args) -> bytes:
    rnd = random.Random(i)
    prompt = f"request {i}: " + " ".join(rnd.choice(WORDS) for _ in range(args.prompt_words))
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": prompt}], "stream": True,
                       "max_tokens": args.output_tokens, "ignore_eos": True}).encode()


async def one(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, float | None, str | None]:
    """``(status, TTFT s or None, worker)``: TTFT = first SSE chunk carrying generated text."""
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        worker = r.headers.get("x-kvroute-worker")
        if r.status != 200:
            await r.read()
            return r.status, None, worker
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                ttft = time.perf_counter() - t0
    return 200, ttft, worker


async def open_loop(session, url: str, rate: float, window_s: float, seed: int, args, first_id: int) -> dict:
    """Poisson arrivals at ``rate`` for ``window_s``; waits for every request. Figures per request."""
    rnd = random.Random(seed)
    times, t = [], rnd.expovariate(rate)
    while t < window_s:
        times.append(t)
        t += rnd.expovariate(rate)
    t0 = time.perf_counter()

    async def fire(k: int, at: float):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            return await one(session, url, body(first_id + k, args))
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}", None, None

    results = await asyncio.gather(*[fire(k, at) for k, at in enumerate(times)])
    return {"sent": len(times), "wall_s": time.perf_counter() - t0, "results": results}


def figures(run: dict, window_s: float, target_s: float) -> dict:
    ttfts = [tt for st, tt, _ in run["results"] if st == 200 and tt is not None]
    statuses: dict[str, int] = {}
    workers: dict[str, int] = {}
    for st, _, w in run["results"]:
        statuses[str(st)] = statuses.get(str(st), 0) + 1
        if st == 200:
            workers[w] = workers.get(w, 0) + 1
    good = sum(1 for tt in ttfts if tt <= target_s)
    return {"offered_rps": run["sent"] / window_s, "sent": run["sent"], "completed": statuses.get("200", 0),
            "rejected_429": statuses.get("429", 0),
            "other": {k: v for k, v in statuses.items() if k not in ("200", "429")},
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "good": good, "goodput_rps": good / window_s, "per_worker": dict(sorted(workers.items())),
            "drain_s": run["wall_s"] - window_s}


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def to_ms(v: float | None) -> float | None:
    """Seconds to milliseconds (None stays None)."""
    return None if v is None else v * 1000


async def bench(args, gw_plain: str, gw_adm: str, sims: list[str], fig: dict) -> dict:
    """Idle TTFT, the capacity sweep and the overload runs (see the module docstring); prints the
    sweep, adds every completed overload request's TTFT to ``fig["samples"]["ttft_ms"]`` and
    returns the figures."""
    conn = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        url = gw_plain + "/v1/chat/completions"
        for k in range(3):  # warm-up (tokenizers, connections)
            await one(session, url, body(-1 - k, args))
        idle = []
        for k in range(args.idle_requests):
            st, tt, _ = await one(session, url, body(10_000 + k, args))
            assert st == 200 and tt is not None, st
            idle.append(tt)
        idle_p50 = percentile(idle, 50)
        service_s = args.output_tokens * args.decode_ms / 1000
        nominal = args.workers * args.max_num_seqs / service_s
        print(f"idle TTFT p50 {ms(idle_p50)} ms over {args.idle_requests} requests; nominal capacity "
              f"{nominal:.1f} req/s ({args.workers} workers x {args.max_num_seqs} seqs / {service_s:.2f} s)")

        sweep, capacity, next_id = [], None, 100_000
        near_ms = args.near_idle_ms if args.near_idle_ms is not None else 4 * args.decode_ms
        print(f"\ncapacity sweep ({args.step_s:g} s per rate, plain gateway): near idle = TTFT p50 <= "
              f"idle + {near_ms:g} ms")
        print(f"{'rate/s':>8} {'done':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}  per worker")
        for frac in args.sweep:
            rate = frac * nominal
            await wait_idle(sims)
            f = figures(await open_loop(session, url, rate, args.step_s, 7, args, next_id), args.step_s, 1e9)
            next_id += f["sent"]
            near = f["completed"] == f["sent"] and f["ttft_p50_s"] <= idle_p50 + near_ms / 1000
            sweep.append({"rate": rate, **f, "near_idle": near})
            print(f"{rate:8.1f} {f['completed']:>6} {ms(f['ttft_p50_s']):>12} {ms(f['ttft_p99_s']):>12}  "
                  f"{f['per_worker']}{'' if near else '   (beyond)'}")
            if near:
                capacity = rate
            else:
                break
        if capacity is None:
            raise SystemExit("even the lowest sweep rate is beyond capacity; lower --sweep")

        offered = args.overload * capacity
        out = {}
        for name, gw in (("admission", gw_adm), ("no admission", gw_plain)):
            await wait_idle(sims)
            run = await open_loop(session, gw + "/v1/chat/completions", offered, args.window_s, 99, args, next_id)
            next_id += run["sent"]
            out[name] = figures(run, args.window_s, args.ttft_target_s)
            add_samples(fig, "ttft_ms", name,
                        [tt * 1000 for st, tt, _ in run["results"] if st == 200 and tt is not None])
        return {"idle_ttft_p50_s": idle_p50, "nominal_rps": nominal, "capacity_rps": capacity, "sweep": sweep,
                "offered_rps": offered, "runs": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=10)
    p.add_argument("--decode-ms", type=float, default=40.0, help="simulated decode step (speedup 1)")
    p.add_argument("--prefill-overhead-ms", type=float, default=5.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    p.add_argument("--prompt-words", type=int, default=40)
    p.add_argument("--idle-requests", type=int, default=20)
    p.add_argument("--sweep", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1],
                   help="capacity sweep rates, as fractions of the nominal capacity")
    p.add_argument("--step-s", type=float, default=15.0)
    p.add_argument("--near-idle-ms", type=float, default=None, help="default: 4 x --decode-ms")
    p.add_argument("--overload", type=float, default=2.0, help="offered rate / measured capacity")
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--ttft-target-s", type=float, default=1.0)
    p.add_argument("--max-in-flight-per-worker", type=int, default=None, help="K (default: --max-num-seqs)")
    p.add_argument("--max-queued", type=int, default=None, help="Q (default: K x workers)")
    p.add_argument("--queue-timeout-s", type=float, default=0.5, help="T")
    add_output_args(p)
    args = p.parse_args()
    fig = new_figures("bench_overload", args)
    k = args.max_in_flight_per_worker or args.max_num_seqs
    q = args.max_queued if args.max_queued is not None else k * args.workers
    admission = {"max_in_flight_per_worker": k, "max_queued": q, "queue_timeout_s": args.queue_timeout_s}

    log_dir = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    ports = free_ports(args.workers + 2)
    procs: list[subprocess.Popen] = []
    try:
        sims = []
        for i, port in enumerate(ports[:args.workers]):
            log = log_dir / f"sim{i}.log"
            proc = start([sys.executable, "-m", "kvroute", "sim", "--model", str(TINY), "--served-model-name", "tiny",
                          "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
                          "--max-num-seqs", str(args.max_num_seqs), "--decode-ms-per-token", str(args.decode_ms),
                          "--decode-ms-per-seq", "0", "--prefill-overhead-ms", str(args.prefill_overhead_ms),
                          "--prefill-ms-per-token", str(args.prefill_ms_per_token), "--seed", str(i)], log)
            procs.append(proc)
            sims.append((f"http://127.0.0.1:{port}", proc, log))
        for url, proc, log in sims:
            wait_ready(url + "/health", proc, log)
        gws = {}
        for name, port, adm in (("plain", ports[-2], None), ("admission", ports[-1], admission)):
            cfg = {"listen": {"host": "127.0.0.1", "port": port},
                   "models": [{"name": "tiny", "tokenizer": str(TINY), "block_size": 32}],
                   "workers": [{"id": f"s{i}", "url": url, "model": "tiny"} for i, (url, _, _) in enumerate(sims)],
                   "timeouts": {"first_byte_s": 600}}
            if adm:
                cfg["admission"] = adm
            path = log_dir / f"gateway-{name}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            log = log_dir / f"gateway-{name}.log"
            proc = start([sys.executable, "-m", "kvroute", "serve", "--config", str(path)], log)
            procs.append(proc)
            gws[name] = f"http://127.0.0.1:{port}"
            wait_ready(gws[name] + "/health", proc, log)
        res = asyncio.run(bench(args, gws["plain"], gws["admission"], [u for u, _, _ in sims], fig))
    finally:
        for proc in reversed(procs):
            stop(proc)

    print(f"\noverload: Poisson {res['offered_rps']:.1f} req/s offered ({args.overload:g} x measured capacity "
          f"{res['capacity_rps']:.1f}) for {args.window_s:g} s; admission {admission}; goodput = completed with "
          f"TTFT <= {args.ttft_target_s:g} s, per second of the window")
    print(f"{'gateway':<14}{'offered/s':>10}{'sent':>6}{'done':>6}{'429':>6}{'other':>7}{'TTFT p50 ms':>13}"
          f"{'TTFT p99 ms':>13}{'goodput/s':>11}{'drain s':>9}")
    for name, f in res["runs"].items():
        print(f"{name:<14}{f['offered_rps']:>10.1f}{f['sent']:>6}{f['completed']:>6}{f['rejected_429']:>6}"
              f"{sum(f['other'].values()):>7}{ms(f['ttft_p50_s']):>13}{ms(f['ttft_p99_s']):>13}"
              f"{f['goodput_rps']:>11.1f}{f['drain_s']:>9.1f}")
    add_table(fig, "capacity", [{"idle_ttft_p50_ms": to_ms(res["idle_ttft_p50_s"]), "nominal_per_s": res["nominal_rps"],
                                 "capacity_per_s": res["capacity_rps"], "offered_per_s": res["offered_rps"],
                                 "ttft_target_ms": args.ttft_target_s * 1000, "window_s": args.window_s}])
    add_table(fig, "sweep", [{"rate_per_s": f["rate"], "sent": f["sent"], "completed": f["completed"],
                              "ttft_p50_ms": to_ms(f["ttft_p50_s"]), "ttft_p99_ms": to_ms(f["ttft_p99_s"]),
                              "near_idle": f["near_idle"], "per_worker": f["per_worker"]} for f in res["sweep"]])
    add_table(fig, "overload", [{"gateway": name, "offered_per_s": f["offered_rps"], "sent": f["sent"],
                                 "completed": f["completed"], "rejected_429": f["rejected_429"],
                                 "other": sum(f["other"].values()), "ttft_p50_ms": to_ms(f["ttft_p50_s"]),
                                 "ttft_p99_ms": to_ms(f["ttft_p99_s"]), "good": f["good"],
                                 "goodput_per_s": f["goodput_rps"], "drain_s": f["drain_s"]}
                                for name, f in res["runs"].items()])
    for q in ("p50", "p99"):
        add_series(fig, "sweep_ttft_ms", f"TTFT {q}", [(f["rate"], to_ms(f[f"ttft_{q}_s"])) for f in res["sweep"]
                                                       if f[f"ttft_{q}_s"] is not None])
    title = (f"Poisson {res['offered_rps']:.1f} req/s ({args.overload:g} x capacity {res['capacity_rps']:.1f}) "
             f"for {args.window_s:g} s, {args.workers} workers")
    add_chart(fig, "bars", "goodput.png", table="overload", group_by="gateway",
              values=["offered_per_s", "goodput_per_s"], ylabel="requests/s",
              title=f"goodput (TTFT <= {args.ttft_target_s:g} s) per gateway; {title}")
    add_chart(fig, "bars", "overload_ttft.png", table="overload", group_by="gateway",
              values=["ttft_p50_ms", "ttft_p99_ms"], ylabel="TTFT (ms)", title=f"TTFT of the completed; {title}")
    add_chart(fig, "cdf", "ttft_cdf.png", samples="ttft_ms", xlabel="TTFT (ms)", title=f"TTFT CDF; {title}")
    add_chart(fig, "lines", "capacity_sweep.png", series="sweep_ttft_ms", xlabel="offered rate (requests/s)",
              ylabel="TTFT (ms)", hline=to_ms(res["idle_ttft_p50_s"]),
              title="capacity sweep through the plain gateway (dashed: idle TTFT p50)")
    fig.update({"args": {k: str(v) for k, v in vars(args).items()}, **res})
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
