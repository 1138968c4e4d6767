#!/usr/bin/env python3
"""Soak and fault injection at scale (project issue 12): what the gateway's resources do under many
concurrent streams, and how long the cluster takes to converge again after each kind of fault.

1. Soak: ``--requests`` streaming chats at ``--concurrency`` (closed loop) through one gateway
   (`kvroute serve`, kv_aware, in-memory index) in front of 2 `kvroute sim` workers. Errors (any
   status but 200, a stream without ``data: [DONE]``, an error event, a client timeout), gateway
   RSS and open fds before / peak / after (after: once in-flight is 0 everywhere, the clients'
   connections are closed and idle upstream connections have aged out), wall time, requests/s.
2. Worker SIGKILLed mid-stream (a second gateway, sims at real speed so streams last seconds):
   how each stream on the killed worker ended (error event in the stream, 502, cut, hang), that
   the streams on the other worker and requests sent during the outage all succeed, how long the
   gateway took to mark the worker down; then the worker restarted on the same port: time until
   the gateway lists it healthy again and until it routes a request to it.
3. Shared index (redis-server, 2 sims publishing KV events, 2 `kvroute agent`, a gateway with the
   Redis index): Redis stopped and restarted, an agent SIGKILLed and restarted, a sim restarted
   (its event seq numbers start again): for each, the time until a prompt's blocks are matched
   again (``POST /admin/explain``), without any new traffic where none is needed.

4. With ``--fuzz-examples N`` and ``--overload``: the hostile-input fuzz (bench_fuzz.py: cases
   tried, gateway 5xx) and goodput at 2x capacity with and without admission control
   (bench_overload.py), run after the above, so one run prints every figure of the issue.

Usage: python benchmarks/bench_resilience.py [--requests 2000] [--concurrency 500] [--json FILE]
       [--plot DIR] [--fuzz-examples 100] [--overload]
Everything runs on loopback; every process has a hard deadline (``timeout -s KILL``) and is stopped
at the end; every client call has a timeout, so a hang is counted, never waited on. Exit status 0
only when no client hung, no request that should succeed failed and every fault converged again.

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``soak`` (one row:
``errors``, ``wall_s``, ``requests_per_s``, ``rss_before_bytes``/``rss_peak_bytes``/
``rss_after_bytes``, ``fds_before``/``fds_peak``/``fds_after``), table ``convergence`` (per fault
and measure: ``time_s``, None when not reached), table ``stream_outcomes`` (how the streams on the
killed and on the other worker ended) and, as before, the raw ``soak``, ``worker_kill``,
``index_faults`` and ``failures``. ``--plot DIR`` draws ``convergence.png``, ``soak_memory.png``,
``soak_fds.png`` and ``stream_outcomes.png``. With ``--fuzz-examples``/``--overload`` the
companions get ``--json`` (next to FILE: ``NAME.bench_fuzz.json``...) and ``--plot DIR/bench_fuzz``
(``DIR/bench_overload``) too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import orjson
import psutil

from lab.figures import add_chart, add_output_args, add_table, emit, new_figures
from lab.process_sampler import Sampler
from kvbench.workers import wait_ready
from kvroute.up import free_ports

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests/fixtures/tiny-model"
DEADLINE_S = 1800  # no process started here outlives this
ADMIN_TOKEN = "bench-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BLOCK = 32
CONVERGE_S = 60.0  # longest wait for any re-convergence; past it the fault counts as failed
CLIENT_TIMEOUT_S = 120.0
WORDS = "oak elm ash fir yew pine palm teak birch cedar maple alder".split()
MIB = 1024 * 1024
UPSTREAM_KEEPALIVE_S = 4  # router/relay/upstream.py's pool


# ---- processes -----------------------------------------------------------------------------------
class Proc:
    """A subprocess in its own session under ``timeout -s KILL``; ``stop()`` ends its group."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        self.popen = subprocess.Popen(["timeout", "-s", "KILL", str(DEADLINE_S)] + argv, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN})

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(10)
        self._log.close()

    def stop(self, timeout_s: float = 10) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        self._log.close()

    def tail(self, n: int = 30) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])

    def process(self) -> psutil.Process:
        """The program itself (a child of ``timeout``)."""
        return psutil.Process(self.popen.pid).children()[0]


