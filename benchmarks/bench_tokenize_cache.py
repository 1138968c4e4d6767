#!/usr/bin/env python3
"""Gateway CPU per request on 10-turn chats growing to ~8k tokens, prefix token cache on vs off.

Each conversation re-sends its whole history every turn, as chat clients do: a shared system
prompt, then per turn a new user message and (from the second turn) the previous assistant reply,
sized so the 10th turn is about ``--tokens`` prompt tokens with the model's tokenizer (``--model``:
the tiny fixture by default, ~1.2 characters per token; the generated small model,
``.cache/models/small-seed0``, has a larger vocabulary).
Several conversations advance turn by turn, interleaved, as concurrent users would.

Two measurements, each repeated ``--repeats`` times with new conversations, cache off and on taking
turns (so drift hits both alike):

- ``tokenize path``: the gateway's tokenization step in this process (``router.route.prompt_blocks``: chat
  template, encode, block keys), CPU time (``time.process_time``) per request;
- ``plain prompts``: completions prompts without special tokens (``--conversations`` x ``--turns``
  of them, each about ``--tokens`` tokens, none sent twice, as a trace's unique prompts), through
  the same step: a plain text has no cut, so the cache only pays off when a text comes again, and
  this says what it costs when none does (it stores a plain text at its second sighting);
- ``gateway process``: the same bodies sent to two ``kvroute serve`` processes over one simulated
  worker (``kvroute sim``, near-instant), one with ``routing.tokenize_cache_max_tokens: 0``, one
  request at a time; the CPU time each gateway used (``/proc/<pid>/task/*/schedstat``, ns), per
  request: parsing, routing, proxying and tokenization together.

The table gives the median over repeats of the mean CPU per request (all turns, and the 10th turn
alone), with min-max over repeats, and the ratio on/off.

Usage: python benchmarks/bench_tokenize_cache.py [--repeats 5] [--conversations 8] [--turns 10]
       [--tokens 8000] [--model DIR] [--no-gateway] [--json FILE] [--plot DIR]
Everything runs on loopback and stops by itself (each process has a deadline).

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``cpu`` (per measurement
and turns: ``cache_off_cpu_per_request_ms`` and ``cache_on_cpu_per_request_ms``, medians over the
repeats, with ``_min_ms``/``_max_ms`` and every repeat's value, ``on_off_ratio``, ``speedup``) and
table ``cache`` (the in-process cache's hits, misses, entries, tokens held). ``--plot DIR`` draws
``cpu_per_request.png`` (CPU per request, cache on vs off).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench_gateway import start  # same folder: a process started under a deadline
from kvcore.tokenization import PromptTokenizer
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures
from kvbench.workers import stop_groups, wait_ready
from kvroute.up import free_ports
from router.config.schema import ModelConfig
from router.route.prompt_blocks import _prompt_blocks

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests/fixtures/tiny-model"
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega cache block token prefix route worker").split()
SYSTEM_WORDS = 120


def _words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def conversations(tok: PromptTokenizer, n: int, turns: int, tokens: int, seed: int) -> list[list[dict]]:
    """``n`` conversations of ``turns`` chat bodies each; the last body of each is about ``tokens``
    prompt tokens. Body ``t`` holds the system prompt, turns 0..t-1 (user + assistant) and user t."""
    rnd = random.Random(seed)
    system = "You are a careful assistant. " + _words(random.Random(0), SYSTEM_WORDS)
    probe = tok.encode_text(_words(rnd, 1000), False)
    tokens_per_word = len(probe) / 1000
    per_turn_words = max(8, int((tokens - SYSTEM_WORDS * tokens_per_word) / turns / tokens_per_word))
    user_words, reply_words = int(per_turn_words * 0.7), per_turn_words - int(per_turn_words * 0.7)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": system}]
        bodies = []
        for t in range(turns):
            if t:
                msgs.append({"role": "assistant", "content": _words(rnd, reply_words)})
            msgs.append({"role": "user", "content": _words(rnd, user_words)})
            bodies.append({"model": "tiny", "messages": list(msgs), "max_tokens": 1})
        out.append(bodies)
    return out


def interleaved(convs: list[list[dict]]) -> list[tuple[int, dict]]:
    """(turn, body) in arrival order: every conversation's turn 0, then every turn 1, ..."""
    return [(t, c[t]) for t in range(len(convs[0])) for c in convs]


def run_tokenize_path(tok: PromptTokenizer, model: ModelConfig, reqs: list[tuple[int, dict]],
                      kind: str = "chat") -> dict[str, float]:
    """CPU ms per request of the gateway's tokenization step on ``kind`` bodies (mean over all, and
    the last turn)."""
    last = max(t for t, _ in reqs)
    all_ms, last_ms = [], []
    for t, body in reqs:
        c0 = time.process_time()
        _prompt_blocks(tok, model, kind, body, None)
        ms = (time.process_time() - c0) * 1e3
        all_ms.append(ms)
        if t == last:
            last_ms.append(ms)
    return {"all": statistics.fmean(all_ms), "last": statistics.fmean(last_ms)}


