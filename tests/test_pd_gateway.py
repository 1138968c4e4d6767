"""The gateway's prefill-decode path (router/route/pd.py, router/edge/prefill_leg.py, the endpoints): the legs'
choice (pure, over candidates) and, through a real ``kvroute serve`` and the openai SDK, the
two-leg relay in front of small aiohttp stand-ins that answer as vLLM does (a prefill leg answers
``kv_transfer_params``; the decode leg streams) and record what each leg received: bodies,
headers, fallback to whole (a failing, silent or timed-out prefill worker), a 4xx passed through,
a client disconnect cancelling the prefill leg, what a split request teaches (the prefill
worker's rate and usage, nothing from the decode worker's report), the skip when the decode
worker holds the prefix, explain and the metric.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from openai import OpenAI

from conftest import ADMIN_TOKEN, Proc, free_ports, serve_gateway, wait_http, wait_until
from kvcore.index.base import TierMatch
from kvbench.workers import samples_by_source
from router.policies import Candidate, RouteRequest, WorkerLoad, describe, make_policy
from router.route.pd import PREFILL_KV_TRANSFER_PARAMS, choose_decode, decode_body, prefill_body, prefill_policy, \
    split_or_whole
from test_gateway_e2e import _sim_argv, metric_value, system_prompt

BLOCK = 32
MIN_PREFILL = 64
PROMPT_TOKENS = 100  # what a stand-in reports as usage.prompt_tokens
PREFILL_CACHED = 32  # what a stand-in's prefill leg reports as usage.prompt_tokens_details.cached_tokens


# ---- pure: settings, legs, bodies ----------------------------------------------------------------

def test_pd_settings_validated_and_described():
    policy = make_policy({"name": "ttft", "pd": {"enabled": True, "models": ["tiny"], "min_prefill_tokens": 64}})
    assert describe(policy)["pd"] == {"enabled": True, "models": ["tiny"], "min_prefill_tokens": 64,
                                      "prefill_timeout_s": None}
    assert policy.pd.applies_to("tiny") and not policy.pd.applies_to("other")
    assert describe(make_policy({}))["pd"] == {"enabled": False, "models": [], "min_prefill_tokens": 256,
                                               "prefill_timeout_s": None}
    assert make_policy({"pd": {"enabled": True}}).pd.applies_to("anything")
    timed = make_policy({"pd": {"enabled": True, "prefill_timeout_s": 2.5}})
    assert timed.pd.prefill_timeout_s == 2.5 and describe(timed)["pd"]["prefill_timeout_s"] == 2.5
    assert make_policy({"pd": describe(timed)["pd"]}).pd == timed.pd
    for bad, words in [({"enabled": "yes"}, "policy.pd.enabled"), ({"model": []}, "unknown key(s) 'model'"),
                       ({"models": "tiny"}, "policy.pd.models"), ({"min_prefill_tokens": -1}, ">= 0"),
                       ({"min_prefill_tokens": 2.5}, "whole number"),
                       ({"prefill_timeout_s": 0}, "policy.pd.prefill_timeout_s must be > 0"),
                       ({"prefill_timeout_s": "5"}, "policy.pd.prefill_timeout_s must be a finite number"),
                       ({"prefill_timeout_s": True}, "policy.pd.prefill_timeout_s must be a finite number")]:
        with pytest.raises(ValueError, match=None) as exc:
            make_policy({"pd": bad})
        assert words in str(exc.value)


def _cand(worker: str, gpu: int = 0, **load) -> Candidate:
    return Candidate(worker, WorkerLoad(**load), TierMatch(gpu=gpu))


def test_decode_holder_serves_whole_and_a_prefix_on_a_prefill_worker_is_split_there():
    req = RouteRequest(model="m", prompt_tokens=1000, all_prompt_tokens=1000, block_size=16, num_blocks=62)
    # d1 holds 60 of the 62 blocks: 40 uncached tokens < 64 -> served whole by d1
    decision, scores = choose_decode(req, [_cand("d0"), _cand("d1", gpu=60)])
    assert decision.worker_id == "d1" and decision.reason == "prefix_hit"
    assert (scores[0].held_tokens, scores[0].uncached_tokens) == (960, 40)
    assert [s.worker_id for s in scores] == ["d1", "d0"] and scores[1].uncached_tokens == 1000
    assert split_or_whole(scores[0], 64) == ("whole", "decode_holds_prefix")
    # the prefix only on prefill worker p1: no decode worker holds it -> split, prefilled on p1
    decision, scores = choose_decode(req, [_cand("d0"), _cand("d1")])
    assert split_or_whole(scores[0], 64) == ("split", "uncached_tokens")
    prefill = prefill_policy(make_policy({"name": "kv_aware"})).choose(req, [_cand("p0"), _cand("p1", gpu=60)])
    assert prefill.worker_id == "p1" and prefill.reason == "prefix_hit"
    ttft = {s.worker_id: s.predicted_ttft_ms for s in prefill.scores}
    assert ttft["p1"] == pytest.approx(25 + 0.1 * 40) and ttft["p0"] == pytest.approx(25 + 0.1 * 1000)
    # a short cold prompt is whole; decode load and a full KV cache move the decode leg
    short = RouteRequest(model="m", prompt_tokens=20, all_prompt_tokens=20, block_size=16, num_blocks=1)
    assert split_or_whole(choose_decode(short, [_cand("d0")])[1][0], 64) == ("whole", "short_prompt")
    decision, scores = choose_decode(req, [_cand("d0", in_flight=3, decoding=3), _cand("d1", kv_usage=0.9)])
    by = {s.worker_id: s for s in scores}
    assert by["d0"].cost == pytest.approx(3 * 128 + 1000) and by["d1"].cost == pytest.approx(1000 / 0.1)
    assert decision.worker_id == "d0" and decision.reason == "load"


def test_leg_bodies():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50,
            "stream": True, "stream_options": {"include_usage": True}, "n": 2, "temperature": 0.5}
    assert orjson.loads(prefill_body(chat, "chat")) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1, "max_tokens": 1,
        "stream": False, "n": 1, "temperature": 0.5, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    comp = {"model": "m", "prompt": "x", "max_tokens": 9}
    assert orjson.loads(prefill_body(comp, "completion")) == {
        "model": "m", "prompt": "x", "max_tokens": 1, "stream": False, "n": 1,
        "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "opaque": {"a": 1}}
    assert orjson.loads(decode_body(orjson.dumps(comp), params)) == {**comp, "kv_transfer_params": params}


# ---- stand-in workers ----------------------------------------------------------------------------

@dataclass
class StandIn:
    """One vLLM stand-in: ``seen``: (path, headers, body) of each completion request; ``mode``
    for prefill legs: ok | 500 | no_params | 400 | hang | gate (answers as ok once ``gate`` is
    set); ``answered``: params answered, by x-request-id; ``cancelled``: x-request-ids whose
    handler was cancelled (client gone); ``answer_gate``: when set, a whole or decode request's
    answer waits for it (the request is before its first byte there meanwhile)."""

    id: str
    port: int
    mode: str = "ok"
    seen: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)
    answered: dict[str, dict[str, Any]] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None
    gate: asyncio.Event | None = None
    answer_gate: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def of(self, request_id: str) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
        return [s for s in self.seen if s[1].get("x-request-id", "").startswith(request_id)]

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("x-request-id", "")
        self.seen.append((request.path, {k.lower(): v for k, v in request.headers.items()}, body))
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return await self._prefill(rid, body)
        return await self._answer(request, body, bool(params.get("do_remote_prefill")))

    async def _prefill(self, rid: str, body: dict[str, Any]) -> web.Response:
        if self.mode == "gate":
            await self.gate.wait()
        if self.mode == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        if self.mode == "500":
            return web.json_response({"error": {"message": "engine dead", "type": "InternalServerError"}}, status=500)
        if self.mode == "400":
            return web.json_response({"object": "error", "message": "prompt too long", "type": "BadRequestError",
                                      "param": None, "code": 400}, status=400)
        out = {"id": "cmpl-p", "object": "text_completion", "model": body.get("model"),  # ok | gate | no_params
               "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
               "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": PROMPT_TOKENS + 1,
                         "prompt_tokens_details": {"cached_tokens": PREFILL_CACHED}}}
        if self.mode in ("ok", "gate"):
            params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{self.id}",
                      "remote_block_ids": [3, 1, 4], "remote_host": "127.0.0.1", "remote_port": self.port,
                      "remote_request_id": uuid.uuid4().hex}
            self.answered[rid] = params
            out["kv_transfer_params"] = params
        return web.json_response(out)

    async def _answer(self, request: web.Request, body: dict[str, Any], remote: bool) -> web.StreamResponse:
        if self.answer_gate is not None:
            await self.answer_gate.wait()
        chat = request.path.endswith("/chat/completions")
        cached = PROMPT_TOKENS - 1 if remote else 0
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2, "total_tokens": PROMPT_TOKENS + 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        pieces = ["from ", self.id]
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(pieces)}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": "".join(pieces), "finish_reason": "length"})
            return web.json_response({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                      "created": 0, "model": body["model"], "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        for i, piece in enumerate(pieces):
            choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
                      else {"index": 0, "text": piece, "finish_reason": None})
            if i == len(pieces) - 1:
                choice["finish_reason"] = "length"
            event = {"id": "x", "object": kind, "created": 0, "model": body["model"], "choices": [choice]}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            event = {"id": "x", "object": kind, "created": 0, "model": body["model"], "choices": [], "usage": usage}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                             "vllm:kv_cache_usage_perc 0.1\n")


class StandIns:
    """The stand-ins' aiohttp servers on one event loop in a thread."""

    def __init__(self, ids: list[str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.workers = {w: StandIn(w, p) for w, p in zip(ids, free_ports(len(ids)))}
        for w in self.workers.values():
            self.call(self._start(w))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self, w: StandIn) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", w.completion)
        app.router.add_post("/v1/completions", w.completion)
        app.router.add_get("/health", _health)
        app.router.add_get("/metrics", _metrics)
        w.runner = web.AppRunner(app, handler_cancellation=True)
        await w.runner.setup()
        await web.TCPSite(w.runner, "127.0.0.1", w.port).start()

    def stop_listening(self, w: StandIn) -> None:
        """Close the port and every open connection (the gateway's pooled keep-alive ones too)."""
        self.call(w.runner.cleanup())

    def listen(self, w: StandIn) -> None:
        self.call(self._start(w))

    def close(self) -> None:
        for w in self.workers.values():
            self.call(w.runner.cleanup())  # idempotent
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class PD:
    base: str
    stand: StandIns

    def __getitem__(self, worker: str) -> StandIn:
        return self.stand.workers[worker]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_model):
    log_dir = tmp_path_factory.mktemp("pd-gateway")
    stand = StandIns(["p0", "d0", "d1"])
    started: list[Proc] = []
    try:
        roles = {"p0": "prefill", "d0": "decode", "d1": "decode"}
        cfg = {
            "listen": {"host": "127.0.0.1", "port": free_ports(1)[0]},
            "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
            "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
            "index": {"backend": "memory"},
            "workers": [{"id": w, "url": stand.workers[w].url, "model": "tiny", "role": r} for w, r in roles.items()],
            "policy": {"name": "ttft", "pd": {"enabled": True, "min_prefill_tokens": MIN_PREFILL}},
            "timeouts": {"connect_s": 2, "first_byte_s": 20},
            # slow probes: the prefill worker that stops listening still counts as healthy
            "health": {"interval_s": 60, "fail_threshold": 5, "rise_threshold": 1},
        }
        base, _, _ = serve_gateway(cfg, log_dir, started, "gateway-pd")
        yield PD(base, stand)
    finally:
        for p in reversed(started):
            p.stop()
        stand.close()


