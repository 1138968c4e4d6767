"""Peer pull on the router side (``router/workers/peers.py``): the worth of a pulled block, which
blocks a candidate can pull, the ``kv_aware`` and ``ttft`` policies weighing a pull against a busy
holder, the config keys, the poller that reads the agents' states, the explain fields and the
metric through the in-process router, and one gateway over a real ``redis-server`` and two
``kvroute sim`` workers, whose agents' states and blocks the test writes into Redis itself.

Figures used throughout: blocks of 32 tokens, a 1,281-token prompt (40 creditable blocks: vLLM
computes the last token), prefill at the prior 0.1 ms per token (3.2 ms per block), a block of
1,000,000 bytes over a measured 1e9 bytes/s link (1 ms per block) plus 2 ms per pull, so one
40-block pull costs 42 ms and saves 1 - 1.05 / 3.2 = 0.671875 of each block's prefill."""
from __future__ import annotations

import asyncio
import uuid

import httpx
import orjson
import pytest

from conftest import ADMIN_TOKEN, wait_until
from kvcore.block_keys import block_keys
from kvcore.index.base import TierMatch
from kvcore.index.errors import IndexUnavailable
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex
from router.config.schema import ModelConfig, RoutingConfig, WorkerConfig
from router.estimates.peer_credit import (PeerInfo, PeerPricing, gbit_s_to_bytes_per_s, peer_blocks_by_worker,
                                          peer_credit_per_block)
from router.policies import Candidate, RouteRequest, WorkerLoad, describe, make_policy
from router.route.planner import PolicyHolder, Router
from router.route.prompt_blocks import TokenizerPool
from router.telemetry.metrics import GatewayMetrics
from router.workers.peers import PeerPoller, PeerTable
from router.workers.registry import WorkerRegistry
from test_gateway_e2e import running_two_sim_gateway

BS = 32
PROMPT = 40 * BS + 1  # 40 creditable blocks
FP = "ab12cd34"  # the KV layout's fingerprint: blocks move only between equal ones
FAST = {"serve": "10.0.0.2:7601", "pull": True, "block_bytes": 1_000_000, "block_size": BS, "fingerprint": FP,
        "link_bytes_per_s": 1e9, "pull_overhead_ms": 2.0, "pulls": 12, "pulled_blocks": 700, "failed_pulls": 1}
CREDIT_FAST = 1 - (1.0 + 2.0 / 40) / 3.2  # 0.671875
HOLDER = {"serve": "10.0.0.1:7601", "pull": False, "block_bytes": 1_000_000, "block_size": BS, "fingerprint": FP}
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# ---- the worth of one pulled block --------------------------------------------------------------
def test_peer_credit_per_block_values():
    # 1 ms transfer + 2 ms / 10 blocks per block against 0.1 ms x 32 tokens of prefill
    assert peer_credit_per_block(1_000_000, 1e9, 2.0, 10, 0.1, 32) == pytest.approx(1 - 1.2 / 3.2)
    assert peer_credit_per_block(1_000_000, 1e9, 2.0, 40, 0.1, 32) == pytest.approx(CREDIT_FAST)
    # the fixed cost weighs less per block the more blocks one pull carries
    assert peer_credit_per_block(1_000_000, 1e9, 2.0, 1, 0.1, 32) == pytest.approx(1 - 3.0 / 3.2)  # 1/16
    assert peer_credit_per_block(0, 1e9, 0.0, 5, 0.1, 32) == 1.0  # free: all of the prefill saved
    assert peer_credit_per_block(1_000_000, 1e8, 0.0, 40, 0.1, 32) == 0.0  # 10 ms a block: clamped
    assert peer_credit_per_block(1_000_000, 1e9, 2.0, 0, 0.1, 32) == 0.0  # nothing to pull
    # a slower prefill makes the same pull worth more: 1.05 ms of 6.4
    assert peer_credit_per_block(1_000_000, 1e9, 2.0, 40, 0.2, 32) == pytest.approx(1 - 1.05 / 6.4)
    assert gbit_s_to_bytes_per_s(10) == 1.25e9
    for args, name in [((1, 0.0, 0, 1, 0.1, 32), "link_bytes_per_s"), ((1, 1e9, 0, 1, 0.0, 32), "ms_per_token"),
                       ((1, 1e9, 0, 1, 0.1, 0), "block_size"), ((-1, 1e9, 0, 1, 0.1, 32), "block_bytes"),
                       ((1, 1e9, -2, 1, 0.1, 32), "pull_overhead_ms"),
                       ((float("nan"), 1e9, 0, 1, 0.1, 32), "block_bytes")]:
        with pytest.raises(ValueError, match=name):
            peer_credit_per_block(*args)


