"""The gateway's uvicorn server (router/edge/server.py): its main loop ticks once a second and a
shutdown signal wakes it at once."""
from __future__ import annotations

import asyncio
import signal

import uvicorn

from router.edge import server as server_mod
from router.edge.server import GatewayServer


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def _server() -> GatewayServer:
    return GatewayServer(uvicorn.Config(_app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))


def test_a_shutdown_signal_wakes_the_main_loop_at_once(monkeypatch):
    monkeypatch.setattr(server_mod, "TICK_S", 60.0)  # a tick would never come within the test's bound

    async def main():
        server = _server()
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        while server._tick is None:  # the main loop waits for its tick
            await asyncio.sleep(0.01)
        server.handle_exit(signal.SIGTERM, None)
        server._captured_signals.clear()  # else uvicorn re-raises SIGTERM in this process once it has stopped
        await asyncio.wait_for(task, 10)
        assert server.should_exit

    asyncio.run(main())


def test_every_tick_does_the_once_a_second_work(monkeypatch):
    monkeypatch.setattr(server_mod, "TICK_S", 0.01)
    counters: list[int] = []

    async def main():
        server = _server()
        real_on_tick = server.on_tick

        async def on_tick(counter: int) -> bool:
            counters.append(counter)
            return await real_on_tick(counter)

        server.on_tick = on_tick
        task = asyncio.create_task(server.serve())
        while len(counters) < 4:
            await asyncio.sleep(0.01)
        server.should_exit = True
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert len(counters) >= 4
    assert all(c % 10 == 0 for c in counters)  # uvicorn refreshes its default headers when counter % 10 == 0
    assert len(set(counters[:4])) == 4