def plain_prompts(tok: PromptTokenizer, n: int, tokens: int, seed: int) -> list[dict]:
    """``n`` completions bodies of about ``tokens`` prompt tokens each, no two alike."""
    rnd = random.Random(seed)
    tokens_per_word = len(tok.encode_text(_words(rnd, 1000), False)) / 1000
    return [{"model": "tiny", "prompt": f"{i}: " + _words(rnd, int(tokens / tokens_per_word)), "max_tokens": 1}
            for i in range(n)]


def process_cpu_s(proc: subprocess.Popen) -> float:
    """CPU seconds (ns resolution) used so far by every thread of the process ``timeout`` started
    for ``proc`` (``/proc/<pid>/task/*/schedstat``, first field)."""
    child = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0]
    total = 0
    for task in os.listdir(f"/proc/{child}/task"):
        try:
            total += int(open(f"/proc/{child}/task/{task}/schedstat").read().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that just exited
            pass
    return total / 1e9


async def run_gateway(url: str, proc: subprocess.Popen, reqs: list[tuple[int, dict]]) -> dict[str, float]:
    """CPU ms per request of the gateway process, sent one at a time (the CPU between two readings
    is the gateway's work on those requests): mean over all, and over the last turn's requests."""
    last = max(t for t, _ in reqs)
    spent_s = {"all": 0.0, "last": 0.0}
    count = {"all": 0, "last": 0}
    async with aiohttp.ClientSession() as session:
        for turn in range(last + 1):
            bodies = [b for t, b in reqs if t == turn]
            c0 = process_cpu_s(proc)
            for body in bodies:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: {r.status}")
            used = process_cpu_s(proc) - c0
            spent_s["all"] += used
            count["all"] += len(bodies)
            if turn == last:
                spent_s["last"] += used
                count["last"] += len(bodies)
    return {k: spent_s[k] * 1e3 / count[k] for k in spent_s}


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.3f} ({min(xs):.3f}-{max(xs):.3f})"


def print_table(title: str, rows: dict[str, dict[str, list[float]]]) -> None:
    print(f"\n{title}")
    print(f"{'requests':<14} {'cache off ms':>24} {'cache on ms':>24} {'on/off':>7} {'speedup':>8}")
    for what, label in (("all", "all 10 turns"), ("last", "10th turn")):
        off, on = rows["off"][what], rows["on"][what]
        ratio = statistics.median(on) / statistics.median(off)
        print(f"{label:<14} {summary(off):>24} {summary(on):>24} {ratio:>7.3f} {1 / ratio:>7.1f}x")


