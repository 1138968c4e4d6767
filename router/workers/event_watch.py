"""Whether a worker's KV events still flow into this gateway (embedded mode).

The index holds a worker's prefix only as its KV events say; when the subscriber has lost the
worker's publisher (a wrong or dead endpoint), the index holds only the gateway's own guesses and
replayed history, so the policies must stop crediting that worker's entries until events flow
again (:attr:`router.workers.registry.WorkerRegistration.evidence_credited`).
"""
from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("kvroute.registry")

EVENTS_GRACE_S = 5.0  # a new worker's KV-event subscriber gets this long to connect


class EventStreamWatch:
    """``live``: True while the subscriber is connected to the publisher, or batches reached it
    within the grace (the socket monitor's CONNECTED may be handled after the first batches when
    the loop is busy), or the worker was added within the grace; False once all three have been
    missing longer; None when no subscriber runs here (no event stream, or the agents write the
    index with Redis); ``problem``: why it is not live (None while live)."""

    __slots__ = ("worker_id", "endpoint", "live", "problem")

    def __init__(self, worker_id: str, endpoint: str | None) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.live: bool | None = None
        self.problem: str | None = None

    def judge(self, subscriber: Any, age_s: float, grace_s: float = EVENTS_GRACE_S,
              now_s: float | None = None) -> bool | None:
        """Re-judge from ``subscriber`` (an object with ``connected``, ``batches_received`` and
        ``last_received_monotonic_s``, :class:`kvcore.kv_events.subscriber.EventSubscriber`;
        None: none runs) for a worker added ``age_s`` seconds ago, at ``now_s``
        (``time.monotonic()``; default: now). Logs a WARNING when the stream stops counting, INFO
        when it counts again. Returns the new ``live``."""
        if subscriber is None:
            live, problem = None, None
        elif subscriber.connected or age_s < grace_s or self._received_within(subscriber, grace_s, now_s):
            live, problem = True, None
        else:
            live = False
            problem = (f"not connected to the KV-event publisher at {self.endpoint} "
                       f"({subscriber.batches_received} batches received)")
        if live is False and self.live is not False:
            log.warning("worker %s: %s; its prefix evidence is not credited until events flow",
                        self.worker_id, problem)
        elif live is True and self.live is False:
            log.info("worker %s: KV events flow again; its prefix evidence is credited", self.worker_id)
        self.live, self.problem = live, problem
        return live

    @staticmethod
    def _received_within(subscriber: Any, grace_s: float, now_s: float | None) -> bool:
        last_s = subscriber.last_received_monotonic_s
        if last_s is None:
            return False
        return (time.monotonic() if now_s is None else now_s) - last_s < grace_s