@pytest.fixture(autouse=True)
def _modes(request):
    yield
    if "pd" in request.fixturenames:
        for w in request.getfixturevalue("pd").stand.workers.values():
            w.mode = "ok"
            w.answer_gate = None


def admin(pd: PD, method: str, path: str, body=None) -> httpx.Response:
    return httpx.request(method, pd.base + path, json=body, timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})


def counts(pd: PD) -> dict[str, float]:
    return {o: metric_value(pd, "kvroute_pd_requests_total", model="tiny", outcome=o)
            for o in ("split", "whole", "prefill_failed", "prefill_rejected")}


def idle(pd: PD) -> None:
    """Every worker's in-flight count back to 0 in the gateway."""
    def check() -> bool:
        return all(w["in_flight"] == 0 and w["prefill_tokens"] == 0
                   for w in admin(pd, "GET", "/admin/workers").json()["workers"])
    wait_until(check, what="no requests in flight")


def long_chat(seed: str, question: str = "q1", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "system", "content": system_prompt(seed, 300)},
                                          {"role": "user", "content": question}], "max_tokens": 7, **extra}


def sdk(pd: PD) -> OpenAI:
    return OpenAI(base_url=pd.base + "/v1", api_key="x", max_retries=0)


def new_id() -> str:
    return "pd-" + uuid.uuid4().hex[:12]


