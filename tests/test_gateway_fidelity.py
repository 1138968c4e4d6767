"""Fidelity of the gateway (`kvroute serve`) in front of a real `kvroute sim` and a stuck worker:
a body without ``model``, a ``GET /v1/models`` that one worker never answers, and worker
endpoints the admin API, the config file and a reload refuse alike. Plus admin changes racing a
reload (in-process, on the gateway object)."""
from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, serve_gateway, wait_http
from router.config.schema import parse_config
from router.gateway import Gateway

BLOCK = 32
HERE = Path(__file__).resolve().parent
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ALLOWED_ORIGIN = "http://app.example"
MAX_TOKENIZE_BYTES = 8192
CHAT = {"messages": [{"role": "user", "content": "hello there, how are you"}], "max_tokens": 2}


@dataclass
class Setup:
    one_model: str   # gateway serving "tiny" only: w0 (sim)
    two_models: str  # gateway serving "tiny" and "other": w0 (sim, tiny) and stuck (other)
    sim_url: str


def _gateway(name: str, cfg: dict, log_dir: Path, started: list[Proc]) -> str:
    return serve_gateway(cfg, log_dir, started, name)[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model) -> Setup:
    log_dir = tmp_path_factory.mktemp("fidelity")
    started: list[Proc] = []
    sim_port, stuck_port, gw1_port, gw2_port = free_ports(4)
    try:
        sim = Proc("sim", kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny",
                                       "--host", "127.0.0.1", "--port", str(sim_port), "--block-size", str(BLOCK),
                                       "--enable-prompt-tokens-details", "--speedup", "10"), log_dir)
        started.append(sim)
        stuck = Proc("stuck", [sys.executable, str(HERE / "bad_worker.py"), "--port", str(stuck_port),
                               "--mode", "hang"], log_dir)
        started.append(stuck)
        sim_url, stuck_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{stuck_port}"
        wait_http(sim_url + "/health", sim, timeout_s=180)
        wait_http(stuck_url + "/health", stuck, timeout_s=60)
        tiny = {"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}
        base = {"admin": {"token_env": "KVROUTE_ADMIN_TOKEN"}, "load_scrape": {"enabled": False},
                "timeouts": {"worker_call_s": 1.0}}
        one = _gateway("gw-one", {**base, "listen": {"host": "127.0.0.1", "port": gw1_port}, "models": [tiny],
                                  "cors": {"allowed_origins": [ALLOWED_ORIGIN]},
                                  "routing": {"max_tokenize_bytes": MAX_TOKENIZE_BYTES},
                                  "workers": [{"id": "w0", "url": sim_url, "model": "tiny"}]}, log_dir, started)
        two = _gateway("gw-two", {**base, "listen": {"host": "127.0.0.1", "port": gw2_port},
                                  "models": [tiny, {**tiny, "name": "other"}],
                                  "workers": [{"id": "w0", "url": sim_url, "model": "tiny"},
                                              {"id": "stuck", "url": stuck_url, "model": "other"}]},
                       log_dir, started)
        yield Setup(one, two, sim_url)
    finally:
        for p in reversed(started):
            p.stop()


def _metric(base: str, line_prefix: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- a body without model -------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "model": None}),
    ("/v1/chat/completions", {**CHAT, "model": ""}),
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 2}),
], ids=["chat-absent", "chat-null", "chat-empty", "completions-absent"])
def test_body_without_model_is_served_by_the_one_model(setup, path, body):
    via_gateway = httpx.post(setup.one_model + path, json=body, timeout=60)
    assert via_gateway.status_code == 200, via_gateway.text
    assert via_gateway.headers["x-kvroute-worker"] == "w0"
    direct = httpx.post(setup.sim_url + path, json=body, timeout=60)  # the worker accepts it too
    assert direct.status_code == 200
    assert via_gateway.json()["model"] == direct.json()["model"] == "tiny"
    assert via_gateway.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]
    # routed as "tiny": tokenized with its tokenizer, the same prompt tokens as with the name
    explained = httpx.post(setup.one_model + "/admin/explain", json=body, headers=AUTH, timeout=30).json()
    named = httpx.post(setup.one_model + "/admin/explain", json={**body, "model": "tiny"}, headers=AUTH,
                       timeout=30).json()
    assert explained["prompt_tokens"] == named["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/admin/explain"])