def test_pricing_sources_measured_prior_config_unknown():
    pricing = PeerPricing()  # priors: 10 Gbit/s, 1 ms per pull
    fast = PeerInfo.from_state({"peer": FAST})
    assert pricing.credit(fast, 40, 0.1, BS) == (pytest.approx(CREDIT_FAST), "measured")
    fresh = PeerInfo.from_state({"peer": {**FAST, "link_bytes_per_s": None, "pull_overhead_ms": None}})
    # 1e6 B at 1.25e9 B/s = 0.8 ms, + 1 ms / 40 blocks
    assert pricing.credit(fresh, 40, 0.1, BS) == (pytest.approx(1 - 0.825 / 3.2), "prior")
    assert PeerPricing(fixed_credit=0.5).credit(fresh, 40, 0.1, BS) == (0.5, "config")
    no_size = PeerInfo(pull=True)
    assert pricing.credit(no_size, 40, 0.1, BS) == (0.0, "unknown_block_bytes")
    assert pricing.credit(fast, 0, 0.1, BS) == (0.0, "")
    # the agent's block size is the one its block bytes refer to: 16-token blocks of 0.5 MB
    half = PeerInfo.from_state({"peer": {**FAST, "block_bytes": 500_000, "block_size": 16}})
    assert pricing.credit(half, 40, 0.1, BS)[0] == pytest.approx(1 - (0.5 + 0.05) / 1.6)


def test_peer_info_reads_the_published_state_and_ignores_bad_fields():
    info = PeerInfo.from_state({"worker": "w", "gaps": 0, "peer": {**FAST, "served": {"requests": 3}}})
    assert info.as_dict() == {**FAST, "skipping": []}
    # the agent's breaker (offload_agent.tier_service.PeerBreaker.state): skipped while open or trying
    broken = PeerInfo.from_state({"peer": {**FAST, "breakers": {
        "v": {"addr": "a:1", "failures": 2, "open_s": 1.5, "trying": False},
        "u": {"addr": "b:1", "failures": 1, "open_s": 0.0, "trying": True},
        "x": {"addr": "c:1", "failures": 3, "open_s": 0.0, "trying": False},  # its retry may go
        "y": {"open_s": True}, 7: {"open_s": 9}, "z": "open"}}})
    assert broken.skipping == {"v", "u"} and broken.as_dict()["skipping"] == ["u", "v"]
    assert PeerInfo.from_state({"worker": "w"}) is None  # an agent without peer pull
    assert PeerInfo.from_state({"peer": "yes"}) is None
    assert PeerInfo.from_state(None) is None
    odd = PeerInfo.from_state({"peer": {"serve": "", "pull": "true", "block_bytes": -5, "block_size": 0.5,
                                        "fingerprint": 7, "link_bytes_per_s": float("inf"), "pull_overhead_ms": True,
                                        "pulls": -1, "pulled_blocks": "7"}})
    assert odd == PeerInfo()  # every field as absent


