"""OpenTelemetry tracing of the gateway: off unless the standard ``OTEL_*`` variables turn it on.

On (:func:`tracing_wanted`): ``OTEL_TRACES_EXPORTER`` names an exporter other than ``none``, or,
with that variable unset, ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
is set (the exporter is then ``otlp``, the specification's default); and ``OTEL_SDK_DISABLED`` is
not ``true``. Everything else is the OpenTelemetry SDK's own reading of the environment
(specification "Environment Variable Specification"): the exporter classes come from the SDK's
``opentelemetry_traces_exporter`` entry points (``otlp``: the OTLP exporter of
``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``, ``http/protobuf`` when unset, as the specification
defaults and unlike the Python SDK's own ``grpc``; ``console``; any installed one by its entry-point
name) and read their ``OTEL_EXPORTER_OTLP_*`` settings themselves; the batch processor reads
``OTEL_BSP_*`` (one kvroute default: export batches of :data:`EXPORT_BATCH_SPANS` spans rather than
the SDK's 512, unless ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` or ``OTEL_BSP_MAX_QUEUE_SIZE`` is set:
encoding a batch holds the interpreter's lock, so a large batch stalls the event loop; figures:
docs/tuning/event_loop.md), the sampler ``OTEL_TRACES_SAMPLER[_ARG]``, the resource
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (service name ``kvroute-gateway`` when neither gives one), the
propagators ``OTEL_PROPAGATORS`` (W3C ``traceparent`` + baggage by default).

Off, nothing of the SDK is imported, no tracer provider is installed and :func:`span` hands out
one shared do-nothing context manager: the cost is a global read per step. A client's
``traceparent`` then passes through to the worker unchanged, as every other header does.

On, the app runs behind OpenTelemetry's ASGI middleware (:func:`instrument_asgi`: one SERVER span
per request, continuing the client's ``traceparent``; ``/health``, ``/ping`` and ``/metrics`` are
left out unless ``OTEL_PYTHON_ASGI_EXCLUDED_URLS`` / ``OTEL_PYTHON_EXCLUDED_URLS`` say otherwise),
and the gateway's steps are its children::

    POST /v1/chat/completions     SERVER (ASGI); the routing decision's attributes, kvroute.*
      kvroute.parse               body read and JSON-parsed
      kvroute.tokenize            prompt -> token ids -> block keys
      kvroute.lookup              index match of the block keys
      kvroute.choose              the policy's choice
      kvroute.upstream            CLIENT, one per attempt on a worker; its context goes to the
                                  worker as traceparent (vLLM's own spans join the trace there)
        kvroute.ttfb              request sent -> the worker's first byte
        kvroute.stream            the relay of the body to the client

The server span ends as the last byte is sent (the ASGI middleware's rule), so ``kvroute.stream``
and ``kvroute.upstream`` end some microseconds after their parent.

Attribute names (:data:`ATTR`) are the gateway's terms as ``POST /admin/explain`` and the decision
log spell them (DESIGN.md), under ``kvroute.``; the model is ``gen_ai.request.model`` and HTTP
ones follow OpenTelemetry's HTTP semantic conventions.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

log = logging.getLogger("kvroute.tracing")

SERVICE_NAME_DEFAULT = "kvroute-gateway"
EXCLUDED_URLS_DEFAULT = "/health,/ping,/metrics"
ENTRY_POINT_GROUP = "opentelemetry_traces_exporter"
EXPORT_BATCH_SPANS = 64  # spans per export unless OTEL_BSP_MAX_EXPORT_BATCH_SIZE / _MAX_QUEUE_SIZE say
# OTLP protocol -> the entry-point name of its exporter (as the SDK maps them)
OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
OTLP_PACKAGES = {"otlp_proto_http": "opentelemetry-exporter-otlp-proto-http",
                 "otlp_proto_grpc": "opentelemetry-exporter-otlp-proto-grpc"}

# attribute names, the gateway's terms (DESIGN.md: explain answer, decision log, Terms)
ATTR = {
    "model": "gen_ai.request.model",
    "policy": "kvroute.policy",
    "prompt_tokens": "kvroute.prompt_tokens",
    "blocks": "kvroute.blocks",
    "candidates": "kvroute.candidates",
    "matched_workers": "kvroute.matched_workers",
    "matched_blocks": "kvroute.matched_blocks",
    "chosen": "kvroute.chosen",
    "reason": "kvroute.reason",
    "predicted_cached_tokens": "kvroute.predicted_cached_tokens",
    "predicted_ttft_ms": "kvroute.predicted_ttft_ms",
    "actual_cached_tokens": "kvroute.actual_cached_tokens",
    "tokenization_fallback": "kvroute.tokenization_fallback",
    "index_unavailable": "kvroute.index_unavailable",
    "worker": "kvroute.worker",
    "request_id": "kvroute.request_id",
    "attempt": "kvroute.attempt",
}


class _NoSpan:
    """The shared context manager :func:`span` returns while tracing is off: enters to the API's
    non-recording ``INVALID_SPAN`` (whose setters do nothing), records nothing, raises nothing."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()
