"""The gateway's single calls to a worker: a health probe, a load scrape (vLLM's ``/metrics``),
any GET such as ``/v1/models``. Every call is bounded by a timeout.

Each goes through the gateway's lean HTTP client (:class:`router.upstream_http.UpstreamHTTP`, the
relay's: keep-alive per worker, less CPU per call than aiohttp's), asks for
``Accept-Encoding: identity`` (a gzip or deflate answer is decompressed all the same) and follows
no redirect (a 3xx is a failed call). The loops that make them every interval are
:mod:`router.workers.probes`.

The load comes from vLLM's Prometheus text at ``/metrics``: ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` (summed over label sets, e.g. DP engines) and
``vllm:kv_cache_usage_perc`` (0..1, the maximum over label sets); a worker that is one data
parallel rank reads only its own ``engine="<rank>"`` label sets.

A scrape asks for those three metrics alone where the worker can answer so: vLLM serves
``/metrics`` twice (``vllm/entrypoints/serve/instrumentator/metrics.py``): the exact path through
prometheus-fastapi-instrumentator, the whole page (~48 kB on vLLM 0.32), and any longer path
through prometheus_client's ASGI app, which honours its ``name[]`` filter
(``prometheus_client/exposition.py``): ``/metrics/?name[]=...`` is ~0.5 kB, so a scrape costs
both the worker's API server and the gateway a small fraction of the page. The first scrape of a
worker tries that form (:func:`filtered_path`); a worker that answers it with anything but 200
and at least one of the three metrics (another engine, an older server, a proxy in between) is
scraped at the configured path from then on (``WorkerRegistration.scrape_filtered``), while one
that does not answer at all (not up yet) decides nothing. A configured path with a query of its
own is used as it is.
"""
from __future__ import annotations

import asyncio
import gzip
import time
import zlib
from urllib.parse import quote

import orjson

from router.config.schema import HealthConfig, LoadScrapeConfig
from router.upstream_http import UpstreamError, UpstreamHTTP
from router.workers.registry import WorkerRegistration

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_NAMES = (_RUNNING, _WAITING, _KV_USAGE)


FILTER_QUERY = "?" + "&".join(f"name%5B%5D={quote(name, safe=':')}" for name in _NAMES)  # as sent (yarl keeps ":")


def filtered_path(path: str) -> str | None:
    """``path`` as the filtered form of the page (the module docstring): ``/metrics`` ->
    ``/metrics/?name%5B%5D=vllm:num_requests_running&...``; None for a path with a query."""
    if "?" in path:
        return None
    return path.rstrip("/") + "/" + FILTER_QUERY


def parse_engine_load(text: str, rank: int | None = None) -> tuple[int | None, int | None, float | None]:
    """``(running, waiting, kv_usage)`` from Prometheus exposition text (vLLM's metric names);
    a metric absent from ``text`` gives None. Only the lines of these metrics are looked at
    (found by search: a vLLM page is ~48 kB of other metrics). ``rank``: read only the label sets
    of that data parallel rank (``engine="<rank>"``, vLLM's per-engine label); None: the whole
    server (every label set)."""
    running = waiting = None
    usage = None
    engine = None if rank is None else f'engine="{rank}"'
    for line in _lines_of(text):
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


def _lines_of(text: str):
    """The sample lines of :data:`_NAMES` in ``text`` (a name followed by ``{`` or a space at
    the start of a line), in order. A metric's samples are one run of lines (the text exposition
    format puts every line of a metric family in one group, as prometheus_client writes it), so
    the search stops at the first line after the run instead of scanning the rest of the page."""
    text = "\n" + text
    for name in _NAMES:
        needle = "\n" + name
        n = len(name)
        at = text.find(needle)
        while at != -1:
            end = text.find("\n", at + 1)
            line = text[at + 1:] if end == -1 else text[at + 1:end]
            if line[n:n + 1] not in ("{", " "):  # a longer name: search on
                at = -1 if end == -1 else text.find(needle, end)
            elif end != -1 and text.startswith(name, end + 1):  # the run goes on
                yield line
                at = end
            else:  # the run's last line
                yield line
                break