def test_peer_blocks_are_the_best_other_servers_run_beyond_ones_own():
    peers = {"v": PeerInfo(serve="a:1"), "u": PeerInfo(serve="b:1", pull=True), "w": PeerInfo(pull=True),
             "x": PeerInfo(pull=False)}
    matches = {"v": TierMatch(gpu=30, cpu=10), "u": TierMatch(gpu=12), "w": TierMatch(gpu=5), "x": TierMatch()}
    cands = [(wid, matches.get(wid, TierMatch())) for wid in ("v", "u", "w", "x")]
    got = peer_blocks_by_worker(cands, matches, peers, creditable_blocks=40)
    # w pulls 40 - 5 from v (all of v's run, cpu part included); u 40 - 12; v is the best server
    # itself and takes the second (u, 12 < its own 40): nothing; x does not pull
    assert got == {"w": (35, "v"), "u": (28, "v")}
    # vLLM's cap: a 33-token prompt has 1 creditable block, whoever holds more
    assert peer_blocks_by_worker(cands, matches, peers, creditable_blocks=1) == {}
    assert peer_blocks_by_worker(cands, matches, peers, creditable_blocks=20) == {"w": (15, "v"), "u": (8, "v")}
    # a distrusted server is no peer: u then serves w
    assert peer_blocks_by_worker(cands, matches, peers, 40, distrusted=lambda wid: wid == "v") == {"w": (7, "u")}
    # no server: a worker that pulls but whose holder serves nothing
    assert peer_blocks_by_worker(cands, {"x": TierMatch(gpu=9)}, peers, 40) == {}
    # the agent pulls only between equal KV layouts: v of another fingerprint is no peer of w
    fp = {"v": PeerInfo(serve="a:1", fingerprint="f1"), "u": PeerInfo(serve="b:1", pull=True, fingerprint="f2"),
          "w": PeerInfo(pull=True, fingerprint="f2"), "x": PeerInfo(pull=True)}
    assert peer_blocks_by_worker(cands, matches, fp, 40) == {"w": (7, "u"), "x": (40, "v")}  # x: any layout
    # the best server's ties go to the lower worker id
    # a server the puller's agent skips after failed pulls (its breaker) is no peer of that puller
    # (the next best serves it), and still one of the others
    skip = {**peers, "w": PeerInfo(pull=True, skipping=frozenset({"v"}))}
    assert peer_blocks_by_worker(cands, matches, skip, 40) == {"w": (7, "u"), "u": (28, "v")}
    tie = {"b": TierMatch(gpu=9), "a": TierMatch(gpu=9)}
    assert peer_blocks_by_worker([("w", TierMatch())], tie, {"a": PeerInfo(serve="a:1"), "b": PeerInfo(serve="b:1"),
                                                            "w": PeerInfo(pull=True)}, 40) == {"w": (9, "a")}


