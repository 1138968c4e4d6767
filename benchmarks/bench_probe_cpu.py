#!/usr/bin/env python3
"""What an idle gateway spends following its workers, by process count: health probes and load
scrapes made by every process (``KVROUTE_SHARED_LOAD=off``, as before one prober per host) against
one process probing for all (:mod:`router.shared.probe_table`), side by side in one run.

N virtual workers are served by one aiohttp process on N ports (``/health`` answers 200,
``/metrics`` a page shaped like vLLM 0.32's: the three gauges the gateway reads among ~48 kB of
counters and histograms, as a real vLLM-CPU server's page measured 48,761 bytes here; with
``--filtered yes``, as vLLM, ``/metrics/?name[]=...`` answers the named metrics alone, the form
the gateway scrapes where it is answered (``router/workers/calls.py``); with ``no`` it is a 404,
as an engine without it, and the gateway scrapes the whole page). For each
worker count and process count, ``kvroute serve --processes P`` follows them for ``--seconds``
with no traffic; the table gives the gateway processes' CPU (user + system, ms per second, all
processes together) and the calls per second the workers received.

With ``--event-rate R`` each virtual worker also publishes vLLM-shaped KV events (R batches per
second, each storing one block and removing an old one) that the gateway subscribes to: with
``--processes P`` one process ingests them into the host index for all (:mod:`kvcore.index.host`).

Usage: python benchmarks/bench_probe_cpu.py [--workers 64,256] [--processes 1,2,4] [--filtered yes,no] [--seconds 10]
       [--settle-s 4] [--event-rate 0] [--json FILE] [--plot DIR]
Everything runs on loopback and stops by itself (each process has a deadline).

``--json FILE`` writes table ``idle`` (per workers, filtered, processes and mode: ``gateway_cpu_ms_per_s``,
``worker_calls_per_s``); ``--plot DIR`` draws ``idle_cpu.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402
from lab.process_sampler import tree_cpu_s  # noqa: E402
from kvroute.up import free_ports  # noqa: E402

TINY = ROOT / "tests/fixtures/tiny-model"
DEADLINE_S = 900
SETTLE_S = 4.0  # default --settle-s
PERIOD_S = 2.0  # the default health interval, a multiple of the load scrape's: the window is a whole number of it

FLEET = r'''
import asyncio, random, sys
from aiohttp import web
from lab.metrics_page import NamedPages
ports = [int(p) for p in sys.argv[1].split(",")]
page = open(sys.argv[2]).read()
event_ports = [int(p) for p in sys.argv[3].split(",")] if len(sys.argv) > 3 and sys.argv[3] else []
event_rate = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
filtered = len(sys.argv) > 5 and sys.argv[5] == "1"
calls = {"/health": 0, "/metrics": 0}
pages = NamedPages(page)
async def handle(request):
    path = "/metrics" if request.path.startswith("/metrics") else request.path
    calls[path] += 1
    if path != "/metrics":
        return web.Response(text="")
    if request.path == "/metrics":
        return web.Response(text=page)
    if not filtered:  # an engine without vLLM's mount of prometheus_client's app
        return web.Response(status=404)
    return web.Response(text=pages.of(request.query.getall("name[]", [])))
async def count(request):
    return web.json_response(calls)
async def main():
    for i, port in enumerate(ports):
        app = web.Application()
        app.router.add_get("/health", handle)
        app.router.add_get("/metrics", handle)
        app.router.add_get("/metrics/{tail:.*}", handle)
        if i == 0:
            app.router.add_get("/calls", count)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    for port in event_ports:
        asyncio.get_running_loop().create_task(publish(port))
    print("ready", flush=True)
    await asyncio.Event().wait()
async def publish(port):
    """vLLM-shaped KV events at event_rate batches/s: each stores a 16-token block (block 0 of a
    new prompt: the gateway may join the stream at any point) and removes the block stored 64
    batches earlier (a bounded cache)."""
    from kvcore.kv_events.wire import BlockRemoved, BlockStored
    from simulator.events import KVEventsConfig, ZmqEventPublisher
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                           endpoint=f"tcp://*:{port}"))
    pub.start()
    rnd = random.Random(port)
    held = []
    loop = asyncio.get_running_loop()
    start, n = loop.time() + rnd.random() / event_rate, 0
    while True:
        h = rnd.getrandbits(63)
        events = [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[rnd.randrange(100) for _ in range(16)],
                              block_size=16, lora_id=None, medium="GPU", lora_name=None)]
        held.append(h)
        if len(held) > 64:
            events.append(BlockRemoved(block_hashes=[held.pop(0)], medium="GPU"))
        pub.publish(events)
        n += 1
        await asyncio.sleep(max(0.0, start + n / event_rate - loop.time()))
asyncio.run(main())
'''


def vllm_like_page() -> str:
    """~48 kB of Prometheus text in vLLM 0.32's shape (``vllm/v1/metrics/loggers.py``): the gauges
    the gateway reads, counters and their ``_created`` samples, and 20-odd histograms of 12-22
    buckets."""
    labels = 'engine="0",model_name="m"'
    lines = []
    for name, value in (("vllm:num_requests_running", 2), ("vllm:num_requests_waiting", 1),
                        ("vllm:kv_cache_usage_perc", 0.4)):
        lines += [f"# HELP {name} x", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    for i in range(24):
        name = f"vllm:counter_{i}"
        lines += [f"# HELP {name}_total A counter of the engine.", f"# TYPE {name}_total counter",
                  f"{name}_total{{{labels}}} {i * 11}.0", f"{name}_created{{{labels}}} 1.7964046699768171e+09"]
    for i in range(22):
        name = f"vllm:histogram_{i}_seconds"
        lines += [f"# HELP {name} A histogram of the engine.", f"# TYPE {name} histogram"]
        for le in [0.001 * 2 ** k for k in range(20)] + ["+Inf"]:
            lines.append(f'{name}_bucket{{engine="0",le="{le}",model_name="m"}} 0.0')
        lines += [f"{name}_count{{{labels}}} 0.0", f"{name}_sum{{{labels}}} 0.0"]
    return "\n".join(lines) + "\n"


def start(argv: list[str], log: Path, env: dict | None = None, deadline_s: float = DEADLINE_S) -> subprocess.Popen:
    """``argv`` in a session of its own, output to ``log``, killed after ``deadline_s``."""
    return subprocess.Popen(["timeout", "-s", "KILL", str(deadline_s)] + argv, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "KVROUTE_ADMIN_TOKEN": "bench", **(env or {})})


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc``'s session, SIGKILL after 20 s."""
    try:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def wait_for(pred, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def measure(work: Path, ports: list[int], processes: int, shared: bool, seconds: float,
            settle_s: float = SETTLE_S, event_ports: list[int] | None = None) -> tuple[float, float]:
    """``(gateway CPU ms per second, worker calls per second)`` of one idle gateway (subscribed
    to ``event_ports``' KV events, one per worker, when given)."""
    gw_port = free_ports(1, avoid=set(ports) | set(event_ports or []))[0]
    events = [{"events": f"tcp://127.0.0.1:{e}"} for e in event_ports] if event_ports else [{} for _ in ports]
    cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
           "models": [{"name": "tiny", "tokenizer": str(TINY), "block_size": 16}],
           "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{p}", "model": "tiny", **events[i]}
                       for i, p in enumerate(ports)],
           "policy": {"name": "kv_aware"}}
    path = work / f"gw-{len(ports)}-{processes}-{shared}.json"
    path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "kvroute", "serve", "--config", str(path)]
    if processes > 1:
        argv += ["--processes", str(processes)]
    gw = start(argv, work / (path.stem + ".log"), None if shared else {"KVROUTE_SHARED_LOAD": "off"})
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{gw_port}/health/ready", timeout=5).status_code == 200,
                 120, "the gateway")
        time.sleep(settle_s)
        if event_ports:  # the events reach the index (every worker holds blocks in it)
            index = httpx.get(f"http://127.0.0.1:{gw_port}/admin/index", timeout=10,
                              headers={"Authorization": "Bearer bench"}).json()
            held = sum(1 for w in index["workers"].values() if w["blocks"]["gpu"] > 0)
            if held < len(ports):
                raise SystemExit(f"only {held} of {len(ports)} workers' KV events reached the index")
        calls = lambda: sum(httpx.get(f"http://127.0.0.1:{ports[0]}/calls", timeout=10).json().values())  # noqa: E731
        # the probes and scrapes run at whole multiples of their intervals on the monotonic clock
        # (kvcore.ticks; health every 2 s, scrapes every 1 s): a window from just past a multiple
        # of 2 s, a whole number of 2 s long, holds every round the same number of times
        window_s = PERIOD_S * math.ceil(seconds / PERIOD_S)
        time.sleep(PERIOD_S * math.floor(time.monotonic() / PERIOD_S) + PERIOD_S + 0.25 - time.monotonic())
        c0, cpu0, t0 = calls(), tree_cpu_s(gw.pid), time.monotonic()
        time.sleep(max(0.0, t0 + window_s - time.monotonic()))
        c1, cpu1, t1 = calls(), tree_cpu_s(gw.pid), time.monotonic()
        return (cpu1 - cpu0) / (t1 - t0) * 1e3, (c1 - c0) / (t1 - t0)
    finally:
        stop(gw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="64,256", help="comma-separated worker counts")
    ap.add_argument("--processes", default="1,2,4", help="comma-separated gateway process counts")
    ap.add_argument("--seconds", type=float, default=10.0,
                    help="idle seconds measured per cell (rounded up to a multiple of 2 s, whole probe rounds)")
    ap.add_argument("--settle-s", type=float, default=SETTLE_S, help="wait after the gateway is ready")
    ap.add_argument("--filtered", default="yes",
                    help="comma-separated: whether the workers answer the filtered page (yes: as vLLM; no)")
    ap.add_argument("--event-rate", type=float, default=0.0,
                    help="KV-event batches per second each worker publishes (0: no event streams)")
    add_output_args(ap)
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    procs = [int(x) for x in args.processes.split(",")]
    forms = args.filtered.split(",")
    if not forms or any(f not in ("yes", "no") for f in forms):
        raise SystemExit("--filtered takes yes, no or both (yes,no)")
    figures = new_figures("bench_probe_cpu", vars(args))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-probe-cpu-") as tmp:
        work = Path(tmp)
        page = work / "metrics.txt"
        page.write_text(vllm_like_page())
        print(f"machine: {os.cpu_count()} CPUs; a /metrics page of {page.stat().st_size} bytes; "
              f"{args.seconds:.0f} s idle per cell after {args.settle_s:.0f} s to settle")
        print(f"{'workers':>8} {'filtered':>8} {'processes':>9} {'mode':>16} {'gateway CPU ms/s':>17} "
              f"{'worker calls/s':>15}")
        for n in counts:
            for filtered in forms:
                ports = free_ports(2 * n if args.event_rate > 0 else n)
                ports, event_ports = ports[:n], ports[n:]
                log = work / f"fleet-{n}-{filtered}.log"
                fleet = start([sys.executable, "-c", FLEET, ",".join(map(str, ports)), str(page),
                               ",".join(map(str, event_ports)), str(args.event_rate), "1" if filtered == "yes" else "0"],
                              log, env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])})
                try:
                    wait_for(lambda: "ready" in log.read_text(), 120, "the worker fleet")
                    for p in procs:
                        modes = [("one prober", True)] if p == 1 else [("every process", False), ("one prober", True)]
                        for mode, shared in modes:
                            cpu, calls = measure(work, ports, p, shared, args.seconds, args.settle_s, event_ports)
                            rows.append({"workers": n, "filtered": filtered, "processes": p, "mode": mode,
                                         "gateway_cpu_ms_per_s": round(cpu, 1), "worker_calls_per_s": round(calls, 1)})
                            print(f"{n:>8} {filtered:>8} {p:>9} {mode:>16} {cpu:>17.1f} {calls:>15.1f}", flush=True)
                finally:
                    stop(fleet)
    add_table(figures, "idle", rows)
    add_chart(figures, "bars", "idle_cpu.png", table="idle", group_by=["workers", "filtered", "processes"],
              values="gateway_cpu_ms_per_s", series_by="mode", title="Idle gateway CPU following its workers",
              ylabel="ms of CPU per second (all processes)")
    emit(figures, args)


if __name__ == "__main__":
    main()
