"""One look of the dispatch queue (:mod:`router.route.dispatch_queue`) at a model's workers:
which are open to a waiting request and when the next may open (:class:`Look`), and which
changed since earlier looks (:class:`WorkerHistory`). Pure computation over the registry's
counts; the queue owns the timers and the decisions."""
from __future__ import annotations

import math
from collections import deque

from router.policies.queue import QueueSettings
from router.workers.registry import WorkerRegistration

HISTORY_LOOKS = 16  # looks whose changed workers are kept (DispatchQueue._decide)


class WorkerHistory:
    """One model's routable workers' states (:meth:`Router.worker_state`) at the last look, and
    which workers changed at each of the last :data:`HISTORY_LOOKS` looks."""

    def __init__(self) -> None:
        self.seq = 0
        self.states: dict[str, object] = {}
        self.changes: deque[tuple[int, set[str]]] = deque(maxlen=HISTORY_LOOKS)
        self.touched: set[str] = set()  # workers to count as changed at the next look

    def snapshot(self, states: dict[str, object]) -> None:
        """Take the states of this look: a worker is changed when its state differs, it was
        routable at only one of this look and the last, or it was :attr:`touched` (sent a request
        in the last look: the decisions after that saw it live, not as the snapshot had it)."""
        old = self.states
        self.seq += 1
        changed = {w for w, s in states.items() if old.get(w) != s}
        changed.update(w for w in old if w not in states)
        changed |= self.touched
        self.touched = set()
        self.changes.append((self.seq, changed))
        self.states = states

    def changed_since(self, seq: int) -> set[str] | None:
        """Workers changed in the looks after look ``seq``; None when those are no longer all kept."""
        if seq == self.seq:
            return set()
        if not self.changes or self.changes[0][0] > seq + 1:
            return None
        out: set[str] = set()
        for at, changed in self.changes:
            if at > seq:
                out |= changed
        return out


class Look:
    """One model's routable workers in one look at the queue: which are open to a request that
    holds no prefix there (and, asked, to a holder), and when the next may open. ``history``:
    the model's :class:`WorkerHistory` under ``affinity: policy``."""

    def __init__(self, regs: list[WorkerRegistration], now: float, settings: QueueSettings) -> None:
        self.regs = regs
        self.ids = {r.id: i for i, r in enumerate(regs)}
        self.now = now
        self.settings = settings
        self.history: WorkerHistory | None = None
        self.states: dict[str, object] | None = None  # the workers' states decisions read (history's look)
        self.dispatched: set[str] = set()
        self._views: dict[frozenset[str], tuple[list[WorkerRegistration], dict[str, int]]] = {}
        self._holder_open: dict[str, bool] = {}
        self.open: set[str] = set()
        self._wake_s = math.inf
        for reg in regs:
            opened, wake_s = open_and_wake(reg, now, settings)
            if opened:
                self.open.add(reg.id)
            if wake_s < self._wake_s:
                self._wake_s = wake_s

    def view(self, pool: frozenset[str] | None) -> tuple[list[WorkerRegistration], dict[str, int]]:
        """The workers a request may go to (``pool``: only those) and their positions."""
        if pool is None:
            return self.regs, self.ids
        got = self._views.get(pool)
        if got is None:
            regs = [r for r in self.regs if r.id in pool]
            got = self._views[pool] = (regs, {r.id: i for i, r in enumerate(regs)})
        return got

    def ready(self, worker_id: str, holders: set[str]) -> bool:
        """Whether ``worker_id`` may take a request whose prefix holders are ``holders`` now."""
        if worker_id in self.open:
            return True
        if worker_id not in holders:
            return False
        got = self._holder_open.get(worker_id)
        if got is None:
            got = self._holder_open[worker_id] = is_open(self.regs[self.ids[worker_id]], self.now,
                                                          self.settings, True)
        return got

    def any_ready(self, ids: dict[str, int], holders: set[str]) -> bool:
        """Whether any of ``ids`` may take such a request now."""
        if len(ids) == len(self.ids):
            if self.open:
                return True
        elif any(w in ids for w in self.open):
            return True
        return any(self.ready(w, holders) for w in holders if w in ids)

    def ready_regs(self, ids: dict[str, int], holders: set[str]) -> list[WorkerRegistration]:
        """Those of ``ids`` that may take such a request now, in registry order."""
        chosen = {w for w in self.open if w in ids}
        chosen.update(w for w in holders if w in ids and self.ready(w, holders))
        return sorted((self.regs[self.ids[w]] for w in chosen), key=lambda r: self.ids[r.id])

    def dispatched_to(self, reg: WorkerRegistration) -> None:
        """A request was sent to ``reg`` (its reservation taken): look at it again."""
        self.dispatched.add(reg.id)
        if self.states is not None:
            self.states.pop(reg.id, None)  # decided on live from now on
        self._holder_open.pop(reg.id, None)
        opened, wake_s = open_and_wake(reg, self.now, self.settings)
        if opened:
            self.open.add(reg.id)
        else:
            self.open.discard(reg.id)
        self._wake_s = min(self._wake_s, wake_s)

    def wake_s(self) -> float:
        """The next predicted opening or end of a settle time (monotonic s; inf: none)."""
        return self._wake_s


def open_and_wake(reg: WorkerRegistration, now: float, settings: QueueSettings,
                  holder: bool = False) -> tuple[bool, float]:
    """Whether ``reg`` is open (:func:`is_open`; ``holder``: to a request whose longest prefix it
    holds), and when it may next open (monotonic s): the end of its settle time or its predicted
    prefill left down to ``worker_queue_ms``; inf when nothing is pending or nothing predicts it
    (the tick)."""
    pending = reg.prefills_pending()
    if pending == 0:
        return reg.unseen_waiting <= 0, math.inf
    wake_s = math.inf
    newest_s = reg.newest_pending_s()
    settling = now - newest_s < settings.settle_ms / 1000.0  # the last request sent may not have reached the engine
    if settling:
        wake_s = newest_s + settings.settle_ms / 1000.0
    left_ms = reg.prefill_left_ms(now)
    if math.isfinite(left_ms) and left_ms > settings.worker_queue_ms:
        wake_s = min(wake_s, now + (left_ms - settings.worker_queue_ms) / 1000.0)
    if reg.unseen_waiting > 0 or settling:
        return False, wake_s
    limit = max(settings.worker_prefills, settings.holder_prefills) if holder else settings.worker_prefills
    return pending < limit or left_ms <= settings.worker_queue_ms, wake_s


def is_open(reg: WorkerRegistration, now: float, settings: QueueSettings, holder: bool = False) -> bool:
    """Whether ``reg`` may take a request now (the dispatch queue's rule, module docstring of
    :mod:`router.route.dispatch_queue`): no waiting requests of other clients, and none pending
    or, past the settle time, fewer pending than the limit or the predicted prefill left within
    ``worker_queue_ms``."""
    return open_and_wake(reg, now, settings, holder)[0]