def kvroute_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvroute", *args]


def wait_http(url: str, proc: Proc, timeout_s: float = 120) -> None:
    """Poll ``url`` every 50 ms until it answers below 500 (the fine step keeps the measured
    times exact); raises when ``proc`` exits first or after ``timeout_s``."""
    wait_ready(url, proc.popen, proc.log_path, timeout_s, interval_s=0.05)


def wait_for(check, timeout_s: float = CONVERGE_S, interval_s: float = 0.05):
    """Seconds until ``check()`` is truthy, or None when it is not within ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        if check():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(interval_s)


def since(t0: float, check, timeout_s: float = CONVERGE_S):
    """Seconds from ``t0`` until ``check()`` is truthy (polled from now), or None."""
    return None if wait_for(check, timeout_s) is None else time.monotonic() - t0


def sim_argv(port: int, speedup: float, seed: int, *extra: str) -> list[str]:
    return kvroute_argv("sim", "--model", str(TINY), "--served-model-name", "tiny", "--host", "127.0.0.1",
                        "--port", str(port), "--block-size", str(BLOCK), "--enable-prompt-tokens-details",
                        "--speedup", str(speedup), "--seed", str(seed), *extra)


def start_gateway(cfg: dict, log_dir: Path, name: str) -> tuple[str, Proc]:
    path = log_dir / f"{name}.json"
    path.write_text(json.dumps(cfg))
    proc = Proc(name, kvroute_argv("serve", "--config", str(path)), log_dir)
    base = f"http://127.0.0.1:{cfg['listen']['port']}"
    wait_http(base + "/health", proc, timeout_s=180)
    return base, proc


def workers(base: str) -> dict[str, dict]:
    r = httpx.get(base + "/admin/workers", headers=AUTH, timeout=30)
    r.raise_for_status()
    return {w["id"]: w for w in r.json()["workers"]}


def idle(base: str) -> bool:
    return all(w["in_flight"] == 0 for w in workers(base).values())


def system_prompt(seed, words: int = 300) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))


def chat(system: str, user: str, max_tokens: int = 3, stream: bool = True) -> dict:
    return {"model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "stream": stream}




# ---- streams -------------------------------------------------------------------------------------
class Outcome:
    """How one streamed request ended: ``ok``, ``error_event`` (200, an error event, then [DONE]),
    ``cut`` (200 but the connection ended without [DONE]), ``status_<n>``, ``hang`` (client
    timeout), ``conn_error``."""

    def __init__(self) -> None:
        self.worker: str | None = None
        self.first_chunk = threading.Event()
        self.kind = "pending"
        self.detail = ""


async def stream_one(session: aiohttp.ClientSession, url: str, body: bytes, out: Outcome, rid: str) -> None:
    raw = b""
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json",
                                                          "x-request-id": rid}) as r:
            out.worker = r.headers.get("x-kvroute-worker")
            if r.status != 200:
                out.kind, out.detail = f"status_{r.status}", (await r.read())[:200].decode(errors="replace")
                return
            async for chunk in r.content.iter_any():
                raw += chunk
                out.first_chunk.set()
    except asyncio.TimeoutError:
        out.kind = "hang"
        return
    except aiohttp.ClientPayloadError as exc:
        out.kind, out.detail = "cut", repr(exc)
        return
    except aiohttp.ClientError as exc:
        out.kind, out.detail = ("cut" if raw else "conn_error"), repr(exc)
        return
    finally:
        out.first_chunk.set()
    events = [e for e in raw.split(b"\n\n") if e]
    if not events or events[-1] != b"data: [DONE]":
        out.kind, out.detail = "cut", raw[-200:].decode(errors="replace")
    elif any(b'"error"' in e for e in events[:-1]):
        out.kind, out.detail = "error_event", events[-2][:300].decode(errors="replace")
    elif len(events) < 2:
        out.kind = "cut"
    else:
        out.kind = "ok"


# ---- 1. soak --------------------------------------------------------------------------------------
def soak(args, log_dir: Path, results: dict) -> list[str]:
    failures: list[str] = []
    *sim_ports, gw_port = free_ports(3)
    procs: list[Proc] = []
    try:
        for i, port in enumerate(sim_ports):
            procs.append(Proc(f"soak-w{i}", sim_argv(port, 100, i, "--num-gpu-blocks-override", "8192",
                                                     "--max-num-seqs", "512"), log_dir))
        for p, port in zip(procs, sim_ports):
            wait_http(f"http://127.0.0.1:{port}/health", p)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
               "models": [{"name": "tiny", "tokenizer": str(TINY), "block_size": BLOCK}],
               "index": {"backend": "memory"}, "policy": {"name": "kv_aware"},
               "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{p}", "model": "tiny"}
                           for i, p in enumerate(sim_ports)],
               "health": {"interval_s": 2.0}, "load_scrape": {"interval_s": 2.0}}
        base, gw = start_gateway(cfg, log_dir, "soak-gateway")
        procs.append(gw)
        gp = gw.process()
        wait_for(lambda: idle(base))
        rss0, fds0 = gp.memory_info().rss, gp.num_fds()
        system = system_prompt("soak", 120)
        outcomes = [Outcome() for _ in range(args.requests)]

        async def run() -> None:
            counter = iter(range(args.requests))
            timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
                async def loop() -> None:
                    for i in counter:
                        body = orjson.dumps(chat(system, f"soak question {i}"))
                        await stream_one(s, base + "/v1/chat/completions", body, outcomes[i], f"soak-{i}")
                await asyncio.gather(*[loop() for _ in range(args.concurrency)])

        t0 = time.monotonic()
        with Sampler(gp) as sampler:
            asyncio.run(run())
        wall = time.monotonic() - t0
        kinds: dict[str, int] = {}
        for o in outcomes:
            kinds[o.kind] = kinds.get(o.kind, 0) + 1
        errors = args.requests - kinds.get("ok", 0)
        in_flight_s = wait_for(lambda: idle(base))
        port = gw_port

        def clients_gone() -> bool:
            return not any(c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN
                           for c in gp.net_connections("tcp"))

        wait_for(clients_gone)
        # the probes (1 call per worker per second here) keep a few idle upstream connections alive
        margin = 2 * (UPSTREAM_KEEPALIVE_S + 1) + 2
        fds_back_s = wait_for(lambda: gp.num_fds() <= fds0 + margin)
        per_worker: dict[str, int] = {}
        for o in outcomes:
            per_worker[str(o.worker)] = per_worker.get(str(o.worker), 0) + 1
        results["soak"] = {
            "requests": args.requests, "concurrency": args.concurrency, "errors": errors, "outcomes": kinds,
            "per_worker": per_worker, "wall_s": wall, "requests_per_s": args.requests / wall,
            "rss_mib": [rss0 / MIB, sampler.peak_rss / MIB, gp.memory_info().rss / MIB],
            "fds": [fds0, sampler.peak_fds, gp.num_fds()], "fds_back_within_margin": fds_back_s is not None,
            "fd_margin": margin, "in_flight_back_to_0": in_flight_s is not None, "gateway_alive": gw.alive()}
        if errors:
            bad = [f"{o.kind} {o.detail[:120]}" for o in outcomes if o.kind != "ok"][:5]
            failures.append(f"soak: {errors} of {args.requests} failed: {bad}")
        if in_flight_s is None:
            failures.append(f"soak: in_flight not back to 0: {workers(base)}")
        if not gw.alive():
            failures.append("soak: the gateway died")
    finally:
        for p in reversed(procs):
            p.stop()
    return failures


# ---- 2. a worker killed mid-stream ---------------------------------------------------------------
def worker_kill(args, log_dir: Path, results: dict) -> list[str]:
    failures: list[str] = []
    *sim_ports, gw_port = free_ports(3)
    sims: dict[str, Proc] = {}
    procs: list[Proc] = []
    n_streams = max(8, min(64, args.concurrency))
    try:
        def start_sim(i: int) -> Proc:
            p = Proc(f"kill-w{i}", sim_argv(sim_ports[i], 1, i), log_dir)  # real speed: streams last seconds
            sims[f"w{i}"] = p
            procs.append(p)
            return p

        for i in range(2):
            start_sim(i)
        for i in range(2):
            wait_http(f"http://127.0.0.1:{sim_ports[i]}/health", sims[f"w{i}"])
        health = {"interval_s": 0.5, "timeout_s": 0.5, "fail_threshold": 2, "rise_threshold": 2}
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
               "models": [{"name": "tiny", "tokenizer": str(TINY), "block_size": BLOCK}],
               "index": {"backend": "memory"}, "policy": {"name": "kv_aware"},
               "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{p}", "model": "tiny"}
                           for i, p in enumerate(sim_ports)],
               "health": health, "load_scrape": {"interval_s": 0.5},
               "timeouts": {"connect_s": 2, "first_byte_s": 30, "stream_idle_s": 10}}
        base, gw = start_gateway(cfg, log_dir, "kill-gateway")
        procs.append(gw)
        wait_for(lambda: all(w["healthy"] for w in workers(base).values()))
        outcomes = [Outcome() for _ in range(n_streams)]

        async def run() -> None:
            timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S / 2)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
                url = base + "/v1/chat/completions"
                await asyncio.gather(*[
                    stream_one(s, url, orjson.dumps(chat(system_prompt(f"kill-{i}", 60), "tell", max_tokens=400)),
                               o, f"kill-{i}")
                    for i, o in enumerate(outcomes)])

        clients = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
        clients.start()
        started = all(o.first_chunk.wait(60) for o in outcomes)
        on = {w: sum(1 for o in outcomes if o.worker == w and o.kind == "pending") for w in ("w0", "w1")}
        if not started or not on["w1"] or not on["w0"]:
            failures.append(f"worker kill: streams not under way on both workers before the kill: {on}")
        t_kill = time.monotonic()
        sims["w1"].kill()
        # requests sent during the outage: a connect failure is retried on the other worker, then
        # the health probes take w1 out; every one of them must succeed
        outage: list = []

        def during_outage() -> None:
            for i in range(20):
                try:
                    r = httpx.post(base + "/v1/chat/completions", timeout=30,
                                   json=chat(system_prompt(f"outage-{i}", 40), "hi", stream=False))
                    outage.append(r.status_code)
                except httpx.HTTPError as exc:
                    outage.append(repr(exc))

        sender = threading.Thread(target=during_outage, daemon=True)
        sender.start()
        down_s = since(t_kill, lambda: not workers(base)["w1"]["healthy"])
        sender.join(20 * 30 + 10)
        clients.join(CLIENT_TIMEOUT_S)
        affected: dict[str, int] = {}
        unaffected: dict[str, int] = {}
        for o in outcomes:
            d = affected if o.worker == "w1" else unaffected
            d[o.kind] = d.get(o.kind, 0) + 1
        # restart on the same port
        t_restart = time.monotonic()
        start_sim(1)
        wait_http(f"http://127.0.0.1:{sim_ports[1]}/health", sims["w1"])
        sim_ready_s = time.monotonic() - t_restart
        t_ready = time.monotonic()
        healthy_s = wait_for(lambda: workers(base)["w1"]["healthy"])
        n = iter(range(10_000))

        def routed_to_w1() -> bool:
            r = httpx.post(base + "/v1/chat/completions", timeout=30,
                           json=chat(system_prompt(f"back-{next(n)}", 40), "hi", stream=False))
            outage.append(r.status_code)
            return r.headers.get("x-kvroute-worker") == "w1"

        routed_s = since(t_ready, routed_to_w1) if healthy_s is not None else None
        results["worker_kill"] = {
            "streams": n_streams, "on_killed_worker": sum(affected.values()), "affected_outcomes": affected,
            "unaffected_outcomes": unaffected, "outage_requests": len(outage),
            "outage_failed": [s for s in outage if s != 200], "marked_down_s": down_s, "health": health,
            "restart_sim_ready_s": sim_ready_s, "healthy_again_s": healthy_s, "routed_again_s": routed_s}
        hangs = affected.get("hang", 0) + unaffected.get("hang", 0)
        if hangs or clients.is_alive():
            failures.append(f"worker kill: {hangs} clients hung")
        if set(unaffected) - {"ok"}:
            failures.append(f"worker kill: streams on the surviving worker failed: {unaffected}")
        if results["worker_kill"]["outage_failed"]:
            failures.append("worker kill: requests during the outage failed: "
                            f"{results['worker_kill']['outage_failed']}")
        for what in ("marked_down_s", "healthy_again_s", "routed_again_s"):
            if results["worker_kill"][what] is None:
                failures.append(f"worker kill: {what} not reached in {CONVERGE_S}s")
    finally:
        for p in reversed(procs):
            p.stop()
    return failures


# ---- 3. the shared index: Redis, agents, a restarted sim -----------------------------------------
class IndexCluster:
    TTL_S = 2.0  # agents' heartbeat TTL

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, Proc] = {}
        ports = iter(free_ports(8))
        self.redis_port = next(ports)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.sims = {}
        for name in ("w0", "w1"):
            port = next(ports)
            self.sims[name] = {"port": port, "ev": next(ports), "rp": next(ports), "url": f"http://127.0.0.1:{port}"}
        self.gw_port = next(ports)
        self.base = f"http://127.0.0.1:{self.gw_port}"
        self.requests: list[int | str] = []  # statuses of requests through the gateway (all should be 200)

    def start(self, name: str, argv: list[str]) -> Proc:
        p = Proc(name, argv, self.log_dir)
        self.procs[name] = p
        return p

    def start_redis(self) -> None:
        self.start("redis", [shutil.which("redis-server"), "--port", str(self.redis_port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"])

        def pong() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.redis_port), 0.5) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        if wait_for(pong, 20) is None:
            raise RuntimeError("redis-server did not start")

    def start_sim(self, name: str) -> None:
        s = self.sims[name]
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                  "endpoint": f"tcp://*:{s['ev']}", "replay_endpoint": f"tcp://*:{s['rp']}"}
        p = self.start(name, sim_argv(s["port"], 50, 0, "--num-gpu-blocks-override", "256",
                                      "--kv-events-config", json.dumps(events)))
        wait_http(s["url"] + "/health", p)

    def start_agent(self, name: str) -> None:
        s = self.sims[name]
        self.start(f"agent-{name}", kvroute_argv(
            "agent", "--worker-id", name, "--events", f"tcp://127.0.0.1:{s['ev']}",
            "--replay", f"tcp://127.0.0.1:{s['rp']}", "--index", self.redis_url, "--model", "tiny",
            "--block-size", str(BLOCK), "--heartbeat-ttl-s", str(self.TTL_S)))

    def up(self) -> None:
        self.start_redis()
        for name in self.sims:
            self.start_sim(name)
            self.start_agent(name)
        cfg = {"listen": {"host": "127.0.0.1", "port": self.gw_port},
               "models": [{"name": "tiny", "tokenizer": str(TINY), "block_size": BLOCK}],
               "index": {"backend": "redis", "url": self.redis_url},
               "workers": [{"id": n, "url": s["url"], "model": "tiny"} for n, s in self.sims.items()],
               "policy": {"name": "kv_aware"}}
        _, gw = start_gateway(cfg, self.log_dir, "index-gateway")
        self.procs["gateway"] = gw

    def down(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    def messages(self, seed, user: str = "hi") -> list[dict]:
        return [{"role": "system", "content": system_prompt(f"idx-{seed}")}, {"role": "user", "content": user}]

    def warm(self, name: str, seed) -> None:
        """The prompt straight to a worker, behind the gateway's back."""
        r = httpx.post(self.sims[name]["url"] + "/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": self.messages(seed, "warm"), "max_tokens": 2})
        r.raise_for_status()

    def matched(self, seed) -> dict[str, int]:
        r = httpx.post(self.base + "/admin/explain", headers=AUTH, timeout=10,
                       json={"model": "tiny", "messages": self.messages(seed), "max_tokens": 2})
        if r.status_code != 200:
            return {}
        return {c["worker"]: c["matched_blocks"]["gpu"] for c in r.json()["candidates"]}

    def route(self, seed) -> str | None:
        """The prompt through the gateway; the worker it went to (None when it failed)."""
        try:
            r = httpx.post(self.base + "/v1/chat/completions", timeout=30,
                           json={"model": "tiny", "messages": self.messages(seed), "max_tokens": 2})
            self.requests.append(r.status_code)
            return r.headers.get("x-kvroute-worker") if r.status_code == 200 else None
        except httpx.HTTPError as exc:
            self.requests.append(repr(exc))
            return None


