#!/usr/bin/env python3
"""TTFT of a 2k-token prompt on worker B by recompute, from B's own CPU tier, and pulled from
worker A's agent over a link shaped to 1, 10 and 25 Gbit/s (and unshaped); the bandwidth at which
pulling beats recompute for this model, and that crossover extrapolated to a Llama-3-8B-sized model
on a GPU's prefill rate. Needs root (a network namespace and ``tc``).

    sudo KVR_VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python benchmarks/bench_peer_pull.py \\
        [--repeats 5] [--rates-gbit 1,10,25] [--quick] [--json FILE] [--plot DIR]

Set-up (everything made here is removed at the end, also after an error, SIGINT or SIGTERM):

- a network namespace ``kvrp<pid>`` joined to this one by a veth pair ``kvrp<pid>a`` (here,
  ``10.201.n.1``) <-> ``kvrp<pid>b`` (inside, ``10.201.n.2``) (:class:`lab.netns.ShapedLink`);
  A's offload agent runs inside and serves its blocks on the inside address, so every byte B pulls
  leaves the namespace through ``kvrp<pid>b``, where a ``tbf`` qdisc sets the rate of each case;
- one redis-server (the index; on loopback and the veth address, nothing persisted), two vLLM
  servers (the "small" generated model, block 32, ``--enforce-eager``, one core each:
  ``VLLM_CPU_OMP_THREADS_BIND`` 0 and 1, ``VLLM_SERVER_DEV_MODE=1``, KV events on, prompt token
  details on), each with our KV connector on its own agent (``kvroute agent --tier-socket``, CPU
  tier in ``/dev/shm/kvr-bpp-<pid>-<worker>``, removed on exit); B's agent (outside) pulls from A's;
- every process runs under ``timeout -s KILL`` (``--deadline-s``), so nothing outlives a killed
  run for long; namespaces and veths of a run killed by SIGKILL are removed by the next run
  (:func:`lab.netns.remove_stale`).

Cases, in each of ``--repeats`` rounds (in an order shuffled per round, the same for every run of
the benchmark), each with a prompt of fresh random tokens (nothing cached by accident). TTFT =
seconds to the first SSE chunk of a streaming completion (max_tokens 2, temperature 0; the stream
is read to its end before the next step); each measured request is sent ``--settle-s`` after the
requests that prepare it, so their after-work is not measured:

- ``recompute``: a prompt nobody has seen, sent to B: the connector must log no load, 0 cached tokens;
- ``cpu``: a prompt sent to B, B's ``/reset_prefix_cache``, the prompt again: B's connector must
  load all 63 blocks from its CPU tier, 2016 cached tokens;
- ``pull@<rate>`` (and ``pull@unshaped``): the link shaped, a prompt sent to A, then waited for
  until the Redis index shows A holding its 63 blocks (A's connector saved them to A's CPU tier in
  the step that computed them; the index reports the GPU copy first), then sent to B: B's
  connector must log ``pulled 63 of 63 blocks from a`` and the completion's
  ``usage.prompt_tokens_details.cached_tokens`` must be 2016. The bytes that left the namespace
  during B's request are counted (``link_bytes``: payload, protocol frames and the headers of the
  packets as the veth counts them, GSO super-packets of up to 64 KB with one set of headers each,
  so a real link's ~4 % of TCP/IP headers is mostly not in it; tbf does charge them, hence raw
  TCP's ~96 % of the nominal rate).

A run that fails its check is printed with the reason and left out of its case's median (the case
shows ``ok k/n``); the exit status is then 1. Before the cases, the link's achievable rate at each
setting is measured with raw TCP (a Python sender inside the namespace, 3 transfers, median), and
reported against the nominal rate: at 1 and 10 Gbit/s tbf holds ~96 % of it (headers), while a
single Python sender on a small machine cannot fill 25 Gbit/s (it gets the same shaped and
unshaped: the setting is then not what limits, and the output says so).

Crossover: near it the link is the bottleneck (the pull path itself goes faster), so a pull's
TTFT is modelled as ``fixed + bytes / (goodput x rate)``: ``fixed`` is the median, at the slowest
shaped setting, of TTFT minus the prompt's pulled bytes at that setting's raw TCP rate (locating
the peer, request and verification, the copy into the KV cache, the last token's compute, the
first chunk), ``goodput`` that setting's raw TCP rate over its nominal one; solved for the nominal
rate at which it equals recompute's median TTFT. Printed beside it as cross-checks: a
least-squares line ``a + s x bytes / rate`` over the TTFT medians of the shaped settings (it
underrates ``s`` when the faster settings are limited by the pull path, not the link), and bytes
per token x recompute tokens/s (no fixed costs). For this small model the crossover lies well
below 1 Gbit/s; ``--rates-gbit 0.1,0.2,1,10,25`` measures around it instead of extrapolating.

Bytes per token: the agent's ``block_bytes`` over the block size (checked against the model's
config). Extrapolation to a Llama-3-8B-sized model: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 B
(bf16) = 131,072 B per token, times a GPU's prefill rate in tokens/s: Dynamo's mocker H100 fit
(the ``gpu`` preset of :mod:`simulator.timing`: linear term 7.41e-2 ms/token, i.e. 13,495
tokens/s) and the 0.15-0.30 ms/token given for llm-d-inference-sim's 7-8B/H100 reference; fixed
overheads (the fit's 26.2 ms, connection set-up, the pull's own latency) ignored there; one more
line uses the mocker's full fit for one 2k-token prompt.

``--json FILE`` (:mod:`lab.figures`): table ``ttft`` (per case: ``ttft_ms`` median,
``ratio_to_recompute``, ``runs_ms``, ``ok_runs``, ``runs``, ``pulled_bytes``, ``pull_ms``,
``pull_bytes_per_s``, ``link_bytes``, ``nominal_bits_per_s``, ``tcp_bits_per_s``), table
``runs`` (every run), table ``link`` (per setting: nominal and raw TCP bits/s, each transfer),
table ``crossover`` (``fixed_ms``, ``goodput``, ``crossover_bits_per_s``, the least-squares
cross-check ``fit_*``, ``pull_path_bits_per_s``) and table ``extrapolation`` (per prefill
rate: bytes per token, tokens/s, crossover bits/s). ``--plot DIR``: ``ttft.png``.
``--quick``: 1 repeat, rates 1 and 25 Gbit/s (a smoke run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

from kvcore.block_keys import block_keys  # noqa: E402
from kvcore.index.redis import RedisIndex  # noqa: E402
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402
from lab.netns import (NetnsError, ShapedLink, check_privileges, remove_stale,  # noqa: E402
                                 tcp_throughput_bytes_per_s)
from kvbench.workers import LogTail, reset_prefix_cache, stop_groups  # noqa: E402
from kvroute.up import free_ports  # noqa: E402
from offload_agent.connector.config import kv_transfer_config, vllm_env  # noqa: E402
from simulator.timing import PRESETS  # noqa: E402

MODEL = "small"
BLOCK = 32
PROMPT_TOKENS = 2048
LOADED_BLOCKS = (PROMPT_TOKENS - 1) // BLOCK     # blocks a repeat can load (the last token is computed): 63
CACHED_TOKENS = LOADED_BLOCKS * BLOCK            # 2016
TIER_BLOCKS = 1024                               # CPU tier of each agent, in blocks (16 prompts)
GPU_BLOCKS = 400
LLAMA8B_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2   # (K, V) x 32 layers x 8 KV heads x 128 head dim x bf16
LLAMA8B_FORMULA = "2 (K, V) x 32 layers x 8 KV heads x 128 head dim x 2 B (bf16)"
TIER_LINE = re.compile(r"request (\S+): \d+ tokens from the tiers \(blocks: cpu (\d+), ssd (\d+), peer (\d+)"
                       r"(?: from (\S+))?, gone (\d+)\)")
PULL_LINE = re.compile(r"pulled (\d+) of (\d+) blocks from (\S+) in ([0-9.]+) ms")


def prefill_rates() -> list[tuple[str, float]]:
    """``(source, prefill tokens per second)`` of a Llama-3-8B-sized model on one GPU."""
    gpu = PRESETS["gpu"]
    return [(f"Dynamo mocker H100 fit, linear term ({gpu.prefill_ms_per_token:g} ms/token)",
             1000 / gpu.prefill_ms_per_token),
            ("llm-d-inference-sim 7-8B/H100 reference, 0.15 ms/token", 1000 / 0.15),
            ("llm-d-inference-sim 7-8B/H100 reference, 0.30 ms/token", 1000 / 0.30)]


def mocker_prefill_ms(n_tokens: int) -> float:
    """Dynamo's mocker H100 prefill fit (the ``gpu`` preset) for ``n_tokens`` new tokens, in ms."""
    g = PRESETS["gpu"]
    return g.prefill_overhead_ms + g.prefill_ms_per_token * n_tokens + g.prefill_ms_per_token_sq * n_tokens ** 2


