#!/usr/bin/env python3
"""What OpenTelemetry tracing (router/telemetry/tracing.py) adds to the gateway's latency: on vs off.

One simulated worker (``kvroute sim`` with a huge ``--speedup``: it answers almost at once) is
reached four ways: straight; through ``kvroute serve`` with tracing off (no ``OTEL_*``
variables); through a second ``kvroute serve`` with tracing on, exporting every span over
OTLP/HTTP protobuf to a receiver process on loopback (tests/otlp_receiver.py, which decodes only
at the end so it takes no CPU from the run; the batch processor as router/telemetry/tracing.py sets it up);
and through a third one sampling 10% of the traces (``OTEL_TRACES_SAMPLER=parentbased_traceidratio``,
``OTEL_TRACES_SAMPLER_ARG=0.1``; the requests carry no client trace). Each repeat sends
``--requests`` sequential small chat requests (non-streamed, then streamed) to each target in
turn, the order rotating between repeats so drift hits all alike. Per repeat and target: p50/p99
latency; "added" = target minus direct at the same percentile; then the medians over the
repeats, and the gateway process's CPU time per request.

Usage: python benchmarks/bench_tracing.py [--requests 300] [--repeats 5] [--otel-env KEY=VALUE ...]
       [--json FILE] [--plot DIR]
(``--otel-env``: more OTEL_* settings for the traced gateways, e.g. OTEL_BSP_MAX_EXPORT_BATCH_SIZE=512)
Everything runs on loopback and stops by itself (each process has a deadline).

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``repeats`` (per workload,
repeat and target: ``p50_ms``, ``p99_ms``, ``cpu_per_request_ms``), table ``latency`` (the medians
and ``added_p50_ms``/``added_p99_ms`` over direct), table ``tracing_cost`` (each traced gateway
minus tracing off: ``added_p50_ms``, ``added_p99_ms``, ``added_cpu_per_request_ms``) and table
``spans``. ``--plot DIR`` draws ``tracing_cost.png`` (added latency and CPU, tracing on vs off)
and ``latency.png`` (p50/p99 per target).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
import httpx  # noqa: E402

from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402
from kvbench.workers import stop_groups, wait_ready  # noqa: E402
from kvroute.up import free_ports  # noqa: E402

TINY = ROOT / "tests/fixtures/tiny-model"
DEADLINE_S = 1800


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``argv`` in its own session with a hard deadline, output to ``log``, environment ``env``."""
    return subprocess.Popen(["timeout", "-s", "KILL", str(DEADLINE_S)] + argv, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)