def index_faults(args, log_dir: Path, results: dict) -> list[str]:
    failures: list[str] = []
    c = IndexCluster(log_dir)
    out: dict = {}
    results["index_faults"] = out
    try:
        c.up()
        # "a" cached on w0, "b" and "b2" on w1, all behind the gateway's back (confirmed by events only)
        c.warm("w0", "a")
        c.warm("w1", "b")
        c.warm("w1", "b2")
        homes = (("a", "w0"), ("b", "w1"), ("b2", "w1"))
        if wait_for(lambda: all(c.matched(s).get(w, 0) >= 8 for s, w in homes)) is None:
            raise RuntimeError(f"prompts never indexed: {c.matched('a')} {c.matched('b')}")
        full = {s: c.matched(s)[w] for s, w in homes}
        out["prompt_blocks"] = full["a"]

        # Redis stopped and restarted (empty): the agents republish what their workers hold
        c.procs["redis"].stop()
        for i in range(4):
            c.route(f"redis-down-{i}")  # routed by load alone, must succeed
        c.start_redis()
        t = time.monotonic()
        out["redis_matched_again_s"] = since(t, lambda: c.matched("a").get("w0", 0) >= full["a"]
                                             and c.matched("b").get("w1", 0) >= full["b"])

        # an agent SIGKILLed: its worker's entries stop counting after the heartbeat TTL. "b" was
        # just routed through the gateway (its own speculative entry for w1, as with live traffic),
        # "b2" never was. Restarted, the agent catches up through the worker's replay buffer.
        out["routed_b_to"] = c.route("b")
        c.procs["agent-w1"].kill()
        t = time.monotonic()
        out["agent_killed_confirmed_expire_s"] = since(t, lambda: c.matched("b2").get("w1", 0) == 0)
        out["agent_killed_routed_expire_s"] = since(t, lambda: c.matched("b").get("w1", 0) == 0)
        c.route("agent-down")  # requests go on meanwhile (not "b2": that would add the gateway's own entry)
        c.start_agent("w1")
        t = time.monotonic()
        out["agent_matched_again_s"] = since(t, lambda: c.matched("b2").get("w1", 0) >= full["b2"])

        # a sim restarted on the same ports: empty cache, seq numbers from 0 again
        c.procs["w0"].stop()
        c.start_sim("w0")
        c.warm("w0", "c")  # its first events after the restart
        t = time.monotonic()
        out["sim_new_prompt_matched_s"] = since(t, lambda: c.matched("c").get("w0", 0) >= 8, 10)
        out["sim_old_entries_dropped_s"] = since(t, lambda: c.matched("a").get("w0", 0) == 0, 10)
        out["sim_first_batch_lost"] = out["sim_new_prompt_matched_s"] is None
        if out["sim_first_batch_lost"]:
            # the agent missed the restarted worker's first batch: it learns only from the next one
            c.warm("w0", "d")
            t = time.monotonic()
            out["sim_recovered_after_next_batch_s"] = since(
                t, lambda: c.matched("c").get("w0", 0) >= 8 and c.matched("a").get("w0", 0) == 0)
        c.warm("w0", "a")  # the old prompt again, on the restarted worker
        t = time.monotonic()
        out["sim_matched_again_s"] = since(t, lambda: c.matched("a").get("w0", 0) >= full["a"])
        c.route("a")
        c.route("c")
        out["gateway_requests"] = len(c.requests)
        out["gateway_requests_failed"] = [s for s in c.requests if s != 200]
        for k in ("redis_matched_again_s", "agent_killed_confirmed_expire_s", "agent_killed_routed_expire_s",
                  "agent_matched_again_s", "sim_matched_again_s"):
            if out[k] is None:
                failures.append(f"index faults: {k} not reached in {CONVERGE_S:g}s")
        if out["sim_first_batch_lost"]:
            failures.append("index faults: the agent missed the restarted sim's first event batch (old entries "
                            "kept, new prompt unindexed until the worker's next batch)")
        if out["gateway_requests_failed"]:
            failures.append(f"index faults: requests through the gateway failed: {out['gateway_requests_failed']}")
    finally:
        c.down()
    return failures