def model_block_bytes(model_dir: Path) -> int:
    """Bytes of one KV block of ``BLOCK`` tokens of a bf16 model, from its ``config.json``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * kv_heads * head * 2


def gbit(bits_per_s: float | None) -> str:
    return "-" if bits_per_s is None else f"{bits_per_s / 1e9:.3g} Gbit/s"


# ---- requests -----------------------------------------------------------------------------------
class Prompts:
    """Fresh random prompts of ``PROMPT_TOKENS`` token ids (10..2009), from a seed new each run."""

    def __init__(self) -> None:
        self.rnd = random.Random(int.from_bytes(os.urandom(8), "little"))

    def next(self) -> list[int]:
        return [10 + self.rnd.randrange(2000) for _ in range(PROMPT_TOKENS)]


def ttft(base: str, prompt: list[int]) -> tuple[float, int, str]:
    """``(seconds to the first streamed chunk, cached prompt tokens, completion id)`` of one
    streaming completion; the stream is read to its end (its last chunk carries the usage)."""
    t0 = time.perf_counter()
    first, cached, rid = None, None, ""
    with httpx.stream("POST", base + "/v1/completions", timeout=300,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            rid = chunk.get("id") or rid
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if first is None:
        raise RuntimeError("no token streamed")
    if cached is None:
        raise RuntimeError("no usage in the stream (is --enable-prompt-tokens-details on?)")
    return first, cached, rid


class Index:
    """Blocking reads of the Redis index (its own event loop)."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.index = RedisIndex(url, socket_timeout_s=10.0)
        self.loop.run_until_complete(self.index.open())

    def held_blocks(self, worker: str, prompt: list[int]) -> int:
        """Leading blocks of ``prompt`` the index says ``worker`` holds, any tier (what a peer's
        agent counts when it looks for a peer; the index reports a block in its best tier, GPU
        first, so A's CPU copies show as GPU while vLLM still holds them too)."""
        keys = block_keys(prompt, BLOCK, MODEL)
        m = self.loop.run_until_complete(self.index.match(keys)).get(worker)
        return m.total if m is not None else 0

    def states(self) -> dict[str, dict]:
        return self.loop.run_until_complete(self.index.worker_states())

    def close(self) -> None:
        self.loop.run_until_complete(self.index.close())
        self.loop.close()


