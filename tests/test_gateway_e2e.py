"""The gateway (`kvroute serve`) in front of real `kvroute sim` subprocesses, driven by the `openai`
SDK and raw HTTP: routing by prefix, predicted vs actual cached tokens, byte-exact streaming,
disconnects, pass-through of unknown fields and headers, error statuses and shapes, the admin
API (token, policy swap, workers add/remove/drain, explain), SIGHUP reload, and the retry of a
connect failure. One cluster for the module; tests run in file order and the last one kills a
worker. Each test makes the traffic it checks (counters are compared before and after), so any
one of them also runs alone (``-k``).
"""
from __future__ import annotations

import contextlib
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
import yaml
from openai import OpenAI

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, serve_gateway, wait_http, wait_until

BLOCK = 32
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


@dataclass
class Sim:
    name: str
    url: str
    proc: Proc


@dataclass
class Cluster:
    base: str
    sims: dict[str, Sim]
    config_path: Path
    config: dict
    gateway: Proc

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.base + "/v1", api_key="sk-client-key", max_retries=0, timeout=60)


def _sim_argv(tiny_model: Path, port: int, model: str = "tiny") -> list[str]:
    return kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", model, "--host", "127.0.0.1",
                        "--port", str(port), "--block-size", str(BLOCK), "--num-gpu-blocks-override", "1024",
                        "--max-model-len", "16384", "--enable-prompt-tokens-details", "--speedup", "10",
                        "--seed", "7")


def start_gateway(cfg: dict, log_dir: Path, started: list[Proc]) -> tuple[str, Path, Proc]:
    """``kvroute serve`` on ``cfg`` (conftest.serve_gateway): base URL, config path, process."""
    return serve_gateway(cfg, log_dir, started)


def two_sim_gateway(tiny_model: Path, log_dir: Path, started: list[Proc], **cfg_extra
                    ) -> tuple[str, dict[str, Sim], Proc]:
    """Two `kvroute sim` workers w0, w1 and a gateway over them (model ``tiny``), ``cfg_extra``
    merged into its config; processes are appended to ``started`` (the caller stops them):
    ``(base URL, sims by id, gateway process)``."""
    *sim_ports, port = free_ports(3)  # 2 simulators, then the gateway
    sims: dict[str, Sim] = {}
    for name, sim_port in zip(("w0", "w1"), sim_ports):
        proc = Proc(name, _sim_argv(tiny_model, sim_port), log_dir)
        started.append(proc)
        sims[name] = Sim(name, f"http://127.0.0.1:{sim_port}", proc)
    for sim in sims.values():
        wait_http(sim.url + "/health", sim.proc, timeout_s=180)
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
        "workers": [{"id": n, "url": sims[n].url, "model": "tiny"} for n in sims],
        **cfg_extra,
    }
    base, _, gw = start_gateway(cfg, log_dir, started)
    return base, sims, gw


@contextlib.contextmanager
def running_two_sim_gateway(tmp_path_factory, tiny_model: Path, name: str, **cfg_extra):
    """:func:`two_sim_gateway` in a fresh log folder ``name``, everything stopped on exit:
    yields ``(base URL, sims by id, gateway process)`` (for module fixtures)."""
    started: list[Proc] = []
    try:
        yield two_sim_gateway(tiny_model, tmp_path_factory.mktemp(name), started, **cfg_extra)
    finally:
        for p in reversed(started):
            p.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    log_dir = tmp_path_factory.mktemp("gateway")
    started: list[Proc] = []
    sims: dict[str, Sim] = {}
    try:
        *sim_ports, port = free_ports(4)  # 3 simulators, then the gateway
        for name, sim_port in zip(("w0", "w1", "w2"), sim_ports):
            proc = Proc(name, _sim_argv(tiny_model, sim_port), log_dir)
            started.append(proc)
            sims[name] = Sim(name, f"http://127.0.0.1:{sim_port}", proc)
        for sim in sims.values():
            wait_http(sim.url + "/health", sim.proc, timeout_s=180)  # generous: CI machines are busy
        cfg = {
            "listen": {"host": "127.0.0.1", "port": port},
            "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
            "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK},
                       {"name": "orphan", "tokenizer": str(tiny_model), "block_size": BLOCK}],
            "index": {"backend": "memory"},
            "workers": [{"id": n, "url": sims[n].url, "model": "tiny"} for n in ("w0", "w1")],
            "policy": {"name": "kv_aware"},
            "timeouts": {"connect_s": 2, "first_byte_s": 8},
            "max_body_bytes": 32 * 1024 * 1024,
            # slow probes: the last test needs a dead worker that still counts as healthy
            "health": {"interval_s": 60, "fail_threshold": 5, "rise_threshold": 1},
            "load_scrape": {"interval_s": 0.5},
        }
        base, path, gw = start_gateway(cfg, log_dir, started)
        yield Cluster(base, sims, path, cfg, gw)
    finally:
        for p in reversed(started):
            p.stop()


