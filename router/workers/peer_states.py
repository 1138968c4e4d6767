"""Peer-pull states that agents publish to the gateway over HTTP, for clusters without a Redis
index (the gateway's embedded index; :mod:`router.workers.peers` explains the states).

An agent started with ``kvroute agent --index http://GATEWAY`` owns its worker's tiers and
publishes the same state an agent writing Redis sends with its heartbeats (a JSON object with a
``"peer"`` mapping, and its ``"tiers"`` counters) with ``PUT /admin/workers/{id}/peer?ttl_s=S``
(:mod:`router.edge.admin`), every ``S / 3`` seconds at most. :class:`PublishedPeerStates` keeps each
worker's latest state for ``S`` seconds after it arrived (``DELETE`` drops it at once: an agent
stopping cleanly); :class:`PeerStateSource` gives the gateway's
:class:`~router.workers.peers.PeerPoller` these states, over those of a shared index's agents when
the index keeps them (Redis), so routing, ``/admin/workers`` and ``/admin/explain`` read one
:class:`~router.workers.peers.PeerTable` either way.

With ``kvroute serve --processes N`` the process that receives a ``PUT``/``DELETE`` applies it and
sends it on to every sibling (:mod:`router.processes.group`), so each process keeps the same states; each
stamps the arrival on its own monotonic clock.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvcore.index.base import SupportsWorkerStates

MAX_TTL_S = 3600.0
DEFAULT_TTL_S = 10.0  # the agents' --heartbeat-ttl-s default
MAX_WORKERS = 4096  # published states kept at most (one per worker id); a new id beyond is refused
MAX_STATE_BYTES = 64 << 10  # one published state's JSON, at most


class TooManyStates(ValueError):
    """:data:`MAX_WORKERS` live states are kept already and the id is a new one."""


class PublishedPeerStates:
    """Worker id -> the state its agent published, live for the ``ttl_s`` it was published with.
    ``clock``: monotonic seconds. Not thread-safe (one event loop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_workers: int = MAX_WORKERS) -> None:
        self._clock = clock
        self.max_workers = max_workers
        self._states: dict[str, tuple[dict[str, Any], float, float]] = {}  # id -> (state, at, ttl_s)

    def put(self, worker_id: str, state: Mapping[str, Any], ttl_s: float = DEFAULT_TTL_S) -> None:
        """Keep ``state`` as ``worker_id``'s for ``ttl_s`` seconds from now (replacing any earlier
        one). Raises ValueError when ``ttl_s`` is not in (0, :data:`MAX_TTL_S`] or ``state`` has
        no ``"peer"`` mapping; :class:`TooManyStates` when the id is new and the store is full."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) \
                or not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g}], got {ttl_s!r}")
        if not isinstance(state, Mapping) or not isinstance(state.get("peer"), Mapping):
            raise ValueError('the state must be a JSON object with a "peer" object')
        if worker_id not in self._states and len(self._states) >= self.max_workers:
            self._expire()
            if len(self._states) >= self.max_workers:
                raise TooManyStates(f"{self.max_workers} workers' peer states are kept already")
        self._states[worker_id] = (dict(state), self._clock(), float(ttl_s))

    def remove(self, worker_id: str) -> bool:
        """Drop ``worker_id``'s state; whether there was a live one."""
        got = self._states.pop(worker_id, None)
        return got is not None and self._clock() - got[1] <= got[2]

    def _expire(self) -> None:
        now = self._clock()
        for wid in [w for w, (_, at, ttl) in self._states.items() if now - at > ttl]:
            del self._states[wid]

    def live(self) -> dict[str, dict[str, Any]]:
        """Worker id -> its live state (a copy) plus ``published_age_s`` (seconds since it came)
        and ``ttl_s``, as :meth:`~kvcore.index.base.SupportsWorkerStates.worker_states` answers."""
        self._expire()
        now = self._clock()
        return {wid: {**state, "published_age_s": round(now - at, 3), "ttl_s": ttl}
                for wid, (state, at, ttl) in self._states.items()}

    def __len__(self) -> int:
        self._expire()
        return len(self._states)


class PeerStateSource:
    """The agents' states the gateway's peer table is fed from (a
    :class:`~kvcore.index.base.SupportsWorkerStates`): ``index``'s (a shared index whose agents
    publish there, or None) overlaid by the ``published`` ones (an id in both: the published
    one). Raises what ``index.worker_states()`` raises (IndexUnavailable)."""

    def __init__(self, published: PublishedPeerStates, index: SupportsWorkerStates | None = None) -> None:
        self.published = published
        self.index = index

    async def worker_states(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if self.index is not None:
            out.update(await self.index.worker_states())
        out.update(self.published.live())
        return out