def wait_for(what: str, cond, timeout_s: float, interval_s: float = 0.05):
    """Poll ``cond()`` until truthy; returns its value; TimeoutError naming ``what``."""
    end = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(interval_s)


# ---- processes ----------------------------------------------------------------------------------
class Procs:
    """Processes of this run, each in its own session under ``timeout -s KILL deadline_s``, logs
    in ``work``; :meth:`stop` stops them all (SIGTERM to each group, SIGKILL after 30 s)."""

    def __init__(self, work: Path, deadline_s: float) -> None:
        self.work, self.deadline_s = work, deadline_s
        self.popens: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              link: ShapedLink | None = None) -> subprocess.Popen:
        log = self.work / f"{name}.log"
        full = ["timeout", "-s", "KILL", str(int(self.deadline_s))] + (link.exec_argv(argv) if link else argv)
        with open(log, "w") as f:
            p = subprocess.Popen(full, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                 start_new_session=True)
        self.popens.append(p)
        self.logs[name] = log
        return p

    def check_alive(self) -> None:
        for (name, log), p in zip(self.logs.items(), self.popens):
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}):\n{log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        stop_groups(self.popens, grace_s=30)


def start_cluster(procs: Procs, link: ShapedLink, model: Path, args: argparse.Namespace,
                  block_bytes: int) -> tuple[dict[str, str], str]:
    """Redis, A's agent (inside the namespace, serving peers on its address), B's agent, and the
    two vLLM servers; returns ``({"a": url, "b": url}, redis url as seen from here)``."""
    tag = f"kvr-bpp-{os.getpid()}"
    (redis_port, a_http, a_ev, a_rp, b_http, b_ev, b_rp, serve_port) = free_ports(8)
    procs.start("redis", ["redis-server", "--port", str(redis_port), "--bind", f"127.0.0.1 {link.host_ip}",
                          "--protected-mode", "no", "--save", "", "--appendonly", "no"])
    wait_for("redis", lambda: _redis_ping(redis_port), 20)
    cpu_bytes = TIER_BLOCKS * block_bytes
    # a pull must never hit the connector's deadline here: 3x the slowest rate's transfer time, >= 1 s
    slowest = min(args.rates_gbit) * 1e9 / 8
    deadline_ms = max(1000.0, 3000 * LOADED_BLOCKS * block_bytes / slowest)
    urls = {}
    for wid, http, ev, rp in (("a", a_http, a_ev, a_rp), ("b", b_http, b_ev, b_rp)):
        inside = wid == "a"
        host = link.host_ip if inside else "127.0.0.1"   # vLLM and Redis as the agent sees them
        sock = procs.work / f"{wid}.sock"
        agent = [sys.executable, "-m", "kvroute", "agent", "--worker-id", wid,
                 "--events", f"tcp://{host}:{ev}", "--replay", f"tcp://{host}:{rp}",
                 "--index", f"redis://{host}:{redis_port}/0", "--model", MODEL, "--block-size", str(BLOCK),
                 "--tier-socket", str(sock), "--tier-shm", f"/dev/shm/{tag}-{wid}",
                 "--cpu-tier-bytes", str(cpu_bytes), "--remove-tiers-on-exit"]
        if inside:
            agent += ["--serve-peers", f"{link.ns_ip}:{serve_port}"]
        procs.start(f"agent-{wid}", agent, link=link if inside else None)
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                  "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"}
        extra = {"peer_pull_deadline_ms": deadline_ms}
        if args.locate_timeout_ms is not None:
            extra["peer_locate_timeout_ms"] = args.locate_timeout_ms
        argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(http),
                "--max-model-len", "4096", "--block-size", str(BLOCK), "--enable-prefix-caching",
                "--dtype", "bfloat16", "--enforce-eager", "--num-gpu-blocks-override", str(GPU_BLOCKS),
                "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
                "--kv-transfer-config", json.dumps(kv_transfer_config(cpu_bytes, agent_socket=sock, **extra))]
        core = "0" if wid == "a" else str(min(1, (os.cpu_count() or 1) - 1))
        procs.start(wid, argv, env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_SERVER_DEV_MODE": "1",
                                    "VLLM_CPU_OMP_THREADS_BIND": core, **vllm_env()})
        urls[wid] = f"http://127.0.0.1:{http}"
    end = time.monotonic() + args.start_timeout_s
    for wid, url in urls.items():
        while True:
            procs.check_alive()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"vLLM {wid} not healthy after {args.start_timeout_s:.0f} s:\n"
                                   f"{procs.logs[wid].read_text(errors='replace')[-3000:]}")
            time.sleep(1)
    return urls, f"redis://127.0.0.1:{redis_port}/0"


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# ---- the cases ----------------------------------------------------------------------------------
def read_load(blog: LogTail, rid: str, load_expected: bool, pull_expected: bool,
              wait_s: float = 5.0) -> tuple[tuple[int, ...] | None, tuple[int, float] | None, str | None]:
    """The load (cpu, ssd, peer, gone blocks) B's connector logged for request ``rid`` and the pull
    (blocks, ms) its worker logged since the last read of ``blog``, read for at least 0.2 s (a stray
    line shows) and until the expected lines came or ``wait_s``; and a problem, or None."""
    t0 = time.monotonic()
    text = ""
    while True:
        text += blog.text()
        loads = [(int(c), int(s), int(p), int(g)) for r, c, s, p, _, g in TIER_LINE.findall(text)
                 if r.startswith(rid + "-") or r == rid]
        pulls = [(int(got), int(n), peer, float(ms)) for got, n, peer, ms in PULL_LINE.findall(text)]
        came = (loads or not load_expected) and (pulls or not pull_expected)
        elapsed = time.monotonic() - t0
        if (came and elapsed >= 0.2) or elapsed >= wait_s:
            break
        time.sleep(0.05)
    problem = None
    if len(loads) > 1 or len(pulls) > 1:
        problem = f"{len(loads)} loads and {len(pulls)} pulls logged for one request"
    elif pulls and not pull_expected:
        problem = f"unexpected pull: {pulls[0]}"
    elif pulls and pulls[0][:3] != (LOADED_BLOCKS, LOADED_BLOCKS, "a"):
        problem = f"pulled {pulls[0][0]} of {pulls[0][1]} blocks from {pulls[0][2]}"
    return (loads[-1] if loads else None), ((pulls[-1][0], pulls[-1][3]) if pulls else None), problem


