"""A lean HTTP/1.1 client for the relay to workers (:mod:`router.relay.upstream`, :mod:`router.edge.prefill_leg`)
and the gateway's probes and scrapes (:mod:`router.workers.calls`).

An ``asyncio.Protocol`` per connection with an ``httptools.HttpResponseParser``; a keep-alive
pool per (scheme, host, port). It spends less CPU per request than aiohttp's client (figures in
the README's scale-out section); the gateway's other calls (render, siblings) stay on
aiohttp.

What the worker sees is what aiohttp sent for ``session.request(method, url, data=body or None,
headers=headers)`` with the gateway's session (``skip_auto_headers=("User-Agent",
"Content-Type")``, no cookies): ``Host`` first (``host[:port]``, the port omitted when it is the
scheme's default), the caller's headers in their order (a caller's ``Host`` replaces ours),
``Accept: */*`` when the caller sent no ``Accept``, ``Content-Length`` when there is a body or
the method is not GET/HEAD/OPTIONS/TRACE; no ``User-Agent``, ``Content-Type`` or ``Connection``
of our own; header strings encoded as UTF-8; the target is yarl's ``raw_path_qs`` of the URL.
``https`` uses the context aiohttp's default connector uses (``ssl.create_default_context()``,
ALPN ``http/1.1``; verified against the system's CAs, ``SSL_CERT_FILE``/``SSL_CERT_DIR``
honoured), SNI the host name.

A response: ``status``, ``raw_headers`` (name and value bytes as sent), ``header(name)``,
``content_type``, ``readany(idle_s=None)`` (what has arrived since the last read, waiting for
the next piece; ``b""`` at the end; with ``idle_s``, :class:`UpstreamIdleTimeout` when that wait
passes ``idle_s`` seconds), ``pipe(sink, idle_s=None)`` (the body handed to ``sink`` from the
connection's own callback as it arrives, one call per socket read, with no task switch per
piece), ``read()`` (the whole body), ``close()`` (drops the connection),
``release()`` (returns it to the pool only after the whole body was read and the server keeps the
connection alive).
More than :data:`HIGH_WATER` bytes unread pause the socket's reading until the reader drains
them.

Errors (:class:`UpstreamError`): :class:`UpstreamConnectError` could not connect (refused,
unreachable, DNS, TLS handshake; :class:`UpstreamConnectTimeout` past ``connect_s``, also a
``TimeoutError``); :class:`UpstreamDisconnected` the server closed the connection before the
response's head; :class:`UpstreamPayloadError` a malformed response or a body cut short;
:class:`UpstreamTimeout` (also a ``TimeoutError``) the ``total_s`` limit passed;
:class:`UpstreamIdleTimeout` (an ``UpstreamTimeout``) no body bytes for a read's ``idle_s``.

A stream's idle limit is one timer per response, not one per read: each wait notes its deadline
and the timer, when it fires before that deadline, re-arms for it; a read that finds bytes
waiting touches no timer.

Pool hygiene: a connection the server closes leaves the pool at once; idle ones are closed after
``keepalive_s`` (4 s: vLLM's uvicorn closes its idle keep-alive after 5 s); at most
``max_idle_per_host`` stay idle per host; a reused connection that fails before any byte of a
response (the server closed it as the request went out) is retried once on a new connection.
A cancelled request (the client went away, a timeout) closes its connection.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Callable

import httptools
from yarl import URL

HIGH_WATER = 64 * 1024  # unread body bytes past which reading pauses
_NO_BODY_LENGTH = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})  # aiohttp's GET_METHODS


class UpstreamError(Exception):
    """The request to the worker failed."""


class UpstreamConnectError(UpstreamError):
    """No connection to the worker: refused, unreachable, DNS, TLS handshake."""


class UpstreamConnectTimeout(UpstreamConnectError, TimeoutError):
    """No connection within the connect timeout."""


class UpstreamDisconnected(UpstreamError):
    """The worker closed the connection before the response's head."""


class UpstreamPayloadError(UpstreamError):
    """A malformed response, or its body cut short."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The request's total time limit passed."""


