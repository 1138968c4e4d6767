"""Hostile input (issue 12): property-based fuzzing of every gateway and admin endpoint from the
gateway's own OpenAPI schema (``GET /openapi.json``, :mod:`router.edge.openapi`), with schemathesis and
hypothesis, against a real ``kvroute serve`` in front of two ``kvroute sim`` workers; then
explicit hostile requests, each with its exact answer.

The property, for every response:

- no 5xx made by the gateway itself: any 5xx without ``x-kvroute-worker``, or a 500 with the
  gateway's own ``internal_error`` body (its relay answers its bugs so, naming the worker). A
  worker's own 5xx passed through, or the gateway's 502/504 naming a worker that failed, is the
  worker's, and is allowed (counted);
- every 4xx has the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``, with
  two exceptions, both answering as vLLM 0.32 does: the gateway's FastAPI 404/405
  ``{"detail": ...}`` for a path or method it does not serve (vLLM's ``HTTPException`` handler
  is registered for FastAPI's class, so Starlette's routing 404/405 keep FastAPI's default body
  there too), and a worker's own 404 ``{"detail": "Not Found"}`` for a forwarded path the
  simulator does not implement (``/v1/responses``, ``/v1/embeddings``, ``/v1/messages``, the
  render paths: real vLLM serves them), passed through unchanged with ``x-kvroute-worker``.

And one 5xx that is this rig's: the sim serves no ``GET /version`` either, so the gateway's
answer there is its 503 ``no_healthy_worker`` (OpenAI shape), as for workers that all fail it.

Cases mix schemathesis' positive (schema-valid) and negative (schema-violating) generation; most
carry the served model name (else nearly every body would stop at the gateway's 404) and, for
``/admin/*``, the admin token (else every one would stop at the 401). Generation is seeded
(``hypothesis.seed``), examples per operation are capped, and every request has a timeout.

The simulator fans a request out into ``n`` engine requests at once and, unlike vLLM (which
refuses ``n`` above ``VLLM_MAX_N_SEQUENCES``, 16384), has no cap: a fuzzed ``n`` above 128 would
keep a sim busy for minutes, so such a ``n`` is sent as 128 (see :func:`_tame`). And the sim
answers 500 to a token-id prompt with an id past 2**32 in a partial block (its output sampler
packs ids in 4 bytes; vLLM answers 400 out-of-vocabulary; the gateway refuses such an id itself
only in a full block, where it makes its block keys): a worker 5xx, counted, not a failure.

``benchmarks/bench_fuzz.py`` runs the same fuzzing longer and prints the tallies.
"""
from __future__ import annotations

import json
import socket
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # the benchmark imports this module from outside pytest
    sys.path.insert(0, str(TESTS))

from conftest import ADMIN_TOKEN, TINY_MODEL, Proc, free_ports, kvroute_argv, wait_http  # noqa: E402

MODEL = "tiny"
BLOCK = 16
MAX_MODEL_LEN = 1024
MAX_BODY = 32 * 1024 * 1024  # the config's smallest max_body_bytes
SIM_IDS = ("fuzz-sim-0", "fuzz-sim-1")  # ids a fuzzed DELETE / drain will not hit by chance
REQUEST_TIMEOUT_S = 60
SEED = 12
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}

# every operation the schema must describe; the fuzz test runs each
OPERATIONS = (
    "GET /health", "GET /health/ready", "GET /ping", "GET /version", "GET /metrics", "GET /v1/models",
    "GET /admin/workers", "POST /admin/workers", "DELETE /admin/workers/{worker_id}",
    "POST /admin/workers/{worker_id}/drain", "GET /admin/policy", "PUT /admin/policy", "GET /admin/index",
    "POST /admin/explain", "GET /admin/decisions", "GET /admin/summary", "GET /dashboard",
    "POST /admin/index/match", "GET /admin/peers", "PUT /admin/workers/{worker_id}/peer",
    "DELETE /admin/workers/{worker_id}/peer", "PUT /admin/workers/{worker_id}/role",
    "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/embeddings",
    "POST /tokenize", "POST /detokenize", "POST /v1/messages", "POST /v1/messages/count_tokens",
    "POST /v1/chat/completions/render", "POST /v1/completions/render", "POST /v1/responses/render",
)
# forwarded paths kvroute sim does not serve (vLLM does): the sim's own FastAPI 404 comes back
SIM_MISSING = frozenset({"/v1/responses", "/v1/embeddings", "/v1/messages", "/v1/messages/count_tokens",
                         "/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render"})
