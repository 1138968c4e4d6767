"""Peer pull without Redis: the gateway holds the embedded index (it subscribes to two `kvroute sim`
workers' real KV events) and two `kvroute agent --index http://GATEWAY` processes own the workers'
tiers, locate peers through the gateway (``POST /admin/index/match``) and publish their peer state
there (``PUT /admin/workers/{id}/peer``). The agents start before the gateway (as `kvroute up`
starts them) and wait for it. A KV connector's side is played by this test over each agent's Unix
socket (offload_agent/agent_link.py): its hello, a locate, a pull of blocks written into the
peer's CPU tier file.

The tests share one cluster and run in file order; the last one stops the agents. A 2-process
gateway (``--processes 2``) is checked on its own at the end."""
from __future__ import annotations

import array
import asyncio
import hashlib
import json
import os
import random
import signal

import httpx
import pytest
from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, wait_http, wait_until

from kvcore.block_keys import ENCODING_VERSION, block_keys
from kvcore.index.base import TierMatch
from offload_agent.agent_link import AgentLink, pull_area_path
from offload_agent.tiers.shm_slab import ShmSlab
from router.workers.peer_states import PeerStateSource, PublishedPeerStates

BLOCK = 32
BLOCK_BYTES = 512
CPU_SLOTS = 64
DIGEST = hashlib.blake2b(b"kvroute test layout", digest_size=16).digest()  # the KV layout both workers share
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TTL = {"w0": 30.0, "w1": 1.5}  # w0's state must outlive the test that withdraws it; w1's expires fast


def _tokens(seed: int, blocks: int, extra: int = 5) -> list[int]:
    rnd = random.Random(seed)
    return [10 + rnd.randrange(300) for _ in range(blocks * BLOCK + extra)]  # the tiny model has 330 ids


def _hello(sock: str) -> dict:
    return AgentLink(sock).call({"op": "hello", "role": "worker", "pid": os.getpid(), "block_bytes": BLOCK_BYTES,
                                 "fingerprint": {"model": "tiny", "block_size": BLOCK},
                                 "fingerprint_digest": DIGEST.hex()})


