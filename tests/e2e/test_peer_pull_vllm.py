"""Peer pull on two real vLLM servers (CPU build): worker B loads a prefix that worker A computed
from A's agent instead of recomputing it.

Each worker runs our KV connector with ``agent_socket`` set; its ``kvroute agent`` owns the tiers
(CPU tier in a shared memory file, SSD tier off), writes the worker's KV events into a real Redis
and serves its blocks to peers (shared-secret auth on). A's agent advertises a TCP forwarder run
by this test in front of its real port, so the test can corrupt one byte of a transfer. The
gateway (Redis index, the default policy) sees both workers; A computes each prompt (sent to its
own URL), then the admin API drains A so the gateway must send the prompt to B.

Each test has its own prompts, so any one runs alone (``-k``) or in any order:

1. A computes a long prompt; its blocks reach A's CPU tier (the index says so); with A drained,
   the gateway's explain sends it to B, credited with peer blocks from A;
2. the prompt sent to B (A drained; in file order B's first request, whose forward pass computes
   only the last 4 tokens: the case that made vLLM's CPU attention die with SIGILL before the
   connector asked for AMX state): B pulls it from A: vLLM reports the tokens cached (source
   ``p2p``), the greedy tokens and logprobs are identical to A's computation, the pulled blocks
   are B's own afterwards (B's CPU tier in the index; a second request hits B's GPU cache);
3. a transfer corrupted on the wire is detected (checksum), B recomputes (identical output) and
   nothing wrong is served: the load is asynchronous, so vLLM puts the request back in its queue,
   and the connector, told of the short pull, does not offer those blocks from A again.
4. B's vLLM restarted: its connector maps the agent's CPU tier file again and takes back the
   blocks in it; the pulled prompt is then a CPU-tier hit on the fresh engine, identical output.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest

from e2e.conftest import vllm_python
from e2e.tier_checks import TINY_BLOCK_BYTES, cached_by_source, random_tokens, same_output
from conftest import ADMIN_TOKEN, Proc, admin_get, free_ports, kvroute_argv, wait_http, wait_until
from offload_agent.connector.config import kv_transfer_config, vllm_env

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

BLOCK = 32
GPU_BLOCKS = 96
BLOCK_BYTES = TINY_BLOCK_BYTES
CPU_BYTES = 400 * BLOCK_BYTES
PROMPT_TOKENS = 900                             # 28 creditable blocks: (900 - 1) // 32; 4 tokens left to compute
N = 28
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SECRET = "peer-secret-for-the-e2e-test"
# which bytes a pull brings is checked here, not how fast: on two shared cores the agent may take
# longer than the default 100 ms to say which peer holds a prefix (vLLM then computes it)
PEER_LIMITS = {"peer_locate_timeout_ms": 5000.0}


def _tokens(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    return random_tokens(seed, n)


class Forwarder:
    """A TCP forwarder in front of a peer server. ``corrupt_next()`` flips one byte, 4096 bytes
    into the next answer (inside the first block's payload), once. ``on_request(data)``, when
    set, is called with each piece of a request once it has been sent on."""

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.target_port = target_port
        self.on_request = None
        self.armed = threading.Event()
        self.corrupted = threading.Event()
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", listen_port))
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def corrupt_next(self) -> None:
        self.corrupted.clear()
        self.armed.set()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                continue
            self.connections += 1
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=30)
            except OSError:  # the peer server is gone (a test killed it): the client sees a close
                client.close()
                continue
            pos = [0]  # bytes of the current answer forwarded so far
            threading.Thread(target=self._pump, args=(client, server, pos, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, pos, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pos: list[int], answers: bool) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                if not answers:
                    pos[0] = 0      # a new request: its answer starts
                    if self.on_request is not None:
                        dst.sendall(data)
                        self.on_request(data)
                        continue
                else:
                    at = 4096 - pos[0]
                    if self.armed.is_set() and 0 <= at < len(data):
                        data = data[:at] + bytes([data[at] ^ 0x20]) + data[at + 1:]
                        self.armed.clear()
                        self.corrupted.set()
                    pos[0] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def start_peer_workers(procs: dict[str, Proc], py: str, model: Path, log_dir: Path, redis_url: str,
                       ports: dict[str, tuple[int, int, int, int]], advertise: dict[str, str], tag: str,
                       limits: dict) -> tuple[dict[str, str], dict[str, tuple[list[str], dict[str, str]]]]:
    """Start each worker of ``ports`` (id -> HTTP, events, replay and peer ports; the n-th on core
    n) with :func:`start_peer_worker` into ``procs`` and wait until they answer. Returns their
    URLs and the servers' (argv, env) to start them again."""
    urls, starts = {}, {}
    for i, (wid, wports) in enumerate(ports.items()):
        procs[f"agent-{wid}"], procs[wid], starts[wid] = start_peer_worker(
            wid, py, model, log_dir, redis_url, wports, advertise[wid], tag, i, limits)
        urls[wid] = f"http://127.0.0.1:{wports[0]}"
    for wid in urls:
        wait_http(urls[wid] + "/health", procs[wid], timeout_s=480)
    return urls, starts


def start_gateway(procs: dict[str, Proc], log_dir: Path, port: int, model: Path, redis_url: str,
                  workers: list[dict], **config) -> str:
    """Start the gateway (the tiny model, the Redis index, ``workers``, ``config``'s other keys)
    into ``procs``; returns its URL once it answers."""
    cfg = {"listen": {"host": "127.0.0.1", "port": port},
           "models": [{"name": "tiny", "tokenizer": str(model), "block_size": BLOCK}],
           "index": {"backend": "redis", "url": redis_url}, "workers": workers, **config}
    cfg_path = log_dir / "gw.yaml"
    cfg_path.write_text(json.dumps(cfg))
    procs["gateway"] = Proc("gateway", kvroute_argv("serve", "--config", str(cfg_path)), log_dir)
    gateway = f"http://127.0.0.1:{port}"
    wait_http(gateway + "/health", procs["gateway"])
    return gateway


def start_peer_worker(wid: str, py: str, model: Path, log_dir: Path, redis_url: str,
                      ports: tuple[int, int, int, int], advertise: str, tag: str, core: int,
                      limits: dict) -> tuple[Proc, Proc, tuple[list[str], dict[str, str]]]:
    """Start worker ``wid``: its ``kvroute agent`` (CPU tier in ``/dev/shm``, the worker's KV
    events into Redis, peers served on ``ports[3]`` and advertised as ``advertise``, shared secret
    ``SECRET``) and its vLLM server (the tiny model, our connector on the agent's socket with
    ``limits``, KV events on ``ports[1]``/``ports[2]``, HTTP on ``ports[0]``, OMP bound to
    ``core``). Returns the agent, the server and the server's (argv, env) to start it again."""
    http_port, ev, rp, serve = ports
    sock = log_dir / f"{wid}.sock"
    agent = Proc(f"agent-{wid}", kvroute_argv(
        "agent", "--worker-id", wid, "--events", f"tcp://127.0.0.1:{ev}", "--replay", f"tcp://127.0.0.1:{rp}",
        "--index", redis_url, "--model", "tiny", "--block-size", str(BLOCK),
        "--tier-socket", str(sock), "--tier-shm", f"/dev/shm/kvroute-e2e-{tag}-{wid}",
        "--cpu-tier-bytes", str(CPU_BYTES), "--serve-peers", f"127.0.0.1:{serve}",
        "--advertise", advertise, "--peer-secret-env", "KVR_PEER_SECRET", "--remove-tiers-on-exit"),
        log_dir, env={"KVR_PEER_SECRET": SECRET})
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"}
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(http_port),
            "--max-model-len", "1024", "--block-size", str(BLOCK), "--enable-prefix-caching",
            "--dtype", "bfloat16", "--enforce-eager", "--num-gpu-blocks-override", str(GPU_BLOCKS),
            "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
            "--kv-transfer-config", json.dumps(kv_transfer_config(CPU_BYTES, agent_socket=sock, **limits))]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(min(core, os.cpu_count() - 1)), **vllm_env()}
    return agent, Proc(wid, argv, log_dir, env=env), (argv, env)