def prefill_and_decode(pd: PD, rid: str) -> tuple[tuple, tuple, str]:
    """What the prefill worker and the decode worker received for ``rid``, and the decode worker."""
    (p,) = pd["p0"].of(rid)
    decoded = [(w, s) for w in ("d0", "d1") for s in pd[w].of(rid)]
    assert len(decoded) == 1, decoded
    return p, decoded[0][1], decoded[0][0]


# ---- through the gateway -------------------------------------------------------------------------

def test_policy_pd_at_admin(pd):
    got = admin(pd, "GET", "/admin/policy").json()
    assert got["pd"] == {"enabled": True, "models": [], "min_prefill_tokens": MIN_PREFILL, "prefill_timeout_s": None}
    r = admin(pd, "PUT", "/admin/policy", {**got, "pd": {"enabled": True, "min_prefill_tokens": "many"}})
    assert r.status_code == 400 and "policy.pd.min_prefill_tokens" in r.json()["error"]["message"]
    r = admin(pd, "PUT", "/admin/policy", {**got, "pd": {**got["pd"], "prefill_timeout_s": -1}})
    assert r.status_code == 400 and "policy.pd.prefill_timeout_s must be > 0" in r.json()["error"]["message"]
    assert admin(pd, "GET", "/admin/policy").json() == got
    try:
        r = admin(pd, "PUT", "/admin/policy", {**got, "pd": {**got["pd"], "prefill_timeout_s": 7.5}})
        assert r.status_code == 200, r.text
        assert admin(pd, "GET", "/admin/policy").json()["pd"] == {**got["pd"], "prefill_timeout_s": 7.5}
    finally:
        assert admin(pd, "PUT", "/admin/policy", got).status_code == 200
    assert admin(pd, "GET", "/admin/policy").json() == got


def test_explain_shows_both_legs(pd):
    out = admin(pd, "POST", "/admin/explain", long_chat("explain")).json()
    legs = out["pd"]
    assert legs["outcome"] == "split" and legs["reason"] == "uncached_tokens"
    assert legs["min_prefill_tokens"] == MIN_PREFILL and legs["prefill_worker"] == "p0"
    assert legs["decode_worker"] == out["chosen"] and out["chosen"] in ("d0", "d1")
    decode = {c["worker"]: c for c in legs["decode"]["candidates"]}
    assert set(decode) == {"d0", "d1"} and legs["decode"]["uncached_tokens"] == out["prompt_tokens"]
    for c in decode.values():  # cold, idle, KV 10 % full: the prompt over the room
        assert c["held_tokens"] == 0 and c["uncached_tokens"] == out["prompt_tokens"]
        assert c["kv_room"] == pytest.approx(0.9) and c["cost"] == pytest.approx(out["prompt_tokens"] / 0.9, abs=0.01)
    (p0,) = legs["prefill"]["candidates"]
    assert p0["worker"] == "p0" and legs["prefill"]["policy"] == "ttft"
    assert p0["predicted_ttft_ms"] == pytest.approx(25 + 0.1 * out["prompt_tokens"], abs=0.01)
    assert legs["prefill"]["predicted_ttft_ms"] == p0["predicted_ttft_ms"]


