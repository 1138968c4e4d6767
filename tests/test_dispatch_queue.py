"""The dispatch queue (policy key ``queue``): predicted prefill ends and reservations on a
registration, then through real gateways in front of simulated workers whose prefill is slow
(1 ms per token): the shortest waiting prompt goes first, a request waits for the worker holding
its prefix until ``affinity_wait_s``, a client that leaves gives up its place, and requests of a
model whose last worker goes away get 503. ``kv_aware`` makes no TTFT prediction, so with
``worker_prefills`` and ``holder_prefills`` 1 a worker is open only once its prefill has
produced a first byte: the orders asserted here do not depend on timing."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest

from conftest import Proc, free_ports, kvroute_argv, metric, serve_gateway, wait_http, wait_until
from router.config.schema import WorkerConfig
from router.route.dispatch_queue import Reservation
from router.workers.registry import WorkerRegistration

BLOCK = 32
ADMIN = {"authorization": "Bearer queue-admin"}
LONG_WORDS = 1500  # 4,200 tokens with one-letter tags: about 4 s of prefill at 1 ms per token


def test_prefill_left_counts_predicted_ends_and_reservations():
    reg = WorkerRegistration(WorkerConfig(id="w0", url="http://127.0.0.1:1", model="m"))
    assert reg.prefill_left_ms(time.monotonic()) == 0.0
    a = reg.begin(100, predicted_ttft_ms=500.0)
    now = a.dispatch_s
    assert reg.prefill_left_ms(now) == pytest.approx(500.0)
    assert reg.prefill_left_ms(now + 0.2) == pytest.approx(300.0)
    assert reg.prefill_left_ms(now + 1.0) == float("inf")  # overdue: closed until its first byte
    opened = []
    hold = Reservation(reg, now + 2.0, lambda: opened.append(1), now + 0.1)
    assert reg.prefill_left_ms(now) == pytest.approx(2000.0)
    assert reg.prefills_pending() == 2 and reg.newest_pending_s() == now + 0.1  # held after a was sent
    hold.release()
    hold.release()
    assert opened == [1] and reg.prefill_left_ms(now) == pytest.approx(500.0)
    b = reg.begin(50)  # no prediction: the worker stays closed until its first byte
    assert reg.prefill_left_ms(now) == float("inf")
    reg.on_prefill_done = lambda: opened.append(2)
    b.first_byte()
    assert reg.prefill_left_ms(now) == pytest.approx(500.0) and opened == [1, 2]
    a.finish()  # ended before any first byte (an error answer)
    assert reg.prefill_left_ms(now) == 0.0 and reg.prefill_tokens == 0 and opened == [1, 2, 2]


def _prompt(tag: str, words: int) -> str:
    return " ".join(f"{tag}{i % 50}" for i in range(words))


def _body(content: str, max_tokens: int = 2) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True}


async def _first_chunk(client: httpx.AsyncClient, base: str, body: dict, seen: list[str], tag: str) -> str:
    """Stream ``body``; append ``tag`` to ``seen`` when the first content bytes arrive; returns the
    worker that answered."""
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for _ in resp.aiter_bytes():
            if tag not in seen:
                seen.append(tag)
        return resp.headers["x-kvroute-worker"]


async def _wait_metric(base: str, name: str, value: float) -> None:
    deadline = time.monotonic() + 30
    while (got := await asyncio.to_thread(metric, base, name)) != value:
        assert time.monotonic() < deadline, f"{name} = {got}, want {value}"
        await asyncio.sleep(0.05)


def _queue_policy(affinity_wait_s: float) -> dict:
    return {"name": "kv_aware", "queue": {"enabled": True, "worker_prefills": 1, "holder_prefills": 1,
                                          "affinity": "holder", "affinity_wait_s": affinity_wait_s}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    """Two slow sims; gateway ``one`` routes to w0 only, gateway ``two`` to both."""
    log_dir: Path = tmp_path_factory.mktemp("dispatch_queue")
    started: list[Proc] = []
    try:
        p0, p1, g1, g2 = free_ports(4)
        sims = {}
        for name, port in (("w0", p0), ("w1", p1)):
            proc = Proc(name, kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny",
                                           "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK),
                                           "--num-gpu-blocks-override", "2048", "--max-model-len", "16384",
                                           "--prefill-overhead-ms", "0", "--prefill-ms-per-token", "1",
                                           "--seed", "3"), log_dir)
            started.append(proc)
            sims[name] = (f"http://127.0.0.1:{port}", proc)
        for url, proc in sims.values():
            wait_http(url + "/health", proc, timeout_s=180)
        bases = {}
        for label, port, ids in (("one", g1, ["w0"]), ("two", g2, ["w0", "w1"])):
            cfg = {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"token_env": "KVR_QUEUE_ADMIN"},
                   "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
                   "workers": [{"id": i, "url": sims[i][0], "model": "tiny"} for i in ids],
                   "load_scrape": {"enabled": False}, "policy": _queue_policy(30.0)}

            os.environ["KVR_QUEUE_ADMIN"] = "queue-admin"
            bases[label], _, _ = serve_gateway(cfg, log_dir, started, name=f"gateway-{label}")
        yield bases
    finally:
        for p in reversed(started):
            p.stop()


def _prefilling(base: str, worker: str) -> bool:
    workers = httpx.get(base + "/admin/workers", headers=ADMIN, timeout=10).json()["workers"]
    return next(w for w in workers if w["id"] == worker)["prefill_tokens"] > 0


async def test_shortest_waiting_prompt_goes_first(cluster):
    base = cluster["one"]
    seen: list[str] = []
    async with httpx.AsyncClient(timeout=120) as client:
        a = asyncio.create_task(_first_chunk(client, base, _body(_prompt("a", LONG_WORDS)), seen, "a"))
        await asyncio.to_thread(wait_until, lambda: _prefilling(base, "w0"), 30, "a dispatched")
        b = asyncio.create_task(_first_chunk(client, base, _body(_prompt("b", LONG_WORDS)), seen, "b"))
        await _wait_metric(base, "kvroute_dispatch_queue_queued", 1)
        c = asyncio.create_task(_first_chunk(client, base, _body(_prompt("c", 5)), seen, "c"))
        await _wait_metric(base, "kvroute_dispatch_queue_queued", 2)
        assert seen == []  # both wait in the gateway while a prefills
        await asyncio.gather(a, b, c)
    assert seen == ["a", "c", "b"]  # c came last but is shortest
    assert await asyncio.to_thread(metric, base, "kvroute_dispatch_queue_queued") == 0


async def test_waits_for_the_prefix_holder_until_affinity_wait(cluster):
    base = cluster["two"]
    shared = _prompt("s", 600)
    async with httpx.AsyncClient(timeout=120) as client:
        home = await _first_chunk(client, base, _body(shared), [], "warm")
        other = "w1" if home == "w0" else "w0"
        for affinity_wait_s, want in ((30.0, home), (0.0, other)):
            put = await client.put(base + "/admin/policy", json=_queue_policy(affinity_wait_s), headers=ADMIN)
            assert put.status_code == 200 and put.json()["queue"]["affinity_wait_s"] == affinity_wait_s
            # a long prompt on the shared prefix goes home and keeps it prefilling (its own words
            # each round: the same prompt again would be cached there, its prefill over at once)
            own = _prompt(f"l{int(affinity_wait_s)}x", LONG_WORDS // 2)  # longer tags: about 5 s
            long = asyncio.create_task(_first_chunk(client, base, _body(shared + " " + own), [], "long"))
            await asyncio.to_thread(wait_until, lambda: _prefilling(base, home), 30, "long dispatched")
            follow_up = await _first_chunk(client, base, _body(shared + " one more"), [], "follow")
            assert follow_up == want, (affinity_wait_s, home)
            assert await long == home


async def test_client_that_leaves_gives_up_its_place(cluster):
    base = cluster["one"]
    async with httpx.AsyncClient(timeout=120) as client:
        a = asyncio.create_task(_first_chunk(client, base, _body(_prompt("d", LONG_WORDS)), [], "a"))
        await asyncio.to_thread(wait_until, lambda: _prefilling(base, "w0"), 30, "a dispatched")
        gone = asyncio.create_task(_first_chunk(client, base, _body(_prompt("e", 20)), [], "gone"))
        await _wait_metric(base, "kvroute_dispatch_queue_queued", 1)
        gone.cancel()
        await _wait_metric(base, "kvroute_dispatch_queue_queued", 0)
        assert await a == "w0"
        assert await _first_chunk(client, base, _body(_prompt("f", 20)), [], "next") == "w0"


async def test_queued_requests_get_503_when_the_last_worker_goes(cluster):
    base = cluster["one"]
    async with httpx.AsyncClient(timeout=120) as client:
        a = asyncio.create_task(client.post(base + "/v1/chat/completions",
                                            json={**_body(_prompt("g", LONG_WORDS)), "stream": False}))
        await asyncio.to_thread(wait_until, lambda: _prefilling(base, "w0"), 30, "a dispatched")
        queued = asyncio.create_task(client.post(base + "/v1/chat/completions",
                                                 json={**_body(_prompt("h", 20)), "stream": False}))
        await _wait_metric(base, "kvroute_dispatch_queue_queued", 1)
        removed = await client.delete(base + "/admin/workers/w0", headers=ADMIN)
        assert removed.status_code == 200
        resp = await queued
        assert resp.status_code == 503 and resp.json()["error"]["type"]
        assert (await a).status_code == 200  # the one already sent still completes
