"""The load scrape's form (``router/workers/calls.py``): vLLM's filtered ``/metrics/?name[]=...``
where the worker answers it, the configured page otherwise, decided once per worker from what it
answered, never from a worker that did not answer. Workers are stand-ins on real sockets; the
filtered form against a real ``kvroute sim`` is in test_sim_http.py and against real vLLM in
tests/e2e/test_fidelity.py."""
from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from conftest import free_port
from router.config.schema import LoadScrapeConfig, WorkerConfig
from router.workers.calls import FILTER_QUERY, filtered_path, scrape_once
from router.workers.registry import WorkerRegistration
from test_shared_probes import lean_client

PAGE = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')


class Worker:
    """``/metrics`` answers the whole page; ``/metrics/...`` answers ``filtered`` (None: 404, as
    a server without vLLM's mount). ``calls`` lists each request's path and query."""

    def __init__(self, filtered: tuple[int, str] | None) -> None:
        self.filtered = filtered
        self.calls: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(request.raw_path)  # as sent
        if request.path == "/metrics":
            return web.Response(text=PAGE + "# other metrics\n" * 2000)
        if self.filtered is None:
            return web.Response(status=404)
        status, text = self.filtered
        return web.Response(status=status, text=text)


@contextlib.asynccontextmanager
async def serving(worker: Worker, port: int | None = None):
    app = web.Application()
    app.router.add_get("/{tail:.*}", worker.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port or 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def _reg(url: str) -> WorkerRegistration:
    return WorkerRegistration(WorkerConfig(id="w0", url=url, model="m"))


def _load(reg: WorkerRegistration) -> tuple:
    return reg.engine_running, reg.engine_waiting, reg.kv_usage


def test_the_filtered_path_names_the_three_gauges_and_a_query_of_ones_own_is_kept():
    assert filtered_path("/metrics") == filtered_path("/metrics/") == "/metrics/" + FILTER_QUERY
    assert FILTER_QUERY == ("?name%5B%5D=vllm:num_requests_running&name%5B%5D=vllm:num_requests_waiting"
                            "&name%5B%5D=vllm:kv_cache_usage_perc")
    assert filtered_path("/metrics?x=1") is None


def test_a_worker_answering_the_filtered_form_is_scraped_in_it_alone():
    async def go():
        worker = Worker((200, PAGE))
        async with serving(worker) as url, lean_client() as client:
            reg = _reg(url)
            oks = [await scrape_once(client, reg, LoadScrapeConfig()) for _ in range(3)]
            return oks, reg, worker.calls

    oks, reg, calls = asyncio.run(go())
    assert oks == [True] * 3 and reg.scrape_filtered is True and _load(reg) == (3, 1, 0.25)
    assert calls == ["/metrics/" + FILTER_QUERY] * 3  # the whole page never fetched


def test_a_worker_without_the_form_falls_back_to_the_page_once_and_for_all():
    async def go():
        out = {}
        for name, filtered in (("404", None), ("another page", (200, "<html>metrics index</html>")),
                               ("500", (500, PAGE))):
            worker = Worker(filtered)
            async with serving(worker) as url, lean_client() as client:
                reg = _reg(url)
                oks = [await scrape_once(client, reg, LoadScrapeConfig()) for _ in range(3)]
                out[name] = (oks, reg.scrape_filtered, _load(reg), worker.calls)
        return out

    for name, (oks, form, load, calls) in asyncio.run(go()).items():
        assert oks == [True] * 3 and form is False and load == (3, 1, 0.25), name
        assert calls == ["/metrics/" + FILTER_QUERY] + ["/metrics"] * 3, name  # tried once, then the page


def test_a_worker_not_up_yet_decides_nothing_and_is_scraped_filtered_once_up():
    async def go():
        port = free_port()
        async with lean_client() as client:
            reg = _reg(f"http://127.0.0.1:{port}")
            reg.record_scrape(5, 5, 0.5)
            down = await scrape_once(client, reg, LoadScrapeConfig(timeout_s=2.0))
            after_down = (reg.scrape_filtered, _load(reg))
            worker = Worker((200, PAGE))
            async with serving(worker, port):
                up = await scrape_once(client, reg, LoadScrapeConfig())
            gone = await scrape_once(client, reg, LoadScrapeConfig(timeout_s=2.0))
            return down, after_down, up, worker.calls, gone, reg.scrape_filtered, _load(reg)

    down, after_down, up, calls, gone, form, load = asyncio.run(go())
    assert down is False and after_down == (None, (None, None, None))  # figures forgotten, form untried
    assert up is True and calls == ["/metrics/" + FILTER_QUERY]
    assert gone is False and form is True and load == (None, None, None)  # down again: the form stays


def test_a_configured_path_with_a_query_is_scraped_as_it_is():
    async def go():
        worker = Worker((200, PAGE))
        async with serving(worker) as url, lean_client() as client:
            reg = _reg(url)
            ok = await scrape_once(client, reg, LoadScrapeConfig(path="/metrics?x=1"))
            return ok, reg.scrape_filtered, worker.calls

    assert asyncio.run(go()) == (True, None, ["/metrics?x=1"])

