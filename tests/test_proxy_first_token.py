"""The relay passes a stream's first bytes to the client before the first token's bookkeeping
(``router/relay/upstream.py``): on a busy host the gateway waits for CPU, and that work (learning the
worker's TTFT line, the decision log) must not delay the client's first token. A real aiohttp
server streams the events; the relay writes through a recording ASGI ``send``."""
from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from router.config.schema import HealthConfig, TimeoutsConfig, WorkerConfig
from router.relay.upstream import ClientState, RelayHooks, RelayRequest, Upstream, opening_only
from router.telemetry.metrics import GatewayMetrics
from router.workers.registry import WorkerRegistration

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


@contextlib.asynccontextmanager
async def serving(path: str, handler):
    """A real aiohttp worker answering ``path`` with ``handler``, and an :class:`Upstream` to it:
    yields ``(upstream, registration)``."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    reg = WorkerRegistration(WorkerConfig(id="w0", url=f"http://127.0.0.1:{port}", model="m"))
    upstream = Upstream(TimeoutsConfig(), HealthConfig(), GatewayMetrics(lambda: [reg]))
    await upstream.start()
    try:
        yield upstream, reg
    finally:
        await upstream.close()
        await runner.cleanup()


async def test_first_chunk_reaches_the_client_before_the_first_token_bookkeeping():
    seen: list[tuple[str, bytes | None]] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            seen.append(("body", message["body"]))

    async with serving("/v1/chat/completions", _stream) as (upstream, reg):
        def on_first_token(handle) -> None:
            assert handle.reg is reg and handle.ttft_ms is not None and handle.ttft_ms > 0
            seen.append(("first_token", None))

        req = RelayRequest("POST", "/v1/chat/completions", b"{}", [], "r1", time.perf_counter())
        await asyncio.wait_for(upstream.relay(send, ClientState(), req, [reg], RelayHooks(on_first_token=on_first_token)),
                               timeout=30)
    bodies = [b for kind, b in seen if kind == "body"]
    assert b"".join(bodies) == b"".join(EVENTS)  # the stream, whole and in order
    assert seen[0] == ("body", EVENTS[0]) and seen[1] == ("first_token", None)  # first bytes, then bookkeeping
    assert [kind for kind, _ in seen].count("first_token") == 1


RESPONSES_EVENTS = [
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1}\n\n',
    b'event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":2}\n\n'
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":{}}\n\n']
PREFILL_S = 0.3


async def _responses_stream(request: web.Request) -> web.StreamResponse:
    """vLLM's order: the opening events as the request is accepted, the first token after the prefill."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(RESPONSES_EVENTS[0])
    await asyncio.sleep(PREFILL_S)
    for event in RESPONSES_EVENTS[1:]:
        await resp.write(event)
        await asyncio.sleep(0.05)
    await resp.write_eof()
    return resp


def test_opening_only_tells_the_responses_preamble_from_a_token():
    assert opening_only(RESPONSES_EVENTS[0])
    assert not opening_only(RESPONSES_EVENTS[1]) and not opening_only(RESPONSES_EVENTS[0] + RESPONSES_EVENTS[1])
    assert not opening_only(EVENTS[0])  # chat: the first bytes carry the first token
    assert not opening_only(b'event: message_start\ndata: {"type":"message_start"}\n\n')


async def test_a_responses_stream_counts_as_prefilled_at_its_first_token_not_its_opening():
    """vLLM sends ``response.created`` before the prefill: the request stays in prefill (the
    worker's load, the TTFT learnt) until the first token's event."""
    seen: list = []
    async with serving("/v1/responses", _responses_stream) as (upstream, reg):
        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message["body"]:
                seen.append((message["body"], reg.decoding))

        req = RelayRequest("POST", "/v1/responses", b"{}", [], "r1", time.perf_counter())
        hooks = RelayHooks(on_first_token=lambda handle: seen.append(("ttft_ms", handle.ttft_ms)))
        await asyncio.wait_for(upstream.relay(send, ClientState(), req, [reg], hooks), timeout=30)
    assert seen[0] == (RESPONSES_EVENTS[0], 0)  # relayed at once, still in prefill
    assert seen[1][0] == RESPONSES_EVENTS[1] and seen[2][0] == "ttft_ms"
    assert seen[2][1] >= PREFILL_S * 1000 * 0.9  # the first token's time, not the opening's
