"""The gateway's FastAPI app (DESIGN.md "Gateway HTTP").

Routed by the policy: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST
/v1/messages`` (Anthropic's Messages API) and ``POST /v1/responses``, the last two tokenized as
vLLM converts them to chat (:mod:`kvcore.anthropic_messages`, :mod:`kvcore.responses_input`).
Forwarded to the least-loaded healthy worker of the body's model: vLLM's other client POST paths
(:data:`FORWARDED`: embeddings, tokenize, detokenize, Anthropic token counting, render). Also ``GET /v1/models``
(union over healthy workers), ``GET /version`` (the first healthy worker's), ``GET /health`` and
``GET /ping`` (the gateway's liveness), ``GET /health/ready`` (readiness: a worker is routable), ``GET /metrics``, ``/admin/*`` (:mod:`router.edge.admin`) and ``GET /dashboard`` (:mod:`router.edge.dashboard`).
Not served: ``GET /v1/responses/{id}`` (a stored response lives on the one worker that made it).
Browsers' cross-origin requests get the ``cors`` config's answer everywhere.

The proxied paths are raw ASGI apps (:mod:`router.edge.endpoints`): FastAPI never validates or
re-serializes their bodies, and :class:`HotPathDispatch` hands POSTs to them before FastAPI's
middleware stack (half a dozen wrappers per request), which serves everything else. Run it with
uvicorn on uvloop + httptools (:mod:`router.cli`).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from router.config.schema import CorsConfig
from router.edge.admin import make_admin_router
from router.edge.client_auth import ClientAuth
from router.edge.dashboard import make_dashboard_router
from router.edge.endpoints import ProxyEndpoint
from router.edge.openapi import serve_openapi
from router.errors import GatewayError, bad_request
from router.gateway import Gateway
from router.processes.group import is_from_sibling, merge_metrics
from router.route.prompt_blocks import ROUTED_PATHS
from router.telemetry import tracing
from router.workers.calls import worker_get, worker_models

log = logging.getLogger("kvroute.app")

ROUTED = ROUTED_PATHS
# vLLM 0.32's other client-facing POST paths: each goes to one worker of the body's model
FORWARDED = ("/v1/embeddings", "/tokenize", "/detokenize", "/v1/messages/count_tokens",
             "/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render")


class HotPathDispatch:
    """ASGI front: ``POST`` to a proxied path goes straight to its endpoint (through ``cors``,
    the CORS wrapper, only when the request names an ``Origin``); everything else (other methods,
    other paths, lifespan) to the FastAPI ``app``, whose CORS middleware answers preflights."""

    def __init__(self, app: FastAPI, endpoints: dict[str, ProxyEndpoint],
                 cors: Callable[[ProxyEndpoint], Any] | None = None) -> None:
        self.app = app
        self.endpoints = endpoints
        self.cors_endpoints = {path: cors(e) for path, e in endpoints.items()} if cors else dict(endpoints)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                for name, _ in scope["headers"]:
                    if name == b"origin":
                        endpoint = self.cors_endpoints[scope["path"]]
                        break
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


def cors_wrapper(cfg: CorsConfig) -> Callable[[Any], CORSMiddleware]:
    """``wrap(asgi_app)``: the app behind Starlette's CORS middleware with ``cfg``."""
    return functools.partial(CORSMiddleware, allow_origins=cfg.allowed_origins, allow_methods=cfg.allowed_methods,
                             allow_headers=cfg.allowed_headers, allow_credentials=cfg.allow_credentials)


GC_YOUNG_THRESHOLD = 20_000  # allocations less frees between young collections (CPython's default: 700)


