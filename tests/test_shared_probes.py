"""One prober per host (``router.shared.probe_table``): the file's records, who probes, and two
processes' probe steps against a real HTTP worker stand-in that counts its calls."""
from __future__ import annotations

import asyncio
import struct
import time

import contextlib
import gzip
import pytest
from aiohttp import web

from router.config.schema import HealthConfig, LoadScrapeConfig, WorkerConfig
from router.shared.load_table import STALE_S, SharedLoadTable, create_table as create_load_table
from router.shared.probe_table import RECORD_BYTES, SharedProbeTable, create_table, stale_after_s
from router.upstream_http import UpstreamHTTP
from router.workers.calls import scrape_once
from router.workers.probes import ProbeSharing, shared_probe_once, shared_scrape_once
from router.workers.registry import WorkerRegistration

METRICS = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
           '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
           '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')


def test_records_round_trip_and_a_write_in_progress_is_never_read(tmp_path):
    table = SharedProbeTable(create_table(tmp_path / "probes"))
    other = SharedProbeTable(tmp_path / "probes")  # another process's mapping of the same file
    assert other.read_probe(3) is None and other.read_scrape(3) is None  # nothing written yet
    table.write_probe(3, False, "status 503", now=100.0)
    got = other.read_probe(3)
    assert (got.ok, got.error, got.at, got.seq) == (False, "status 503", 100.0, 2)
    table.write_probe(3, True, None, now=101.0)
    got = other.read_probe(3)
    assert (got.ok, got.error, got.at, got.seq) == (True, None, 101.0, 4)
    table.write_scrape(3, True, running=2, waiting=None, kv_usage=0.5, now=102.0)
    s = other.read_scrape(3)
    assert (s.ok, s.running, s.waiting, s.kv_usage, s.at) == (True, 2, None, 0.5, 102.0)
    table.write_scrape(3, False, now=103.0)
    assert other.read_scrape(3).ok is False and other.read_scrape(3).running is None
    assert other.read_probe(4) is None  # records are per slot
    # a writer that died between its two sequence bumps leaves the number odd: never read as whole
    struct.pack_into("<Q", table._mm, 3 * RECORD_BYTES, 5)
    assert other.read_probe(3) is None
    table.write_probe(3, False, "x" * 500, now=104.0)  # the next write makes it whole again
    got = other.read_probe(3)
    assert got.seq % 2 == 0 and got.seq > 5 and got.error == "x" * 159  # text cut to its field
    with pytest.raises(ValueError):
        SharedProbeTable(create_load_table(tmp_path / "load", 2))  # not a probe table
    for t in (table, other):
        t.close()


def test_the_live_process_of_lowest_index_is_the_prober(tmp_path):
    path = create_load_table(tmp_path / "load", 3)
    a, b, c = (SharedLoadTable(path, 3, row) for row in range(3))
    assert [t.first_live_row() for t in (a, b, c)] == [0, 0, 0]
    a.heartbeat(now=time.monotonic() - STALE_S - 1)  # process 0 stopped beating
    assert [b.first_live_row(), c.first_live_row()] == [1, 1]
    b.heartbeat(now=time.monotonic() - STALE_S - 1)
    assert c.first_live_row() == 2  # its own row always counts
    a.heartbeat()
    assert c.first_live_row() == 0
    for t in (a, b, c):
        t.close()


class Worker:
    """A worker stand-in on a real port: ``/health`` answers ``status``, ``/metrics`` a vLLM
    page; ``calls`` counts both."""

    def __init__(self) -> None:
        self.status = 200
        self.calls = {"/health": 0, "/metrics": 0}

    async def handle(self, request: web.Request) -> web.Response:
        self.calls[request.path] += 1
        if request.path == "/metrics":
            return web.Response(text=METRICS)
        return web.Response(status=self.status)


@contextlib.asynccontextmanager
async def lean_client():
    """The gateway's client for probes and scrapes (router.upstream_http)."""
    client = UpstreamHTTP()
    try:
        yield client
    finally:
        await client.close()