def run_case(case: str, urls: dict[str, str], prompts: Prompts, blog: LogTail, index: Index,
             link: ShapedLink, block_bytes: int, settle_s: float) -> dict:
    """One measured request of ``case`` (``recompute``, ``cpu`` or ``pull@...``), sent ``settle_s``
    seconds after the steps that prepare it; returns its run record (``ok`` False with ``problem``
    when a check failed)."""
    b = urls["b"]
    prompt = prompts.next()
    if case == "cpu":
        ttft(b, prompt)
        reset_prefix_cache(b, MODEL)
    elif case.startswith("pull"):
        ttft(urls["a"], prompt)
        try:
            wait_for("A's blocks in the index", lambda: index.held_blocks("a", prompt) >= LOADED_BLOCKS, 30)
        except TimeoutError as exc:
            return {"case": case, "ok": False, "problem": str(exc)}
    time.sleep(settle_s)   # what the steps before left running (A's agent, Redis, vLLM's clean-up) ends first
    blog.text()
    tx0 = link.ns_tx_bytes()
    seconds, cached, rid = ttft(b, prompt)
    link_bytes = link.ns_tx_bytes() - tx0
    pulling = case.startswith("pull")
    load, pull, problem = read_load(blog, rid, case != "recompute", pulling)
    want_cached, want_load = {"recompute": (0, None), "cpu": (CACHED_TOKENS, (LOADED_BLOCKS, 0, 0, 0))}.get(
        case, (CACHED_TOKENS, (0, 0, LOADED_BLOCKS, 0)))
    if problem is None and load != want_load:
        problem = f"connector logged load {load} (cpu, ssd, peer, gone), expected {want_load}"
    if problem is None and cached != want_cached:
        problem = f"{cached} cached tokens, expected {want_cached}"
    if problem is None and pulling and pull is None:
        problem = "no pull logged"
    rec = {"case": case, "ok": problem is None, "problem": problem, "ttft_ms": seconds * 1000,
           "cached_tokens": cached, "link_bytes": link_bytes, "request_id": rid}
    if pull is not None:
        rec.update(pulled_blocks=pull[0], pulled_bytes=pull[0] * block_bytes, pull_ms=pull[1])
    return rec


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float, str]:
    """``(a, s, how)`` of ``y = a + s x`` by least squares over ``points``; ``s`` = 1 and ``a`` the
    median of ``y - x`` when the x's do not differ or the slope is <= 0."""
    xs = [x for x, _ in points]
    if len(set(xs)) >= 2:
        n = len(points)
        mx, my = sum(xs) / n, sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x in xs)
        s = sum((x - mx) * (y - my) for x, y in points) / var
        if s > 0:
            return my - s * mx, s, "least squares"
    return statistics.median(y - x for x, y in points), 1.0, "slope fixed at 1 (median offset)"