class Pair:
    def __init__(self, urls: dict[str, str], gateway: str, procs: dict[str, Proc], forwarder: Forwarder) -> None:
        self.urls, self.gateway, self.procs, self.forwarder = urls, gateway, procs, forwarder
        self.first: dict[tuple[int, ...], dict] = {}  # prompt -> A's completion of it

    def complete(self, tokens: list[int], worker: str | None = None) -> tuple[dict, str]:
        """Sent to ``worker``'s own URL, or through the gateway; returns the body and the worker."""
        r = httpx.post((self.urls[worker] if worker else self.gateway) + "/v1/completions", timeout=180,
                       json={"model": "tiny", "prompt": tokens, "max_tokens": 8, "temperature": 0, "logprobs": 3})
        assert r.status_code == 200, r.text
        return r.json(), worker or r.headers["x-kvroute-worker"]

    def admin(self, path: str, body: dict | None = None) -> dict:
        """A POST with ``body``, else a GET (asked again while the index is unavailable for a
        moment: :func:`conftest.admin_get`); the answer must be 200."""
        if body is not None:
            r = httpx.post(self.gateway + path, headers=AUTH, json=body, timeout=30)
        else:
            r = admin_get(self.gateway + path)
        assert r.status_code == 200, r.text
        return r.json()

    def cached_by_source(self, worker: str) -> dict[str, float]:
        return cached_by_source(self.urls[worker])

    def log(self, name: str) -> str:
        """The current process's log for ``name`` (a worker, its agent, the gateway)."""
        return self.procs[name].log_path.read_text(errors="replace")

    def tiers_log(self, name: str) -> str:
        """The connector's last log lines in worker ``name``'s log (for a failure's message)."""
        return "\n".join([ln for ln in self.log(name).splitlines() if "kvroute tiers" in ln][-15:])