# examples per operation in `make test`: the generation paths get the most
EXAMPLES = {"POST /v1/chat/completions": 200, "POST /v1/completions": 250, "POST /admin/explain": 80,
            "PUT /admin/policy": 80, "POST /admin/workers": 40, "POST /tokenize": 80}
DEFAULT_EXAMPLES = 30


# ---- the rig ---------------------------------------------------------------------------------

def start_rig(log_dir: Path, started: list[Proc]) -> str:
    """Two sims behind one gateway on loopback (processes appended to ``started``, which the
    caller stops); the gateway's base URL once everything answers."""
    *sim_ports, gw_port = free_ports(len(SIM_IDS) + 1)
    no_keys = {"KVROUTE_API_KEYS": ""}  # client API keys off whatever the caller's environment holds
    workers = []
    for wid, port in zip(SIM_IDS, sim_ports):
        sim = Proc(wid, kvroute_argv("sim", "--model", str(TINY_MODEL), "--served-model-name", MODEL,
                                     "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK),
                                     "--max-model-len", str(MAX_MODEL_LEN), "--speedup", "1000"), log_dir, env=no_keys)
        started.append(sim)
        workers.append({"id": wid, "url": f"http://127.0.0.1:{port}", "model": MODEL})
    for p, w in zip(started, workers):
        wait_http(w["url"] + "/health", p, timeout_s=180)
    cfg = {"listen": {"host": "127.0.0.1", "port": gw_port}, "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
           "models": [{"name": MODEL, "tokenizer": str(TINY_MODEL), "block_size": BLOCK}],
           "workers": workers, "load_scrape": {"enabled": False}, "max_body_bytes": MAX_BODY,
           "timeouts": {"first_byte_s": 30, "stream_idle_s": 30, "worker_call_s": 5}}
    import yaml

    path = log_dir / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gw = Proc("gateway", kvroute_argv("serve", "--config", str(path)), log_dir, env=no_keys)
    started.append(gw)
    base = f"http://127.0.0.1:{gw_port}"
    wait_http(base + "/health", gw, timeout_s=180)
    return base


# ---- the property ----------------------------------------------------------------------------

def _openai_error_problem(body: bytes) -> str | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return "body is not JSON"
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return "not the OpenAI error shape"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return "error.message / error.type not strings"
    return None


def _is_detail(body: bytes, detail: str) -> bool:
    try:
        return json.loads(body) == {"detail": detail}
    except ValueError:
        return False


def verdict(path: str, status: int, headers: Any, body: bytes) -> tuple[str, str | None]:
    """``(kind, problem)`` of one response (``path``: the request's path). ``kind``: "ok";
    "worker_5xx" (a worker's own 5xx passed through, or the gateway's 502/503/504 naming the worker;
    allowed); "rig_5xx" (the sims' missing ``/version``); "gateway_5xx" or "bad_4xx" (the property
    broken; ``problem`` says how)."""
    worker = headers.get("x-kvroute-worker")
    if status >= 500:
        shape = _openai_error_problem(body)
        if path == "/version" and status == 503 and shape is None:
            return "rig_5xx", None  # the sims serve no /version (vLLM does): no worker answered it
        own = shape is None and json.loads(body)["error"]["type"] == "internal_error"  # the relay's bug answer
        if not worker or (status == 500 and own):
            return "gateway_5xx", f"gateway {status}"
        return "worker_5xx", None
    if 400 <= status < 500:
        problem = _openai_error_problem(body)
        if problem is None:
            return "ok", None
        if not worker and ((status == 404 and _is_detail(body, "Not Found"))
                           or (status == 405 and _is_detail(body, "Method Not Allowed"))):
            return "ok", None  # FastAPI's routing answer, as vLLM's
        if worker and status == 404 and path in SIM_MISSING and _is_detail(body, "Not Found"):
            return "ok", None  # the sim lacks the path: its own 404, passed through
        return "bad_4xx", f"{status} from {'worker ' + worker if worker else 'the gateway'}: {problem}"
    if status == 200 and b'"type":"upstream_error"' in body and b"text/event-stream" in (
            headers.get("content-type") or "").encode():
        return "worker_5xx", None  # a stream the gateway ended with an error event: the worker failed
    return "ok", None


