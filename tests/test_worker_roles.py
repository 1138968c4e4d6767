"""Worker roles (``both``, ``prefill``, ``decode``) at the gateway: set in the config and by
``POST /admin/workers``, changed by ``PUT /admin/workers/{id}/role``, shown by ``GET
/admin/workers``, the metric ``kvroute_worker_role{worker, role}`` and ``/openapi.json``.

Against a real ``kvroute serve`` over two real ``kvroute sim`` workers (w0 with no role, w1
``role: decode`` in the config file), driven by raw HTTP; every error has the OpenAI shape.
Each test makes the state it checks, so any one also runs alone (``-k``).
"""
from __future__ import annotations

import httpx
import pytest

from conftest import ADMIN_TOKEN, Proc, free_port, free_ports, metric, wait_http
from router.config.schema import WorkerConfig
from test_gateway_e2e import BLOCK, _sim_argv, assert_openai_error, start_gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory, tiny_model):
    log_dir = tmp_path_factory.mktemp("roles")
    started: list[Proc] = []
    try:
        *sim_ports, port = free_ports(3)
        urls = {}
        for name, sim_port in zip(("w0", "w1"), sim_ports):
            proc = Proc(name, _sim_argv(tiny_model, sim_port), log_dir)
            started.append(proc)
            urls[name] = (f"http://127.0.0.1:{sim_port}", proc)
        for url, proc in urls.values():
            wait_http(url + "/health", proc, timeout_s=180)
        cfg = {
            "listen": {"host": "127.0.0.1", "port": port},
            "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
            "workers": [{"id": "w0", "url": urls["w0"][0], "model": "tiny"},
                        {"id": "w1", "url": urls["w1"][0], "model": "tiny", "role": "decode"}],
        }
        base, _, _ = start_gateway(cfg, log_dir, started)
        yield base
    finally:
        for p in reversed(started):
            p.stop()


def admin(base: str, method: str, path: str, body=None, token: str | None = ADMIN_TOKEN, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, base + path, json=body, headers=headers, timeout=30, **kw)


def roles(base: str) -> dict[str, str]:
    r = admin(base, "GET", "/admin/workers")
    assert r.status_code == 200, r.text
    return {w["id"]: w["role"] for w in r.json()["workers"]}


def test_worker_config_role_defaults_to_both_and_takes_only_the_three():
    assert WorkerConfig(url="http://h:1", model="m").role == "both"
    for role in ("both", "prefill", "decode"):
        assert WorkerConfig(url="http://h:1", model="m", role=role).role == role
    with pytest.raises(ValueError, match="role"):
        WorkerConfig(url="http://h:1", model="m", role="Prefill")


def test_config_roles_are_listed_and_exported(gw):
    assert roles(gw) == {"w0": "both", "w1": "decode"}
    assert metric(gw, "kvroute_worker_role", worker="w0", role="both") == 1
    assert metric(gw, "kvroute_worker_role", worker="w1", role="decode") == 1
    assert metric(gw, "kvroute_worker_role", worker="w1", role="both") == 0  # one series per worker


def test_put_role_changes_it_live(gw):
    try:
        r = admin(gw, "PUT", "/admin/workers/w0/role", {"role": "prefill"})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "w0" and r.json()["role"] == "prefill"
        assert roles(gw) == {"w0": "prefill", "w1": "decode"}
        text = httpx.get(gw + "/metrics", timeout=30).text
        series = sorted(line for line in text.splitlines() if line.startswith("kvroute_worker_role{"))
        assert series == ['kvroute_worker_role{role="decode",worker="w1"} 1.0',
                          'kvroute_worker_role{role="prefill",worker="w0"} 1.0']
        # the worker keeps serving: a role matters only where P/D is on
        assert r.json()["healthy"] is True
    finally:
        assert admin(gw, "PUT", "/admin/workers/w0/role", {"role": "both"}).status_code == 200
    assert roles(gw)["w0"] == "both"


@pytest.mark.parametrize("body", [{"role": "fast"}, {"role": None}, {}, {"role": "decode", "extra": 1}, ["decode"]])
def test_put_role_bad_body_is_400(gw, body):
    err = assert_openai_error(admin(gw, "PUT", "/admin/workers/w0/role", body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] in ("role", None)
    assert roles(gw)["w0"] == "both"


def test_put_role_errors(gw):
    err = assert_openai_error(admin(gw, "PUT", "/admin/workers/nope/role", {"role": "decode"}), 404)
    assert err["code"] == "worker_not_found"
    for token in (None, "wrong-token"):
        err = assert_openai_error(admin(gw, "PUT", "/admin/workers/w0/role", {"role": "decode"}, token=token), 401)
        assert err["type"] == "authentication_error"
    err = assert_openai_error(admin(gw, "PUT", "/admin/workers/w0/role", content=b"{not json",
                                    token=ADMIN_TOKEN), 400)
    assert roles(gw)["w0"] == "both"


def test_post_worker_with_role(gw):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: registered, unhealthy
    try:
        r = admin(gw, "POST", "/admin/workers", {"id": "p9", "url": dead, "model": "tiny", "role": "prefill"})
        assert r.status_code == 201, r.text
        assert r.json()["role"] == "prefill" and r.json()["healthy"] is False
        assert roles(gw)["p9"] == "prefill"
        assert metric(gw, "kvroute_worker_role", worker="p9", role="prefill") == 1
        err = assert_openai_error(admin(gw, "POST", "/admin/workers",
                                        {"id": "p8", "url": dead, "model": "tiny", "role": "x"}), 400)
        assert err["param"] == "role" and "p8" not in roles(gw)
    finally:
        admin(gw, "DELETE", "/admin/workers/p9")
    assert "p9" not in roles(gw)


def test_openapi_lists_the_role_route(gw):
    schema = httpx.get(gw + "/openapi.json", timeout=30).json()
    op = schema["paths"]["/admin/workers/{worker_id}/role"]["put"]
    assert op["security"] == [{"AdminBearer": []}]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/WorkerRole"}
    assert {"200", "400", "401", "404"} <= set(op["responses"])
    assert op["responses"]["404"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}
    schemas = schema["components"]["schemas"]
    assert schemas["WorkerRole"]["properties"]["role"]["enum"] == ["both", "prefill", "decode"]
    role_field = schemas["WorkerConfig"]["properties"]["role"]
    assert role_field["enum"] == ["both", "prefill", "decode"] and role_field["default"] == "both"
