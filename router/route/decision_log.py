"""The decision log: a bounded ring of the most recent routing decisions of real traffic, served
at ``GET /admin/decisions`` (DESIGN.md) and read by the dashboard and by ``kvroute bench rig``.

Each entry is the ``POST /admin/explain`` answer of the request's final plan (after the
dispatch queue: the plan actually sent) plus what only real traffic knows, filled in as the
request goes on::

    {"request_id", "time_unix_s", "model",               # at the decision
     "prompt_tokens", "blocks", "candidates", "chosen", "reason", "policy",
     "predicted_cached_tokens", "predicted_ttft_ms", "tokenization_fallback",  # explain's shape
     "queue_wait_ms",                                    # time in the dispatch queue (0 when off)
     "worker": id | null,                                # where it was sent (a retry may move it)
     "gateway_ms": ms | null,                            # arrival to that send, less queue_wait_ms:
                                                         # the gateway's own work (parse, admission,
                                                         # tokenize, lookup, choose) and CPU waits
     "upstream_ttft_ms": ms | null,                      # dispatch to the worker's first byte
     "actual_cached_tokens": n | null}                   # vLLM's usage.prompt_tokens_details
                                                         # (a several-prompt body: their sum)

A request of a model with P/D on carries ``pd`` (:meth:`router.route.pd.PDLegs.as_dict`: both legs'
candidates and costs, the outcome and its reason) and, when split, the prefill leg's
``pd.prefill_ms``, ``pd.prefill_outcome`` and ``pd.prefill_cached_tokens`` (:meth:`DecisionLog.prefill`);
its ``actual_cached_tokens`` is then the decode worker's report, which counts the tokens
transferred from the prefill worker as cached.

A candidate a peer can supply blocks to carries ``peer_blocks``, ``peer_worker``, ``peer_credit``
and ``peer_credit_source`` (:meth:`router.policies.base.CandidateScore.as_dict`), as in explain.

Entries are plain dicts, written on the event loop only (no locks). ``candidates`` keeps the
:data:`MAX_CANDIDATES` best-ranked (the chosen first), so an entry stays small on a large
cluster; ``candidates_total`` says how many there were. Memory: about 0.2-1 KiB per candidate
kept, so the default 1,024 entries of 8 candidates hold about 2-8 MiB.

:meth:`DecisionLog.summary` folds the entries of the last minutes into counts and time buckets
(``GET /admin/summary``, drawn by the dashboard, :mod:`router.edge.dashboard`).
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.route.plan import RoutePlan

DEFAULT_DECISIONS_KEPT = 1024
MAX_CANDIDATES = 16
DEFAULT_SUMMARY_WINDOW_S = 300.0
DEFAULT_SUMMARY_BUCKET_S = 10.0
MAX_SUMMARY_WINDOW_S = 3600.0
MAX_SUMMARY_BUCKETS = 720

# the per-bucket and total figures of a summary; token sums count only reported decisions
_FIGURES = ("decisions", "reported", "prompt_tokens", "predicted_cached_tokens", "actual_cached_tokens")


class SummaryWindowError(ValueError):
    """A summary window or bucket out of range; ``param`` names the query parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class DecisionEntry(dict):
    """One decision (the module docstring's shape), as a dict; its ``candidates`` are kept as the
    policy's :class:`~router.policies.base.CandidateScore` objects (``scores``, the best
    :data:`MAX_CANDIDATES`, the chosen first: a decision's scores are not changed once made) and
    written out as explain's dicts only when read (:meth:`view`, what :meth:`DecisionLog.snapshot`
    returns); until then the dict's own ``candidates`` is an empty list."""

    __slots__ = ("scores",)

    def view(self) -> dict[str, Any]:
        """A copy with ``candidates`` written out, ready to serialize."""
        return {**self, "candidates": [s.as_dict() for s in self.scores]}