def _cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@pytest.fixture(scope="module")
def pair(tmp_path_factory, redis_url):
    py = vllm_python()
    model = ensure_model("tiny", py)
    log_dir = tmp_path_factory.mktemp("peer")
    procs: dict[str, Proc] = {}
    forwarder = None
    tag = f"{os.getpid()}"
    try:
        (a_http, a_ev, a_rp, b_http, b_ev, b_rp, a_serve, a_fwd, b_serve, gw_port) = free_ports(10)
        ports = {"a": (a_http, a_ev, a_rp, a_serve), "b": (b_http, b_ev, b_rp, b_serve)}
        forwarder = Forwarder(a_fwd, a_serve)
        advertise = {"a": f"127.0.0.1:{a_fwd}", "b": f"127.0.0.1:{b_serve}"}
        urls, starts = start_peer_workers(procs, py, model, log_dir, redis_url, ports, advertise, tag, PEER_LIMITS)
        gateway = start_gateway(procs, log_dir, gw_port, model, redis_url,
                                [{"id": wid, "url": url, "model": "tiny"} for wid, url in urls.items()])
        p = Pair(urls, gateway, procs, forwarder)

        def restart(wid: str) -> Proc:  # the same server again: same ports, same agent
            n = sum(1 for name in procs if name.startswith(f"{wid}-")) + 1
            procs[wid].stop()
            proc = procs[wid] = Proc(f"{wid}-{n}", *starts[wid][:1], log_dir, env=starts[wid][1])
            procs[f"{wid}-{n}"] = proc
            wait_http(urls[wid] + "/health", proc, timeout_s=480)
            return proc
        p.restart = restart

        def both_serving():
            workers = p.admin("/admin/workers")["workers"]
            return all(w["healthy"] and ((w.get("peer") or {}).get("serve")) for w in workers)
        assert wait_until(both_serving, 60), p.admin("/admin/workers")
        yield p
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()
        if forwarder is not None:
            forwarder.close()


P0, P1, P2, P3 = _tokens(0), _tokens(1), _tokens(2), _tokens(3)  # one prompt per test: any order works


def _a_computes(pair: Pair, tokens: list[int]) -> dict:
    """``tokens`` computed on A (its own URL), once, and in the index as A's (its connector saves
    every prompt block to its CPU tier in the step that computes it); then A drained, so the
    gateway must send the prompt to B. Returns A's completion."""
    key = tuple(tokens)
    if key not in pair.first:
        before = pair.admin("/admin/index")["workers"]["a"]["blocks"]["cpu"]
        body, _ = pair.complete(tokens, "a")
        assert _cached(body) == 0
        assert wait_until(lambda: pair.admin("/admin/index")["workers"]["a"]["blocks"]["cpu"] >= before + N)
        pair.first[key] = body
    assert pair.admin("/admin/workers/a/drain", {})["draining"] is True
    return pair.first[key]


