"""The proxied OpenAI endpoints as raw ASGI apps (no FastAPI body validation on the hot path).

A request's body is read once as bytes (413 past ``max_body_bytes``), parsed once with orjson for
routing, and the original bytes go upstream. Once a request has run
:data:`DISCONNECT_WATCH_AFTER_S`, a watcher task waits on ASGI ``receive`` for
``http.disconnect`` and cancels the route (a wait in the admission or dispatch queue included)
and the relay when the client leaves.
"""
from __future__ import annotations

import asyncio
import logging
import time
from random import getrandbits as _getrandbits
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
import orjson

from router.edge.client_auth import ClientAuth
from router.edge.prefill_leg import PrefillResult, prefill_leg
from router.errors import GatewayError, bad_request, body_too_large, upstream_failed
from router.relay.stream_usage import request_stream_usage
from router.relay.upstream import ClientState, RelayHooks, RelayRequest, upstream_headers
from router.route.context import RequestContext
from router.route.decision_log import DecisionLog
from router.route.pd import DECODE_POLICY, decode_body, prefill_policy
from router.route.prompt_blocks import AGENT_KINDS
from router.telemetry.tracing import span as trace_span  # OpenTelemetry (router/telemetry/tracing.py)
from router.upstream_http import UpstreamError

if TYPE_CHECKING:  # the gateway owns its endpoints: imported for types only
    from router.gateway import Gateway
    from router.workers.registry import WorkerRegistration
    from router.route.dispatch_queue import Reservation
    from router.route.plan import RoutePlan

log = logging.getLogger("kvroute.endpoints")

EndpointKind = Literal["chat", "completion", "forward"]
_JSON_HEADERS = [(b"content-type", b"application/json")]


class _ClientGone(Exception):
    """The client disconnected while its body was being read."""


