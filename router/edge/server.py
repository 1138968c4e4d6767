"""The gateway's HTTP server: uvicorn's ``Server`` with a main loop that wakes once a second.

uvicorn's own main loop sleeps 0.1 s between checks of its exit flag (``Server.main_loop``,
uvicorn/server.py), ten wake-ups a second whether or not anything happens; an idle gateway
spends most of its CPU on them. :class:`GatewayServer` does the loop's work (``on_tick``: the
once-a-second header refresh, the exit flag, ``limit_max_requests``) once a second, and a
shutdown signal (``handle_exit``, which uvicorn installs for SIGINT and SIGTERM) wakes it at once,
so shutdown starts as promptly as before (figures: docs/tuning/gateway_cpu.md).
"""
from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn

TICK_S = 1.0


def _wake(tick: asyncio.Future) -> None:
    if not tick.done():
        tick.set_result(None)


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` whose main loop ticks every :data:`TICK_S` seconds (see the module
    docstring); everything else is uvicorn's."""

    _tick: asyncio.Future | None = None

    async def main_loop(self) -> None:
        loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick does its once-a-second work when counter % 10 == 0
            self._tick = tick = loop.create_future()
            timer = loop.call_later(TICK_S, _wake, tick)
            try:
                await tick
            finally:
                timer.cancel()
                self._tick = None
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        tick = self._tick
        if tick is not None:
            tick.get_loop().call_soon_threadsafe(_wake, tick)