def test_the_router_credits_b_with_the_blocks_a_can_serve(pair):
    _a_computes(pair, P0)
    explain = pair.admin("/admin/explain", {"model": "tiny", "prompt": P0, "max_tokens": 1})
    assert (explain["chosen"], explain["reason"]) == ("b", "peer_pull")
    b = next(c for c in explain["candidates"] if c["worker"] == "b")
    assert b["matched_blocks"] == {"gpu": 0, "cpu": 0, "ssd": 0}
    assert (b["peer_blocks"], b["peer_worker"]) == (N, "a") and 0 < b["peer_credit"] <= 1
    assert explain["predicted_cached_tokens"] == N * BLOCK     # vLLM reports pulled tokens as cached


def test_b_pulls_the_prefix_from_a_with_identical_output(pair):
    first = _a_computes(pair, P1)
    before = pair.cached_by_source("b").get("p2p", 0.0)
    body, worker = pair.complete(P1)                   # A is drained: the gateway picks B
    assert worker == "b"
    assert _cached(body) == N * BLOCK, pair.tiers_log("b")
    same_output(first, body)
    assert pair.cached_by_source("b").get("p2p", 0.0) - before == N * BLOCK
    assert f"pulled {N} of {N} blocks from a" in pair.log("b")
    # the pulled blocks are B's own now: announced in its CPU tier, and B's GPU cache hits them
    assert wait_until(lambda: pair.admin("/admin/index")["workers"]["b"]["blocks"]["cpu"] >= N)
    again, worker = pair.complete(P1)
    assert worker == "b" and _cached(again) == N * BLOCK
    assert pair.cached_by_source("b").get("p2p", 0.0) - before == N * BLOCK   # no second pull
    same_output(first, again)


def test_a_corrupted_transfer_is_detected_and_recomputed(pair):
    first = _a_computes(pair, P2)
    pair.forwarder.corrupt_next()
    before = pair.cached_by_source("b").get("p2p", 0.0)
    body, worker = pair.complete(P2)
    assert worker == "b"
    assert pair.forwarder.corrupted.is_set()
    same_output(first, body)                          # never a wrong result
    log = pair.log("b")
    assert f"pulled 0 of {N} blocks from a" in log
    assert f"Recovered from KV load failure: 1 request(s) rescheduled ({N * BLOCK} tokens affected)" in log
    # the load is asynchronous: vLLM puts the request back in its queue and asks the connector
    # again, which no longer offers those blocks from that peer (the short pull was reported):
    # B computes them, pulling once
    assert f"pulled {N} of {N} blocks from a" not in log[log.index(f"pulled 0 of {N} blocks from a"):]
    # vLLM 0.32 counts the planned load by source when it schedules it and keeps the count
    assert pair.cached_by_source("b").get("p2p", 0.0) - before == N * BLOCK
    assert "checksum" in pair.log("agent-b")


def test_b_keeps_its_cpu_tier_across_a_vllm_restart(pair):
    """The agent owns the CPU tier: a restarted vLLM maps the agent's file again and takes back
    the blocks it held (P3's, pulled from A and saved), so P3 is a CPU-tier hit on a fresh engine."""
    first = _a_computes(pair, P3)
    _, worker = pair.complete(P3)
    assert worker == "b"
    assert wait_until(lambda: pair.admin("/admin/index")["workers"]["b"]["blocks"]["cpu"] >= N)
    restarted = pair.restart("b")
    log = restarted.log_path.read_text(errors="replace")
    kept = int(re.search(r"CPU tier \d+ blocks of \d+ bytes over 1 shard\(s\) \((\d+) kept from before\)", log).group(1))
    assert kept >= N                                 # at least P3's blocks, pulled from A and saved
    before = pair.cached_by_source("b").get("host", 0.0)
    body, worker = pair.complete(P3, "b")
    assert _cached(body) == N * BLOCK
    same_output(first, body)
    assert pair.cached_by_source("b").get("host", 0.0) - before == N * BLOCK   # from B's own CPU tier
    log = restarted.log_path.read_text(errors="replace")
    assert "peer 0" in log and "pulled" not in log
