"""kv_aware against round_robin on two real vLLM workers (CPU build) with the generated "small"
model, printed side by side in one run.

    .venv/bin/python benchmarks/bench_e2e_vllm.py [--vllm-python PY] [--conversations 16]
        [--turns 6] [--system-prompts 4] [--system-tokens 800] [--concurrency 4]
        [--blocks 512] [--pressure-blocks 160] [--skip-pressure] [--json FILE] [--plot DIR]

Workload: multi-turn chat. ``--conversations`` conversations of ``--turns`` turns; conversation i
uses system prompt i mod ``--system-prompts`` (each about ``--system-tokens`` tokens), then user
turns of ~60 tokens and fixed assistant replies of ~40 tokens (so every policy gets identical
bodies). Turns go round by round (turn t of every conversation, in a shuffled order, before turn
t+1), ``--concurrency`` requests in flight, streaming with ``max_tokens`` 16 (``ignore_eos``), so
every conversation stays live for the whole run.

Two clusters are started one after the other with ``kvroute up --engine vllm`` (gateway with its
embedded index): one with ``--blocks`` KV blocks per worker (the workload fits), one with
``--pressure-blocks`` (the live conversations need more blocks than both workers hold: vLLM
evicts, and a router that does not learn evictions mispredicts). On each, both policies run on
the same requests, each after ``/reset_prefix_cache`` on both workers.

Figures per run: TTFT p50/p95 (client side, first streamed chunk), wall time, cluster prefix-hit
rate from vLLM's own counters (``vllm:prefix_cache_hits_total / queries_total``) and from the
responses' ``cached_tokens``, the ideal rate for these requests (infinite cache, perfect
stickiness, from the token ids), and the gateway's prediction accuracy (its
``kvroute_predicted_cached_tokens`` against vLLM's reported ``cached_tokens``: totals and mean
absolute error per request).

Measured on the 2-core AVX2 development machine (shared with other jobs, so TTFT is noisy; small
model in float32, 2k-token prefill 0.9-1.7 s; defaults; two runs agreed within a few percent on
hit rates):

    roomy (512 blocks/worker)     kv_aware  round_robin     KV pressure (160)   kv_aware  round_robin
    prefix-hit rate (vLLM)        0.836     0.766                               0.697     0.558
    TTFT p50 / p95 ms             361/1296  318/793                             379/1178  395/1192
    predicted / reported cached   96480/96480  -                                85088/79040  -
    ideal (infinite cache)        0.859                                         0.859

kv_aware keeps its hit-rate lead under pressure (its index follows vLLM's BlockRemoved events);
its predictions are exact when nothing is evicted and ~8 % high under pressure (66 tokens/request
mean error: blocks evicted between routing and prefill by the 4 requests in flight). Its TTFT tail
is worse than round robin's when the cache is roomy: requests sharing a system prompt gather on the
worker that holds it, while round robin spreads the load evenly and still hits the shared prompts.

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``runs`` (per scenario and
policy: ``ttft_p50_ms``, ``ttft_p95_ms``, ``wall_s``, ``hit_rate_vllm_metrics``, ``hit_rate_usage``,
``ideal_hit_rate``, ``predicted_cached_tokens``, ``reported_cached_tokens``,
``prediction_mae_tokens``, ``requests_w0``/``requests_w1``), table ``workload`` and ``report``, a
``kvroute bench``-style report with one target per scenario and policy and a record per request
(send time, TTFT, prompt and cached tokens, worker). ``--plot DIR`` draws ``ttft_cdf.png``,
``hit_rate_over_time.png`` and ``worker_load.png`` (:mod:`kvbench.plots`), and
``hit_rate.png``, ``ttft.png`` and ``prediction.png`` (bars per scenario and policy).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import OpenAI

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402
from kvbench.workers import metric_samples, reset_prefix_cache  # noqa: E402

from kvcore.tokenization import PromptTokenizer  # noqa: E402
from kvroute.up import free_ports  # noqa: E402

MODEL = "small"
BLOCK_SIZE = 32
MAX_TOKENS = 16
ADMIN_TOKEN = "bench-admin-token"
_WORDS = ("cache block token prefix route worker server request model prompt weather city search "
          "answer question data file order price customer account policy latency memory the of and "
          "to in is for with on as by at from").split()


def text_of_tokens(tok: PromptTokenizer, n_tokens: int, seed: int) -> str:
    """Words (deterministic for ``seed``) until the text is at least ``n_tokens`` tokens long."""
    rnd = random.Random(seed)
    words: list[str] = []
    while len(tok.encode_text(" ".join(words), False)) < n_tokens:
        words += [rnd.choice(_WORDS) for _ in range(16)]
    return " ".join(words)


def make_conversations(tok: PromptTokenizer, args: argparse.Namespace) -> list[list[dict]]:
    """Per conversation, the chat body of each turn."""
    systems = [f"System prompt {s}. " + text_of_tokens(tok, args.system_tokens, 10 + s)
               for s in range(args.system_prompts)]
    out = []
    for c in range(args.conversations):
        messages = [{"role": "system", "content": systems[c % args.system_prompts]}]
        turns = []
        for t in range(args.turns):
            messages.append({"role": "user", "content": f"[{c}.{t}] " + text_of_tokens(tok, 60, 1000 * c + t)})
            turns.append([dict(m) for m in messages])
            messages.append({"role": "assistant", "content": text_of_tokens(tok, 40, 5000 + 1000 * c + t)})
        out.append(turns)
    return out


def ideal_cached(ids: list[list[int]]) -> int:
    """Tokens an infinite, perfectly shared cache would hit over requests sent in this order."""
    total = 0
    seen: list[list[int]] = []
    for p in ids:
        best = 0
        for q in seen:
            n = min(len(p), len(q))
            lcp = next((i for i in range(n) if p[i] != q[i]), n)
            best = max(best, lcp)
        total += min(best // BLOCK_SIZE, (len(p) - 1) // BLOCK_SIZE) * BLOCK_SIZE
        seen.append(p)
    return total


@dataclass
class Cluster:
    proc: subprocess.Popen
    base: str
    workers: dict[str, str] = field(default_factory=dict)  # id -> url

    def admin(self, method: str, path: str, json=None) -> httpx.Response:
        return httpx.request(method, self.base + path, json=json, timeout=60,
                             headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})


def start_cluster(args: argparse.Namespace, model_dir: Path, blocks: int, log_dir: Path) -> Cluster:
    """``kvroute up --engine vllm`` with ``blocks`` KV blocks per worker; waits for its ready line."""
    port = free_ports(1)[0]
    log = open(log_dir / f"up-{blocks}.log", "w")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN}
    vllm_args = f"--dtype {args.dtype} --max-num-seqs 8" + ("" if args.compile else " --enforce-eager")
    proc = subprocess.Popen(
        ["timeout", "-s", "INT", "-k", "30", str(args.deadline_s), sys.executable, "-m", "kvroute", "up",
         "--engine", "vllm", "--vllm-python", args.vllm_python, "--workers", "2", "--model", str(model_dir),
         "--served-model-name", MODEL, "--port", str(port), "--block-size", str(BLOCK_SIZE),
         "--num-gpu-blocks-override", str(blocks), "--max-model-len", "2048", "--vllm-args", vllm_args,
         "--log-dir", str(log_dir / f"up-{blocks}")],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 900:
        m = re.search(r"gateway ready: (http://\S+)/v1", (log_dir / f"up-{blocks}.log").read_text())
        if m:
            c = Cluster(proc, m.group(1))
            c.workers = {w["id"]: w["url"] for w in c.admin("GET", "/admin/workers").json()["workers"]}
            print(f"  cluster with {blocks} blocks/worker ready in {time.monotonic() - t0:.0f}s", flush=True)
            return c
        if proc.poll() is not None:
            raise RuntimeError(f"kvroute up exited {proc.returncode}; see {log_dir}")
        time.sleep(1)
    proc.terminate()
    raise TimeoutError(f"kvroute up not ready after 900s; see {log_dir}")


def stop_cluster(c: Cluster) -> None:
    os.killpg(c.proc.pid, 2)  # SIGINT: `kvroute up` stops every process it started
    try:
        c.proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(c.proc.pid, 9)


def prefill_ms(url: str, n_tokens: int = 2048 - 8) -> float:
    """Time of one uncached ``n_tokens``-token prefill (``max_tokens`` 1) sent straight to a worker."""
    rnd = random.Random(n_tokens)
    ids = [6 + rnd.randrange(2000) for _ in range(n_tokens)]
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=600)
    r.raise_for_status()
    return 1000 * (time.perf_counter() - t0)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_policy(c: Cluster, policy: str, conversations: list[list[list[dict]]], concurrency: int) -> dict:
    """Every turn, round by round, through the gateway under ``policy``; returns the figures."""
    r = c.admin("PUT", "/admin/policy", {"name": policy})
    r.raise_for_status()
    for url in c.workers.values():
        reset_prefix_cache(url, MODEL)
    time.sleep(6.0)  # the clears reach the index; speculative entries (5 s TTL) of a last run expire
    vllm_before = {w: metric_samples(u) for w, u in c.workers.items()}
    gw_before = metric_samples(c.base)
    cli = OpenAI(base_url=c.base + "/v1", api_key="x", max_retries=0, timeout=600)
    lock = threading.Lock()
    ttft: list[float] = []
    cached = prompt = 0
    per_worker: dict[str, int] = {}
    records: list[dict] = []  # per request, for the figures: send time, TTFT, tokens, worker

    def one(messages: list[dict]) -> None:
        nonlocal cached, prompt
        t0 = time.perf_counter()
        first = None
        usage = None
        with cli.chat.completions.with_streaming_response.create(
                model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) as resp:
            worker = resp.headers["x-kvroute-worker"]
            for chunk in resp.parse():
                if first is None and chunk.choices:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    usage = chunk.usage
        with lock:
            ttft.append(first if first is not None else time.perf_counter() - t0)
            prompt += usage.prompt_tokens
            cached += (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
            per_worker[worker] = per_worker.get(worker, 0) + 1
            details = usage.prompt_tokens_details
            records.append({"index": len(records), "start_s": t0 - t_start, "ttft_ms": 1000 * ttft[-1],
                            "prompt_tokens": usage.prompt_tokens, "worker": worker, "error": None,
                            "cached_tokens": (details.cached_tokens or 0) if details else 0})

    t_start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for t in range(len(conversations[0])):
            order = list(range(len(conversations)))
            random.Random(t).shuffle(order)
            list(pool.map(one, [conversations[i][t] for i in order]))
    wall = time.perf_counter() - t_start

    time.sleep(1.0)
    hits = queries = 0.0
    for w, u in c.workers.items():
        after = metric_samples(u)
        hits += after["vllm:prefix_cache_hits_total"] - vllm_before[w]["vllm:prefix_cache_hits_total"]
        queries += after["vllm:prefix_cache_queries_total"] - vllm_before[w]["vllm:prefix_cache_queries_total"]
    gw = metric_samples(c.base)

    def delta(name: str) -> float:
        return gw.get(name, 0.0) - gw_before.get(name, 0.0)

    n_pred = delta("kvroute_predicted_cached_tokens_count")  # 0 for a policy without the index
    return {"ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p95_ms": 1000 * _pct(ttft, 0.95),
            "wall_s": wall, "hit_vllm_metrics": hits / queries if queries else 0.0,
            "hit_usage": cached / prompt if prompt else 0.0, "prompt_tokens": prompt,
            "cached_tokens": cached, "predicted_tokens": delta("kvroute_predicted_cached_tokens_sum"),
            "reported_tokens": delta("kvroute_actual_cached_tokens_sum"),
            "mae_tokens": delta("kvroute_cached_tokens_error_tokens_sum") / n_pred if n_pred else float("nan"),
            "n_predictions": n_pred, "split": per_worker, "records": records}


def print_table(title: str, results: dict[str, dict], ideal: float) -> None:
    print(f"\n== {title} (ideal prefix-hit rate {ideal:.3f}: infinite cache, perfect stickiness)")
    names = list(results)
    rows = [("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p95 ms", "ttft_p95_ms", "{:.0f}"),
            ("wall s", "wall_s", "{:.1f}"), ("prefix-hit rate (vLLM metrics)", "hit_vllm_metrics", "{:.3f}"),
            ("prefix-hit rate (usage cached_tokens)", "hit_usage", "{:.3f}"),
            ("predicted cached tokens", "predicted_tokens", "{:.0f}"),
            ("reported cached tokens", "reported_tokens", "{:.0f}"),
            ("prediction MAE tokens/request", "mae_tokens", "{:.1f}"), ("requests per worker", "split", "{}")]
    for r in results.values():
        r["split"] = "/".join(str(r["split"].get(w, 0)) for w in ("w0", "w1"))
    print(f"{'':40s}" + "".join(f"{n:>18s}" for n in names))
    for label, key, fmt in rows:
        cells = []
        for n in names:
            no_prediction = key in ("predicted_tokens", "reported_tokens", "mae_tokens") and not results[n]["n_predictions"]
            cells.append("-" if no_prediction else fmt.format(results[n][key]))
        print(f"{label:40s}" + "".join(f"{c:>18s}" for c in cells))


def figure_rows(title: str, blocks: int, results: dict[str, dict], ideal: float) -> list[dict]:
    """The rows of :func:`print_table` for the figures (before it turns ``split`` into text)."""
    rows = []
    for policy, r in results.items():
        pred = bool(r["n_predictions"])
        rows.append({"scenario": title.split(":")[0], "blocks_per_worker": blocks, "policy": policy,
                     "requests": len(r["records"]), "ttft_p50_ms": r["ttft_p50_ms"], "ttft_p95_ms": r["ttft_p95_ms"],
                     "wall_s": r["wall_s"], "hit_rate_vllm_metrics": r["hit_vllm_metrics"],
                     "hit_rate_usage": r["hit_usage"], "ideal_hit_rate": ideal, "prompt_tokens": r["prompt_tokens"],
                     "cached_tokens": r["cached_tokens"],
                     "predicted_cached_tokens": r["predicted_tokens"] if pred else None,
                     "reported_cached_tokens": r["reported_tokens"] if pred else None,
                     "prediction_mae_tokens": r["mae_tokens"] if pred else None,
                     **{f"requests_{w}": r["split"].get(w, 0) for w in ("w0", "w1")}})
    return rows


def report_target(name: str, r: dict) -> dict:
    """A ``kvroute bench``-style target (records, per-worker requests and prefill tokens) of one
    policy's run, for :func:`kvbench.plots.write_plots`."""
    per_worker: dict[str, dict[str, int]] = {}
    for rec in r["records"]:
        w = per_worker.setdefault(rec["worker"], {"requests": 0, "prefill_tokens": 0, "cached_tokens": 0})
        w["requests"] += 1
        w["prefill_tokens"] += rec["prompt_tokens"] - rec["cached_tokens"]
        w["cached_tokens"] += rec["cached_tokens"]
    return {"name": name, "requests": len(r["records"]), "hit_rate": r["hit_usage"], "per_worker": per_worker,
            "records": r["records"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("KVR_VLLM_PYTHON", ""))
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=800)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=512, help="KV blocks per worker, roomy run")
    ap.add_argument("--pressure-blocks", type=int, default=160, help="KV blocks per worker, pressure run")
    ap.add_argument("--skip-pressure", action="store_true")
    ap.add_argument("--skip-roomy", action="store_true")
    ap.add_argument("--dtype", default="float32", help="vLLM --dtype (float32: this CPU has no bf16 instructions)")
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile (slower start)")
    ap.add_argument("--deadline-s", type=int, default=1800, help="hard limit per cluster")
    add_output_args(ap)
    args = ap.parse_args()
    fig = new_figures("bench_e2e_vllm", args)
    if not args.vllm_python:
        ap.error("--vllm-python (or KVR_VLLM_PYTHON) must name an interpreter with vLLM")

    model_dir = ensure_model("small", args.vllm_python)
    tok = PromptTokenizer(model_dir)
    conversations = make_conversations(tok, args)
    order_ids = []
    for t in range(args.turns):
        order = list(range(args.conversations))
        random.Random(t).shuffle(order)
        order_ids += [tok.encode_chat({"messages": conversations[i][t]}) for i in order]
    prompt_total = sum(len(p) for p in order_ids)
    ideal = ideal_cached(order_ids) / prompt_total
    live_blocks = len({tuple(p[:k * BLOCK_SIZE]) for p in order_ids[-args.conversations:]
                       for k in range(1, len(p) // BLOCK_SIZE + 1)})
    print(f"workload: {args.conversations} conversations x {args.turns} turns, {args.system_prompts} system prompts "
          f"of ~{args.system_tokens} tokens, {len(order_ids)} requests, {prompt_total} prompt tokens; "
          f"final prompts need {live_blocks} distinct KV blocks; model {model_dir}")
    add_table(fig, "workload", [{"conversations": args.conversations, "turns": args.turns, "requests": len(order_ids),
                                 "prompt_tokens": prompt_total, "live_blocks": live_blocks, "ideal_hit_rate": ideal}])
    fig["report"] = {"workload": {"name": f"multiturn chat ({args.conversations} x {args.turns})",
                                  "requests": len(order_ids), "mean_prompt_tokens": prompt_total / len(order_ids),
                                  "ideal_hit_rate": ideal},
                     "arrivals": f"closed loop, concurrency {args.concurrency}, round by round", "targets": []}

    log_dir = Path(tempfile.mkdtemp(prefix="bench-e2e-vllm-"))
    scenarios = []
    if not args.skip_roomy:
        scenarios.append((f"roomy: {args.blocks} blocks/worker", args.blocks))
    if not args.skip_pressure:
        scenarios.append((f"KV pressure: {args.pressure_blocks} blocks/worker "
                          f"({2 * args.pressure_blocks} in the cluster < {live_blocks} live)", args.pressure_blocks))
    for title, blocks in scenarios:
        c = start_cluster(args, model_dir, blocks, log_dir)
        try:
            if blocks == scenarios[0][1]:
                print(f"  2k-token prefill on one worker: {prefill_ms(next(iter(c.workers.values()))):.0f} ms "
                      f"(uncached, one core)", flush=True)
            results = {p: run_policy(c, p, conversations, args.concurrency) for p in ("kv_aware", "round_robin")}
        finally:
            stop_cluster(c)
        add_table(fig, "runs", figure_rows(title, blocks, results, ideal))
        fig["report"]["targets"] += [report_target(f"{p}, {blocks} blocks", r) for p, r in results.items()]
        print_table(title, results, ideal)
    print(f"\nlogs: {log_dir}")
    add_chart(fig, "bench_report", ".")
    add_chart(fig, "bars", "hit_rate.png", table="runs", group_by="scenario", series_by="policy",
              values=["hit_rate_vllm_metrics", "hit_rate_usage"], ylabel="share of prompt tokens",
              title=f"prefix-hit rate per scenario and policy (ideal {ideal:.3f})")
    add_chart(fig, "bars", "ttft.png", table="runs", group_by="scenario", series_by="policy",
              values=["ttft_p50_ms", "ttft_p95_ms"], ylabel="ms", title="TTFT per scenario and policy (client side)")
    add_chart(fig, "bars", "prediction.png", table="runs", group_by=["scenario", "policy"],
              values=["predicted_cached_tokens", "reported_cached_tokens"], ylabel="tokens",
              title="the gateway's predicted cached tokens vs vLLM's reported ones")
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
