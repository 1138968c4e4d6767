"""Admission control through a real gateway (`kvroute serve`): with one slot per worker and one
place in the queue, a third request gets 429 with Retry-After at once; a client that leaves gives
its slot (or its place) to the next. The only worker never answers, so every request holds its
slot until its client leaves: nothing here depends on timing."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from conftest import Proc, free_ports, serve_gateway, wait_http

TESTS = Path(__file__).resolve().parents[1]
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_model) -> str:
    log_dir = tmp_path_factory.mktemp("overload")
    worker_port, gw_port = free_ports(2)
    started: list[Proc] = []
    try:
        worker = Proc("hang", [sys.executable, str(TESTS / "bad_worker.py"), "--port", str(worker_port),
                               "--mode", "hang"], log_dir)
        started.append(worker)
        wait_http(f"http://127.0.0.1:{worker_port}/health", worker, timeout_s=60)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": 32}],
               "workers": [{"id": "w0", "url": f"http://127.0.0.1:{worker_port}", "model": "tiny"}],
               "load_scrape": {"enabled": False}, "timeouts": {"first_byte_s": 300},
               "admission": {"max_in_flight_per_worker": 1, "max_queued": 1, "queue_timeout_s": 300}}
        base, _, _ = serve_gateway(cfg, log_dir, started)
        yield base
    finally:
        for p in reversed(started):
            p.stop()


async def _gauges(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    text = (await client.get(base + "/metrics")).text
    out = {}
    for line in text.splitlines():
        for name in ("kvroute_admission_in_flight", "kvroute_admission_queued",
                     'kvroute_admission_rejected_total{reason="queue_full"}'):
            if line.startswith(name + " "):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def _wait(client: httpx.AsyncClient, base: str, **want: float) -> dict[str, float]:
    """Poll the gauges until each ``kvroute_admission_<key>`` equals ``want[key]`` (20 s at most)."""
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        got = await _gauges(client, base)
        if all(got.get(f"kvroute_admission_{k}") == v for k, v in want.items()):
            return got
        assert asyncio.get_running_loop().time() < deadline, f"admission gauges {got}, want {want}"
        await asyncio.sleep(0.05)


async def test_full_gateway_answers_429_and_hands_slots_on(gateway):
    async with httpx.AsyncClient(timeout=300) as client, httpx.AsyncClient(timeout=300) as probe:
        first = asyncio.create_task(client.post(gateway + "/v1/chat/completions", json=BODY))
        await _wait(probe, gateway, in_flight=1, queued=0)
        second = asyncio.create_task(client.post(gateway + "/v1/chat/completions", json=BODY))
        before = await _wait(probe, gateway, in_flight=1, queued=1)
        third = await probe.post(gateway + "/v1/chat/completions", json=BODY)
        assert third.status_code == 429
        assert int(third.headers["retry-after"]) >= 1
        err = third.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "gateway_overloaded"
        after = await _gauges(probe, gateway)
        key = 'kvroute_admission_rejected_total{reason="queue_full"}'
        assert after[key] == before.get(key, 0.0) + 1
        second.cancel()  # a queued client leaves: its place is freed, the slot stays taken
        await _wait(probe, gateway, in_flight=1, queued=0)
        fourth = asyncio.create_task(client.post(gateway + "/v1/chat/completions", json=BODY))
        await _wait(probe, gateway, in_flight=1, queued=1)
        first.cancel()  # the admitted client leaves: the queued request takes the slot
        await _wait(probe, gateway, in_flight=1, queued=0)
        assert not fourth.done()  # admitted, now waiting on the worker
        fourth.cancel()
        await _wait(probe, gateway, in_flight=0, queued=0)
        for task in (first, second, fourth):
            with pytest.raises(asyncio.CancelledError):
                await task