# ---- helpers -------------------------------------------------------------------------------------
def admin(cluster: Cluster, method: str, path: str, body=None, token: str | None = ADMIN_TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, cluster.base + path, json=body, headers=headers, timeout=30)


def system_prompt(seed: str, words: int = 300) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))


def chat_body(conv: str, question: str = "q1", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "system", "content": system_prompt(conv)},
                                          {"role": "user", "content": question}], "max_tokens": 3, **extra}


def post(cluster: Cluster, path: str, body, headers: dict | None = None, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(cluster.base + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **(headers or {})})


def settle(cluster: Cluster) -> None:
    """Wait until the gateway's last scrape of every worker shows an idle engine, so the load an
    explain sees is the load the next real request sees."""
    wait_until(lambda: all(not w["engine"]["running"] and not w["engine"]["waiting"]
                           for w in workers_by_id(cluster).values()), what="idle engines")


def explain(cluster: Cluster, body: dict) -> dict:
    settle(cluster)
    r = admin(cluster, "POST", "/admin/explain", body)
    assert r.status_code == 200, r.text
    return r.json()


def steer_to(cluster: Cluster, body: dict, worker: str, tries: int = 16) -> None:
    """Send throwaway cold requests until explain says ``body`` goes to ``worker``: cold prompts
    tie on cost, and each routed request moves the tie-break draw on. A throwaway never goes to
    ``worker`` (it would have tied the same way as ``body``)."""
    for i in range(tries):
        if explain(cluster, body)["chosen"] == worker:
            return
        r = post(cluster, "/v1/chat/completions", chat_body(f"steer-{worker}-{time.monotonic_ns()}-{i}", "x"))
        assert r.status_code == 200 and r.headers["x-kvroute-worker"] != worker
    raise AssertionError(f"never steered to {worker}")


def workers_by_id(cluster: Cluster) -> dict[str, dict]:
    r = admin(cluster, "GET", "/admin/workers")
    assert r.status_code == 200, r.text
    return {w["id"]: w for w in r.json()["workers"]}