# ---- report ----------------------------------------------------------------------------------------
def fmt_s(v) -> str:
    return "not reached" if v is None else f"{v:.2f} s"


def table(results: dict) -> str:
    rows: list[tuple[str, str]] = []
    s = results.get("soak")
    if s:
        rows += [("soak: requests (concurrency)", f"{s['requests']} ({s['concurrency']})"),
                 ("soak: errors", f"{s['errors']}  {s['outcomes']}"),
                 ("soak: requests per worker", str(s["per_worker"])),
                 ("soak: gateway RSS before/peak/after", " / ".join(f"{x:.1f}" for x in s["rss_mib"]) + " MiB"),
                 ("soak: gateway fds before/peak/after", " / ".join(str(x) for x in s["fds"])
                  + ("" if s["fds_back_within_margin"] else f"  (NOT back within {s['fd_margin']})")),
                 ("soak: wall time", f"{s['wall_s']:.2f} s"),
                 ("soak: requests/s", f"{s['requests_per_s']:.0f}")]
    k = results.get("worker_kill")
    if k:
        rows += [("kill -9 worker: streams / on the killed worker", f"{k['streams']} / {k['on_killed_worker']}"),
                 ("kill -9 worker: how those ended", str(k["affected_outcomes"])),
                 ("kill -9 worker: streams on the other worker", str(k["unaffected_outcomes"])),
                 ("kill -9 worker: requests during/after outage failed",
                  f"{len(k['outage_failed'])} of {k['outage_requests']}"),
                 ("kill -9 worker: marked down after", fmt_s(k["marked_down_s"])),
                 ("restart worker: sim answering after", fmt_s(k["restart_sim_ready_s"])),
                 ("restart worker: listed healthy after (from sim up)", fmt_s(k["healthy_again_s"])),
                 ("restart worker: routed to after (from sim up)", fmt_s(k["routed_again_s"]))]
    x = results.get("index_faults")
    if x:
        lost = x.get("sim_first_batch_lost")
        rows += [("redis stop+start: blocks matched again (from up)", fmt_s(x.get("redis_matched_again_s"))),
                 (f"kill -9 agent: entries expire (TTL {IndexCluster.TTL_S:g} s)",
                  fmt_s(x.get("agent_killed_confirmed_expire_s"))),
                 ("kill -9 agent: a prompt routed via gateway expires",
                  fmt_s(x.get("agent_killed_routed_expire_s"))),
                 ("restart agent: blocks matched again (from spawn)", fmt_s(x.get("agent_matched_again_s"))),
                 ("restart sim: new prompt matched (from its answer)", fmt_s(x.get("sim_new_prompt_matched_s"))
                  + ("  (first batch lost; next batch recovered in "
                     f"{fmt_s(x.get('sim_recovered_after_next_batch_s'))})" if lost else "")),
                 ("restart sim: old entries dropped (from its answer)", fmt_s(x.get("sim_old_entries_dropped_s"))),
                 ("restart sim: old prompt re-sent, matched again", fmt_s(x.get("sim_matched_again_s"))),
                 ("index faults: gateway requests failed",
                  f"{len(x.get('gateway_requests_failed', []))} of {x.get('gateway_requests', 0)}")]
    w = max(len(r[0]) for r in rows) if rows else 10
    lines = [f"{'what':<{w}}  value", f"{'-' * w}  {'-' * 30}"]
    lines += [f"{a:<{w}}  {b}" for a, b in rows]
    return "\n".join(lines)


