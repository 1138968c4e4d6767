"""Where a kvroute gateway's TTFT went, request by request (pure; no I/O).

A client's TTFT through a kvroute gateway is four parts in a row, each read from the gateway's
decision log (:mod:`router.route.decision_log`) except the last:

- ``gateway``: arrival to the send upstream, less the time queued (``gateway_ms``: parse,
  admission, tokenize, lookup, choose, and any wait for the gateway's CPU);
- ``queue``: time in the dispatch queue waiting for a worker (``queue_wait_ms``);
- ``worker``: the send to the worker's first byte (``upstream_ttft_ms``: the engine's queue and
  prefill);
- ``relay``: the rest of the client's TTFT (the relay back, the client's own reading, and a
  first event that carries no text yet).

:func:`ttft_split` pairs the bench client's records with the log by workload index (the
``x-request-id`` the client sends, ``bench-<index>-<random>``) and gives each part's p50, p90 and
mean in ms over the requests with all four known.
"""
from __future__ import annotations

from typing import Any

from kvbench.client import REQUEST_ID_PREFIX
from kvbench.stats import percentile

PARTS = ("gateway", "queue", "worker", "relay")


def _index_of(request_id: str) -> int | None:
    if not request_id.startswith(REQUEST_ID_PREFIX):
        return None
    head = request_id[len(REQUEST_ID_PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def ttft_split(records: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``{"requests": n, "gateway": {"p50", "p90", "mean"}, "queue": ..., "worker": ...,
    "relay": ...}`` in ms, over the ``n`` requests of one run found in both ``records`` (the
    client's, :meth:`kvbench.client.RequestRecord.to_json`) and ``decisions`` (``GET
    /admin/decisions`` entries) with a client TTFT, a ``gateway_ms`` and an ``upstream_ttft_ms``.
    ``relay`` may come out slightly negative (the two clocks are read at different moments).
    None when no request pairs up (a gateway too old to log ``gateway_ms``, say)."""
    ttft_by_index = {r["index"]: r["ttft_ms"] for r in records if r.get("ttft_ms") is not None}
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    for d in decisions:
        index = _index_of(str(d.get("request_id", "")))
        ttft = ttft_by_index.get(index) if index is not None else None
        gateway, worker = d.get("gateway_ms"), d.get("upstream_ttft_ms")
        if ttft is None or gateway is None or worker is None:
            continue
        queue = d.get("queue_wait_ms") or 0.0
        for name, value in zip(PARTS, (gateway, queue, worker, ttft - gateway - queue - worker)):
            parts[name].append(value)
    n = len(parts["gateway"])
    if not n:
        return None
    out: dict[str, Any] = {"requests": n}
    for name, values in parts.items():
        out[name] = {"p50": round(percentile(values, 50), 1), "p90": round(percentile(values, 90), 1),
                     "mean": round(sum(values) / n, 1)}
    return out


def describe(split: dict[str, Any]) -> str:
    """One line for a report's note: each part's mean and p90, e.g. ``TTFT split, mean/p90 ms:
    gateway 3/5, queue 40/130, worker 133/259, relay 9/20``."""
    return "TTFT split, mean/p90 ms: " + ", ".join(
        f"{p} {split[p]['mean']:.0f}/{split[p]['p90']:.0f}" for p in PARTS)


__all__ = ["PARTS", "describe", "ttft_split"]