def cpu_seconds(proc: subprocess.Popen | None) -> float:
    """User + system CPU seconds of the process ``timeout`` started for ``proc`` (0 for None)."""
    if proc is None:
        return 0.0
    try:
        child = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0]
        fields = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank below)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def sequential(session: aiohttp.ClientSession, url: str, body: bytes, n: int) -> list[float]:
    """Latencies (s) of ``n`` requests sent one after another, each read to its end."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: {r.status}")
        out.append(time.perf_counter() - t0)
    return out


async def run(targets: dict[str, str], procs: dict[str, subprocess.Popen | None], args, fig: dict) -> None:
    """Measure every target, print the tables and add them to ``fig`` (tables ``repeats``,
    ``latency``, ``tracing_cost``)."""
    base = {"model": "tiny", "messages": [{"role": "user", "content": "Hello, how are you today?"}], "max_tokens": 4}
    workloads = {"chat": json.dumps(base).encode(), "chat stream": json.dumps({**base, "stream": True}).encode()}
    order = list(targets)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        for body in workloads.values():  # warm every path (tokenizer, pools, the exporter's connection)
            for url in targets.values():
                await sequential(session, url + "/v1/chat/completions", body, 30)
        print(f"latency in ms, {args.requests} sequential requests per target per repeat; 'added' = target "
              f"minus direct at the same percentile; 'CPU/req' = the gateway process's CPU per request")
        for name, body in workloads.items():
            per: dict[str, dict[str, list[float]]] = {t: {"p50": [], "p99": [], "cpu": []} for t in targets}
            print(f"\n{name}")
            print(f"{'repeat':>6}  " + "  ".join(f"{t + ' p50':>14} {t + ' p99':>14}" for t in targets))
            for r in range(args.repeats):
                for t in order[r % len(order):] + order[:r % len(order)]:
                    c0 = cpu_seconds(procs[t])
                    lat = await sequential(session, targets[t] + "/v1/chat/completions", body, args.requests)
                    per[t]["cpu"].append((cpu_seconds(procs[t]) - c0) / len(lat))
                    per[t]["p50"].append(pct(lat, 0.5))
                    per[t]["p99"].append(pct(lat, 0.99))
                print(f"{r + 1:>6}  " + "  ".join(f"{per[t]['p50'][r] * 1e3:>14.3f} {per[t]['p99'][r] * 1e3:>14.3f}"
                                                   for t in targets))
                add_table(fig, "repeats", [{"workload": name, "repeat": r + 1, "target": t, "requests": args.requests,
                                            "p50_ms": per[t]["p50"][r] * 1e3, "p99_ms": per[t]["p99"][r] * 1e3,
                                            "cpu_per_request_ms": None if procs[t] is None else per[t]["cpu"][r] * 1e3}
                                           for t in targets])
            med = {t: {k: statistics.median(v) for k, v in per[t].items()} for t in targets}
            added = {t: {q: [(a - d) for a, d in zip(per[t][q], per["direct"][q])] for q in ("p50", "p99")}
                     for t in targets}
            print(f"\n{name}: medians over {args.repeats} repeats (ms)")
            print(f"{'target':<14} {'p50':>8} {'p99':>8} {'added p50':>10} {'added p99':>10} {'CPU/req':>9}")
            for t in targets:
                extra = ("" if t == "direct" else
                         f"{statistics.median(added[t]['p50']) * 1e3:>10.3f} "
                         f"{statistics.median(added[t]['p99']) * 1e3:>10.3f} {med[t]['cpu'] * 1e3:>9.3f}")
                print(f"{t:<14} {med[t]['p50'] * 1e3:>8.3f} {med[t]['p99'] * 1e3:>8.3f} {extra}")
                direct = t == "direct"
                add_table(fig, "latency", [{
                    "workload": name, "target": t, "repeats": args.repeats,
                    "p50_ms": med[t]["p50"] * 1e3, "p99_ms": med[t]["p99"] * 1e3,
                    "added_p50_ms": None if direct else statistics.median(added[t]["p50"]) * 1e3,
                    "added_p99_ms": None if direct else statistics.median(added[t]["p99"]) * 1e3,
                    "cpu_per_request_ms": None if direct else med[t]["cpu"] * 1e3}])
            for t in targets:
                if t.startswith("tracing on"):
                    d50 = [a - b for a, b in zip(per[t]["p50"], per["tracing off"]["p50"])]
                    d99 = [a - b for a, b in zip(per[t]["p99"], per["tracing off"]["p99"])]
                    print(f"{t} minus tracing off, median of the repeats' differences: p50 "
                          f"{statistics.median(d50) * 1e3:+.3f} ms, p99 {statistics.median(d99) * 1e3:+.3f} ms, "
                          f"CPU/req {(med[t]['cpu'] - med['tracing off']['cpu']) * 1e3:+.3f} ms")
                    add_table(fig, "tracing_cost", [{
                        "workload": name, "target": t, "added_p50_ms": statistics.median(d50) * 1e3,
                        "added_p99_ms": statistics.median(d99) * 1e3,
                        "added_cpu_per_request_ms": (med[t]["cpu"] - med["tracing off"]["cpu"]) * 1e3}])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="sequential requests per target per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--speedup", type=float, default=1e6, help="the sim's --speedup (large: near-instant)")
    ap.add_argument("--otel-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an OTEL_* setting for the traced gateways (repeatable)")
    add_output_args(ap)
    args = ap.parse_args()
    fig = new_figures("bench_tracing", args)
    extra_env = dict(kv.split("=", 1) for kv in args.otel_env)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    procs: list[subprocess.Popen] = []
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    clean["KVROUTE_ADMIN_TOKEN"] = "bench"
    try:
        sim_port, off_port, on_port, sampled_port, rx_port = free_ports(5)
        rx_url = f"http://127.0.0.1:{rx_port}"
        procs.append(start([sys.executable, str(ROOT / "tests/otlp_receiver.py"), "--port", str(rx_port)],
                           tmp / "receiver.log", clean))
        wait_ready(rx_url + "/stats", procs[-1], tmp / "receiver.log", 60)
        sim_url = f"http://127.0.0.1:{sim_port}"
        procs.append(start([sys.executable, "-m", "kvroute", "sim", "--model", str(TINY), "--served-model-name",
                            "tiny", "--host", "127.0.0.1", "--port", str(sim_port), "--block-size", "16",
                            "--max-model-len", "4096", "--num-gpu-blocks-override", "4096",
                            "--enable-prompt-tokens-details", "--speedup", str(args.speedup)], tmp / "sim.log", clean))
        wait_ready(sim_url + "/health", procs[-1], tmp / "sim.log", 120)
        targets = {"direct": sim_url}
        target_procs: dict[str, subprocess.Popen | None] = {"direct": None}
        traced = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                  "OTEL_EXPORTER_OTLP_ENDPOINT": rx_url, "OTEL_SERVICE_NAME": "kvroute-bench", **extra_env}
        sampled = {**traced, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
        gateways = (("tracing off", off_port, clean), ("tracing on", on_port, {**clean, **traced}),
                    ("tracing on 10%", sampled_port, {**clean, **sampled}))
        for name, port, env in gateways:
            cfg = {"listen": {"host": "127.0.0.1", "port": port},
                   "models": [{"name": "tiny", "tokenizer": str(TINY), "block_size": 16}],
                   "workers": [{"id": "w0", "url": sim_url, "model": "tiny"}], "policy": {"name": "kv_aware"}}
            path = tmp / f"gateway-{port}.json"
            path.write_text(json.dumps(cfg))
            log = tmp / f"gateway-{port}.log"
            procs.append(start([sys.executable, "-m", "kvroute", "serve", "--config", str(path)], log, env))
            wait_ready(f"http://127.0.0.1:{port}/health", procs[-1], log, 120)
            targets[name] = f"http://127.0.0.1:{port}"
            target_procs[name] = procs[-1]
        print(f"machine: {os.cpu_count()} CPUs; one sim worker (--speedup {args.speedup:g}); logs in {tmp}"
              + (f"; traced gateways also get {extra_env}" if extra_env else ""))
        asyncio.run(run(targets, target_procs, args, fig))
        for p in procs[2:]:  # the gateways: the traced ones flush their last spans as they stop
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(30)
        stats = httpx.get(rx_url + "/stats", timeout=120).json()
        print(f"\nspans received from the traced gateways: {stats['spans']} in {stats['posts']} exports "
              f"({stats['bytes'] / 1e6:.1f} MB); services {stats['services']}; names {stats['names']}")
        add_table(fig, "spans", [{"spans": stats["spans"], "exports": stats["posts"], "export_bytes": stats["bytes"]}])
    finally:
        stop_groups([p for p in procs if p.poll() is None])
    title = f"{args.requests} sequential requests x {args.repeats} repeats per target, medians"
    add_chart(fig, "bars", "tracing_cost.png", table="tracing_cost", group_by="workload", series_by="target",
              values=["added_p50_ms", "added_p99_ms", "added_cpu_per_request_ms"], ylabel="ms",
              title=f"what tracing adds over tracing off; {title}")
    add_chart(fig, "bars", "latency.png", table="latency", group_by="workload", series_by="target",
              values=["p50_ms", "p99_ms"], ylabel="ms", title=f"latency per target; {title}")
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
