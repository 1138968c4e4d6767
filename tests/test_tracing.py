"""OpenTelemetry tracing of the gateway (router/telemetry/tracing.py), end to end with real parts: `kvroute
serve` as a subprocess exporting over OTLP/HTTP protobuf to a receiver this test runs
(tests/otlp_receiver.py), two `kvroute sim` workers, the `openai` SDK as the client with its own
W3C ``traceparent``. Checked: the spans' names and parent links, the trace continuing the
client's, the routing attributes against the response (x-kvroute-worker, usage), the
``traceparent`` the worker received (the sim records request headers: GET /sim/requests) naming
the gateway's upstream span; off by default (no SDK provider, nothing exported, the client's
``traceparent`` passed through untouched); and the OTEL_* decision table.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from conftest import Proc, free_ports, kvroute_argv, wait_http, wait_until
from otlp_receiver import OtlpReceiver, SpanRecord
from router.telemetry import tracing

BLOCK = 16
ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
STEPS = ("kvroute.parse", "kvroute.tokenize", "kvroute.lookup", "kvroute.choose", "kvroute.upstream")
OTEL_OFF = {"OTEL_TRACES_EXPORTER": "", "OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
            "OTEL_SDK_DISABLED": ""}  # what the test runner's own environment might have set


def _sim_argv(tiny_model: Path, port: int) -> list[str]:
    return kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny", "--host", "127.0.0.1",
                        "--port", str(port), "--block-size", str(BLOCK), "--num-gpu-blocks-override", "512",
                        "--max-model-len", "4096", "--enable-prompt-tokens-details", "--speedup", "50",
                        "--seed", "3")


def _gateway_cfg(port: int, tiny_model: Path, sims: dict[str, str]) -> dict:
    return {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
            "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
            "index": {"backend": "memory"},
            "workers": [{"id": wid, "url": url, "model": "tiny"} for wid, url in sims.items()],
            "policy": {"name": "kv_aware"}, "timeouts": {"connect_s": 2, "first_byte_s": 20}}


def _start_gateway(name: str, cfg: dict, log_dir: Path, env: dict[str, str], started: list[Proc]) -> tuple[str, Proc]:
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc(name, kvroute_argv("serve", "--config", str(path)), log_dir, env={**OTEL_OFF, **env})
    started.append(proc)
    base = f"http://127.0.0.1:{cfg['listen']['port']}"
    wait_http(base + "/health", proc, timeout_s=180)
    return base, proc


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_model):
    """Two sims, an OTLP receiver and a traced gateway: ``(gateway base URL, {worker id: sim URL},
    receiver, log dir, gateway config maker)``."""
    log_dir = tmp_path_factory.mktemp("tracing")
    started: list[Proc] = []
    rx = OtlpReceiver()
    try:
        p0, p1, gw_port = free_ports(3)
        sims = {"w0": f"http://127.0.0.1:{p0}", "w1": f"http://127.0.0.1:{p1}"}
        procs = [Proc(wid, _sim_argv(tiny_model, int(url.rsplit(":", 1)[1])), log_dir) for wid, url in sims.items()]
        started.extend(procs)
        for proc, url in zip(procs, sims.values()):
            wait_http(url + "/health", proc, timeout_s=180)
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_ENDPOINT": rx.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
               "OTEL_SERVICE_NAME": "kvroute-under-test"}
        base, _ = _start_gateway("gateway-traced", _gateway_cfg(gw_port, tiny_model, sims), log_dir, env, started)
        yield base, sims, rx, log_dir, lambda port: _gateway_cfg(port, tiny_model, sims)
    finally:
        for p in reversed(started):
            p.stop()
        rx.close()


# ---- helpers -------------------------------------------------------------------------------------
def _traceparent() -> tuple[str, str, str]:
    """A client's W3C traceparent (sampled): ``(header value, trace id hex, span id hex)``."""
    rnd = random.SystemRandom()
    trace_id, span_id = f"{rnd.getrandbits(128):032x}", f"{rnd.getrandbits(64):016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _prompt(seed: str, words: int = 120) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))


def _chat(base: str, prompt: str, traceparent: str, request_id: str, stream: bool = False):
    """One chat request through the gateway with the openai SDK: ``(x-kvroute-worker, usage)``."""
    cli = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    raw = cli.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "system", "content": prompt}, {"role": "user", "content": "hi"}],
        max_tokens=4, stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}),
        extra_headers={"traceparent": traceparent, "x-request-id": request_id})
    assert raw.http_response.status_code == 200
    worker = raw.headers["x-kvroute-worker"]
    if not stream:
        return worker, raw.parse().usage
    usage = None
    for chunk in raw.parse():
        usage = chunk.usage or usage
    return worker, usage


def _sim_headers(sim_url: str, request_id: str) -> dict[str, str]:
    """The headers the sim received with the request whose x-request-id is ``request_id``."""
    got = httpx.get(sim_url + "/sim/requests", timeout=10).json()["requests"]
    found = [r["headers"] for r in got if r["headers"].get("x-request-id") == request_id]
    assert len(found) == 1, f"request {request_id} reached {sim_url} {len(found)} times"
    return found[0]


