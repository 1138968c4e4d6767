"""The dispatch queue's rules in one process, on the real router pieces (tokenizer, memory
index, registry, policies) with a clock the test moves: shortest prefill first, ``max_wait_s``
first of all, the ``holder`` and ``policy`` affinity rules, and 503 once no worker is left.
Workers here are busy through requests counted in flight without a TTFT prediction
(``kv_aware`` makes none); with ``worker_prefills: 1`` each stays closed until the test gives
that request its first byte (the default; then 2, one request waiting behind it, and a prefix
holder's second slot, ``holder_prefills``)."""
from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from kvcore.index.memory import MemoryIndex
from router.config.schema import ModelConfig, RoutingConfig, WorkerConfig
from router.errors import GatewayError
from router.route.dispatch_queue import DispatchQueue
from router.route.planner import PolicyHolder, Router
from router.route.prompt_blocks import TokenizerPool
from router.telemetry.metrics import GatewayMetrics
from router.workers.registry import WorkerRegistry

BLOCK = 32
SETTLED_S = 0.06  # past the default settle_ms (50): the requests just sent have reached their engine
ONE_AT_A_TIME = {"enabled": True, "worker_prefills": 1, "holder_prefills": 1}  # opens only at a first byte


class Clock:
    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


@pytest.fixture
async def rig(tiny_model):
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    registry = WorkerRegistry()
    for wid in ("w0", "w1"):
        registry.add(WorkerConfig(id=wid, url=f"http://127.0.0.1:1/{wid}", model="tiny")).healthy = True
    holder = PolicyHolder({"name": "kv_aware", "queue": {**ONE_AT_A_TIME, "affinity": "holder", "affinity_wait_s": 2,
                                                          "max_wait_s": 10}})
    metrics = GatewayMetrics(registry.all)
    index = MemoryIndex()
    router = Router([model], pool, index, registry, holder, metrics, RoutingConfig())
    clock = Clock()
    queue = DispatchQueue(router, registry, metrics, lambda: holder.policy.queue, clock=clock)
    yield router, registry, queue, clock, holder, index
    queue.close()
    pool.close()


