"""Shared ticks: one timer per tick for every periodic loop of the gateway.

Each registered worker runs its own health-probe and load-scrape loop
(:mod:`router.workers.probes`), and the gateway has a few periodic jobs of its own (the peer-state
poll, the shared load table's heartbeat, the KV-event ingest board). Slept independently, N loops
are N timers a second, spread over the second: N wake-ups of the event loop, the most of an idle
gateway's CPU. Here a loop waits for the next multiple of its interval on the event loop's clock
instead, so every loop of one interval (and of its divisors) wakes from one timer. Loops are
released :data:`BATCH` at a time, one batch per pass of the event loop, so a tick of a thousand
workers does not hold requests up for all of their calls at once (figures:
docs/tuning/gateway_cpu.md).
"""
from __future__ import annotations

import asyncio
import math
import weakref

BATCH = 32  # loops released per pass of the event loop

_clocks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Ticks] = weakref.WeakKeyDictionary()


class Ticks:
    """The ticks of one event loop: ``await clock.wait(interval_s)`` returns at the next
    multiple of ``interval_s`` (seconds of ``loop.time()``), after the earlier waiters' batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[float, list[asyncio.Future]] = {}
        self._fired = -math.inf  # the latest tick whose timer has run

    async def wait(self, interval_s: float) -> None:
        loop = self._loop
        k = math.floor(loop.time() / interval_s) + 1
        # a timer may run a little before its time (uvloop counts whole milliseconds): a loop
        # waiting again at once must not get the tick that just woke it
        while k * interval_s <= self._fired:
            k += 1
        due = k * interval_s
        waiters = self._due.get(due)
        if waiters is None:
            waiters = self._due[due] = []
            loop.call_at(due, self._fire, due)
        fut = loop.create_future()
        waiters.append(fut)
        await fut

    def waiting(self) -> int:
        """Loops waiting for a tick."""
        return sum(len(w) for w in self._due.values())

    def _fire(self, due: float) -> None:
        self._fired = max(self._fired, due)
        self._release(self._due.pop(due, []), 0)

    def _release(self, waiters: list[asyncio.Future], start: int) -> None:
        end = start + BATCH
        for fut in waiters[start:end]:
            if not fut.done():
                fut.set_result(None)
        if end < len(waiters):
            self._loop.call_soon(self._release, waiters, end)


def ticks() -> Ticks:
    """The running loop's :class:`Ticks` (one per loop)."""
    loop = asyncio.get_running_loop()
    clock = _clocks.get(loop)
    if clock is None:
        clock = _clocks[loop] = Ticks(loop)
    return clock
