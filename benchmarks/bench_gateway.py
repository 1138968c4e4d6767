#!/usr/bin/env python3
"""The gateway's added latency and throughput, side by side with sglang-router, in one run.

One simulated worker (``kvroute sim`` with a huge ``--speedup``, so the engine answers almost at
once) is reached three ways: straight, through ``kvroute serve`` (kv_aware policy, exact
tokenization, index lookup, speculative insert), and through sglang-router
(``--policy round_robin``) when it is installed (``pip install sglang-router``). For a short chat
(each message numbered apart: no two requests alike) and an ~8k-token chat (one system prompt,
the same request each time), at concurrency 1 and 32, the targets take turns in rounds (so drift hits
all alike) and the table prints p50/p99 latency and what each proxy adds over the straight path.
Then each target's most requests per second at concurrency 64 (short chat) for a few seconds.
Last (``--stream-seconds``, 0 to skip), the relay of a token stream at a worker's real pace: a
second sim with the GPU timing preset (no speedup), fresh ~600-token completions streamed back
46 tokens each (46 reads per request), through a kvroute gateway (kv_aware), the same gateway
with ``round_robin`` (the relay without the cache-aware step) and sglang-router in front of it,
in alternating rounds: CPU per streamed request and per read, the cost that grows with the
output length, and the proxy's wake-ups per request. ``--stream-concurrency`` (default 8 and 2):
at 8 the streams' pieces often arrive together and one wake-up relays several; at 2 they arrive
~12 ms apart, each a wake-up of its own, as in a cluster whose streams are spread thin.
``--processes 1,2`` adds a ``kvroute serve --processes N`` target per N > 1 ("kvroute xN"); CPU
is then summed over the gateway's processes, and the CPU-bound ceiling is what N processes on N
free cores would serve.

Usage: python benchmarks/bench_gateway.py [--requests 200] [--rounds 3] [--rps-seconds 5] [--processes 1,2]
       [--json FILE] [--plot DIR]
Everything runs on loopback and stops by itself (each process has a deadline).

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``latency`` (per workload,
concurrency and target: ``p50_ms``, ``p99_ms``, ``added_p50_ms``, ``added_p99_ms``,
``proxy_cpu_per_request_ms``) and table ``throughput`` (per target: ``requests_per_s``,
``proxy_busy_cpu_share``, ``ceiling_requests_per_s_per_cpu``...). ``--plot DIR`` draws
``latency.png`` (p50/p99 per target and workload, log scale), ``added_latency.png`` and
``throughput.png``. With ``--stream-seconds``, table ``stream`` (per target and concurrency:
``requests``, ``reads_per_request``, ``proxy_cpu_per_request_ms``, ``proxy_cpu_per_read_us``,
``wakeups_per_request``).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from lab.figures import add_chart, add_output_args, add_table, emit, new_figures
from lab.process_sampler import tree_cpu_s, tree_wakeups
from kvbench.workers import stop_groups, wait_ready
from kvroute.up import free_ports

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests/fixtures/tiny-model"
DEADLINE_S = 1800
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(["timeout", "-s", "KILL", str(DEADLINE_S)] + argv, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "KVROUTE_ADMIN_TOKEN": "bench"})


def long_system_prompt(target_tokens: int) -> str:
    """Text of about ``target_tokens`` tokens for the tiny model's tokenizer."""
    from kvcore.tokenization import PromptTokenizer

    tok = PromptTokenizer(TINY)
    rnd = random.Random(8)
    words = [rnd.choice(WORDS) for _ in range(target_tokens)]
    while len(tok.encode_text(" ".join(words), False)) > target_tokens:
        words = words[: int(len(words) * 0.9)]
    return " ".join(words)


def numbered_chats() -> Callable[[], bytes]:
    """Short chat bodies, each message numbered apart from the last (as clients' messages differ,
    so no text of it was seen before: what a gateway keeps per text is not what is measured)."""
    count = itertools.count()
    head = b'{"model": "tiny", "messages": [{"role": "user", "content": "Hello, how are you today? ('
    tail = b')"}], "max_tokens": 1}'
    return lambda: b"%s%d%s" % (head, next(count), tail)