class DecisionLog:
    """The ring of recent decisions; ``capacity`` 0 keeps none (recording is then a no-op)."""

    def __init__(self, capacity: int = DEFAULT_DECISIONS_KEPT) -> None:
        self.capacity = max(0, int(capacity))
        self._entries: deque[DecisionEntry] = deque(maxlen=self.capacity or 1)
        self.recorded = 0

    def __len__(self) -> int:
        return len(self._entries) if self.capacity else 0

    def record(self, plan: RoutePlan, request_id: str, queue_wait_ms: float = 0.0) -> DecisionEntry | None:
        """Add the decision ``plan`` made for ``request_id``; returns its entry (to be completed
        by :meth:`sent`, :meth:`first_token`, :meth:`usage`), None when the log keeps nothing."""
        if not self.capacity:
            return None
        entry = DecisionEntry(request_id=request_id, time_unix_s=round(time.time(), 3), model=plan.model.name)
        entry.update(plan.explain(0))  # the candidates' dicts are written when read (DecisionEntry.view)
        scores = plan.decision.scores
        entry.scores = scores[:MAX_CANDIDATES]
        entry["candidates_total"] = len(scores)
        entry["queue_wait_ms"] = round(max(0.0, queue_wait_ms), 3)
        entry["worker"] = None
        entry["gateway_ms"] = None
        entry["upstream_ttft_ms"] = None
        entry["actual_cached_tokens"] = None
        self._entries.append(entry)
        self.recorded += 1
        return entry

    @staticmethod
    def sent(entry: DecisionEntry | None, worker_id: str, arrived_s: float | None = None) -> None:
        """The request was sent to ``worker_id`` (the chosen one, or the next on a retry).
        ``arrived_s``: the request's arrival on ``time.perf_counter()``'s clock; sets
        ``gateway_ms``, the time since then less ``queue_wait_ms`` (a retry's includes the
        failed attempt)."""
        if entry is not None:
            entry["worker"] = worker_id
            if arrived_s is not None:
                since_ms = (time.perf_counter() - arrived_s) * 1000.0
                entry["gateway_ms"] = round(max(0.0, since_ms - entry["queue_wait_ms"]), 3)

    @staticmethod
    def prefill(entry: DecisionEntry | None, ms: float, outcome: str, cached_tokens: int | None = None) -> None:
        """A split request's prefill leg (:mod:`router.edge.prefill_leg`) took ``ms`` from its send to
        its answer (or failure), with ``outcome`` ``split``, ``prefill_failed`` or
        ``prefill_rejected`` (a 4xx passed to the client), and the prefill worker reported
        ``cached_tokens`` prefix-hit tokens (None: no report): ``pd.prefill_ms``,
        ``pd.prefill_outcome`` and ``pd.prefill_cached_tokens``; the leg's time is not the
        gateway's own (``gateway_ms`` leaves it out)."""
        if entry is not None and isinstance(entry.get("pd"), dict):
            entry["pd"]["prefill_ms"] = round(ms, 3)
            entry["pd"]["prefill_outcome"] = outcome
            entry["pd"]["prefill_cached_tokens"] = cached_tokens

    @staticmethod
    def first_token(entry: DecisionEntry | None, upstream_ttft_ms: float | None) -> None:
        """The worker's first byte came ``upstream_ttft_ms`` after the request was sent to it
        (the client's TTFT adds ``queue_wait_ms`` and the gateway's own work)."""
        if entry is not None and upstream_ttft_ms is not None:
            entry["upstream_ttft_ms"] = round(upstream_ttft_ms, 3)

    @staticmethod
    def usage(entry: DecisionEntry | None, actual_cached_tokens: int) -> None:
        """The worker reported ``actual_cached_tokens`` prefix-hit tokens for the request."""
        if entry is not None:
            entry["actual_cached_tokens"] = int(actual_cached_tokens)

    def snapshot(self, limit: int | None = None, worker: str | None = None,
                 since_unix_s: float | None = None) -> list[dict[str, Any]]:
        """Entries newest first, as copies (:meth:`DecisionEntry.view`): at most ``limit``, only
        those sent to (or, before sending, chosen as) ``worker``, only those decided after
        ``since_unix_s``."""
        if not self.capacity:
            return []
        out: list[dict[str, Any]] = []
        for entry in reversed(self._entries):
            if since_unix_s is not None and entry["time_unix_s"] <= since_unix_s:
                break
            if worker is not None and (entry["worker"] or entry["chosen"]) != worker:
                continue
            out.append(entry.view())
            if limit is not None and len(out) >= limit:
                break
        return out

    def summary(self, window_s: float = DEFAULT_SUMMARY_WINDOW_S, bucket_s: float = DEFAULT_SUMMARY_BUCKET_S,
                now_unix_s: float | None = None) -> dict[str, Any]:
        """The decisions of the last ``window_s`` seconds (up to ``now_unix_s``, default now),
        folded into counts and ``ceil(window_s / bucket_s)`` time buckets, oldest first. Buckets
        start at multiples of ``bucket_s`` since the epoch, the last one holding now, so the
        summaries of several gateway processes line up (:func:`merge_summaries`)::

            {"now_unix_s", "window_s", "bucket_s", "kept", "recorded",
             "oldest_kept_unix_s": t | null,     # the ring's oldest entry: before it, nothing is known
             "totals": {figures}, "hit_rate": r | null, "predicted_hit_rate": r | null,
             "by_reason": {reason: decisions}, "by_worker": {worker id: decisions},
             "series": [{"start_unix_s", figures, "hit_rate", "predicted_hit_rate"}, ...]}

        figures: ``decisions`` (all of them), ``reported`` (those whose worker has reported its
        cached tokens, with known prompt tokens) and, over the reported ones only, the sums of
        ``prompt_tokens``, ``predicted_cached_tokens`` and ``actual_cached_tokens``. A hit rate
        is cached over prompt tokens (0..1; null without reported tokens), so predicted and
        actual compare on the same requests. ``by_worker`` counts where a request was sent (or,
        before sending, chosen). The window holds only what the ring still keeps: under heavy
        traffic ``oldest_kept_unix_s`` falls inside it.

        Raises :class:`SummaryWindowError` unless 0 < ``window_s`` <= :data:`MAX_SUMMARY_WINDOW_S`
        and 0 < ``bucket_s`` <= ``window_s`` with at most :data:`MAX_SUMMARY_BUCKETS` buckets.
        """
        if not 0 < window_s <= MAX_SUMMARY_WINDOW_S:
            raise SummaryWindowError("window_s", f"window_s must be in (0, {MAX_SUMMARY_WINDOW_S:g}] seconds")
        if not 0 < bucket_s <= window_s or window_s / bucket_s > MAX_SUMMARY_BUCKETS:
            raise SummaryWindowError("bucket_s", f"bucket_s must be in (0, window_s] with at most "
                                                 f"{MAX_SUMMARY_BUCKETS} buckets in the window")
        now = time.time() if now_unix_s is None else now_unix_s
        n_buckets = math.ceil(window_s / bucket_s - 1e-9)
        start = (math.floor(now / bucket_s) + 1 - n_buckets) * bucket_s
        series: list[dict[str, Any]] = [dict.fromkeys(_FIGURES, 0) for _ in range(n_buckets)]
        totals: dict[str, Any] = dict.fromkeys(_FIGURES, 0)
        by_reason: dict[str, int] = {}
        by_worker: dict[str, int] = {}
        entries = self._entries if self.capacity else ()
        for entry in reversed(entries):  # newest first; recorded in time order
            t = entry["time_unix_s"]
            if t <= start:
                break
            bucket = series[min(n_buckets - 1, int((t - start) / bucket_s))]
            reason = str(entry.get("reason"))
            by_reason[reason] = by_reason.get(reason, 0) + 1
            worker = str(entry.get("worker") or entry.get("chosen"))
            by_worker[worker] = by_worker.get(worker, 0) + 1
            prompt, predicted, actual = (entry.get("prompt_tokens"), entry.get("predicted_cached_tokens"),
                                         entry.get("actual_cached_tokens"))
            reported = prompt is not None and actual is not None
            for figures in (bucket, totals):
                figures["decisions"] += 1
                if reported:
                    figures["reported"] += 1
                    figures["prompt_tokens"] += prompt
                    figures["predicted_cached_tokens"] += predicted or 0
                    figures["actual_cached_tokens"] += actual
        for i, bucket in enumerate(series):
            bucket["start_unix_s"] = round(start + i * bucket_s, 3)
            bucket["hit_rate"], bucket["predicted_hit_rate"] = _hit_rates(bucket)
        hit_rate, predicted_hit_rate = _hit_rates(totals)
        return {"now_unix_s": round(now, 3), "window_s": window_s, "bucket_s": bucket_s,
                "kept": self.capacity, "recorded": self.recorded,
                "oldest_kept_unix_s": entries[0]["time_unix_s"] if entries else None,
                "totals": totals, "hit_rate": hit_rate, "predicted_hit_rate": predicted_hit_rate,
                "by_reason": by_reason, "by_worker": by_worker, "series": series}