async def _serve(worker: Worker) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/health", worker.handle)
    app.router.add_get("/metrics", worker.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _two_processes(load_path, probe_path, url: str, is_prober) -> list[tuple[WorkerRegistration, ProbeSharing]]:
    """Rows 0 and 1 of the shared tables, each with its registration of worker ``w0`` at ``url``
    and its ProbeSharing (``is_prober(load_table, row)``)."""
    procs = []
    for row in (0, 1):
        load = SharedLoadTable(load_path, 2, row)
        reg = WorkerRegistration(WorkerConfig(id="w0", url=url, model="m"))
        reg.shared = (load, load.slot("w0"))
        procs.append((reg, ProbeSharing(SharedProbeTable(probe_path), lambda load=load, row=row: is_prober(load, row))))
    return procs


def test_one_process_calls_the_worker_and_the_other_applies_each_result_once(tmp_path):
    """Process 0 probes and scrapes; process 1 calls nothing and follows (ProbeSharing.apply):
    the same health transitions (3 failures to go down, its callback awaited once) and the same
    engine load. Once the prober's records are too old, process 1 calls the worker itself."""
    load_path = create_load_table(tmp_path / "load", 2)
    probe_path = create_table(tmp_path / "probes")
    health, scrape = HealthConfig(interval_s=1, timeout_s=1), LoadScrapeConfig(interval_s=1, timeout_s=1)

    async def run() -> None:
        worker = Worker()
        runner, url = await _serve(worker)
        procs = _two_processes(load_path, probe_path, url, lambda load, row: load.first_live_row() == row)
        (reg0, p0), (reg1, p1) = procs
        changes: list[bool] = []

        async def on_change(reg: WorkerRegistration) -> None:
            changes.append(reg.healthy)

        try:
            async with lean_client() as session:
                async def both() -> None:
                    assert await shared_probe_once(session, reg0, health, p0) is True
                    assert await shared_probe_once(session, reg1, health, p1) is False  # a fresh record: no call
                    await p1.apply(reg1, health, scrape, on_change)
                    await p1.apply(reg1, health, scrape, on_change)  # each result applied once

                await both()
                assert worker.calls["/health"] == 1
                assert (reg0.healthy, reg1.healthy) == (True, True) and p1.applied["health"] == 1
                worker.status = 503
                for n in range(3):
                    await both()
                    assert reg1.healthy is (n < 2), n  # down after fail_threshold (3) results, as process 0
                    assert reg0.healthy is reg1.healthy
                assert changes == [False] and reg1.health.last_error == "status 503"
                assert worker.calls["/health"] == 4 and p0.calls["health"] == 4 and p1.calls["health"] == 0
                assert p1.applied["health"] == 4

                assert await shared_scrape_once(session, reg0, scrape, p0) is True
                assert await shared_scrape_once(session, reg1, scrape, p1) is False
                await p1.apply(reg1, health, scrape)
                assert (reg1.engine_running, reg1.engine_waiting, reg1.kv_usage) == (3, 1, 0.25)
                assert worker.calls["/metrics"] == 1 and p1.calls["scrape"] == 0 and p1.applied["scrape"] == 1

                # the prober's last results are older than stale_after_s: nothing to apply, and
                # process 1 calls the worker itself
                old = time.monotonic() - stale_after_s(1, 1) - 1
                p0.table.write_probe(reg0.shared[1], True, None, now=old)
                p0.table.write_scrape(reg0.shared[1], True, 9, 9, 0.9, now=old)
                await p1.apply(reg1, health, scrape)
                assert reg1.healthy is False and reg1.engine_running == 3 and p1.applied == {"health": 4, "scrape": 1}
                worker.status = 200
                assert await shared_probe_once(session, reg1, health, p1) is True
                assert await shared_scrape_once(session, reg1, scrape, p1) is True
                assert worker.calls == {"/health": 5, "/metrics": 2}
                assert p1.calls == {"health": 1, "scrape": 1}
        finally:
            await runner.cleanup()
            for reg, sharing in procs:
                reg.shared[0].close()
                sharing.table.close()

    asyncio.run(run())


@pytest.mark.parametrize("always_gzip", [False, True])
def test_a_scrape_asks_for_identity_and_reads_a_gzipped_page_all_the_same(always_gzip):
    """vLLM's /metrics (prometheus_client's ASGI app) gzips its page for a client that accepts
    gzip: the scrape asks for ``identity`` and gets the text; a server that gzips regardless
    (``always_gzip``) is decompressed. Either way the three gauges are read."""
    seen: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:
        accept = request.headers.get("Accept-Encoding")
        seen.append(accept)
        if always_gzip or "gzip" in (accept or ""):
            return web.Response(body=gzip.compress(METRICS.encode()), headers={"Content-Encoding": "gzip"},
                                content_type="text/plain")
        return web.Response(text=METRICS)

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        reg = WorkerRegistration(WorkerConfig(id="w0", url=url, model="m"))
        try:
            async with lean_client() as client:
                assert await scrape_once(client, reg, LoadScrapeConfig(interval_s=1, timeout_s=5)) is True
        finally:
            await runner.cleanup()
        assert seen == ["identity"]
        assert (reg.engine_running, reg.engine_waiting, reg.kv_usage) == (3, 1, 0.25)

    asyncio.run(run())


def test_a_followers_worker_loop_waits_while_the_prober_is_live_and_calls_once_its_records_go_stale(tmp_path):
    """The per-worker health loops of two processes (``health_probe_task``) with
    ``ProbeSharing.follow`` running in the follower: while process 0 probes, the follower's loop
    waits in ``wait_turn`` (it calls nothing and does not wake every interval); once process 0
    stops probing and its record is older than ``stale_after_s``, follow wakes the loop and the
    follower probes the worker itself."""
    from kv_replay_publisher import until

    from router.workers.probes import health_probe_task

    load_path = create_load_table(tmp_path / "load", 2)
    probe_path = create_table(tmp_path / "probes")
    health = HealthConfig(interval_s=0.2, timeout_s=0.2)

    async def run() -> None:
        worker = Worker()
        runner, url = await _serve(worker)
        procs = _two_processes(load_path, probe_path, url, lambda load, row: row == 0)
        (reg0, p0), (reg1, p1) = procs
        tasks = []
        try:
            async with lean_client() as client:
                prober = asyncio.create_task(health_probe_task(client, health, None, p0)(reg0))
                await until(lambda: p0.calls["health"] >= 1, what="the prober's first probe")
                tasks = [prober, asyncio.create_task(health_probe_task(client, health, None, p1)(reg1)),
                         asyncio.create_task(p1.follow(lambda: [reg1], health, None))]
                await until(lambda: p0.calls["health"] >= 6, what="the prober probing on")
                assert p1.calls["health"] == 0 and p1.applied["health"] >= 1 and reg1.healthy is True
                assert p1._turn is not None and not p1._turn.done()  # the follower's loop is waiting
                # stop process 0 between two probes, once the worker has received every probe it
                # counted: a probe cancelled before its request went out would be counted by p0
                # and never reach the worker (nothing awaits between this check and the cancel)
                await until(lambda: worker.calls["/health"] == p0.calls["health"], what="p0's probes received")
                prober.cancel()  # process 0 stops probing (hung, not dead: it stays the prober)
                stopped = time.monotonic()
                await until(lambda: p1.calls["health"] >= 1, what="the follower probing itself")
                assert time.monotonic() - stopped >= stale_after_s(health.interval_s, health.timeout_s) - 0.3
                # the follower counts its probe as it sends it: wait for the worker to receive it
                await until(lambda: worker.calls["/health"] >= p0.calls["health"] + p1.calls["health"],
                            what="the follower's probe received")
                assert worker.calls["/health"] == p0.calls["health"] + p1.calls["health"]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await runner.cleanup()
            for reg, sharing in procs:
                reg.shared[0].close()
                sharing.table.close()

    asyncio.run(run())


def test_changes_move_only_when_applying_the_result_would_change_a_follower(tmp_path):
    """A run of equal health results moves ``changes`` for its first ``repeats_shown`` writes;
    a repeated scrape moves it once, unless the gateway has requests on the worker (then every
    time, and once more after they ended); every write still refreshes the record's time, and
    the vectorised columns show both."""
    table = SharedProbeTable(create_table(tmp_path / "probes"))
    moved = [table.write_probe(5, ok, err, now=float(t), repeats_shown=3)
             for t, (ok, err) in enumerate([(True, None)] * 5 + [(False, "status 503")] * 4 + [(True, None)])]
    assert moved == [True, True, True, False, False, True, True, True, False, True]
    got = table.read_probe(5)
    assert (got.changes, got.at, got.ok) == (7, 9.0, True)
    assert [table.write_scrape(5, True, 0, 0, 0.0, now=10.0 + i) for i in range(3)] == [True, False, False]
    assert [table.write_scrape(5, True, 2, 1, 0.1, now=20.0 + i) for i in range(3)] == [True, False, False]
    assert [table.write_scrape(5, True, 2, 1, 0.1, now=30.0 + i, in_flight=n)
            for i, n in enumerate([3, 3, 0, 0])] == [True, True, True, False]
    assert [table.write_scrape(5, False, now=40.0 + i) for i in range(2)] == [True, False]
    cols = table.columns()
    assert (int(cols.probe_changes[5]), cols.probe_at[5], int(cols.scrape_changes[5]), cols.scrape_at[5],
            cols.scrape_ok[5]) == (7, 9.0, 6, 41.0, 0.0)
    assert table.read_scrape(5).changes == 6 and int(cols.probe_changes[6]) == 0
    table.close()
    with pytest.raises(ValueError):
        table.columns()


def test_a_follower_seeing_only_moved_results_keeps_the_probers_health_through_any_sequence(tmp_path):
    """Hysteresis survives the skipped repeats: the prober publishes a random run-heavy sequence
    of results (repeats shown up to the larger threshold) and the follower, applying after each
    write, is up or down exactly when the prober is, with its callback awaited on each flip."""
    import random

    load_path = create_load_table(tmp_path / "load", 2)
    probe_path = create_table(tmp_path / "probes")
    health = HealthConfig(interval_s=1, timeout_s=1, fail_threshold=3, rise_threshold=2)
    rng = random.Random(7)
    results = [ok for _ in range(120) for ok in [rng.random() < 0.6] * rng.choice([1, 1, 2, 3, 5, 9])]

    async def run() -> tuple[list, list, int]:
        (reg0, p0), (reg1, p1) = _two_processes(load_path, probe_path, "http://127.0.0.1:9", lambda load, row: row == 0)
        flips: list[bool] = []

        async def on_change(reg: WorkerRegistration) -> None:
            flips.append(reg.healthy)

        prober_states, follower_states = [], []
        try:
            for ok in results:
                reg0.record_probe(ok, health.fail_threshold, health.rise_threshold, None if ok else "down")
                p0.table.write_probe(reg0.shared[1], ok, reg0.health.last_error,
                                     repeats_shown=max(health.fail_threshold, health.rise_threshold))
                await p1.apply(reg1, health, None, on_change)
                prober_states.append(reg0.healthy)
                follower_states.append(reg1.healthy)
        finally:
            for reg, sharing in ((reg0, p0), (reg1, p1)):
                reg.shared[0].close()
                sharing.table.close()
        expected_flips = [b for a, b in zip(prober_states, prober_states[1:]) if a is not b]
        assert flips == expected_flips
        return prober_states, follower_states, p1.applied["health"]

    prober_states, follower_states, applied = asyncio.run(run())
    assert follower_states == prober_states and False in prober_states and True in prober_states
    assert applied < len(results)  # long runs were not applied again and again


def test_follow_once_reads_only_the_workers_whose_records_moved_or_went_stale(tmp_path):
    """64 idle workers: the first pass applies every record; a pass after the prober wrote the
    same results again applies none (and still refreshes the scrape age); a busy worker's new
    scrape is applied alone; a record older than stale_after_s makes the pass say so."""
    load_path = create_load_table(tmp_path / "load", 2)
    probe_path = create_table(tmp_path / "probes")
    health, scrape = HealthConfig(interval_s=1, timeout_s=1), LoadScrapeConfig(interval_s=1, timeout_s=1)
    prober_load, follower_load = SharedLoadTable(load_path, 2, 0), SharedLoadTable(load_path, 2, 1)
    prober_table = SharedProbeTable(probe_path)
    sharing = ProbeSharing(SharedProbeTable(probe_path), lambda: False)
    regs = []
    for i in range(64):
        reg = WorkerRegistration(WorkerConfig(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", model="m"))
        reg.shared = (follower_load, follower_load.slot(reg.id))
        regs.append(reg)

    def publish(busy: int | None = None, now: float | None = None) -> None:
        for reg in regs:
            slot = prober_load.slot(reg.id)
            prober_table.write_probe(slot, True, None, now=now, repeats_shown=3)
            prober_table.write_scrape(slot, True, 4 if reg.id == f"w{busy}" else 0, 0, 0.0, now=now,
                                      in_flight=1 if reg.id == f"w{busy}" else 0)

    async def run() -> None:
        for _ in range(3):  # past the repeats a follower is shown
            publish()
        assert await sharing.follow_once(regs, health, scrape) is False
        assert sharing.applied == {"health": 64, "scrape": 64} and all(r.healthy for r in regs)
        before = regs[7].last_scrape_monotonic
        publish()
        assert await sharing.follow_once(regs, health, scrape) is False
        assert sharing.applied == {"health": 64, "scrape": 64}
        assert regs[7].last_scrape_monotonic > before  # the unmoved record still dates the figures
        publish(busy=7)
        await sharing.follow_once(regs, health, scrape)
        assert sharing.applied == {"health": 64, "scrape": 65} and regs[7].engine_running == 4
        assert [r.engine_running for r in regs].count(4) == 1
        publish(now=time.monotonic() - stale_after_s(1, 1) - 1)
        assert await sharing.follow_once(regs, health, scrape) is True

    try:
        asyncio.run(run())
    finally:
        for t in (prober_load, follower_load, prober_table, sharing.table):
            t.close()