def collect(results: dict, fig: dict) -> None:
    """Add the tables and charts of ``results`` (what :func:`table` prints) to ``fig``."""
    s = results.get("soak")
    if s:
        add_table(fig, "soak", [{
            "soak": f"{s['requests']} requests at concurrency {s['concurrency']}", "requests": s["requests"],
            "concurrency": s["concurrency"], "errors": s["errors"], "wall_s": s["wall_s"],
            "requests_per_s": s["requests_per_s"],
            **{f"rss_{k}_bytes": v * MIB for k, v in zip(("before", "peak", "after"), s["rss_mib"])},
            **{f"fds_{k}": v for k, v in zip(("before", "peak", "after"), s["fds"])}}])
        add_chart(fig, "bars", "soak_memory.png", table="soak", group_by="soak",
                  values=["rss_before_bytes", "rss_peak_bytes", "rss_after_bytes"], scale=1 / MIB,
                  ylabel="gateway RSS (MiB)", title="soak: the gateway's resident memory before / peak / after")
        add_chart(fig, "bars", "soak_fds.png", table="soak", group_by="soak",
                  values=["fds_before", "fds_peak", "fds_after"], ylabel="open file descriptors",
                  title="soak: the gateway's open fds before / peak / after")
    rows = []
    k = results.get("worker_kill")
    if k:
        for what in ("marked_down_s", "restart_sim_ready_s", "healthy_again_s", "routed_again_s"):
            rows.append({"fault": "kill -9 worker", "measure": what.removesuffix("_s"), "time_s": k[what]})
        kinds = sorted(set(k["affected_outcomes"]) | set(k["unaffected_outcomes"]))
        add_table(fig, "stream_outcomes", [{"streams": name, **{kind: d.get(kind, 0) for kind in kinds}}
                                           for name, d in (("on the killed worker", k["affected_outcomes"]),
                                                           ("on the other worker", k["unaffected_outcomes"]))])
        add_chart(fig, "bars", "stream_outcomes.png", table="stream_outcomes", group_by="streams", values=kinds,
                  ylabel="streams", title=f"kill -9 worker: how the {k['streams']} streams under way ended")
    x = results.get("index_faults")
    if x:
        for fault, what in (("redis stop+start", "redis_matched_again_s"),
                            ("kill -9 agent", "agent_killed_confirmed_expire_s"),
                            ("kill -9 agent", "agent_killed_routed_expire_s"),
                            ("restart agent", "agent_matched_again_s"),
                            ("restart sim", "sim_new_prompt_matched_s"),
                            ("restart sim", "sim_old_entries_dropped_s"),
                            ("restart sim", "sim_matched_again_s")):
            if what in x:
                rows.append({"fault": fault, "measure": what.removesuffix("_s"), "time_s": x[what]})
    if rows:
        add_table(fig, "convergence", [{**r, "reached": r["time_s"] is not None} for r in rows])
        add_chart(fig, "bars", "convergence.png", table="convergence", group_by=["fault", "measure"],
                  values=["time_s"], ylabel="seconds", horizontal=True,
                  title=f"time to converge after each fault (missing bar: not reached in {CONVERGE_S:g} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=500)
    add_output_args(ap, json_help="write the figures here as JSON")
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (path printed)")
    ap.add_argument("--fuzz-examples", type=int, default=0, metavar="N",
                    help="also run benchmarks/bench_fuzz.py with N examples per operation (0: skip)")
    ap.add_argument("--overload", action="store_true",
                    help="also run benchmarks/bench_overload.py (goodput at 2x capacity, ~2 min)")
    args = ap.parse_args()
    fig = new_figures("bench_resilience", args)
    if shutil.which("redis-server") is None:
        print("redis-server is not on PATH", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="bench-resilience-"))
    results: dict = {}
    failures: list[str] = []
    try:
        for part in (soak, worker_kill, index_faults):
            try:
                failures += part(args, log_dir, results)
            except Exception as exc:  # a part that cannot run is a failure, the others still run
                failures.append(f"{part.__name__}: {type(exc).__name__}: {exc}")
    finally:
        if not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"logs: {log_dir}")
    print(table(results))
    collect(results, fig)
    fig.update({**results, "failures": list(failures)})
    emit(fig, args)
    for name, extra in (("bench_fuzz", ["--examples", str(args.fuzz_examples)] if args.fuzz_examples else None),
                        ("bench_overload", [] if args.overload else None)):
        if extra is None:
            continue
        # the companion benchmarks print their own tables; one run of this script gives every figure
        print(f"\n== {name}", flush=True)
        if args.json:
            extra += ["--json", str(args.json.with_name(f"{args.json.stem}.{name}.json"))]
        if args.plot:
            extra += ["--plot", str(args.plot / name)]
        done = subprocess.run([sys.executable, str(Path(__file__).with_name(f"{name}.py")), *extra], timeout=3600)
        if done.returncode != 0:
            failures.append(f"{name} exited {done.returncode}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