@dataclass
class Tally:
    """What a fuzz run saw: per operation the statuses by origin (``"400 gateway"``, ``"200 worker"``:
    whether ``x-kvroute-worker`` came back), the verdict kinds, and the property's failures (each
    with a curl line to reproduce)."""

    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    kinds: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def tried(self, label: str) -> int:
        return sum(self.statuses[label].values())


def _tame(case) -> None:
    """Bodies the simulator cannot bound (see the module docstring): an integer ``n`` past 128
    is sent as 128."""
    body = case.body
    if isinstance(body, dict):
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 128:
            body["n"] = 128


def load_schema(base: str):
    """The gateway's schema, as schemathesis loads it."""
    import schemathesis

    return schemathesis.openapi.from_url(base + "/openapi.json")


def fuzz_operation(schema, label: str, base: str, examples: int, tally: Tally, *, seed: int = SEED,
                   stop_at_first: bool = True) -> None:
    """Fuzz one operation (``"METHOD /path"``) with ``examples`` cases, recording into ``tally``.
    ``stop_at_first``: raise AssertionError on a case that breaks the property (hypothesis then
    shrinks it to a minimal one); else record every failure and go on."""
    import requests
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    method, path = label.split(" ", 1)
    op = schema[path][method]
    strategies = [op.as_strategy(generation_mode=GenerationMode.POSITIVE)]
    if op.body or any(True for _ in op.iter_parameters()):
        strategies.append(op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    session = requests.Session()

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=timedelta(seconds=REQUEST_TIMEOUT_S * 2), database=None,
              derandomize=False, print_blob=False, phases=[Phase.generate, Phase.shrink] if stop_at_first
              else [Phase.generate], suppress_health_check=list(HealthCheck))
    # hypothesis favours 0 (the simplest value): that draw is the common case, served model and token
    @given(case=st.one_of(strategies), own_model=st.integers(0, 3), no_token=st.integers(0, 5))
    def run(case, own_model: int, no_token: int) -> None:
        if own_model != 3 and isinstance(case.body, dict):
            case.body["model"] = MODEL
        _tame(case)
        if no_token != 5 and path.startswith("/admin"):  # replaces the (random) token schemathesis made up
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {ADMIN_TOKEN}"}
        try:
            resp = case.call(base_url=base, session=session, timeout=REQUEST_TIMEOUT_S)
        except requests.exceptions.InvalidHeader:
            return  # a header value `requests` refuses to send: nothing reached the gateway
        except requests.exceptions.RequestException as exc:  # no answer: a dropped connection, a timeout
            tally.statuses[label]["no answer"] += 1
            kind, problem, answer = "no_answer", f"no answer ({type(exc).__name__}: {exc})", ""
        else:
            origin = "worker" if resp.headers.get("x-kvroute-worker") else "gateway"
            tally.statuses[label][f"{resp.status_code} {origin}"] += 1
            sent_path = resp.request.path_url.split("?", 1)[0]
            kind, problem = verdict(sent_path, resp.status_code, resp.headers, resp.content)
            answer = f" -> {resp.status_code} {resp.content[:300]!r}"
        tally.kinds[kind] += 1
        if problem is not None:
            what = f"{problem}: {label}{answer}\n  {case.as_curl_command()}"
            tally.failures.append(what)
            if stop_at_first:
                raise AssertionError(what)

    try:
        run()
    finally:
        session.close()


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> str:
    log_dir = tmp_path_factory.mktemp("fuzz")
    started: list[Proc] = []
    try:
        yield start_rig(log_dir, started)
    finally:
        for p in reversed(started):
            p.stop()


@pytest.fixture(scope="module")
def schema(rig):
    return load_schema(rig)


# ---- the schema ------------------------------------------------------------------------------

