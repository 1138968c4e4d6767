"""Routing quality of the policies on the Mooncake conversation trace: an offline, cache-only
simulation, printed side by side in one run.

    .venv/bin/python benchmarks/bench_routing_quality.py [--trace PATH] [--workers 8]
        [--gpu-blocks 1000] [--cpu-blocks 0] [--limit N] [--time-scale 1.0]

What is simulated (no model, no HTTP; the policies are the real ones, called as the gateway calls
them):

- The trace (kvcache-ai/Mooncake FAST'25 ``conversation_trace.jsonl``): per request an arrival
  time, input and output token counts and chained block ids of 512 tokens, used directly as block
  keys (full blocks only). All requests share block 0 (a system prompt): the "hot shared prefix"
  case. ``--trace`` defaults to the first 1,000 requests the repo ships
  (``kvbench/data/mooncake_conversation_1000.jsonl``); the whole trace, when the workspace
  has it, is ``../shared/traces/mooncake_conversation_trace.jsonl`` from the repo root (see the
  README.md there). A missing trace is an error (exit 2).
- N workers, each with an LRU prefix cache of ``--gpu-blocks`` blocks and optionally a CPU tier of
  ``--cpu-blocks`` (blocks evicted from GPU go there; a hit there counts as cached, and the block
  moves back to GPU). A request hits the longest run of its blocks from block 0 that the worker
  holds; then all its blocks become the most recently used.
- ``kv_aware`` looks up a :class:`kvcore.index.MemoryIndex` that mirrors every cache change exactly
  (as KV events would, without lag).
- Load, which every policy sees as :class:`WorkerLoad`: a worker prefills its requests one after
  another (FIFO) at ``--prefill-tokens-per-s`` for the uncached tokens; a request then decodes for
  ``output_tokens x --decode-ms-per-token``. ``in_flight``, ``prefill_tokens`` (uncached tokens of
  requests not past prefill) and ``decoding`` come from that queue at each arrival. The modelled
  TTFT (queue wait + own prefill) is reported as a rough indicator only.
- ``session`` gets the conversation's first block after the shared one (``hash_ids[1]``) as its
  session key: a stand-in for a per-conversation header, since the trace has no ids.

Figures: prefix-hit rate (cached prompt tokens / all prompt tokens; the whole trace's
infinite-cache bound is 37.4 %), load imbalance as max/mean over workers of requests routed and of prefill tokens
computed, and modelled TTFT p50/p90. Besides the four policies with default settings, three
kv_aware variants show what the overload guard and the load term do: without a load term every
request shares block 0 with every worker's cache, so all traffic piles onto one worker.

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``policies`` (one row per
policy: ``hit_rate``, ``gpu_hit_rate``, ``cpu_hit_rate`` as fractions, ``requests_max_over_mean``,
``prefill_max_over_mean``, ``ttft_p50_ms``, ``ttft_p90_ms``, ``sim_s``, ``reasons``), table
``per_worker`` (requests and prefill tokens per policy and worker) and ``report``, a
``kvroute bench``-style report with one record per request and policy (send time = arrival,
modelled TTFT, cached tokens, worker). ``--plot DIR`` draws ``ttft_cdf.png`` (modelled TTFT per
policy), ``hit_rate_over_time.png``, ``worker_load.png`` (:mod:`kvbench.plots`),
``hit_rate.png`` and ``load_imbalance.png`` (bars per policy).
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from kvcore.index.base import TierMatch
from kvcore.index.memory import MemoryIndex
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures
from router.policies.base import Candidate, Policy, RouteRequest, WorkerLoad
from router.policies.factory import make_policy

REPO = Path(__file__).resolve().parents[1]
SHIPPED_TRACE = REPO / "kvbench" / "data" / "mooncake_conversation_1000.jsonl"
FULL_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def default_trace() -> Path:
    """The trace slice the repo ships, else the whole trace next to the repo (may be missing)."""
    return SHIPPED_TRACE if SHIPPED_TRACE.exists() else FULL_TRACE


TRACE_BLOCK_TOKENS = 512


@dataclass
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: list[int]  # full blocks only
    session_key: str | None


def load_trace(path: Path, limit: int | None, time_scale: float) -> list[TraceRequest]:
    """The first ``limit`` requests of a Mooncake JSONL trace; arrival times divided by
    ``time_scale`` (2.0 = twice the request rate)."""
    out = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            ids = row["hash_ids"]
            out.append(TraceRequest(
                arrival_s=row["timestamp"] / 1000.0 / time_scale,
                input_tokens=row["input_length"], output_tokens=row["output_length"],
                keys=ids[: row["input_length"] // TRACE_BLOCK_TOKENS],
                session_key=str(ids[1]) if len(ids) > 1 else None))
            if limit and len(out) >= limit:
                break
    return out


class SimWorker:
    """One worker: GPU (+ CPU) LRU block caches mirrored into the index, and a FIFO prefill queue."""

    def __init__(self, worker_id: str, gpu_blocks: int, cpu_blocks: int, index: MemoryIndex) -> None:
        self.worker_id = worker_id
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.gpu_blocks, self.cpu_blocks = gpu_blocks, cpu_blocks
        self.index = index
        self.prefill_free_at = 0.0
        self.prefilling: list[tuple[float, int]] = []  # (prefill end s, uncached tokens)
        self.finishing: list[float] = []  # finish times of in-flight requests
        self.pending_tokens = 0
        self.requests = 0
        self.prefill_tokens_done = 0

    def load_at(self, now: float) -> WorkerLoad:
        while self.prefilling and self.prefilling[0][0] <= now:
            self.pending_tokens -= heapq.heappop(self.prefilling)[1]
        while self.finishing and self.finishing[0] <= now:
            heapq.heappop(self.finishing)
        in_flight = len(self.finishing)
        return WorkerLoad(in_flight=in_flight, prefill_tokens=self.pending_tokens,
                          decoding=in_flight - len(self.prefilling))

    def cached_run(self, keys: list[int]) -> tuple[int, int]:
        """(gpu, cpu) blocks of the longest cached run from block 0."""
        gpu = 0
        while gpu < len(keys) and keys[gpu] in self.gpu:
            gpu += 1
        cpu = gpu
        while cpu < len(keys) and (keys[cpu] in self.gpu or keys[cpu] in self.cpu):
            cpu += 1
        return gpu, cpu - gpu

    def admit(self, keys: list[int]) -> None:
        """Make ``keys`` the most recently used GPU blocks, evicting (to CPU) beyond capacity."""
        new, from_cpu = [], []
        for k in keys:
            if k in self.gpu:
                self.gpu.move_to_end(k)
                continue
            if k in self.cpu:
                del self.cpu[k]
                from_cpu.append(k)
            self.gpu[k] = None
            new.append(k)
        if from_cpu:
            self.index.remove_sync(self.worker_id, "cpu", from_cpu)
        self.index.store_sync(self.worker_id, "gpu", new)
        evicted = []
        while len(self.gpu) > self.gpu_blocks:
            evicted.append(self.gpu.popitem(last=False)[0])
        if evicted:
            self.index.remove_sync(self.worker_id, "gpu", evicted)
            if self.cpu_blocks:
                for k in evicted:
                    self.cpu[k] = None
                self.index.store_sync(self.worker_id, "cpu", evicted)
                dropped = []
                while len(self.cpu) > self.cpu_blocks:
                    dropped.append(self.cpu.popitem(last=False)[0])
                self.index.remove_sync(self.worker_id, "cpu", dropped)

    def start(self, now: float, uncached_tokens: int, output_tokens: int, prefill_tokens_per_s: float,
              decode_s_per_token: float) -> float:
        """Queue one request; returns its modelled TTFT in seconds."""
        prefill_end = max(now, self.prefill_free_at) + uncached_tokens / prefill_tokens_per_s
        self.prefill_free_at = prefill_end
        heapq.heappush(self.prefilling, (prefill_end, uncached_tokens))
        heapq.heappush(self.finishing, prefill_end + output_tokens * decode_s_per_token)
        self.pending_tokens += uncached_tokens
        self.requests += 1
        self.prefill_tokens_done += uncached_tokens
        return prefill_end - now


@dataclass
class Result:
    label: str
    input_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    reasons: Counter = field(default_factory=Counter)
    workers: list[SimWorker] = field(default_factory=list)
    wall_s: float = 0.0
    cached_tokens: list[int] = field(default_factory=list)  # per request, in trace order
    worker_ids: list[str] = field(default_factory=list)  # per request, in trace order


def simulate(label: str, policy: Policy, trace: list[TraceRequest], args: argparse.Namespace) -> Result:
    """Replay ``trace`` through ``policy`` over fresh workers; see the module docstring."""
    index = MemoryIndex()
    workers = [SimWorker(f"w{i}", args.gpu_blocks, args.cpu_blocks, index) for i in range(args.workers)]
    rng = random.Random(args.seed)
    result = Result(label, workers=workers)
    decode_s = args.decode_ms_per_token / 1000.0
    t0 = time.perf_counter()
    for r in trace:
        matches = index.match_sync(r.keys) if policy.uses_index else {}
        candidates = [Candidate(w.worker_id, w.load_at(r.arrival_s),
                                matches.get(w.worker_id) or TierMatch()) for w in workers]
        request = RouteRequest(model="mooncake", prompt_tokens=r.input_tokens,
                               block_size=TRACE_BLOCK_TOKENS, num_blocks=len(r.keys),
                               session_key=r.session_key, rand=rng.random())
        decision = policy.choose(request, candidates)
        worker = workers[int(decision.worker_id[1:])]
        gpu, cpu = worker.cached_run(r.keys)
        worker.admit(r.keys)
        cached = (gpu + cpu) * TRACE_BLOCK_TOKENS
        result.input_tokens += r.input_tokens
        result.gpu_hit_tokens += gpu * TRACE_BLOCK_TOKENS
        result.cpu_hit_tokens += cpu * TRACE_BLOCK_TOKENS
        result.reasons[decision.reason] += 1
        result.cached_tokens.append(cached)
        result.worker_ids.append(worker.worker_id)
        result.ttft_s.append(worker.start(r.arrival_s, r.input_tokens - cached, r.output_tokens,
                                          args.prefill_tokens_per_s, decode_s))
    result.wall_s = time.perf_counter() - t0
    return result


def _max_over_mean(values: list[int]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean else 0.0


def report(results: list[Result]) -> str:
    """The side-by-side table."""
    head = (f"{'policy':<24}{'hit %':>7}{'gpu %':>7}{'cpu %':>7}{'req max/mean':>14}"
            f"{'prefill max/mean':>18}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'sim s':>7}  reasons")
    lines = [head, "-" * len(head)]
    for r in results:
        q = statistics.quantiles(r.ttft_s, n=10)
        reasons = ", ".join(f"{k} {v}" for k, v in r.reasons.most_common())
        lines.append(
            f"{r.label:<24}{100 * (r.gpu_hit_tokens + r.cpu_hit_tokens) / r.input_tokens:>7.1f}"
            f"{100 * r.gpu_hit_tokens / r.input_tokens:>7.1f}{100 * r.cpu_hit_tokens / r.input_tokens:>7.1f}"
            f"{_max_over_mean([w.requests for w in r.workers]):>14.2f}"
            f"{_max_over_mean([w.prefill_tokens_done for w in r.workers]):>18.2f}"
            f"{statistics.median(r.ttft_s):>12.2f}{q[8]:>12.2f}{r.wall_s:>7.1f}  {reasons}")
    return "\n".join(lines)


def ideal_cached_tokens(trace: list[TraceRequest]) -> int:
    """Prompt tokens an infinite cache shared by every worker would hit over ``trace``: per
    request, the longest run of its blocks from block 0 seen in any earlier request."""
    seen: set[int] = set()
    total = 0
    for r in trace:
        n = 0
        while n < len(r.keys) and r.keys[n] in seen:
            n += 1
        total += n * TRACE_BLOCK_TOKENS
        seen.update(r.keys)
    return total


def collect_figures(results: list[Result], trace: list[TraceRequest], args: argparse.Namespace) -> dict:
    """The figures dict of the run (see the module docstring): tables, the bench-style report
    (TTFT in ms), and the charts ``--plot`` draws."""
    fig = new_figures("bench_routing_quality", args)
    input_total = sum(r.input_tokens for r in trace)
    for r in results:
        q = statistics.quantiles(r.ttft_s, n=10)
        add_table(fig, "policies", [{
            "policy": r.label, "requests": len(r.ttft_s), "input_tokens": r.input_tokens,
            "hit_rate": (r.gpu_hit_tokens + r.cpu_hit_tokens) / r.input_tokens,
            "gpu_hit_rate": r.gpu_hit_tokens / r.input_tokens, "cpu_hit_rate": r.cpu_hit_tokens / r.input_tokens,
            "requests_max_over_mean": _max_over_mean([w.requests for w in r.workers]),
            "prefill_max_over_mean": _max_over_mean([w.prefill_tokens_done for w in r.workers]),
            "ttft_p50_ms": 1000 * statistics.median(r.ttft_s), "ttft_p90_ms": 1000 * q[8],
            "sim_s": r.wall_s, "reasons": dict(r.reasons.most_common())}])
        add_table(fig, "per_worker", [{"policy": r.label, "worker": w.worker_id, "requests": w.requests,
                                       "prefill_tokens": w.prefill_tokens_done} for w in r.workers])
    fig["report"] = {
        "workload": {"name": f"trace {args.trace.name}", "requests": len(trace),
                     "mean_prompt_tokens": input_total / len(trace) if trace else 0.0,
                     "ideal_hit_rate": ideal_cached_tokens(trace) / input_total if input_total else 0.0},
        "arrivals": f"trace timestamps / {args.time_scale:g}; TTFT modelled",
        "targets": [{
            "name": r.label,
            "per_worker": {w.worker_id: {"requests": w.requests, "prefill_tokens": w.prefill_tokens_done}
                           for w in r.workers},
            "records": [{"index": i, "start_s": t.arrival_s, "prompt_tokens": t.input_tokens,
                         "cached_tokens": c, "ttft_ms": 1000 * ttft, "worker": w, "error": None}
                        for i, (t, c, ttft, w) in enumerate(zip(trace, r.cached_tokens, r.ttft_s, r.worker_ids))],
        } for r in results]}
    add_chart(fig, "bench_report", ".")
    add_chart(fig, "bars", "hit_rate.png", table="policies", group_by="policy",
              values=["hit_rate", "gpu_hit_rate", "cpu_hit_rate"], ylabel="share of prompt tokens",
              title=f"prefix-hit rate per policy, {len(trace)} requests, {args.workers} workers")
    add_chart(fig, "bars", "load_imbalance.png", table="policies", group_by="policy",
              values=["requests_max_over_mean", "prefill_max_over_mean"], ylabel="max / mean over workers",
              title="load imbalance per policy (1.0 = even)")
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=default_trace(),
                   help="Mooncake JSONL trace (default: the repo's kvbench/data/mooncake_conversation_1000.jsonl, "
                        "else ../shared/traces/mooncake_conversation_trace.jsonl from the repo root)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--gpu-blocks", type=int, default=1000, help="per-worker GPU cache, 512-token blocks")
    p.add_argument("--cpu-blocks", type=int, default=0, help="per-worker CPU tier, 512-token blocks")
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests (0: all)")
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival-rate multiplier")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0)
    p.add_argument("--decode-ms-per-token", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-config", type=json.loads, default={},
                   help='extra kv_aware settings as JSON, e.g. \'{"load_weight": 0.5}\'')
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; 0 on success, 2 (with a message on stderr) when the trace is missing."""
    args = parse_args(argv)
    if not args.trace.is_file():
        print(f"bench_routing_quality: error: trace {args.trace} not found (pass --trace PATH to a "
              f"Mooncake conversation_trace.jsonl, e.g. {SHIPPED_TRACE.relative_to(REPO)} or "
              f"../shared/traces/mooncake_conversation_trace.jsonl from the repo root)", file=sys.stderr)
        return 2
    trace = load_trace(args.trace, args.limit or None, args.time_scale)
    kv = {"name": "kv_aware", **args.kv_config}
    variants = [
        ("kv_aware", kv),
        ("kv_aware no guard", {**kv, "overload_guard": {"enabled": False}}),
        ("kv_aware load_weight .5", {**kv, "load_weight": 0.5}),
        ("kv_aware no load", {**kv, "load_weight": 0.0, "overload_guard": {"enabled": False}}),
        ("round_robin", {"name": "round_robin"}),
        ("least_load", {"name": "least_load"}),
        ("session", {"name": "session"}),
    ]
    print(f"{len(trace)} requests, {args.workers} workers x {args.gpu_blocks} GPU + {args.cpu_blocks} "
          f"CPU blocks of {TRACE_BLOCK_TOKENS} tokens, time scale {args.time_scale}, prefill "
          f"{args.prefill_tokens_per_s:g} tok/s, decode {args.decode_ms_per_token:g} ms/token")
    results = [simulate(label, make_policy(cfg), trace, args) for label, cfg in variants]
    print(report(results))
    if args.json or args.plot:
        emit(collect_figures(results, trace, args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