_IDENTITY = (("Accept-Encoding", "identity"),)


async def _get(client: UpstreamHTTP, url: str, timeout_s: float) -> tuple[int, bytes] | str:
    """``(status, body)`` of a GET within ``timeout_s`` seconds (the whole call; the body
    decompressed when the answer was gzip or deflate anyway), or the error text when it failed."""
    resp = None
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.request("GET", url, _IDENTITY)
            body = await resp.read()
        encoding = (resp.header(b"content-encoding") or b"").strip().lower()
        if encoding in (b"gzip", b"x-gzip"):
            body = gzip.decompress(body)
        elif encoding == b"deflate":
            body = zlib.decompress(body)
        return resp.status, body
    except (UpstreamError, TimeoutError, OSError, EOFError, zlib.error) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if resp is not None:
            resp.release()  # back to the pool when the whole body was read, else closed


async def probe_once(client: UpstreamHTTP, reg: WorkerRegistration, cfg: HealthConfig) -> bool:
    """One ``GET {url}{path}``; records the result on ``reg``; returns whether it answered 200."""
    got = await _get(client, reg.url + cfg.path, cfg.timeout_s)
    ok = not isinstance(got, str) and got[0] == 200
    error = None if ok else (got if isinstance(got, str) else f"status {got[0]}")
    reg.record_probe(ok, cfg.fail_threshold, cfg.rise_threshold, error)
    reg.check_events(time.monotonic())  # every probe: whether its KV events still flow
    return ok


async def scrape_once(client: UpstreamHTTP, reg: WorkerRegistration, cfg: LoadScrapeConfig) -> bool:
    """One ``GET {url}/metrics`` (its filtered form where the worker answers it: the module
    docstring); stores the engine load on ``reg``; returns success. A failed scrape forgets the
    last figures (a dead worker's last queue must not weigh on routing)."""
    rank = reg.cfg.data_parallel_rank
    path = filtered_path(cfg.path) if reg.scrape_filtered is not False else None
    if path is not None:
        got = await _get(client, reg.url + path, cfg.timeout_s)
        if isinstance(got, str):  # no answer (down, not up yet): nothing learnt about the form
            reg.forget_scrape()
            return False
        if got[0] == 200:
            load = parse_engine_load(got[1].decode(errors="replace"), rank)
            if load != (None, None, None):
                reg.scrape_filtered = True
                reg.record_scrape(*load)
                return True
        reg.scrape_filtered = False  # answered, not in that form: the configured path from now on
    got = await _get(client, reg.url + cfg.path, cfg.timeout_s)
    if isinstance(got, str) or got[0] != 200:
        reg.forget_scrape()
        return False
    reg.record_scrape(*parse_engine_load(got[1].decode(errors="replace"), rank))
    return True


async def worker_get(client: UpstreamHTTP, reg: WorkerRegistration, path: str,
                     timeout_s: float) -> bytes | str:
    """The body of ``GET {url}{path}`` when it answered 200 within ``timeout_s`` seconds (the
    whole call), else the error text."""
    got = await _get(client, reg.url + path, timeout_s)
    if isinstance(got, str):
        return got
    return got[1] if got[0] == 200 else f"status {got[0]}"


async def worker_models(client: UpstreamHTTP, reg: WorkerRegistration,
                        timeout_s: float) -> list[dict] | str:
    """The model cards of ``GET {url}/v1/models`` (OpenAI list shape ``{"data": [card, ...]}``),
    the whole call bounded by ``timeout_s`` seconds; the error text when it failed, timed out,
    answered non-200 or not that shape."""
    body = await worker_get(client, reg, "/v1/models", timeout_s)
    if isinstance(body, str):
        return body
    try:
        data = orjson.loads(body).get("data")
    except (orjson.JSONDecodeError, AttributeError):
        return "not a JSON object"
    if not isinstance(data, list):
        return "no 'data' list"
    return [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]