async def one(session: aiohttp.ClientSession, url: str, body: bytes | Callable[[], bytes]) -> float:
    """One request of ``body`` (a callable: its next body), its latency in seconds."""
    data = body() if callable(body) else body
    t0 = time.perf_counter()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status}")
    return time.perf_counter() - t0


async def closed_loop(session, url: str, body: bytes | Callable[[], bytes], concurrency: int, n: int) -> list[float]:
    """``n`` requests from ``concurrency`` clients each sending its next when the last returns."""
    out: list[float] = []
    left = [n]

    async def client():
        while left[0] > 0:
            left[0] -= 1
            out.append(await one(session, url, body))

    await asyncio.gather(*[client() for _ in range(concurrency)])
    return out


async def rate(session, url: str, body: bytes | Callable[[], bytes], concurrency: int, seconds: float) -> float:
    """Completed requests per second with ``concurrency`` clients for ``seconds``."""
    done = [0]
    end = time.perf_counter() + seconds

    async def client():
        while time.perf_counter() < end:
            await one(session, url, body)
            done[0] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    return done[0] / (time.perf_counter() - t0)


def wakeups(proc: subprocess.Popen | None) -> int:
    """Wake-ups so far of every process below the ``timeout`` started for ``proc``
    (:func:`lab.process_sampler.tree_wakeups`); 0 for None."""
    return 0 if proc is None else tree_wakeups(proc.pid)


def cpu_seconds(proc: subprocess.Popen | None) -> float:
    """User + system CPU seconds of every process below the ``timeout`` started for ``proc``
    (the gateway, or a supervisor and its gateway processes; 0 for None, nan when none runs)."""
    if proc is None:
        return 0.0
    return tree_cpu_s(proc.pid) or float("nan")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(targets: dict[str, str], procs: dict[str, subprocess.Popen | None], args, fig: dict) -> None:
    """Measure every target (latency cells, then throughput), print the tables and add them to
    ``fig`` (tables ``latency`` and ``throughput``)."""
    long_ = {"model": "tiny", "messages": [{"role": "system", "content": long_system_prompt(8000)},
                                           {"role": "user", "content": "Summarize."}], "max_tokens": 1}
    workloads = {"short chat": numbered_chats(), "8k-token chat": json.dumps(long_).encode()}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        for name, body in workloads.items():  # warm every path (tokenizer, caches, pools)
            for url in targets.values():
                await closed_loop(session, url + "/v1/chat/completions", body, 4, 20)
        print(f"\nlatency in ms; 'added' = target minus direct at the same percentile "
              f"({args.rounds} interleaved rounds x {args.requests} requests per cell)")
        print("'proxy CPU' = the proxy process's CPU time per request (steadier than latency on a busy machine)")
        print(f"{'workload':<14} {'conc':>4}  {'target':<14} {'p50':>8} {'p99':>8} {'added p50':>10} "
              f"{'added p99':>10} {'proxy CPU':>10}")
        for name, body in workloads.items():
            for conc in (1, 32):
                lat: dict[str, list[float]] = {t: [] for t in targets}
                cpu: dict[str, float] = {t: 0.0 for t in targets}
                order = list(targets)
                for r in range(args.rounds):
                    for t in order[r % len(order):] + order[:r % len(order)]:
                        c0 = cpu_seconds(procs[t])
                        lat[t] += await closed_loop(session, targets[t] + "/v1/chat/completions", body, conc,
                                                    args.requests)
                        cpu[t] += cpu_seconds(procs[t]) - c0
                base50, base99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
                for t in targets:
                    p50, p99 = pct(lat[t], 0.5), pct(lat[t], 0.99)
                    direct = t == "direct"
                    add_table(fig, "latency", [{
                        "workload": name, "concurrency": conc, "target": t, "requests": len(lat[t]),
                        "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3,
                        "added_p50_ms": None if direct else (p50 - base50) * 1e3,
                        "added_p99_ms": None if direct else (p99 - base99) * 1e3,
                        "proxy_cpu_per_request_ms": None if direct else cpu[t] / len(lat[t]) * 1e3}])
                    if t == "direct":
                        added = f"{'':>10} {'':>10} {'':>10}"
                    else:
                        added = (f"{(p50 - base50) * 1e3:>10.3f} {(p99 - base99) * 1e3:>10.3f} "
                                 f"{cpu[t] / len(lat[t]) * 1e3:>10.3f}")
                    print(f"{name:<14} {conc:>4}  {t:<14} {p50 * 1e3:>8.3f} {p99 * 1e3:>8.3f} {added}")
        print(f"\nthroughput, short chat, concurrency 64, {args.rps_seconds:g} s each (one process per proxy; "
              f"the client and the worker share the machine's {os.cpu_count()} CPUs)")
        for t, url in targets.items():
            c0 = cpu_seconds(procs[t])
            t0 = time.perf_counter()
            rps = await rate(session, url + "/v1/chat/completions", workloads["short chat"], 64, args.rps_seconds)
            elapsed = time.perf_counter() - t0
            used = cpu_seconds(procs[t]) - c0
            note = ""
            row = {"target": t, "concurrency": 64, "duration_s": args.rps_seconds, "requests_per_s": rps}
            if procs[t] is not None and used > 0:
                # one process on one core can do at most 1 / (CPU per request) requests a second
                n = int(t.rsplit("x", 1)[1]) if t.startswith("kvroute x") else 1
                per_cpu = rps * elapsed / used
                note = (f"  proxy busy {used / elapsed * 100:.0f}% of one CPU; CPU-bound ceiling ~{per_cpu:.0f} "
                        f"requests/s per CPU" + (f", ~{per_cpu * n:.0f} on {n} free CPUs" if n > 1 else ""))
                row.update(proxy_busy_cpu_share=used / elapsed, ceiling_requests_per_s_per_cpu=per_cpu,
                           processes=n, ceiling_requests_per_s_on_processes_cpus=per_cpu * n)
            add_table(fig, "throughput", [row])
            print(f"  {t:<14} {rps:>8.0f} requests/s{note}")


