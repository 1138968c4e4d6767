#!/usr/bin/env python3
"""The dispatch queue's look at the queue (``DispatchQueue.pump``) at N workers with K requests
waiting for busy prefix holders: the CPU one opening of a worker costs a saturated cluster.

In one process, on the real router pieces (the tiny test tokenizer, the memory index, the
registry, the ``ttft`` policy with its default queue: ``affinity: policy``, one request before its
first byte per worker, two for a prefix holder):

- ``--workers`` workers, each busy with two requests before their first byte and no TTFT
  prediction (closed, holder or not);
- ``--waiting`` chat requests of ~600 words, each of a conversation whose prompt worker ``w<i>``
  holds in the index (its gpu tier), queued with ``take_turn``;
- ``--openings`` times: a worker that holds none of them gets the first byte of both its
  requests (it opens) and the pump runs. Each waiting request is decided again
  (``DispatchQueue._decide``: over every worker at its first look, then over those that changed
  since, its holder and the opened worker); each prefers its busy holder, so none leaves and the
  worker is made busy again for the next opening.

Prints the pump's wall time per opening (median and largest) in milliseconds, per waiting request
and in all, how many requests left the queue (0: each waited for its holder), and how many of the
queue's decisions scored every worker and how many only the changed ones
(``kvroute_dispatch_queue_decisions_total``). In-process: no sockets.

``--fresh N`` measures instead what a request pays on its way through an empty queue: ``N``
short chats, each planned over idle workers (``Router.plan``) then given its turn
(``take_turn`` with ``fresh=True``, sent at once by the decision it arrived with); median
microseconds of each, and how many kept their decision.

    .venv/bin/python benchmarks/bench_queue_scale.py [--workers 1024] [--waiting 1,8,32] [--openings 20]
    .venv/bin/python benchmarks/bench_queue_scale.py --fresh 300 --workers 8,256,1024
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from kvcore.index.memory import MemoryIndex  # noqa: E402
from router.config.schema import ModelConfig, RoutingConfig, WorkerConfig  # noqa: E402
from router.route.dispatch_queue import DispatchQueue  # noqa: E402
from router.route.planner import PolicyHolder, Router  # noqa: E402
from router.route.prompt_blocks import TokenizerPool  # noqa: E402
from router.telemetry.metrics import GatewayMetrics  # noqa: E402
from router.workers.registry import WorkerRegistry  # noqa: E402

TINY = ROOT / "tests/fixtures/tiny-model"
BLOCK_SIZE = 16


async def _gateway(workers: int) -> tuple[TokenizerPool, WorkerRegistry, MemoryIndex, Router, DispatchQueue,
                                          GatewayMetrics]:
    """One gateway's routing pieces over ``workers`` healthy workers (``w0``...), the ``ttft``
    policy with its default queue; the tokenizer pool loaded (close it when done)."""
    model = ModelConfig(name="tiny", tokenizer=str(TINY), block_size=BLOCK_SIZE)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    registry = WorkerRegistry()
    for i in range(workers):
        registry.add(WorkerConfig(id=f"w{i}", url=f"http://127.0.0.1:1/w{i}", model="tiny")).healthy = True
    holder = PolicyHolder({"name": "ttft"})
    metrics = GatewayMetrics(registry.all)
    index = MemoryIndex()
    router = Router([model], pool, index, registry, holder, metrics, RoutingConfig())
    return pool, registry, index, router, DispatchQueue(router, registry, metrics, lambda: holder.policy.queue), metrics


async def measure(workers: int, waiting: int, openings: int) -> dict[str, float]:
    """One cell of the module docstring; ``pump_ms`` median and max, and how many requests left
    the queue (0 expected: each waits for its holder)."""
    if not 0 < waiting < workers:
        raise ValueError("need 0 < waiting < workers")
    pool, registry, index, router, queue, metrics = await _gateway(workers)
    busy = {r.id: [r.begin(500), r.begin(500)] for r in registry.all()}  # past holder_prefills (2) too
    tasks = []
    try:
        for c in range(waiting):
            body = {"model": "tiny", "messages": [{"role": "user", "content": " ".join(f"c{c}w{i}" for i in range(600))}]}
            raw = orjson.dumps(body)
            plan = await router.plan("chat", body, [], raw)
            await index.store(f"w{c}", "gpu", list(plan.blocks.first_keys))
            plan = await router.plan("chat", body, [], raw)  # now it sees its holder
            tasks.append(asyncio.create_task(queue.take_turn(plan)))
        for _ in range(50):
            await asyncio.sleep(0.01)
            if queue.queued == waiting:
                break
        if queue.queued != waiting:
            raise RuntimeError(f"{queue.queued} of {waiting} requests queued")
        times_s = []
        for j in range(openings):
            reg = registry.get(f"w{workers - 1 - j % (workers - waiting)}")
            for handle in busy[reg.id]:
                handle.first_byte()
            t0 = time.perf_counter()
            queue.pump()
            times_s.append(time.perf_counter() - t0)
            for handle in busy[reg.id]:
                handle.finish()
            busy[reg.id] = [reg.begin(500), reg.begin(500)]
            await asyncio.sleep(0)
        decisions = metrics.dispatch_queue_decisions
        return {"pump_ms": statistics.median(times_s) * 1e3, "pump_max_ms": max(times_s) * 1e3,
                "left": waiting - queue.queued, "all_workers": decisions.labels("all_workers").value,
                "changed_workers": decisions.labels("changed_workers").value}
    finally:
        queue.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pool.close()


async def measure_fresh(workers: int, requests: int) -> dict[str, float]:
    """A fresh request at an empty queue over ``workers`` idle workers (``--fresh``): median
    microseconds of ``Router.plan`` (a short chat, a different one each time) and of
    ``DispatchQueue.take_turn`` with ``fresh=True`` (sent at once: the decision kept, the chosen
    worker open), and how many were sent by the decision they arrived with (all, expected)."""
    pool, _, _, router, queue, _ = await _gateway(workers)
    plan_s, turn_s, kept = [], [], 0
    try:
        for c in range(requests):
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"hello {c}, how are you?"}]}
            raw = orjson.dumps(body)
            t0 = time.perf_counter()
            plan = await router.plan("chat", body, [], raw)
            t1 = time.perf_counter()
            sent, reservation = await queue.take_turn(plan, fresh=True)
            turn_s.append(time.perf_counter() - t1)
            plan_s.append(t1 - t0)
            kept += sent is plan
            reservation.release()
    finally:
        queue.close()
        pool.close()
    return {"plan_us": statistics.median(plan_s) * 1e6, "take_turn_us": statistics.median(turn_s) * 1e6,
            "kept": kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1024", help="comma-separated worker counts")
    ap.add_argument("--waiting", default="1,8,32", help="comma-separated counts of waiting requests")
    ap.add_argument("--openings", type=int, default=20)
    ap.add_argument("--fresh", type=int, default=0, metavar="REQUESTS",
                    help="instead: REQUESTS fresh requests at an empty queue over idle workers")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    if args.fresh:
        print(f"{'workers':>8} {'requests':>9} {'plan us p50':>12} {'take_turn us p50':>17} {'kept':>5}")
        for workers in counts:
            got = asyncio.run(measure_fresh(workers, args.fresh))
            print(f"{workers:>8} {args.fresh:>9} {got['plan_us']:12.1f} {got['take_turn_us']:17.1f} {got['kept']:>5}")
        return
    print(f"{'workers':>8} {'waiting':>8} {'pump ms p50':>12} {'max':>8} {'per waiting ms':>15} {'left':>5}"
          f" {'decisions: all':>15} {'changed only':>13}")
    for workers in counts:
        for waiting in (int(x) for x in args.waiting.split(",")):
            got = asyncio.run(measure(workers, waiting, args.openings))
            print(f"{workers:>8} {waiting:>8} {got['pump_ms']:12.2f} {got['pump_max_ms']:8.2f} {got['pump_ms'] / waiting:15.2f}"
                  f" {got['left']:>5} {got['all_workers']:15.0f} {got['changed_workers']:13.0f}")


if __name__ == "__main__":
    main()