_tracer: trace.Tracer | None = None  # set by setup_from_env when tracing is on
_provider: Any = None  # the SDK TracerProvider this module installed, if any
_inject: Any = None  # opentelemetry.propagate.inject, once on
_propagated: frozenset[str] = frozenset()  # header names the global propagator writes (lower case)
_configured = False


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    """``OTEL_TRACES_EXPORTER``'s names (comma-separated, ``none`` dropped); ``["otlp"]`` when it
    is unset or empty and an OTLP endpoint is set; else ``[]``."""
    raw = (env.get("OTEL_TRACES_EXPORTER") or "").strip()
    if not raw:
        endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "")
        return ["otlp"] if endpoint.strip() else []
    return [n.strip().lower() for n in raw.split(",") if n.strip() and n.strip().lower() != "none"]


def tracing_wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default ``os.environ``) turns tracing on (module docstring): an exporter
    is named (or implied by an OTLP endpoint) and ``OTEL_SDK_DISABLED`` is not ``true``."""
    env = os.environ if env is None else env
    return not _truthy(env.get("OTEL_SDK_DISABLED")) and bool(_exporter_names(env))


def exporter_entry_points(env: Mapping[str, str] | None = None) -> list[str]:
    """The ``opentelemetry_traces_exporter`` entry-point names ``env`` asks for, in order, without
    repeats: ``otlp`` becomes the exporter of ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``http/protobuf``); other names are kept as given.
    Raises ValueError for an OTLP protocol the SDK has no exporter for (e.g. ``http/json``)."""
    env = os.environ if env is None else env
    out: list[str] = []
    for name in _exporter_names(env):
        if name == "otlp":
            protocol = ((env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                         or "http/protobuf").strip().lower())
            if protocol not in OTLP_BY_PROTOCOL:
                raise ValueError(f"OTLP protocol {protocol!r} is not supported; use one of "
                                 f"{', '.join(sorted(OTLP_BY_PROTOCOL))}")
            name = OTLP_BY_PROTOCOL[protocol]
        if name not in out:
            out.append(name)
    return out


def _load_exporter_classes(names: list[str]) -> list[type]:
    """The exporter classes of ``names`` from installed entry points. Raises ValueError naming
    the package to install for one that is missing."""
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    classes = []
    for name in names:
        ep = found.get(name)
        if ep is None:
            hint = f" (pip install {OTLP_PACKAGES[name]})" if name in OTLP_PACKAGES else ""
            raise ValueError(f"no trace exporter {name!r} is installed{hint}; installed: "
                             f"{', '.join(sorted(found)) or 'none'}")
        classes.append(ep.load())
    return classes


def setup_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on when ``env`` (default ``os.environ``) asks for it: build the SDK's
    ``TracerProvider`` (resource, sampler from the environment) with one ``BatchSpanProcessor``
    per exporter (:data:`EXPORT_BATCH_SPANS` spans a batch unless the environment sizes them),
    install it as the global provider and keep a tracer for :func:`span`. Returns whether
    tracing is on. Idempotent: later calls return the first call's answer. A request the
    SDK cannot serve (an unknown exporter, one not installed, an unsupported OTLP protocol) is
    logged as an error and leaves tracing off: the gateway serves without it. Never raises."""
    global _tracer, _provider, _configured, _inject, _propagated
    if _configured:
        return _tracer is not None
    _configured = True
    env = os.environ if env is None else env
    if not tracing_wanted(env):
        return False
    try:
        names = exporter_entry_points(env)
        classes = _load_exporter_classes(names)
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: SERVICE_NAME_DEFAULT}))
        provider = TracerProvider(resource=resource)
        batch = (None if env.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") or env.get("OTEL_BSP_MAX_QUEUE_SIZE")
                 else EXPORT_BATCH_SPANS)
        for cls in classes:
            provider.add_span_processor(BatchSpanProcessor(cls(), max_export_batch_size=batch))
    except Exception as exc:  # noqa: BLE001 - tracing must never keep the gateway from serving
        log.error("tracing is off: the OTEL_* settings cannot be served: %s", exc)
        return False
    from opentelemetry import propagate

    trace.set_tracer_provider(provider)
    _provider = provider
    _inject = propagate.inject
    _propagated = frozenset(f.lower() for f in propagate.get_global_textmap().fields)
    _tracer = trace.get_tracer("kvroute.gateway")
    log.info("tracing on: exporters %s, service %s", ", ".join(names), resource.attributes.get(SERVICE_NAME))
    return True


