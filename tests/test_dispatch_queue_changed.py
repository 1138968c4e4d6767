"""The dispatch queue re-scores, for a request already waiting for a worker, only that worker,
its prefix holders, the workers whose state changed since and those others wait for
(``DispatchQueue._decide``): it must decide exactly as scoring every worker does.

A seeded script drives two identical clusters of real router pieces (tiny tokenizer, memory
index, registry, ``ttft`` with its queue) with a clock the test sets: one queue decides over
every worker at every look (``full_redecide_s=0``), the other re-scores changed workers only.
Each step changes one thing (a worker opens, takes work, finishes, is scraped, learns a TTFT,
goes unhealthy or back, a request arrives or a dispatched one starts) and looks at the queue;
after each step both must have dispatched the same requests to the same workers, and each
waiting request must wait for the same worker. A fresh request at an empty queue, sent without
the look when its chosen worker is open to it (``DispatchQueue._at_once``), is checked the same
way against a twin that always looks."""
from __future__ import annotations

import asyncio
import contextlib
import random
import time

import orjson
import pytest

from kvcore.index.memory import MemoryIndex
from router.config.schema import ModelConfig, RoutingConfig, WorkerConfig
from router.policies.base import Policy
from router.route.dispatch_queue import DispatchQueue
from router.route.pd import DECODE_POLICY
from router.route.queue_look import WorkerHistory
from router.shared.load_table import OthersLoad
from router.route.planner import PolicyHolder, Router
from router.route.prompt_blocks import TokenizerPool
from router.telemetry.metrics import GatewayMetrics
from router.workers.registry import WorkerRegistry

BLOCK = 32
WORKERS = 12
CONVERSATIONS = 4  # conversation i holds its history on worker i (an even one also on i + 4, in part)
QUEUE = {"enabled": True, "worker_prefills": 1, "holder_prefills": 1, "settle_ms": 0, "rematch_ms": 0,
         "affinity": "policy", "affinity_wait_s": 600, "max_wait_s": 900}


class Cluster:
    """One gateway's router pieces over ``WORKERS`` workers, each busy with one unpredicted
    request (closed until its first byte), and a queue."""

    def __init__(self, pool: TokenizerPool, model: ModelConfig, full_redecide_s: float,
                 policy: Policy | None = None, queue: dict | None = None) -> None:
        self.policy = policy  # what re-chooses waiting requests (None: the live ttft)
        self.now_s = 1000.0
        self.registry = WorkerRegistry()
        for i in range(WORKERS):
            self.registry.add(WorkerConfig(id=f"w{i}", url=f"http://127.0.0.1:1/w{i}", model="tiny")).healthy = True
        holder = PolicyHolder({"name": "ttft", "queue": QUEUE if queue is None else queue})
        self.metrics = GatewayMetrics(self.registry.all)
        self.index = MemoryIndex()
        self.router = Router([model], pool, self.index, self.registry, holder, self.metrics, RoutingConfig())
        self.queue = DispatchQueue(self.router, self.registry, self.metrics, lambda: holder.policy.queue,
                                   clock=lambda: self.now_s, full_redecide_s=full_redecide_s)
        self.handles = {r.id: [r.begin(400)] for r in self.registry.all()}
        self.waiting: dict[str, asyncio.Task] = {}
        self.dispatched: dict[str, tuple[str, object]] = {}  # tag -> (worker, reservation)
        self.prefixes: list[list[int]] = []  # each conversation's block keys
        self.tags: dict[int, str] = {}  # id of a plan's request -> its tag
        self.fresh = False  # requests arrive as the gateway sends them (take_turn's ``fresh``)

    async def enqueue(self, tag: str, body: dict) -> None:
        plan = await self.router.plan("chat", body, [], orjson.dumps(body))
        self.tags[id(plan.request)] = tag
        fresh = self.fresh and self.policy is None
        self.waiting[tag] = asyncio.create_task(self.queue.take_turn(plan, policy=self.policy, fresh=fresh))
        await _settle()

    def outcome(self) -> tuple[dict[str, str], dict[str, str]]:
        """Where each dispatched request went, and which worker each waiting one waits for."""
        for tag, task in list(self.waiting.items()):
            if task.done():
                plan, reservation = task.result()
                self.dispatched[tag] = (plan.decision.worker_id, reservation)
                del self.waiting[tag]
        waits = {}
        for entry in self.queue._entries:
            if entry.choice is not None:
                waits[self.tags[id(entry.plan.request)]] = entry.choice.worker_id
        return {t: w for t, (w, _) in self.dispatched.items()}, waits

    def decisions(self, workers: str) -> float:
        return self.metrics.dispatch_queue_decisions.labels(workers).value

    async def close(self) -> None:
        self.queue.close()
        for task in self.waiting.values():
            task.cancel()
        await asyncio.gather(*self.waiting.values(), return_exceptions=True)