def sim_gauge(sim: Sim, name: str) -> float:
    text = httpx.get(sim.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_value(cluster: Cluster, name: str, **labels) -> float:
    text = httpx.get(cluster.base + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- routing -------------------------------------------------------------------------------------
def test_same_prefix_sticks_and_different_prefixes_spread(cluster):
    cli = cluster.client()
    first = {}
    for i in range(8):
        r = cli.chat.completions.with_raw_response.create(**chat_body(f"spread-{i}", "q1"))
        first[i] = r.headers["x-kvroute-worker"]
        assert r.parse().choices[0].message.content is not None
    for i in range(8):
        body = chat_body(f"spread-{i}", "q1")
        body["messages"] += [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
        r = cli.chat.completions.with_raw_response.create(**body)
        assert r.headers["x-kvroute-worker"] == first[i], f"conversation {i} moved"
    assert set(first.values()) == {"w0", "w1"}


def test_predicted_cached_tokens_equal_worker_cached_tokens(cluster):
    cli = cluster.client()
    before_pred = metric_value(cluster, "kvroute_predicted_cached_tokens_sum")
    before_act = metric_value(cluster, "kvroute_actual_cached_tokens_sum")
    total_predicted = 0
    for i in range(3):
        cold = chat_body(f"predict-{i}", "first question")
        r1 = cli.chat.completions.with_raw_response.create(**cold)
        assert r1.parse().usage.prompt_tokens_details.cached_tokens == 0
        warm = chat_body(f"predict-{i}", "a different second question")
        plan = explain(cluster, warm)
        assert plan["chosen"] == r1.headers["x-kvroute-worker"]
        predicted = plan["predicted_cached_tokens"]
        chosen = next(c for c in plan["candidates"] if c["worker"] == plan["chosen"])
        assert predicted == chosen["matched_blocks"]["gpu"] * BLOCK and predicted >= 8 * BLOCK
        r2 = cli.chat.completions.with_raw_response.create(**warm)
        assert r2.headers["x-kvroute-worker"] == plan["chosen"]
        usage = r2.parse().usage
        assert usage.prompt_tokens == plan["prompt_tokens"]
        assert usage.prompt_tokens_details.cached_tokens == predicted
        total_predicted += predicted
    # completions endpoint too, on token ids: 5 full blocks + 3 tokens, repeated exactly
    ids = [random.Random(5).randrange(5, 300) for _ in range(5 * BLOCK + 3)]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2}
    cli.completions.create(**body)
    plan = explain(cluster, body)
    assert plan["predicted_cached_tokens"] == 5 * BLOCK and plan["blocks"] == 5
    r = cli.completions.create(**body)
    assert r.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK
    total_predicted += 5 * BLOCK
    # the gateway's own metrics saw the same numbers (the cold requests predicted and got 0)
    assert metric_value(cluster, "kvroute_predicted_cached_tokens_sum") - before_pred == total_predicted
    assert metric_value(cluster, "kvroute_actual_cached_tokens_sum") - before_act == total_predicted


def test_a_refused_request_leaves_no_speculative_entries(cluster):
    """A worker that answers an error status computed none of the prompt: the keys the gateway
    stored for it on the way are withdrawn (these workers have no KV events, so they would have
    stood for ``approx_ttl_s``), and the same prompt then finds no holder; an accepted one does."""
    refused = chat_body("refused-prompt", "q", max_tokens=20_000)  # prompt + max_tokens past 16,384
    before = {w: e["speculative_blocks"] for w, e in workers_by_id(cluster).items()}
    r = post(cluster, "/v1/chat/completions", refused)
    assert_openai_error(r, 400)
    worker = r.headers["x-kvroute-worker"]
    assert workers_by_id(cluster)[worker]["speculative_blocks"] == before[worker]
    plan = explain(cluster, chat_body("refused-prompt", "q"))
    assert plan["blocks"] >= 8 and plan["predicted_cached_tokens"] == 0
    assert all(c["matched_blocks"]["gpu"] == 0 for c in plan["candidates"])
    accepted = post(cluster, "/v1/chat/completions", chat_body("refused-prompt", "q"))
    assert accepted.status_code == 200
    plan = explain(cluster, chat_body("refused-prompt", "q"))
    assert plan["chosen"] == accepted.headers["x-kvroute-worker"] and plan["predicted_cached_tokens"] > 0


def test_a_refused_turn_leaves_the_conversation_it_shares_a_prefix_with(cluster):
    """Only what the refused request added is withdrawn: the conversation's history that an
    accepted turn put on the worker (the only record of it here: no KV events) stays credited."""
    first = post(cluster, "/v1/chat/completions", chat_body("kept-prefix", "q1"))
    assert first.status_code == 200
    worker = first.headers["x-kvroute-worker"]
    plan = explain(cluster, chat_body("kept-prefix", "q2"))
    assert plan["chosen"] == worker and plan["predicted_cached_tokens"] >= 8 * BLOCK
    held = plan["predicted_cached_tokens"]
    r = post(cluster, "/v1/chat/completions", chat_body("kept-prefix", "q2", max_tokens=20_000))
    assert_openai_error(r, 400)
    assert r.headers["x-kvroute-worker"] == worker
    plan = explain(cluster, chat_body("kept-prefix", "q3"))
    assert plan["chosen"] == worker and plan["predicted_cached_tokens"] == held


def test_explain_agrees_with_real_decision(cluster):
    for i in range(6):
        body = chat_body(f"explain-{i % 3}", f"question {i}")
        plan = explain(cluster, body)
        assert {c["worker"] for c in plan["candidates"]} == {"w0", "w1"}
        assert plan["blocks"] == plan["prompt_tokens"] // BLOCK
        r = post(cluster, "/v1/chat/completions", body)
        assert r.status_code == 200 and r.headers["x-kvroute-worker"] == plan["chosen"]


# ---- streaming -----------------------------------------------------------------------------------
def _stream_bytes(url: str, body: dict, request_id: str) -> tuple[httpx.Headers, bytes]:
    with httpx.stream("POST", url, json=body, headers={"x-request-id": request_id}, timeout=30) as r:
        assert r.status_code == 200
        return r.headers, b"".join(r.iter_raw())


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_reaches_client_byte_for_byte(cluster, include_usage):
    body = chat_body(f"stream-{include_usage}", "tell me", max_tokens=24, stream=True, seed=11,
                     messages=[{"role": "user", "content": "héllo 😀 " + system_prompt("stream", 120)}])
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    rid = f"req-stream-{include_usage}"
    _stream_bytes(cluster.base + "/v1/chat/completions", body, rid)  # warms the worker's cache
    headers, via_gateway = _stream_bytes(cluster.base + "/v1/chat/completions", body, rid)
    worker = cluster.sims[headers["x-kvroute-worker"]]
    assert headers["x-request-id"] == rid and headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in headers
    _, direct = _stream_bytes(worker.url + "/v1/chat/completions", body, rid)
    assert via_gateway == direct
    assert via_gateway.endswith(b"data: [DONE]\n\n") and via_gateway.count(b"data: ") >= 10
    assert (b'"usage":{' in via_gateway) == include_usage
    # what the worker received: the body unchanged, except the usage option the gateway added
    recorded = httpx.get(worker.url + "/sim/requests", timeout=10).json()["requests"]
    sent = [r for r in recorded if r["headers"].get("x-request-id") == rid][-2]  # the gateway's 2nd request
    expected = dict(body, stream_options={"include_usage": True})
    assert sent["body"] == expected


def _stalled_small_window_stream(cluster: Cluster, body: dict, stall_tokens: int) -> tuple[str, bytes]:
    """The worker (``x-kvroute-worker``) and the de-chunked body of a streamed chat answer read by
    a client with a 4 KiB receive buffer that reads the head, then nothing until the worker has
    generated ``stall_tokens`` more tokens (far more than its window), then the rest 512 bytes
    at a time."""
    import socket
    from urllib.parse import urlparse
    u = urlparse(cluster.base)
    payload = orjson.dumps(body)
    before = {wid: sim_gauge(sim, "vllm:generation_tokens_total") for wid, sim in cluster.sims.items()}
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect((u.hostname, u.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(payload), payload))
        raw = sock.recv(512)
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(512)
        worker = re.search(rb"\r\nx-kvroute-worker: ([^\r]+)", raw).group(1).decode()
        sim = cluster.sims[worker]
        wait_until(lambda: sim_gauge(sim, "vllm:generation_tokens_total") - before[worker] >= stall_tokens,
                   timeout_s=60, what=f"{worker} generated {stall_tokens} tokens")
        while piece := sock.recv(512):
            raw += piece
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    out = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return worker, out
        out, rest = out + rest[:n], rest[n + 2:]


def test_a_stalled_client_gets_the_stream_byte_for_byte(cluster):
    """A client that stops reading while the worker streams on gets every byte, in order, as the
    worker sent them (the relay's wait on a full client socket: tests/test_direct_write.py)."""
    body = chat_body("slow-client", "go on", max_tokens=2000, ignore_eos=True, stream=True, seed=5,
                     stream_options={"include_usage": True})
    _stream_bytes(cluster.base + "/v1/chat/completions", body, "slow-warm")  # both reads below hit the cache
    worker, via_gateway = _stalled_small_window_stream(cluster, body, 1500)
    _, direct = _stream_bytes(cluster.sims[worker].url + "/v1/chat/completions", body, "slow")
    assert len(via_gateway) > 200_000 and via_gateway.count(b"data: ") == direct.count(b"data: ")
    strip_ids = re.compile(rb'"(id|created)":("[^"]*"|\d+)')
    assert strip_ids.sub(b"", via_gateway) == strip_ids.sub(b"", direct)


def test_sdk_stream_text_matches_non_stream(cluster):
    cli = cluster.client()
    body = chat_body("sdk-stream", "count", max_tokens=12, seed=3)
    whole = cli.chat.completions.create(**body).choices[0].message.content
    chunks = list(cli.chat.completions.create(**body, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert all(c.usage is None for c in chunks)  # the usage chunk the gateway asked for is stripped


# ---- disconnects ---------------------------------------------------------------------------------
def _long_body(seed: str, stream: bool) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": system_prompt(seed, 40)}],
            "max_tokens": 3500, "ignore_eos": True, "stream": stream}


def test_stream_disconnect_releases_in_flight_and_aborts_upstream(cluster):
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", cluster.base + "/v1/chat/completions", json=_long_body("disc-s", True)) as r:
            worker = r.headers["x-kvroute-worker"]
            it = r.iter_raw()
            next(it)
            next(it)
            assert workers_by_id(cluster)[worker]["in_flight"] == 1
            assert sim_gauge(cluster.sims[worker], "vllm:num_requests_running") == 1
    wait_until(lambda: workers_by_id(cluster)[worker]["in_flight"] == 0, what="gateway in-flight back to 0")
    wait_until(lambda: sim_gauge(cluster.sims[worker], "vllm:num_requests_running") == 0,
               what="worker aborted the request")


def test_non_stream_disconnect_releases_in_flight_and_aborts_upstream(cluster):
    body = _long_body("disc-n", False)
    worker = explain(cluster, body)["chosen"]
    generated = sim_gauge(cluster.sims[worker], "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        post(cluster, "/v1/chat/completions", body, timeout=0.8)
    wait_until(lambda: workers_by_id(cluster)[worker]["in_flight"] == 0, what="gateway in-flight back to 0")
    wait_until(lambda: sim_gauge(cluster.sims[worker], "vllm:num_requests_running") == 0,
               what="worker aborted the request")
    assert sim_gauge(cluster.sims[worker], "vllm:generation_tokens_total") - generated < body["max_tokens"]


def test_a_client_gone_before_its_disconnect_watcher_starts_still_aborts_upstream(cluster):
    """The watcher starts DISCONNECT_WATCH_AFTER_S into a request; a client that left sooner
    is found then (receive answers http.disconnect at once) and its relay cancelled."""
    from router.edge.endpoints import DISCONNECT_WATCH_AFTER_S

    body = _long_body("disc-early", False)
    worker = explain(cluster, body)["chosen"]
    sim = cluster.sims[worker]
    generated = sim_gauge(sim, "vllm:generation_tokens_total")
    with pytest.raises(httpx.TimeoutException):
        post(cluster, "/v1/chat/completions", body, timeout=DISCONNECT_WATCH_AFTER_S / 5)
    wait_until(lambda: workers_by_id(cluster)[worker]["in_flight"] == 0, what="gateway in-flight back to 0")
    wait_until(lambda: sim_gauge(sim, "vllm:num_requests_running") == 0, what="the request ended on the worker")
    # aborted, not run to its end (the tokens the worker made meanwhile are fewer than asked)
    assert sim_gauge(sim, "vllm:generation_tokens_total") - generated < body["max_tokens"]


def test_concurrent_streams_and_disconnects_leave_no_counts(cluster):
    """16 streams at once, half of them dropped by their client after the first bytes: every
    count (gateway in-flight, prefill, decoding; engine running) returns to 0."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        body = {**_long_body(f"many-{i}", True), "max_tokens": 40 if i % 2 else 3500}
        with httpx.stream("POST", cluster.base + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            it = r.iter_raw()
            got = len(next(it))
            if i % 2 == 0:
                return got  # leave early: the client closes the connection
            return got + sum(len(c) for c in it)

    with ThreadPoolExecutor(16) as pool:
        sizes = list(pool.map(one, range(16)))
    assert all(n > 0 for n in sizes)

    def idle() -> bool:
        ws = workers_by_id(cluster)
        return all(w["in_flight"] == 0 and w["prefill_tokens"] == 0 and w["decoding"] == 0 for w in ws.values())

    wait_until(idle, what="gateway counts back to 0")
    for name in ("w0", "w1"):
        wait_until(lambda: sim_gauge(cluster.sims[name], "vllm:num_requests_running") == 0,
                   what=f"{name} running back to 0")


# ---- pass-through --------------------------------------------------------------------------------
def test_unknown_fields_and_headers_reach_the_worker(cluster):
    cli = OpenAI(base_url=cluster.base + "/v1", api_key="sk-secret-123", max_retries=0)
    extra = {"x_custom_field": {"nested": [1, 2, {"k": "v"}]}, "vllm_xargs": {"kv_cache_report_mode": "full"},
             "top_k": 5}
    r = cli.chat.completions.with_raw_response.create(
        **chat_body("unknown-fields", "hi"), extra_body=extra, extra_headers={"x-request-id": "rid-fields-1",
                                                                              "x-tenant": "acme"})
    worker = cluster.sims[r.headers["x-kvroute-worker"]]
    assert r.headers["x-request-id"] == "rid-fields-1"
    recorded = httpx.get(worker.url + "/sim/requests", timeout=10).json()["requests"]
    got = next(q for q in reversed(recorded) if q["headers"].get("x-request-id") == "rid-fields-1")
    assert got["body"] == {**chat_body("unknown-fields", "hi"), **extra}
    assert got["headers"]["authorization"] == "Bearer sk-secret-123"
    assert got["headers"]["x-tenant"] == "acme"
    # no client id: the gateway makes one and the worker and the client see the same
    r = post(cluster, "/v1/chat/completions", chat_body("unknown-fields", "again"))
    assert int(r.headers["content-length"]) == len(r.content) and "transfer-encoding" not in r.headers
    rid = r.headers["x-request-id"]
    recorded = httpx.get(cluster.sims[r.headers["x-kvroute-worker"]].url + "/sim/requests", timeout=10).json()
    assert recorded["requests"][-1]["headers"]["x-request-id"] == rid and len(rid) >= 16


def test_worker_errors_pass_through_unchanged(cluster):
    body = {"model": "tiny", "prompt": list(range(5, 16500)), "max_tokens": 4}  # over --max-model-len
    r = post(cluster, "/v1/completions", body)
    worker = cluster.sims[r.headers["x-kvroute-worker"]]
    direct = httpx.post(worker.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == direct.status_code == 400
    assert r.content == direct.content
    # an endpoint the worker does not serve: its 404 comes back as it is
    r = post(cluster, "/v1/embeddings", {"model": "tiny", "input": "hello"})
    direct = httpx.post(worker.url + "/v1/embeddings", json={"model": "tiny", "input": "hello"}, timeout=30)
    assert r.status_code == direct.status_code and r.content == direct.content and "x-kvroute-worker" in r.headers


def test_forwarded_endpoints_and_models(cluster, capture):
    step = next(s for s in capture["steps"] if s["name"] == "chat_1")
    r = post(cluster, "/tokenize", step["tokenize_request"])
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] in ("w0", "w1")
    assert r.json()["tokens"] == step["tokenize_response"]["tokens"]
    r = post(cluster, "/detokenize", {"model": "tiny", "tokens": step["tokenize_response"]["tokens"][:5]})
    assert r.status_code == 200 and isinstance(r.json()["prompt"], str)
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_large_body_accepted(cluster):
    pad = "x" * (31 * 1024 * 1024)
    body = {**chat_body("large", "hi"), "x_padding": pad}
    r = post(cluster, "/v1/chat/completions", body, timeout=120)
    assert r.status_code == 200, r.text[:200]


# ---- gateway errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/completions", {"model": "orphan", "prompt": "x"}, 503, None),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
])
def test_bad_inputs_get_status_and_openai_error(cluster, path, body, status, param):
    r = post(cluster, path, body)
    err = assert_openai_error(r, status)
    assert err["param"] == param
    assert "x-request-id" in r.headers


def test_body_over_limit_is_413(cluster):
    limit = cluster.config["max_body_bytes"]
    r = post(cluster, "/v1/chat/completions", b'{"model": "tiny", "x": "' + b"y" * limit + b'"}')
    assert_openai_error(r, 413)


def test_sdk_sees_gateway_errors(cluster):
    cli = cluster.client()
    with pytest.raises(Exception) as info:
        cli.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert getattr(info.value, "status_code", None) == 404


def test_first_byte_timeout_is_504(cluster):
    body = {**_long_body("timeout", False), "max_tokens": 12000}  # 14 s of decode at --speedup 10
    worker = explain(cluster, body)["chosen"]
    r = post(cluster, "/v1/chat/completions", body)
    assert assert_openai_error(r, 504)["code"] == "upstream_timeout"
    assert r.headers["x-kvroute-worker"] == worker
    wait_until(lambda: workers_by_id(cluster)[worker]["in_flight"] == 0, what="in-flight released after 504")
    wait_until(lambda: sim_gauge(cluster.sims[worker], "vllm:num_requests_running") == 0,
               what="worker aborted the timed-out request")


# ---- metrics -------------------------------------------------------------------------------------
def test_metrics_exposed(cluster):
    """Every family is exposed, and this test's own requests move the counters by what they are
    (deltas: the module's other tests count too)."""
    def fallbacks() -> float:
        return metric_value(cluster, "kvroute_tokenization_fallbacks_total", model="tiny", reason="unsupported_prompt")

    before = fallbacks()
    post(cluster, "/v1/chat/completions", {"model": "tiny", "messages": [  # not tokenizable here: a fallback
        {"role": "user", "content": [{"type": "file", "file": {"file_data": "data:application/pdf;base64,AA"}}]}]})
    assert fallbacks() - before == 1

    def counts(worker: str) -> list[float]:
        return [metric_value(cluster, "kvroute_requests_total", worker=worker, status="200"),
                metric_value(cluster, "kvroute_requests_total", worker="none", status="404"),
                metric_value(cluster, "kvroute_route_decisions_total", policy="kv_aware", reason="prefix_hit")]

    body = chat_body("metrics", "q")
    worker = explain(cluster, body)["chosen"]
    before = counts(worker)
    for _ in range(2):  # a cold request, then a prefix hit on the same worker
        r = post(cluster, "/v1/chat/completions", body)
        assert r.status_code == 200 and r.headers["x-kvroute-worker"] == worker
    assert_openai_error(post(cluster, "/v1/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": "x"}]}), 404)
    assert [a - b for a, b in zip(counts(worker), before)] == [2, 1, 1]
    text = httpx.get(cluster.base + "/metrics", timeout=10).text
    for name in ["kvroute_requests_total", "kvroute_route_decisions_total", "kvroute_index_lookup_seconds_bucket",
                 "kvroute_ttft_seconds_bucket", "kvroute_in_flight", "kvroute_tokenization_fallbacks_total",
                 "kvroute_predicted_cached_tokens_sum", "kvroute_actual_cached_tokens_sum", "kvroute_worker_healthy"]:
        assert name in text, name
    assert metric_value(cluster, "kvroute_in_flight", worker=worker) == 0


# ---- admin ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path", [("GET", "/admin/workers"), ("POST", "/admin/workers"),
                                         ("DELETE", "/admin/workers/w0"), ("POST", "/admin/workers/w0/drain"),
                                         ("GET", "/admin/policy"), ("PUT", "/admin/policy"),
                                         ("GET", "/admin/index"), ("POST", "/admin/explain")])