# ---- the policies: a busy holder v and an idle puller w -----------------------------------------
def _candidates(puller: dict | None, holder_queue_tokens: int = 1000) -> list[Candidate]:
    """v holds all 40 blocks in its GPU and has ``holder_queue_tokens`` of prefill queued (one
    request in flight); w is idle, holds nothing and, when its agent says ``puller``, pulls."""
    peers = {"v": PeerInfo.from_state({"peer": HOLDER})}
    if puller is not None:
        peers["w"] = PeerInfo.from_state({"peer": puller})
    matches = {"v": TierMatch(gpu=40)}
    cands = [Candidate("v", WorkerLoad(in_flight=1, prefill_tokens=holder_queue_tokens), matches["v"]),
             Candidate("w", WorkerLoad(), TierMatch())]
    supply = peer_blocks_by_worker([(c.worker_id, c.matched) for c in cands], matches, peers, (PROMPT - 1) // BS)
    for c in cands:
        c.peer = peers.get(c.worker_id)
        c.peer_blocks, c.peer_worker = supply.get(c.worker_id, (0, None))
    return cands


REQ = RouteRequest(model="tiny", prompt_tokens=PROMPT, block_size=BS, num_blocks=40)


def _scores(decision) -> dict:
    return {s.worker_id: s for s in decision.scores}


def test_kv_aware_sends_to_the_idle_puller_only_when_the_pull_pays():
    policy = make_policy({"name": "kv_aware"})
    d = policy.choose(REQ, _candidates(FAST))
    # v: 0 uncredited + (1000 + 1 x 128) / 32 = 35.25; w: 40 - 40 x 0.671875 = 13.125
    assert (d.worker_id, d.reason) == ("w", "peer_pull")
    s = _scores(d)
    assert s["w"].cost == pytest.approx(40 - 40 * CREDIT_FAST) and s["v"].cost == pytest.approx(35.25)
    assert (s["w"].peer_blocks, s["w"].peer_worker, s["w"].peer_credit_source) == (40, "v", "measured")
    assert s["w"].peer_credit == pytest.approx(CREDIT_FAST) and s["v"].peer_blocks == 0
    # w's connector does not pull: it would compute all 40 blocks (cost 40): v
    d = policy.choose(REQ, _candidates({**FAST, "pull": False}))
    assert (d.worker_id, d.reason) == ("v", "prefix_hit") and _scores(d)["w"].peer_blocks == 0
    # a slow link (10 ms a block) saves nothing: v
    d = policy.choose(REQ, _candidates({**FAST, "link_bytes_per_s": 1e8}))
    assert d.worker_id == "v" and _scores(d)["w"].cost == 40.0
    assert (_scores(d)["w"].peer_blocks, _scores(d)["w"].peer_credit) == (40, 0.0)
    # no agent state at all for w
    assert policy.choose(REQ, _candidates(None)).worker_id == "v"


def test_kv_aware_peer_weight_fixed_by_config():
    half = make_policy({"name": "kv_aware", "tier_credit": {"peer": 0.5}})
    d = half.choose(REQ, _candidates({**FAST, "link_bytes_per_s": 1e8}))  # the measurement is ignored
    s = _scores(d)["w"]
    assert (d.worker_id, s.cost, s.peer_credit, s.peer_credit_source) == ("w", 20.0, 0.5, "config")
    zero = make_policy({"name": "kv_aware", "tier_credit": {"peer": 0.0}})
    assert zero.choose(REQ, _candidates(FAST)).worker_id == "v"


def test_ttft_prediction_includes_the_pull_and_the_puller_wins():
    policy = make_policy({"name": "ttft", "recompute_weight": 1, "private_recompute_weight": 1})
    d = policy.choose(REQ, _candidates(FAST))
    s = _scores(d)
    # v: 25 + 0.1 x (1000 queued + 1 own) = 125.1 ms
    assert s["v"].predicted_ttft_ms == pytest.approx(125.1)
    # w: 25 ms + the last token 0.1 ms + the pull, 40 blocks x (1 ms + 2 ms / 40) = 42 ms
    assert s["w"].predicted_ttft_ms == pytest.approx(25 + 0.1 * 1 + 40 * (1.0 + 2.0 / 40)) == pytest.approx(67.1)
    assert s["w"].work_tokens == pytest.approx(PROMPT - 40 * BS * CREDIT_FAST)
    # rank: 67.1 + 0.1 x (1280 - 860) recomputed beyond v's credit = 109.1 < 125.1
    assert (d.worker_id, d.reason) == ("w", "peer_pull")
    assert d.scores[0].as_dict() == {
        "worker": "w", "matched_blocks": {"gpu": 0, "cpu": 0, "ssd": 0}, "load": 0.0,
        "cost": pytest.approx(67.1), "note": "", "predicted_ttft_ms": 67.1, "peer_blocks": 40,
        "peer_worker": "v", "peer_credit": 0.6719, "peer_credit_source": "measured"}
    assert "peer_blocks" not in d.scores[1].as_dict()
    # without the pull w computes all of it: 25 + 128.1 ms, ranked + 128 ms more: v
    for puller in ({**FAST, "pull": False}, {**FAST, "link_bytes_per_s": 1e8}):
        d = policy.choose(REQ, _candidates(puller))
        assert d.worker_id == "v" and _scores(d)["w"].predicted_ttft_ms == pytest.approx(153.1)
    # a holder with little queued keeps the request: 25 + 0.1 x 201 = 45.1 ms < 109.1
    assert policy.choose(REQ, _candidates(FAST, holder_queue_tokens=200)).worker_id == "v"


def test_ttft_prior_link_until_measured_and_its_config_key():
    fresh = {**FAST, "link_bytes_per_s": None, "pull_overhead_ms": None}
    d = make_policy({"name": "ttft"}).choose(REQ, _candidates(fresh))
    s = _scores(d)["w"]
    # 10 Gbit/s: 0.8 ms a block, + 1 ms per pull
    assert s.peer_credit_source == "prior" and s.peer_credit == pytest.approx(1 - 0.825 / 3.2)
    assert s.predicted_ttft_ms == pytest.approx(25.1 + 40 * 0.8 + 1.0)
    slow = make_policy({"name": "ttft", "peer_link_gbit_s": 1, "peer_pull_overhead_ms": 5})
    s = _scores(slow.choose(REQ, _candidates(fresh)))["w"]
    assert s.peer_credit_source == "prior" and s.peer_credit == 0.0  # 8 ms a block of 3.2 ms
    fixed = make_policy({"name": "ttft", "tier_credit": {"peer": 1.0}})
    s = _scores(fixed.choose(REQ, _candidates(fresh)))["w"]
    assert (s.peer_credit, s.peer_credit_source, s.predicted_ttft_ms) == (1.0, "config", pytest.approx(25.1))


def test_peer_config_keys_validate_and_round_trip():
    for name in ("ttft", "kv_aware"):
        plain = describe(make_policy({"name": name}))
        assert "peer" not in plain["tier_credit"] and "peer_link_gbit_s" not in plain  # unchanged when unset
        cfg = describe(make_policy({"name": name, "tier_credit": {"peer": 0.4}, "peer_link_gbit_s": 25,
                                    "peer_pull_overhead_ms": 0.5}))
        assert cfg["tier_credit"] == {"gpu": 1.0, "cpu": 0.75, "ssd": 0.25, "peer": 0.4}
        assert (cfg["peer_link_gbit_s"], cfg["peer_pull_overhead_ms"]) == (25.0, 0.5)
        assert describe(make_policy(cfg)) == cfg
    for bad, message in [({"tier_credit": {"peer": 1.5}}, "policy.tier_credit.peer must be between 0 and 1, got 1.5"),
                         ({"tier_credit": {"peer": "high"}}, "policy.tier_credit.peer must be a finite number"),
                         ({"peer_link_gbit_s": 0}, "policy.peer_link_gbit_s must be > 0, got 0"),
                         ({"peer_link_gbit_s": -3}, "policy.peer_link_gbit_s must be >= 0, got -3"),
                         ({"peer_pull_overhead_ms": -1}, "policy.peer_pull_overhead_ms must be >= 0, got -1"),
                         ({"peer_link_gbps": 10}, "unknown key(s) 'peer_link_gbps'")]:
        for name in ("ttft", "kv_aware"):
            with pytest.raises(ValueError) as exc:
                make_policy({"name": name, **bad})
            assert message in str(exc.value)


# ---- the poller ---------------------------------------------------------------------------------
class _States:
    """A stand-in shared index: ``worker_states()`` answers, fails or hangs as told."""

    def __init__(self) -> None:
        self.answer: dict | Exception | None = {}
        self.calls = 0
        self.called = asyncio.Event()

    async def worker_states(self) -> dict:
        self.calls += 1
        self.called.set()
        if self.answer is None:
            await asyncio.Event().wait()  # hangs
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_poller_keeps_the_table_and_survives_failures_and_hangs():
    now = [100.0]
    table = PeerTable(stale_after_s=10, clock=lambda: now[0])
    index = _States()
    poller = PeerPoller(index, table, interval_s=0.01, timeout_s=0.05)
    index.answer = {"w": {"peer": FAST}, "v": {"worker": "v"}}
    assert await poller.poll_once() is True
    assert set(table.current()) == {"w"} and table.get("w").link_bytes_per_s == 1e9
    index.answer = IndexUnavailable("redis down")
    assert await poller.poll_once() is False
    assert table.get("w") is not None and table.failures == 1 and "redis down" in table.last_error
    now[0] += 11  # no success for longer than stale_after_s: the figures are not used
    assert table.current() == {} and table.get("w") is None
    index.answer = None  # a poll that never answers is cut at timeout_s
    assert await poller.poll_once() is False and "TimeoutError" in table.last_error
    # the task: polls again and again, never ends on a failure, stops when told
    index.answer = {"w": {"peer": {**FAST, "pulls": 13}}}
    poller.start()
    await asyncio.wait_for(_until(lambda: table.get("w") is not None and table.get("w").pulls == 13), 5)
    index.answer = ["not", "a", "mapping"]  # a bad answer: counted, the loop goes on
    calls = index.calls
    await asyncio.wait_for(_until(lambda: index.calls > calls + 2), 5)
    assert not poller._task.done()
    await asyncio.wait_for(poller.stop(), 5)
    calls = index.calls
    await asyncio.sleep(0.05)
    assert index.calls == calls  # stopped


async def _until(check) -> None:
    while not check():
        await asyncio.sleep(0.01)


# ---- the in-process router: candidates, explain, uncached tokens, metric ------------------------
@pytest.fixture
async def rig(tiny_model):
    model = ModelConfig(name="tiny", tokenizer=str(tiny_model), block_size=BS)
    pool = TokenizerPool([model], threads=1)
    await pool.load()
    registry = WorkerRegistry()
    for wid in ("v", "w"):
        registry.add(WorkerConfig(id=wid, url=f"http://127.0.0.1:1/{wid}", model="tiny")).healthy = True
    index = MemoryIndex()
    metrics = GatewayMetrics(registry.all)
    peers = PeerTable()
    metrics.watch_peer_links(peers.current)
    router = Router([model], pool, index, registry, PolicyHolder({"name": "ttft", "recompute_weight": 1,
                                                                                "private_recompute_weight": 1}), metrics,
                    RoutingConfig(), peers)
    yield router, registry, index, peers
    pool.close()


def _tokens(n: int = PROMPT, seed: int = 0) -> list[int]:
    return [(i * 7 + seed) % 300 + 5 for i in range(n)]


async def test_router_puts_peer_blocks_on_candidates_and_explains_them(rig):
    router, registry, index, peers = rig
    tokens = _tokens()
    await index.store("v", "gpu", block_keys(tokens, BS, "tiny")[:30])
    await index.store("v", "cpu", block_keys(tokens, BS, "tiny")[30:])  # all 40, cpu for the last 10
    peers.update({"v": {"peer": HOLDER}, "w": {"peer": FAST}, "gone": {"worker": "gone"}})
    busy = registry.get("v").begin(1000)  # 1000 tokens of prefill queued on the holder
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 1}
    plan = await router.plan("completion", body, [], orjson.dumps(body), explain=True)
    out = plan.explain()
    assert (out["chosen"], out["reason"], out["blocks"], out["prompt_tokens"]) == ("w", "peer_pull", 40, PROMPT)
    w = out["candidates"][0]
    assert (w["worker"], w["peer_blocks"], w["peer_worker"], w["peer_credit_source"]) == ("w", 40, "v", "measured")
    assert w["peer_credit"] == 0.6719 and w["predicted_ttft_ms"] == pytest.approx(67.1)
    assert out["candidates"][1]["worker"] == "v" and "peer_blocks" not in out["candidates"][1]
    assert out["predicted_cached_tokens"] == 40 * BS  # vLLM reports pulled tokens as cached (source p2p)
    # the puller's load counts the pull's share of the prefill: 1281 - 40 x 32 x 0.671875
    assert plan.uncached_tokens("w") == PROMPT - 860 and plan.uncached_tokens("v") == 1
    real = await router.plan("completion", body, [], orjson.dumps(body))
    router.record_decision(real)
    text = router.metrics.exposition().decode()
    assert 'kvroute_peer_credit_blocks_total{worker="w"} 40.0' in text
    assert 'kvroute_worker_peer_link_bytes_per_second{worker="w"} 1e+09' in text
    assert 'kvroute_route_decisions_total{policy="ttft",reason="peer_pull"} 1.0' in text
    # a holder whose evidence the gateway distrusts is no peer; nor is one whose agent stopped serving
    registry.get("v").evidence.trusted = False
    plan = await router.plan("completion", body, [], orjson.dumps(body), explain=True)
    assert all("peer_blocks" not in c for c in plan.explain()["candidates"])
    registry.get("v").evidence.trusted = True
    # the puller's agent skips v after failed pulls: no credit from it until the agent retries
    peers.update({"v": {"peer": HOLDER}, "w": {"peer": {**FAST, "breakers": {
        "v": {"addr": HOLDER["serve"], "failures": 1, "open_s": 0.8, "trying": False}}}}})
    plan = await router.plan("completion", body, [], orjson.dumps(body), explain=True)
    assert plan.decision.worker_id == "v" and all("peer_blocks" not in c for c in plan.explain()["candidates"])
    peers.update({"v": {"peer": HOLDER}, "w": {"peer": {**FAST, "breakers": {
        "v": {"addr": HOLDER["serve"], "failures": 1, "open_s": 0.0, "trying": False}}}}})
    plan = await router.plan("completion", body, [], orjson.dumps(body), explain=True)
    assert plan.decision.worker_id == "w" and plan.explain()["candidates"][0]["peer_blocks"] == 40
    peers.update({"v": {"peer": {**HOLDER, "serve": None}}, "w": {"peer": FAST}})
    plan = await router.plan("completion", body, [], orjson.dumps(body), explain=True)
    assert plan.decision.worker_id == "v" and all("peer_blocks" not in c for c in plan.explain()["candidates"])
    busy.finish()