def test_split_chat_stream_through_the_sdk(pd):
    before = counts(pd)
    rid = new_id()
    body = long_chat("split-stream")
    with sdk(pd).chat.completions.with_streaming_response.create(
            **body, stream=True, stream_options={"include_usage": True}, extra_headers={"x-request-id": rid}) as resp:
        headers = resp.headers
        chunks = list(resp.parse())
    p, d, dworker = prefill_and_decode(pd, rid)
    assert headers["x-kvroute-worker"] == dworker and headers["x-kvroute-prefill-worker"] == "p0"
    assert headers["x-request-id"] == rid
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"from {dworker}"
    assert chunks[-1].usage.prompt_tokens == PROMPT_TOKENS
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == PROMPT_TOKENS - 1
    path, pheaders, pbody = p
    sent = {**body, "stream": True, "stream_options": {"include_usage": True}}
    assert path == "/v1/chat/completions" and pheaders["x-request-id"] == f"{rid}-prefill"
    assert pbody == {**body, "max_tokens": 1, "stream": False, "n": 1,
                     "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    path, dheaders, dbody = d
    assert path == "/v1/chat/completions" and dheaders["x-request-id"] == rid
    assert dbody == {**sent, "kv_transfer_params": pd["p0"].answered[f"{rid}-prefill"]}
    after = counts(pd)
    assert after["split"] == before["split"] + 1 and after["prefill_failed"] == before["prefill_failed"]
    idle(pd)
    entry = next(e for e in admin(pd, "GET", "/admin/decisions").json()["decisions"] if e["request_id"] == rid)
    assert entry["pd"]["outcome"] == "split" and entry["pd"]["prefill_worker"] == "p0"
    assert entry["worker"] == dworker and entry["actual_cached_tokens"] == PROMPT_TOKENS - 1
    assert entry["pd"]["prefill_outcome"] == "split" and entry["pd"]["prefill_ms"] > 0
    assert [c["worker"] for c in entry["pd"]["prefill"]["candidates"]] == ["p0"]
    assert sorted(c["worker"] for c in entry["pd"]["decode"]["candidates"]) == ["d0", "d1"]


def test_split_completion_without_stream(pd):
    rid = new_id()
    body = {"model": "tiny", "prompt": system_prompt("split-completion", 300), "max_tokens": 5, "temperature": 0}
    r = httpx.post(pd.base + "/v1/completions", json=body, headers={"x-request-id": rid}, timeout=30)
    assert r.status_code == 200, r.text
    p, d, dworker = prefill_and_decode(pd, rid)
    assert r.headers["x-kvroute-worker"] == dworker and r.headers["x-kvroute-prefill-worker"] == "p0"
    assert r.json()["choices"][0]["text"] == f"from {dworker}"
    assert p[0] == "/v1/completions" and p[2] == {**body, "max_tokens": 1, "stream": False, "n": 1,
                                                  "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    assert d[2] == {**body, "kv_transfer_params": pd["p0"].answered[f"{rid}-prefill"]}
    idle(pd)


def test_chat_max_completion_tokens_is_one_on_the_prefill_leg(pd):
    rid = new_id()
    body = {**long_chat("max-completion"), "max_completion_tokens": 9}
    r = sdk(pd).chat.completions.with_raw_response.create(**body, extra_headers={"x-request-id": rid})
    assert r.headers["x-kvroute-prefill-worker"] == "p0"
    p, d, _ = prefill_and_decode(pd, rid)
    assert p[2]["max_completion_tokens"] == 1 and p[2]["max_tokens"] == 1
    assert d[2]["max_completion_tokens"] == 9 and d[2]["max_tokens"] == 7


def test_decode_worker_holding_the_prefix_serves_whole(pd):
    first = new_id()
    r = httpx.post(pd.base + "/v1/chat/completions", json=long_chat("follow-up", "q1"),
                   headers={"x-request-id": first}, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvroute-prefill-worker"] == "p0"
    holder = r.headers["x-kvroute-worker"]
    follow = long_chat("follow-up", "q2")
    out = admin(pd, "POST", "/admin/explain", follow).json()
    legs = out["pd"]
    assert legs["outcome"] == "whole" and legs["reason"] == "decode_holds_prefix"
    assert legs["decode_worker"] == holder and legs["prefill"] is None and legs["prefill_worker"] is None
    assert 0 < legs["decode"]["uncached_tokens"] < MIN_PREFILL
    assert out["reason"] == "prefix_hit"
    before = counts(pd)
    rid = new_id()
    r = httpx.post(pd.base + "/v1/chat/completions", json=follow, headers={"x-request-id": rid}, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] == holder
    assert "x-kvroute-prefill-worker" not in r.headers
    assert pd["p0"].of(rid) == []
    (path, _, dbody), = pd[holder].of(rid)
    assert dbody == follow  # whole: the client's body as it is
    assert counts(pd)["whole"] == before["whole"] + 1
    idle(pd)


@pytest.mark.parametrize("mode", ["500", "no_params"])
def test_prefill_failure_falls_back_to_whole(pd, mode):
    pd["p0"].mode = mode
    before = counts(pd)
    rid = new_id()
    body = long_chat(f"fallback-{mode}")
    r = sdk(pd).chat.completions.with_raw_response.create(**body, extra_headers={"x-request-id": rid})
    p, d, dworker = prefill_and_decode(pd, rid)
    assert r.headers["x-kvroute-worker"] == dworker and "x-kvroute-prefill-worker" not in r.headers
    assert r.parse().choices[0].message.content == f"from {dworker}"
    assert p[2]["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS and d[2] == body
    after = counts(pd)
    assert after["prefill_failed"] == before["prefill_failed"] + 1 and after["split"] == before["split"]
    idle(pd)


def test_prefill_worker_down_falls_back_to_whole(pd):
    p0 = pd["p0"]
    pd.stand.stop_listening(p0)
    try:
        before = counts(pd)
        rid = new_id()
        body = long_chat("fallback-down")
        r = httpx.post(pd.base + "/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=30)
        assert r.status_code == 200, r.text
        assert "x-kvroute-prefill-worker" not in r.headers and p0.of(rid) == []
        dworker = r.headers["x-kvroute-worker"]
        (_, _, dbody), = pd[dworker].of(rid)
        assert dbody == body
        assert counts(pd)["prefill_failed"] == before["prefill_failed"] + 1
        idle(pd)
    finally:
        pd.stand.listen(p0)


def test_prefill_4xx_reaches_the_client(pd):
    pd["p0"].mode = "400"
    before = counts(pd)
    speculative = _speculative_blocks(pd, "p0")
    rid = new_id()
    r = httpx.post(pd.base + "/v1/chat/completions", json=long_chat("bad-input"), headers={"x-request-id": rid},
                   timeout=30)
    assert r.status_code == 400 and r.headers["x-kvroute-worker"] == "p0" and r.headers["x-request-id"] == rid
    assert r.json() == {"object": "error", "message": "prompt too long", "type": "BadRequestError", "param": None,
                        "code": 400}
    assert pd["d0"].of(rid) == [] and pd["d1"].of(rid) == []
    after = counts(pd)
    assert after == {**before, "prefill_rejected": before["prefill_rejected"] + 1}
    entry = next(e for e in admin(pd, "GET", "/admin/decisions").json()["decisions"] if e["request_id"] == rid)
    assert entry["pd"]["prefill_outcome"] == "prefill_rejected" and entry["pd"]["prefill_cached_tokens"] is None
    assert _speculative_blocks(pd, "p0") == speculative  # the refused prompt's keys were withdrawn
    idle(pd)


def _speculative_blocks(pd: PD, worker: str) -> int:
    workers = admin(pd, "GET", "/admin/workers").json()["workers"]
    return next(w["speculative_blocks"] for w in workers if w["id"] == worker)


def test_client_disconnect_cancels_the_prefill_leg(pd):
    p0 = pd["p0"]
    p0.mode = "hang"
    before = counts(pd)
    rid = new_id()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(pd.base + "/v1/chat/completions", json=long_chat("disconnect", stream=True),
                   headers={"x-request-id": rid}, timeout=httpx.Timeout(30, read=1.0))
    wait_until(lambda: f"{rid}-prefill" in p0.cancelled, what="the prefill leg cancelled on the worker")
    idle(pd)
    assert len(p0.of(rid)) == 1 and pd["d0"].of(rid) == [] and pd["d1"].of(rid) == []
    assert counts(pd) == before  # neither split nor a fallback: nothing went on


def test_prefill_timeout_falls_back_to_whole(pd):
    """A prefill worker that takes the leg and never answers: after policy.pd.prefill_timeout_s
    the leg's connection is closed (the worker sees its request cancelled) and the decode worker
    serves the client's own body whole, counted prefill_failed."""
    p0 = pd["p0"]
    p0.mode = "hang"
    got = admin(pd, "GET", "/admin/policy").json()
    assert admin(pd, "PUT", "/admin/policy", {**got, "pd": {**got["pd"], "prefill_timeout_s": 1.0}}).status_code == 200
    try:
        before = counts(pd)
        rid = new_id()
        body = long_chat("prefill-timeout")
        t0 = time.monotonic()
        r = sdk(pd).chat.completions.with_raw_response.create(**body, extra_headers={"x-request-id": rid})
        elapsed = time.monotonic() - t0
        p, d, dworker = prefill_and_decode(pd, rid)
        assert r.headers["x-kvroute-worker"] == dworker and "x-kvroute-prefill-worker" not in r.headers
        assert r.parse().choices[0].message.content == f"from {dworker}"
        assert p[2]["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS and d[2] == body
        assert 1.0 <= elapsed < 15.0
        assert f"{rid}-prefill" in p0.cancelled  # closed at the timeout, before the decode leg began
        after = counts(pd)
        assert after == {**before, "prefill_failed": before["prefill_failed"] + 1}
        entry = next(e for e in admin(pd, "GET", "/admin/decisions").json()["decisions"] if e["request_id"] == rid)
        # uvloop's timers count whole milliseconds from a loop time cached per iteration, so the
        # timeout may fire up to 1 ms before a full second by perf_counter (CI saw 999.993 ms)
        assert entry["pd"]["prefill_outcome"] == "prefill_failed" and 999.0 <= entry["pd"]["prefill_ms"] < 15000.0
        assert entry["worker"] == dworker
        idle(pd)
    finally:
        assert admin(pd, "PUT", "/admin/policy", got).status_code == 200


def _worker_entries(pd: PD) -> dict[str, dict]:
    return {w["id"]: w for w in admin(pd, "GET", "/admin/workers").json()["workers"]}


def test_split_request_teaches_the_prefill_worker_only(pd):
    """A split request's figures come from the worker that computed its prompt: the prefill leg's
    answer books the prefill worker's reported cached tokens (against its prediction) and its
    TTFT line; the decode worker's answer, which counts the transferred tokens as cached, books
    nothing but the decision log's actual_cached_tokens."""
    def figures() -> dict[str, tuple[float, float, float]]:
        workers = _worker_entries(pd)
        return {w: (metric_value(pd, "kvroute_actual_cached_tokens_count", worker=w),
                    metric_value(pd, "kvroute_actual_cached_tokens_sum", worker=w),
                    workers[w]["prefill_rate"]["observed"]) for w in ("p0", "d0", "d1")}

    idle(pd)
    before = figures()
    rid = new_id()
    body = long_chat("teaches")
    with sdk(pd).chat.completions.with_streaming_response.create(
            **body, stream=True, extra_headers={"x-request-id": rid}) as resp:
        assert resp.headers["x-kvroute-prefill-worker"] == "p0"
        dworker = resp.headers["x-kvroute-worker"]
        text = "".join(c.choices[0].delta.content or "" for c in resp.parse() if c.choices)
    assert text == f"from {dworker}"
    idle(pd)
    entry = wait_until(lambda: next((e for e in admin(pd, "GET", "/admin/decisions").json()["decisions"]
                                     if e["request_id"] == rid and e["actual_cached_tokens"] is not None), None),
                       what="the decode worker's usage in the decision log")
    assert entry["actual_cached_tokens"] == PROMPT_TOKENS - 1  # the decode worker's report, transfer included
    assert entry["pd"]["prefill_cached_tokens"] == PREFILL_CACHED
    after = figures()
    count, total, observed = before["p0"]
    assert after["p0"] == (count + 1, total + PREFILL_CACHED, observed + 1)
    assert after["d0"] == before["d0"] and after["d1"] == before["d1"]


# ---- over real `kvroute sim` workers that speak the protocol ------------------------------------

def _sim_metrics(url: str) -> dict[str, float]:
    return samples_by_source(url, "vllm:prompt_tokens_by_source_total", timeout_s=10)


def test_split_then_follow_up_whole_over_sims(tmp_path, tiny_model):
    started: list[Proc] = []
    try:
        p_port, d_port, g_port = free_ports(3)
        sims = {"p0": f"http://127.0.0.1:{p_port}", "d0": f"http://127.0.0.1:{d_port}"}
        for (name, url), port in zip(sims.items(), (p_port, d_port)):
            started.append(Proc(name, _sim_argv(tiny_model, port), tmp_path))
        for proc, url in zip(started, sims.values()):
            wait_http(url + "/health", proc, timeout_s=180)
        cfg = {"listen": {"host": "127.0.0.1", "port": g_port},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
               "workers": [{"id": "p0", "url": sims["p0"], "model": "tiny", "role": "prefill"},
                           {"id": "d0", "url": sims["d0"], "model": "tiny", "role": "decode"}],
               "policy": {"name": "ttft", "pd": {"enabled": True, "min_prefill_tokens": MIN_PREFILL}}}
        base, _, _ = serve_gateway(cfg, tmp_path, started, "gateway-pd-sims")
        client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        prompt = [(7 * i) % 400 + 50 for i in range(300)]  # 9 full blocks of 32 + 12 tokens
        p_before, d_before = _sim_metrics(sims["p0"]), _sim_metrics(sims["d0"])
        with client.completions.with_streaming_response.create(
                model="tiny", prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}) as r:
            assert r.headers["x-kvroute-worker"] == "d0" and r.headers["x-kvroute-prefill-worker"] == "p0"
            chunks = list(r.parse())
        usage = chunks[-1].usage
        assert usage.prompt_tokens == 300 and usage.completion_tokens == 4
        assert usage.prompt_tokens_details.cached_tokens == 300  # the whole prompt came over the link
        p_after, d_after = _sim_metrics(sims["p0"]), _sim_metrics(sims["d0"])
        assert p_after.get("local_compute", 0) - p_before.get("local_compute", 0) == 300
        assert d_after.get("external_kv_transfer", 0) - d_before.get("external_kv_transfer", 0) == 300
        assert d_after.get("local_compute", 0) - d_before.get("local_compute", 0) == 0
        # the next turn: d0 holds 288 of its 320 tokens, 32 uncached < 64: served whole by d0
        follow = prompt + list(range(60, 80))
        r = client.completions.with_raw_response.create(model="tiny", prompt=follow, max_tokens=2)
        assert r.headers["x-kvroute-worker"] == "d0" and "x-kvroute-prefill-worker" not in r.headers
        assert r.parse().usage.prompt_tokens_details.cached_tokens == 288
        assert _sim_metrics(sims["p0"]) == p_after  # the prefill worker saw nothing
        gw = PD(base, None)
        assert metric_value(gw, "kvroute_pd_requests_total", model="tiny", outcome="split") == 1
        assert metric_value(gw, "kvroute_pd_requests_total", model="tiny", outcome="whole") == 1
        # usage booked once per request, for the worker that computed the prompt: the split one on
        # p0 (its cold prefill: 0 cached, 0 predicted), the whole follow-up on d0 (288 cached)
        def booked() -> dict[str, tuple[float, float]]:
            return {w: (metric_value(gw, "kvroute_actual_cached_tokens_count", worker=w),
                        metric_value(gw, "kvroute_actual_cached_tokens_sum", worker=w)) for w in ("p0", "d0")}
        wait_until(lambda: booked()["d0"][0] == 1, what="the follow-up's usage booked")
        assert booked() == {"p0": (1, 0), "d0": (1, 288)}
        assert metric_value(gw, "kvroute_predicted_cached_tokens_sum", worker="d0") == 288
    finally:
        for p in reversed(started):
            p.stop()


async def _new_event() -> asyncio.Event:
    return asyncio.Event()


def test_dispatch_queue_holds_the_prefill_leg_for_its_pool(pd):
    """With policy.queue on (one prefill at a time per worker), a split request's prefill leg waits
    in the gateway while the prefill worker is busy with another's, as a whole request would, and
    goes once that one's answer came; its decode leg then goes straight to the decode worker."""
    p0 = pd["p0"]
    got = admin(pd, "GET", "/admin/policy").json()
    queue = {**got["queue"], "enabled": True, "worker_prefills": 1, "holder_prefills": 1, "settle_ms": 0,
             "worker_queue_ms": 0}
    assert admin(pd, "PUT", "/admin/policy", {**got, "queue": queue}).status_code == 200, got
    p0.gate = pd.stand.call(_new_event())
    p0.mode = "gate"
    results: dict[str, httpx.Response] = {}
    threads = []
    try:
        before = counts(pd)
        first, second = new_id(), new_id()

        def post(rid: str, seed: str) -> None:
            results[rid] = httpx.post(pd.base + "/v1/chat/completions", json=long_chat(seed),
                                      headers={"x-request-id": rid}, timeout=30)

        threads.append(threading.Thread(target=post, args=(first, "queue-a")))
        threads[-1].start()
        wait_until(lambda: p0.of(first), what="the first prefill leg on p0")
        threads.append(threading.Thread(target=post, args=(second, "queue-b")))
        threads[-1].start()
        wait_until(lambda: metric_value(pd, "kvroute_dispatch_queue_queued") == 1, what="the second leg queued")
        assert p0.of(second) == [] and len(p0.of(first)) == 1
        pd.stand.loop.call_soon_threadsafe(p0.gate.set)
        for t in threads:
            t.join(30)
        for rid in (first, second):
            r = results[rid]
            assert r.status_code == 200 and r.headers["x-kvroute-prefill-worker"] == "p0", r.text
            p, d, dworker = prefill_and_decode(pd, rid)
            assert r.headers["x-kvroute-worker"] == dworker
            assert d[2]["kv_transfer_params"] == p0.answered[f"{rid}-prefill"]
        assert counts(pd) == {**before, "split": before["split"] + 2}
        assert metric_value(pd, "kvroute_dispatch_queue_queued") == 0
        entry = next(e for e in admin(pd, "GET", "/admin/decisions").json()["decisions"] if e["request_id"] == second)
        assert entry["pd"]["prefill_worker"] == "p0" and entry["queue_wait_ms"] > 0
        idle(pd)
    finally:
        if p0.gate is not None:
            pd.stand.loop.call_soon_threadsafe(p0.gate.set)
        for t in threads:
            t.join(30)
        assert admin(pd, "PUT", "/admin/policy", got).status_code == 200


def queue_on(pd: PD) -> dict:
    """Turn policy.queue on, one request before its first byte per worker, no settle or queue
    margin; returns the policy to put back."""
    got = admin(pd, "GET", "/admin/policy").json()
    queue = {**got["queue"], "enabled": True, "worker_prefills": 1, "holder_prefills": 1, "settle_ms": 0,
             "worker_queue_ms": 0}
    assert admin(pd, "PUT", "/admin/policy", {**got, "queue": queue}).status_code == 200, got
    return got


def hold_decode_answers(pd: PD) -> asyncio.Event:
    """d0 and d1 answer whole and decode requests only once the returned event is set."""
    gate = pd.stand.call(_new_event())
    for w in ("d0", "d1"):
        pd[w].answer_gate = gate
    return gate


def test_dispatch_queue_holds_whole_requests_and_fallbacks_for_the_decode_pool(pd):
    """With policy.queue on, a request the decode pool serves whole (a short prompt), and the
    fallback of a split request whose prefill leg failed, wait in the gateway while every decode
    worker is before the first byte of another request, as any whole request does, and go once
    one answers."""
    got = queue_on(pd)
    gate = hold_decode_answers(pd)
    pd["p0"].mode = "500"
    results: dict[str, httpx.Response] = {}
    threads: list[threading.Thread] = []

    def post(rid: str, body: dict) -> None:
        results[rid] = httpx.post(pd.base + "/v1/chat/completions", json=body, headers={"x-request-id": rid},
                                  timeout=30)

    def start(rid: str, body: dict) -> None:
        threads.append(threading.Thread(target=post, args=(rid, body)))
        threads[-1].start()

    def seen(rid: str) -> list[str]:
        return [w for w in ("d0", "d1") if pd[w].of(rid)]

    short = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    try:
        before = counts(pd)
        a, b, c, f = (new_id() for _ in range(4))
        start(a, short)
        wait_until(lambda: seen(a), what="the first whole request on a decode worker")
        start(b, short)
        wait_until(lambda: seen(b), what="the second whole request on the other decode worker")
        assert sorted(seen(a) + seen(b)) == ["d0", "d1"]
        start(c, short)
        wait_until(lambda: metric_value(pd, "kvroute_dispatch_queue_queued") == 1, what="the third one queued")
        start(f, long_chat("queue-fallback"))  # split; its prefill leg fails, its fallback queues
        wait_until(lambda: pd["p0"].of(f) and metric_value(pd, "kvroute_dispatch_queue_queued") == 2,
                   what="the fallback queued")
        assert seen(c) == [] and seen(f) == []
        pd.stand.loop.call_soon_threadsafe(gate.set)
        for t in threads:
            t.join(30)
        for rid in (a, b, c, f):
            r = results[rid]
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-worker"] == seen(rid)[0] and "x-kvroute-prefill-worker" not in r.headers
        assert pd["p0"].of(c) == [] and len(pd["p0"].of(f)) == 1
        after = counts(pd)
        assert after["whole"] == before["whole"] + 3 and after["prefill_failed"] == before["prefill_failed"] + 1
        assert metric_value(pd, "kvroute_dispatch_queue_queued") == 0
        log = {e["request_id"]: e for e in admin(pd, "GET", "/admin/decisions").json()["decisions"]}
        assert log[c]["queue_wait_ms"] > 0 and log[c]["pd"]["decode_worker"] == seen(c)[0]
        idle(pd)
    finally:
        pd.stand.loop.call_soon_threadsafe(gate.set)
        for t in threads:
            t.join(30)
        assert admin(pd, "PUT", "/admin/policy", got).status_code == 200


def test_agent_api_requests_are_served_whole_by_the_decode_pool(pd):
    """Anthropic Messages and OpenAI Responses bodies are not split (vLLM's P/D legs are chat and
    completions bodies): the live policy chooses among the decode pool only, never p0."""
    messages = {"model": "tiny", "max_tokens": 4, "system": system_prompt("agent-pd", 300),
                "messages": [{"role": "user", "content": "hi"}]}
    responses = {"model": "tiny", "input": "hi", "instructions": system_prompt("agent-pd", 300)}
    for path, body in (("/v1/messages", messages), ("/v1/responses", responses)):
        out = admin(pd, "POST", f"/admin/explain?path={path}", body).json()
        assert out["chosen"] in ("d0", "d1") and out.get("pd") is None, out
        assert sorted(c["worker"] for c in out["candidates"]) == ["d0", "d1"]


def test_an_agent_api_request_waits_for_the_decode_pool_not_an_idle_prefill_worker(pd):
    """With policy.queue on and both decode workers before a first byte, a Messages request waits
    in the gateway rather than going to the idle prefill worker."""
    got = queue_on(pd)
    gate = hold_decode_answers(pd)
    short = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    results: dict[str, httpx.Response] = {}
    threads: list[threading.Thread] = []

    def post(key: str, path: str, body: dict) -> None:
        results[key] = httpx.post(pd.base + path, json=body, headers={"x-request-id": key}, timeout=30)

    def seen(key: str) -> list[str]:
        return [w for w in ("d0", "d1") if pd[w].of(key)]

    a, b, agent = (new_id() for _ in range(3))
    try:
        # each whole request must be on its decode worker (before its first byte) before the next
        # starts: the stand-ins' `seen` lists hold the whole module's requests, so wait on ids
        for key in (a, b):
            threads.append(threading.Thread(target=post, args=(key, "/v1/chat/completions", short)))
            threads[-1].start()
            wait_until(lambda: seen(key), what=f"request {key} on a decode worker")
        assert sorted(seen(a) + seen(b)) == ["d0", "d1"]
        threads.append(threading.Thread(target=post, args=(agent, "/v1/messages", {
            "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]})))
        threads[-1].start()
        # on a loaded machine the request can take seconds to reach the queue; one answered
        # before it queued fails here with its answer, not after the wait
        wait_until(lambda: metric_value(pd, "kvroute_dispatch_queue_queued") == 1 or agent in results,
                   timeout_s=60, what="the Messages request queued")
        assert agent not in results, (results[agent].status_code, results[agent].headers.get("x-kvroute-worker"),
                                      results[agent].text[:500])
        pd.stand.loop.call_soon_threadsafe(gate.set)
        for t in threads:
            t.join(30)
        assert results[agent].headers["x-kvroute-worker"] in ("d0", "d1")  # the stand-ins have no such route
        assert pd["p0"].of(agent) == []
    finally:
        pd.stand.loop.call_soon_threadsafe(gate.set)
        for t in threads:
            t.join(30)
        assert admin(pd, "PUT", "/admin/policy", got).status_code == 200
