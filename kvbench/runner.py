"""Replay one workload against one OpenAI endpoint and collect the records (the I/O of
``kvroute bench run``; the figures come from :mod:`kvbench.stats`).

Before a target: optionally empty every known worker's prefix cache (``/reset_prefix_cache``, so
targets start alike) and read the workers' counters; then send every request under the arrival
process (a progress bar on stderr), then read the counters again. Per-worker figures come from the
``x-kvroute-worker`` header when the router sets it, else from the counters.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from kvbench import workers as worker_http
from kvbench.arrivals import Arrivals
from kvbench.client import RequestRecord, send
from kvbench.stats import per_worker_from_records, summarize
from kvbench.workload import Workload

COUNTERS_SETTLE_S = 10.0  # how long the workers' request counters may lag the last stream's end


@dataclass
class Target:
    """An endpoint to measure: ``name`` (the table's label) and ``base_url`` (``http://host:port``,
    with the OpenAI API under ``/v1``; a trailing ``/v1`` is accepted and dropped)."""

    name: str
    base_url: str

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]


@dataclass
class RunSettings:
    """How to send: ``model`` name, ``arrivals``, per-request ``timeout_s``, extra ``headers``,
    the TTFT target of goodput (ms), known ``workers`` (name -> URL) whose counters are read and,
    with ``reset_cache``, whose prefix caches are emptied before each target."""

    model: str
    arrivals: Arrivals
    timeout_s: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)
    ttft_target_ms: float = 1000.0
    workers: dict[str, str] = field(default_factory=dict)
    reset_cache: bool = False
    progress: bool = True


async def replay(base_url: str, workload: Workload, settings: RunSettings,
                 label: str = "") -> tuple[list[RequestRecord], float]:
    """Send every request of ``workload`` to ``base_url``; returns (records in workload order,
    wall seconds from the first send to the last end)."""
    reqs = workload.requests
    times = settings.arrivals.send_times_s(workload)
    done = [asyncio.Event() for _ in reqs]
    records: list[RequestRecord | None] = [None] * len(reqs)
    bar = tqdm(total=len(reqs), desc=label or base_url, unit="req", file=sys.stderr,
               disable=not settings.progress, dynamic_ncols=True)
    errors = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()

        async def one(i: int, at_s: float | None) -> None:
            nonlocal errors
            req = reqs[i]
            if at_s is not None:
                await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
            if req.after is not None:
                await done[req.after].wait()
            rec = await send(session, base_url, req, settings.model, time.monotonic() - t0,
                             settings.timeout_s, settings.headers)
            records[i] = rec
            done[i].set()
            errors += 0 if rec.ok else 1
            bar.update(1)
            if errors:
                bar.set_postfix(errors=errors, refresh=False)

        if times is not None:
            await asyncio.gather(*(one(i, t) for i, t in enumerate(times)))
        else:
            slots = asyncio.Semaphore(settings.arrivals.concurrency)

            async def in_slot(i: int) -> None:
                try:
                    await one(i, None)
                finally:
                    slots.release()

            tasks = []
            for i in range(len(reqs)):
                await slots.acquire()
                tasks.append(asyncio.create_task(in_slot(i)))
            await asyncio.gather(*tasks)
        duration = time.monotonic() - t0
    bar.close()
    return [r for r in records if r is not None], duration


def _settled_counters(urls: dict[str, str], before: dict, expect_requests: int) -> dict:
    """The workers' counters once their request count reached ``before`` + ``expect_requests``
    (vLLM counts a request when its output is processed, a moment after the stream ends), or
    after :data:`COUNTERS_SETTLE_S`."""
    after, _ = worker_http.poll_until(
        lambda: worker_http.worker_counters(urls),
        lambda now: sum(a["requests"] - before[w]["requests"] for w, a in now.items()) >= expect_requests,
        COUNTERS_SETTLE_S)
    return after


def run_target(target: Target, workload: Workload, settings: RunSettings) -> dict[str, Any]:
    """Measure one target (module docstring); returns its JSON entry (see :func:`summarize`)."""
    if settings.reset_cache:
        for url in settings.workers.values():
            worker_http.reset_prefix_cache(url, settings.model)
    before = worker_http.worker_counters(settings.workers) if settings.workers else {}
    records, duration = asyncio.run(replay(target.base_url, workload, settings, target.name))
    per_worker = per_worker_from_records(records)
    if settings.workers:
        ok = sum(1 for r in records if r.ok)
        counted = worker_http.counters_delta(before, _settled_counters(settings.workers, before, ok))
        if not per_worker:  # the router does not name the worker: the workers' own counters
            per_worker = counted
        elif set(per_worker) <= set(settings.workers):  # one that got nothing counts in max/mean
            for name in settings.workers:
                per_worker.setdefault(name, {"requests": 0, "prefill_tokens": 0, "cached_tokens": 0})
    return summarize(target.name, records, duration, workload.ideal_cached_tokens(), settings.ttft_target_ms,
                     per_worker)
