#!/usr/bin/env python3
"""What learning TTFTs costs a decision at N workers once every worker has learned its speed.

The ``ttft`` policy predicts each worker by its model's TTFT line times the worker's speed factor
(``router/estimates/prefill_rate.py``); every request's first byte adds a sample to the worker's
window and to the model's, and a factor is computed again whenever its worker's samples or the
model's published line change. This replays that in one process, on a warm registry where every
worker has a full window (a gateway that has run a while), with no I/O:

- ``--workers`` registrations (``router.workers.registry.WorkerRegistry``), each with a speed of
  its own (0.8-1.25x) and a full window of samples;
- per request: a worker drawn at random gets a sample (work 100-3,000 tokens, TTFT on the line
  times the worker's speed times 1 + |N(0, ``--noise``)|), observed by the worker's and the
  model's estimators as the gateway's feedback step does (``router/route/feedback.py``), then the
  next decision's inputs: every worker's ``prefill_speed`` (as ``Router._candidates`` asks), and
  the ``ttft`` policy choosing among the candidates;
- the same requests for the model's line as the gateway publishes it (the registry's own
  estimator, ``MODEL_LINE_TOLERANCE``) and with every refit published (tolerance 0), in rounds
  whose order alternates, with the gateway's garbage-collector settings (``gc.freeze()`` after
  start-up, young collections every ``GC_YOUNG_THRESHOLD`` allocations, ``router/edge/app.py``).

Prints per request: feedback, speed factors and choose (building the candidates as
``Router._candidates`` does, and the policy) in microseconds, and how many of the model's refits
were published. ``--json FILE``: table ``model_line``, one row per variant (medians over rounds).

    .venv/bin/python benchmarks/bench_model_line.py [--workers 1024] [--requests 400] [--rounds 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcore.index.base import NO_MATCH  # noqa: E402
from lab.figures import add_output_args, add_table, emit, new_figures  # noqa: E402
from router.config.schema import WorkerConfig  # noqa: E402
from router.edge.app import GC_YOUNG_THRESHOLD  # noqa: E402
from router.estimates.prefill_rate import MODEL_LINE_TOLERANCE, WINDOW, PrefillRateEstimator  # noqa: E402
from router.policies import Candidate, RouteRequest, make_policy  # noqa: E402
from router.workers.registry import WorkerRegistry  # noqa: E402

MODEL = "m"
OVERHEAD_MS, MS_PER_TOKEN = 20.0, 0.05


def build(workers: int, tolerance: float, noise: float, seed: int):
    """A registry of ``workers`` warm workers; the model's estimator is the registry's own, or
    replaced by one with ``tolerance`` when that differs."""
    rng = random.Random(seed)
    registry = WorkerRegistry()
    if registry.model_rate(MODEL).tolerance != tolerance:
        registry._model_rates[MODEL] = PrefillRateEstimator(tolerance=tolerance)
    speeds = {}
    for i in range(workers):
        reg = registry.add(WorkerConfig(id=f"w{i}", url=f"http://127.0.0.1:{10000 + i}", model=MODEL))
        speeds[reg.id] = rng.uniform(0.8, 1.25)
    regs = registry.all()
    for _ in range(WINDOW):
        for reg in regs:
            work, ttft_ms = sample(rng, speeds[reg.id], noise)
            reg.prefill_rate.observe(work, ttft_ms)
            registry.model_rate(MODEL).observe(work, ttft_ms)
    return registry, regs, speeds


def sample(rng: random.Random, speed: float, noise: float) -> tuple[float, float]:
    work = rng.uniform(100, 3000)
    return work, (OVERHEAD_MS + MS_PER_TOKEN * work) * speed * (1 + abs(rng.gauss(0, noise)))


def run(registry: WorkerRegistry, regs, speeds, requests: int, noise: float, seed: int) -> dict[str, float]:
    """``requests`` requests as the module docstring says; mean microseconds per step."""
    rng = random.Random(seed)
    policy = make_policy({"name": "ttft"})
    model = registry.model_rate(MODEL)
    for reg in regs:  # start from cached factors
        registry.prefill_speed(reg)
    feedback_s = factors_s = choose_s = 0.0
    published = refits = 0
    for _ in range(requests):
        reg = regs[rng.randrange(len(regs))]
        work, ttft_ms = sample(rng, speeds[reg.id], noise)
        line = model.learned
        t0 = time.perf_counter()
        reg.prefill_rate.observe(work, ttft_ms)
        model.observe(work, ttft_ms)
        t1 = time.perf_counter()
        refits += model._since_fit == 0  # the observation refitted the line
        model_line = model.learned
        speed = [registry.prefill_speed(r) for r in regs]
        t2 = time.perf_counter()
        cands = [Candidate(r.id, r.load(), NO_MATCH, r.prefill_rate.learned, r.evidence_credited,
                           r.evidence.credit_weight, model_prefill_rate=model_line, prefill_speed=s)
                 for r, s in zip(regs, speed)]
        policy.choose(RouteRequest(model=MODEL, prompt_tokens=2000, block_size=16), cands)
        t3 = time.perf_counter()
        feedback_s += t1 - t0
        factors_s += t2 - t1
        choose_s += t3 - t2
        published += model.learned is not line
    return {"feedback_us": feedback_s / requests * 1e6, "factors_us": factors_s / requests * 1e6,
            "choose_us": choose_s / requests * 1e6, "published": published, "refits": refits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=400, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per variant, alternating")
    ap.add_argument("--noise", type=float, default=0.2, help="TTFT noise: 1 + |N(0, noise)|")
    add_output_args(ap)
    args = ap.parse_args()
    variants = {f"dead band {MODEL_LINE_TOLERANCE:g}": MODEL_LINE_TOLERANCE, "every refit": 0.0}
    warm = {name: build(args.workers, tol, args.noise, seed=1) for name, tol in variants.items()}
    assert warm[f"dead band {MODEL_LINE_TOLERANCE:g}"][0].model_rate(MODEL).tolerance == MODEL_LINE_TOLERANCE
    gc.freeze()  # as the gateway does after start-up (router/edge/app.py)
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in (variants if r % 2 == 0 else reversed(list(variants))):
            rows[name].append(run(*warm[name], args.requests, args.noise, seed=100 + r))
    print(f"{args.workers} workers, {args.requests} requests x {args.rounds} rounds per variant, noise {args.noise}")
    print(f"{'model line':<16} {'feedback us':>12} {'speed factors us':>17} {'choose us':>10} {'published/refits':>17}")
    fig = new_figures("bench_model_line", args)
    for name, got in rows.items():
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        published, refits = sum(g["published"] for g in got), sum(g["refits"] for g in got)
        print(f"{name:<16} {med['feedback_us']:12.1f} {med['factors_us']:17.1f} {med['choose_us']:10.1f} "
              f"{published:>8}/{refits}")
        add_table(fig, "model_line", [{"model_line": name, "workers": args.workers, "feedback_us": med["feedback_us"],
                                        "speed_factors_us": med["factors_us"], "choose_us": med["choose_us"],
                                        "lines_published": published, "refits": refits}])
    emit(fig, args)


if __name__ == "__main__":
    main()