def measure_link(link: ShapedLink, rates: list[float | None], fig: dict) -> dict[float | None, float]:
    """Raw TCP bits/s out of the namespace at each setting (median of 3); printed and tabled."""
    print("\nRaw TCP out of the namespace (Python sender inside, this process receiving; median of 3)")
    out = {}
    for rate in rates:
        link.shape(rate)
        n = 64 << 20 if rate is None or rate >= 5e9 else max(8 << 20, int(rate / 8 * 0.25))
        runs = [tcp_throughput_bytes_per_s(link, n) * 8 for _ in range(3)]
        out[rate] = statistics.median(runs)
        note = ""
        if rate and out[rate] < 0.9 * rate:
            note = " (this machine cannot fill it: the sender, not the qdisc, sets the rate)"
        print(f"  {'unshaped' if rate is None else gbit(rate):>14s}: {gbit(out[rate]):>14s}"
              + (f" ({out[rate] / rate:.0%} of nominal){note}" if rate else "")
              + f"   runs {', '.join(f'{r / 1e9:.2f}' for r in runs)}   {link.qdisc()}")
        add_table(fig, "link", [{"setting": "unshaped" if rate is None else f"{rate / 1e9:g}gbit",
                                 "nominal_bits_per_s": rate, "tcp_bits_per_s": out[rate], "tcp_runs_bits_per_s": runs,
                                 "transfer_bytes": n, "qdisc": link.qdisc()}])
    link.shape(None)
    return out


def bench(args: argparse.Namespace, fig: dict, link: ShapedLink, procs: Procs, model: Path, block_bytes: int) -> int:
    """Start the cluster, warm it up, measure the link and every case; returns the exit status
    (1 when a run failed its check). Raises RuntimeError/TimeoutError when the cluster does not
    come up or a process dies."""
    urls, redis_url = start_cluster(procs, link, model, args, block_bytes)
    index = Index(redis_url)
    try:
        fp = wait_for("both agents' peer state (A serving, same layout as B)", lambda: _peer_ready(index), 90, 0.5)
        agent_block_bytes = fp["block_bytes"]
        print(f"A's agent serves peers on {fp['serve']} (inside {link.ns}); block {agent_block_bytes} bytes "
              f"of {BLOCK} tokens")
        if agent_block_bytes != block_bytes:
            raise RuntimeError(f"the agents' block is {agent_block_bytes} bytes, the model's config says {block_bytes}")
        blog = LogTail(procs.logs["b"])
        prompts = Prompts()
        rates: list[float | None] = [r * 1e9 for r in args.rates_gbit] + [None]
        cases = ["recompute", "cpu"] + [f"pull@{'unshaped' if r is None else f'{r / 1e9:g}gbit'}" for r in rates]
        rate_of = dict(zip(cases[2:], rates))
        # warm-up (not measured): each server's first requests, a first CPU load and a first pull
        # (the peer connection is set up then and kept)
        for url in urls.values():
            ttft(url, prompts.next())
        warm = {c: run_case(c, urls, prompts, blog, index, link, block_bytes, args.settle_s)
                for c in ("cpu", "pull@unshaped")}
        for c, rec in warm.items():
            if not rec["ok"]:
                print(f"warm-up {c} failed: {rec['problem']}")
        tcp = measure_link(link, rates, fig)
        runs: list[dict] = []
        print(f"\nRuns (TTFT of a {PROMPT_TOKENS}-token prompt on B, ms)")
        for rep in range(args.repeats):
            order = list(cases)
            random.Random(rep).shuffle(order)   # no case always follows the same one
            for case in order:
                link.shape(rate_of.get(case))
                rec = run_case(case, urls, prompts, blog, index, link, block_bytes, args.settle_s)
                rec["repeat"] = rep
                runs.append(rec)
                extra = (f"  pulled {rec['pulled_blocks']} blocks in {rec['pull_ms']:.1f} ms, "
                         f"{rec['link_bytes']:,} B on the link") if "pull_ms" in rec else ""
                print(f"  #{rep} {case:18s} " + (f"{rec['ttft_ms']:8.1f}" if "ttft_ms" in rec else "       -")
                      + f"  cached {rec.get('cached_tokens', '-')}{extra}"
                      + ("" if rec["ok"] else f"   FAILED: {rec['problem']}"), flush=True)
            procs.check_alive()
        link.shape(None)
        add_table(fig, "runs", runs)
        return report(args, fig, cases, rate_of, runs, tcp, index, block_bytes)
    finally:
        index.close()