def create_app(gateway: Gateway) -> HotPathDispatch | tracing.TracedASGI:
    """The ASGI app serving ``gateway``: a FastAPI app (lifespan starts and stops the gateway
    and, when the gateway has a config path, re-reads it on SIGHUP) behind
    :class:`HotPathDispatch`; with tracing on (the ``OTEL_*`` environment,
    :mod:`router.telemetry.tracing`), that behind OpenTelemetry's ASGI middleware
    (:class:`router.telemetry.tracing.TracedASGI`). The FastAPI app is the result's ``.app``."""
    tracing.setup_from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        # what start-up made (imports, tokenizers, the config's objects) lives as long as the
        # process: out of the cyclic collector's reach, a full collection walks only what came
        # after (a full collection's walk is a pause for every request in flight; figures:
        # docs/tuning/event_loop.md)
        gc.freeze()
        # a decision allocates a few objects per candidate; at the default 700 allocations per
        # young collection a 1,024-worker decision ran ~7 of them, each a walk of what is young
        thresholds = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
        hup = _install_sighup(gateway)
        try:
            yield
        finally:
            gc.set_threshold(*thresholds)
            if hup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            await gateway.stop()
            tracing.flush()

    # FastAPI's own OpenTelemetry (fastapi.telemetry, newer FastAPI; ignored by older ones) stays
    # off: the gateway's spans come from router/telemetry/tracing.py alone, one server span per request
    app = FastAPI(title="kvroute gateway", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None, telemetry={"tracing": False, "metrics": False, "logs": False,
                                             "operation_spans": False, "auto_configure": False})
    app.state.gateway = gateway
    if gateway.group is not None:  # which of the N processes answered (admin, metrics, health)
        process = str(gateway.group.index)

        @app.middleware("http")
        async def name_process(request: Request, call_next):
            response = await call_next(request)
            response.headers["x-kvroute-process"] = process
            return response

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return Response(exc.body(), status_code=exc.status, media_type="application/json",
                        headers={k.decode("latin-1"): v.decode("latin-1") for k, v in exc.headers})

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # a bad query or path parameter: 400 in the OpenAI shape, as vLLM answers, not FastAPI's 422
        errors = exc.errors()
        loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x not in ("query", "path", "body")]
        message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors)
        err = bad_request(message or "invalid request", loc[0] if loc else None)
        return Response(err.body(), status_code=400, media_type="application/json")

    auth = ClientAuth.from_config(gateway.cfg.client_auth)  # client API keys (off unless configured)
    endpoints = {path: ProxyEndpoint(gateway, kind, auth) for path, kind in ROUTED.items()}
    endpoints.update({path: ProxyEndpoint(gateway, "forward", auth) for path in FORWARDED})
    for path, endpoint in endpoints.items():  # also in FastAPI, so other methods get a 405
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))

    @app.get("/health")
    async def health() -> Response:
        up = sum(1 for r in gateway.registry.all() if r.routable)
        return Response(orjson.dumps({"status": "ok", "workers": len(gateway.registry), "routable": up}),
                        media_type="application/json")

    @app.get("/health/ready")
    async def ready() -> Response:
        """Readiness (Kubernetes): 200 while at least one worker is routable, else 503; liveness
        is ``/health``, which answers as long as the process serves."""
        up = sum(1 for r in gateway.registry.all() if r.routable)
        body = {"status": "ready" if up else "not_ready", "workers": len(gateway.registry), "routable": up}
        return Response(orjson.dumps(body), status_code=200 if up else 503, media_type="application/json")

    @app.get("/ping")
    async def ping() -> Response:  # vLLM's (SageMaker's) liveness path: the gateway answers for itself
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return await _first_worker_answer(gateway, "/version")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        text = gateway.metrics.exposition()
        group = gateway.group
        if group is not None and not is_from_sibling(request.headers):  # every process's, labelled
            got = {i: body.decode() for i, status, body in await group.fanout("GET", "/metrics") if status == 200}
            text = merge_metrics({group.index: text.decode(), **got})
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth.check(request.scope["headers"])
        return Response(orjson.dumps(await _union_models(gateway)), media_type="application/json")

    app.include_router(make_admin_router(gateway))
    app.include_router(make_dashboard_router())  # GET /dashboard, the operator's page
    serve_openapi(app, [m.name for m in gateway.cfg.models])  # GET /openapi.json, as vLLM serves
    cors = cors_wrapper(gateway.cfg.cors)
    app.add_middleware(CORSMiddleware, **cors.keywords)
    return tracing.instrument_asgi(HotPathDispatch(app, endpoints, cors))


async def _union_models(gateway: Gateway) -> dict[str, Any]:
    """``{"object": "list", "data": [...]}``: every model card of every healthy worker, once per
    id (first worker in id order wins). The workers are asked at once, each call bounded by
    ``timeouts.worker_call_s``; a worker that fails or is slow is skipped (logged, counted in
    ``kvroute_worker_call_failures_total{call="models"}``) and never delays the others' cards."""
    regs = sorted((r for r in gateway.registry.all() if r.healthy), key=lambda r: r.id)
    timeout_s = gateway.cfg.timeouts.worker_call_s
    answers = await asyncio.gather(*[worker_models(gateway.upstream.http, r, timeout_s) for r in regs])
    seen: dict[str, dict[str, Any]] = {}
    for reg, cards in zip(regs, answers):
        if isinstance(cards, str):
            log.warning("GET %s/v1/models (worker %s) failed, its models are left out: %s", reg.url, reg.id, cards)
            gateway.metrics.worker_call_failures.labels(reg.id, "models").inc()
            continue
        for card in cards:
            seen.setdefault(card["id"], card)
    return {"object": "list", "data": list(seen.values())}


async def _first_worker_answer(gateway: Gateway, path: str) -> Response:
    """``GET path`` of the healthy workers, asked in id order until one answers 200 (each call
    bounded by ``timeouts.worker_call_s``; failures counted as for the models listing); its
    JSON body. 503 in the OpenAI shape when none answers."""
    for reg in sorted((r for r in gateway.registry.all() if r.healthy), key=lambda r: r.id):
        got = await worker_get(gateway.upstream.http, reg, path, gateway.cfg.timeouts.worker_call_s)
        if isinstance(got, bytes):
            return Response(got, media_type="application/json", headers={"x-kvroute-worker": reg.id})
        log.warning("GET %s%s (worker %s) failed: %s", reg.url, path, reg.id, got)
        gateway.metrics.worker_call_failures.labels(reg.id, path.strip("/")).inc()
    err = GatewayError(503, f"no healthy worker answered GET {path}", "service_unavailable", "no_healthy_worker")
    return Response(err.body(), status_code=503, media_type="application/json")


def _install_sighup(gateway: Gateway) -> bool:
    if gateway.config_path is None:
        return False
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(gateway.reload()))
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True