def test_body_without_model_among_several_models_gets_400_listing_them(setup, path):
    body = CHAT if path != "/v1/completions" else {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(setup.two_models + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "model" and err["type"] == "invalid_request_error"
    assert "other, tiny" in err["message"]


@pytest.mark.parametrize("model", [5, ["tiny"], {"name": "tiny"}, True])
def test_model_of_the_wrong_type_gets_400(setup, model):
    r = httpx.post(setup.one_model + "/v1/chat/completions", json={**CHAT, "model": model}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


# ---- CORS: the gateway's own policy (vLLM's flags), on the hot path too -------------------------
@pytest.mark.parametrize("origin,allowed", [(ALLOWED_ORIGIN, True), ("http://evil.example", False)])
def test_cors_follows_the_gateways_allowed_origins(setup, origin, allowed):
    preflight = httpx.options(setup.one_model + "/v1/chat/completions", timeout=30, headers={
        "origin": origin, "access-control-request-method": "POST", "access-control-request-headers": "content-type"})
    assert preflight.status_code == (200 if allowed else 400)
    assert preflight.headers.get("access-control-allow-origin") == (origin if allowed else None)
    posted = httpx.post(setup.one_model + "/v1/chat/completions", json={**CHAT, "model": "tiny"},
                        headers={"origin": origin}, timeout=60)
    assert posted.status_code == 200 and posted.headers["x-kvroute-worker"] == "w0"
    assert posted.headers.get("access-control-allow-origin") == (origin if allowed else None)
    listed = httpx.get(setup.one_model + "/v1/models", headers={"origin": origin}, timeout=30)
    assert listed.headers.get("access-control-allow-origin") == (origin if allowed else None)
    # the default (vLLM's): no origin is allowed
    default = httpx.options(setup.two_models + "/v1/chat/completions", timeout=30, headers={
        "origin": ALLOWED_ORIGIN, "access-control-request-method": "POST"})
    assert default.status_code == 400 and "access-control-allow-origin" not in default.headers


# ---- one stuck worker ------------------------------------------------------------------------------
def test_models_listing_skips_a_stuck_worker(setup):
    """The stuck worker answers /health (so it is listed as healthy) but never /v1/models: the
    listing comes with the other worker's models (each call is bounded by worker_call_s 1 s; the
    stuck one never answers) and the failure is counted."""
    series = 'kvroute_worker_call_failures_total{call="models",worker="stuck"}'
    before = _metric(setup.two_models, series)
    healthy = {w["id"]: w["healthy"] for w in
               httpx.get(setup.two_models + "/admin/workers", headers=AUTH, timeout=30).json()["workers"]}
    assert healthy == {"w0": True, "stuck": True}
    r = httpx.get(setup.two_models + "/v1/models", timeout=60)
    assert r.status_code == 200
    assert [card["id"] for card in r.json()["data"]] == ["tiny"]
    assert _metric(setup.two_models, series) == before + 1


# ---- worker endpoints: one schema for the admin API, the config file and a reload ----------------
BAD_WORKERS = [
    ({"id": "bad", "url": "http://127.0.0.1:99999", "model": "tiny"}, "url"),
    ({"id": "bad", "url": "http://127.0.0.1:http", "model": "tiny"}, "url"),
    ({"id": "bad", "url": "http://127.0.0.1:0", "model": "tiny"}, "url"),
    ({"id": "bad", "url": "ftp://127.0.0.1:8000", "model": "tiny"}, "url"),
    ({"id": "bad", "url": "http://user:pw@127.0.0.1:8000", "model": "tiny"}, "url"),
    ({"id": "bad", "url": "http://127.0.0.1:8000", "model": "tiny", "events": "not an endpoint"}, "events"),
    ({"id": "bad", "url": "http://127.0.0.1:8000", "model": "tiny", "events": "tcp://127.0.0.1:70000"}, "events"),
    ({"id": "bad", "url": "http://127.0.0.1:8000", "model": "tiny", "events": "tcp://127.0.0.1"}, "events"),
    ({"id": "bad", "url": "http://127.0.0.1:8000", "model": "tiny", "replay": "udp://127.0.0.1:5"}, "replay"),
    ({"id": "bad", "url": "http://127.0.0.1:8000", "model": "tiny", "extra": 1}, "extra"),
    ({"id": "bad/slash", "url": "http://127.0.0.1:8000", "model": "tiny"}, None),
    ({"id": "", "url": "http://127.0.0.1:8000", "model": "tiny"}, "id"),
]


@pytest.mark.parametrize("worker,field", BAD_WORKERS, ids=[f"{w.get('url')}-{f}" for w, f in BAD_WORKERS])
def test_add_worker_refuses_unusable_endpoints(setup, worker, field):
    before = httpx.get(setup.one_model + "/admin/workers", headers=AUTH, timeout=30).json()["workers"]
    r = httpx.post(setup.one_model + "/admin/workers", json=worker, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if field is not None:
        assert err["param"] == field and field in err["message"]
    after = httpx.get(setup.one_model + "/admin/workers", headers=AUTH, timeout=30).json()["workers"]
    assert [w["id"] for w in after] == [w["id"] for w in before] == ["w0"]
    routed = httpx.post(setup.one_model + "/v1/chat/completions", json={**CHAT, "model": "tiny"}, timeout=60)
    assert routed.status_code == 200 and routed.headers["x-kvroute-worker"] == "w0"
    # the config file (and so a SIGHUP reload, which reads it the same way) refuses it too
    with pytest.raises(ValueError, match=field or "worker id"):
        parse_config({"models": [{"name": "tiny", "block_size": BLOCK}], "workers": [worker]})


# ---- admin changes racing a reload ---------------------------------------------------------------
async def test_admin_changes_wait_for_a_reload_in_progress(tiny_model):
    """A reload that drops w1 and w2 while DELETEs of both arrive: every change is applied once,
    in turn (the reload first: the DELETEs then find nothing to remove, a 404), and nothing
    raises in the reload. Nobody listens on the workers' ports: they are only registered."""
    ports = free_ports(3)
    def cfg(ids):
        return parse_config({"models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
                             "health": {"timeout_s": 0.5}, "load_scrape": {"enabled": False},
                             "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{ports[i]}", "model": "tiny"}
                                         for i in ids]})
    gw = Gateway(cfg([0, 1, 2]))
    await gw.start()
    try:
        reload, del1, del2 = await asyncio.gather(gw.apply_config(cfg([0])), gw.remove_worker("w1"),
                                                  gw.remove_worker("w2"), return_exceptions=True)
        assert reload == {"added": [], "removed": ["w1", "w2"], "replaced": []}
        assert isinstance(del1, KeyError) and isinstance(del2, KeyError)
        assert [r.id for r in gw.registry.all()] == ["w0"]
        # and the other way round: a DELETE under way, then a reload that still lists the worker
        del0, reload2 = await asyncio.gather(gw.remove_worker("w0"), gw.apply_config(cfg([0])),
                                             return_exceptions=True)
        assert del0.id == "w0" and reload2 == {"added": ["w0"], "removed": [], "replaced": []}
        assert [r.id for r in gw.registry.all()] == ["w0"]
    finally:
        await gw.stop()


def test_header_bytes_reach_the_worker_unchanged(setup):
    """Header values go upstream byte for byte, UTF-8 included (aiohttp writes strings as UTF-8)."""
    raw = "tenant é ☃".encode()
    r = httpx.post(setup.one_model + "/v1/chat/completions", json={**CHAT, "model": "tiny"},
                   headers={"x-tenant": raw, "x-request-id": "hdr-bytes-1"}, timeout=60)
    assert r.status_code == 200
    recorded = httpx.get(setup.sim_url + "/sim/requests", timeout=10).json()["requests"]
    sent = [q for q in recorded if q["headers"].get("x-request-id") == "hdr-bytes-1"]
    assert [q["headers"]["x-tenant"].encode("latin-1") for q in sent] == [raw]  # Starlette decodes as latin-1


def test_a_second_registration_of_one_server_is_refused(setup):
    """The same server under another id would count twice in routing and load: 409 from the admin
    API; the config file refuses it too."""
    r = httpx.post(setup.one_model + "/admin/workers", json={"id": "w9", "url": setup.sim_url, "model": "tiny"},
                   headers=AUTH, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_exists" and "'w0'" in r.json()["error"]["message"]
    ids = [w["id"] for w in httpx.get(setup.one_model + "/admin/workers", headers=AUTH, timeout=30).json()["workers"]]
    assert ids == ["w0"]
    with pytest.raises(ValueError, match="worker urls repeated"):
        parse_config({"models": [{"name": "tiny", "block_size": BLOCK}],
                      "workers": [{"id": "a", "url": setup.sim_url, "model": "tiny"},
                                  {"id": "b", "url": setup.sim_url, "model": "tiny"}]})


def test_a_body_past_max_tokenize_bytes_is_routed_by_load_untokenized(setup):
    series = 'kvroute_tokenization_fallbacks_total{model="tiny",reason="too_large"}'
    before = _metric(setup.one_model, series)
    body = {"model": "tiny", "prompt": "word " * (MAX_TOKENIZE_BYTES // 4), "max_tokens": 1}
    r = httpx.post(setup.one_model + "/v1/completions", json=body, timeout=60)
    direct = httpx.post(setup.sim_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == direct.status_code and r.headers["x-kvroute-worker"] == "w0"
    assert _metric(setup.one_model, series) == before + 1