def test_admin_needs_token(cluster, method, path):
    for token in (None, "wrong-token"):
        r = admin(cluster, method, path, {"name": "round_robin"} if method != "GET" else None, token=token)
        assert assert_openai_error(r, 401)["type"] == "authentication_error"
    assert "w0" in workers_by_id(cluster)


def test_admin_workers_and_index(cluster):
    body = chat_body("admin-w0", "q")  # w0 gets a request of its own: speculative entries
    steer_to(cluster, body, "w0")
    assert post(cluster, "/v1/chat/completions", body).headers["x-kvroute-worker"] == "w0"
    settle(cluster)  # the engine figures below come from the gateway's load scrape
    w = workers_by_id(cluster)
    assert set(w) == {"w0", "w1"}
    entry = w["w0"]
    assert entry["healthy"] is True and entry["draining"] is False and entry["in_flight"] == 0
    assert entry["url"] == cluster.sims["w0"].url and entry["model"] == "tiny"
    assert entry["engine"]["running"] == 0 and entry["engine"]["kv_cache_usage"] is not None
    assert entry["speculative_blocks"] > 0 and set(entry["blocks"]) == {"gpu", "cpu", "ssd"}
    r = admin(cluster, "GET", "/admin/index")
    assert r.status_code == 200
    idx = r.json()
    assert idx["backend"] == "memory" and idx["workers"]["w0"]["speculative_blocks"] == entry["speculative_blocks"]


