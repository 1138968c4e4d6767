"""The agents' peer-pull states as the gateway holds them: :class:`PeerPoller` reads every agent's
published state every ``interval_s`` into a :class:`PeerTable`, which routing reads. What a state
holds and what a pulled block is worth: :mod:`router.estimates.peer_credit`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvcore.index.base import SupportsWorkerStates
from kvcore.ticks import ticks
from router.estimates.peer_credit import PeerInfo

log = logging.getLogger("kvroute.peer_pull")

POLL_INTERVAL_S = 1.0
STALE_AFTER_S = 10.0  # no successful poll for this long: the table is not used (the heartbeat TTL's default)


class PeerTable:
    """The latest :class:`PeerInfo` per worker, from the last successful poll; empty while the
    last success is older than ``stale_after_s`` (seconds of ``clock``, monotonic), so routing
    never weighs a pull on figures nobody refreshes (Redis down: lookups fail then anyway)."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._peers: dict[str, PeerInfo] = {}
        self.updated_monotonic: float | None = None
        self.polls = 0
        self.failures = 0
        self.last_error: str | None = None

    def update(self, states: Mapping[str, Any]) -> None:
        """Replace the table by the peer info in ``states`` (worker id -> the agent's published
        state, :meth:`~kvcore.index.base.SupportsWorkerStates.worker_states`); workers whose
        state has no ``"peer"`` mapping are left out."""
        peers = {}
        for wid, state in states.items():
            info = PeerInfo.from_state(state)
            if info is not None:
                peers[str(wid)] = info
        self._peers = peers
        self.updated_monotonic = self._clock()
        self.polls += 1

    def failed(self, error: str) -> None:
        """A poll failed (the table keeps its last figures until they go stale)."""
        self.failures += 1
        self.last_error = error

    def current(self) -> Mapping[str, PeerInfo]:
        """Peer info by worker id; empty when never polled or stale."""
        if self.updated_monotonic is None or self._clock() - self.updated_monotonic > self.stale_after_s:
            return {}
        return self._peers

    def get(self, worker_id: str) -> PeerInfo | None:
        """``worker_id``'s peer info, None when its agent publishes none (or the table is stale)."""
        return self.current().get(worker_id)


class PeerPoller:
    """Polls ``index.worker_states()`` every ``interval_s`` (on the probe loops' ticks,
    :mod:`kvcore.ticks`) into ``table`` on the running loop.
    Each poll is bounded by ``timeout_s``; a failure (Redis down, a timeout, anything else) is
    logged once per outage, counted on the table and never ends the loop. :meth:`start` needs a
    running loop; :meth:`stop` cancels the task and waits for it (at most 2 s)."""

    def __init__(self, index: SupportsWorkerStates, table: PeerTable, interval_s: float = POLL_INTERVAL_S,
                 timeout_s: float = 2.0) -> None:
        self.index = index
        self.table = table
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._ok_since_failure = True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="peer-states")

    async def poll_once(self) -> bool:
        """One poll; returns whether it succeeded."""
        try:
            async with asyncio.timeout(self.timeout_s):
                states = await self.index.worker_states()
            self.table.update(states)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # IndexUnavailable, a timeout, a bad answer: never fail the gateway
            self.table.failed(f"{type(exc).__name__}: {exc}")
            if self._ok_since_failure:  # once per outage
                log.warning("reading the agents' peer-pull states failed (their last figures count for "
                            "%g s more at most): %s", self.table.stale_after_s, self.table.last_error)
            self._ok_since_failure = False
            return False
        self._ok_since_failure = True
        return True

    async def _run(self) -> None:
        while not self._stopping:
            await self.poll_once()
            await ticks().wait(self.interval_s)  # on the probe loops' ticks: no wake-up of its own

    async def stop(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task], timeout=2.0)