def test_openapi_json_describes_every_endpoint(rig, schema):
    from router.edge.app import FORWARDED, ROUTED

    raw = httpx.get(rig + "/openapi.json", timeout=30).json()
    assert raw["openapi"].startswith("3.")
    labels = {f"{method.upper()} {path}" for path, item in raw["paths"].items() for method in item}
    assert labels == set(OPERATIONS)
    assert {f"POST {p}" for p in (*ROUTED, *FORWARDED)} <= labels
    chat = raw["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"model", "messages", "max_tokens", "n", "stream", "stream_options", "temperature"} <= set(chat)
    prompt = raw["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert [p["type"] for p in prompt] == ["string", "array", "array", "array"]
    assert raw["components"]["securitySchemes"]["AdminBearer"] == {
        "type": "http", "scheme": "bearer", "description": "the admin token (admin.token_env / admin.token)"}
    for label in OPERATIONS:
        method, path = label.split(" ", 1)
        op = raw["paths"][path][method.lower()]
        assert (op.get("security") == [{"AdminBearer": []}]) == path.startswith("/admin"), label
    assert sum(1 for r in schema.get_all_operations()) == len(OPERATIONS)  # schemathesis loads each


# ---- fuzzing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzz(rig, schema, label):
    tally = Tally()
    fuzz_operation(schema, label, rig, EXAMPLES.get(label, DEFAULT_EXAMPLES), tally)
    assert tally.failures == []
    assert tally.tried(label) >= 1
    # the workers took everything: none was drained, removed or marked down by the fuzzing
    workers = httpx.get(rig + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                        timeout=30).json()["workers"]
    assert sorted((w["id"], w["healthy"], w["draining"]) for w in workers) == [(i, True, False) for i in SIM_IDS]


# ---- explicit hostile requests ---------------------------------------------------------------

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
JSON_CT = {"content-type": "application/json"}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
DEEP = 100_000
_MULTIPART = (b'--b0undary\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n'
              b'--b0undary\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny\r\n--b0undary--\r\n')


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _nested_tool_args(depth: int) -> dict[str, Any]:
    """A chat whose assistant tool call carries ``depth`` nested JSON arrays as its arguments
    string: valid JSON outside, too deep for Python's json inside (vLLM parses the arguments)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": None, "tool_calls": [call]}]}


# (id, method path, body bytes, extra headers, status, who answers ("gateway" / "worker"), the
# error's code (the gateway's string codes; the sim's, like vLLM's, is the HTTP status) and param)
HOSTILE = [
    ("malformed JSON", CHAT_PATH, b'{"model": "tiny", "messages": [', JSON_CT, 400, "gateway", "bad_request", None),
    ("form-encoded body", COMPLETIONS_PATH, b"model=tiny&prompt=hi",
     {"content-type": "application/x-www-form-urlencoded"}, 400, "gateway", "bad_request", None),
    ("multipart body", COMPLETIONS_PATH, _MULTIPART, {"content-type": "multipart/form-data; boundary=b0undary"},
     400, "gateway", "bad_request", None),
    ("100k nested arrays", COMPLETIONS_PATH, b'{"model":"tiny","prompt":' + b"[" * DEEP + b"]" * DEEP + b"}",
     JSON_CT, 400, "gateway", "bad_request", None),
    ("100k nested objects", COMPLETIONS_PATH, b'{"model":"tiny","prompt":"hi","x":' + b'{"a":' * DEEP + b"1"
     + b"}" * DEEP + b"}", JSON_CT, 400, "gateway", "bad_request", None),
    ("tool-call arguments nested 100k deep", CHAT_PATH, _dumps(_nested_tool_args(DEEP)), JSON_CT, 400, "gateway",
     "bad_request", "messages"),
    ("tool-call arguments nested 1000 deep", CHAT_PATH, _dumps(_nested_tool_args(1000)), JSON_CT, 400, "gateway",
     "bad_request", "messages"),
    ("explain: tool-call arguments nested 100k deep", "/admin/explain", _dumps(_nested_tool_args(DEEP)),
     {**JSON_CT, **ADMIN}, 400, "gateway", "bad_request", "messages"),
    ("invalid UTF-8 in a string", COMPLETIONS_PATH, b'{"model":"tiny","prompt":"ab\xff\xfecd"}', JSON_CT, 400,
     "gateway", "bad_request", None),
    ("lone surrogate escape", COMPLETIONS_PATH, b'{"model":"tiny","prompt":"\\ud800"}', JSON_CT, 400, "gateway",
     "bad_request", None),
    ("NaN literal", CHAT_PATH, b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
     JSON_CT, 400, "gateway", "bad_request", None),
    ("Infinity literal", CHAT_PATH,
     b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":Infinity}', JSON_CT, 400,
     "gateway", "bad_request", None),
    ("-Infinity literal", CHAT_PATH,
     b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":-Infinity}', JSON_CT, 400,
     "gateway", "bad_request", None),
    ("1e400 (infinite as a double)", CHAT_PATH,
     b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":1e400}', JSON_CT, 400, "gateway",
     "bad_request", None),
    ("duplicate key: the last model wins", COMPLETIONS_PATH, b'{"model":"tiny","model":"nope","prompt":"hi"}',
     JSON_CT, 404, "gateway", "model_not_found", "model"),
    # the sim checks max_tokens before it fans n out (n alone that large would keep it busy: no cap, unlike vLLM)
    ("huge n and max_tokens", COMPLETIONS_PATH, _dumps({"model": MODEL, "prompt": "hi", "n": 10**9,
                                                        "max_tokens": 10**9}), JSON_CT, 400, "worker", 400,
     "max_tokens"),
    ("n of 2**64 (past uint64: a float to orjson)", COMPLETIONS_PATH,
     _dumps({"model": MODEL, "prompt": "hi", "n": 2**64}), JSON_CT, 400, "worker", 400, "n"),
    ("max_tokens of 2**63", CHAT_PATH, _dumps({**CHAT, "max_tokens": 2**63}), JSON_CT, 400, "worker", 400,
     "max_tokens"),
    ("token-id prompt past max_model_len", COMPLETIONS_PATH,
     _dumps({"model": MODEL, "prompt": list(range(5, 5 + 2 * MAX_MODEL_LEN)), "max_tokens": 1}), JSON_CT, 400,
     "worker", 400, "prompt"),
    ("chat past max_model_len", CHAT_PATH,
     _dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 3 * MAX_MODEL_LEN}]}), JSON_CT,
     400, "worker", 400, "messages"),
    ("JSON sent as text/plain", CHAT_PATH, _dumps(CHAT), {"content-type": "text/plain"}, 200, "worker", None, None),
    ("JSON without a content type", CHAT_PATH, _dumps(CHAT), {}, 200, "worker", None, None),
    ("a 64 KiB header", CHAT_PATH, _dumps(CHAT), {**JSON_CT, "x-junk": "j" * 65536}, 200, "worker", None, None),
    ("duplicate key: the last stream wins", COMPLETIONS_PATH,
     b'{"model":"tiny","prompt":"hi","stream":true,"stream":false,"max_tokens":2}', JSON_CT, 200, "worker", None,
     None),
]


def _sim_url(rig: str, worker_id: str) -> str:
    workers = httpx.get(rig + "/admin/workers", headers=ADMIN, timeout=30).json()["workers"]
    return next(w["url"] for w in workers if w["id"] == worker_id)


@pytest.mark.parametrize("name,path,body,headers,status,origin,code,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request(rig, name, path, body, headers, status, origin, code, param):
    rid = "hostile-" + "".join(c if c.isalnum() else "-" for c in name)
    r = httpx.post(rig + path, content=body, headers={**headers, "x-request-id": rid}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == status, r.text[:500]
    worker = r.headers.get("x-kvroute-worker")
    assert (worker in SIM_IDS) if origin == "worker" else worker is None, (worker, r.text[:300])
    if not path.startswith("/admin"):
        assert r.headers["x-request-id"] == rid
    if status >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["code"], err["param"]) == (code, param), err
        assert err["type"] == ("invalid_request_error" if origin == "gateway" else "BadRequestError")
        return
    assert r.headers["content-type"] == "application/json"
    out = r.json()
    assert out["object"] == ("chat.completion" if path == CHAT_PATH else "text_completion")
    assert out["usage"]["completion_tokens"] >= 1
    # the worker got the request as sent: the body unchanged, the client's headers (content type,
    # the 64 KiB one) passed on, so vLLM decides on them as it would without the gateway
    seen = [q for q in httpx.get(_sim_url(rig, worker) + "/sim/requests", timeout=30).json()["requests"]
            if q["headers"].get("x-request-id") == rid]
    assert len(seen) == 1 and seen[0]["body"] == json.loads(body)
    for k, v in headers.items():
        assert seen[0]["headers"][k] == v
    if not headers:
        assert "content-type" not in seen[0]["headers"]


def test_a_64_kib_request_id_comes_back(rig):
    rid = "r" * 65536
    for stream in (False, True):
        r = httpx.post(rig + CHAT_PATH, json={**CHAT, "stream": stream}, headers={"x-request-id": rid},
                       timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200 and r.headers["x-kvroute-worker"] in SIM_IDS
        assert r.headers["x-request-id"] == rid
        assert f'"id":"chatcmpl-{rid}"' in r.text  # the sim, like vLLM, names the completion after it


@pytest.mark.parametrize("literal", [b'"a string"', b"42", b"-1.5", b"null", b"true", b"[]", b"[{}]", b""])
def test_a_body_that_is_not_a_json_object(rig, literal):
    """Every path that reads a JSON body answers 400 bad_request itself, before any worker."""
    targets = [("POST", p) for p in
               (*(label.split(" ", 1)[1] for label in OPERATIONS if label.startswith("POST /v1")),
                "/tokenize", "/detokenize")]
    targets += [("POST", "/admin/workers"), ("PUT", "/admin/policy"), ("POST", "/admin/explain")]
    want = "request body is empty; expected a JSON object" if not literal else "request body must be a JSON object"
    for method, path in targets:
        r = httpx.request(method, rig + path, content=literal, headers={**JSON_CT, **ADMIN}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert "x-kvroute-worker" not in r.headers
        assert r.json() == {"error": {"message": want, "type": "invalid_request_error", "param": None,
                                      "code": "bad_request"}}, path


def _raw_exchange(base: str, head: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` (request line and headers, no body) and read one response."""
    host, port = base.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(rest) < int(headers["content-length"]):
            chunk = s.recv(65536)
            assert chunk, rest
            rest += chunk
    return int(lines[0].split()[1]), headers, rest


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH, "/tokenize"])
def test_a_body_over_max_body_bytes_gets_413_before_it_is_sent(rig, path):
    """Refused on its Content-Length: the answer comes without the gateway waiting for the body."""
    status, headers, body = _raw_exchange(rig, (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {MAX_BODY + 1}\r\n\r\n").encode())
    assert status == 413 and "x-kvroute-worker" not in headers
    assert json.loads(body) == {"error": {"message": f"Request body exceeds the limit of {MAX_BODY} bytes.",
                                          "type": "invalid_request_error", "param": None,
                                          "code": "request_too_large"}}


def test_a_body_at_max_body_bytes_is_read(rig):
    """Exactly at the limit (32 MiB, most of it a field the worker ignores): read, parsed and
    relayed, so the limit is the configured one and not lower."""
    head = b'{"model":"tiny","prompt":"hi","max_tokens":1,"x_padding":"'
    body = head + b"p" * (MAX_BODY - len(head) - 2) + b'"}'
    assert len(body) == MAX_BODY
    r = httpx.post(rig + COMPLETIONS_PATH, content=body, headers=JSON_CT, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] in SIM_IDS, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] == 1


def test_unknown_paths_and_methods_answer_as_vllm(rig):
    """FastAPI's own 404/405 bodies, which vLLM 0.32 answers too (its HTTPException handler is
    registered for FastAPI's class; Starlette's routing raises its own)."""
    r = httpx.post(rig + "/v1/nope", json=CHAT, timeout=30)
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    r = httpx.get(rig + CHAT_PATH, timeout=30)
    assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})
    r = httpx.delete(rig + "/admin/policy", headers=ADMIN, timeout=30)
    assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})