def test_policy_swap_applies_to_next_request(cluster):
    body = chat_body("swap", "same body")
    post(cluster, "/v1/chat/completions", body)
    sticky = {post(cluster, "/v1/chat/completions", body).headers["x-kvroute-worker"] for _ in range(3)}
    assert len(sticky) == 1
    r = admin(cluster, "PUT", "/admin/policy", {"name": "round_robin"})
    assert r.status_code == 200 and r.json()["name"] == "round_robin"
    assert admin(cluster, "GET", "/admin/policy").json()["name"] == "round_robin"
    seen = [post(cluster, "/v1/chat/completions", body).headers["x-kvroute-worker"] for _ in range(4)]
    assert set(seen) == {"w0", "w1"} and seen[0] != seen[1] and seen[1] != seen[2]
    for bad in ({"name": "kv_aware", "load_weight": "heavy"}, {"name": "nope"}, {"name": "kv_aware", "bogus": 1}):
        r = admin(cluster, "PUT", "/admin/policy", bad)
        assert_openai_error(r, 400)
    assert admin(cluster, "GET", "/admin/policy").json()["name"] == "round_robin"
    r = admin(cluster, "PUT", "/admin/policy", {"name": "session"})
    assert r.status_code == 200
    a = {post(cluster, "/v1/chat/completions", chat_body(f"sess-{i}", "x"), headers={"x-session-id": "user-42"})
         .headers["x-kvroute-worker"] for i in range(4)}
    assert len(a) == 1
    assert admin(cluster, "PUT", "/admin/policy", {"name": "kv_aware"}).status_code == 200
    full = admin(cluster, "GET", "/admin/policy").json()  # the effective config, defaults filled in
    assert full["tier_credit"] == {"gpu": 1.0, "cpu": 0.75, "ssd": 0.25} and full["load_weight"] == 1.0
    r = admin(cluster, "PUT", "/admin/policy", full)
    assert r.status_code == 200 and r.json() == full


