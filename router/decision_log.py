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
     "upstream_ttft_ms": ms | null,                      # dispatch to the worker's first byte
     "actual_cached_tokens": n | null}                   # vLLM's usage.prompt_tokens_details
                                                         # (a several-prompt body: their sum)

Entries are plain dicts, written on the event loop only (no locks). ``candidates`` keeps the
:data:`MAX_CANDIDATES` best-ranked (the chosen first), so an entry stays small on a large
cluster; ``candidates_total`` says how many there were. Memory: about 0.2-1 KiB per candidate
kept, so the default 1,024 entries of 8 candidates hold about 2-8 MiB.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.routing import RoutePlan

DEFAULT_DECISIONS_KEPT = 1024
MAX_CANDIDATES = 16


class DecisionEntry(dict):
    """One decision (the module docstring's shape); a dict, so it serializes as it is."""


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
        entry.update(plan.explain())
        total = len(entry["candidates"])
        if total > MAX_CANDIDATES:
            entry["candidates"] = entry["candidates"][:MAX_CANDIDATES]
        entry["candidates_total"] = total
        entry["queue_wait_ms"] = round(max(0.0, queue_wait_ms), 3)
        entry["worker"] = None
        entry["upstream_ttft_ms"] = None
        entry["actual_cached_tokens"] = None
        self._entries.append(entry)
        self.recorded += 1
        return entry

    @staticmethod
    def sent(entry: DecisionEntry | None, worker_id: str) -> None:
        """The request was sent to ``worker_id`` (the chosen one, or the next on a retry)."""
        if entry is not None:
            entry["worker"] = worker_id

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
        """Entries newest first, as copies: at most ``limit``, only those sent to (or, before
        sending, chosen as) ``worker``, only those decided after ``since_unix_s``."""
        if not self.capacity:
            return []
        out: list[dict[str, Any]] = []
        for entry in reversed(self._entries):
            if since_unix_s is not None and entry["time_unix_s"] <= since_unix_s:
                break
            if worker is not None and (entry["worker"] or entry["chosen"]) != worker:
                continue
            out.append(dict(entry))
            if limit is not None and len(out) >= limit:
                break
        return out