def table_rows(measurement: str, rows: dict[str, dict[str, list[float]]]) -> list[dict]:
    """The rows of :func:`print_table` for the figures: CPU ms per request, cache off and on."""
    out = []
    for what, label in (("all", "all 10 turns"), ("last", "10th turn")):
        row: dict = {"measurement": measurement, "turns": label}
        for mode in ("off", "on"):
            xs = rows[mode][what]
            row.update({f"cache_{mode}_cpu_per_request_ms": statistics.median(xs), f"cache_{mode}_min_ms": min(xs),
                        f"cache_{mode}_max_ms": max(xs), f"cache_{mode}_repeats_ms": list(xs)})
        ratio = row["cache_on_cpu_per_request_ms"] / row["cache_off_cpu_per_request_ms"]
        out.append({**row, "on_off_ratio": ratio, "speedup": 1 / ratio})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens of the last turn")
    ap.add_argument("--model", type=Path, default=TINY, help="model directory (tokenizer + chat template)")
    ap.add_argument("--no-gateway", action="store_true", help="only the in-process tokenize path")
    add_output_args(ap)
    args = ap.parse_args()
    fig = new_figures("bench_tokenize_cache", args)
    add_chart(fig, "bars", "cpu_per_request.png", table="cpu", group_by=["measurement", "turns"],
              values=["cache_off_cpu_per_request_ms", "cache_on_cpu_per_request_ms"], ylabel="CPU ms per request",
              title=f"prefix token cache off vs on: {args.conversations} conversations x {args.turns} turns to "
                    f"~{args.tokens} tokens, medians of {args.repeats} repeats")
    model_dir = args.model.resolve()
    model = ModelConfig(name="tiny", tokenizer=str(model_dir), block_size=32)
    toks = {"off": PromptTokenizer(model_dir, cache_max_tokens=0), "on": PromptTokenizer(model_dir)}
    sample = conversations(toks["off"], 1, args.turns, args.tokens, seed=1)[0]
    sizes = [len(toks["off"].encode_chat(b)) for b in sample]
    chars = len(toks["off"].render_chat(sample[-1]))
    print(f"machine: {os.cpu_count()} CPUs; model {model_dir.name}; {args.conversations} conversations x "
          f"{args.turns} turns, prompt tokens per turn e.g. {sizes} (last: {chars} characters); "
          f"{args.repeats} repeats (median, min-max)")

    rows: dict[str, dict[str, list[float]]] = {m: {"all": [], "last": []} for m in toks}
    for r in range(args.repeats):
        reqs = interleaved(conversations(toks["off"], args.conversations, args.turns, args.tokens, seed=100 + r))
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if toks[mode].token_cache is not None:
                toks[mode].token_cache.clear()
            got = run_tokenize_path(toks[mode], model, reqs)
            for k, v in got.items():
                rows[mode][k].append(v)
    print_table("tokenize path (router.route.prompt_blocks: template + encode + block keys), CPU ms per request", rows)
    add_table(fig, "cpu", table_rows("tokenize path", rows))
    st = toks["on"].cache_stats()
    print(f"cache: {st.hits} hits, {st.misses} misses, {st.fallbacks} fallbacks; {st.entries} entries, "
          f"{st.cached_tokens} ids held ({st.size_tokens} of {st.max_tokens} counted)")
    add_table(fig, "cache", [{"hits": st.hits, "misses": st.misses, "fallbacks": st.fallbacks, "entries": st.entries,
                              "cached_tokens": st.cached_tokens, "size_tokens": st.size_tokens,
                              "max_tokens": st.max_tokens}])
    plain: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.repeats):
        bodies = plain_prompts(toks["off"], args.conversations * args.turns, args.tokens, seed=300 + r)
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            plain[mode].append(run_tokenize_path(toks[mode], model, [(0, b) for b in bodies], "completion")["all"])
    ratio = statistics.median(plain["on"]) / statistics.median(plain["off"])
    print(f"\nplain prompts, each once ({args.conversations * args.turns} completions of ~{args.tokens} tokens), "
          f"CPU ms per request: cache off {summary(plain['off'])}, on {summary(plain['on'])}, on/off {ratio:.3f}")
    add_table(fig, "cpu", [{"measurement": "plain prompts", "turns": "each once",
                            **{f"cache_{m}_cpu_per_request_ms": statistics.median(plain[m]) for m in plain},
                            **{f"cache_{m}_repeats_ms": list(plain[m]) for m in plain},
                            "on_off_ratio": ratio, "speedup": 1 / ratio}])
    if args.no_gateway:
        emit(fig, args)
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="bench-tokcache-"))
    procs: list[subprocess.Popen] = []
    try:
        sim_port, on_port, off_port = free_ports(3)
        sim_url = f"http://127.0.0.1:{sim_port}"
        procs.append(start([sys.executable, "-m", "kvroute", "sim", "--model", str(model_dir), "--served-model-name",
                            "tiny", "--host", "127.0.0.1", "--port", str(sim_port), "--block-size", "32",
                            "--max-model-len", "32768", "--num-gpu-blocks-override", "8192",
                            "--enable-prompt-tokens-details", "--speedup", "1e6"], tmp / "sim.log"))
        wait_ready(sim_url + "/health", procs[-1], tmp / "sim.log", 90)
        gateways: dict[str, tuple[str, subprocess.Popen]] = {}
        for mode, port in (("on", on_port), ("off", off_port)):
            cfg = {"listen": {"host": "127.0.0.1", "port": port},
                   "models": [{"name": "tiny", "tokenizer": str(model_dir), "block_size": 32}],
                   "workers": [{"id": "w0", "url": sim_url, "model": "tiny"}], "policy": {"name": "kv_aware"},
                   "routing": {"tokenize_cache_max_tokens": 0 if mode == "off" else 2_000_000}}
            (tmp / f"gateway-{mode}.yaml").write_text(json.dumps(cfg))
            procs.append(start([sys.executable, "-m", "kvroute", "serve", "--config",
                                str(tmp / f"gateway-{mode}.yaml")], tmp / f"gateway-{mode}.log"))
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", procs[-1], tmp / f"gateway-{mode}.log", 90)
            gateways[mode] = (url, procs[-1])
        warm = interleaved(conversations(toks["off"], 2, args.turns, args.tokens, seed=7))
        for url, proc in gateways.values():
            asyncio.run(run_gateway(url, proc, warm))
        grows: dict[str, dict[str, list[float]]] = {m: {"all": [], "last": []} for m in gateways}
        for r in range(args.repeats):
            reqs = interleaved(conversations(toks["off"], args.conversations, args.turns, args.tokens, seed=200 + r))
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                got = asyncio.run(run_gateway(*gateways[mode], reqs))
                for k, v in got.items():
                    grows[mode][k].append(v)
        print_table("gateway process (kvroute serve, everything it does per request), CPU ms per request", grows)
        add_table(fig, "cpu", table_rows("gateway process", grows))
    finally:
        stop_groups(procs)
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