async def _settle() -> None:
    for _ in range(4):
        await asyncio.sleep(0)


def _body(tag: str, words: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": " ".join(f"{tag}{i}" for i in range(words))}]}


def _learn(cluster: Cluster, reg, rng: random.Random, samples: int) -> None:
    """``samples`` TTFTs of ``reg``, each worker at its own speed (1x-3x), so speed factors differ."""
    slope_ms = 0.01 * (1 + int(reg.id[1:]) % 3) * rng.uniform(0.8, 1.2)
    for _ in range(samples):
        work = rng.randrange(100, 4000)
        ttft_ms = 5.0 + work * slope_ms
        reg.prefill_rate.observe(work, ttft_ms)
        cluster.registry.model_rate("tiny").observe(work, ttft_ms)


async def _held_conversations(cluster: Cluster) -> None:
    """Each conversation's history held by its worker (an even one's also in part, in the cpu
    tier, by the worker ``CONVERSATIONS`` on)."""
    for owner in range(CONVERSATIONS):
        body = _body(f"conv{owner}", 600)
        plan = await cluster.router.plan("chat", body, [], orjson.dumps(body))
        keys = list(plan.blocks.first_keys)
        cluster.prefixes.append(keys)
        await cluster.index.store(f"w{owner}", "gpu", keys)
        if owner % 2 == 0:
            await cluster.index.store(f"w{owner + CONVERSATIONS}", "cpu", keys[: len(keys) // 2])


def _learned(clusters: list[Cluster], seed: int) -> list[random.Random]:
    """Every worker of each cluster has learned its speed, alike in each; one ``seed``ed
    generator per cluster, in the same state, to drive its steps."""
    rngs = [random.Random(seed) for _ in clusters]
    for cluster, rng in zip(clusters, rngs):
        for reg in cluster.registry.all():
            _learn(cluster, reg, rng, 64)
    return rngs


async def _step(cluster: Cluster, rng: random.Random, step: int) -> None:
    """One random change (drawn from ``rng``, so both clusters get the same), then a look."""
    regs = cluster.registry.all()
    reg = regs[rng.randrange(len(regs))]
    action = rng.choice(["open", "open", "open_many", "work", "finish", "scrape", "learn", "health", "health",
                         "arrive", "burst", "hot", "hot", "start", "start", "tick"])
    if action == "open":
        for handle in cluster.handles[reg.id]:
            handle.first_byte()
    elif action == "open_many":  # several openings in one look: later requests see earlier ones sent
        for other in rng.sample(regs, 4):
            for handle in cluster.handles[other.id]:
                handle.first_byte()
    elif action == "work":
        cluster.handles[reg.id].append(reg.begin(rng.randrange(0, 4000)))
    elif action == "finish" and cluster.handles[reg.id]:
        cluster.handles[reg.id].pop(0).finish()
    elif action == "scrape":
        reg.record_scrape(rng.randrange(0, 6), 0, rng.random())
    elif action == "learn":
        _learn(cluster, reg, rng, 8)
    elif action == "health":
        reg.healthy = not reg.healthy if rng.random() < 0.5 or not reg.healthy else reg.healthy
    elif action == "arrive":
        await cluster.enqueue(f"s{step}", _body(f"conv{rng.randrange(CONVERSATIONS)}", 200 + 40 * step % 400))
    elif action == "burst":  # follow-ups of one conversation: those behind wait behind the first
        owner = rng.randrange(CONVERSATIONS)
        for k in range(3):
            await cluster.enqueue(f"b{step}.{k}", _body(f"conv{owner}", 620 + 7 * k))
    elif action == "hot":  # a conversation's prefix turns hot (other requests went through it)
        keys = cluster.prefixes[rng.randrange(CONVERSATIONS)]
        for _ in range(3):
            cluster.router.prefix_uses.record(keys)
    elif action == "start" and cluster.dispatched:
        tag = sorted(cluster.dispatched)[rng.randrange(len(cluster.dispatched))]
        worker_id, reservation = cluster.dispatched[tag]
        if reservation is not None:
            reservation.release()
            cluster.dispatched[tag] = (worker_id, None)
    elif action == "tick":  # held places open as their predicted prefill runs out
        cluster.now_s += rng.uniform(0.02, 0.3)
    cluster.now_s += 0.01
    cluster.queue.pump()
    await _settle()


@pytest.mark.parametrize("seed, policy", [(1, None), (2, None), (3, None), (4, None), (5, None),
                                          (6, DECODE_POLICY), (7, DECODE_POLICY)])
async def test_changed_workers_only_decide_as_every_worker_does(tiny_model, seed, policy):
    """``policy``: None, the live ``ttft``; the P/D decode leg's (a whole request waiting for
    the decode pool)."""
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    clusters = [Cluster(pool, model, full_redecide_s=0.0, policy=policy),
                Cluster(pool, model, full_redecide_s=3600.0, policy=policy)]
    try:
        for cluster in clusters:
            await _held_conversations(cluster)
            for owner in range(CONVERSATIONS):
                await cluster.enqueue(f"c{owner}", _body(f"conv{owner}", 640))
        rngs = _learned(clusters, seed)
        waited = 0
        for step in range(300):
            for cluster, rng in zip(clusters, rngs):
                await _step(cluster, rng, step)
            full, short = (c.outcome() for c in clusters)
            assert short == full, f"step {step}"
            waited += len(full[1])
        assert waited > 100  # requests did wait for busy workers along the way
        assert clusters[0].decisions("changed_workers") == 0
        assert clusters[1].decisions("changed_workers") > clusters[1].decisions("all_workers")
    finally:
        for cluster in clusters:
            await cluster.close()
        pool.close()


@pytest.mark.parametrize("seed", [21, 22, 23])
async def test_a_fresh_request_at_an_empty_queue_goes_at_once_as_the_look_sends_it(tiny_model, seed):
    """A request fresh from the policy at an empty queue is sent without the look over every
    worker (``DispatchQueue._at_once``) when its chosen worker is open to it: every request must
    go where, and wait for what, the look would have sent it. One cluster takes that path, its
    twin always looks; both re-score changed workers only."""
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    queue = {**QUEUE, "holder_prefills": 2}  # a holder of the longest prefix takes a second request
    clusters = [Cluster(pool, model, 3600.0, queue=queue), Cluster(pool, model, 3600.0, queue=queue)]
    at_once = []
    fast = clusters[0].queue._at_once

    def counted(*args):
        got = fast(*args)
        at_once.append(got is not None)
        return got

    clusters[0].queue._at_once = counted
    clusters[1].queue._at_once = lambda *args: None  # the twin always takes the look
    try:
        for cluster in clusters:
            cluster.fresh = True
            await _held_conversations(cluster)
        rngs = _learned(clusters, seed)
        waited = 0
        for step in range(300):
            for cluster, rng in zip(clusters, rngs):
                await _step(cluster, rng, step)
                if step % 10 == 9:  # the cluster catches up: every request so far starts its prefill
                    _catch_up(cluster)
                    await _look(cluster)
            went, waits = clusters[0].outcome()
            assert (went, waits) == clusters[1].outcome(), f"step {step}"
            waited += len(waits)
        assert sum(at_once) >= 10 and not all(at_once)  # both ways were taken, and some waited
        assert waited >= 10
    finally:
        for cluster in clusters:
            await cluster.close()
        pool.close()


async def _one_fresh(tiny_model, queue: dict, holder_queued: int, change=None) -> tuple[Cluster, str]:
    """A cluster with ``queue``: w0 holds ``conv0``'s history with ``holder_queued`` prefill
    tokens before its first byte (besides its first request), every other worker open; a fresh
    follow-up planned, ``change(cluster, plan)`` applied, then its turn taken. Returns the
    cluster (closed) and the worker the policy chose."""
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    cluster = Cluster(pool, model, 3600.0, queue=queue)
    try:
        body = _body("conv0", 600)
        keys = list((await cluster.router.plan("chat", body, [], orjson.dumps(body))).blocks.first_keys)
        await cluster.index.store("w0", "gpu", keys)
        if holder_queued:
            cluster.handles["w0"].append(cluster.registry.get("w0").begin(holder_queued))
        for reg in cluster.registry.all()[1:]:
            for handle in cluster.handles[reg.id]:
                handle.first_byte()
        cluster.now_s = time.monotonic() + 1.0  # the queue's clock past the requests' starts (no settling)
        follow_up = _body("conv0", 640)
        plan = await cluster.router.plan("chat", follow_up, [], orjson.dumps(follow_up))
        cluster.tags[id(plan.request)] = "f"
        if change is not None:
            change(cluster, plan)
        cluster.waiting["f"] = asyncio.create_task(cluster.queue.take_turn(plan, fresh=True))
        await _settle()
        cluster.outcome()
        return cluster, plan.decision.worker_id
    finally:
        await cluster.close()
        pool.close()


async def test_a_holder_open_to_its_follow_up_takes_it_without_a_look(tiny_model):
    """w0 holds the conversation and has one request before its first byte: closed to others
    (``worker_prefills`` 1), open to a holder (``holder_prefills`` 2). The follow-up goes there
    at once: no look at the queue was taken (no worker history kept)."""
    cluster, chosen = await _one_fresh(tiny_model, {**QUEUE, "holder_prefills": 2}, 0)
    assert chosen == "w0"
    assert {t: w for t, (w, _) in cluster.dispatched.items()} == {"f": "w0"}
    assert cluster.queue._history == {}


async def test_under_affinity_holder_a_fresh_request_takes_the_look_and_waits_for_its_holder(tiny_model):
    """With ``affinity: holder`` the policy's choice does not stand within the affinity wait:
    the policy prefers an open worker to w0's long queue, yet the request waits for w0."""
    cluster, chosen = await _one_fresh(tiny_model, {**QUEUE, "affinity": "holder"}, 200_000)
    assert chosen != "w0"
    assert cluster.dispatched == {} and list(cluster.waiting) == ["f"]


async def test_a_fresh_plan_whose_worker_went_unhealthy_is_decided_again(tiny_model):
    """The chosen worker turned unroutable after the decision: the look decides again, among
    the workers still routable."""
    gone = []

    def unhealthy(cluster, plan):
        gone.append(plan.decision.worker_id)
        cluster.registry.get(plan.decision.worker_id).healthy = False

    cluster, chosen = await _one_fresh(tiny_model, {**QUEUE, "holder_prefills": 2}, 0, unhealthy)
    assert gone == [chosen] == ["w0"]
    went = {t: w for t, (w, _) in cluster.dispatched.items()}
    assert list(went) == ["f"] and went["f"] != "w0"


@pytest.mark.parametrize("at_once", [False, True])
async def test_a_worker_routable_again_since_the_plan_read_them_is_decided_over(tiny_model, at_once):
    """``Router.plan`` reads the routable workers before its awaits (tokenizing, the lookup): a
    worker that turns routable meanwhile is no candidate of the plan. w0 and w1 both hold the
    conversation; w0, with one request before its first byte, is open to a holder; w1, idle, was
    unhealthy when the plan was made and is healthy again at the request's turn. The look decides
    again over the routable workers and sends it to w1; the at-once path must not keep the plan's
    w0 (its twin with the path off shows what the look does)."""
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    cluster = Cluster(pool, model, 3600.0, queue={**QUEUE, "holder_prefills": 2})
    if not at_once:
        cluster.queue._at_once = lambda *args: None
    try:
        body = _body("conv0", 600)
        keys = list((await cluster.router.plan("chat", body, [], orjson.dumps(body))).blocks.first_keys)
        await cluster.index.store("w0", "gpu", keys)
        await cluster.index.store("w1", "gpu", keys)
        for reg in cluster.registry.all()[1:]:
            for handle in cluster.handles[reg.id]:
                handle.first_byte()
        cluster.registry.get("w1").healthy = False
        cluster.now_s = time.monotonic() + 1.0  # past the requests' starts (no settling)
        follow_up = _body("conv0", 640)
        plan = await cluster.router.plan("chat", follow_up, [], orjson.dumps(follow_up))
        assert "w1" not in plan.workers and plan.decision.worker_id == "w0"
        cluster.registry.get("w1").healthy = True  # a probe during the plan's awaits
        cluster.tags[id(plan.request)] = "f"
        cluster.waiting["f"] = asyncio.create_task(cluster.queue.take_turn(plan, fresh=True))
        await _settle()
        assert cluster.outcome() == ({"f": "w1"}, {})
    finally:
        await cluster.close()
        pool.close()


def _catch_up(cluster: Cluster) -> None:
    """Every request sent so far starts (its reservation released) and gives its first byte."""
    cluster.outcome()
    for tag, (worker_id, reservation) in list(cluster.dispatched.items()):
        if reservation is not None:
            reservation.release()
            cluster.dispatched[tag] = (worker_id, None)
    for handles in cluster.handles.values():
        for handle in handles:
            handle.first_byte()


def test_the_history_knows_which_workers_changed_and_forgets_old_looks():
    history = WorkerHistory()
    history.snapshot({"w0": 1, "w1": 1})
    first = history.seq
    assert history.changed_since(first) == set()
    history.snapshot({"w0": 1, "w1": 2})  # w1 changed
    history.snapshot({"w0": 1})  # w1 left
    history.snapshot({"w0": 1, "w1": 2})  # w1 back, with the state it had: changed (it was not scored)
    assert history.changed_since(first) == {"w1"}
    assert history.changed_since(history.seq - 1) == {"w1"}
    history.snapshot({"w0": 3, "w1": 2})
    assert history.changed_since(history.seq - 1) == {"w0"}
    for _ in range(20):
        history.snapshot({"w0": 3, "w1": 2})
    assert history.changed_since(history.seq - 1) == set()
    assert history.changed_since(first) is None  # too old: decide over every worker


async def _twins(tiny_model, setup, change, seen: list | None = None) -> list[tuple[dict, dict]]:
    """Both clusters (every worker / changed workers only) through ``setup(cluster)``, a look,
    ``change(cluster)`` and a look: each one's outcome after the change (``seen``: gets the
    clusters)."""
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    clusters = [Cluster(pool, model, full_redecide_s=0.0), Cluster(pool, model, full_redecide_s=3600.0)]
    if seen is not None:
        seen.extend(clusters)
    try:
        for cluster in clusters:
            await setup(cluster)
            cluster.queue.pump()
            await _settle()
            change(cluster)
            cluster.now_s += 0.01
            cluster.queue.pump()
            await _settle()
        return [c.outcome() for c in clusters]
    finally:
        for cluster in clusters:
            await cluster.close()
        pool.close()


async def _waits_for(cluster: Cluster, holders: dict[str, tuple[str, float, int]]) -> None:
    """``conv0``'s history held by each of ``holders`` (worker -> (tier, share of its blocks,
    prefill tokens queued there)); every other worker open; its follow-up enqueued."""
    body = _body("conv0", 600)
    keys = list((await cluster.router.plan("chat", body, [], orjson.dumps(body))).blocks.first_keys)
    cluster.prefixes.append(keys)
    for worker_id, (tier, share, queued) in holders.items():
        await cluster.index.store(worker_id, tier, keys[: int(len(keys) * share)])
        cluster.handles[worker_id].append(cluster.registry.get(worker_id).begin(queued))
    for reg in cluster.registry.all():
        if reg.id not in holders:
            for handle in cluster.handles[reg.id]:
                handle.first_byte()
    await cluster.enqueue("f", _body("conv0", 640))


async def test_a_prefix_turning_hot_is_decided_over_every_worker(tiny_model):
    """A conversation's follow-up waits for its busy holder while its prefix is private
    (recomputing it elsewhere is charged three times); once other requests make the prefix hot
    (charged once), an open worker wins for some of the holder's queues. The prefix's uses are
    no worker's state: the change is seen by comparing them with the last decision's."""
    flipped = 0
    for queued in range(9500, 24000, 1500):
        async def setup(cluster, queued=queued):
            await _waits_for(cluster, {"w0": ("gpu", 1.0, queued)})
            cluster.queue.pump()
            await _settle()
            cluster.before = cluster.outcome()

        def hot(cluster):
            for _ in range(3):
                cluster.router.prefix_uses.record(cluster.prefixes[0])

        clusters_seen: list = []
        full, short = await _twins(tiny_model, setup, hot, clusters_seen)
        assert short == full, queued
        before = clusters_seen[0].before
        assert before == ({}, {"f": "w0"}) or before[0]  # it waited for w0, or went at once
        flipped += before == ({}, {"f": "w0"}) and bool(full[0])
    assert flipped >= 3  # the prefix turning hot sent a waiting follow-up elsewhere


async def _both(tiny_model, script) -> list[tuple[dict, dict]]:
    """``script(cluster)`` on a cluster deciding over every worker and on one re-scoring changed
    workers only; each one's outcome at the end."""
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    out = []
    try:
        for full_redecide_s in (0.0, 3600.0):
            cluster = Cluster(pool, model, full_redecide_s)
            try:
                await script(cluster)
                out.append(cluster.outcome())
            finally:
                await cluster.close()
    finally:
        pool.close()
    return out


async def _look(cluster: Cluster) -> None:
    cluster.now_s += 0.01
    cluster.queue.pump()
    await _settle()


async def _only(cluster: Cluster, *worker_ids: str) -> dict:
    for reg in cluster.registry.all():
        reg.healthy = reg.id in worker_ids
    body = _body("conv0", 600)
    keys = list((await cluster.router.plan("chat", body, [], orjson.dumps(body))).blocks.first_keys)
    await cluster.index.store("w0", "gpu", keys)  # w0 holds the history, with a long queue
    cluster.handles["w0"].append(cluster.registry.get("w0").begin(200_000))
    return {w: cluster.registry.get(w) for w in worker_ids}


async def test_a_decision_made_with_peer_pulls_is_made_again_over_every_worker_once_they_go(tiny_model):
    """While agents publish peer pulls, a worker's pull credit depends on the others' blocks; a
    request decided then waits for w1 (busy, pulling w0's blocks). Once the peer table empties
    (agents stopped, or it went stale) no worker's state changed, yet every rank did: the
    request is decided over every worker again and goes to the open w2."""

    async def script(cluster):
        regs = await _only(cluster, "w0", "w1", "w2")
        for handle in cluster.handles["w2"]:
            handle.first_byte()  # w2 open
        cluster.router.peers.update({"w0": {"peer": {"serve": "10.0.0.1:9000"}},
                                     "w1": {"peer": {"pull": True, "block_bytes": 65536}}})
        await cluster.enqueue("f", _body("conv0", 640))
        await _look(cluster)
        assert cluster.outcome() == ({}, {"f": "w1"}), regs
        cluster.router.peers.update({})
        await _look(cluster)

    full, short = await _both(tiny_model, script)
    assert full == short == ({"f": "w2"}, {})


class _OtherProcess:
    """Another gateway process's load on one worker, as the shared load table shows it."""

    def __init__(self) -> None:
        self.load = OthersLoad()

    def others(self, slot):
        return self.load

    def publish(self, *args, **kwargs) -> None:
        pass

    def claim(self):
        return contextlib.nullcontext()


async def test_a_look_decides_on_its_snapshot_though_another_process_changes_a_worker_meanwhile(tiny_model):
    """Another gateway process sends a long prompt to w1 right after a look took its snapshot
    (w1 light) and before that look's decisions; the request waits for w0. By the next look that
    prompt is gone and w1 is as the snapshot had it: had the decision seen w1 heavy, w1 would
    count as unchanged and never be scored again. Decisions read the look's snapshot, so the
    request goes to w1."""
    heavy = OthersLoad(in_flight=1, prefill_tokens=1_000_000, pending=1)

    async def script(cluster):
        regs = await _only(cluster, "w0", "w1")
        other = _OtherProcess()
        regs["w1"].shared = (other, 0)
        for handle in cluster.handles["w1"]:
            handle.first_byte()  # open, as far as this process goes
        other.load = heavy
        await cluster.enqueue("f", _body("conv0", 640))
        assert cluster.outcome() == ({}, {"f": "w0"})
        other.load = OthersLoad()
        look = cluster.queue._look

        def then_the_other_process_sends(*args):
            got = look(*args)
            other.load = heavy
            return got

        cluster.queue._look = then_the_other_process_sends
        await _look(cluster)
        cluster.queue._look = look
        other.load = OthersLoad()
        await _look(cluster)

    full, short = await _both(tiny_model, script)
    assert full == short == ({"f": "w1"}, {})


async def test_candidates_from_worker_states_are_the_candidates_read_live(tiny_model):
    """``Router._candidates`` builds each candidate inline from the registration, or from a
    ``worker_state`` taken earlier (the dispatch queue's look): the same candidates."""
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BLOCK)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    cluster = Cluster(pool, model, 0.0)
    try:
        rng = random.Random(7)
        regs = cluster.registry.all()
        for reg in regs:
            _learn(cluster, reg, rng, 40)
            reg.record_scrape(rng.randrange(4), rng.randrange(3), rng.random())
        for _ in range(20):  # one worker's reported hits run well below the index's predictions
            regs[3].evidence.observe(1000, 10)
        plan = await cluster.router.plan("chat", _body("conv0", 300), [], orjson.dumps(_body("conv0", 300)))
        live = cluster.router._candidates(regs, plan.matches, plan.request, plan.blocks)
        states = {r.id: cluster.router.worker_state(r) for r in regs}
        taken = cluster.router._candidates(regs, plan.matches, plan.request, plan.blocks, states)
        assert taken == live and any(c.prefill_speed is not None for c in live)
        assert len({repr(c.load) for c in live}) > 1 and len({c.evidence_weight for c in live}) > 1
    finally:
        await cluster.close()
        pool.close()
