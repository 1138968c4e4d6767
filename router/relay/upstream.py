"""The upstream clients and the relay of one request: routed requests, health probes, load
scrapes and ``/v1/models`` go through the lean HTTP/1.1 client of :mod:`router.upstream_http`
(``Upstream.http``), forwarded paths included; the pooled ``aiohttp.ClientSession``
(``Upstream.session``) serves render calls.

What reaches the worker: the client's body bytes unchanged (except the streaming usage option,
see :mod:`router.relay.stream_usage`), every client header but hop-by-hop ones, ``Host``,
``Content-Length`` (recomputed), ``Accept: */*`` when the client sent none, and
``Accept-Encoding`` (we ask for ``identity`` so a copy of the body can be read); ``x-request-id``
is the client's or a new one (what aiohttp sent; :mod:`router.upstream_http`).

What reaches the client: the worker's status, headers (minus hop-by-hop, a stale
``Content-Length`` and ``Access-Control-*``, which the gateway's own CORS policy sets;
``Content-Encoding`` is kept because the body is passed raw) plus ``x-kvroute-worker`` and
``x-request-id``; the body as it arrives (each socket read of the worker's answer forwarded at
once, never re-chunked; under ``kvroute serve`` a stream's pieces go from the worker
connection's callback straight to the client's transport, :mod:`router.relay.direct_write`,
waiting while the client's socket is full). A connect failure before any byte reached the client
is retried once on the next-best worker (a pooled connection the worker closed as the request
went out is first retried once on a new connection to the same worker). Cancelling the relay
(the client went away) closes the upstream connection, which makes vLLM abort the request;
in-flight counts are released in every path.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import aiohttp

from kvcore.data_parallel import DP_RANK_HEADER
from router.config.schema import HealthConfig, TimeoutsConfig
from router.errors import GatewayError, upstream_failed, upstream_timeout
from router.relay.direct_write import writer_for
from router.relay.stream_usage import UsageStrip, UsageTap, cached_tokens_of_body
from router.telemetry import tracing
from router.telemetry.metrics import GatewayMetrics
from router.upstream_http import (UpstreamConnectError, UpstreamDisconnected, UpstreamError, UpstreamHTTP,
                                  UpstreamPayloadError, UpstreamResponse)
from router.workers.registry import InFlight, WorkerRegistration

log = logging.getLogger("kvroute.proxy")
KEEPALIVE_S = 4.0  # idle connections to a worker close before vLLM's uvicorn closes them (5 s)

_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                         b"proxy-authorization", b"te", b"trailer", b"trailers", b"transfer-encoding",
                         b"upgrade"})
_DP_RANK = DP_RANK_HEADER.lower()
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"expect", b"x-request-id"}
_RESPONSE_DROP = _HOP_BY_HOP | {b"content-length", b"x-request-id", b"x-kvroute-worker",
                                b"x-kvroute-prefill-worker"}
_CORS_PREFIX = b"access-control-"  # the gateway's CORS policy answers browsers, not the worker's
_SSE = b"text/event-stream"


class ClientState:
    """Shared between a relay and the task watching for the client's disconnect."""

    __slots__ = ("disconnected", "response_started", "response_done")

    def __init__(self) -> None:
        self.disconnected = False
        self.response_started = False
        self.response_done = False