def start_sim(port: int, log: Path, *flags: str) -> subprocess.Popen:
    """A ``kvroute sim`` of the tiny model on ``port`` with ``flags`` added, ready."""
    proc = start([sys.executable, "-m", "kvroute", "sim", "--model", str(TINY), "--served-model-name", "tiny",
                  "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "16384", *flags], log)
    wait_ready(f"http://127.0.0.1:{port}/health", proc, log, 90)
    return proc


def start_gateway(cfg: dict, path: Path, processes: int = 1) -> subprocess.Popen:
    """``kvroute serve`` of ``cfg`` (written to ``path``; its log beside it), ready."""
    path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "kvroute", "serve", "--config", str(path)]
    log = path.with_suffix(".log")
    proc = start(argv + (["--processes", str(processes)] if processes > 1 else []), log)
    wait_ready(f"http://127.0.0.1:{cfg['listen']['port']}/health", proc, log, 90)
    return proc


def start_sglang(port: int, sim_url: str, log: Path) -> subprocess.Popen | None:
    """sglang-router (round robin) in front of ``sim_url`` on ``port``, ready; None (said why)
    when it is not installed or does not start (the process is then stopped)."""
    if importlib.util.find_spec("sglang_router") is None:
        print("sglang-router not installed (pip install sglang-router): left out")
        return None
    proc = start([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                  "--worker-urls", sim_url, "--policy", "round_robin", "--log-level", "warn"], log)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, log, 60)
    except (RuntimeError, TimeoutError) as exc:
        print(f"sglang-router did not start, left out: {exc}")
        stop_groups([proc])
        return None
    return proc


def gateway_config(port: int, sim_url: str, block_size: int) -> dict:
    """One kv_aware gateway on ``port`` in front of the one sim worker."""
    return {"listen": {"host": "127.0.0.1", "port": port},
            "models": [{"name": "tiny", "tokenizer": str(TINY), "block_size": block_size}],
            "workers": [{"id": "w0", "url": sim_url, "model": "tiny"}], "policy": {"name": "kv_aware"}}