def enabled() -> bool:
    """Whether :func:`setup_from_env` turned tracing on in this process."""
    return _tracer is not None


def flush(timeout_ms: int = 5000) -> None:
    """Export the spans still buffered (at gateway stop; the SDK also flushes at process exit).
    Waits at most ``timeout_ms``; does nothing while tracing is off. Never raises."""
    if _provider is not None:
        try:
            _provider.force_flush(timeout_ms)
        except Exception:  # noqa: BLE001
            log.exception("flushing spans failed")


def span(name: str, kind: SpanKind = SpanKind.INTERNAL):
    """``with span(name) as s:``: a child of the current span, current inside the block, ended at
    its exit (an exception escaping the block is recorded on it, status ERROR). While tracing is
    off: a shared no-op context manager whose ``s`` is the API's non-recording span."""
    if _tracer is None:
        return _NO_SPAN
    return _tracer.start_as_current_span(name, kind=kind)


def current_span() -> Span:
    """The current span (the ASGI server span inside a request), ``INVALID_SPAN`` while tracing
    is off or outside any span."""
    if _tracer is None:
        return INVALID_SPAN
    return trace.get_current_span()


def set_attributes(s: Span, attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` (names from :data:`ATTR` keys, or full names containing a dot) on span
    ``s``, skipping None values; nothing when ``s`` does not record."""
    if not s.is_recording():
        return
    for key, value in attributes.items():
        if value is not None:
            s.set_attribute(ATTR.get(key, key), value)


def set_http_status(s: Span, status: int) -> None:
    """``http.response.status_code`` on a CLIENT span ``s``, status ERROR for 4xx and 5xx (the HTTP
    semantic conventions for client spans)."""
    if not s.is_recording():
        return
    s.set_attribute("http.response.status_code", status)
    if status >= 400:
        s.set_status(trace.StatusCode.ERROR, f"HTTP {status}")


def inject_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` for a worker with the current context's propagation headers (W3C
    ``traceparent``/``tracestate``, ``baggage``; ``OTEL_PROPAGATORS``) in place of any the client
    sent: a new list; ``headers`` itself unchanged while tracing is off."""
    if _tracer is None:
        return headers
    carrier: dict[str, str] = {}
    _inject(carrier)
    drop = _propagated.union(k.lower() for k in carrier)
    out = [(k, v) for k, v in headers if k.lower() not in drop]
    out.extend(carrier.items())
    return out


class TracedASGI:
    """ASGI app ``inner`` behind OpenTelemetry's ``OpenTelemetryMiddleware`` (one SERVER span per
    HTTP request, no per-message send/receive spans; the excluded URLs of the module docstring).
    ``.app`` is ``inner.app`` (the FastAPI app behind the gateway's dispatch) and ``.inner`` is
    ``inner``."""

    def __init__(self, inner: Any) -> None:
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
        from opentelemetry.util.http import get_excluded_urls, parse_excluded_urls

        excluded = get_excluded_urls("ASGI")
        if not (os.environ.get("OTEL_PYTHON_ASGI_EXCLUDED_URLS") or os.environ.get("OTEL_PYTHON_EXCLUDED_URLS")):
            excluded = parse_excluded_urls(EXCLUDED_URLS_DEFAULT)
        self.inner = inner
        self.app = getattr(inner, "app", None)
        self._middleware = OpenTelemetryMiddleware(inner, excluded_urls=excluded, exclude_spans=["receive", "send"])

    async def __call__(self, scope, receive, send) -> None:
        await self._middleware(scope, receive, send)


def instrument_asgi(app: Any) -> Any:
    """``app`` as :class:`TracedASGI` while tracing is on, else ``app`` itself."""
    return TracedASGI(app) if _tracer is not None else app


__all__ = ["ATTR", "SpanKind", "TracedASGI", "current_span", "enabled", "exporter_entry_points", "flush",
           "inject_headers", "instrument_asgi", "set_attributes", "set_http_status", "setup_from_env", "span",
           "tracing_wanted"]