class UpstreamIdleTimeout(UpstreamTimeout):
    """A read waited ``idle_s`` seconds without a body byte (``readany(idle_s=...)``)."""


_ssl_context: ssl.SSLContext | None = None


def default_ssl_context() -> ssl.SSLContext:
    """aiohttp's verified client context (``aiohttp.connector._make_ssl_context(True)``)."""
    global _ssl_context
    if _ssl_context is None:
        ctx = ssl.create_default_context()
        ctx.set_alpn_protocols(("http/1.1",))
        _ssl_context = ctx
    return _ssl_context


class _Target:
    __slots__ = ("key", "host", "port", "tls", "host_header", "path")

    def __init__(self, url: str) -> None:
        u = URL(url)
        if u.scheme not in ("http", "https") or not u.raw_host:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = u.scheme == "https"
        self.host = u.raw_host
        self.port = u.port
        self.key = (u.scheme, self.host, self.port)
        self.host_header = u.host_port_subcomponent
        self.path = u.raw_path_qs


_targets: dict[str, _Target] = {}


def _target(url: str) -> _Target:
    t = _targets.get(url)
    if t is None:
        t = _Target(url)
        if len(_targets) >= 4096:
            _targets.clear()
        _targets[url] = t
    return t


def request_head(method: str, target: _Target, headers, body: bytes) -> bytes:
    """The request line and headers aiohttp wrote for this request (see the module docstring)."""
    host = target.host_header
    lines = []
    accept = False
    for k, v in headers:
        lk = k.lower()
        if lk == "host":
            host = v
            continue
        if lk == "accept":
            accept = True
        lines.append(f"{k}: {v}\r\n")
    if not accept:
        lines.append("Accept: */*\r\n")
    if body or method not in _NO_BODY_LENGTH:
        lines.append(f"Content-Length: {len(body)}\r\n")
    fields = "".join(lines)
    n = len(lines)  # each line ends with the one CR LF it may hold
    if fields.count("\n") != n or fields.count("\r") != n or "\r" in host or "\n" in host or "\n" in method:
        raise ValueError("Newline or carriage return character detected in HTTP status message or header. "
                         "This is a potential security issue.")
    return f"{method} {target.path} HTTP/1.1\r\nHost: {host}\r\n{fields}\r\n".encode("utf-8")


