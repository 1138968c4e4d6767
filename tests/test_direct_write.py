"""router/relay/direct_write.py against a real uvicorn server (httptools, as ``kvroute serve``
runs it): the bytes a client reads on a raw socket are those ASGI ``send`` writes for the same
response, keep-alive and ``Connection: close`` are honoured, and every other set-up keeps ASGI."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import uvicorn
from aiohttp import web

from router.config.schema import HealthConfig, TimeoutsConfig, WorkerConfig
from router.relay.direct_write import DirectWriter, writer_for
from router.relay.upstream import ClientState, RelayRequest, Upstream
from router.telemetry.metrics import GatewayMetrics
from router.workers.registry import WorkerRegistration

HEADERS = [(b"content-type", b"text/event-stream"), (b"x-kvroute-worker", b"w0")]
PIECES = [b"data: 1\n\n", b"data: two\n\n", b"x" * 70_000]
LAST = b"data: [DONE]\n\n"
BODY = b'{"id": "cmpl-1", "choices": []}'
BIG = b"[" + b"0," * (4 << 20) + b"0]"
seen: dict[str, object] = {}


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    path, status = scope["path"], int(dict(scope["headers"]).get(b"x-status", b"200"))
    writer = writer_for(send)
    seen[path] = writer
    if path == "/asgi-stream":
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        for piece in PIECES:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": LAST, "more_body": False})
    elif path == "/direct-stream":
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        assert writer.chunked
        for piece in PIECES:
            writer.chunk(piece)
        await send({"type": "http.response.body", "body": LAST, "more_body": False})
    elif path == "/asgi-whole":
        await send({"type": "http.response.start", "status": status,
                    "headers": HEADERS[1:] + [(b"content-length", b"%d" % len(BODY))]})
        await send({"type": "http.response.body", "body": BODY, "more_body": False})
    elif path == "/direct-whole":
        assert writer.whole(status, HEADERS[1:], BODY)
    elif path == "/direct-big":  # 8 MiB to a client that reads nothing yet: written, completed, returned
        assert writer.whole(200, HEADERS[1:], BIG)
        seen["big returned"].set()
    elif path == "/refused":  # what whole() leaves to send: nothing is written
        assert not writer.whole(204, [], b"")
        assert not writer.whole(200, [(b"Content-Length", b"3")], b"abc")
        assert not writer.whole(200, [(b"connection", b"close")], b"abc")
        with pytest.raises(RuntimeError, match="Invalid HTTP header value"):
            writer.whole(200, [(b"x-a", b"1\r\nx-b: 2")], b"abc")
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif path == "/flood":  # 4 MB in 16 KB chunks, waiting whenever the client's buffer is full
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        pauses = 0
        for i in range(256):
            writer.chunk(bytes([65 + i % 26]) * 16384)
            if writer.paused:
                pauses += 1
                await writer.drain()
        seen["pauses"] = pauses
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif path == "/relay":  # the gateway's relay of a worker's answer (router/relay/upstream.py)
        upstream, reg, req = seen["relay"]
        await upstream.relay(send, ClientState(), req, [reg])
        seen["relay in flight"] = reg.in_flight
        seen["relay returned"].set()
    elif path == "/wrapped":
        async def wrapped(message):
            await send(message)
        seen[path] = writer_for(wrapped)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@contextlib.asynccontextmanager
async def serve(**kw):
    """uvicorn as ``kvroute serve`` configures it (router/cli.py), ``kw`` changed."""
    kw = {"access_log": False, "date_header": False, "server_header": False, "proxy_headers": False, **kw}
    config = uvicorn.Config(app, host="127.0.0.1", port=0, loop="none", http="httptools", lifespan="off",
                            log_level="warning", **kw)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One whole response's bytes as sent (Content-Length or chunked framing)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    if b"content-length:" in lower:
        n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
        return head + await reader.readexactly(n)
    if b"transfer-encoding: chunked" not in lower:
        return head
    out = head
    while True:
        size_line = await reader.readuntil(b"\r\n")
        n = int(size_line.strip(), 16)
        out += size_line + await reader.readexactly(n + 2)
        if n == 0:
            return out


async def exchange(port: int, paths: list[str], extra: bytes = b"") -> list[bytes]:
    """The responses to POSTs of ``paths`` in turn on one connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        out = []
        for path in paths:
            writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n%s\r\n{}" % (path.encode(), extra))
            out.append(await asyncio.wait_for(read_response(reader), 10))
        return out
    finally:
        writer.close()


