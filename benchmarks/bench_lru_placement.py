"""How far placement alone can take the hit rate and the median request on the multi-turn
KV-pressure workload, against workers that evict like vLLM (least recently used, a request's
tail first): :mod:`lab.lru_replay`, printed side by side.

    .venv/bin/python benchmarks/bench_lru_placement.py --tokenizer MODEL_DIR [--workers 2]
        [--blocks-per-worker 200] [--block-size 32] [--conversations 16] [--turns 4]
        [--system-tokens 740] [--user-tokens 60] [--reply-tokens 40] [--tries 400] [--seed 0]

The workload is ``kvroute bench``'s ``multiturn`` (the same prompts, token for token, and the
same send order: turn t of every conversation before turn t+1). Rows:

- ``round robin``: request i to worker i mod N;
- ``longest prefix``: to the worker holding the longest cached prefix, else round robin (what an
  exact KV-aware router does with no load to weigh);
- ``best static``: the best of ``--tries`` random assignments of whole conversations to
  workers (every split of counts tried), by hit rate;
- ``ideal`` / ``Belady``: no eviction at all, and one cache of all the workers' blocks run with
  Belady's rule (:mod:`kvbench.capacity`), the bounds no placement can pass.

``median uncached`` is the median request's tokens to prefill: if it stays near round robin's
for every placement, so does any router's TTFT median on that workload (prefill time grows with
those tokens), whatever it knows about the caches.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbench import synthetic  # noqa: E402
from kvbench.capacity import capacity_hit_rate  # noqa: E402
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402
from lab.lru_replay import best_static_placement, longest_prefix_replay, replay  # noqa: E402
from kvbench.words import OneTokenWords  # noqa: E402
from router.route.prompt_blocks import PromptTokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="model folder whose tokenizer makes the prompts")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--blocks-per-worker", type=int, default=200)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=740)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--reply-tokens", type=int, default=40)
    p.add_argument("--output-tokens", type=int, default=16, help="tokens generated per request (the rig's 16)")
    p.add_argument("--tries", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p)
    args = p.parse_args(argv)
    if min(args.workers, args.blocks_per_worker, args.block_size) < 1 or min(args.tries, args.output_tokens) < 0:
        p.error("--workers, --blocks-per-worker and --block-size must be >= 1, --tries and --output-tokens >= 0")
    words = OneTokenWords(PromptTokenizer(args.tokenizer))
    workload = synthetic.multiturn(words, args.block_size, args.conversations, args.turns, args.conversations,
                                   args.system_tokens, args.user_tokens, args.reply_tokens, max(1, args.output_tokens), args.seed)
    prompts = [list(r.prompt_token_ids) for r in workload.requests]
    groups = [r.group for r in workload.requests]
    bs, cap, n = args.block_size, args.blocks_per_worker, args.workers
    total = sum(len(ids) for ids in prompts)
    out = args.output_tokens
    rows = [("round robin", replay(prompts, bs, cap, [i % n for i in range(len(prompts))], out)),
            ("longest prefix", longest_prefix_replay(prompts, bs, cap, n, out))]
    best, assignment = best_static_placement(prompts, groups, bs, cap, n, args.tries, args.seed, out)
    split = [sum(1 for w in assignment.values() if w == k) for k in range(n)]
    rows.append((f"best static {'/'.join(map(str, split))}", best))
    base = rows[0][1].median_uncached_tokens
    print(f"{len(prompts)} requests, {n} workers x {cap} blocks of {bs} tokens; {total} prompt tokens")
    print(f"{'placement':22s} {'hit rate':>8s} {'median uncached':>15s} {'of round robin':>14s}")
    for name, r in rows:
        ratio = r.median_uncached_tokens / base if base else 0.0
        print(f"{name:22s} {r.hit_rate:8.3f} {r.median_uncached_tokens:15.0f} {ratio:14.2f}")
    ideal, belady = workload.ideal_hit_rate(), capacity_hit_rate(prompts, bs, cap * n)
    print(f"{'ideal (no eviction)':22s} {ideal:8.3f}")
    print(f"{'Belady, all blocks':22s} {belady:8.3f}")
    figures = new_figures("bench_lru_placement", args, argv)
    add_table(figures, "placements", [
        {"placement": name, "hit_rate": round(r.hit_rate, 4), "median_uncached_tokens": r.median_uncached_tokens,
         "median_uncached_of_round_robin": round(r.median_uncached_tokens / base, 4) if base else None}
        for name, r in rows])
    add_table(figures, "bounds", [{"bound": "ideal", "hit_rate": round(ideal, 4)},
                                  {"bound": "belady", "hit_rate": round(belady, 4)}])
    add_chart(figures, "bars", "lru_placement.png", table="placements", group_by="placement", values=["hit_rate"],
              title="hit rate by placement, LRU workers", ylabel="prefix hit rate")
    emit(figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
