"""The gateway's own calls to workers: the per-worker background loops (health probe,
engine-load scrape) and the ``GET /v1/models`` listing. Every call is bounded by a timeout.

Both are registry task factories (``factory(registration) -> coroutine``) bound to the gateway's
shared aiohttp session. The load comes from vLLM's Prometheus text at ``/metrics``:
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (summed over label sets, e.g. DP
engines) and ``vllm:kv_cache_usage_perc`` (0..1, the maximum over label sets); a worker that is one
data parallel rank reads only its own ``engine="<rank>"`` label sets.
"""
from __future__ import annotations

import asyncio
import logging
import time

from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from router.config import HealthConfig, LoadScrapeConfig
from router.registry import WorkerRegistration

log = logging.getLogger("kvroute.probes")

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_NAMES = (_RUNNING, _WAITING, _KV_USAGE)


def parse_engine_load(text: str, rank: int | None = None) -> tuple[int | None, int | None, float | None]:
    """``(running, waiting, kv_usage)`` from Prometheus exposition text (vLLM's metric names);
    a metric absent from ``text`` gives None. Lines of other metrics are skipped cheaply.
    ``rank``: read only the label sets of that data parallel rank (``engine="<rank>"``, vLLM's
    per-engine label); None: the whole server (every label set)."""
    running = waiting = None
    usage = None
    engine = None if rank is None else f'engine="{rank}"'
    for line in text.splitlines():
        if not line.startswith(_NAMES):
            continue
        space = line.find(" ")
        brace = line.find("{")
        if brace != -1 and (space == -1 or brace < space):
            close = line.rfind("}")
            if engine is not None and engine not in line[brace:close]:
                continue
            name, rest = line[:brace], line[close + 1:]
        elif engine is not None:  # no labels: not a rank's line
            continue
        else:
            name, rest = line[:space], line[space:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if name == _RUNNING:
            running = (running or 0) + int(value)
        elif name == _WAITING:
            waiting = (waiting or 0) + int(value)
        elif name == _KV_USAGE:
            usage = value if usage is None else max(usage, value)
    return running, waiting, usage


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, bytes] | str:
    """``(status, body)`` of a GET, or the error text when it failed."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def probe_once(session: aiohttp.ClientSession, reg: WorkerRegistration, cfg: HealthConfig) -> bool:
    """One ``GET {url}{path}``; records the result on ``reg``; returns whether it answered 200."""
    got = await _get(session, reg.url + cfg.path, cfg.timeout_s)
    ok = not isinstance(got, str) and got[0] == 200
    error = None if ok else (got if isinstance(got, str) else f"status {got[0]}")
    reg.record_probe(ok, cfg.fail_threshold, cfg.rise_threshold, error)
    reg.check_events(time.monotonic())  # every probe: whether its KV events still flow
    return ok


async def scrape_once(session: aiohttp.ClientSession, reg: WorkerRegistration, cfg: LoadScrapeConfig) -> bool:
    """One ``GET {url}/metrics``; stores the engine load on ``reg``; returns success. A failed
    scrape forgets the last figures (a dead worker's last queue must not weigh on routing)."""
    got = await _get(session, reg.url + cfg.path, cfg.timeout_s)
    if isinstance(got, str) or got[0] != 200:
        reg.forget_scrape()
        return False
    reg.record_scrape(*parse_engine_load(got[1].decode(errors="replace"), reg.cfg.data_parallel_rank))
    return True


async def worker_get(session: aiohttp.ClientSession, reg: WorkerRegistration, path: str,
                     timeout_s: float) -> bytes | str:
    """The body of ``GET {url}{path}`` when it answered 200 within ``timeout_s`` seconds (the
    whole call), else the error text."""
    got = await _get(session, reg.url + path, timeout_s)
    if isinstance(got, str):
        return got
    return got[1] if got[0] == 200 else f"status {got[0]}"


async def worker_models(session: aiohttp.ClientSession, reg: WorkerRegistration,
                        timeout_s: float) -> list[dict] | str:
    """The model cards of ``GET {url}/v1/models`` (OpenAI list shape ``{"data": [card, ...]}``),
    the whole call bounded by ``timeout_s`` seconds; the error text when it failed, timed out,
    answered non-200 or not that shape."""
    body = await worker_get(session, reg, "/v1/models", timeout_s)
    if isinstance(body, str):
        return body
    try:
        data = orjson.loads(body).get("data")
    except (orjson.JSONDecodeError, AttributeError):
        return "not a JSON object"
    if not isinstance(data, list):
        return "no 'data' list"
    return [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]


def periodic_task(step, session: aiohttp.ClientSession, cfg: HealthConfig | LoadScrapeConfig):
    """A registry task factory running ``step(session, reg, cfg)`` at once and then every
    ``cfg.interval_s`` seconds, for as long as the worker is registered."""

    async def run(reg: WorkerRegistration) -> None:
        while True:
            await step(session, reg, cfg)
            await asyncio.sleep(cfg.interval_s)

    return run


def health_probe_task(session: aiohttp.ClientSession, cfg: HealthConfig,
                      on_change: Callable[[WorkerRegistration], Awaitable[None]] | None = None):
    """Task factory: :func:`probe_once` every ``cfg.interval_s``; ``on_change(reg)`` is awaited
    after a probe that turned the worker up or down (not after its first probe)."""

    async def step(session: aiohttp.ClientSession, reg: WorkerRegistration, cfg: HealthConfig) -> None:
        before = reg.healthy
        await probe_once(session, reg, cfg)
        if on_change is not None and before is not None and reg.healthy is not before:
            await on_change(reg)

    return periodic_task(step, session, cfg)


def load_scrape_task(session: aiohttp.ClientSession, cfg: LoadScrapeConfig):
    """Task factory: :func:`scrape_once` every ``cfg.interval_s``."""
    return periodic_task(scrape_once, session, cfg)
