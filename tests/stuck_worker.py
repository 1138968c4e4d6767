"""Test helper: a worker that is alive but stuck. ``GET /health`` answers 200 at once; every
other request is accepted and then left without an answer for ``--hang-s`` seconds (a vLLM
server whose event loop is wedged behind one call, or a proxy that lost its upstream).

Run: ``python tests/stuck_worker.py --port P [--hang-s 120]``; it exits by itself after
``--life-s`` seconds.
"""
from __future__ import annotations

import argparse
import asyncio

from aiohttp import web


def make_app(hang_s: float) -> web.Application:
    """The stuck server's routes: 200 ``{}`` on /health, a ``hang_s`` wait on anything else."""

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    async def hang(_request: web.Request) -> web.Response:
        await asyncio.sleep(hang_s)
        return web.json_response({"object": "list", "data": [{"id": "stuck-model", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", hang)
    return app


async def _main(port: int, hang_s: float, life_s: float) -> None:
    runner = web.AppRunner(make_app(hang_s))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.sleep(life_s)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--hang-s", type=float, default=120.0)
    p.add_argument("--life-s", type=float, default=300.0)
    a = p.parse_args()
    asyncio.run(_main(a.port, a.hang_s, a.life_s))