class UpstreamResponse:
    """One response (see the module docstring)."""

    __slots__ = ("status", "raw_headers", "_conn", "_loop", "_head", "_chunks", "_size", "_done", "_exc",
                 "_waiter", "_paused", "_keep_alive", "_head_only", "_interim", "_got_bytes", "_body", "_timer",
                 "_idle_timer", "_idle_until", "_idle_s", "_sink", "_pipe")

    def __init__(self, conn: _Conn, method: str, loop: asyncio.AbstractEventLoop) -> None:
        self.status: int = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._conn: _Conn | None = conn
        self._loop = loop
        self._head: asyncio.Future = loop.create_future()
        self._chunks: list[bytes] = []
        self._size = 0
        self._done = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._keep_alive = False
        self._head_only = method == "HEAD"
        self._interim = False
        self._got_bytes = False
        self._body: bytes | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_until = 0.0
        self._idle_s = 0.0
        self._sink: Callable[[bytes], bool] | None = None
        self._pipe: asyncio.Future | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lowercase bytes) as sent, None when absent."""
        for k, v in self.raw_headers:
            if len(k) == len(name) and k.lower() == name:
                return v
        return None

    @property
    def content_type(self) -> str:
        """The media type, lowercased (``application/octet-stream`` when none was given), as aiohttp's."""
        v = self.header(b"content-type")
        return "application/octet-stream" if v is None else v.split(b";", 1)[0].strip().lower().decode("latin-1")

    # -- parser side (called by _Conn) --

    def _on_headers_complete(self, status: int) -> None:
        if 100 <= status < 200 and status != 101:  # an interim answer (100 Continue, 103): the real one follows
            self._interim = True
            self.raw_headers = []
            return
        self.status = status
        if self._head_only:  # the parser would wait for a body a HEAD answer never has
            self._done = True
            self._keep_alive = False
        if not self._head.done():
            self._head.set_result(None)

    def _on_body(self, data: bytes) -> None:
        if self._done:
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _on_message_complete(self, keep_alive: bool) -> None:
        if self._interim:
            self._interim = False
            return
        if self._done:
            return
        self._done = True
        self._keep_alive = keep_alive
        self._cancel_timers()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self._sink is not None:
            self._pump()

    def _fail(self, exc: BaseException) -> None:
        self._cancel_timers()
        if self._exc is None and not self._done:
            self._exc = exc
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: a cancelled requester never awaits it
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self._sink is not None:
            self._pump()

    def _lost(self, exc: BaseException | None) -> None:
        """The connection closed under the response."""
        self._conn = None
        if self._done:
            return
        why = f": {exc}" if exc is not None else ""
        if not self._head.done():
            self._fail(UpstreamDisconnected(f"the server closed the connection before answering{why}"))
        elif self._eof_body():  # the body runs to the connection's end
            self._on_message_complete(False)
        else:
            self._fail(UpstreamPayloadError(f"the response's body ended before its end (connection closed{why})"))

    def _eof_body(self) -> bool:
        if self.status in (204, 304):
            return True
        for k, v in self.raw_headers:
            lk = k.lower()
            if lk == b"content-length" or (lk == b"transfer-encoding" and b"chunked" in v.lower()):
                return False
        return True

    def _expire(self) -> None:
        self._timer = None
        self._fail(UpstreamTimeout("the request's total time limit passed"))
        self.close()

    def _cancel_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_check(self) -> None:
        """The idle timer: fail the pending read or pipe past its deadline, re-arm for a later
        one, or stop when nothing waits (the next wait arms it again)."""
        self._idle_timer = None
        w = self._waiter if self._waiter is not None else self._pipe
        if w is None or w.done():
            return
        if self._loop.time() < self._idle_until:
            self._idle_timer = self._loop.call_at(self._idle_until, self._idle_check)
            return
        if w is self._pipe:
            self._sink = self._pipe = None
        w.set_exception(UpstreamIdleTimeout(f"no data for {self._idle_s} s"))

    def _pump(self) -> None:
        """Pipe mode: hand what has arrived to the sink in one call, then settle the pipe at the
        body's end (True), on an error, or when the sink asked to pause (False)."""
        fut = self._pipe
        if fut is None or fut.done():  # the piping coroutine was cancelled: keep the bytes
            self._sink = self._pipe = None
            return
        if self._chunks:
            data = self._take()
            if self._idle_timer is not None:
                self._idle_until = self._loop.time() + self._idle_s
            try:
                more = self._sink(data)
            except BaseException as exc:  # the sink's own failure ends the pipe with it
                self._sink = self._pipe = None
                fut.set_exception(exc)
                return
            if not more:
                self._sink = self._pipe = None
                fut.set_result(False)
                return
        if self._exc is not None:
            self._sink = self._pipe = None
            fut.set_exception(self._exc)
        elif self._done:
            self._sink = self._pipe = None
            fut.set_result(True)

    # -- reader side --

    async def readany(self, idle_s: float | None = None) -> bytes:
        """What has arrived since the last read (waiting for the next piece); ``b""`` at the end.
        ``idle_s``: raise :class:`UpstreamIdleTimeout` when the wait for the next piece passes it
        (the response stays open: the caller closes it)."""
        chunks = self._chunks
        while not chunks:
            if self._exc is not None:
                raise self._exc
            if self._done:
                return b""
            self._waiter = w = self._loop.create_future()
            if idle_s is not None:
                self._idle_s = idle_s
                self._idle_until = self._loop.time() + idle_s
                if self._idle_timer is None:
                    self._idle_timer = self._loop.call_at(self._idle_until, self._idle_check)
            try:
                await w
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> bytes:
        """What has arrived (one or more pieces), the buffer emptied and reading resumed if it
        was paused."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        if self._paused:
            self._paused = False
            conn = self._conn
            if conn is not None and not conn.closed:
                conn.transport.resume_reading()
        return data

    def pipe(self, sink: Callable[[bytes], bool], idle_s: float | None = None) -> asyncio.Future:
        """Hand the body to ``sink(data)`` as it arrives, from the connection's ``data_received``
        (what came in one socket read, in one call; what had arrived before, at once). ``sink``
        returns False to pause: the next bytes wait (reading pauses past :data:`HIGH_WATER`)
        until the next ``pipe`` or ``readany``.

        Returns a future: True at the body's end, False when ``sink`` paused; its exception the
        response's :class:`UpstreamError`, :class:`UpstreamIdleTimeout` when ``idle_s`` seconds
        pass without a byte, or what ``sink`` raised. Cancelling it stops the piping (the bytes
        stay buffered). One pipe or read at a time."""
        fut = self._loop.create_future()
        self._sink = sink
        self._pipe = fut
        if self._chunks or self._done or self._exc is not None:
            self._pump()
        if not fut.done() and idle_s is not None:
            self._idle_s = idle_s
            self._idle_until = self._loop.time() + idle_s
            if self._idle_timer is None:
                self._idle_timer = self._loop.call_at(self._idle_until, self._idle_check)
        return fut

    async def read(self) -> bytes:
        """The whole body."""
        if self._body is not None:
            return self._body
        if self._done and self._exc is None:
            body = b"".join(self._chunks)
            self._chunks.clear()
            self._size = 0
        else:
            parts = []
            while True:
                piece = await self.readany()
                if not piece:
                    break
                parts.append(piece)
            body = b"".join(parts)
        self._body = body
        return body

    def close(self) -> None:
        """Drop the connection (the server sees it close)."""
        self._cancel_timers()
        self._sink = self._pipe = None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.resp = None
            conn.close()
        if not self._done and self._exc is None:
            self._exc = UpstreamDisconnected("the response was closed")

    def release(self) -> None:
        """Back to the pool when the whole body was read and the server keeps the connection; else close."""
        conn = self._conn
        if conn is None:
            return
        if self._done and self._exc is None and self._keep_alive and not self._chunks and not conn.closed \
                and not conn.broken:
            self._conn = None
            conn.resp = None
            if self._paused:
                self._paused = False
                conn.transport.resume_reading()
            conn.pool.put(conn)
        else:
            self.close()


class _Conn(asyncio.Protocol):
    __slots__ = ("pool", "transport", "parser", "resp", "closed", "broken", "idle_since")

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None
        self.closed = False
        self.broken = False
        self.idle_since = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp._done:  # bytes outside a response: never reuse this connection
            self.broken = True
            if resp is None:
                self.close()
            return
        resp._got_bytes = True
        try:
            self.parser.feed_data(data)
            if resp._sink is not None:
                resp._pump()
        except httptools.HttpParserUpgrade:
            self.broken = True
            resp._fail(UpstreamPayloadError("the server switched protocols"))
            resp.close()
        except httptools.HttpParserError as exc:
            self.broken = True
            resp._fail(UpstreamPayloadError(f"malformed response: {exc}"))
            resp.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost settles the response

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        resp, self.resp = self.resp, None
        if resp is not None:
            resp._lost(exc)
        else:
            self.pool.forget(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is not None:
            if resp.status:  # a second answer to one request
                self.broken = True
                return
            resp._on_headers_complete(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp._on_body(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is not None:
            resp._on_message_complete(self.parser.should_keep_alive())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class _Pool:
    """The connections to one (scheme, host, port)."""

    __slots__ = ("client", "target", "idle")

    def __init__(self, client: UpstreamHTTP, target: _Target) -> None:
        self.client = client
        self.target = target
        self.idle: deque[_Conn] = deque()

    def acquire(self, now: float) -> _Conn | None:
        idle = self.idle
        keepalive = self.client.keepalive_s
        while idle:
            conn = idle.pop()  # the most recently used
            if conn.closed or conn.transport.is_closing():
                continue
            if now - conn.idle_since > keepalive:
                conn.close()
                continue
            return conn
        return None

    async def connect(self, loop: asyncio.AbstractEventLoop) -> _Conn:
        t = self.target
        ctx = (self.client.ssl_context or default_ssl_context()) if t.tls else None
        try:
            async with asyncio.timeout(self.client.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Conn(self), t.host, t.port, ssl=ctx,
                                                       server_hostname=t.host.rstrip(".") if ctx else None)
        except TimeoutError:
            raise UpstreamConnectTimeout(f"no connection to {t.host}:{t.port} within "
                                         f"{self.client.connect_timeout_s:g} s") from None
        except (OSError, ssl.SSLError, ssl.CertificateError) as exc:
            raise UpstreamConnectError(f"Cannot connect to host {t.host}:{t.port} ssl:{'default' if ctx else False} "
                                       f"[{exc}]") from None
        return conn

    def put(self, conn: _Conn) -> None:
        idle = self.idle
        if len(idle) >= self.client.max_idle_per_host or self.client._closed:
            conn.close()
            return
        conn.idle_since = self.client.loop_time()
        idle.append(conn)
        self.client._schedule_sweep()

    def forget(self, conn: _Conn) -> None:
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def sweep(self, now: float) -> None:
        idle, keepalive = self.idle, self.client.keepalive_s
        while idle and (idle[0].closed or now - idle[0].idle_since > keepalive):
            idle.popleft().close()


class UpstreamHTTP:
    """The client: ``await request(method, url, headers, body)`` gives an :class:`UpstreamResponse`
    once its head arrived. ``connect_timeout_s``: connect and TLS handshake; ``total_s``: the
    whole request from connect to the body's end (None: no limit); ``keepalive_s``: how long an
    idle connection stays pooled; ``ssl_context``: for https workers (None: aiohttp's default).
    No limit on concurrent connections (the aiohttp connector had ``limit=0``)."""

    def __init__(self, connect_timeout_s: float = 5.0, total_s: float | None = None, keepalive_s: float = 4.0,
                 max_idle_per_host: int = 256, ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.total_s = total_s
        self.keepalive_s = keepalive_s
        self.max_idle_per_host = max_idle_per_host
        self.ssl_context = ssl_context
        self._pools: dict[tuple, _Pool] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def loop_time(self) -> float:
        return self._loop.time()

    async def request(self, method: str, url: str, headers=(), body: bytes = b"") -> UpstreamResponse:
        """Send the request; return once the response's head arrived (see the module docstring)."""
        if self._closed:
            raise RuntimeError("UpstreamHTTP is closed")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        target = _target(url)
        pool = self._pools.get(target.key)
        if pool is None:
            pool = self._pools[target.key] = _Pool(self, target)
        head = request_head(method, target, headers, body or b"")
        data = head + body if body and len(body) < 65536 else head
        retried = False
        while True:
            conn = pool.acquire(loop.time())
            reused = conn is not None
            if conn is None:
                conn = await pool.connect(loop)
            resp = UpstreamResponse(conn, method, loop)
            conn.resp = resp
            if self.total_s is not None:
                resp._timer = loop.call_later(self.total_s, resp._expire)
            transport = conn.transport
            transport.write(data)
            if data is head and body:
                transport.write(body)
            try:
                await resp._head
            except UpstreamDisconnected:
                resp.close()
                if reused and not resp._got_bytes and not retried:
                    retried = True  # the server closed the idle connection as the request went out
                    continue
                raise
            except BaseException:
                resp.close()
                raise
            return resp

    def _schedule_sweep(self) -> None:
        if self._sweeper is None and not self._closed:
            self._sweeper = self._loop.call_later(1.0, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now = self._loop.time()
        pending = False
        for pool in self._pools.values():
            pool.sweep(now)
            pending = pending or bool(pool.idle)
        if pending:
            self._schedule_sweep()

    def idle_connections(self) -> int:
        """Idle pooled connections, all hosts."""
        return sum(len(p.idle) for p in self._pools.values())

    async def close(self) -> None:
        """Close every idle connection; requests in flight keep theirs until they end."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in self._pools.values():
            while pool.idle:
                pool.idle.pop().close()
        self._pools.clear()