def _peer_ready(index: Index) -> dict | None:
    states = index.states()
    a, b = (states.get(w, {}).get("peer") or {} for w in ("a", "b"))
    if a.get("serve") and a.get("fingerprint") and a.get("fingerprint") == b.get("fingerprint"):
        return a
    return None


def report(args: argparse.Namespace, fig: dict, cases: list[str], rate_of: dict, runs: list[dict],
           tcp: dict, index: Index, block_bytes: int) -> int:
    ok = {c: [r for r in runs if r["case"] == c and r["ok"]] for c in cases}
    med = {c: statistics.median(r["ttft_ms"] for r in ok[c]) if ok[c] else None for c in cases}
    rec_ms = med["recompute"]
    print(f"\nTTFT of a {PROMPT_TOKENS}-token prompt on B (small model, one CPU core), median of the ok runs of "
          f"{args.repeats}")
    print(f"  {'case':18s} {'ok':>5s} {'TTFT p50 ms':>12s} {'x recompute':>12s} {'pulled B':>10s} {'pull ms':>8s} "
          f"{'pull rate':>15s} {'link B':>10s} {'link: nominal -> raw TCP':>30s}")
    for c in cases:
        rs, n_runs = ok[c], sum(r["case"] == c for r in runs)
        pulled = statistics.median(r["pulled_bytes"] for r in rs) if rs and "pulled_bytes" in rs[0] else None
        pull_ms = statistics.median(r["pull_ms"] for r in rs) if pulled else None
        link_b = statistics.median(r["link_bytes"] for r in rs) if rs and c.startswith("pull") else None
        rate = rate_of.get(c)
        ratio = med[c] / rec_ms if med[c] is not None and rec_ms else None
        pull_rate = pulled * 8 / (pull_ms / 1000) if pulled and pull_ms else None
        linkcol = (f"{'unshaped' if rate is None else gbit(rate)} -> {gbit(tcp.get(rate))}"
                   if c.startswith("pull") else "")
        print(f"  {c:18s} {len(rs):>2d}/{n_runs:<2d} {_f(med[c], 12, 1)} {_f(ratio, 12, 2)} {_f(pulled, 10, 0)} "
              f"{_f(pull_ms, 8, 1)} {gbit(pull_rate) if pull_rate else '-':>15s} {_f(link_b, 10, 0)} {linkcol:>30s}"
              "   runs " + ", ".join(f"{r['ttft_ms']:.0f}" for r in rs))
        add_table(fig, "ttft", [{"case": c, "prompt_tokens": PROMPT_TOKENS, "ttft_ms": med[c],
                                 "ratio_to_recompute": ratio,
                                 "runs_ms": [r["ttft_ms"] for r in rs], "ok_runs": len(rs), "runs": n_runs,
                                 "pulled_bytes": pulled, "pull_ms": pull_ms,
                                 "pull_bytes_per_s": pull_rate / 8 if pull_rate else None, "link_bytes": link_b,
                                 "nominal_bits_per_s": rate if c.startswith("pull") else None,
                                 "tcp_bits_per_s": tcp.get(rate) if c.startswith("pull") else None}])
    failed = [r for r in runs if not r["ok"]]
    for r in failed:
        print(f"  FAILED run #{r['repeat']} {r['case']}: {r['problem']}")

    # this model's bytes per token, from the agents' published state
    states = index.states()
    peer_b = states.get("b", {}).get("peer") or {}
    tiers_b = states.get("b", {}).get("tiers") or {}
    bytes_per_token = (peer_b.get("block_bytes") or block_bytes) / (peer_b.get("block_size") or BLOCK)
    print(f"\nBytes per token, this model: {bytes_per_token:,.0f} B (agent: block {peer_b.get('block_bytes')} B / "
          f"{peer_b.get('block_size')} tokens; config: {block_bytes} B). B's agent: {tiers_b.get('pulls')} pulls, "
          f"{tiers_b.get('pulled_blocks')} blocks, {tiers_b.get('pulled_bytes')} B, "
          f"{tiers_b.get('failed_pulls')} failed; "
          f"its link estimate {gbit((peer_b.get('link_bytes_per_s') or 0) * 8 or None)}, "
          f"overhead {peer_b.get('pull_overhead_ms')} ms (over its last pulls, all rates mixed)")

    # the crossover: a link-bound model anchored on the slowest shaped setting (see the docstring)
    shaped = sorted((c for c in cases if rate_of.get(c) and ok[c]), key=lambda c: rate_of[c])
    pull_bytes = LOADED_BLOCKS * BLOCK * bytes_per_token
    cross: dict = {"bytes_per_token": bytes_per_token, "recompute_ttft_ms": rec_ms, "pull_bytes": pull_bytes,
                   "shaped_cases": len(shaped)}
    if shaped and rec_ms:
        lo = shaped[0]
        nominal = rate_of[lo]
        goodput = min(1.0, tcp[nominal] / nominal)
        fixed_ms = statistics.median(r["ttft_ms"] - pull_bytes * 8 / tcp[nominal] * 1000 for r in ok[lo])
        crossover = pull_bytes * 8 / goodput / ((rec_ms - fixed_ms) / 1000) if rec_ms > fixed_ms else None
        a_ms, s, how = fit_line([(pull_bytes * 8 / rate_of[c] * 1000, med[c]) for c in shaped])
        direct = s * pull_bytes * 8 / ((rec_ms - a_ms) / 1000) if rec_ms > a_ms else None
        top = [r["pulled_bytes"] * 8 / r["pull_ms"] * 1000 for r in ok.get("pull@unshaped", [])]
        per_token = bytes_per_token * 8 * PROMPT_TOKENS / (rec_ms / 1000)
        print(f"Pull TTFT model: {fixed_ms:.1f} ms fixed (TTFT at {gbit(nominal)} minus {pull_bytes:,.0f} B at its "
              f"raw TCP rate, median) + bytes / ({goodput:.2f} x nominal rate)")
        if top:
            print(f"The pull path's own rate on the unshaped link (agent to agent to connector, connector's pull "
                  f"time): {gbit(statistics.median(top))}")
        if crossover is None:
            print(f"Crossover: none: a pull's fixed part ({fixed_ms:.1f} ms) is above recompute ({rec_ms:.1f} ms)")
        else:
            print(f"Crossover, this model (recompute {rec_ms:.1f} ms): pulling beats recompute above "
                  f"{gbit(crossover)} ({crossover / 8e6:.1f} MB/s)")
        print(f"  cross-checks: a least-squares line over the TTFT medians of {len(shaped)} shaped settings ({how}: "
              f"{a_ms:.1f} ms + {s:.3f} x bytes / nominal rate): {gbit(direct)}; bytes per token x recompute "
              f"tokens/s (fixed costs ignored): {gbit(per_token)}")
        cross.update(anchor_case=lo, anchor_nominal_bits_per_s=nominal, goodput=goodput, fixed_ms=fixed_ms,
                     crossover_bits_per_s=crossover, fit_a_ms=a_ms, fit_s=s, fit=how, fit_crossover_bits_per_s=direct,
                     per_token_crossover_bits_per_s=per_token,
                     pull_path_bits_per_s=statistics.median(top) if top else None)
    else:
        print("Crossover: no successful shaped pull (or no recompute run): not computed")
    add_table(fig, "crossover", [cross])

    print(f"\nExtrapolated to a Llama-3-8B-sized model: {LLAMA8B_BYTES_PER_TOKEN:,} B per token ({LLAMA8B_FORMULA});")
    print("crossover bandwidth = bytes per token x GPU prefill tokens per second (fixed overheads ignored: the "
          "prefill's fixed part, the pull's set-up and latency)")
    rows = []
    for source, tok_s in prefill_rates():
        bits = LLAMA8B_BYTES_PER_TOKEN * tok_s * 8
        print(f"  {source:62s} {tok_s:8,.0f} tokens/s -> {gbit(bits)} ({bits / 8e9:.2f} GB/s)")
        rows.append({"source": source, "bytes_per_token": LLAMA8B_BYTES_PER_TOKEN, "prefill_tokens_per_s": tok_s,
                     "crossover_bits_per_s": bits})
    ms = mocker_prefill_ms(PROMPT_TOKENS)
    bits = LLAMA8B_BYTES_PER_TOKEN * PROMPT_TOKENS * 8 / (ms / 1000)
    src = f"Dynamo mocker H100 full fit, one {PROMPT_TOKENS}-token prompt ({ms:.1f} ms incl. its fixed part)"
    print(f"  {src:62s} {PROMPT_TOKENS / ms * 1000:8,.0f} tokens/s -> {gbit(bits)} ({bits / 8e9:.2f} GB/s)")
    rows.append({"source": src, "bytes_per_token": LLAMA8B_BYTES_PER_TOKEN,
                 "prefill_tokens_per_s": PROMPT_TOKENS / ms * 1000,
                 "crossover_bits_per_s": bits, "prefill_ms": ms})
    add_table(fig, "extrapolation", rows)
    add_chart(fig, "bars", "ttft.png", table="ttft", group_by="case", values=["ttft_ms"], ylabel="TTFT (ms)",
              title=f"TTFT of a {PROMPT_TOKENS}-token prompt on B: recompute, CPU tier, pulled from A, "
                    f"median of {args.repeats}")
    return 1 if failed or rec_ms is None else 0


