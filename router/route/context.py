"""One proxied request as it passes the gateway: the edge fills in what the client sent, the route
step what it decided (:meth:`router.edge.endpoints.ProxyEndpoint`), the relay and
:mod:`router.route.feedback` read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.route.decision_log import DecisionEntry
    from router.route.dispatch_queue import Reservation
    from router.route.plan import RoutePlan
    from router.workers.registry import WorkerRegistration

@dataclass(slots=True)
class RequestContext:
    """``kind``: how the endpoint routes it (``forward``: to the least-loaded worker, no plan);
    ``request_id``: the client's ``x-request-id`` or a new one; ``t0``: perf_counter at receipt
    (TTFT); ``method``, ``path``, ``headers``: the client's (ASGI: lower-case names, bytes);
    ``raw``: the body bytes to send (the streaming usage option added when ``strip_usage``);
    ``body``: the parsed body. Set by the route step: ``plan`` (None for ``forward``),
    ``ranked`` (workers in order of preference), ``reservation`` (the dispatch queue's, None when
    it is off or released), ``logged`` (the decision log's entry, None when not logged)."""

    kind: str
    request_id: str
    t0: float
    method: str
    path: str
    headers: list[tuple[bytes, bytes]]
    raw: bytes
    body: dict[str, Any]
    plan: RoutePlan | None = None
    ranked: list[WorkerRegistration] = field(default_factory=list)
    strip_usage: bool = False
    reservation: Reservation | None = None
    logged: DecisionEntry | None = None

    def release_reservation(self) -> None:
        """Let the dispatch queue's next request go (the request is counted in flight)."""
        if self.reservation is not None:
            self.reservation.release()