def merge_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary of several gateway processes' :meth:`DecisionLog.summary` answers, all made
    with the same ``window_s`` and ``bucket_s`` (raises ValueError otherwise, or for none):
    buckets with the same start are added up and the newest of them kept (a process that
    crossed into the next bucket first adds one); ``totals`` and the hit rates are those of
    the merged buckets; counts by reason and worker, ``kept`` and ``recorded`` are summed;
    ``now_unix_s`` is the latest, ``oldest_kept_unix_s`` the earliest."""
    if not summaries:
        raise ValueError("no summaries to merge")
    first = summaries[0]
    if any((s["window_s"], s["bucket_s"]) != (first["window_s"], first["bucket_s"]) for s in summaries):
        raise ValueError("summaries of different windows or buckets")
    buckets: dict[float, dict[str, Any]] = {}
    by_reason: dict[str, int] = {}
    by_worker: dict[str, int] = {}
    for summary in summaries:
        for bucket in summary["series"]:
            into = buckets.setdefault(bucket["start_unix_s"], dict.fromkeys(_FIGURES, 0))
            for key in _FIGURES:
                into[key] += bucket[key]
        for counts, into in ((summary["by_reason"], by_reason), (summary["by_worker"], by_worker)):
            for key, n in counts.items():
                into[key] = into.get(key, 0) + n
    series = []
    for start in sorted(buckets)[-len(first["series"]):]:
        bucket = {**buckets[start], "start_unix_s": start}
        bucket["hit_rate"], bucket["predicted_hit_rate"] = _hit_rates(bucket)
        series.append(bucket)
    totals = {key: sum(b[key] for b in series) for key in _FIGURES}
    hit_rate, predicted_hit_rate = _hit_rates(totals)
    oldest = [s["oldest_kept_unix_s"] for s in summaries if s["oldest_kept_unix_s"] is not None]
    return {"now_unix_s": max(s["now_unix_s"] for s in summaries), "window_s": first["window_s"],
            "bucket_s": first["bucket_s"], "kept": sum(s["kept"] for s in summaries),
            "recorded": sum(s["recorded"] for s in summaries), "oldest_kept_unix_s": min(oldest, default=None),
            "totals": totals, "hit_rate": hit_rate, "predicted_hit_rate": predicted_hit_rate,
            "by_reason": by_reason, "by_worker": by_worker, "series": series}


def _hit_rates(figures: dict[str, Any]) -> tuple[float | None, float | None]:
    """(actual, predicted) cached over prompt tokens of ``figures``, rounded; None without tokens."""
    prompt = figures["prompt_tokens"]
    if not prompt:
        return None, None
    return round(figures["actual_cached_tokens"] / prompt, 4), round(figures["predicted_cached_tokens"] / prompt, 4)