# ---- a gateway over a real redis-server ---------------------------------------------------------
def test_gateway_over_redis_credits_the_peer_and_explains_it(tmp_path_factory, tiny_model, redis_url):
    """Workers w0, w1 (sims) behind a gateway on a Redis index. w9, a worker of another gateway,
    holds the prompt (30 blocks in its GPU, 10 in its CPU tier) and serves it; w0 and w1 pull,
    w0 over a slow link (1 ms per kB), w1 over a fast one. The test writes the blocks and the
    agents' states into Redis as the agents would."""
    namespace = f"peer{uuid.uuid4().hex[:8]}"
    tokens = _tokens(seed=3)
    keys = block_keys(tokens, BS, "tiny")
    states = {"w9": {"worker": "w9", "peer": {**HOLDER, "serve": "127.0.0.1:7609"}},
              "w0": {"worker": "w0", "peer": {**FAST, "serve": "127.0.0.1:7600", "link_bytes_per_s": 1e6}},
              "w1": {"worker": "w1", "peer": {**FAST, "serve": "127.0.0.1:7601"}}}

    async def publish(states: dict, blocks: bool) -> None:
        idx = RedisIndex(redis_url, namespace=namespace, heartbeat_ttl_s=600, socket_timeout_s=5)
        try:
            if blocks:
                await idx.store("w9", "gpu", keys[:30])
                await idx.store("w9", "cpu", keys[30:])
            for worker, state in states.items():
                await idx.heartbeat(worker, ttl_s=600, state=state)
        finally:
            await idx.close()

    asyncio.run(publish(states, blocks=True))
    index_cfg = {"backend": "redis", "url": redis_url, "namespace": namespace}
    with running_two_sim_gateway(tmp_path_factory, tiny_model, "peer", index=index_cfg) as (base, _, _):
        body = {"model": "tiny", "prompt": tokens, "max_tokens": 1}

        def explain() -> dict:
            r = httpx.post(base + "/admin/explain", headers=AUTH, json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        def candidates_when(ready) -> dict:
            def check():
                out = explain()
                by = {c["worker"]: c for c in out["candidates"]}
                return (out, by) if ready(by) else None
            return wait_until(check, timeout_s=30, what="the gateway to see the agents' peer states")

        out, by = candidates_when(lambda by: by["w1"].get("peer_blocks") == 40 and "peer_blocks" in by["w0"])
        assert (out["chosen"], out["reason"], out["prompt_tokens"], out["blocks"]) == ("w1", "peer_pull", PROMPT, 40)
        assert {k: by["w1"][k] for k in ("peer_blocks", "peer_worker", "peer_credit", "peer_credit_source")} == {
            "peer_blocks": 40, "peer_worker": "w9", "peer_credit": 0.6719, "peer_credit_source": "measured"}
        assert by["w1"]["predicted_ttft_ms"] == pytest.approx(67.1)
        assert by["w1"]["matched_blocks"] == {"gpu": 0, "cpu": 0, "ssd": 0}
        # w0's link makes a block cost 1 s to pull: no credit, it would compute the whole prompt
        assert (by["w0"]["peer_blocks"], by["w0"]["peer_credit"], by["w0"]["peer_credit_source"]) == (40, 0.0,
                                                                                                   "measured")
        assert by["w0"]["predicted_ttft_ms"] == pytest.approx(25 + 0.1 * PROMPT)
        workers = {w["id"]: w for w in httpx.get(base + "/admin/workers", headers=AUTH, timeout=10).json()["workers"]}
        assert workers["w1"]["peer"] == {**FAST, "serve": "127.0.0.1:7601", "skipping": []}
        assert workers["w0"]["peer"]["link_bytes_per_s"] == 1e6
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert 'kvroute_worker_peer_link_bytes_per_second{worker="w1"} 1e+09' in metrics
        # a fixed weight from the config: both pullers get it
        r = httpx.put(base + "/admin/policy", headers=AUTH, json={"name": "ttft", "tier_credit": {"peer": 0.25}})
        assert r.status_code == 200 and r.json()["tier_credit"]["peer"] == 0.25
        by = {c["worker"]: c for c in explain()["candidates"]}
        for w in ("w0", "w1"):
            assert (by[w]["peer_credit"], by[w]["peer_credit_source"]) == (0.25, "config")
            assert by[w]["predicted_ttft_ms"] == pytest.approx(25 + 0.1 * (PROMPT - 40 * BS * 0.25))
        assert httpx.put(base + "/admin/policy", headers=AUTH, json={"name": "ttft"}).status_code == 200
        # w1's connector stops pulling: it gets no peer blocks, w0 keeps its (worthless) ones
        asyncio.run(publish({"w1": {"worker": "w1", "peer": {**FAST, "pull": False}}}, blocks=False))
        out, by = candidates_when(lambda by: "peer_blocks" not in by["w1"])
        assert by["w0"]["peer_blocks"] == 40 and by["w0"]["peer_credit"] == 0.0
        assert out["reason"] != "peer_pull"
        assert [c["predicted_ttft_ms"] for c in out["candidates"]] == [pytest.approx(25 + 0.1 * PROMPT)] * 2