def _reload_failures(cluster: Cluster) -> int:
    """How many config reloads the gateway has logged as failed (it keeps the running config)."""
    return cluster.gateway.log_path.read_text(errors="replace").count("keeping the running config")


def test_sighup_reloads_policy_and_workers(cluster):
    original = cluster.config_path.read_text()
    changed = dict(cluster.config, policy={"name": "least_load"}, workers=cluster.config["workers"][:1])
    try:
        cluster.config_path.write_text(yaml.safe_dump(changed))
        cluster.gateway.signal(signal.SIGHUP)
        wait_until(lambda: admin(cluster, "GET", "/admin/policy").json()["name"] == "least_load", what="reload")
        wait_until(lambda: set(workers_by_id(cluster)) == {"w0"}, what="w1 removed")
        cluster.config_path.write_text("policy: [not, valid")  # a bad file is ignored
        failed_before = _reload_failures(cluster)
        cluster.gateway.signal(signal.SIGHUP)
        wait_until(lambda: _reload_failures(cluster) == failed_before + 1, what="the bad reload logged")
        assert admin(cluster, "GET", "/admin/policy").json()["name"] == "least_load"
        assert set(workers_by_id(cluster)) == {"w0"}
    finally:
        cluster.config_path.write_text(original)
        cluster.gateway.signal(signal.SIGHUP)
    wait_until(lambda: admin(cluster, "GET", "/admin/policy").json()["name"] == "kv_aware", what="restore")
    wait_until(lambda: set(workers_by_id(cluster)) == {"w0", "w1"}, what="w1 back")
    assert workers_by_id(cluster)["w1"]["healthy"] is True


