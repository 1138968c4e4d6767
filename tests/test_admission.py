"""Admission control (router.route.admission) on its own: slots, the FIFO queue, 429 with Retry-After,
cancelled waits, and slots that follow the routable workers."""
from __future__ import annotations

import asyncio

import pytest

from router.config.schema import AdmissionConfig
from router.errors import GatewayError
from router.route.admission import Admission
from router.telemetry.metrics import GatewayMetrics


def make(per_worker: int = 1, workers: list[int] | None = None, max_queued: int = 2,
         queue_timeout_s: float = 30.0) -> tuple[Admission, GatewayMetrics, list[int]]:
    count = workers if workers is not None else [2]
    metrics = GatewayMetrics(lambda: [])
    cfg = AdmissionConfig(max_in_flight_per_worker=per_worker, max_queued=max_queued, queue_timeout_s=queue_timeout_s)
    return Admission(cfg, lambda: count[0], metrics), metrics, count


def rejected(metrics: GatewayMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("kvroute_admission_rejected_total", {"reason": reason}) or 0.0


async def test_off_by_default_admits_everything():
    adm = Admission(AdmissionConfig(), lambda: 1, GatewayMetrics(lambda: []))
    stamps = [await adm.acquire() for _ in range(100)]
    assert adm.in_flight == 0 and adm.queued == 0 and len(stamps) == 100


async def test_slots_then_fifo_queue_then_429():
    adm, metrics, _ = make(per_worker=1, workers=[2], max_queued=2)
    first, second = await adm.acquire(), await adm.acquire()
    assert adm.in_flight == 2
    order: list[str] = []

    async def wait(name: str) -> float:
        t = await adm.acquire()
        order.append(name)
        return t

    third = asyncio.create_task(wait("third"))
    fourth = asyncio.create_task(wait("fourth"))
    await asyncio.sleep(0)  # both queued
    assert adm.queued == 2
    with pytest.raises(GatewayError) as full:
        await adm.acquire()
    err = full.value
    assert err.status == 429 and err.code == "gateway_overloaded" and err.type == "rate_limit_error"
    assert [k for k, _ in err.headers] == [b"retry-after"] and int(err.headers[0][1]) >= 1
    assert rejected(metrics, "queue_full") == 1
    adm.release(first)
    t3 = await third
    assert order == ["third"] and adm.in_flight == 2 and adm.queued == 1
    adm.release(second)
    t4 = await fourth
    assert order == ["third", "fourth"] and adm.queued == 0
    adm.release(t3)
    adm.release(t4)
    assert adm.in_flight == 0


async def test_wait_past_queue_timeout_is_429():
    adm, metrics, _ = make(per_worker=1, workers=[1], max_queued=5, queue_timeout_s=0.05)
    held = await adm.acquire()
    with pytest.raises(GatewayError) as late:
        await adm.acquire()
    assert late.value.status == 429 and rejected(metrics, "queue_timeout") == 1
    assert adm.queued == 0 and adm.in_flight == 1  # the late one left no trace
    adm.release(held)
    assert adm.in_flight == 0


async def test_cancelled_wait_gives_its_place_up():
    adm, _, _ = make(per_worker=1, workers=[1], max_queued=5)
    held = await adm.acquire()
    gone = asyncio.create_task(adm.acquire())
    stays = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    assert adm.queued == 2
    gone.cancel()  # its client disconnected
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert adm.queued == 1
    adm.release(held)
    await stays  # the slot went to the one still waiting
    assert adm.in_flight == 1 and adm.queued == 0


async def test_slots_follow_the_routable_workers():
    adm, _, workers = make(per_worker=2, workers=[1], max_queued=10)
    a, b = await adm.acquire(), await adm.acquire()
    waiting = [asyncio.create_task(adm.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    assert adm.queued == 3
    workers[0] = 2  # a worker came back: two more slots, handed out at the next admission or release
    adm.release(a)
    assert adm.in_flight == 4 and adm.queued == 0  # slots are handed over at once
    done, _ = await asyncio.wait(waiting, timeout=10)
    assert len(done) == 3
    workers[0] = 1  # and went again: no slot is handed out until in flight falls below 2
    for t in waiting:
        adm.release(await t)
    assert adm.in_flight == 1
    adm.release(b)
    assert adm.in_flight == 0