class Cluster:
    def __init__(self, log_dir, tiny_model) -> None:
        self.log_dir, self.tiny_model = log_dir, tiny_model
        self.procs: dict[str, Proc] = {}
        ports = iter(free_ports(7))
        self.sims = {w: {"port": next(ports), "ev": next(ports), "rp": next(ports)} for w in ("w0", "w1")}
        for s in self.sims.values():
            s["url"] = f"http://127.0.0.1:{s['port']}"
        self.gw_port = next(ports)
        self.base = f"http://127.0.0.1:{self.gw_port}"
        self.sockets = {w: str(log_dir / f"{w}.sock") for w in self.sims}
        self.shm = {w: f"/dev/shm/kvroute-test-peers-{os.getpid()}-{w}" for w in self.sims}

    def start(self, name: str, argv: list[str]) -> Proc:
        p = Proc(name, argv, self.log_dir)
        self.procs[name] = p
        return p

    def up(self) -> None:
        for w, s in self.sims.items():
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                      "endpoint": f"tcp://*:{s['ev']}", "replay_endpoint": f"tcp://*:{s['rp']}"}
            self.start(w, kvroute_argv(
                "sim", "--model", str(self.tiny_model), "--served-model-name", "tiny", "--host", "127.0.0.1",
                "--port", str(s["port"]), "--block-size", str(BLOCK), "--num-gpu-blocks-override", "256",
                "--enable-prompt-tokens-details", "--speedup", "50", "--kv-events-config", json.dumps(events)))
        for w in self.sims:  # before the gateway, as `kvroute up` starts them: they wait for it
            self.start(f"agent-{w}", kvroute_argv(
                "agent", "--worker-id", w, "--index", self.base, "--model", "tiny", "--block-size", str(BLOCK),
                "--tier-socket", self.sockets[w], "--tier-shm", self.shm[w],
                "--cpu-tier-bytes", str(CPU_SLOTS * BLOCK_BYTES), "--serve-peers", "127.0.0.1:0",
                "--heartbeat-ttl-s", str(TTL[w]), "--remove-tiers-on-exit"))
        for w, s in self.sims.items():
            wait_http(s["url"] + "/health", self.procs[w])
        for w in self.sims:
            wait_until(lambda: "not answering yet" in self.log(f"agent-{w}"), 30, f"agent-{w} waiting for the gateway")
        cfg = {"listen": {"host": "127.0.0.1", "port": self.gw_port},
               "models": [{"name": "tiny", "tokenizer": str(self.tiny_model), "block_size": BLOCK}],
               "index": {"backend": "memory"},
               "workers": [{"id": w, "url": s["url"], "model": "tiny", "events": f"tcp://127.0.0.1:{s['ev']}",
                            "replay": f"tcp://127.0.0.1:{s['rp']}"} for w, s in self.sims.items()]}
        (self.log_dir / "gw.yaml").write_text(json.dumps(cfg))
        wait_http(self.base + "/health", self.start("gateway", kvroute_argv("serve", "--config",
                                                                             str(self.log_dir / "gw.yaml"))))
        for w in self.sims:  # the connectors say hello: the agents make their CPU tiers and serve peers
            assert wait_until(lambda: os.path.exists(self.sockets[w]), 30, f"{w}'s tier socket")
            answer = _hello(self.sockets[w])
            assert answer["ok"], answer
            self.shm[w] = answer["shm_path"]

    def down(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()
        for path in self.shm.values():
            for leftover in (path, pull_area_path(path)):  # a SIGKILLed agent leaves both
                if os.path.exists(leftover):
                    os.unlink(leftover)

    def log(self, name: str) -> str:
        return self.procs[name].log_path.read_text(errors="replace")

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.base + path, headers=AUTH, timeout=10, **kw)

    def peer(self, worker: str) -> dict | None:
        r = self.admin("GET", "/admin/workers")
        assert r.status_code == 200, r.text
        return next(w for w in r.json()["workers"] if w["id"] == worker)["peer"]

    def compute(self, worker: str, tokens: list[int]) -> None:
        """``tokens`` computed on ``worker`` (its own URL, behind the gateway's back); returns once
        the gateway's index holds its full blocks for ``worker`` (its KV events arrived)."""
        r = httpx.post(self.sims[worker]["url"] + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": tokens, "max_tokens": 1})
        assert r.status_code == 200, r.text
        n = len(tokens) // BLOCK
        wait_until(lambda: self.match(token_ids=tokens).get(worker, {}).get("gpu") == n, 20,
                   f"{worker}'s {n} blocks in the gateway's index")

    def match(self, **body) -> dict:
        if "token_ids" in body:
            body["model"] = "tiny"
        r = self.admin("POST", "/admin/index/match", json=body)
        assert r.status_code == 200, r.text
        return r.json()["matches"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    c = Cluster(tmp_path_factory.mktemp("gateway-peers"), tiny_model)
    try:
        c.up()
        yield c
    finally:
        c.down()


# ---- unit: the gateway's store of published states ------------------------------------------------
def test_published_states_expire_and_overlay_a_shared_index():
    now = [100.0]
    store = PublishedPeerStates(clock=lambda: now[0], max_workers=2)
    store.put("a", {"peer": {"serve": "h:1"}, "tiers": {"hellos": 1}}, 2.0)
    store.put("b", {"peer": {"serve": "h:2"}}, 10.0)
    now[0] += 1.0
    assert store.live() == {"a": {"peer": {"serve": "h:1"}, "tiers": {"hellos": 1}, "published_age_s": 1.0,
                                  "ttl_s": 2.0},
                            "b": {"peer": {"serve": "h:2"}, "published_age_s": 1.0, "ttl_s": 10.0}}
    with pytest.raises(ValueError, match="kept already"):
        store.put("c", {"peer": {}}, 5.0)        # full: a third id is refused while a and b live
    now[0] += 1.5                                # a's 2 s are over
    assert sorted(store.live()) == ["b"]
    store.put("c", {"peer": {}}, 5.0)            # a's place is free again
    for bad_ttl in (0, -1, float("inf"), float("nan"), 3601, True):
        with pytest.raises(ValueError, match="ttl_s"):
            store.put("b", {"peer": {}}, bad_ttl)
    for bad_state in ({}, {"peer": 1}, {"peer": [1]}):
        with pytest.raises(ValueError, match='"peer"'):
            store.put("b", bad_state, 5.0)
    assert store.remove("b") is True and store.remove("b") is False and sorted(store.live()) == ["c"]

    class Shared:  # a shared index's agents (Redis) publish there
        async def worker_states(self):
            return {"c": {"peer": {"serve": "redis:1"}}, "d": {"peer": {"serve": "redis:2"}}}

    merged = asyncio.run(PeerStateSource(store, Shared()).worker_states())
    assert {w: st["peer"].get("serve") for w, st in merged.items()} == {"c": None, "d": "redis:2"}  # c: published


# ---- the cluster ----------------------------------------------------------------------------------
def test_agents_waited_for_the_gateway_and_publish_their_peer_state(cluster):
    for w in ("w0", "w1"):
        peer = wait_until(lambda: (cluster.peer(w) or {}).get("fingerprint") and cluster.peer(w), 15,
                          f"{w}'s state after its connector's hello")
        assert peer["serve"].startswith("127.0.0.1:") and peer["pull"] is True
        assert (peer["fingerprint"], peer["block_bytes"], peer["block_size"]) == (DIGEST.hex(), BLOCK_BYTES, BLOCK)
        assert f"peer state of worker {w} published to gateway {cluster.base} (registered there: True" \
            in cluster.log(f"agent-{w}")
    listed = cluster.admin("GET", "/admin/peers").json()
    assert listed["block_key_encoding"] == ENCODING_VERSION
    assert sorted(listed["workers"]) == ["w0", "w1"]
    w1 = listed["workers"]["w1"]
    assert w1["ttl_s"] == TTL["w1"] and 0 <= w1["published_age_s"] <= TTL["w1"]
    assert w1["tiers"]["cpu_slots"] == CPU_SLOTS and w1["tiers"]["hellos"] == 1


def test_the_lookup_answers_each_workers_run_by_keys_or_token_ids(cluster):
    tokens = _tokens(1, 10)
    cluster.compute("w0", tokens)
    cluster.compute("w1", tokens[:4 * BLOCK + 3])               # w1 holds the first 4 blocks
    keys = block_keys(tokens, BLOCK, "tiny")
    assert len(keys) == 10
    want = {"w0": {"gpu": 10, "cpu": 0, "ssd": 0}, "w1": {"gpu": 4, "cpu": 0, "ssd": 0}}
    assert cluster.match(token_ids=tokens) == want
    r = cluster.admin("POST", "/admin/index/match", json={"keys": keys})
    assert r.status_code == 200 and r.json() == {"matches": want, "blocks": 10, "block_key_encoding": ENCODING_VERSION}
    assert cluster.match(keys=keys[:6]) == {"w0": {"gpu": 6, "cpu": 0, "ssd": 0}, "w1": {"gpu": 4, "cpu": 0, "ssd": 0}}
    assert cluster.match(keys=[12345] + keys) == {}              # a run starts at the first key
    assert cluster.match(keys=[]) == {}
    salted = cluster.admin("POST", "/admin/index/match", json={"model": "tiny", "token_ids": tokens, "cache_salt": "s"})
    assert salted.json()["matches"] == {}                        # another salt, other keys


@pytest.mark.parametrize("method, path", [("POST", "/admin/index/match"), ("GET", "/admin/peers"),
                                          ("PUT", "/admin/workers/w0/peer"), ("DELETE", "/admin/workers/w0/peer")])
def test_the_agent_routes_need_the_admin_token(cluster, method, path):
    body = {"keys": [1]} if method == "POST" else {"peer": {}} if method == "PUT" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.request(method, cluster.base + path, headers=headers, json=body, timeout=10)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_admin_token"
    assert cluster.peer("w0") is not None                        # nothing was withdrawn


def test_the_agents_client_says_when_the_gateway_refuses_its_token(cluster):
    from kvcore.index.gateway import GatewayIndex, GatewayRefused

    async def main():
        idx = GatewayIndex(cluster.base, "wrong")
        try:
            with pytest.raises(GatewayRefused, match="refused the admin token"):
                await idx.worker_states()
        finally:
            await idx.close()
        idx = GatewayIndex(cluster.base, ADMIN_TOKEN)
        try:
            states = await idx.worker_states()
            assert states["w0"]["peer"]["fingerprint"] == DIGEST.hex()
        finally:
            await idx.close()
    asyncio.run(main())


@pytest.mark.parametrize("body, param", [
    (b"", None), (b"[1, 2]", None), (b"{not json", None),
    ({}, "keys"), ({"keys": [1], "token_ids": [1], "model": "tiny"}, "keys"),
    ({"keys": "1,2"}, "keys"), ({"keys": [1, "2"]}, "keys"), ({"keys": [-1]}, "keys"),
    ({"keys": [1.5]}, "keys"), ({"keys": [True]}, "keys"),
    ({"token_ids": [1, 2]}, "model"), ({"token_ids": [1, 1 << 32], "model": "tiny"}, "token_ids"),
    ({"token_ids": [1], "model": "tiny", "cache_salt": 3}, "cache_salt"),
])
def test_a_bad_lookup_is_a_400(cluster, body, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = cluster.admin("POST", "/admin/index/match", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "bad_request", param)


def test_a_lookup_of_an_unknown_model_is_a_404_and_too_many_keys_a_400(cluster):
    r = cluster.admin("POST", "/admin/index/match", json={"token_ids": [1] * 64, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = cluster.admin("POST", "/admin/index/match", content=b'{"keys": [' + b"1," * (1 << 20) + b'1]}')
    assert r.status_code == 400 and "at most 1048576" in r.json()["error"]["message"]
    r = cluster.admin("POST", "/admin/index/match", content=b'{"keys": [18446744073709551616]}')  # 2^64
    assert r.status_code == 400


def test_a_bad_publish_is_refused(cluster):
    for body, query, param in (({"tiers": {}}, "", "peer"), ({"peer": 5}, "", "peer"), ({"peer": {}}, "?ttl_s=0", "ttl_s"),
                               ({"peer": {}}, "?ttl_s=4000", "ttl_s"), ({"peer": {}}, "?ttl_s=soon", "ttl_s")):
        r = cluster.admin("PUT", "/admin/workers/w9/peer" + query, json=body)
        assert r.status_code == 400, (body, query, r.text)
        assert r.json()["error"]["param"] == param
    r = cluster.admin("PUT", "/admin/workers/w9/peer", json={"peer": {}, "pad": "x" * (64 << 10)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "w9" not in cluster.admin("GET", "/admin/peers").json()["workers"]
    r = cluster.admin("DELETE", "/admin/workers/w9/peer")
    assert r.status_code == 200 and r.json() == {"worker": "w9", "removed": False}


def test_an_agent_locates_through_the_gateway_and_pulls_from_its_peer(cluster):
    tokens = _tokens(2, 8)
    cluster.compute("w0", tokens)
    toks = array.array("I", tokens[:8 * BLOCK])
    link = AgentLink(cluster.sockets["w1"])

    def locate(first: int, n: int) -> dict:
        return link.call({"op": "locate", "start_block": first, "max_blocks": n, "cache_salt": None},
                         memoryview(toks).cast("B")[:4 * (first + n) * BLOCK])

    assert locate(0, 8) == {"ok": True, "peer": "w0", "blocks": 8}
    assert locate(3, 5) == {"ok": True, "peer": "w0", "blocks": 5}
    assert locate(0, 3) == {"ok": True, "peer": "w0", "blocks": 3}
    own = AgentLink(cluster.sockets["w0"]).call({"op": "locate", "start_block": 0, "max_blocks": 8},
                                                memoryview(toks).cast("B"))
    assert own == {"ok": True, "peer": None, "blocks": 0}       # never itself
    other = array.array("I", _tokens(3, 8)[:8 * BLOCK])         # nobody holds it
    assert link.call({"op": "locate", "start_block": 0, "max_blocks": 8},
                     memoryview(other).cast("B")) == {"ok": True, "peer": None, "blocks": 0}

    # w0's connector saved the blocks in w0's CPU tier (the test writes them as it would) ...
    shm = ShmSlab.attach(cluster.shm["w0"])                     # the file w0's agent made at the hello
    keys = [bytes([0xA0 + i]) * 16 for i in range(8)]
    blocks = [bytes([(i * 13 + j) % 251 for j in range(BLOCK_BYTES)]) for i in range(8)]
    for i, (key, data) in enumerate(zip(keys, blocks)):
        shm.begin_write(10 + i)
        shm.slot_view(10 + i)[:] = data
        shm.end_write(10 + i, key)
    # ... and w1's agent pulls them from w0's agent, found through the gateway's states
    out = bytearray(8 * BLOCK_BYTES)
    answer = link.call({"op": "pull", "peer": "w0", "deadline_ms": 5000}, memoryview(b"".join(keys)), None,
                       memoryview(out))
    shm.close()
    assert answer["ok"] and answer["blocks"] == 8 and answer["error"] is None
    assert bytes(out) == b"".join(blocks)
    assert wait_until(lambda: (cluster.peer("w1") or {}).get("pulled_blocks", 0) >= 8, 10, "w1's pull published")


def test_explain_credits_the_peer_blocks_a_published_agent_can_pull(cluster):
    tokens = _tokens(4, 10)
    cluster.compute("w0", tokens)
    r = cluster.admin("POST", "/admin/explain", json={"model": "tiny", "prompt": tokens, "max_tokens": 1})
    assert r.status_code == 200, r.text
    cands = {c["worker"]: c for c in r.json()["candidates"]}
    assert cands["w0"]["matched_blocks"] == {"gpu": 10, "cpu": 0, "ssd": 0} and not cands["w0"].get("peer_blocks")
    w1 = cands["w1"]
    assert w1["matched_blocks"] == {"gpu": 0, "cpu": 0, "ssd": 0}
    creditable = (len(tokens) - 1) // BLOCK
    assert (w1["peer_blocks"], w1["peer_worker"]) == (creditable, "w0") == (10, "w0")
    assert w1["peer_credit_source"] == "prior" and 0 < w1["peer_credit"] <= 1  # its pulls were too small to rate


def test_a_withdrawn_or_silent_agents_state_goes(cluster):
    tokens = _tokens(5, 6)
    cluster.compute("w0", tokens)
    assert cluster.peer("w0") is not None and cluster.peer("w1") is not None
    cluster.procs["agent-w1"].signal(signal.SIGKILL)             # silent: its state lives TTL["w1"] s more
    assert wait_until(lambda: cluster.peer("w1") is None, TTL["w1"] + 5, "w1's state expired")
    assert cluster.peer("w0") is not None                         # w0's still publishes
    cluster.procs["agent-w0"].stop()                              # a clean stop withdraws at once
    assert "could not withdraw" not in cluster.log("agent-w0")
    assert cluster.peer("w0") is None and cluster.admin("GET", "/admin/peers").json()["workers"] == {}
    r = cluster.admin("POST", "/admin/explain", json={"model": "tiny", "prompt": tokens, "max_tokens": 1})
    assert all(not c.get("peer_blocks") and c.get("peer") is None for c in r.json()["candidates"])


# ---- a 2-process gateway ----------------------------------------------------------------------------
def _each_process(base: str, path: str, tries: int = 200) -> dict[str, dict]:
    """``GET path`` on fresh connections until both processes answered; their JSON by process."""
    got: dict[str, dict] = {}
    for _ in range(tries):
        r = httpx.get(base + path, headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        got.setdefault(r.headers["x-kvroute-process"], r.json())
        if len(got) == 2:
            return got
    raise AssertionError(f"only processes {sorted(got)} answered {tries} connections")


def test_every_gateway_process_keeps_the_published_states(tmp_path, tiny_model, procs):
    port = free_ports(1)[0]
    cfg = {"listen": {"host": "127.0.0.1", "port": port},
           "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
           "index": {"backend": "memory"}, "workers": []}
    (tmp_path / "gw.yaml").write_text(json.dumps(cfg))
    gw = procs("gateway", kvroute_argv("serve", "--config", str(tmp_path / "gw.yaml"), "--processes", "2"))
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", gw, timeout_s=180)
    state = {"peer": {"serve": "127.0.0.1:7601", "pull": True, "block_bytes": 512, "block_size": BLOCK,
                      "fingerprint": DIGEST.hex()}}
    r = httpx.put(base + "/admin/workers/w5/peer?ttl_s=60", headers=AUTH, json=state, timeout=10)
    assert r.status_code == 200
    assert r.json() == {"worker": "w5", "ttl_s": 60.0, "registered": False, "block_key_encoding": ENCODING_VERSION}
    for answer in _each_process(base, "/admin/peers").values():
        assert answer["workers"]["w5"]["peer"] == state["peer"] and answer["workers"]["w5"]["ttl_s"] == 60.0
    r = httpx.delete(base + "/admin/workers/w5/peer", headers=AUTH, timeout=10)
    assert r.json() == {"worker": "w5", "removed": True}
    for answer in _each_process(base, "/admin/peers").values():
        assert answer["workers"] == {}


def test_a_gateway_index_client_fails_cleanly(tmp_path):
    """The agent's side against nothing listening, and against a gateway refusing its token."""
    from kvcore.index.errors import IndexUnavailable
    from kvcore.index.gateway import GatewayIndex, GatewayRefused

    async def main():
        idx = GatewayIndex(f"http://127.0.0.1:{free_ports(1)[0]}", "t")
        try:
            with pytest.raises(IndexUnavailable, match="failed"):
                await idx.match([1, 2])
            assert await idx.match([]) == {}
        finally:
            await idx.close()
    asyncio.run(main())
    with pytest.raises(ValueError):
        GatewayIndex("redis://127.0.0.1:1/0", "t")
    assert issubclass(GatewayRefused, IndexUnavailable) and TierMatch(1, 2, 3).total == 6


@pytest.mark.parametrize("extra, message", [
    ([], "needs --tier-socket"),
    (["--tier-socket", "t.sock", "--cpu-tier-bytes", "4096", "--events", "tcp://127.0.0.1:1"], "leave out --events"),
    (["--tier-socket", "t.sock", "--cpu-tier-bytes", "4096", "--admin-token-env", "KVR_UNSET_TOKEN"],
     "--admin-token-env KVR_UNSET_TOKEN: that variable is not set"),
    (["--tier-socket", "t.sock"], "--tier-socket needs --cpu-tier-bytes > 0"),
])
def test_an_agent_pointed_at_a_gateway_refuses_what_it_cannot_do(extra, message):
    import subprocess

    argv = kvroute_argv("agent", "--worker-id", "w", "--index", "http://127.0.0.1:1", "--model", "tiny",
                        "--block-size", "32", *extra)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "KVR_UNSET_TOKEN"} | {"KVROUTE_ADMIN_TOKEN": "t"})
    assert done.returncode == 2
    assert "kvroute agent: error: " in done.stderr and message in done.stderr, done.stderr


def test_an_agent_writing_redis_still_needs_the_events():
    import subprocess

    done = subprocess.run(kvroute_argv("agent", "--worker-id", "w", "--index", "redis://127.0.0.1:1/0",
                                       "--model", "tiny", "--block-size", "32"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--events is required with a Redis index" in done.stderr


def test_an_agent_stops_on_a_gateway_of_another_block_key_encoding(tmp_path, procs):
    """A gateway that computes another block-key version than the agent (another kvroute release):
    no key would ever match, so the agent says so and exits 1 (as with a Redis index)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str] = []

    class OtherRelease(BaseHTTPRequestHandler):
        def do_PUT(self):  # noqa: N802 (http.server's name)
            seen.append(f"{self.command} {self.path} {self.headers.get('Authorization')}")
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = json.dumps({"worker": "w", "ttl_s": 10.0, "registered": True,
                               "block_key_encoding": ENCODING_VERSION + 1}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_DELETE = do_PUT

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), OtherRelease)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        agent = procs("agent", kvroute_argv(
            "agent", "--worker-id", "w", "--index", f"http://127.0.0.1:{server.server_address[1]}", "--model", "tiny",
            "--block-size", "32", "--tier-socket", str(tmp_path / "w.sock"), "--tier-shm",
            f"/dev/shm/kvroute-test-enc-{os.getpid()}", "--cpu-tier-bytes", "4096"),
            env={"KVROUTE_ADMIN_TOKEN": "tok"})
        assert agent.popen.wait(60) == 1, agent.log_tail()
        assert f"computes block keys of encoding version {ENCODING_VERSION + 1}" in agent.log_tail()
        assert seen[0] == "PUT /admin/workers/w/peer?ttl_s=10.0 Bearer tok"
        assert seen[-1] == "DELETE /admin/workers/w/peer Bearer tok"      # withdrawn on the way out
    finally:
        server.shutdown()
        server.server_close()