def test_admin_add_drain_remove_worker(cluster):
    w2 = cluster.sims["w2"]
    assert_openai_error(admin(cluster, "POST", "/admin/workers", {"url": "not a url", "model": "tiny"}), 400)
    assert_openai_error(admin(cluster, "POST", "/admin/workers", {"id": "x", "url": w2.url, "model": "zzz"}), 400)
    r = admin(cluster, "POST", "/admin/workers", {"id": "w2", "url": w2.url, "model": "tiny"})
    assert r.status_code == 201 and r.json()["id"] == "w2" and r.json()["healthy"] is True
    assert_openai_error(admin(cluster, "POST", "/admin/workers", {"id": "w2", "url": w2.url, "model": "tiny"}), 409)
    # give w2 a prefix of its own: the first cold body whose decision is w2
    body = chat_body("w2-own", "q")
    steer_to(cluster, body, "w2")
    assert post(cluster, "/v1/chat/completions", body).headers["x-kvroute-worker"] == "w2"
    assert explain(cluster, body)["chosen"] == "w2"
    # drain: no new requests, even for its own prefix
    r = admin(cluster, "POST", "/admin/workers/w2/drain")
    assert r.status_code == 200 and r.json()["draining"] is True
    assert explain(cluster, body)["chosen"] != "w2"
    assert post(cluster, "/v1/chat/completions", body).headers["x-kvroute-worker"] != "w2"
    # remove while a stream is running on it: the stream finishes, the worker is never chosen again
    assert admin(cluster, "DELETE", "/admin/workers/w2").status_code == 200
    r = admin(cluster, "POST", "/admin/workers", {"id": "w2", "url": w2.url, "model": "tiny"})
    assert r.status_code == 201 and r.json()["in_flight"] == 0
    long_body = {**_long_body("w2-long", True), "max_tokens": 300}
    steer_to(cluster, long_body, "w2")
    with httpx.stream("POST", cluster.base + "/v1/chat/completions", json=long_body, timeout=30) as s:
        assert s.headers["x-kvroute-worker"] == "w2"
        it = s.iter_raw()
        first = next(it)
        assert admin(cluster, "DELETE", "/admin/workers/w2").status_code == 200
        rest = b"".join(it)
    assert (first + rest).endswith(b"data: [DONE]\n\n")
    assert "w2" not in workers_by_id(cluster)
    assert "w2" not in admin(cluster, "GET", "/admin/index").json()["workers"]
    assert_openai_error(admin(cluster, "DELETE", "/admin/workers/w2"), 404)
    for b in (body, long_body, chat_body("after-remove", "x")):
        plan = explain(cluster, b)
        assert "w2" not in {c["worker"] for c in plan["candidates"]}
        assert post(cluster, "/v1/chat/completions", {**b, "stream": False, "max_tokens": 2}) \
            .headers["x-kvroute-worker"] in ("w0", "w1")
    assert metric_value(cluster, "kvroute_in_flight", worker="w0") == 0