async def read_body(receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    """The whole request body. Raises GatewayError 413 past ``limit`` bytes (by Content-Length
    before reading, or while reading), _ClientGone on disconnect."""
    for name, value in headers:
        if name == b"content-length":
            try:
                if int(value) > limit:
                    raise body_too_large(limit)
            except ValueError:
                raise bad_request("invalid Content-Length header") from None
            break
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone()
        part = msg.get("body", b"")
        if part:
            size += len(part)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(part)
        if not msg.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object. Raises GatewayError 400 when it is not one."""
    if not body:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    return obj


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``x-request-id``, or a new random one: 32 hex digits from the process's
    ``random`` generator (seeded from the OS at start and again in a forked child; an id needs
    to be unique, not secret, and this spares a system call per request)."""
    for name, value in headers:
        if name == b"x-request-id" and value:
            return value.decode("latin-1")
    return "%032x" % _getrandbits(128)


async def send_json(send, status: int, body: bytes, request_id: str | None = None,
                    worker_id: str | None = None, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A complete JSON response through ASGI ``send``; ``worker_id``: the worker the gateway
    tried (502/504), sent as ``x-kvroute-worker``; ``extra_headers`` (e.g. ``Retry-After``)."""
    headers = _JSON_HEADERS + [(b"content-length", str(len(body)).encode())] + (extra_headers or [])
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode("latin-1")))
    if worker_id is not None:
        headers.append((b"x-kvroute-worker", worker_id.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


DISCONNECT_WATCH_AFTER_S = 0.05
"""How long a request runs before its disconnect watcher starts: most requests end sooner and
never pay for a task of their own; a client gone earlier is found once it starts (ASGI
``receive`` answers ``http.disconnect`` at once then), so the relay is cancelled at most this late."""


async def _cancel_on_disconnect(receive, task: asyncio.Task, state: ClientState) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not state.response_done:
                state.disconnected = True
                task.cancel()
            return


class _DisconnectWatch:
    """Cancels ``task`` when the client disconnects before its response is done
    (:func:`_cancel_on_disconnect`), from :data:`DISCONNECT_WATCH_AFTER_S` on; :meth:`stop` at
    the request's end."""

    __slots__ = ("_receive", "_task", "_state", "_timer", "_watcher")

    def __init__(self, receive, task: asyncio.Task, state: ClientState) -> None:
        self._receive, self._task, self._state = receive, task, state
        self._watcher: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            DISCONNECT_WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._timer = None
        self._watcher = asyncio.get_running_loop().create_task(
            _cancel_on_disconnect(self._receive, self._task, self._state))

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()


class ProxyEndpoint:
    """ASGI app for one proxied path. ``kind``: "chat" / "completion" are routed by the policy;
    "forward" goes to the least-loaded healthy worker of the body's model. ``gateway``: the
    :class:`router.gateway.Gateway` (router, upstream, metrics, config); ``auth``: client API
    keys checked before the body is read (None: none needed)."""

    def __init__(self, gateway: Gateway, kind: EndpointKind, auth: ClientAuth | None = None) -> None:
        self.gw = gateway
        self.kind = kind
        self.auth = auth if auth is not None and auth.enabled else None

    async def __call__(self, scope, receive, send) -> None:
        t0 = time.perf_counter()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = request_id_of(headers)
        gw = self.gw
        try:
            if self.auth is not None:
                self.auth.check(headers)
            with trace_span("kvroute.parse"):  # tracing: the parse span (router/telemetry/tracing.py)
                raw = await read_body(receive, headers, gw.cfg.max_body_bytes)
                body = parse_json_object(raw)
        except _ClientGone:
            return
        except GatewayError as exc:
            await self._refuse(send, exc, request_id)
            return
        ctx = RequestContext(self.kind, request_id, t0, scope["method"], scope["path"], headers, raw, body)
        state = ClientState()
        watch = _DisconnectWatch(receive, asyncio.current_task(), state)
        admitted_at = None
        try:
            try:
                admitted_at = await gw.admission.acquire()  # routed only once admitted: fresh load
                await self._route(ctx)
            except GatewayError as exc:
                await self._refuse(send, exc, request_id)
                return
            except Exception as exc:  # a bug must still get an OpenAI-shaped answer
                log.exception("request %s failed before reaching a worker", request_id)
                await self._refuse(send, GatewayError(500, f"internal gateway error: {exc}", "internal_error"),
                                   request_id)
                return
            try:
                await self._relay(send, state, ctx)
            finally:
                ctx.release_reservation()
        except asyncio.CancelledError:
            if state.disconnected:
                asyncio.current_task().uncancel()
                return
            raise
        finally:
            watch.stop()
            if admitted_at is not None:
                gw.admission.release(admitted_at)

    async def _refuse(self, send, exc: GatewayError, request_id: str) -> None:
        """An error the gateway answers before any worker is chosen."""
        self.gw.metrics.requests.labels("none", str(exc.status)).inc()
        await send_json(send, exc.status, exc.body(), request_id, extra_headers=exc.headers)

    async def _route(self, ctx: RequestContext) -> None:
        """The route step for ``ctx``: its plan (none for a forwarded path), workers in order of
        preference, the body bytes to send and whether to strip the usage chunk, the dispatch
        queue's reservation and the decision log's entry; waits in the dispatch queue when the
        policy has it on. Raises GatewayError (400/404/503)."""
        gw = self.gw
        body = ctx.body
        if self.kind == "forward":
            ctx.ranked = gw.router.ranked_by_load(body)
            return
        plan = await gw.router.plan(self.kind, body, ctx.headers, ctx.raw)
        queued_s = time.monotonic()
        holder = self._stored_response_holder(body, plan)
        if holder is not None:  # it continues a response only that worker holds: no queue, no choice
            plan, reservation = gw.router.pin(plan, holder, "stored_response"), None
        elif plan.pd is not None and plan.pd.pooled:  # legs chosen from the role pools (router.route.pd)
            reservation = None
            if plan.pd.split:  # the prefill leg waits for its pool as a whole request would
                reservation = await self._prefill_turn(plan)
            if not plan.pd.split:  # served whole by a decode-pool worker, which computes the prompt
                plan, reservation = await self._decode_turn(plan)
        else:  # a P/D model's agent-API request stays in the decode pool the router chose it from
            pool = frozenset(plan.workers) if gw.router.policy.policy.pd.applies_to(plan.model.name) else None
            plan, reservation = await gw.dispatch_queue.take_turn(plan, pool, fresh=True)  # nothing awaited since
        if plan.pd is not None and not plan.pd.split:
            gw.metrics.child(gw.metrics.pd_requests, plan.model.name, "whole").inc()
        gw.router.record_decision(plan)
        ctx.plan, ctx.ranked, ctx.reservation = plan, plan.ranked(), reservation
        ctx.logged = gw.decisions.record(plan, ctx.request_id, (time.monotonic() - queued_s) * 1000.0)
        if body.get("stream") is True and gw.cfg.routing.measure_stream_usage and self.kind not in AGENT_KINDS:
            ctx.raw, ctx.strip_usage = request_stream_usage(ctx.raw, body)

    def _stored_response_holder(self, body: dict[str, Any], plan: RoutePlan) -> str | None:
        """For a Responses request continuing a stored response (``previous_response_id``), the
        routable worker that made it (:mod:`router.route.stored_responses`), else None."""
        previous = body.get("previous_response_id") if self.kind == "responses" else None
        if not isinstance(previous, str):
            return None
        worker = self.gw.stored_responses.worker_of(previous)
        return worker if worker in plan.workers else None

    async def _prefill_turn(self, plan: RoutePlan) -> Reservation | None:
        """The split ``plan``'s prefill leg through the dispatch queue (on when the policy has
        it): waits until a prefill-pool worker is open, re-chosen by the prefill leg's policy
        (``plan.pd.prefill`` replaced); the reservation (None with the queue off) is released
        once the leg is in flight. When the pool has no routable worker left, or the re-chosen
        worker is the decode worker (role ``both``), the decode worker serves the request
        whole (outcome ``whole``, reason ``no_prefill_pool`` / ``same_worker``)."""
        legs = plan.pd
        chooser = prefill_policy(self.gw.router.policy.policy)
        try:
            prefill, reservation = await self.gw.dispatch_queue.take_turn(
                legs.prefill, frozenset(legs.prefill.workers), chooser)
        except GatewayError:
            legs.outcome, legs.reason, legs.prefill = "whole", "no_prefill_pool", None
            return None
        if reservation is not None and prefill.decision.worker_id == legs.decode_worker:
            reservation.release()
            legs.outcome, legs.reason, legs.prefill = "whole", "same_worker", None
            return None
        legs.prefill = prefill
        return reservation

    async def _decode_turn(self, plan: RoutePlan) -> tuple[RoutePlan, Reservation | None]:
        """A request the decode pool serves whole (P/D outcome ``whole``, or its prefill leg
        failed) through the dispatch queue, as any whole request: it waits until a decode-pool
        worker is open and is re-chosen there by the decode leg's cost
        (:class:`router.route.pd.DecodePolicy`). Returns the plan to send it by and the reservation (None
        with the queue off). Raises GatewayError 503 when the decode pool has no routable worker."""
        legs = plan.pd
        plan, reservation = await self.gw.dispatch_queue.take_turn(plan, frozenset(plan.workers), DECODE_POLICY)
        legs.dispatched_to(plan.decision.worker_id)
        return plan, reservation

    async def _prefill_leg(self, send, state: ClientState, ctx: RequestContext) -> tuple[PrefillResult, float]:
        """The prefill leg of a split ``ctx`` (:func:`router.edge.prefill_leg.prefill_leg`) and its
        time in seconds; its outcome goes to the decision log and ``kvroute_pd_requests_total``."""
        gw, plan = self.gw, ctx.plan
        prefill = plan.pd.prefill
        leg_s = time.perf_counter()
        try:  # the prefill worker computed the prompt: its leg teaches its rate and evidence
            result = await prefill_leg(gw, send, state, ctx,
                                       on_answer=lambda handle: gw.feedback.first_token(prefill, handle),
                                       on_usage=lambda handle, n: gw.feedback.usage(prefill, handle, n),
                                       on_begin=ctx.release_reservation)
        except Exception:  # a bug in the leg: the decode worker serves the request whole
            if state.response_started:
                raise
            log.exception("request %s: prefill leg failed", ctx.request_id)
            result = PrefillResult(detail="internal error")
        leg_s = time.perf_counter() - leg_s
        outcome = "prefill_rejected" if result.answered else "split" if result.params is not None \
            else "prefill_failed"
        DecisionLog.prefill(ctx.logged, leg_s * 1000.0, outcome, result.cached_tokens)
        gw.metrics.child(gw.metrics.pd_requests, plan.model.name, outcome).inc()
        return result, leg_s

    def _hooks(self, ctx: RequestContext, on_attempt, split: bool) -> RelayHooks:
        """What the relay reports back for ``ctx``. Split: the decode worker received the
        prompt's KV and computed none of it; it reports the transferred tokens as cached and its
        first token comes after the transfer, so its answer teaches neither its evidence trust nor
        its prefill rate, and its cached tokens are not booked in the metrics (the prefill leg
        booked the request's figures for the prefill worker, which computed the prompt): only the
        decision log gets them. Forwarded (no plan): nothing to learn."""
        gw, plan, logged = self.gw, ctx.plan, ctx.logged
        on_refused = (lambda reg: gw.router.withdraw(plan, reg)) if plan is not None else None
        if split:
            return RelayHooks(on_attempt=on_attempt, on_refused=on_refused,
                              on_cached_tokens=lambda handle, n: DecisionLog.usage(logged, n),
                              on_first_token=lambda handle: DecisionLog.first_token(logged, handle.ttft_ms))
        if plan is None:
            return RelayHooks()
        return RelayHooks(
            uncached_tokens=plan.uncached_tokens, predicted_ttft_ms=plan.predicted_ttft_ms,
            presumed_ttft_ms=plan.predicted_ttft_ms if ctx.body.get("stream") is not True else None,
            on_attempt=on_attempt, on_refused=on_refused,
            on_answer=(lambda reg, first: gw.stored_responses.learn(reg.id, first)) if self.kind == "responses"
            else None,
            on_first_token=lambda handle: gw.feedback.first_token(plan, handle, logged),
            on_cached_tokens=lambda handle, n: gw.feedback.usage(plan, handle, n, logged))

    async def _relay(self, send, state: ClientState, ctx: RequestContext) -> None:
        gw = self.gw
        plan, logged = ctx.plan, ctx.logged
        split = plan is not None and plan.pd is not None and plan.pd.split
        fallback = False
        t0_sent = ctx.t0
        raw = ctx.raw
        response_headers = None
        if split:  # the prefill leg first (router.edge.prefill_leg); then the decode leg below
            result, leg_s = await self._prefill_leg(send, state, ctx)
            if result.answered:
                return
            split = result.params is not None
            if split:
                raw = decode_body(raw, result.params)
                response_headers = [(b"x-kvroute-prefill-worker", plan.pd.prefill_worker.encode("latin-1"))]
            fallback = not split  # the decode pool computes the prompt: a turn as a whole request
            t0_sent = ctx.t0 + leg_s  # the decision log's gateway_ms leaves the prefill leg out

        async def on_attempt(reg: WorkerRegistration) -> None:
            DecisionLog.sent(logged, reg.id, t0_sent)
            await gw.router.commit(ctx.plan, reg)
            ctx.release_reservation()  # counted in flight right after this returns

        req = RelayRequest(ctx.method, ctx.path, raw, upstream_headers(ctx.headers, ctx.request_id), ctx.request_id,
                           ctx.t0, ctx.strip_usage, response_headers)
        ranked = ctx.ranked
        try:
            if fallback:
                ctx.release_reservation()  # the prefill turn's, if the leg never began
                ctx.plan, ctx.reservation = await self._decode_turn(plan)
                plan, ranked = ctx.plan, ctx.plan.ranked()
            await gw.upstream.relay(send, state, req, ranked, self._hooks(ctx, on_attempt, split))
        except GatewayError as exc:
            worker = ranked[0].id if ranked else "none"
            gw.metrics.requests.labels(worker, str(exc.status)).inc()
            log.warning("request %s: %s", ctx.request_id, exc.message)
            if not state.response_started:
                await send_json(send, exc.status, exc.body(), ctx.request_id, worker)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if state.response_started:
                # the worker broke an answer already under way: returning without completing it
                # makes the server close the connection, so the client sees a truncated response
                log.warning("request %s: response from %s broken: %r", ctx.request_id, ranked[0].id, exc)
                return
            if isinstance(exc, (aiohttp.ClientError, UpstreamError)):
                err = upstream_failed(ranked[0].id, f"{type(exc).__name__}: {exc}")
            else:
                log.exception("request %s failed", ctx.request_id)
                err = GatewayError(500, f"internal gateway error: {exc}", "internal_error")
            gw.metrics.requests.labels(ranked[0].id, str(err.status)).inc()
            await send_json(send, err.status, err.body(), ctx.request_id, ranked[0].id)