def _header_value(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def upstream_headers(client_headers: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[str, str]]:
    """Headers for the worker: the client's minus hop-by-hop, Host, Content-Length,
    Accept-Encoding and x-request-id; plus ``Accept-Encoding: identity`` and ``x-request-id``.
    Values keep their bytes: aiohttp writes header strings as UTF-8, so UTF-8 values are decoded
    as UTF-8 (other bytes, rare, as latin-1)."""
    out = [(k.decode("latin-1"), _header_value(v)) for k, v in client_headers if k not in _REQUEST_DROP]
    out.append(("Accept-Encoding", "identity"))
    out.append(("x-request-id", request_id))
    return out


_OPENING_EVENTS = (b"response.created", b"response.in_progress")


def opening_only(chunk: bytes) -> bool:
    """Whether an event-stream chunk holds only the opening events of a Responses API stream
    (``response.created``, ``response.in_progress``), which vLLM sends as the request is accepted,
    before its prefill (``responses_stream_generator``, vllm/entrypoints/openai/responses/serving.py,
    0.32): the first token comes with a later event. Each vLLM event has an ``event:`` line."""
    if b"response.created" not in chunk and b"response.in_progress" not in chunk:
        return False
    kinds = [line[6:].strip() for line in chunk.split(b"\n") if line.startswith(b"event:")]
    return bool(kinds) and all(k in _OPENING_EVENTS for k in kinds)


def for_rank(headers: list[tuple[str, str]], reg: WorkerRegistration) -> list[tuple[str, str]]:
    """``headers`` for ``reg``: a data parallel rank (``WorkerConfig.data_parallel_rank``) is named in
    ``X-data-parallel-rank`` (vLLM's header, :mod:`kvcore.data_parallel`), replacing the client's;
    a whole server gets them unchanged."""
    rank = reg.cfg.data_parallel_rank
    if rank is None:
        return headers
    return [(k, v) for k, v in headers if k.lower() != _DP_RANK] + [(DP_RANK_HEADER, str(rank))]


def client_headers(raw: Iterable[tuple[bytes, bytes]], worker_id: str, request_id: str,
                   content_length: int | None = None,
                   extra: list[tuple[bytes, bytes]] | None = None) -> list[tuple[bytes, bytes]]:
    """Response headers for the client from the worker's ``raw_headers``; ``extra``: the
    gateway's own (``x-kvroute-prefill-worker`` on a split request, :mod:`router.edge.prefill_leg`)."""
    out = []
    for k, v in raw:
        k = k.lower()
        if k not in _RESPONSE_DROP and not k.startswith(_CORS_PREFIX):
            out.append((k, v))
    out.append((b"x-kvroute-worker", worker_id.encode("latin-1")))
    out.extend(extra or ())
    out.append((b"x-request-id", request_id.encode("latin-1")))
    if content_length is not None:
        out.append((b"content-length", str(content_length).encode()))
    return out


class _Retryable(Exception):
    """No answer came and nothing reached the client: the worker could not be reached
    (``connect_failed``: counts against its health) or it dropped the connection first."""

    def __init__(self, message: str, connect_failed: bool) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed


@dataclass(frozen=True, slots=True)
class RelayRequest:
    """What goes to the worker, the same for every attempt: ``method`` and ``path`` (the
    client's), ``body`` (bytes), ``headers`` (:func:`upstream_headers`), ``request_id``; ``t0``:
    perf_counter at request receipt (TTFT); ``strip_usage``: the client did not ask for the usage
    chunk the gateway added (:mod:`router.relay.stream_usage`); ``response_headers``: added to the
    worker's for the client (:func:`client_headers` ``extra``)."""

    method: str
    path: str
    body: bytes
    headers: list[tuple[str, str]]
    request_id: str
    t0: float
    strip_usage: bool = False
    response_headers: list[tuple[bytes, bytes]] | None = None


@dataclass(frozen=True, slots=True)
class RelayHooks:
    """What the caller supplies and learns during a relay, each optional.

    ``uncached_tokens(worker_id)``: prefill tokens to count as that worker's load;
    ``predicted_ttft_ms(worker_id)``: the policy's TTFT prediction there, which tells the
    dispatch queue when the worker's prefill should end; ``presumed_ttft_ms(worker_id)``: for an
    answer that is not streamed, when to count its prefill as done (its first byte comes only
    with the whole answer); ``on_attempt(reg)``: awaited before each attempt (speculative index
    insert); ``on_refused(reg)``: awaited after an attempt on ``reg`` that computed no prompt
    there: the connection failed (a retry or a 502 follows), or the worker answered a 4xx other
    than 408 and 429 (:func:`refused_status`); it must not raise (the gateway's,
    :meth:`router.route.planner.Router.withdraw`, logs its own errors);
    ``on_answer(reg, first)``: a 200 answer's first bytes (the whole body when not
    streamed); ``on_first_token(handle)``: a 200 event stream's first token arrived (its TTFT is
    known), called once it has been passed on to the client; ``on_cached_tokens(handle, n)``: the
    worker's reported cached tokens, after the response is complete. ``handle`` is the request's
    :class:`~router.workers.registry.InFlight` on that worker (what it met at dispatch, its TTFT)."""

    uncached_tokens: Callable[[str], int] | None = None
    predicted_ttft_ms: Callable[[str], float | None] | None = None
    presumed_ttft_ms: Callable[[str], float | None] | None = None
    on_attempt: Callable[[WorkerRegistration], Awaitable[None]] | None = None
    on_refused: Callable[[WorkerRegistration], Awaitable[None]] | None = None
    on_answer: Callable[[WorkerRegistration, bytes], None] | None = None
    on_first_token: Callable[[InFlight], None] | None = None
    on_cached_tokens: Callable[[InFlight, int], None] | None = None


NO_HOOKS = RelayHooks()


def refused_status(status: int) -> bool:
    """Whether a worker's answer ``status`` says it refused the request, computing none of its
    prompt: a 4xx (vLLM refuses a request it cannot serve before it schedules it) other than 408
    and 429 (a timeout or a rate limit: the request may have been taken). A 5xx may come after
    the prefill ran."""
    return 400 <= status < 500 and status not in (408, 429)


class Upstream:
    """The pooled upstream client and relay. ``on_connect_failure`` counts a failed connect
    against the worker's health (as a failed probe)."""

    def __init__(self, timeouts: TimeoutsConfig, health: HealthConfig, metrics: GatewayMetrics) -> None:
        self.timeouts = timeouts
        self.health = health
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._http: UpstreamHTTP | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session (render calls). Raises RuntimeError before start()."""
        if self._session is None:
            raise RuntimeError("Upstream.start() not called")
        return self._session

    @property
    def http(self) -> UpstreamHTTP:
        """The relay's client (:mod:`router.upstream_http`). Raises RuntimeError before start()."""
        if self._http is None:
            raise RuntimeError("Upstream.start() not called")
        return self._http

    async def start(self) -> None:
        """Open the pooled session (unbounded pool, keep-alive, raw bodies)."""
        # idle connections are dropped before vLLM's uvicorn drops them (its keep-alive is 5 s), so
        # a request rarely meets a connection the worker just closed
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S,
                                         ttl_dns_cache=300, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=self.timeouts.total_s, connect=None,
                                        sock_connect=self.timeouts.connect_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                              cookie_jar=aiohttp.DummyCookieJar(),
                                              skip_auto_headers=("User-Agent", "Content-Type"))
        # the relay's: the same timeouts, keep-alive and unbounded pool, the same default TLS context
        self._http = UpstreamHTTP(connect_timeout_s=self.timeouts.connect_s, total_s=self.timeouts.total_s,
                                  keepalive_s=KEEPALIVE_S)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def relay(self, send: Callable[[dict], Awaitable[None]], state: ClientState, req: RelayRequest,
                    ranked: list[WorkerRegistration], hooks: RelayHooks = NO_HOOKS) -> None:
        """Send ``req`` to ``ranked[0]`` (``ranked[1]`` after a connect failure) and relay the
        answer through ASGI ``send``; ``hooks``: what the caller learns on the way
        (:class:`RelayHooks`). Raises GatewayError (502/504) when nothing reached the client. With
        tracing on (:mod:`router.telemetry.tracing`) each attempt is a CLIENT span
        ``kvroute.upstream`` whose context goes to the worker as ``traceparent`` (in place of the
        client's), with children ``kvroute.ttfb`` and ``kvroute.stream``; the worker's cached
        tokens go on it and on the request's span."""
        attempts = ranked[:2]
        request_span = tracing.current_span()
        for i, reg in enumerate(attempts):
            if hooks.on_attempt is not None:
                await hooks.on_attempt(reg)
            handle = reg.begin(hooks.uncached_tokens(reg.id) if hooks.uncached_tokens else 0,
                               hooks.predicted_ttft_ms(reg.id) if hooks.predicted_ttft_ms is not None else None)
            presumed = hooks.presumed_ttft_ms(reg.id) if hooks.presumed_ttft_ms is not None else None
            timer = (asyncio.get_running_loop().call_later(presumed / 1000.0, handle.presume_prefilled)
                     if presumed is not None else None)
            try:
                with tracing.span("kvroute.upstream", tracing.SpanKind.CLIENT) as span:
                    attempt, trace_cached = req, None
                    if span.is_recording():
                        attempt = dataclasses.replace(req, headers=tracing.inject_headers(req.headers))
                        trace_cached = _cached_tokens_on(span, request_span) if hooks.on_cached_tokens else None
                        tracing.set_attributes(span, {"worker": reg.id, "request_id": req.request_id,
                                                      "attempt": i + 1, "http.request.method": req.method,
                                                      "url.full": reg.url + req.path})
                    await self._relay_one(send, state, reg, handle, attempt, hooks, span, trace_cached)
                return
            except _Retryable as exc:
                if exc.connect_failed:
                    reg.record_probe(False, self.health.fail_threshold, self.health.rise_threshold, str(exc))
                    if hooks.on_refused is not None:
                        await hooks.on_refused(reg)
                if i + 1 < len(attempts):
                    self.metrics.retries.inc()
                    log.warning("worker %s unreachable (%s); retrying on %s", reg.id, exc, attempts[i + 1].id)
                    continue
                raise upstream_failed(reg.id, str(exc)) from None
            finally:
                if timer is not None:
                    timer.cancel()
                handle.finish()

    async def _relay_one(self, send, state: ClientState, reg: WorkerRegistration, handle: InFlight,
                         req: RelayRequest, hooks: RelayHooks, span=tracing.INVALID_SPAN,
                         trace_cached: Callable[[int], None] | None = None) -> None:
        """One attempt on ``reg`` (see :meth:`relay`); ``span``: the attempt's span (its HTTP
        status goes on it); ``trace_cached(n)``: puts the worker's cached tokens on the spans,
        called before the last byte reaches the client (the ASGI server span ends there)."""
        http = self.http
        first_byte_s = self.timeouts.first_byte_s
        resp: UpstreamResponse | None = None
        try:
            try:
                with tracing.span("kvroute.ttfb"):
                    async with asyncio.timeout(first_byte_s) as deadline:
                        try:
                            resp = await http.request(req.method, reg.url + req.path, for_rank(req.headers, reg),
                                                      req.body)
                        except UpstreamConnectError as exc:
                            raise _Retryable("connect timeout" if isinstance(exc, TimeoutError)
                                             else f"{type(exc).__name__}: {exc}", True) from None
                        except UpstreamDisconnected as exc:
                            raise _Retryable(f"{type(exc).__name__}: {exc}", False) from None
                        stream = resp.content_type == "text/event-stream"
                        first = await (resp.readany() if stream else resp.read())
            except TimeoutError:
                if deadline.expired():
                    raise upstream_timeout(reg.id, first_byte_s) from None
                raise _Retryable("connect timeout", True) from None
            except UpstreamError as exc:
                raise upstream_failed(reg.id, f"{type(exc).__name__}: {exc}") from None
            status = resp.status
            tracing.set_http_status(span, status)
            if refused_status(status) and hooks.on_refused is not None:
                await hooks.on_refused(reg)
            handle.streamed = stream and status == 200
            opening = handle.streamed and opening_only(first)  # no token yet: the prefill runs on
            if not opening:
                handle.first_byte()
            if hooks.on_answer is not None and status == 200:
                hooks.on_answer(reg, first)
            self.metrics.record_response(reg.id, status, time.perf_counter() - req.t0)
            with tracing.span("kvroute.stream"):
                if stream:
                    # the first token's bookkeeping runs once it is on its way to the client:
                    # on a busy host the gateway waits for CPU, and the client's TTFT must not
                    on_first = hooks.on_first_token
                    after_first = (lambda: on_first(handle)) if handle.streamed and on_first else None
                    await self._relay_stream(send, state, resp, reg, handle, first, req,
                                             hooks.on_cached_tokens, req.strip_usage and status == 200,
                                             trace_cached, after_first, opening)
                else:
                    state.response_started = True
                    cached = None
                    writer = writer_for(send) if trace_cached is None else None  # traced: ASGI's order
                    if writer is not None and writer.whole(status, client_headers(
                            resp.raw_headers, reg.id, req.request_id, None, req.response_headers), first):
                        state.response_done = True
                    else:
                        await send({"type": "http.response.start", "status": status,
                                    "headers": client_headers(resp.raw_headers, reg.id, req.request_id, len(first),
                                                              req.response_headers)})
                        state.response_done = True
                        if trace_cached is not None and status == 200:  # tracing: before the last send
                            cached = cached_tokens_of_body(first)
                            if cached is not None:
                                trace_cached(cached)
                        await send({"type": "http.response.body", "body": first, "more_body": False})
                    if hooks.on_cached_tokens is not None and status == 200:
                        if cached is None:
                            cached = cached_tokens_of_body(first)
                        if cached is not None:
                            hooks.on_cached_tokens(handle, cached)
        finally:
            if resp is not None:
                resp.close() if not state.response_done else resp.release()

    async def _relay_stream(self, send, state: ClientState, resp: UpstreamResponse,
                            reg: WorkerRegistration, handle: InFlight, first: bytes, req: RelayRequest,
                            on_cached_tokens: Callable[[InFlight, int], None] | None,
                            strip_usage: bool, trace_cached: Callable[[int], None] | None = None,
                            after_first: Callable[[], None] | None = None, opening: bool = False) -> None:
        """Relay the event stream. ``opening``: the first chunk held only a Responses stream's
        opening events (:func:`opening_only`), so the first token is the first chunk that holds
        more: only then does the request count as past its prefill and ``after_first`` run."""
        request_id = req.request_id
        watcher = (UsageStrip() if strip_usage else UsageTap()) if on_cached_tokens is not None else None
        state.response_started = True
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": client_headers(resp.raw_headers, reg.id, request_id, extra=req.response_headers)})
        chunk = first
        finished = False
        idle_s = self.timeouts.stream_idle_s
        writer = writer_for(send)

        def sent(data: bytes) -> None:
            """``data`` has gone to the client: the first token's bookkeeping, once."""
            nonlocal opening, after_first
            if opening and not opening_only(data):
                opening = False
                handle.first_byte()
            if after_first is not None and not opening:
                after_first()
                after_first = None

        try:
            try:
                if writer is not None and writer.chunked:
                    # each socket read of the worker's answer goes on from the connection's own
                    # callback, as the ASGI loop below would send it
                    def on_data(data: bytes) -> bool:
                        out = watcher.feed(data) if watcher is not None else data
                        if out:
                            writer.chunk(out)
                        sent(data)
                        return not writer.paused

                    go_on = on_data(chunk) if chunk else True
                    while not (go_on and await resp.pipe(on_data, idle_s)):
                        await writer.drain()
                        go_on = True
                    chunk = b""
                while chunk:
                    out = watcher.feed(chunk) if watcher is not None else chunk
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                    sent(chunk)
                    chunk = await resp.readany(idle_s)
                rest = watcher.finish() if watcher is not None else b""
            except (UpstreamError, TimeoutError) as exc:
                # the worker died or went silent mid-stream: end the stream cleanly, with an
                # error event and [DONE] as vLLM ends a stream that fails (a truncated HTTP body
                # would leave clients guessing)
                timed_out = isinstance(exc, TimeoutError)
                if timed_out:
                    detail = f"no data for {idle_s} s"
                elif isinstance(exc, (UpstreamPayloadError, UpstreamDisconnected)):
                    detail = "the worker closed the stream before its end"
                else:
                    detail = f"{type(exc).__name__}: {exc}"
                log.warning("worker %s broke the stream of request %s: %s", reg.id, request_id, detail)
                self.metrics.broken_streams.labels(reg.id, "idle_timeout" if timed_out else "upstream_error").inc()
                held = watcher.finish() if watcher is not None else b""
                err = (GatewayError(504, f"Upstream worker {reg.id} sent nothing for {idle_s} s mid-stream.",
                                    "upstream_error", "upstream_timeout") if timed_out
                       else upstream_failed(reg.id, detail))
                rest = held + (b"\n\n" if held and not held.endswith(b"\n\n") else b"") + \
                    b"data: " + err.body() + b"\n\ndata: [DONE]\n\n"
            finished = True
            state.response_done = True
            if trace_cached is not None and watcher is not None and watcher.cached_tokens is not None:
                trace_cached(watcher.cached_tokens)
            await send({"type": "http.response.body", "body": rest, "more_body": False})
        finally:
            # Booked even when the client goes away after its last event (a client that closes on
            # "data: [DONE]" cancels this relay while it waits for the worker's end of stream):
            # the usage has been seen by then, and the prediction's error must not be lost.
            if watcher is not None:
                if not finished:
                    watcher.finish()
                if watcher.cached_tokens is not None:
                    if not finished and trace_cached is not None:
                        trace_cached(watcher.cached_tokens)
                    on_cached_tokens(handle, watcher.cached_tokens)


def _cached_tokens_on(span, request_span) -> Callable[[int], None]:
    """``f(n)``: the worker's reported cached tokens ``n`` as ``kvroute.actual_cached_tokens`` on
    the attempt's span and the request's span."""
    def record(cached: int) -> None:
        tracing.set_attributes(span, {"actual_cached_tokens": cached})
        tracing.set_attributes(request_span, {"actual_cached_tokens": cached})

    return record