def test_connect_failure_retried_on_next_best_then_502(cluster):
    """Last test: kills w2. A dead worker still marked healthy (slow probes) is tried first,
    then the request goes to the next-best worker; with no other worker left, 502."""
    w2 = cluster.sims["w2"]
    r = admin(cluster, "POST", "/admin/workers", {"id": "w2", "url": w2.url, "model": "tiny"})
    assert r.status_code == 201 and r.json()["healthy"] is True
    # a stream under way when its worker dies: the client gets a clean end (an error event, then
    # [DONE], as vLLM ends a stream that fails), and the counts drop
    long_body = _long_body("broken", True)
    steer_to(cluster, long_body, "w2")
    with httpx.stream("POST", cluster.base + "/v1/chat/completions", json=long_body, timeout=30) as s:
        assert s.headers["x-kvroute-worker"] == "w2"
        it = s.iter_raw()
        received = next(it)
        w2.proc.signal(signal.SIGKILL)  # the worker dies (no graceful shutdown)
        w2.proc.popen.wait(10)
        received += b"".join(it)
    events = [e for e in received.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_failure" and "w2" in error["message"]
    assert all(b'"choices"' in e for e in events[:-2])  # before it, the worker's own chunks
    wait_until(lambda: workers_by_id(cluster)["w2"]["in_flight"] == 0, what="in-flight released")
    body = chat_body("retry", "q")
    steer_to(cluster, body, "w2")
    before = metric_value(cluster, "kvroute_upstream_retries_total")
    r = post(cluster, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] in ("w0", "w1")
    assert metric_value(cluster, "kvroute_upstream_retries_total") == before + 1
    # the prompt's keys were stored for w2 before the attempt and withdrawn after it failed
    holders = {c["worker"]: c["matched_blocks"]["gpu"] for c in explain(cluster, body)["candidates"]}
    assert holders["w2"] == 0 and holders[r.headers["x-kvroute-worker"]] > 0
    for wid in ("w0", "w1"):
        assert admin(cluster, "POST", f"/admin/workers/{wid}/drain").status_code == 200
    r = post(cluster, "/v1/chat/completions", body)
    assert assert_openai_error(r, 502)["code"] == "upstream_failure"
    assert r.headers["x-kvroute-worker"] == "w2"
    assert workers_by_id(cluster)["w2"]["in_flight"] == 0
