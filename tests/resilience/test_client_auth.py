"""Client API keys (``client_auth``) through real gateways (`kvroute serve`) in front of one
`kvroute sim`: one gateway reads key hashes from a file, one from an environment variable, one has
no ``client_auth`` section (off by default). Without a key, or with a wrong one, every OpenAI
endpoint answers 401 in the OpenAI shape and nothing reaches the worker; with a right key the
request is relayed and the worker receives the client's ``Authorization`` header unchanged.
``/health``, ``/ping``, ``/metrics`` and ``/admin`` (its own token) need no client key."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, metric, wait_http
from router.client_auth import main as client_auth_main
from router.config.client_keys import parse_file_hashes, parse_hash
from router.config.schema import parse_config
from router.edge.client_auth import bearer_token

BLOCK = 32
KEY_A = "sk-tenant-a-0123456789"        # in the file, as "sha256:<hex>"
KEY_B = "sk-tenant-b-456"               # in the file, as a `sha256sum` output line
KEY_U = "sk-ünïcode"                    # in the file: keys are hashed as the header's UTF-8 bytes
KEY_C = "sk-env-c"                      # in the env var, bare hex
KEY_D = "sk-env-d"                      # in the env var, upper-case "SHA256:<HEX>"
ENV_VAR = "KVR_TEST_CLIENT_KEYS"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
OPENAI_POSTS = {  # every proxied POST path the sim serves, with a valid body
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 2},
    "/tokenize": {"model": "tiny", "prompt": "hello"},
    "/detokenize": {"model": "tiny", "tokens": [5, 6, 7]},
}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> dict[str, bytes]:
    return {"Authorization": f"Bearer {key}".encode()}  # UTF-8 bytes: httpx would encode a str as ASCII


class Cluster:
    def __init__(self, sim: str, gateways: dict[str, str]) -> None:
        self.sim = sim
        self.gw = gateways

    def worker_requests(self) -> list[dict]:
        return httpx.get(self.sim + "/sim/requests", timeout=30).json()["requests"]

    def clear(self) -> None:
        assert httpx.delete(self.sim + "/sim/requests", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model) -> Cluster:
    log_dir = tmp_path_factory.mktemp("client-auth")
    sim_port, *gw_ports = free_ports(4)
    keys_file = log_dir / "api_keys.txt"
    keys_file.write_text(f"# tenants\n\nsha256:{sha(KEY_A)}\n"
                         f"{sha(KEY_B)}  -\n{sha(KEY_U)}\n")
    started: list[Proc] = []
    try:
        sim = Proc("sim", kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny",
                                       "--host", "127.0.0.1", "--port", str(sim_port), "--block-size", str(BLOCK),
                                       "--speedup", "20"), log_dir)
        started.append(sim)
        sim_url = f"http://127.0.0.1:{sim_port}"
        wait_http(sim_url + "/health", sim, timeout_s=120)
        variants = {
            "file": {"api_keys_env": None, "api_keys_file": str(keys_file)},
            "env": {"api_keys_env": ENV_VAR},
            "off": None,
        }
        env = {ENV_VAR: f"{sha(KEY_C)}, SHA256:{sha(KEY_D).upper()}", "KVROUTE_API_KEYS": ""}
        gateways = {}
        for (name, auth), port in zip(variants.items(), gw_ports):
            cfg = {"listen": {"host": "127.0.0.1", "port": port},
                   "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
                   "workers": [{"id": "w0", "url": sim_url, "model": "tiny"}], "load_scrape": {"enabled": False}}
            if auth is not None:
                cfg["client_auth"] = auth
            path = log_dir / f"gateway-{name}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            proc = Proc(f"gateway-{name}", kvroute_argv("serve", "--config", str(path)), log_dir, env=env)
            started.append(proc)
            gateways[name] = f"http://127.0.0.1:{port}"
        for (name, base), proc in zip(gateways.items(), started[1:]):
            wait_http(base + "/health", proc, timeout_s=180)
        yield Cluster(sim_url, gateways)
    finally:
        for p in reversed(started):
            p.stop()


def _assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


@pytest.mark.parametrize("gateway", ["file", "env"])
def test_missing_or_wrong_key_is_refused_on_every_openai_endpoint(cluster, gateway):
    base = cluster.gw[gateway]
    cluster.clear()
    before = metric(base, "kvroute_requests_total", worker="none", status="401")
    wrong = [None, bearer("sk-not-a-key"), {"Authorization": "Bearer"},
             {"Authorization": f"Basic {KEY_A}"}, {"Authorization": KEY_A},
             bearer(sha(KEY_A)),  # the hash itself is not a key
             bearer(KEY_C if gateway == "file" else KEY_A)]  # the other gateway's key
    n = 0
    for headers in wrong:
        for path, body in OPENAI_POSTS.items():
            _assert_401(httpx.post(base + path, json=body, headers=headers, timeout=30))
            n += 1
        _assert_401(httpx.post(base + "/v1/embeddings", json={"model": "tiny", "input": "x"},
                               headers=headers, timeout=30))
        n += 1
        _assert_401(httpx.get(base + "/v1/models", headers=headers, timeout=30))  # not in kvroute_requests_total
    assert cluster.worker_requests() == []  # refused before anything was relayed
    assert metric(base, "kvroute_requests_total", worker="none", status="401") == before + n


@pytest.mark.parametrize("gateway,keys", [("file", [KEY_A, KEY_B]), ("env", [KEY_C, KEY_D])])
def test_right_key_is_relayed_with_the_clients_authorization_header(cluster, gateway, keys):
    base = cluster.gw[gateway]
    for key in keys:
        cluster.clear()
        header = bearer(key)["Authorization"]
        for path, body in OPENAI_POSTS.items():
            r = httpx.post(base + path, json=body, headers={"Authorization": header}, timeout=30)
            assert r.status_code == 200, (path, r.text)
            assert r.headers["x-kvroute-worker"] == "w0"
        got = cluster.worker_requests()
        assert [g["path"] for g in got] == list(OPENAI_POSTS)
        assert {g["headers"]["authorization"] for g in got} == {f"Bearer {key}"}
        models = httpx.get(base + "/v1/models", headers={"Authorization": header}, timeout=30)
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]


def test_scheme_is_case_insensitive_and_a_streamed_request_passes(cluster):
    base = cluster.gw["file"]
    cluster.clear()
    with httpx.stream("POST", base + "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"Authorization": f"bEaReR {KEY_A}"}, timeout=30) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    assert cluster.worker_requests()[0]["headers"]["authorization"] == f"bEaReR {KEY_A}"


def test_paths_outside_the_openai_api_need_no_client_key(cluster):
    base = cluster.gw["file"]
    assert httpx.get(base + "/health", timeout=30).json()["routable"] == 1
    assert httpx.get(base + "/ping", timeout=30).status_code == 200
    assert "kvroute_requests_total" in httpx.get(base + "/metrics", timeout=30).text
    workers = httpx.get(base + "/admin/workers", headers=ADMIN, timeout=30)
    assert [w["id"] for w in workers.json()["workers"]] == ["w0"]
    # /admin keeps its own token: a client key does not open it
    r = httpx.get(base + "/admin/workers", headers=bearer(KEY_A), timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"


def test_connection_survives_a_401_with_an_unread_body(cluster):
    base = cluster.gw["file"]
    big = {**CHAT, "messages": [{"role": "user", "content": "x " * 500_000}]}  # ~1 MB, never read
    with httpx.Client(timeout=30) as client:
        _assert_401(client.post(base + "/v1/chat/completions", json=big))
        ok = client.post(base + "/v1/chat/completions", json=CHAT, headers=bearer(KEY_A))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
        _assert_401(client.post(base + "/v1/completions", json={"model": "tiny", "prompt": "y " * 400_000}))
        assert client.get(base + "/v1/models", headers=bearer(KEY_B)).status_code == 200
        assert client.post(base + "/tokenize", json=OPENAI_POSTS["/tokenize"], headers=bearer(KEY_U)).status_code == 200


def test_off_by_default_and_any_authorization_header_is_forwarded(cluster):
    base = cluster.gw["off"]
    cluster.clear()
    assert httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    r = httpx.post(base + "/v1/chat/completions", json=CHAT, headers=bearer("anything-for-vllm"), timeout=30)
    assert r.status_code == 200
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 200
    got = cluster.worker_requests()
    assert "authorization" not in got[0]["headers"]
    assert got[1]["headers"]["authorization"] == "Bearer anything-for-vllm"


# ---- config and helpers (no processes) ------------------------------------------------------------

BASE_CFG = {"models": [{"name": "tiny", "block_size": 32}]}


def test_config_refuses_a_raw_key_or_an_unreadable_file_without_echoing_it(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, f"{sha(KEY_C)},sk-live-secret-key")
    with pytest.raises(ValueError) as exc:
        parse_config({**BASE_CFG, "client_auth": {"api_keys_env": ENV_VAR}})
    assert "client_auth" in str(exc.value) and "entry 2" in str(exc.value)
    assert "sk-live-secret-key" not in str(exc.value)
    bad_file = tmp_path / "keys"
    bad_file.write_text(f"{sha(KEY_A)}\nsha256:{sha(KEY_B)[:-1]}\n")
    with pytest.raises(ValueError, match="line 2"):
        parse_config({**BASE_CFG, "client_auth": {"api_keys_file": str(bad_file)}})
    with pytest.raises(ValueError, match="cannot read api_keys_file"):
        parse_config({**BASE_CFG, "client_auth": {"api_keys_file": str(tmp_path / "missing")}})
    monkeypatch.delenv("KVROUTE_API_KEYS", raising=False)
    assert parse_config(BASE_CFG).client_auth.api_keys_file is None


def test_kvroute_serve_exits_2_on_a_bad_key_entry(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({**BASE_CFG, "client_auth": {"api_keys_env": ENV_VAR}}))
    env = {**os.environ, ENV_VAR: "not-a-hash"}
    done = subprocess.run(kvroute_argv("serve", "--config", str(path)), env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "client_auth" in done.stderr and "not-a-hash" not in done.stderr


def test_hash_helpers_and_cli(capsys, monkeypatch):
    assert parse_hash(f"sha256:{sha(KEY_A)}") == parse_hash(sha(KEY_A).upper()) == hashlib.sha256(
        KEY_A.encode()).digest()
    assert parse_file_hashes(f"# c\n\n{sha(KEY_A)}  -\n", "f") == [hashlib.sha256(KEY_A.encode()).digest()]
    assert bearer_token([(b"x-other", b"1"), (b"authorization", b"Bearer  tok ")]) == b"tok"
    assert bearer_token([(b"authorization", b"Token tok")]) is None
    assert client_auth_main(["hash", KEY_A]) == 0
    assert capsys.readouterr().out == f"sha256:{sha(KEY_A)}\n"
    done = subprocess.run([sys.executable, "-m", "router.client_auth", "hash"], input=KEY_B + "\n",
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout == f"sha256:{sha(KEY_B)}\n"
    shell = subprocess.run(["sh", "-c", f"printf %s '{KEY_A}' | sha256sum"], capture_output=True, text=True)
    assert parse_file_hashes(shell.stdout, "sha256sum") == [parse_hash(sha(KEY_A))]
    assert client_auth_main(["nope"]) == 2
