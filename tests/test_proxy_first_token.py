"""The relay passes a stream's first bytes to the client before the first token's bookkeeping
(``router/proxy.py``): on a busy host the gateway waits for CPU, and that work (learning the
worker's TTFT line, the decision log) must not delay the client's first token. A real aiohttp
server streams the events; the relay writes through a recording ASGI ``send``."""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from router.config import HealthConfig, TimeoutsConfig, WorkerConfig
from router.metrics import GatewayMetrics
from router.proxy import ClientState, Upstream
from router.registry import WorkerRegistration

EVENTS = [b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n',
          b'data: {"choices": [{"delta": {"content": "b"}}]}\n\n',
          b"data: [DONE]\n\n"]


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in EVENTS:
        await resp.write(event)
        await asyncio.sleep(0.05)  # each event its own read on the relay's side
    await resp.write_eof()
    return resp


async def test_first_chunk_reaches_the_client_before_the_first_token_bookkeeping():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    reg = WorkerRegistration(WorkerConfig(id="w0", url=f"http://127.0.0.1:{port}", model="m"))
    upstream = Upstream(TimeoutsConfig(), HealthConfig(), GatewayMetrics(lambda: [reg]))
    await upstream.start()
    seen: list[tuple[str, bytes | None]] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            seen.append(("body", message["body"]))

    def on_first_token(handle) -> None:
        assert handle.reg is reg and handle.ttft_ms is not None and handle.ttft_ms > 0
        seen.append(("first_token", None))

    try:
        await asyncio.wait_for(upstream.relay(
            send, ClientState(), "POST", "/v1/chat/completions", b"{}", [], "r1", [reg],
            t0=time.perf_counter(), on_first_token=on_first_token), timeout=30)
    finally:
        await upstream.close()
        await runner.cleanup()
    bodies = [b for kind, b in seen if kind == "body"]
    assert b"".join(bodies) == b"".join(EVENTS)  # the stream, whole and in order
    assert seen[0] == ("body", EVENTS[0]) and seen[1] == ("first_token", None)  # first bytes, then bookkeeping
    assert [kind for kind, _ in seen].count("first_token") == 1
