"""The whole shared-index path as real processes: a gateway (`kvroute serve`, index Redis),
2 simulated vLLM workers (`kvroute sim`) publishing real-format KV events, 2 agents (`kvroute agent`)
writing Redis, and a real redis-server. The tests run in file order on one cluster: each agent's view
in the gateway's admin API, prefix routing through events, eviction, a prefix-cache reset on one worker, a restarted simulator, a killed
agent, then Redis stopped mid-run. Each test caches the prompts it checks itself, so any one of them
also runs alone (``-k``)."""
from __future__ import annotations

import json
import random
import shutil
import signal
import time

import httpx
import pytest
import redis
import zmq
from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, wait_http
from openai import OpenAI

from kvcore.kv_events.wire import (REPLAY_END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, seq_bytes,
                                   seq_from_bytes)

BLOCK = 32
TTL_S = 1.5
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _prompt(seed: int, words: int = 300) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice("oak elm ash fir yew pine palm teak".split()) for _ in range(words))


def _messages(seed: int, user: str = "hi") -> list[dict]:
    return [{"role": "system", "content": _prompt(seed)}, {"role": "user", "content": user}]


class Cluster:
    def __init__(self, log_dir, tiny_model) -> None:
        self.log_dir = log_dir
        self.tiny_model = tiny_model
        self.procs: dict[str, Proc] = {}
        self.sims: dict[str, dict] = {}

    def start(self, name: str, argv: list[str]) -> Proc:
        p = Proc(f"{name}-{len(self.procs)}", argv, self.log_dir)
        self.procs[name] = p
        return p

    def start_redis(self) -> None:
        self.start("redis", [shutil.which("redis-server"), "--port", str(self.redis_port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"])
        client = redis.Redis(port=self.redis_port, socket_connect_timeout=0.5)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()

    def start_sim(self, name: str) -> None:
        s = self.sims[name]
        events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                      "endpoint": f"tcp://*:{s['ev']}", "replay_endpoint": f"tcp://*:{s['rp']}"}
        p = self.start(name, kvroute_argv(
            "sim", "--model", str(self.tiny_model), "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(s["port"]), "--block-size", str(BLOCK), "--num-gpu-blocks-override", "64",
            "--enable-prompt-tokens-details", "--speedup", "50", "--kv-events-config", json.dumps(events_cfg)))
        wait_http(s["url"] + "/health", p)

    def start_agent(self, name: str) -> None:
        s = self.sims[name]
        self.start(f"agent-{name}", kvroute_argv(
            "agent", "--worker-id", name, "--events", f"tcp://127.0.0.1:{s['ev']}",
            "--replay", f"tcp://127.0.0.1:{s['rp']}", "--index", self.redis_url, "--model", "tiny",
            "--block-size", str(BLOCK), "--heartbeat-ttl-s", str(TTL_S)))

    def up(self) -> None:
        ports = iter(free_ports(8))  # redis, 3 per simulator (HTTP, events, replay), gateway
        self.redis_port = next(ports)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.start_redis()
        for name in ("w0", "w1"):
            port = next(ports)
            self.sims[name] = {"port": port, "ev": next(ports), "rp": next(ports), "url": f"http://127.0.0.1:{port}"}
            self.start_sim(name)
            self.start_agent(name)
        gw_port = next(ports)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
               "models": [{"name": "tiny", "tokenizer": str(self.tiny_model), "block_size": BLOCK}],
               "index": {"backend": "redis", "url": self.redis_url},
               "workers": [{"id": n, "url": s["url"], "model": "tiny"} for n, s in self.sims.items()],
               "policy": {"name": "kv_aware"}}
        cfg_path = self.log_dir / "gw.yaml"
        cfg_path.write_text(json.dumps(cfg))
        gw = self.start("gateway", kvroute_argv("serve", "--config", str(cfg_path)))
        self.base = f"http://127.0.0.1:{gw_port}"
        wait_http(self.base + "/health", gw)

    def down(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    # ---- helpers ------------------------------------------------------------------------------
    def warm(self, name: str, seed: int) -> None:
        """Send a prompt straight to a worker, behind the gateway's back."""
        OpenAI(base_url=self.sims[name]["url"] + "/v1", api_key="x").chat.completions.create(
            model="tiny", messages=_messages(seed, "warm"), max_tokens=2)

    def matched(self, seed: int) -> dict[str, int]:
        """Gateway's view (via /admin/explain): gpu blocks matched per worker for the prompt."""
        r = httpx.post(self.base + "/admin/explain", headers=AUTH, timeout=10,
                       json={"model": "tiny", "messages": _messages(seed), "max_tokens": 2})
        assert r.status_code == 200, r.text
        return {c["worker"]: c["matched_blocks"]["gpu"] for c in r.json()["candidates"]}

    def wait_matched(self, seed: int, cond, what: str, timeout_s: float = 15.0) -> dict[str, int]:
        end = time.monotonic() + timeout_s
        while True:
            m = self.matched(seed)
            if cond(m):
                return m
            if time.monotonic() > end:
                raise AssertionError(f"{what}: matched blocks {m}\n" + "\n".join(
                    f"--- {p.name}\n{p.log_tail(15)}" for p in self.procs.values() if "agent" in p.name))
            time.sleep(0.1)

    def published(self, name: str) -> tuple[int, int]:
        """What simulator ``name`` has published, read back over its replay socket (from seq 0):
        (last seq or -1, distinct gpu blocks those events leave held)."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        try:
            sock.connect(f"tcp://127.0.0.1:{self.sims[name]['rp']}")
            sock.send_multipart([b"", seq_bytes(0)])
            last, held = -1, set()
            while True:
                _, _, seq_raw, payload = sock.recv_multipart()
                seq = seq_from_bytes(seq_raw)
                if seq == REPLAY_END_SEQ:
                    return last, len(held)
                last = seq
                for ev in decode_batch(payload).events:
                    if isinstance(ev, BlockStored) and ev.medium in (None, "GPU"):
                        held.update(ev.block_hashes)
                    elif isinstance(ev, BlockRemoved) and ev.medium in (None, "GPU"):
                        held.difference_update(ev.block_hashes)
                    elif isinstance(ev, AllBlocksCleared):
                        held.clear()
        finally:
            sock.close(0)
            ctx.term()

    def admin(self, path: str) -> dict:
        r = httpx.get(self.base + path, headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def route(self, seed: int) -> str:
        r = OpenAI(base_url=self.base + "/v1", api_key="x").chat.completions.with_raw_response.create(
            model="tiny", messages=_messages(seed), max_tokens=2)
        return r.headers["x-kvroute-worker"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    c = Cluster(tmp_path_factory.mktemp("agent-cluster"), tiny_model)
    try:
        c.up()
        yield c
    finally:
        c.down()


def test_admin_shows_each_agents_view_of_its_worker(cluster):
    # w0 gets one prompt straight from a client; w1 none. Each agent publishes its view into Redis
    # with its heartbeats; the gateway's /admin/workers and /admin/index show it as kv_events.
    cluster.warm("w0", 3)
    explain = httpx.post(cluster.base + "/admin/explain", headers=AUTH, timeout=10,
                         json={"model": "tiny", "messages": _messages(3, "warm"), "max_tokens": 2}).json()
    prompt_blocks = explain["prompt_tokens"] // BLOCK
    # the one decode step (max_tokens 2) fills no further block, so the cache holds the prompt's full blocks
    assert explain["prompt_tokens"] % BLOCK + 1 < BLOCK
    expected = {name: cluster.published(name) for name in ("w0", "w1")}
    assert expected["w0"] == (expected["w0"][0], prompt_blocks) and expected["w0"][0] >= 0
    assert expected["w1"] == (-1, 0)
    end = time.monotonic() + 15
    while True:
        seen = {w["id"]: w["kv_events"] for w in cluster.admin("/admin/workers")["workers"]}
        if all(seen.get(n) and seen[n]["last_seq"] == expected[n][0] for n in expected):
            break
        assert time.monotonic() < end, f"agents' states in /admin/workers: {seen}"
        time.sleep(0.1)
    index = cluster.admin("/admin/index")
    assert index["backend"] == "redis"
    for name, (last_seq, gpu_blocks) in expected.items():
        for view in (seen[name], index["workers"][name]["kv_events"]):
            assert view["worker"] == name and view["last_seq"] == last_seq
            assert view["blocks"] == {"gpu": gpu_blocks, "cpu": 0, "ssd": 0}
            assert view["index_synced"] is True
            # one replay: the catch-up from seq 0 when the agent started; no loss since
            assert view["replays"] == 1 and view["gaps"] == 0 and view["resyncs"] == 0
            assert isinstance(view["published_age_s"], float) and view["published_age_s"] >= 0
    assert index["workers"]["w0"]["blocks"]["gpu"] == prompt_blocks  # the index itself agrees
    assert seen["w0"]["batches_applied"] == expected["w0"][0] + 1  # every batch since seq 0
    assert isinstance(seen["w0"]["last_event_age_s"], float) and seen["w0"]["last_event_age_s"] >= 0
    assert seen["w1"]["last_event_age_s"] is None  # nothing published yet


def test_prefix_cached_behind_the_gateway_attracts_the_prompt(cluster):
    for seed, target in ((1, "w0"), (2, "w1")):
        cluster.warm(target, seed)
        m = cluster.wait_matched(seed, lambda m, t=target: m.get(t, 0) >= 8, f"{target} holds prompt {seed}")
        other = "w1" if target == "w0" else "w0"
        assert m[other] == 0
        assert cluster.route(seed) == target


def test_eviction_moves_the_prefix(cluster):
    cluster.warm("w0", 10)
    cluster.wait_matched(10, lambda m: m.get("w0", 0) >= 8, "w0 holds prompt 10")
    for seed in range(11, 16):  # 64 blocks of 32 tokens: these evict prompt 10 from w0
        cluster.warm("w0", seed)
    cluster.wait_matched(10, lambda m: m.get("w0", 0) < 8, "eviction reached the index")
    cluster.warm("w1", 10)
    cluster.wait_matched(10, lambda m: m.get("w1", 0) >= 8, "w1 holds prompt 10")
    assert cluster.route(10) == "w1"


def test_prefix_cache_reset_on_one_worker_leaves_the_other(cluster):
    cluster.warm("w0", 20)
    cluster.warm("w1", 21)
    cluster.wait_matched(20, lambda m: m.get("w0", 0) >= 8, "w0 holds prompt 20")
    cluster.wait_matched(21, lambda m: m.get("w1", 0) >= 8, "w1 holds prompt 21")
    assert httpx.post(cluster.sims["w0"]["url"] + "/reset_prefix_cache").status_code == 200
    cluster.warm("w0", 22)  # as in vLLM, AllBlocksCleared goes out with the next step's batch
    cluster.wait_matched(22, lambda m: m.get("w0", 0) >= 8, "w0 holds prompt 22")
    cluster.wait_matched(20, lambda m: m.get("w0", 0) == 0, "w0's entries cleared")
    assert cluster.matched(21)["w1"] >= 8


def test_restarted_simulator_is_detected_and_its_old_entries_dropped(cluster):
    cluster.warm("w0", 30)
    cluster.wait_matched(30, lambda m: m.get("w0", 0) >= 8, "w0 holds prompt 30")
    cluster.procs["w0"].stop()
    cluster.start_sim("w0")  # same ports, empty cache, seq back to 0
    cluster.warm("w0", 31)
    cluster.wait_matched(31, lambda m: m.get("w0", 0) >= 8, "restarted w0's events indexed")
    # prompt 30 lived only in the old process's cache: the agent resynced the worker
    cluster.wait_matched(30, lambda m: m.get("w0", 0) == 0, "old entries dropped after restart")
    log = cluster.procs["agent-w0"].log_path.read_text()
    assert "publisher restarted" in log


def test_killed_agent_entries_stop_counting_after_the_ttl(cluster):
    cluster.warm("w1", 40)
    cluster.wait_matched(40, lambda m: m.get("w1", 0) >= 8, "w1 holds prompt 40")
    agent = cluster.procs["agent-w1"]
    agent.signal(signal.SIGKILL)
    agent.popen.wait(10)
    # the entries stop counting when the last heartbeat's TTL runs out: not before (a kill purges
    # nothing) and not long after. Redis gives the last heartbeat's age with the agent's state.
    t0 = time.monotonic()
    age = {w["id"]: w["kv_events"] for w in cluster.admin("/admin/workers")["workers"]}["w1"]["published_age_s"]
    assert 0 <= age < TTL_S
    left = TTL_S - age  # the heartbeat key expires this long after t0, or a little later
    cluster.wait_matched(40, lambda m: m.get("w1", 0) == 0, "TTL expiry", timeout_s=left + 10)
    elapsed = time.monotonic() - t0
    assert elapsed >= left - 0.05, (age, elapsed)  # not before the TTL (no upper bound: the machine is shared)
    # its published view expired with it (it is written with the heartbeats)
    assert {w["id"]: w["kv_events"] for w in cluster.admin("/admin/workers")["workers"]}["w1"] is None
    cluster.start_agent("w1")  # back: it catches up through vLLM's replay buffer
    cluster.wait_matched(40, lambda m: m.get("w1", 0) >= 8, "restarted agent republished")


def test_redis_stopped_mid_run_requests_still_succeed(cluster):
    cluster.warm("w1", 55)  # w1 holds blocks of its own, which its agent must republish below
    cluster.wait_matched(55, lambda m: m.get("w1", 0) >= 8, "w1 holds prompt 55")
    def counter(name: str) -> float:
        lines = [ln for ln in httpx.get(cluster.base + "/metrics", timeout=10).text.splitlines()
                 if ln.startswith(name + " ")]
        return float(lines[0].split()[1]) if lines else 0.0

    lookups0, writes0 = counter("kvroute_index_unavailable_total"), counter("kvroute_index_write_failures_total")
    cluster.procs["redis"].stop()
    seen = set()
    for seed in (50, 51, 52, 53):
        seen.add(cluster.route(seed))  # raises on a non-2xx
    assert seen <= {"w0", "w1"}
    assert counter("kvroute_index_unavailable_total") - lookups0 == 4  # counted, routed by load alone
    # the speculative entries live in the gateway (RedisIndex keeps them local): nothing failed to be stored
    assert counter("kvroute_index_write_failures_total") == writes0
    r = httpx.get(cluster.base + "/admin/index", headers=AUTH, timeout=10)  # the admin says why
    assert r.status_code == 503 and r.json()["error"]["code"] == "index_unavailable"
    cluster.start_redis()  # back, empty: the agents publish their state again
    cluster.warm("w0", 54)
    cluster.wait_matched(54, lambda m: m.get("w0", 0) >= 8, "index recovered", timeout_s=20)
    # not just the new prompt: each agent republished every block its worker holds, as the worker's
    # own events (read back over its replay socket) say
    end = time.monotonic() + 20
    while True:
        held = {name: cluster.published(name)[1] for name in ("w0", "w1")}
        r = httpx.get(cluster.base + "/admin/index", headers=AUTH, timeout=10)
        assert r.status_code == 200
        blocks = {w: v["blocks"]["gpu"] for w, v in r.json()["workers"].items()}
        if blocks == held:
            break
        assert time.monotonic() < end, f"gpu blocks in Redis after recovery {blocks}, held by the workers {held}"
        time.sleep(0.2)
    assert held["w0"] >= 8 and held["w1"] >= 8