def _f(v: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if v is None else f"{v:>{width},.{digits}f}"


# ---- main ---------------------------------------------------------------------------------------
def _sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rates-gbit", default="1,10,25",
                    help="link rates of the pull cases, Gbit/s, comma-separated (default 1,10,25; unshaped is added)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, rates 1 and 25 Gbit/s")
    ap.add_argument("--vllm-python", default=os.environ.get("KVR_VLLM_PYTHON", ""))
    ap.add_argument("--locate-timeout-ms", type=float, default=None,
                    help="the connector's peer_locate_timeout_ms (default: the connector's own, 100)")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="pause before each measured request, after the requests that prepare it (default 0.5)")
    ap.add_argument("--start-timeout-s", type=float, default=900, help="longest wait for both vLLM servers")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="hard limit on every process started (default: start timeout + 120 s per repeat + 300 s)")
    ap.add_argument("--keep-work", action="store_true", help="keep the folder of logs and sockets (printed)")
    add_output_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.rates_gbit = 1, "1,25"
    try:
        args.rates_gbit = [float(x) for x in args.rates_gbit.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rates-gbit {args.rates_gbit!r}: numbers separated by commas")
    if not args.rates_gbit or min(args.rates_gbit) <= 0 or args.repeats < 1:
        ap.error("--rates-gbit needs rates > 0 and --repeats >= 1")
    if not args.vllm_python:
        ap.error("set KVR_VLLM_PYTHON or --vllm-python")
    if shutil.which("redis-server") is None:
        ap.error("redis-server is not installed (the index needs it)")
    if args.deadline_s is None:
        args.deadline_s = args.start_timeout_s + 120 * args.repeats + 300
    try:
        check_privileges()
    except NetnsError as exc:
        print(f"bench_peer_pull: {exc}", file=sys.stderr)
        return 2
    for what in remove_stale():
        print(f"removed a stale {what}")
    signal.signal(signal.SIGTERM, _sigterm)
    fig = new_figures("bench_peer_pull", args)
    model = ensure_model(MODEL, args.vllm_python)
    block_bytes = model_block_bytes(model)
    work = Path(tempfile.mkdtemp(prefix="kvr-bench-peer-pull-"))
    link = ShapedLink()
    procs = Procs(work, args.deadline_s)
    status = 1
    try:
        try:
            link.open()
        except NetnsError as exc:
            print(f"bench_peer_pull: cannot make the network namespace: {exc}", file=sys.stderr)
            return 2
        print(f"namespace {link.ns}: {link.host_dev} {link.host_ip} <-> {link.ns_dev} {link.ns_ip} (inside); "
              f"A's agent inside, pulls shaped on {link.ns_dev}")
        status = bench(args, fig, link, procs, model, block_bytes)
    except KeyboardInterrupt:
        print("bench_peer_pull: interrupted; cleaning up", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, NetnsError, httpx.HTTPError) as exc:
        print(f"bench_peer_pull: {exc}", file=sys.stderr)
        for name in ("b", "agent-b", "agent-a"):
            if name in procs.logs:
                print(f"--- {name}'s log, last lines:\n{procs.logs[name].read_text(errors='replace')[-2000:]}",
                      file=sys.stderr)
        status = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):   # the clean-up must not be cut short
            signal.signal(sig, signal.SIG_IGN)
        procs.stop()
        problems = link.close()
        if problems:
            print(f"bench_peer_pull: clean-up problems: {'; '.join(problems)}", file=sys.stderr)
        for p in Path("/dev/shm").glob(f"kvr-bpp-{os.getpid()}-*"):
            p.unlink(missing_ok=True)
        if args.keep_work:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    emit(fig, args)
    return status


if __name__ == "__main__":
    sys.exit(main())
