"""The dispatch queue: requests wait in the gateway until a worker is ready for them, and the
shortest prefill goes first (late binding). On when the policy config's ``queue.enabled`` is true
(:mod:`router.policies.queue` has the settings).

Why: an engine serves its waiting queue in arrival order, so a request sent to a busy worker
waits behind every prompt sent there before it, and the choice of worker is frozen at arrival,
when the router knows least. Holding requests in the gateway instead:

- a worker is *open* to a request while the engine shows no waiting requests of other clients
  and either fewer than ``worker_prefills`` (2, 1 for ``ttft``: with 2, one in prefill and one
  waiting in the engine to follow it at once) requests are before their first byte there
  (:meth:`~router.workers.registry.WorkerRegistration.prefills_pending`), or ``holder_prefills`` (2)
  when the worker holds the request's longest cached prefix and that is more than every
  routable worker holds (the larger of the two applies), or the prefill its requests are
  predicted to have left (:meth:`~router.workers.registry.WorkerRegistration.prefill_left_ms`, from
  the policy's TTFT predictions at dispatch; ``inf`` for a request the policy made none for,
  until its first byte) is at most ``worker_queue_ms`` (0; 50 for ``ttft``: the next request
  leaves just in time to follow the last prefill); but never within ``settle_ms`` (50) of the
  last request sent there (or reserved for it) before its first byte, which may not have
  reached the engine yet (:mod:`router.policies.queue` says what that costs);
- whenever a worker may have opened (a request's first byte or end, a reservation released, a
  timer at the next predicted opening, a 100 ms tick while requests wait), waiting requests are
  taken in order: those that waited ``max_wait_s`` first (arrival order), then the smallest
  predicted prefill (prompt tokens less the longest credited prefix any candidate holds), then
  arrival; this is shortest-job-first, which cuts the median and p90 TTFT of a loaded cluster
  (Harchol-Balter, *Performance Modeling and Design of Computer Systems*, ch. 30-32, for why);
- until a request has waited ``affinity_wait_s`` (or the wait its policy set for it,
  ``Decision.affinity_wait_s``: ``ttft``'s for a conversation's follow-up) it may go only
  to certain open workers: with
  ``affinity: holder``, those that hold its longest cached prefix within one block; with
  ``affinity: policy``, the worker the live policy chooses among all routable ones (their load as
  it is then, plus the prefill of the requests ahead of it in this queue that wait for the same
  worker: a busy holder shows its whole queue), so it waits while the policy prefers a closed
  worker. Once it waits for a worker, a policy whose ranks are each worker's own
  (``ttft``; the P/D decode leg's) re-scores at each look only the workers that changed since,
  with the same choice (:meth:`DispatchQueue._decide`).
  Past ``affinity_wait_s`` any open worker may take it (the prefix is then computed a second time,
  and the worker's KV events tell the index). Among the workers it may go to, the live policy
  chooses (:meth:`~router.route.planner.Router.redecide`);
- while it waits, its prompt is looked up in the index again every ``rematch_ms`` (200)
  (:meth:`~router.route.planner.Router.rematch`), and the rules above then use what the workers hold
  now: a holder that evicted the prefix meanwhile is not waited for, and a prefix that a request
  dispatched meanwhile is computing is credited where it went, so requests sharing a prefix that
  arrive together follow the first of them (``kvroute_dispatch_queue_rematches_total``).

A request chosen for a worker holds a :class:`Reservation` there (counted as prefill in flight
with the policy's predicted end, by every gateway process) until its first attempt has begun,
so two requests never take one opening; the worker is checked open again and the reservation
published under the gateway processes' shared lock
(:meth:`~router.workers.registry.WorkerRegistration.claim`), so neither do two processes. Requests of
a model with no routable worker fail with 503.

The prefill leg of a split request (:mod:`router.route.pd`) waits here as a whole request does, by the
same rules, limited to its prefill pool (``pool``: the prefill plan's workers) and re-chosen by
the prefill leg's policy (:func:`router.route.pd.prefill_policy`); its decode leg then goes to the
decode worker without waiting (the decode worker computes no prompt). A request the decode pool
serves whole (P/D outcome ``whole``, or a failed prefill leg's fallback) computes its prompt there,
so it waits as a whole request does, limited to the decode pool and re-chosen by the decode leg's
cost (:class:`router.route.pd.DecodePolicy`).

Pure asyncio in one event loop; its only I/O is the index lookups of :meth:`Router.rematch`.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.errors import no_healthy_worker
from router.policies.base import Policy
from router.policies.queue import QueueSettings
from router.route.plan import RoutePlan
from router.route.planner import Router
from router.route.queue_look import Look, WorkerHistory, is_open
from router.telemetry.metrics import GatewayMetrics
from router.workers.registry import WorkerRegistration, WorkerRegistry

log = logging.getLogger(__name__)
TICK_S = 0.1  # while requests wait, look again at least this often (health, affinity expiry)
FULL_REDECIDE_S = 1.0  # a waiting request is decided over every worker at least this often


class Reservation:
    """A dispatch queue's hold on ``reg`` for one request on its way there; :meth:`release`
    (idempotent) frees it once the request is counted in flight (or failed)."""

    __slots__ = ("reg", "_on_release")

    def __init__(self, reg: WorkerRegistration, end_s: float | None, on_release: Callable[[], None],
                 now_s: float) -> None:
        self.reg = reg
        self._on_release = on_release
        reg.reserve(self, end_s, now_s)

    def release(self) -> None:
        if self.reg.unreserve(self):
            self._on_release()


@dataclass(eq=False)
class _Entry:
    plan: RoutePlan
    arrival_s: float
    size_tokens: float  # predicted own prefill at the best holder; inf when tokens are unknown
    held_blocks: dict[str, int]  # credited matched blocks per worker id
    pool: frozenset[str] | None = None  # the only workers it may go to (a prefill leg's pool)
    policy: Policy | None = None  # the policy that re-chooses its worker (None: the live one)
    fresh: bool = False  # its plan was decided with nothing awaited since (take_turn's ``fresh``)
    choice: _Choice | None = None  # its last decision while it waits (affinity: policy)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def affinity_wait_s(self, settings: QueueSettings) -> float:
        """The policy's wait for this request (``Decision.affinity_wait_s``), else the queue's."""
        return _affinity_wait_s(self.plan, settings)

    def order(self, now: float, settings: QueueSettings) -> tuple[int, float, float]:
        if now - self.arrival_s >= settings.max_wait_s:
            return (0, self.arrival_s, 0.0)
        return (1, self.size_tokens, self.arrival_s)


class DispatchQueue:
    """See the module docstring. ``settings()``: the live policy's :class:`QueueSettings`;
    ``full_redecide_s``: how often at least a waiting request is decided over every worker
    (:meth:`_decide`; 0: at every look)."""

    def __init__(self, router: Router, registry: WorkerRegistry, metrics: GatewayMetrics,
                 settings: Callable[[], QueueSettings], clock: Callable[[], float] = time.monotonic,
                 full_redecide_s: float = FULL_REDECIDE_S) -> None:
        self.router = router
        self.full_redecide_s = full_redecide_s
        self._history: dict[str, WorkerHistory] = {}  # model -> its workers' states at the last look
        self.registry = registry
        self.metrics = metrics
        self.settings = settings
        self.clock = clock
        self._entries: list[_Entry] = []
        self._timer: asyncio.TimerHandle | None = None
        self._pump_soon = False
        self._rematcher: asyncio.Task | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        """Requests waiting now."""
        return len(self._entries)

    async def take_turn(self, plan: RoutePlan, pool: frozenset[str] | None = None,
                        policy: Policy | None = None, fresh: bool = False) -> tuple[RoutePlan, Reservation | None]:
        """Wait until ``plan``'s request may be dispatched; returns the plan to send it by (a new
        decision among the workers then open) and the reservation to release once its first
        attempt has begun. ``pool``: only these worker ids may take it (a prefill leg's pool);
        ``policy``: the policy that re-chooses (None: the live one). ``fresh``: the live
        policy decided ``plan`` with nothing awaited since, so every input of its choice is
        as it was: the first look at the queue then keeps that decision instead of making it
        again, unless requests before it in the queue were dispatched or waited for a worker
        in that look, or it may go only to some of the plan's workers; at an empty queue it is
        sent without the look over every worker when the look would keep its decision and send
        it (:meth:`_at_once`). With the queue off:
        ``(plan, None)`` at once. Raises GatewayError 503 when no worker (of ``pool``) serves
        the model any more; cancelling the wait gives up its place."""
        settings = self.settings()
        if not settings.enabled:
            return plan, None
        if fresh and policy is None and not self._entries:
            reservation = self._at_once(plan, pool, settings)
            if reservation is not None:
                self.metrics.dispatch_queue_wait_s.observe(0.0)
                return plan, reservation
        entry = _Entry(plan, self.clock(), _size_tokens(plan), _held_blocks(plan), pool, policy,
                       fresh=fresh and policy is None)
        self._entries.append(entry)
        self.pump()
        try:
            return await entry.future
        except asyncio.CancelledError:
            if entry in self._entries:
                self._entries.remove(entry)
            elif entry.future.done() and not entry.future.cancelled() and entry.future.exception() is None:
                entry.future.result()[1].release()
            raise
        finally:
            self.metrics.dispatch_queue_wait_s.observe(self.clock() - entry.arrival_s)

    def _at_once(self, plan: RoutePlan, pool: frozenset[str] | None,
                 settings: QueueSettings) -> Reservation | None:
        """The first look at an empty queue for a fresh ``plan`` (:meth:`take_turn`), without
        the look over every worker when its decision stands: under ``affinity: policy``, within
        its affinity wait, the look keeps a fresh plan's decision (when its workers are the routable
        ones) and dispatches it when the chosen worker is open to it (a holder of its longest
        credited prefix by the holder limit). Returns the reservation taken there, or None when
        the request must take the look (another affinity rule, no affinity wait, the routable
        workers (of ``pool``) not the plan's: one came back or left during the plan's awaits,
        so the look decides again; the chosen worker closed); the reservation is taken under
        the same shared lock and open rule as :meth:`pump`'s."""
        if settings.affinity != "policy" or _affinity_wait_s(plan, settings) <= 0:
            return None
        regs = self.registry.routable(plan.model.name)
        if pool is not None:
            regs = [r for r in regs if r.id in pool]
        reg = plan.workers.get(plan.decision.worker_id)
        if reg is None or not _same_workers(plan, regs):
            return None
        holder = reg.id in _holders(_held_blocks(plan), plan.workers)
        reg.on_prefill_done = self._schedule_pump
        return self._reserve(plan, reg, self.clock(), settings, holder)

    def _reserve(self, plan: RoutePlan, reg: WorkerRegistration, now: float, settings: QueueSettings,
                 holder: bool) -> Reservation | None:
        """``reg``'s reservation for ``plan``'s request (ending at the policy's predicted first
        token), taken under the gateway processes' shared lock if ``reg`` is still open to it
        (``holder``: a holder of its longest credited prefix); None when it is not."""
        predicted_ms = plan.predicted_ttft_ms(reg.id)
        end_s = None if predicted_ms is None else now + predicted_ms / 1000.0
        with reg.claim():  # another gateway process may have taken it since it was read
            if not is_open(reg, now, settings, holder):
                return None
            return Reservation(reg, end_s, self._schedule_pump, now)

    def _ensure_rematcher(self) -> None:
        """Start the lookups again (:meth:`_rematch_while_waiting`) while requests wait, unless
        they run, ``rematch_ms`` is 0 or the queue is closed (called from every :meth:`pump`, so
        turning ``rematch_ms`` on at run time reaches the requests already waiting)."""
        if (self._entries and not self._closed and self.settings().rematch_ms > 0
                and (self._rematcher is None or self._rematcher.done())):
            self._rematcher = asyncio.get_running_loop().create_task(self._rematch_while_waiting())

    async def _rematch_while_waiting(self) -> None:
        """While requests wait: every ``rematch_ms``, look each one up in the index again
        (:meth:`_rematch`), then look at the queue once if any changed. Ends when the queue is
        empty or ``rematch_ms`` is 0; a lookup that fails ends that round (logged)."""
        while self._entries:
            rematch_s = self.settings().rematch_ms / 1000.0
            if rematch_s <= 0:
                return
            await asyncio.sleep(rematch_s)
            changed = False
            for entry in list(self._entries):
                if entry not in self._entries:
                    continue
                try:
                    changed = await self._rematch(entry) or changed
                except Exception:  # noqa: BLE001 - the requests keep waiting on what they had
                    log.exception("dispatch queue: looking a waiting request up again failed")
                    break
            if changed:
                self.pump()

    async def _rematch(self, entry: _Entry) -> bool:
        """Look ``entry``'s prompt up in the index again (:meth:`Router.rematch`); while it still
        waits, it waits by what the workers hold now. Returns whether its matches changed (any
        worker or tier); counts the change in total blocks per credited worker."""
        plan = await self.router.rematch(entry.plan)
        if entry not in self._entries or plan is entry.plan:
            return False  # dispatched meanwhile, no block keys, or the index was unavailable
        if plan.matches == entry.plan.matches:
            self.metrics.dispatch_queue_rematches.labels("none").inc()
            return False
        held = _held_blocks(plan)
        before = entry.held_blocks
        gained = any(n > before.get(wid, 0) for wid, n in held.items())
        lost = any(held.get(wid, 0) < n for wid, n in before.items())
        for change, happened in (("gained", gained), ("lost", lost), ("none", not (gained or lost))):
            if happened:
                self.metrics.dispatch_queue_rematches.labels(change).inc()
        entry.plan, entry.held_blocks, entry.size_tokens = plan, held, _size_tokens(plan)
        return True

    def close(self) -> None:
        """Stop the timer and the lookups again for good (gateway shutdown)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._rematcher is not None:
            self._rematcher.cancel()
            self._rematcher = None

    def _schedule_pump(self) -> None:
        """Look at the queue once the current callback is done (never re-entered from a handle's
        first byte or end, which run inside the relay)."""
        if self._entries and not self._pump_soon:
            self._pump_soon = True
            asyncio.get_running_loop().call_soon(self.pump)

    def pump(self) -> None:
        """Dispatch every waiting request that may go now (called on every event that may
        open a worker, and by a timer while requests wait)."""
        self._pump_soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._entries:
            return
        settings = self.settings()
        now = self.clock()
        for reg in self.registry.all():
            reg.on_prefill_done = self._schedule_pump
        backlog: dict[str, float] = {}  # worker id -> prefill tokens of requests ahead waiting for it
        looks: dict[str, Look] = {}  # model -> its routable workers in this look
        moved = False  # an entry before this one was dispatched or waits for a worker (backlog)
        for entry in sorted(self._entries, key=lambda e: e.order(now, settings)):
            if entry.future.done():  # cancelled: its waiter removes it when it runs
                continue
            fresh, entry.fresh = entry.fresh and not moved, False
            model = entry.plan.model.name
            look = looks.get(model)
            if look is None:
                look = looks[model] = self._look(model, now, settings)
            regs, ids = look.view(entry.pool)
            if not regs:
                self._entries.remove(entry)
                entry.future.set_exception(no_healthy_worker(entry.plan.model.name))
                continue
            holders = _holders(entry.held_blocks, ids)
            if not look.any_ready(ids, holders):
                continue
            affinity_wait_s = entry.affinity_wait_s(settings)
            if now - entry.arrival_s < affinity_wait_s and settings.affinity == "policy":
                if fresh and _same_workers(entry.plan, regs):
                    plan = entry.plan  # it read the live states, nothing awaited before this look
                    entry.choice = self._choice(entry, plan, look, backlog, now)
                else:
                    plan = self._decide(entry, look, regs, ids, holders, backlog, now)
                chosen = plan.decision.worker_id
                if not look.ready(chosen, holders):
                    backlog[chosen] = backlog.get(chosen, 0.0) + plan.uncached_tokens(chosen)
                    moved = True
                    continue
            else:
                ready = look.ready_regs(ids, holders)
                if now - entry.arrival_s < affinity_wait_s:
                    top = max((n for w, n in entry.held_blocks.items() if w in ids), default=0)
                    ready = [r for r in ready if entry.held_blocks.get(r.id, 0) >= top - 1]
                if not ready:
                    continue
                plan = entry.plan if fresh and _same_workers(entry.plan, ready) else \
                    self.router.redecide(entry.plan, ready, policy=entry.policy)
            reg = plan.workers[plan.decision.worker_id]
            reservation = self._reserve(plan, reg, now, settings, reg.id in holders)
            if reservation is None:
                continue
            look.dispatched_to(reg)
            self._entries.remove(entry)
            entry.future.set_result((plan, reservation))
            moved = True
        for look in looks.values():
            if look.history is not None:  # changed at the next look, whatever their state then
                look.history.touched |= look.dispatched
        if self._entries:
            wake_s = min((look.wake_s() for look in looks.values()), default=math.inf)
            for entry in self._entries:
                expiry = entry.arrival_s + entry.affinity_wait_s(settings)
                if expiry > now:
                    wake_s = min(wake_s, expiry)
            wake_s = min(wake_s, now + TICK_S)
            self._timer = asyncio.get_running_loop().call_later(max(0.0, wake_s - now) + 1e-4, self.pump)
            self._ensure_rematcher()

    def _look(self, model: str, now: float, settings: QueueSettings) -> Look:
        """``model``'s routable workers for one look at the queue; with ``affinity: policy``, a
        snapshot of each one's state (:meth:`Router.worker_state`) against the last look's, so
        requests waiting for a worker re-score only those that changed (:meth:`_decide`)."""
        regs = self.registry.routable(model)
        look = Look(regs, now, settings)
        if settings.affinity == "policy":
            history = self._history.get(model)
            if history is None:
                history = self._history[model] = WorkerHistory()
            look.history = history
            states = {r.id: self.router.worker_state(r) for r in regs}
            history.snapshot(states)
            look.states = dict(states)  # what this look decides on (a worker sent a request: live)
        return look

    def _decide(self, entry: _Entry, look: Look, regs: list[WorkerRegistration], ids: dict[str, int],
                holders: set[str], backlog: dict[str, float], now: float) -> RoutePlan:
        """The policy's choice for a waiting request among all its routable workers ``regs``.

        When the request already waits for a worker (:class:`_Choice`), the policy ranks each
        worker apart from the others (``Policy.ranks_alone``: by its own state, the request and
        the matched workers') and neither that worker nor any worker the request matched has
        changed since (state, the prefill waiting for it ahead of this request, its prefix's
        recent uses), only those, the workers whose state changed since
        (:meth:`Router.worker_state`, from the look's history) or that were sent a request in
        this look, and those with requests waiting for them ahead of this one (then or now) are
        scored again: every other worker ranked behind the chosen one then and ranks the same
        now, so the best of those scored is the best of all. It is decided over every worker
        instead when any of that does not hold; when the policy, the request's matches or the
        model's learned line are not those of the last decision; when agents publish peer
        pulls now or did then (a worker's pull credit depends on other workers); when the
        history no longer reaches back to it; when ``full_redecide_s`` has passed since the last
        such decision; and whenever the short list chooses a worker that may take the request
        now (it leaves with a decision over every worker). Ties are broken among the workers
        scored. Every decision of a look reads the workers' states from the look's snapshot
        (``Look.states``; a worker sent a request in it: its live state), so the next look
        compares what the decisions saw, whatever other gateway processes did in between."""
        choice = entry.choice
        policy = self.router.policy.policy if entry.policy is None else entry.policy
        history = look.history
        if (choice is not None and history is not None and policy is choice.policy and entry.plan is choice.plan
                and policy.ranks_alone and now - choice.full_s < self.full_redecide_s
                and choice.worker_id in ids
                and self.registry.model_rate(entry.plan.model.name).learned is choice.model_rate
                and not choice.peers and not self.router.peers.current()):
            changed = history.changed_since(choice.snapshot)
            uses = self.router.holder_uses(entry.plan)
            if changed is not None and uses == choice.holder_uses and not any(
                    w in changed or w in look.dispatched or backlog.get(w, 0.0) != choice.backlog.get(w, 0.0)
                    for w in (choice.worker_id, *entry.plan.matches)):
                short = {choice.worker_id, *entry.plan.matches, *changed, *look.dispatched, *choice.backlog,
                         *backlog}
                subset = sorted((regs[ids[w]] for w in short if w in ids), key=lambda r: ids[r.id])
                plan = self.router.redecide(entry.plan, subset, backlog, entry.policy, look.states)
                if not look.ready(plan.decision.worker_id, holders):
                    self.metrics.dispatch_queue_decisions.labels("changed_workers").inc()
                    entry.choice = _Choice(plan.decision.worker_id, policy, entry.plan, choice.model_rate,
                                           uses, False, dict(backlog), history.seq, choice.full_s)
                    return plan
        plan = self.router.redecide(entry.plan, regs, backlog, entry.policy, look.states)
        self.metrics.dispatch_queue_decisions.labels("all_workers").inc()
        entry.choice = self._choice(entry, plan, look, backlog, now)
        return plan

    def _choice(self, entry: _Entry, plan: RoutePlan, look: Look, backlog: dict[str, float],
                now: float) -> _Choice:
        """What ``plan``, decided over every worker now, was decided on (:meth:`_decide`)."""
        policy = self.router.policy.policy if entry.policy is None else entry.policy
        return _Choice(plan.decision.worker_id, policy, entry.plan,
                       self.registry.model_rate(entry.plan.model.name).learned, self.router.holder_uses(entry.plan),
                       bool(self.router.peers.current()), dict(backlog),
                       look.history.seq if look.history is not None else -1, now)


@dataclass(eq=False)
class _Choice:
    """A waiting request's last decision under ``affinity: policy``: the worker it waits for,
    and what that decision was made on (:meth:`DispatchQueue._decide`). ``snapshot``: the
    history's :attr:`WorkerHistory.seq` it saw; ``full_s``: when it was last decided over every
    worker."""

    worker_id: str
    policy: Policy
    plan: RoutePlan
    model_rate: object
    holder_uses: dict[str, int]
    peers: bool  # agents published peer pulls then
    backlog: dict[str, float]
    snapshot: int
    full_s: float


def _holders(held_blocks: dict[str, int], ids: dict[str, int]) -> set[str]:
    """Workers of ``ids`` holding the request's longest credited prefix (within one block) when
    that is more than every one of them holds (a prefix all of them hold sets none apart);
    ``held_blocks``: the request's credited matched blocks per worker id."""
    held = {w: n for w, n in held_blocks.items() if w in ids}
    if not held:
        return set()
    top = max(held.values())
    floor = min(held.values()) if len(held) == len(ids) else 0
    if top <= floor:
        return set()
    return {w for w, n in held.items() if n > floor and n >= top - 1}


def _affinity_wait_s(plan: RoutePlan, settings: QueueSettings) -> float:
    """How long ``plan``'s request waits for the workers its affinity allows: the policy's wait
    for it (``Decision.affinity_wait_s``), else the queue's."""
    own = plan.decision.affinity_wait_s
    return settings.affinity_wait_s if own is None else own


def _held_blocks(plan: RoutePlan) -> dict[str, int]:
    """Matched blocks (any tier) per candidate whose evidence is credited."""
    return {wid: m.total for wid, m in plan.matches.items()
            if wid in plan.workers and plan.workers[wid].evidence_credited}


def _same_workers(plan: RoutePlan, regs: list[WorkerRegistration]) -> bool:
    """Whether ``regs`` are exactly the workers ``plan`` was decided among."""
    return len(regs) == len(plan.workers) and all(r.id in plan.workers for r in regs)

def _size_tokens(plan: RoutePlan) -> float:
    """Prompt tokens to prefill (every prompt of the body) at the candidate with the longest
    credited prefix (:meth:`RoutePlan.uncached_tokens`, vLLM's cap included); inf when the tokens
    are unknown."""
    if plan.request.prompt_tokens is None:
        return math.inf
    whole = plan.blocks.prompt_tokens if plan.blocks is not None else None
    return float(min((plan.uncached_tokens(wid) for wid in _held_blocks(plan)), default=whole or 0))