def _trace(rx: OtlpReceiver, trace_id: str) -> dict[str, SpanRecord]:
    """The request's spans by name once the server span and every step have arrived (each name
    once)."""
    def complete():
        spans = rx.spans_of(trace_id)
        names = {s.name for s in spans}
        if "POST /v1/chat/completions" in names and set(STEPS) <= names and "kvroute.stream" in names:
            return spans
        return None

    spans = wait_until(complete, timeout_s=30, what=f"spans of trace {trace_id}")
    by_name: dict[str, SpanRecord] = {}
    for s in spans:
        assert s.name not in by_name, f"span {s.name} twice in one request's trace"
        by_name[s.name] = s
    return by_name


def _check_tree(spans: dict[str, SpanRecord], client_span_id: str) -> SpanRecord:
    """The parent links and kinds of one request's spans; returns the server span."""
    server = spans["POST /v1/chat/completions"]
    assert server.kind == "SERVER" and server.parent_id == client_span_id  # the client's trace, continued
    assert server.service == "kvroute-under-test"
    for name in STEPS:
        assert spans[name].parent_id == server.span_id, name
    upstream = spans["kvroute.upstream"]
    assert upstream.kind == "CLIENT"
    assert spans["kvroute.ttfb"].parent_id == upstream.span_id
    assert spans["kvroute.stream"].parent_id == upstream.span_id
    order = [spans[n] for n in ("kvroute.parse", "kvroute.tokenize", "kvroute.lookup", "kvroute.choose")]
    for before, after in zip(order, order[1:]):  # the steps run one after another
        assert before.end_ns <= after.start_ns, (before.name, after.name)
    assert spans["kvroute.choose"].end_ns <= upstream.start_ns
    assert spans["kvroute.ttfb"].end_ns <= spans["kvroute.stream"].start_ns
    for s in spans.values():
        assert server.start_ns <= s.start_ns <= server.end_ns, s.name
    # the ASGI server span ends as the last byte is sent: the relay's spans end right after it
    for name in ("kvroute.parse", "kvroute.tokenize", "kvroute.lookup", "kvroute.choose", "kvroute.ttfb"):
        assert spans[name].end_ns <= server.end_ns, name
    return server


def _status(attributes: dict) -> int:
    """The HTTP status of a server span, under the stable or the older semantic conventions
    (``OTEL_SEMCONV_STABILITY_OPT_IN``)."""
    return attributes.get("http.response.status_code", attributes.get("http.status_code"))


# ---- tracing on ----------------------------------------------------------------------------------
def test_spans_of_a_request_continue_the_client_trace_and_reach_the_worker(rig):
    base, sims, rx, _, _ = rig
    header, trace_id, client_span = _traceparent()
    worker, usage = _chat(base, _prompt("cold"), header, "trace-cold")
    spans = _trace(rx, trace_id)
    server = _check_tree(spans, client_span)

    a = server.attributes
    assert a["kvroute.chosen"] == worker and a["gen_ai.request.model"] == "tiny"
    assert a["kvroute.policy"] == "kv_aware" and a["kvroute.reason"]
    assert a["kvroute.prompt_tokens"] == usage.prompt_tokens
    assert a["kvroute.blocks"] == usage.prompt_tokens // BLOCK
    assert a["kvroute.matched_blocks"] == 0 and a["kvroute.predicted_cached_tokens"] == 0  # a cold prompt
    assert a["kvroute.actual_cached_tokens"] == usage.prompt_tokens_details.cached_tokens == 0
    assert a["kvroute.candidates"] == 2 and _status(a) == 200
    up = spans["kvroute.upstream"].attributes
    assert up["kvroute.worker"] == worker and up["kvroute.request_id"] == "trace-cold"
    assert up["http.response.status_code"] == 200 and up["url.full"] == sims[worker] + "/v1/chat/completions"
    assert spans["kvroute.choose"].attributes["kvroute.chosen"] == worker
    assert spans["kvroute.tokenize"].attributes["kvroute.prompt_tokens"] == usage.prompt_tokens

    # the worker got the gateway's context: same trace, its parent the upstream span
    got = _sim_headers(sims[worker], "trace-cold")["traceparent"]
    version, tid, parent, flags = got.split("-")
    assert (version, tid, parent, flags) == ("00", trace_id, spans["kvroute.upstream"].span_id, "01")


def test_streamed_prefix_hit_carries_predicted_and_actual_cached_tokens(rig):
    base, sims, rx, _, _ = rig
    prompt = _prompt("warm", 200)
    _chat(base, prompt, _traceparent()[0], "trace-warm-1")
    header, trace_id, client_span = _traceparent()
    worker, usage = _chat(base, prompt, header, "trace-warm-2", stream=True)
    spans = _trace(rx, trace_id)
    a = _check_tree(spans, client_span).attributes
    assert a["kvroute.chosen"] == worker == spans["kvroute.upstream"].attributes["kvroute.worker"]
    assert a["kvroute.matched_blocks"] > 0 and a["kvroute.reason"]
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert a["kvroute.predicted_cached_tokens"] == a["kvroute.actual_cached_tokens"] == cached
    assert spans["kvroute.upstream"].attributes["kvroute.actual_cached_tokens"] == cached
    assert _sim_headers(sims[worker], "trace-warm-2")["traceparent"].split("-")[1] == trace_id


