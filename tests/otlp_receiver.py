"""Test helper: a small OTLP/HTTP trace receiver on loopback, the collector side of what the
gateway's OpenTelemetry exporter sends (OTLP specification, "OTLP/HTTP": ``POST /v1/traces``, body a
protobuf ``ExportTraceServiceRequest``, optionally gzip-encoded; answer 200 with an
``ExportTraceServiceResponse``). Spans are decoded with opentelemetry-proto and kept in memory.

Use: ``with OtlpReceiver() as rx: ... env OTEL_EXPORTER_OTLP_ENDPOINT=rx.url ...; rx.spans_of(trace_id)``.
Runs ``http.server`` in a daemon thread; ``close()`` (or leaving the ``with``) stops it.
As a process (benchmarks/bench_tracing.py): ``python tests/otlp_receiver.py --port P [--life-s S]``
keeps bodies undecoded until ``GET /stats`` asks (``{"posts", "bytes", "spans", "names",
"services"}``), so decoding never competes with the traffic being measured; it exits after
``--life-s`` seconds.
"""
from __future__ import annotations

import argparse
import gzip
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                         ExportTraceServiceResponse)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

KIND_NAMES = {ProtoSpan.SPAN_KIND_INTERNAL: "INTERNAL", ProtoSpan.SPAN_KIND_SERVER: "SERVER",
              ProtoSpan.SPAN_KIND_CLIENT: "CLIENT", ProtoSpan.SPAN_KIND_PRODUCER: "PRODUCER",
              ProtoSpan.SPAN_KIND_CONSUMER: "CONSUMER", ProtoSpan.SPAN_KIND_UNSPECIFIED: "UNSPECIFIED"}


@dataclass
class SpanRecord:
    """One received span. Ids are lower-case hex (32 digits for traces, 16 for spans; ``parent_id``
    "" for a root); times in ns since the epoch; ``status``: 0 unset, 1 ok, 2 error."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start_ns: int
    end_ns: int
    status: int
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)


def _any_value(v) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def decode_spans(body: bytes) -> list[SpanRecord]:
    """The spans of one ``ExportTraceServiceRequest`` body. Raises google.protobuf's DecodeError
    on a body that is not one."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {kv.key: _any_value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(SpanRecord(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                      KIND_NAMES.get(s.kind, str(s.kind)), s.start_time_unix_nano,
                                      s.end_time_unix_nano, s.status.code, str(res.get("service.name", "")),
                                      {kv.key: _any_value(kv.value) for kv in s.attributes}))
    return out


class OtlpReceiver:
    """The receiver on ``port`` (0: any free one); ``url``: its base (``http://127.0.0.1:PORT``, what
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes); ``posts``: export requests received; ``bytes``: their
    body bytes; ``spans``: every span so far (a copy). ``lazy``: keep bodies and decode them only
    when ``spans`` is read (a bad body then raises DecodeError there instead of a 400)."""

    def __init__(self, port: int = 0, lazy: bool = False) -> None:
        self._lock = threading.Lock()
        self._spans: list[SpanRecord] = []
        self._pending: list[bytes] = []
        self.posts = 0
        self.bytes = 0
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding", "").lower() == "gzip":
                    body = gzip.decompress(body)
                try:
                    spans = ([] if lazy else decode_spans(body)) if self.path == "/v1/traces" else None
                except Exception:  # noqa: BLE001 - a bad body is the sender's bug: 400, as a collector
                    spans = None
                with receiver._lock:
                    receiver.posts += 1
                    receiver.bytes += len(body)
                    receiver.paths.append(self.path)
                    receiver._spans.extend(spans or [])
                    if lazy and spans is not None:
                        receiver._pending.append(body)
                if spans is None:
                    self.send_response(404 if self.path != "/v1/traces" else 400)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self) -> None:  # noqa: N802
                if self.path != "/stats":
                    self.send_error(404)
                    return
                spans = receiver.spans
                out = json.dumps({"posts": receiver.posts, "bytes": receiver.bytes, "spans": len(spans),
                                  "names": sorted({s.name for s in spans}),
                                  "services": sorted({s.service for s in spans})}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    @property
    def spans(self) -> list[SpanRecord]:
        with self._lock:
            pending, self._pending = self._pending, []
            for body in pending:
                self._spans.extend(decode_spans(body))
            return list(self._spans)

    def spans_of(self, trace_id: str) -> list[SpanRecord]:
        """The spans received so far whose trace id is ``trace_id`` (hex)."""
        return [s for s in self.spans if s.trace_id == trace_id]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="OTLP/HTTP trace receiver on loopback (test and benchmark helper)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--life-s", type=float, default=1800, help="exit after this many seconds")
    args = ap.parse_args()
    rx = OtlpReceiver(args.port, lazy=True)
    print(f"receiving on {rx.url}", flush=True)
    threading.Event().wait(args.life_s)
    rx.close()


if __name__ == "__main__":
    main()