async def small_window_post(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose receive buffer is 4 KiB, with a POST of ``path`` sent on it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
    writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % path.encode())
    return reader, writer


async def test_a_direct_stream_is_the_bytes_asgi_writes():
    async with serve(server_header=True) as port:
        asgi, direct, again = await exchange(port, ["/asgi-stream", "/direct-stream", "/direct-stream"])
    assert direct == asgi == again  # and the connection stayed usable: the response was completed
    assert asgi.startswith(b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream\r\n")
    assert b"%x\r\n%s\r\n" % (len(PIECES[2]), PIECES[2]) in asgi
    assert asgi.endswith(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


@pytest.mark.parametrize("status", [200, 400, 503])
async def test_a_direct_whole_answer_is_the_bytes_asgi_writes(status):
    async with serve(server_header=True) as port:
        extra = b"x-status: %d\r\n" % status
        asgi, direct, again = await exchange(port, ["/asgi-whole", "/direct-whole", "/asgi-whole"], extra)
    assert direct == asgi == again
    assert asgi.split(b"\r\n")[0] == b"HTTP/1.1 %d " % status + asgi.split(b"\r\n")[0].split(b" ", 2)[2]
    assert asgi.endswith(b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))


async def test_a_client_asking_to_close_gets_connection_close_and_the_close():
    async with serve() as port:
        for path in ("/asgi-whole", "/direct-whole"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
                         % path.encode())
            got = await asyncio.wait_for(reader.read(), 10)  # to the server's close
            writer.close()
            assert b"\r\nconnection: close\r\n" in got.split(b"\r\n\r\n")[0] + b"\r\n"
            assert got.endswith(BODY)
            seen[path + " close"] = got
    assert seen["/asgi-whole close"] == seen["/direct-whole close"]


async def test_what_the_writer_refuses_and_where_there_is_none():
    async with serve() as port:
        refused, wrapped = await exchange(port, ["/refused", "/wrapped"])
    assert refused == b"HTTP/1.1 204 No Content\r\n\r\n"
    assert seen["/wrapped"] is None  # a middleware's send keeps ASGI
    async with serve(access_log=True) as port:  # written in send: ASGI keeps it
        await exchange(port, ["/asgi-whole"])
    assert seen["/asgi-whole"] is None


async def test_a_slow_client_pauses_the_writer_and_gets_every_byte():
    """A client with a small receive window reading slowly: the writer reports the client's
    buffer full (``paused``), ``drain`` waits for it, and every byte arrives in order."""
    async with serve() as port:
        reader, writer = await small_window_post(port, "/flood")
        got = await asyncio.wait_for(read_response(reader), 30)
        writer.close()
    body = b"".join(got.split(b"\r\n\r\n", 1)[1].split(b"\r\n")[1::2])  # the chunks' data
    assert body == b"".join(bytes([65 + i % 26]) * 16384 for i in range(256))
    assert seen["pauses"] > 0


@contextlib.asynccontextmanager
async def relaying(handler):
    """A real aiohttp worker answering ``/v1/completions`` with ``handler`` and the gateway's
    :class:`Upstream` to it, behind uvicorn's ``/relay``: yields uvicorn's port."""
    app_ = web.Application()
    app_.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app_)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    reg = WorkerRegistration(WorkerConfig(id="w0", url=f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}",
                                          model="m"))
    upstream = Upstream(TimeoutsConfig(), HealthConfig(), GatewayMetrics(lambda: [reg]))
    await upstream.start()
    seen["relay"] = (upstream, reg, RelayRequest("POST", "/v1/completions", b"{}", [], "r1", time.perf_counter()))
    seen["relay returned"] = asyncio.Event()
    try:
        async with serve() as port:
            yield port
    finally:
        await upstream.close()
        await runner.cleanup()