async def stream_rounds(targets: dict[str, str], procs: dict[str, subprocess.Popen], seconds: float,
                        rounds: int, fig: dict, concurrency: int = 8) -> None:
    """Streamed completions at ``concurrency`` through each target for ``seconds`` per round, the
    targets alternating each round; prints and records proxy CPU and wake-ups per request
    (table ``stream``). At concurrency 8 the streams' pieces often arrive together, one wake-up
    relaying several; at 2 they arrive spaced, as in a cluster whose streams are spread thin,
    and each piece is a wake-up of its own."""
    rnd = random.Random(11)
    done = {t: 0 for t in targets}
    reads = {t: 0 for t in [*targets, "warm"]}
    cpu = {t: 0.0 for t in targets}
    woke = {t: 0 for t in targets}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(url: str, t: str) -> None:
            body = {"model": "tiny", "prompt": " ".join(rnd.choice(WORDS) for _ in range(300)), "max_tokens": 46,
                    "stream": True, "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as r:
                async for _ in r.content.iter_any():
                    reads[t] += 1
                if r.status != 200:
                    raise RuntimeError(f"{url}: {r.status}")

        for url in targets.values():  # warm the paths (not counted)
            for _ in range(2):
                await one(url, "warm")
        order = list(targets)
        for r in range(rounds):
            for t in order[r % len(order):] + order[:r % len(order)]:
                end = time.perf_counter() + seconds
                c0, w0 = cpu_seconds(procs[t]), wakeups(procs[t])
                n0, r0 = done[t], reads[t]

                async def client(t=t, end=end):
                    while time.perf_counter() < end:
                        await one(targets[t], t)
                        done[t] += 1

                await asyncio.gather(*[client() for _ in range(concurrency)])
                cpu[t] += cpu_seconds(procs[t]) - c0
                woke[t] += wakeups(procs[t]) - w0
                print(f"  round {r + 1} {t:<14} {done[t] - n0:>4} requests, {(reads[t] - r0) / max(1, done[t] - n0):.0f} "
                      f"reads each", flush=True)
    print(f"\nstreamed completions at a real-time worker (~600-token prompts, 46 tokens streamed, concurrency "
          f"{concurrency}, {rounds} rounds x {seconds:g} s per target); wake-ups: the proxy's threads going to sleep")
    for t in targets:
        n = max(1, done[t])
        per, pieces = cpu[t] / n * 1e3, reads[t] / n
        add_table(fig, "stream", [{"target": t, "concurrency": concurrency, "requests": done[t],
                                   "reads_per_request": pieces, "proxy_cpu_per_request_ms": per,
                                   "proxy_cpu_per_read_us": per / pieces * 1e3 if pieces else None,
                                   "wakeups_per_request": woke[t] / n}])
        print(f"  {t:<20} {done[t]:>5} requests  proxy CPU {per:.3f} ms per request, "
              f"{per / pieces * 1e3 if pieces else 0:.1f} us per read; {woke[t] / n:.1f} wake-ups per request")


def stream_phase(args, fig: dict, tmp: Path) -> None:
    """Start a real-time sim and in front of it a kvroute gateway (kv_aware), one with
    ``round_robin`` and sglang-router (when installed); run :func:`stream_rounds` at each of
    ``args.stream_concurrencies`` (highest first, as parsed); stop them."""
    procs: list[subprocess.Popen] = []
    try:
        sim_port, gw_port, rr_port, sg_port = free_ports(4)
        sim_url = f"http://127.0.0.1:{sim_port}"
        procs.append(start_sim(sim_port, tmp / "sim-rt.log", "--block-size", "16", "--timing-preset", "gpu"))
        procs.append(start_gateway(gateway_config(gw_port, sim_url, 16), tmp / "gateway-rt.yaml"))
        targets = {"kvroute": f"http://127.0.0.1:{gw_port}"}
        target_procs = {"kvroute": procs[-1]}
        # the same gateway without the cache-aware step (no tokenization, lookup or policy): the relay alone
        procs.append(start_gateway({**gateway_config(rr_port, sim_url, 16), "policy": {"name": "round_robin"}},
                                   tmp / "gateway-rt-rr.yaml"))
        targets["kvroute round_robin"] = f"http://127.0.0.1:{rr_port}"
        target_procs["kvroute round_robin"] = procs[-1]
        sglang = start_sglang(sg_port, sim_url, tmp / "sglang-rt.log")
        if sglang is not None:
            procs.append(sglang)
            targets["sglang-router"] = f"http://127.0.0.1:{sg_port}"
            target_procs["sglang-router"] = sglang
        for concurrency in args.stream_concurrencies:
            asyncio.run(stream_rounds(targets, target_procs, args.stream_seconds, args.rounds, fig, concurrency))
    finally:
        stop_groups(procs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per target per round per cell")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rps-seconds", type=float, default=5.0)
    ap.add_argument("--speedup", type=float, default=1e6, help="the sim's --speedup (large: near-instant)")
    ap.add_argument("--processes", default="1", help="comma-separated gateway process counts to compare (e.g. 1,2)")
    ap.add_argument("--stream-seconds", type=float, default=10.0,
                    help="seconds per target per round of streamed completions at a real-time worker (0: skip)")
    ap.add_argument("--stream-concurrency", default="8,2",
                    help="comma-separated concurrencies of the streamed cells (2: pieces arrive spaced)")
    add_output_args(ap)
    args = ap.parse_args()
    try:
        args.stream_concurrencies = sorted({int(c) for c in args.stream_concurrency.split(",")}, reverse=True)
    except ValueError:
        args.stream_concurrencies = []
    if not args.stream_concurrencies or min(args.stream_concurrencies) < 1:
        ap.error(f"--stream-concurrency: positive integers separated by commas, not {args.stream_concurrency!r}")
    fig = new_figures("bench_gateway", args)
    counts = sorted({int(n) for n in args.processes.split(",")})
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    procs: list[subprocess.Popen] = []
    try:
        sim_port, gw_port, sg_port, *more_ports = free_ports(3 + len(counts))
        sim_url = f"http://127.0.0.1:{sim_port}"
        procs.append(start_sim(sim_port, tmp / "sim.log", "--block-size", "32", "--num-gpu-blocks-override", "4096",
                               "--enable-prompt-tokens-details", "--speedup", str(args.speedup)))
        cfg = gateway_config(gw_port, sim_url, 32)
        procs.append(start_gateway(cfg, tmp / "gateway.yaml"))
        targets = {"direct": sim_url, "kvroute": f"http://127.0.0.1:{gw_port}"}
        target_procs: dict[str, subprocess.Popen | None] = {"direct": None, "kvroute": procs[-1]}
        for n, port in zip([c for c in counts if c > 1], more_ports):
            procs.append(start_gateway({**cfg, "listen": {"host": "127.0.0.1", "port": port}},
                                       tmp / f"gateway-x{n}.yaml", processes=n))
            targets[f"kvroute x{n}"] = f"http://127.0.0.1:{port}"
            target_procs[f"kvroute x{n}"] = procs[-1]
        sglang = start_sglang(sg_port, sim_url, tmp / "sglang.log")
        if sglang is not None:
            procs.append(sglang)
            targets["sglang-router"] = f"http://127.0.0.1:{sg_port}"
            target_procs["sglang-router"] = sglang
        print(f"machine: {os.cpu_count()} CPUs; one sim worker (--speedup {args.speedup:g}); logs in {tmp}")
        asyncio.run(run(targets, target_procs, args, fig))
    finally:
        stop_groups(procs)
    if args.stream_seconds > 0:
        stream_phase(args, fig, tmp)
    title = f"one sim worker (--speedup {args.speedup:g}), {args.rounds} rounds x {args.requests} requests per cell"
    add_chart(fig, "bars", "latency.png", table="latency", group_by=["workload", "concurrency"], series_by="target",
              values=["p50_ms", "p99_ms"], ylabel="ms", log_y=True, title=f"latency per target; {title}")
    add_chart(fig, "bars", "added_latency.png", table="latency", group_by=["workload", "concurrency"],
              series_by="target", values=["added_p50_ms", "added_p99_ms"], ylabel="ms",
              title=f"latency added over the direct path; {title}")
    add_chart(fig, "bars", "throughput.png", table="throughput", group_by="target", values=["requests_per_s"],
              ylabel="requests/s", title=f"short chat, concurrency 64, {args.rps_seconds:g} s per target")
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
