"""The relay's HTTP/1.1 client (``router/upstream_http.py``) against real servers on loopback:
raw asyncio servers (full control of the bytes and the connection), aiohttp.web servers, and
a TLS server with a self-signed certificate. What the worker sees is compared with what the
gateway's aiohttp session sent for the same call."""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess

import aiohttp
import pytest
from aiohttp import web

from router.upstream_http import (HIGH_WATER, UpstreamConnectError, UpstreamDisconnected, UpstreamHTTP,
                                  UpstreamIdleTimeout, UpstreamPayloadError, UpstreamTimeout)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request's head and body (Content-Length framed); None at the connection's end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return head, body


class RawServer:
    """An asyncio server running ``handler(server, reader, writer, n)`` per connection (``n``:
    its number, from 1); counts connections and those that ended (``lost``), records requests."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.connections = 0
        self.lost = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.lost_event = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        try:
            await self.handler(self, reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.lost += 1
            self.lost_event.set()

    async def next_request(self, reader) -> tuple[bytes, bytes] | None:
        got = await read_request(reader)
        if got is not None:
            self.requests.append(got)
        return got


def ok(body: bytes, content_type: bytes = b"application/json", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n"
            % (content_type, len(body), extra)) + body


async def answer_all(server, reader, writer, n) -> None:
    """Keep-alive: answers every request with its own body echoed."""
    while (got := await server.next_request(reader)) is not None:
        writer.write(ok(b"echo:" + got[1]))
        await writer.drain()


@contextlib.asynccontextmanager
async def web_server(routes, **runner_kw):
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, **runner_kw)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def client(**kw):
    http = UpstreamHTTP(**kw)
    try:
        yield http
    finally:
        await http.close()


async def test_content_length_and_chunked_bodies():
    big = bytes(range(256)) * 4000  # ~1 MB

    async def fixed(request):
        return web.Response(body=big, content_type="application/octet-stream")

    async def chunked(request):
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        resp.content_type = "application/json"
        await resp.prepare(request)
        for i in range(0, len(big), 100_000):
            await resp.write(big[i:i + 100_000])
        await resp.write_eof()
        return resp

    async with web_server([web.get("/fixed", fixed), web.get("/chunked", chunked)]) as url, client() as http:
        for path in ("/fixed", "/chunked", "/fixed"):
            resp = await http.request("GET", url + path, [])
            assert resp.status == 200
            assert await resp.read() == big
            resp.release()
        assert resp.content_type == "application/octet-stream"
        assert http.idle_connections() == 1


async def test_event_stream_pieces_arrive_one_by_one():
    events = [b"data: %d\n\n" % i for i in range(5)]

    async def sse(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp

    async with web_server([web.post("/v1/completions", sse)]) as url, client() as http:
        resp = await http.request("POST", url + "/v1/completions", [], b"{}")
        assert resp.content_type == "text/event-stream"
        got = []
        while piece := await resp.readany():
            got.append(piece)
        assert got == events  # each as it came, none held back for the next
        assert await resp.readany() == b""
        resp.release()
        assert http.idle_connections() == 1


async def test_keep_alive_one_connection_for_twenty_requests():
    async with RawServer(answer_all) as server, client() as http:
        for i in range(20):
            resp = await http.request("POST", server.url + "/x", [], b"%d" % i)
            assert await resp.read() == b"echo:%d" % i
            resp.release()
        assert server.connections == 1
        assert len(server.requests) == 20


async def test_a_server_closing_idle_connections_after_one_second_fails_no_request():
    async def hello(request):
        return web.json_response({"ok": True})

    async with web_server([web.post("/c", hello)], keepalive_timeout=1.0) as url, client() as http:
        for i, pause in enumerate((0.0, 0.9, 0.97, 1.0, 1.03, 1.1, 0.5, 1.0)):
            await asyncio.sleep(pause)
            resp = await http.request("POST", url + "/c", [], b"{}")
            assert resp.status == 200, i
            assert await resp.read() == b'{"ok": true}'
            resp.release()


async def test_a_pooled_connection_closed_as_the_request_goes_out_is_retried_on_a_new_one():
    async def one_then_close(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(ok(b"first"))
        await writer.drain()
        await server.next_request(reader)  # the second request on this connection: closed unanswered

    async with RawServer(one_then_close) as server, client() as http:
        for _ in range(4):
            resp = await http.request("POST", server.url + "/c", [], b"{}")
            assert await resp.read() == b"first"
            resp.release()
        assert server.connections == 4  # each connection's second request: closed, retried on a new one
        assert len(server.requests) == 7


async def test_a_fresh_connection_closed_before_the_answer_is_an_upstream_disconnect():
    async def close_at_once(server, reader, writer, n):
        await server.next_request(reader)

    async with RawServer(close_at_once) as server, client() as http:
        with pytest.raises(UpstreamDisconnected):
            await http.request("POST", server.url + "/c", [], b"{}")
        assert server.connections == 1  # not retried: the connection was new


async def test_a_server_dying_mid_stream_is_a_payload_error():
    async def dies(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"b\r\ndata: one\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)

    async with RawServer(dies) as server, client() as http:
        resp = await http.request("POST", server.url + "/s", [], b"{}")
        assert await resp.readany() == b"data: one\n\n"
        with pytest.raises(UpstreamPayloadError):
            await resp.readany()
        resp.release()  # not pooled
        assert http.idle_connections() == 0


async def test_a_content_length_body_cut_short_is_a_payload_error():
    async def short(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    async with RawServer(short) as server, client() as http:
        resp = await http.request("GET", server.url + "/", [])
        with pytest.raises(UpstreamPayloadError):
            await resp.read()


async def test_a_body_that_runs_to_the_connections_end():
    async def until_close(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart one, ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"part two")
        await writer.drain()

    async with RawServer(until_close) as server, client() as http:
        resp = await http.request("GET", server.url + "/", [])
        assert await resp.read() == b"part one, part two"
        resp.release()
        assert http.idle_connections() == 0


async def test_garbage_is_a_payload_error_not_a_disconnect():
    async def garbage(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(b"\x00\x01 this is not HTTP \xff\r\n\r\n")
        await writer.drain()

    async with RawServer(garbage) as server, client() as http:
        with pytest.raises(UpstreamPayloadError):
            await http.request("GET", server.url + "/", [])


async def test_connection_refused_and_unknown_host_are_connect_errors():
    sock_server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = sock_server.sockets[0].getsockname()[1]
    sock_server.close()
    await sock_server.wait_closed()
    async with client(connect_timeout_s=5) as http:
        with pytest.raises(UpstreamConnectError):
            await http.request("POST", f"http://127.0.0.1:{port}/v1/completions", [], b"{}")
        with pytest.raises(UpstreamConnectError):
            await http.request("GET", "http://no-such-host.invalid:8000/", [])


async def test_a_large_body_read_slowly_stays_bounded_in_memory():
    size = 20 * 1024 * 1024
    sent = asyncio.Event()

    async def huge(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        piece = b"x" * (1024 * 1024)
        for _ in range(20):
            writer.write(piece)
            await writer.drain()
        sent.set()
        await asyncio.sleep(30)

    async with RawServer(huge) as server, client() as http:
        resp = await http.request("GET", server.url + "/big", [])
        got = 0
        paused_seen = False
        peak = 0
        reads = 0
        while piece := await resp.readany():
            got += len(piece)
            reads += 1
            if reads <= 20:
                await asyncio.sleep(0.02)  # a slow client
                peak = max(peak, resp._size)
                paused_seen = paused_seen or resp._paused
                assert not sent.is_set()  # the server is held back by the paused socket
        assert got == size
        assert paused_seen
        # at most the high-water mark plus one socket read (uvloop reads up to 256 KiB at once)
        assert peak <= HIGH_WATER + 256 * 1024
        resp.release()
        assert http.idle_connections() == 1


async def test_cancelling_a_request_closes_its_connection():
    async def stream(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        async def tick():
            while True:
                writer.write(b"9\r\ndata: x\n\n\r\n")
                await asyncio.sleep(0.05)

        ticker = asyncio.create_task(tick())
        try:
            await reader.read()  # until the client closes
        finally:
            ticker.cancel()

    async def hang(server, reader, writer, n):
        await server.next_request(reader)
        await reader.read()  # until the client closes

    async def reading(http, url):
        resp = await http.request("POST", url, [], b"{}")
        try:
            while await resp.readany():
                pass
        finally:
            resp.close()  # what the relay does when cancelled

    for handler, work in ((stream, reading), (hang, lambda http, url: http.request("POST", url, [], b"{}"))):
        async with RawServer(handler) as server, client() as http:
            task = asyncio.create_task(work(http, server.url + "/s"))
            await asyncio.sleep(0.3)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.wait_for(server.lost_event.wait(), 2)  # the server saw the connection close
            assert server.lost == 1
            assert http.idle_connections() == 0


async def test_head_and_204_have_no_body():
    async def head_or_get(request):
        return web.Response(body=b"0123456789")

    async def nothing(request):
        return web.Response(status=204)

    async with web_server([web.get("/r", head_or_get), web.post("/n", nothing)]) as url, client() as http:
        resp = await http.request("HEAD", url + "/r", [])
        assert resp.status == 200
        assert await resp.read() == b""
        assert [v for k, v in resp.raw_headers if k.lower() == b"content-length"] == [b"10"]
        resp.release()
        for _ in range(2):
            resp = await http.request("POST", url + "/n", [], b"{}")
            assert resp.status == 204
            assert await resp.read() == b""
            resp.release()
        assert http.idle_connections() == 1  # the 204's connection is reused
        resp = await asyncio.wait_for(http.request("GET", url + "/r", []), 5)
        assert await resp.read() == b"0123456789"


async def test_the_total_time_limit():
    async def stall(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
        await writer.drain()
        await reader.read()

    async with RawServer(stall) as server, client(total_s=0.3) as http:
        resp = await http.request("GET", server.url + "/", [])
        with pytest.raises(UpstreamTimeout):
            await resp.read()
        await asyncio.wait_for(server.lost_event.wait(), 2)


async def test_a_stream_longer_than_the_idle_limit_is_read_whole_and_a_silence_past_it_fails():
    """``readany(idle_s)``: the limit is per wait (a stream of 30 pieces 50 ms apart outlasts a
    1 s limit), a timer that fires while nothing waits fails nothing, and a wait of 1 s raises."""
    sent_all = asyncio.Event()
    second_written = asyncio.Event()

    async def stream(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(30):
            writer.write(b"a\r\ndata: %02d\n\n\r\n" % i)
            await writer.drain()
            await asyncio.sleep(0.05)
        sent_all.set()
        await asyncio.sleep(0.4)  # the worker stalls, with one more piece to come after
        writer.write(b"a\r\ndata: 30\n\n\r\n")
        await writer.drain()
        second_written.set()
        await reader.read()  # then silence until the client goes

    loop = asyncio.get_running_loop()
    async with RawServer(stream) as server, client() as http:
        resp = await http.request("POST", server.url + "/v1/completions", [], b"{}")
        got = []
        while len(got) < 30:
            got.append(await resp.readany(idle_s=1.0))
        assert b"".join(got) == b"".join(b"data: %02d\n\n" % i for i in range(30))
        # the reader is busy elsewhere while the limit's timer (armed by a wait) comes due
        t = loop.time()
        await sent_all.wait()
        await second_written.wait()
        assert loop.time() - t > 0.3
        assert await resp.readany(idle_s=0.3) == b"data: 30\n\n"
        t = loop.time()
        with pytest.raises(UpstreamIdleTimeout, match="no data for 1.0 s"):
            await resp.readany(idle_s=1.0)
        assert loop.time() - t >= 0.99
        resp.close()
        await asyncio.wait_for(server.lost_event.wait(), 2)


async def test_idle_connections_are_capped_and_expire():
    async with RawServer(answer_all) as server, client(max_idle_per_host=2, keepalive_s=0.3) as http:
        resps = await asyncio.gather(*[http.request("POST", server.url + "/", [], b"%d" % i) for i in range(5)])
        for resp in resps:
            await resp.read()
            resp.release()
        assert server.connections == 5
        assert http.idle_connections() == 2
        await asyncio.sleep(1.6)
        assert http.idle_connections() == 0
        assert server.lost == 5


def _heads_fields(head: bytes) -> list[bytes]:
    return head.split(b"\r\n")


@pytest.mark.parametrize("method,body", [("POST", b'{"model": "tiny", "prompt": "h\xc3\xa9llo"}'),
                                         ("POST", b""), ("GET", b""), ("DELETE", b"")])
async def test_the_worker_sees_what_aiohttp_sent(method, body):
    """The same call through the gateway's aiohttp session (as configured in Upstream.start) and
    through this client: byte-identical request heads and bodies."""
    headers = [("content-type", "application/json"), ("authorization", "Bearer s3cr\u00e9t"),
               ("X-data-parallel-rank", "1"), ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
               ("Accept-Encoding", "identity"), ("x-request-id", "r-1")]
    async with RawServer(answer_all) as server, client() as http:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Content-Type"))
        try:
            for hdrs in (headers, headers + [("accept", "text/event-stream")]):
                r = await session.request(method, server.url + "/v1/chat/completions", data=body or None,
                                          headers=hdrs)
                await r.read()
                r.release()
                resp = await http.request(method, server.url + "/v1/chat/completions", hdrs, body)
                await resp.read()
                resp.release()
                (a_head, a_body), (l_head, l_body) = server.requests[-2:]
                assert l_head == a_head
                assert l_body == a_body == body
        finally:
            await session.close()


async def test_a_header_with_a_newline_is_refused():
    async with RawServer(answer_all) as server, client() as http:
        with pytest.raises(ValueError):
            await http.request("GET", server.url + "/", [("x-a", "b\r\nx-evil: 1")])
        assert server.requests == []


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


async def test_https_workers(self_signed):
    cert, key = self_signed
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    server = RawServer(answer_all)
    server._server = await asyncio.start_server(server._serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server._server.sockets[0].getsockname()[1]
    try:
        # aiohttp's default context: a self-signed certificate fails the handshake, a connect error
        async with client() as http:
            with pytest.raises(UpstreamConnectError):
                await http.request("POST", f"https://localhost:{port}/x", [], b"1")
        trusting = ssl.create_default_context(cafile=str(cert))
        async with client(ssl_context=trusting) as http:
            for i in range(3):
                resp = await http.request("POST", f"https://localhost:{port}/x", [], b"%d" % i)
                assert await resp.read() == b"echo:%d" % i
                resp.release()
        assert server.requests[-1][0].split(b"\r\n")[1] == b"Host: localhost:%d" % port
        assert server.connections == 1  # the failed handshake never reached the handler; one connection, reused
    finally:
        server._server.close()


def _sse_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_pipe_hands_each_read_to_the_sink_from_the_connection_callback():
    """``pipe``: each piece as it arrives, in order, called outside any task (from the
    connection's ``data_received``, no task switch per piece); True at the end; the connection
    is pooled after, as after ``readany``."""
    events = [b"data: %d\n\n" % i for i in range(5)]

    async def stream(server, reader, writer, n):
        while await server.next_request(reader) is not None:
            writer.write(_sse_head())
            for event in events:
                writer.write(_chunk(event))
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with RawServer(stream) as server, client() as http:
        for _ in range(2):
            resp = await http.request("POST", server.url + "/v1/completions", [], b"{}")
            got, tasks = [], []

            def sink(data: bytes) -> bool:
                got.append(data)
                tasks.append(asyncio.current_task())
                return True

            assert await resp.pipe(sink, idle_s=5.0) is True
            assert b"".join(got) == b"".join(events)
            assert len(got) >= 3  # pieces 50 ms apart are not held back for the next
            assert tasks[-1] is None  # run by the connection, not by a task
            resp.release()
        assert server.connections == 1 and http.idle_connections() == 1


async def test_a_paused_pipe_keeps_what_follows_for_the_next():
    sent_all = asyncio.Event()

    async def stream(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(_sse_head() + _chunk(b"data: 0\n\n"))
        await writer.drain()
        await asyncio.sleep(0.1)
        for i in (1, 2):
            writer.write(_chunk(b"data: %d\n\n" % i))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        sent_all.set()
        await reader.read()

    async with RawServer(stream) as server, client() as http:
        resp = await http.request("POST", server.url + "/s", [], b"{}")
        got = []
        assert await resp.pipe(lambda d: got.append(d) and False) is False  # paused after the first
        assert got == [b"data: 0\n\n"]
        await sent_all.wait()
        await asyncio.sleep(0.05)
        assert got == [b"data: 0\n\n"]  # nothing handed on while paused
        calls = []
        assert await resp.pipe(lambda d: calls.append(d) or True) is True
        assert calls == [b"data: 1\n\ndata: 2\n\n"]  # what waited, in one call
        resp.release()
        assert http.idle_connections() == 1


async def test_pipe_failures_reach_the_piping_coroutine():
    """A worker dying mid-stream (after what it sent is handed on), a silence past ``idle_s``,
    and the sink's own exception each fail the pipe; the connection is never pooled after."""
    async def dies(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(_sse_head() + _chunk(b"data: one\n\n"))
        await writer.drain()
        await asyncio.sleep(0.1)

    async def silent(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(_sse_head() + _chunk(b"data: one\n\n"))
        await writer.drain()
        await reader.read()

    async with RawServer(dies) as server, client() as http:
        resp = await http.request("POST", server.url + "/s", [], b"{}")
        got = []
        with pytest.raises(UpstreamPayloadError):
            await resp.pipe(lambda d: got.append(d) or True)
        assert got == [b"data: one\n\n"]
        resp.release()
        assert http.idle_connections() == 0

    loop = asyncio.get_running_loop()
    async with RawServer(silent) as server, client() as http:
        resp = await http.request("POST", server.url + "/s", [], b"{}")
        got = []
        t = loop.time()
        with pytest.raises(UpstreamIdleTimeout, match="no data for 0.3 s"):
            await resp.pipe(lambda d: got.append(d) or True, idle_s=0.3)
        assert got == [b"data: one\n\n"] and loop.time() - t >= 0.29
        resp.close()
        await asyncio.wait_for(server.lost_event.wait(), 2)

    async with RawServer(silent) as server, client() as http:
        resp = await http.request("POST", server.url + "/s", [], b"{}")

        def broken(data: bytes) -> bool:
            raise ValueError("sink failed")

        with pytest.raises(ValueError, match="sink failed"):
            await resp.pipe(broken)
        resp.close()


async def test_a_cancelled_pipe_hands_on_nothing_more():
    second_sent = asyncio.Event()

    async def stream(server, reader, writer, n):
        await server.next_request(reader)
        writer.write(_sse_head() + _chunk(b"data: 0\n\n"))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(_chunk(b"data: 1\n\n") + b"0\r\n\r\n")
        await writer.drain()
        second_sent.set()
        await reader.read()

    async with RawServer(stream) as server, client() as http:
        resp = await http.request("POST", server.url + "/s", [], b"{}")
        got = []
        fut = resp.pipe(lambda d: got.append(d) or True)
        await asyncio.sleep(0.1)
        fut.cancel()
        await second_sent.wait()
        assert await resp.readany() == b"data: 1\n\n"  # kept for the next read
        assert got == [b"data: 0\n\n"]
        assert await resp.readany() == b""
        resp.release()