def test_request_without_client_context_starts_a_trace_and_probes_are_not_traced(rig):
    base, sims, rx, _, _ = rig
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    assert httpx.get(base + "/metrics", timeout=10).status_code == 200
    cli = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    raw = cli.completions.with_raw_response.create(model="tiny", prompt=_prompt("root", 40), max_tokens=2,
                                                   extra_headers={"x-request-id": "trace-root"})
    worker = raw.headers["x-kvroute-worker"]
    trace_id = _sim_headers(sims[worker], "trace-root")["traceparent"].split("-")[1]

    def server_span():
        return [s for s in rx.spans_of(trace_id) if s.name == "POST /v1/completions"]

    (root,) = wait_until(server_span, timeout_s=30, what="the completions server span")
    assert root.parent_id == "" and root.attributes["kvroute.chosen"] == worker
    # the probe and the scrape ended before that span began, so they would have been exported by now
    assert not [s for s in rx.spans if s.name.startswith(("GET /health", "GET /metrics"))]


# ---- tracing off ---------------------------------------------------------------------------------
def test_disabled_sdk_exports_nothing_and_passes_the_client_traceparent_through(rig, tiny_model):
    _, sims, _, log_dir, make_cfg = rig
    started: list[Proc] = []
    with OtlpReceiver() as rx:
        try:
            env = {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.url,
                   "OTEL_BSP_SCHEDULE_DELAY": "50"}
            base, proc = _start_gateway("gateway-off", make_cfg(free_ports(1)[0]), log_dir, env, started)
            header, _, _ = _traceparent()
            worker, _ = _chat(base, _prompt("off"), header, "trace-off")
            assert _sim_headers(sims[worker], "trace-off")["traceparent"] == header  # untouched
            proc.stop()  # the SDK would flush at exit: once the process is gone, nothing can come later
            assert proc.popen.returncode is not None
        finally:
            for p in started:
                p.stop()
        assert rx.posts == 0 and rx.spans == []


_PROBE = textwrap.dedent("""
    import json, sys
    from router.edge.app import create_app
    from router.config.schema import load_config
    from router.gateway import Gateway
    from opentelemetry import trace
    app = create_app(Gateway(load_config(sys.argv[1])))
    print(json.dumps({"provider": type(trace.get_tracer_provider()).__name__, "app": type(app).__name__,
                      "fastapi": type(app.app).__name__,
                      "sdk_imported": any(m.startswith("opentelemetry.sdk") for m in sys.modules),
                      "asgi_imported": "opentelemetry.instrumentation.asgi" in sys.modules}))
""")


def _probe_app(tmp_path: Path, tiny_model: Path, env: dict[str, str]) -> tuple[dict, str]:
    """Build the app in a fresh interpreter with only ``env``'s OTEL_* variables: its tracing
    state as JSON, and what it logged."""
    cfg = tmp_path / "probe.yaml"
    cfg.write_text(yaml.safe_dump(_gateway_cfg(free_ports(1)[0], tiny_model, {"w0": "http://127.0.0.1:9"})))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(cfg)], env={**clean, **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_no_otel_environment_installs_no_sdk(tmp_path, tiny_model):
    state, _ = _probe_app(tmp_path, tiny_model, {})
    assert state == {"provider": "ProxyTracerProvider", "app": "HotPathDispatch", "fastapi": "FastAPI",
                     "sdk_imported": False, "asgi_imported": False}


def test_console_exporter_turns_tracing_on_and_unserved_protocol_leaves_it_off(tmp_path, tiny_model):
    state, _ = _probe_app(tmp_path, tiny_model, {"OTEL_TRACES_EXPORTER": "console"})
    assert state == {"provider": "TracerProvider", "app": "TracedASGI", "fastapi": "FastAPI",
                     "sdk_imported": True, "asgi_imported": True}
    state, log = _probe_app(tmp_path, tiny_model,
                            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert state["provider"] == "ProxyTracerProvider" and state["app"] == "HotPathDispatch"
    assert "opentelemetry-exporter-otlp-proto-grpc" in log  # the error names the package to install


@pytest.mark.parametrize("env, on, names", [
    ({}, False, []),
    ({"OTEL_TRACES_EXPORTER": "none"}, False, []),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True, ["otlp_proto_http"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True, ["otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True, ["otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, True, ["otlp_proto_grpc"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, True, ["otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "console,otlp,none"}, True, ["console", "otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False, ["otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, True, ["otlp_proto_http"]),
])
def test_otel_environment_decides(env, on, names):
    assert tracing.tracing_wanted(env) is on
    assert tracing.exporter_entry_points(env) == names


def test_unsupported_otlp_protocol_is_refused():
    with pytest.raises(ValueError, match="http/json"):
        tracing.exporter_entry_points({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
