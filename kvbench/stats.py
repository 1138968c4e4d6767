"""Figures of one target's run, computed from its request records (pure; no I/O).

- TTFT p50/p90/p99 and mean, ITL p50/p99 (over every gap of every request), end-to-end p50/p99;
  percentiles interpolate linearly between order statistics (NumPy's default method);
- throughput: output tokens / s and requests / s over the run's wall time;
- goodput: the share of all requests (errors count as failed) with TTFT at most the target;
- hit rate: cached prompt tokens / prompt tokens over successful requests, and its ratio to the
  workload's ideal (an infinite cache shared by every worker, :mod:`kvbench.workload`);
- per worker (from the ``x-kvroute-worker`` header, or from the workers' own counters when the
  router does not say): requests and prefill tokens (prompt tokens not served from cache), and
  max/mean of each over the workers (1.0 is a perfect spread).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

from kvbench.client import RequestRecord


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _max_over_mean(values: list[float]) -> float | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    return max(values) / mean if mean else None


def per_worker_from_records(records: list[RequestRecord]) -> dict[str, dict[str, int]]:
    """``{worker: {"requests", "prefill_tokens", "cached_tokens"}}`` from the worker header of
    successful records; empty when no record names a worker."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        if not r.ok or r.worker is None:
            continue
        w = out.setdefault(r.worker, {"requests": 0, "prefill_tokens": 0, "cached_tokens": 0})
        w["requests"] += 1
        w["prefill_tokens"] += r.prompt_tokens - r.cached_tokens
        w["cached_tokens"] += r.cached_tokens
    return out


def summarize(name: str, records: list[RequestRecord], duration_s: float, ideal_cached_tokens: list[int],
              ttft_target_ms: float, per_worker: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The target's entry of the JSON report (DESIGN.md ``bench run``), records included.

    ``ideal_cached_tokens``: per request (by ``index``), what an infinite shared cache would hit;
    ``hit_rate_of_ideal`` compares the hit rate with the ideal over the same (successful) requests.
    ``per_worker``: counters read from the workers (other routers); when None they come from the
    records' worker header. Durations in ms, rates per second."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    itl = [x for r in ok for x in r.itl_ms]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    # None when no answer reported cached tokens (vLLM without --enable-prompt-tokens-details)
    hit = cached / prompt if prompt and any(r.cached_reported for r in ok) else None
    ideal = sum(ideal_cached_tokens[r.index] for r in ok) / prompt if prompt else 0.0
    workers = per_worker if per_worker is not None else per_worker_from_records(records)
    good = sum(1 for r in ok if r.ttft_ms is not None and r.ttft_ms <= ttft_target_ms)
    n = len(records)
    return {
        "name": name,
        "requests": n,
        "errors": n - len(ok),
        "duration_s": duration_s,
        "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99),
                    "mean": sum(ttft) / len(ttft) if ttft else None},
        "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        "e2e_ms": {"p50": percentile(e2e, 50), "p99": percentile(e2e, 99)},
        "throughput_tokens_per_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "goodput": good / n if n else 0.0,
        "ttft_target_ms": ttft_target_ms,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": hit,
        "ideal_hit_rate": ideal,
        "hit_rate_of_ideal": hit / ideal if ideal and hit is not None else None,
        "per_worker": workers,
        "requests_max_over_mean": _max_over_mean([w["requests"] for w in workers.values()]),
        "prefill_max_over_mean": _max_over_mean([w["prefill_tokens"] for w in workers.values()]),
        "error_sample": _error_sample(records),
        "records": [r.to_json() for r in records],
    }


def _error_sample(records: list[RequestRecord]) -> str | None:
    """The most frequent error with its count (``"24 x HTTP 404: ..."``, 120 characters of it),
    None without errors: why a target failed, on the table."""
    counts = Counter(r.error[:120] for r in records if r.error is not None)
    if not counts:
        return None
    text, n = counts.most_common(1)[0]
    return f"{n} x {text}"


def _median_tree(values: list[Any]) -> Any:
    """Median of numbers; per key of dicts (recursively); the first value otherwise."""
    first = values[0]
    if isinstance(first, dict):
        keys = [k for k in first if all(isinstance(v, dict) and k in v for v in values)]
        return {k: _median_tree([v[k] for v in values]) for k in keys}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        nums = [v for v in values if isinstance(v, (int, float))]
        if len(nums) != len(values):
            return None
        mid = percentile(nums, 50)
        return int(mid) if all(isinstance(v, int) for v in nums) and mid == int(mid) else mid
    return first


def aggregate_repeats(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry for a target measured ``len(results)`` times (repeats of the same workload):
    every figure is the median over the repeats, ``requests`` and ``errors`` the totals, ``runs`` the count,
    ``repeats`` each run's figures (records left out) and ``records`` every run's records, each
    with its ``repeat`` number (0-based); a ``note`` (text) is the first run's, prefixed
    ``run 1 of N:``. A single result is returned with ``runs`` 1."""
    if len(results) == 1:
        return {**results[0], "runs": 1}
    figures = [{k: v for k, v in r.items() if k != "records"} for r in results]
    out = _median_tree(figures)
    out["requests"] = sum(r["requests"] for r in results)  # both totals over the runs
    out["errors"] = sum(r["errors"] for r in results)
    out["runs"] = len(results)
    if out.get("note"):  # notes are text: the first run's, said so
        out["note"] = f"run 1 of {len(results)}: {out['note']}"
    out["repeats"] = figures
    out["records"] = [{**rec, "repeat": i} for i, r in enumerate(results) for rec in r["records"]]
    return out