EVENT = b"data: " + b"x" * 16377 + b"\n\n"  # 16 KiB
N_EVENTS = 1024  # 16 MiB: more than the sockets' kernel buffers hold


async def test_the_relay_waits_for_a_stalled_client_and_loses_nothing(monkeypatch):
    """The relay's direct path under back-pressure: a worker streaming 16 MiB to a client with a
    4 KiB receive window that reads nothing until the worker's stream stalls (the gateway has
    stopped reading it): the relay waited on the client's socket (``DirectWriter.drain``) and
    the client gets every byte in order."""
    drains = []
    real_drain = DirectWriter.drain

    async def counted_drain(self):
        drains.append(time.monotonic())
        await real_drain(self)

    monkeypatch.setattr(DirectWriter, "drain", counted_drain)
    written = [0]

    async def worker(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(N_EVENTS):
            await resp.write(EVENT)
            written[0] += 1
        await resp.write_eof()
        return resp

    async with relaying(worker) as port:
        reader, writer = await small_window_post(port, "/relay")
        async with asyncio.timeout(30):  # the worker stalls: the relay stopped reading it
            last = -1
            while written[0] != last or not drains:
                last = written[0]
                await asyncio.sleep(0.2)
        assert written[0] < N_EVENTS
        got = await asyncio.wait_for(read_response(reader), 60)
        writer.close()
    head, _, chunked = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
    assert b"\r\nx-kvroute-worker: w0\r\nx-request-id: r1\r\ntransfer-encoding: chunked" in head
    body, rest = bytearray(), memoryview(chunked)
    while True:
        end = bytes(rest[:16]).index(b"\r\n")
        n = int(bytes(rest[:end]), 16)
        if n == 0:
            break
        body += rest[end + 2:end + 2 + n]
        rest = rest[end + 4 + n:]
    assert body == EVENT * N_EVENTS and written[0] == N_EVENTS
    assert drains


async def test_a_whole_answer_does_not_wait_for_a_stalled_client():
    """8 MiB, far more than the sockets hold, to a client with a 4 KiB window that reads nothing
    until the handler has returned: ``whole`` writes and completes the response without waiting
    for the client (as ASGI's two sends do), the client then reads all of it, and the connection
    serves the next request."""
    seen["big returned"] = asyncio.Event()
    async with serve() as port:
        reader, writer = await small_window_post(port, "/direct-big")
        await asyncio.wait_for(seen["big returned"].wait(), 10)
        got = await asyncio.wait_for(read_response(reader), 60)
        writer.write(b"POST /asgi-whole HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        after = await asyncio.wait_for(read_response(reader), 10)
        writer.close()
    assert got.endswith(b"\r\ncontent-length: %d\r\n\r\n" % len(BIG) + BIG)
    assert after.endswith(BODY)


async def test_the_relay_of_a_whole_answer_ends_before_a_stalled_client_reads_it():
    """16 MiB of JSON relayed to a client that reads nothing until the relay has returned: the
    worker's answer is written in one piece and the relay ends at once, its in-flight count
    released (a client's pace must not hold a worker's load figures), then the client gets it all."""
    async def worker(request: web.Request) -> web.Response:
        return web.Response(body=BIG * 2, content_type="application/json")

    async with relaying(worker) as port:
        reader, writer = await small_window_post(port, "/relay")
        await asyncio.wait_for(seen["relay returned"].wait(), 10)
        assert seen["relay in flight"] == 0
        got = await asyncio.wait_for(read_response(reader), 60)
        writer.close()
    assert got.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    assert got.endswith(b"\r\nx-kvroute-worker: w0\r\nx-request-id: r1\r\ncontent-length: %d\r\n\r\n"
                        % (2 * len(BIG)) + BIG * 2)