def _body(words: int, tag: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": " ".join(f"{tag}{i}" for i in range(words))}]}


async def _plan(router: Router, body: dict):
    return await router.plan("chat", body, [], orjson.dumps(body))


async def _enqueue(queue: DispatchQueue, plan) -> asyncio.Task:
    task = asyncio.create_task(queue.take_turn(plan))
    await asyncio.sleep(0)
    return task


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_shortest_first_and_one_request_per_opening(rig):
    router, registry, queue, _, _, _ = rig
    registry.get("w1").healthy = False
    busy = registry.get("w0").begin(500)
    long = await _enqueue(queue, await _plan(router, _body(400, "l")))
    short = await _enqueue(queue, await _plan(router, _body(10, "s")))
    assert queue.queued == 2 and not long.done() and not short.done()
    busy.first_byte()  # w0 opens: the short one goes, and its reservation closes w0 again
    await _settle()
    assert short.done() and not long.done() and queue.queued == 1
    plan, reservation = short.result()
    assert plan.decision.worker_id == "w0"
    reservation.release()  # counted in flight (here: given up): w0 opens for the next
    await _settle()
    assert long.done() and long.result()[0].decision.worker_id == "w0" and queue.queued == 0


async def test_a_request_past_max_wait_goes_before_shorter_ones(rig):
    router, registry, queue, clock, _, _ = rig
    registry.get("w1").healthy = False
    busy = registry.get("w0").begin(500)
    long = await _enqueue(queue, await _plan(router, _body(400, "l")))
    clock.offset_s += 11.0  # past max_wait_s (10)
    short = await _enqueue(queue, await _plan(router, _body(10, "s")))
    busy.first_byte()
    await _settle()
    assert long.done() and not short.done()


async def test_holder_affinity_waits_for_the_holder_then_gives_up(rig):
    router, registry, queue, clock, _, index = rig
    warm = await _plan(router, _body(300, "p"))
    await index.store("w0", "gpu", warm.blocks.first_keys)  # w0 holds the prefix
    busy = registry.get("w0").begin(50)
    follow = await _enqueue(queue, await _plan(router, _body(300, "p") | {"max_tokens": 3}))
    fresh = await _enqueue(queue, await _plan(router, _body(300, "q")))
    await _settle()
    assert fresh.done() and fresh.result()[0].decision.worker_id == "w1"  # no holder: w1 is open
    assert not follow.done()  # w1 is open, but the holder is w0
    fresh.result()[1].release()
    clock.offset_s += 2.5  # past affinity_wait_s
    queue.pump()
    await _settle()
    assert follow.done() and follow.result()[0].decision.worker_id == "w1"
    busy.finish()


async def test_a_waiting_request_stops_waiting_for_a_holder_that_evicted_its_prefix(rig):
    router, registry, queue, _, holder, index = rig
    holder.replace({"name": "kv_aware", "queue": {**ONE_AT_A_TIME, "affinity": "holder", "affinity_wait_s": 30,
                                                  "rematch_ms": 50}})
    warm = await _plan(router, _body(300, "p"))
    await index.store("w0", "gpu", warm.blocks.first_keys)  # w0 holds the prefix
    busy = registry.get("w0").begin(50)
    follow = await _enqueue(queue, await _plan(router, _body(300, "p") | {"max_tokens": 3}))
    await _settle()
    assert not follow.done()  # w1 is open, but the holder is w0, for up to 30 s
    await index.remove("w0", "gpu", warm.blocks.first_keys)  # w0's KV events: evicted
    plan, reservation = await asyncio.wait_for(follow, 10)  # looked up again: nothing to wait for
    assert plan.decision.worker_id == "w1" and plan.matches.get("w0") is None
    assert router.metrics.dispatch_queue_rematches.labels("lost").value == 1
    reservation.release()
    busy.finish()


async def test_lookups_again_turned_on_at_run_time_reach_the_requests_already_waiting(rig):
    router, registry, queue, _, holder, index = rig
    queue_cfg = {**ONE_AT_A_TIME, "affinity": "holder", "affinity_wait_s": 30}
    holder.replace({"name": "kv_aware", "queue": {**queue_cfg, "rematch_ms": 0}})
    warm = await _plan(router, _body(300, "p"))
    await index.store("w0", "gpu", warm.blocks.first_keys)
    busy = registry.get("w0").begin(50)
    follow = await _enqueue(queue, await _plan(router, _body(300, "p") | {"max_tokens": 3}))
    await index.remove("w0", "gpu", warm.blocks.first_keys)
    holder.replace({"name": "kv_aware", "queue": {**queue_cfg, "rematch_ms": 50}})  # the queue's tick sees it
    plan, reservation = await asyncio.wait_for(follow, 10)
    assert plan.decision.worker_id == "w1"
    reservation.release()
    busy.finish()


async def test_requests_sharing_a_prefix_follow_the_first_one_dispatched(rig):
    router, registry, queue, _, holder, index = rig
    holder.replace({"name": "kv_aware", "queue": {**ONE_AT_A_TIME, "affinity": "holder", "affinity_wait_s": 30,
                                                  "rematch_ms": 50}})
    busy = {wid: registry.get(wid).begin(50) for wid in ("w0", "w1")}
    document = " ".join(f"d{i}" for i in range(300))
    ask = {"model": "tiny", "messages": [{"role": "user", "content": document + " Summarise it."}]}
    asked = await _plan(router, ask)
    second = await _enqueue(queue, asked)
    await _settle()
    assert not second.done()  # both busy; nobody holds the document yet
    # the first request on the document went to w1 meanwhile: the gateway's speculative entries
    first = await _plan(router, {"model": "tiny", "messages": [{"role": "user", "content": document + " Translate it."}]})
    shared = next(i for i, (a, b) in enumerate(zip(first.blocks.first_keys, asked.blocks.first_keys)) if a != b)
    assert shared >= 20  # the document's blocks
    await router.commit(first, registry.get("w1"))
    deadline = time.monotonic() + 10
    while router.metrics.dispatch_queue_rematches.labels("gained").value < 1:
        assert time.monotonic() < deadline, "the waiting request was never looked up again"
        await asyncio.sleep(0.01)
    busy["w0"].first_byte()  # w0 opens first, but w1 now holds the document
    queue.pump()
    await _settle()
    assert not second.done()
    busy["w1"].first_byte()
    plan, reservation = await asyncio.wait_for(second, 10)
    assert plan.decision.worker_id == "w1" and plan.matches["w1"].total == shared
    reservation.release()
    for handle in busy.values():
        handle.finish()


async def test_policy_affinity_waits_only_while_the_policy_prefers_the_busy_holder(rig):
    router, registry, queue, _, holder, index = rig
    holder.replace({"name": "kv_aware", "queue": {**ONE_AT_A_TIME, "affinity": "policy", "affinity_wait_s": 30}})
    body = _body(300, "p")
    warm = await _plan(router, body)
    await index.store("w0", "gpu", warm.blocks.first_keys)
    light = registry.get("w0").begin(50)  # a little queued ahead: the holder is still cheaper
    follow = await _enqueue(queue, await _plan(router, body))
    await _settle()
    assert not follow.done()
    heavy = registry.get("w0").begin(1_000_000)  # now recomputing on w1 costs less than waiting
    queue.pump()
    await _settle()
    assert follow.done() and follow.result()[0].decision.worker_id == "w1"
    light.finish()
    heavy.finish()


async def test_waiting_requests_get_503_when_no_worker_is_left(rig):
    router, registry, queue, _, _, _ = rig
    registry.get("w1").healthy = False
    registry.get("w0").begin(500)
    waiting = await _enqueue(queue, await _plan(router, _body(10, "s")))
    registry.get("w0").healthy = False
    queue.pump()
    await _settle()
    with pytest.raises(GatewayError) as err:
        await waiting
    assert err.value.status == 503 and queue.queued == 0


async def test_queue_off_returns_the_plan_untouched(rig):
    router, registry, queue, _, holder, _ = rig
    holder.replace({"name": "kv_aware"})
    registry.get("w0").begin(500)
    plan = await _plan(router, _body(10, "s"))
    assert await queue.take_turn(plan) == (plan, None)


async def test_policy_affinity_counts_the_requests_already_waiting_for_a_worker(rig):
    router, registry, queue, _, holder, index = rig
    holder.replace({"name": "kv_aware", "queue": {**ONE_AT_A_TIME, "affinity": "policy", "affinity_wait_s": 30}})
    shared = _body(300, "p")
    await index.store("w0", "gpu", (await _plan(router, shared)).blocks.first_keys)
    busy = registry.get("w0").begin(50)
    follow_ups = []
    for i in range(12):
        body = {**shared, "messages": [{"role": "user", "content": shared["messages"][0]["content"]
                                        + " " + " ".join(f"x{i}y{j}" for j in range(80))}]}
        follow_ups.append(await _enqueue(queue, await _plan(router, body)))
    await _settle()
    # alone, each would wait for w0 (see the test above); behind the others waiting for it, the
    # last ones are cheaper on w1, which takes one (its reservation closes it again)
    done = [t for t in follow_ups if t.done()]
    assert len(done) == 1 and queue.queued == 11
    assert done[0].result()[0].decision.worker_id == "w1"
    busy.finish()


async def test_ttft_waits_longer_for_a_conversations_history_than_for_a_hot_prefix(rig):
    """``ttft`` sets a follow-up's wait: ``private_affinity_wait_s`` (6 here) while the holder's
    prefix is private (no other recent request through it), the queue's ``affinity_wait_s`` (2)
    once it is hot (two requests sent through it: the router counts each sent request's block
    keys)."""
    router, registry, queue, clock, holder, index = rig
    holder.replace({"name": "ttft", "private_affinity_wait_s": 6,
                    "queue": {**ONE_AT_A_TIME, "affinity": "policy", "affinity_wait_s": 2}})
    body = _body(300, "p")
    warm = await _plan(router, body)
    await index.store("w0", "gpu", warm.blocks.first_keys)
    busy = registry.get("w0").begin(50)  # closed until its first byte; still the cheaper place
    plan = await _plan(router, body)
    assert (plan.decision.worker_id, plan.decision.affinity_wait_s) == ("w0", 6)
    follow = await _enqueue(queue, plan)
    clock.offset_s += 2.5  # past the queue's wait, not the private one
    queue.pump()
    await _settle()
    assert not follow.done()
    clock.offset_s += 4.0  # past 6 s: any open worker
    queue.pump()
    await _settle()
    assert follow.done() and follow.result()[0].decision.worker_id == "w1"
    follow.result()[1].release()
    assert router.prefix_uses.uses(warm.blocks.first_keys[-1]) == 0  # routed here, never committed
    for _ in range(2):  # two other requests are sent through the prefix (to w0): it is hot now
        other = await _plan(router, body)
        await router.commit(other, registry.get("w0"))
    assert router.prefix_uses.uses(warm.blocks.first_keys[-1]) == 2
    plan = await _plan(router, body)
    assert (plan.decision.worker_id, plan.decision.affinity_wait_s) == ("w0", None)
    hot = await _enqueue(queue, plan)
    await _settle()
    assert not hot.done()
    clock.offset_s += 2.5
    queue.pump()
    await _settle()
    assert hot.done() and hot.result()[0].decision.worker_id == "w1"
    hot.result()[1].release()
    busy.finish()


async def test_two_prefills_per_worker_keep_one_request_waiting_in_the_engine(rig):
    """``worker_prefills: 2``: a worker with one request before its first byte is still open
    (the next one waits in the engine, ready to follow at once); with two it is closed until one
    of them has its first byte. Reservations count as requests on their way."""
    router, registry, queue, clock, holder, _ = rig
    holder.replace({"name": "kv_aware", "queue": {"enabled": True, "affinity": "holder", "worker_prefills": 2}})
    registry.get("w1").healthy = False
    w0 = registry.get("w0")
    first = w0.begin(500)
    clock.offset_s += SETTLED_S
    second = await _enqueue(queue, await _plan(router, _body(10, "a")))
    await _settle()
    assert second.done() and second.result()[0].decision.worker_id == "w0"  # one ahead: open
    third = await _enqueue(queue, await _plan(router, _body(10, "b")))
    await _settle()
    assert not third.done() and w0.prefills_pending() == 2  # the request and the reservation
    second.result()[1].release()  # the second is counted in flight in its place...
    second_in_flight = w0.begin(10)
    clock.offset_s += SETTLED_S
    queue.pump()
    await _settle()
    assert not third.done() and w0.prefills_pending() == 2  # ...still two before a first byte
    first.first_byte()  # the first one's prefill is done: one left, the worker opens
    await _settle()
    assert third.done() and third.result()[0].decision.worker_id == "w0" and queue.queued == 0
    third.result()[1].release()
    first.finish()
    second_in_flight.finish()


async def _w0_holds_a_history(rig, worker_prefills: int, holder_prefills: int):
    """Sets the queue's limits (``affinity: holder``, 30 s) and stores a 300-word history's
    blocks on w0 only; returns w0, w1 and that history's body."""
    router, registry, _, _, holder, index = rig
    holder.replace({"name": "kv_aware", "queue": {"enabled": True, "worker_prefills": worker_prefills,
                                                  "holder_prefills": holder_prefills, "affinity": "holder",
                                                  "affinity_wait_s": 30}})
    history = _body(300, "h")
    await index.store("w0", "gpu", (await _plan(router, history)).blocks.first_keys)
    return registry.get("w0"), registry.get("w1"), history


async def test_a_prefix_holder_takes_one_more_of_its_own_requests(rig):
    """``worker_prefills: 1, holder_prefills: 2``: a worker with one request before its first
    byte is closed to a prompt it holds nothing of, but still open to a follow-up of a prefix it
    holds (more than the other worker), which waits in its engine; a prefix both hold sets no
    worker apart."""
    router, _, queue, clock, _, index = rig
    w0, w1, history = await _w0_holds_a_history(rig, worker_prefills=1, holder_prefills=2)
    both = _body(300, "b")
    keys = (await _plan(router, both)).blocks.first_keys
    await index.store("w0", "gpu", keys)
    await index.store("w1", "gpu", keys)
    first0, first1 = w0.begin(500), w1.begin(500)
    clock.offset_s += SETTLED_S
    fresh = await _enqueue(queue, await _plan(router, _body(10, "f")))
    shared = await _enqueue(queue, await _plan(router, both))
    follow = await _enqueue(queue, await _plan(router, history))
    await _settle()
    assert not fresh.done() and not shared.done()  # one before its first byte on each: closed to these
    assert follow.done() and follow.result()[0].decision.worker_id == "w0"  # the holder's second slot
    follow.result()[1].release()
    follow_in_flight = w0.begin(20)
    first1.first_byte()  # w1 opens: the shorter waiting prefill (shared's, cached) goes first
    await _settle()
    assert shared.done() and shared.result()[0].decision.worker_id == "w1" and not fresh.done()
    shared.result()[1].release()
    for handle in (first0, first1, follow_in_flight):
        handle.finish()
    queue.pump()
    await _settle()
    assert fresh.done()
    fresh.result()[1].release()


async def test_a_prefix_holder_takes_its_own_requests_up_to_holder_prefills(rig):
    """``worker_prefills: 2, holder_prefills: 4``: with three requests before their first byte a
    worker is closed to a fresh prompt but open to a follow-up of the prefix it holds; with four
    it is closed to that follow-up too."""
    router, _, queue, clock, _, _ = rig
    w0, w1, history = await _w0_holds_a_history(rig, worker_prefills=2, holder_prefills=4)
    pending = [w0.begin(500) for _ in range(3)] + [w1.begin(500) for _ in range(2)]
    clock.offset_s += SETTLED_S
    fresh = await _enqueue(queue, await _plan(router, _body(10, "f")))
    follow = await _enqueue(queue, await _plan(router, history))
    await _settle()
    assert not fresh.done()  # 3 and 2 before their first byte: both closed to a prompt they hold nothing of
    assert follow.done() and follow.result()[0].decision.worker_id == "w0"  # the holder's fourth slot
    follow.result()[1].release()
    pending.append(w0.begin(20))
    clock.offset_s += SETTLED_S
    again = await _enqueue(queue, await _plan(router, history))
    await _settle()
    assert w0.prefills_pending() == 4 and not again.done()  # the holder is full: the follow-up waits
    pending[0].first_byte()  # w0 is down to 3: open to its follow-up, still closed to the fresh prompt
    await _settle()
    assert again.done() and again.result()[0].decision.worker_id == "w0" and not fresh.done()
    again.result()[1].release()
    for handle in pending:
        handle.finish()
    queue.pump()
    await _settle()
    assert fresh.done()
    fresh.result()[1].release()


async def test_ttft_default_opens_a_worker_when_its_prefill_has_50_ms_left(rig):
    """``ttft``'s default queue (``worker_prefills: 1, worker_queue_ms: 50``): a worker with one
    request in prefill stays closed until that prefill is predicted to end within 50 ms, then
    takes the next request (so the engine does not idle while it crosses the gateway); past the
    predicted end without a first byte it is closed again until that byte comes."""
    router, registry, queue, clock, holder, _ = rig
    holder.replace({"name": "ttft"})
    assert (holder.policy.queue.worker_prefills, holder.policy.queue.worker_queue_ms) == (1, 50.0)
    registry.get("w1").healthy = False
    busy = registry.get("w0").begin(500, predicted_ttft_ms=2000.0)
    first = await _enqueue(queue, await _plan(router, _body(10, "a")))
    clock.offset_s += 1.0  # 1,000 ms of prefill left
    queue.pump()
    await _settle()
    assert not first.done() and queue.queued == 1
    clock.offset_s += 0.97  # 30 ms left
    queue.pump()
    await _settle()
    assert first.done() and first.result()[0].decision.worker_id == "w0"
    handle = registry.get("w0").begin(20, predicted_ttft_ms=60.0)  # the request sent
    first.result()[1].release()
    second = await _enqueue(queue, await _plan(router, _body(10, "b")))
    clock.offset_s += 0.5  # both past their predicted first bytes: closed until a byte comes
    queue.pump()
    await _settle()
    assert not second.done()
    busy.first_byte()
    handle.first_byte()
    await _settle()
    assert second.done() and second.result()[0].decision.worker_id == "w0"
    second.result()[1].release()


async def test_a_worker_takes_no_request_until_the_last_one_sent_there_has_settled(rig):
    """``settle_ms`` (50): a request sent less than 50 ms ago may not have reached its engine,
    so the next one could arrive first (and the first would wait out its prefill) or join it in
    one engine step (and the first would wait out its chunk). A worker whose last request was
    sent that recently is closed, even when a second request could follow (here
    ``worker_prefills: 2``; the same for ``worker_queue_ms`` or a holder's second slot); the
    same holds for a place the queue has just reserved, so one pump never sends two requests to
    one worker."""
    router, registry, queue, clock, holder, _ = rig
    holder.replace({"name": "ttft", "queue": {"worker_prefills": 2}})
    assert holder.policy.queue.settle_ms == 50.0
    registry.get("w1").healthy = False
    w0 = registry.get("w0")
    sent = w0.begin(20)
    follow = await _enqueue(queue, await _plan(router, _body(10, "a")))
    await _settle()
    assert not follow.done() and queue.queued == 1  # one before its first byte, but sent just now
    clock.offset_s += SETTLED_S
    queue.pump()
    await _settle()
    assert follow.done() and follow.result()[0].decision.worker_id == "w0"
    follow.result()[1].release()
    sent.finish()
    # two waiting requests, an idle worker: the first goes, and its fresh reservation keeps the
    # second back (in the same pump and after it) until it has settled
    first = await _enqueue(queue, await _plan(router, _body(10, "b")))
    second = await _enqueue(queue, await _plan(router, _body(10, "c")))
    await _settle()
    assert [first.done(), second.done()] == [True, False] and w0.prefills_pending() == 1
    plan, _ = await asyncio.wait_for(second, 10)  # the queue's timer looks again once it has settled
    assert plan.decision.worker_id == "w0"
    for task in (first, second):
        task.result()[1].release()


async def test_settle_ms_zero_lets_a_request_follow_at_once(rig):
    """With ``settle_ms: 0`` a second request follows the first at once (the behaviour before
    settling was added)."""
    router, registry, queue, _, holder, _ = rig
    holder.replace({"name": "ttft", "queue": {"worker_prefills": 2, "settle_ms": 0}})
    registry.get("w1").healthy = False
    sent = registry.get("w0").begin(20)
    follow = await _enqueue(queue, await _plan(router, _body(10, "a")))
    await _settle()
    assert follow.done() and follow.result()[0].decision.worker_id == "w0"
    follow.result()[1].release()
    sent.finish()


def _count_redecides(router: Router) -> list:
    calls: list = []
    real = router.redecide

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    router.redecide = counted  # type: ignore[method-assign]
    return calls


async def test_a_fresh_plan_keeps_its_decision_unless_the_queue_moved_before_it(rig):
    """take_turn(fresh=True): the plan was decided with nothing awaited since, so the first
    look keeps it; not when an entry before it was dispatched in that look, nor for a plan
    that is not fresh."""
    router, registry, queue, _, holder, _ = rig
    holder.replace({"name": "kv_aware", "queue": {"enabled": True, "worker_prefills": 2, "settle_ms": 0}})
    redecided = _count_redecides(router)
    plan = await _plan(router, _body(50, "a"))
    got, reservation = await queue.take_turn(plan, fresh=True)
    assert got is plan and redecided == []  # dispatched on the decision it came with
    reservation.release()
    plan = await _plan(router, _body(50, "b"))
    got, reservation = await queue.take_turn(plan)  # not fresh: chosen again
    assert got is not plan and redecided == [plan] and got.decision.worker_id == plan.decision.worker_id
    reservation.release()
    # a look that dispatches a waiting request before a fresh one has moved the queue: the fresh
    # one is chosen again
    registry.get("w1").healthy = False
    late = await _plan(router, _body(400, "d"))
    held = [await queue.take_turn(await _plan(router, _body(20, t)), fresh=True) for t in ("x", "y")]
    waiting = await _enqueue(queue, await _plan(router, _body(10, "c")))
    assert not waiting.done() and queue.queued == 1  # w0 has its two prefills (reserved)
    redecided.clear()
    for _, r in held:
        r.release()  # two openings; the looks this schedules run after the take_turn below
    got, reservation = await queue.take_turn(late, fresh=True)
    assert queue.queued == 0 and redecided[-1] is late and got is not late  # the waiting one went first
    reservation.release()
    (await waiting)[1].release()


async def test_round_robin_with_the_queue_takes_the_workers_in_turn(rig):
    """round_robin's choice advances its rotation: a fresh plan dispatched on its own decision
    is not chosen a second time, so two requests go to the two workers."""
    router, _, queue, _, holder, _ = rig
    holder.replace({"name": "round_robin", "queue": {"enabled": True, "worker_prefills": 4, "settle_ms": 0}})
    chosen = []
    for tag in ("x", "y", "z", "t"):
        body = _body(20, tag)
        plan, reservation = await queue.take_turn(await _plan(router, body), fresh=True)
        chosen.append(plan.decision.worker_id)
        reservation.release()
    assert chosen == ["w0", "w1", "w0", "w1"]
