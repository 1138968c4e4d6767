"""Routing policies: real decisions and costs for constructed candidates (pure unit tests).

Block size 16 throughout, so with the default load model one in-flight request weighs
128 / 16 = 8 blocks and each 16 predicted prefill tokens weigh 1 block.
"""
from __future__ import annotations

import threading
from collections import Counter

import pytest

from kvcore.index.base import TierMatch
from router.policies.base import Candidate, CandidateScore, Decision, RouteRequest, WorkerLoad
from router.policies.factory import POLICY_NAMES, describe, make_policy
from router.policies.session import SessionPolicy
from router.policies.ttft import TTFTPolicy

BS = 16


def cand(worker: str, gpu: int = 0, cpu: int = 0, ssd: int = 0, in_flight: int = 0,
         prefill_tokens: int = 0, decoding: int = 0, running: int | None = None,
         waiting: int | None = None) -> Candidate:
    return Candidate(worker, WorkerLoad(in_flight=in_flight, prefill_tokens=prefill_tokens,
                                        decoding=decoding, engine_running=running,
                                        engine_waiting=waiting),
                     TierMatch(gpu=gpu, cpu=cpu, ssd=ssd))


def req(num_blocks: int, rand: float = 0.0, model: str = "tiny", session_key: str | None = None,
        tokens: bool = True) -> RouteRequest:
    return RouteRequest(model=model, prompt_tokens=num_blocks * BS + 5 if tokens else None,
                        block_size=BS, num_blocks=num_blocks, session_key=session_key, rand=rand)


def costs(decision) -> dict[str, float | None]:
    return {s.worker_id: s.cost for s in decision.scores}


# ---- kv_aware ---------------------------------------------------------------------------------

def test_prefix_holder_wins_over_empty_worker():
    d = make_policy({"name": "kv_aware"}).choose(req(10), [cand("w0"), cand("w1", gpu=6)])
    assert d.worker_id == "w1"
    assert d.reason == "prefix_hit"
    assert d.ranked_worker_ids() == ["w1", "w0"]
    assert costs(d) == {"w1": 4.0, "w0": 10.0}
    assert d.scores[0].matched.gpu == 6


def test_gpu_beats_cpu_beats_ssd_with_default_credits():
    policy = make_policy({"name": "kv_aware"})
    holders = [cand("w_ssd", ssd=8), cand("w_cpu", cpu=8), cand("w_gpu", gpu=8)]
    d = policy.choose(req(10), holders)
    assert d.ranked_worker_ids() == ["w_gpu", "w_cpu", "w_ssd"]
    # 10 blocks minus 8 x 1.0 / 8 x 0.75 / 8 x 0.25
    assert costs(d) == {"w_gpu": 2.0, "w_cpu": 4.0, "w_ssd": 8.0}
    d = policy.choose(req(10), holders[:2] + [cand("w_none")])
    assert (d.worker_id, d.reason) == ("w_cpu", "prefix_hit")
    assert costs(d) == {"w_cpu": 4.0, "w_ssd": 8.0, "w_none": 10.0}


def test_mixed_tiers_and_credit_capped_at_prompt_blocks():
    policy = make_policy({"name": "kv_aware", "tier_credit": {"gpu": 1.0, "cpu": 0.5, "ssd": 0.0}})
    d = policy.choose(req(10), [cand("w0", gpu=2, cpu=4, ssd=4), cand("w1", gpu=12)])
    assert costs(d) == {"w0": 6.0, "w1": 0.0}  # 10 - (2 + 2 + 0); w1's credit capped at 10
    assert d.worker_id == "w1"


def test_load_outweighs_a_small_prefix_but_not_a_large_one():
    policy = make_policy({"name": "kv_aware"})
    # w0: one request in flight with 160 tokens still to prefill: 10 + 8 = 18 blocks of load.
    busy = dict(in_flight=1, prefill_tokens=160)
    d = policy.choose(req(20), [cand("w0", gpu=2, **busy), cand("w1")])
    assert (d.worker_id, d.reason) == ("w1", "load")
    assert costs(d) == {"w1": 20.0, "w0": 18.0 + 18.0}
    assert [s.load for s in d.scores] == [0.0, 18.0]
    d = policy.choose(req(20), [cand("w0", gpu=20, **busy), cand("w1")])
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")
    assert costs(d) == {"w0": 18.0, "w1": 20.0}
    # load_weight scales the load term: a 10-block hit loses at weight 1, wins at 0.5
    mid = [cand("w0", gpu=10, **busy), cand("w1")]
    d = policy.choose(req(20), mid)
    assert (d.worker_id, costs(d)) == ("w1", {"w1": 20.0, "w0": 10.0 + 18.0})
    d = make_policy({"name": "kv_aware", "load_weight": 0.5}).choose(req(20), mid)
    assert (d.worker_id, costs(d)) == ("w0", {"w0": 10.0 + 9.0, "w1": 20.0})


GUARD_8K = {"name": "kv_aware", "overload_guard": {"excess_tokens": 8192}}


def test_overload_guard_skips_hot_holder():
    # w0 holds the whole 1000-block prompt but has 80 requests in flight: 80 x 8 = 640 blocks,
    # 632 blocks = 10112 tokens above w1 (> 8192) and more than 1.5 x w1's 8 blocks.
    cands = [cand("w0", gpu=1000, in_flight=80, decoding=80), cand("w1", in_flight=1, decoding=1)]
    d = make_policy(GUARD_8K).choose(req(1000), cands)
    assert (d.worker_id, d.reason) == ("w1", "overload_guard")
    assert d.ranked_worker_ids() == ["w1", "w0"]
    assert costs(d) == {"w1": 1008.0, "w0": 640.0}
    assert [s.note for s in d.scores] == ["", "overloaded"]
    off = make_policy({"name": "kv_aware", "overload_guard": {"enabled": False}})
    d = off.choose(req(1000), cands)
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")
    # the default guard (32768 tokens of excess) lets this 10112-token excess through
    assert make_policy({"name": "kv_aware"}).choose(req(1000), cands).worker_id == "w0"
    # ... but not a 64000-token hit behind 300 requests: 2400 blocks (38400 tokens) of load,
    # 38272 tokens above w1, though its cost 2400 beats w1's 4008
    hot = [cand("w0", gpu=4000, in_flight=300, decoding=300), cand("w1", in_flight=1, decoding=1)]
    d = make_policy({"name": "kv_aware"}).choose(req(4000), hot)
    assert (d.worker_id, d.reason, costs(d)) == ("w1", "overload_guard", {"w1": 4008.0, "w0": 2400.0})


def test_overload_guard_spreads_a_hot_prefix_burst():
    """200 requests sharing a 1000-block prefix held only by w0, none finishing; each routed
    request adds 8 blocks of load to its worker."""
    def burst(policy) -> tuple[Counter, list[str]]:
        in_flight = Counter()
        reasons = []
        for _ in range(200):
            cands = [cand(w, gpu=1000 if w == "w0" else 0, in_flight=in_flight[w],
                          decoding=in_flight[w]) for w in ("w0", "w1", "w2")]
            d = policy.choose(req(1000), cands)
            in_flight[d.worker_id] += 1
            reasons.append(d.reason)
        return in_flight, reasons

    guarded, reasons = burst(make_policy(GUARD_8K))
    # w0 takes 65 in a row (65 x 8 = 520 blocks > 512 = 8192 tokens of excess), then the guard
    # sends the 66th elsewhere.
    assert reasons[:65] == ["prefix_hit"] * 65
    assert reasons[65] == "overload_guard"
    unguarded, _ = burst(make_policy({"name": "kv_aware", "overload_guard": None}))
    # without the guard w0 keeps everything until its load (8 per request) reaches the 1000-block
    # prefix credit: 125 requests, then shares only beyond that.
    assert unguarded["w0"] == 125 + min(unguarded["w1"], unguarded["w2"])
    assert guarded["w0"] < unguarded["w0"]
    assert guarded["w1"] + guarded["w2"] > unguarded["w1"] + unguarded["w2"]
    assert sum(guarded.values()) == 200


def test_cost_ties_go_to_lower_load_then_worker_order():
    policy = make_policy({"name": "kv_aware"})
    # w1: 18 cached of 20, load 8 -> 2 + 8 = 10; w0: 10 cached, idle -> 10. Same cost.
    d = policy.choose(req(20), [cand("w1", gpu=18, in_flight=1, decoding=1), cand("w0", gpu=10)])
    assert costs(d) == {"w0": 10.0, "w1": 10.0}
    assert (d.worker_id, d.reason) == ("w0", "load")
    # equal cost and load: worker-id order, request.rand choosing among the equals
    same = [cand("w2"), cand("w0"), cand("w1")]
    assert policy.choose(req(4, rand=0.0), same).worker_id == "w0"
    assert policy.choose(req(4, rand=0.5), same).worker_id == "w1"
    assert policy.choose(req(4, rand=0.99), same).worker_id == "w2"
    assert policy.choose(req(4, rand=0.5), same).ranked_worker_ids() == ["w1", "w0", "w2"]


def test_temperature_samples_by_rand():
    policy = make_policy({"name": "kv_aware", "temperature": 1.0})
    cands = [cand("w2"), cand("w1", gpu=5), cand("w0", gpu=10)]  # costs 10, 5, 0
    # weights exp(0), exp(-0.5), exp(-1): cumulative shares 0.507, 0.814, 1
    picks = {r: policy.choose(req(10, rand=r), cands) for r in (0.1, 0.5, 0.6, 0.8, 0.9)}
    assert {r: d.worker_id for r, d in picks.items()} == {
        0.1: "w0", 0.5: "w0", 0.6: "w1", 0.8: "w1", 0.9: "w2"}
    assert [picks[r].reason for r in (0.1, 0.6, 0.9)] == ["prefix_hit", "temperature", "temperature"]
    assert picks[0.9].ranked_worker_ids() == ["w2", "w0", "w1"]
    spread = Counter(policy.choose(req(10, rand=i / 1000), cands).worker_id for i in range(1000))
    assert spread == {"w0": 507, "w1": 307, "w2": 186}
    cold = make_policy({"name": "kv_aware"})
    assert {cold.choose(req(10, rand=r / 10), cands).worker_id for r in range(10)} == {"w0"}


def test_no_tokens_routes_by_load():
    policy = make_policy({"name": "kv_aware"})
    d = policy.choose(req(10, tokens=False), [cand("w0", gpu=10, in_flight=1), cand("w1")])
    assert (d.worker_id, d.reason) == ("w1", "no_tokens")
    assert costs(d) == {"w1": 0.0, "w0": 8.0}


def test_load_figure_uses_engine_scrape():
    policy = make_policy({"name": "least_load"})
    # requests = max(in_flight 2, running 3 + waiting 2) = 5 -> 5 x 128 tokens;
    # waiting not sent by us = 2 - (2 in flight - 1 decoding) = 1 -> 1024 tokens; plus 320 prefill.
    scraped = cand("w0", in_flight=2, prefill_tokens=320, decoding=1, running=3, waiting=2)
    d = policy.choose(req(4), [scraped, cand("w1", in_flight=15)])
    assert costs(d) == {"w0": (320 + 1024 + 5 * 128) / 16, "w1": 15 * 8.0}
    assert (d.worker_id, d.reason) == ("w1", "load")  # 120 < 124 blocks
    tuned = make_policy({"name": "least_load", "decode_tokens_per_request": 0,
                         "engine_waiting_prefill_tokens": 0})
    assert costs(tuned.choose(req(4), [scraped]))["w0"] == 20.0


# ---- least_load, round_robin, session ---------------------------------------------------------

def test_least_load_picks_lowest_and_ranks_all():
    d = make_policy({"name": "least_load"}).choose(
        req(4), [cand("w0", in_flight=2), cand("w1", prefill_tokens=64), cand("w2", in_flight=1)])
    assert (d.worker_id, d.reason) == ("w1", "load")
    assert d.ranked_worker_ids() == ["w1", "w2", "w0"]
    assert [s.load for s in d.scores] == [4.0, 8.0, 16.0]


def test_round_robin_cycles_per_model():
    policy = make_policy({"name": "round_robin"})
    cands = [cand("w2"), cand("w0"), cand("w1", in_flight=9)]
    picks = [policy.choose(req(1), cands) for _ in range(6)]
    assert [d.worker_id for d in picks] == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert picks[1].ranked_worker_ids() == ["w1", "w2", "w0"]
    assert {d.reason for d in picks} == {"round_robin"}
    assert picks[0].scores[0].cost is None
    assert policy.choose(req(1, model="other"), cands).worker_id == "w0"  # own counter
    assert policy.choose(req(1), cands[:2]).worker_id == "w0"  # 7th turn over [w0, w2]


def test_round_robin_turns_are_not_lost_across_threads():
    policy = make_policy({"name": "round_robin"})
    cands = [cand("w0"), cand("w1"), cand("w2")]
    counts = Counter()
    lock = threading.Lock()

    def run() -> None:
        local = Counter(policy.choose(req(1), cands).worker_id for _ in range(900))
        with lock:
            counts.update(local)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert counts == {"w0": 1200, "w1": 1200, "w2": 1200}


def test_session_is_sticky_and_survives_membership_changes():
    policy = make_policy({"name": "session"})
    three = [cand("w0"), cand("w1"), cand("w2")]
    keys = [f"user-{i}" for i in range(300)]
    home = {k: policy.choose(req(4, session_key=k), three).worker_id for k in keys}
    assert set(Counter(home.values())) == {"w0", "w1", "w2"}
    assert min(Counter(home.values()).values()) > 60  # spread, about 100 each
    # load does not move a session
    busy = [cand("w0", in_flight=50), cand("w1", in_flight=50), cand("w2", in_flight=50)]
    d = policy.choose(req(4, session_key="user-7"), busy)
    assert (d.worker_id, d.reason) == (home["user-7"], "session")
    # a worker joins: keys either stay or move to the newcomer, never between old workers
    four = three + [cand("w3")]
    after_add = {k: policy.choose(req(4, session_key=k), four).worker_id for k in keys}
    moved = [k for k in keys if after_add[k] != home[k]]
    assert moved and all(after_add[k] == "w3" for k in moved)
    assert len(moved) < 120  # about a quarter
    # a worker leaves: only its keys move, each to its own second choice
    without_w1 = [c for c in three if c.worker_id != "w1"]
    for k in keys:
        d = policy.choose(req(4, session_key=k), without_w1)
        if home[k] != "w1":
            assert d.worker_id == home[k]
        else:
            second = policy.choose(req(4, session_key=k), three).ranked_worker_ids()[1]
            assert d.worker_id == second


def test_session_without_key_falls_back_to_least_load():
    policy = make_policy({"name": "session"})
    d = policy.choose(req(4), [cand("w0", in_flight=1), cand("w1")])
    assert (d.worker_id, d.reason) == ("w1", "load")
    d = policy.choose(req(4, session_key=""), [cand("w0"), cand("w1", in_flight=1)])
    assert (d.worker_id, d.reason) == ("w0", "load")


# ---- factory ----------------------------------------------------------------------------------

def test_factory_names_flags_and_describe_round_trip():
    assert POLICY_NAMES == ("ttft", "kv_aware", "round_robin", "least_load", "session")
    assert [make_policy({"name": n}).uses_index for n in POLICY_NAMES] == [True, True, False, False, False]
    assert isinstance(make_policy(None), TTFTPolicy)
    assert isinstance(make_policy({}), TTFTPolicy)
    assert isinstance(make_policy({"name": "ttft"}), TTFTPolicy)
    cfg = {"name": "kv_aware", "tier_credit": {"cpu": 0.5}, "load_weight": 2,
           "temperature": 0.1, "overload_guard": {"excess_tokens": 4096}}
    p = make_policy(cfg)
    assert describe(p) == {
        "name": "kv_aware", "tier_credit": {"gpu": 1.0, "cpu": 0.5, "ssd": 0.25},
        "load_weight": 2.0, "temperature": 0.1,
        "overload_guard": {"enabled": True, "excess_tokens": 4096.0, "ratio": 1.5},
        "decode_tokens_per_request": 128.0, "engine_waiting_prefill_tokens": 1024.0,
        "queue": {"enabled": False, "worker_prefills": 2, "holder_prefills": 2, "worker_queue_ms": 0.0,
                  "settle_ms": 50.0, "affinity": "policy",
                  "affinity_wait_s": 2.0, "max_wait_s": 10.0, "rematch_ms": 200.0},
        "pd": {"enabled": False, "models": [], "min_prefill_tokens": 256, "prefill_timeout_s": None}}
    q = make_policy({"name": "round_robin", "queue": {"enabled": True, "affinity_wait_s": 0.5}}).queue
    assert (q.enabled, q.affinity_wait_s, q.worker_queue_ms, q.max_wait_s) == (True, 0.5, 0.0, 10.0)
    assert not make_policy({"name": "ttft", "queue": {"enabled": False}}).queue.enabled
    for bad in ({"enabled": "yes"}, {"worker_queue_ms": -1}, {"settle_ms": -5}, {"affinity": "sticky"}, {"bogus": 1}, [1],
                {"worker_prefills": 0}, {"worker_prefills": 1.5}, {"worker_prefills": True},
                {"holder_prefills": 0}, {"holder_prefills": 2.5}, {"rematch_ms": -1}, {"rematch_ms": 5}):
        with pytest.raises(ValueError, match="queue"):
            make_policy({"name": "ttft", "queue": bad})
    for name in POLICY_NAMES:
        d = describe(make_policy({"name": name}))
        assert describe(make_policy(d)) == d
    s = make_policy({"name": "session", "session_header": "X-User-Session"})
    assert isinstance(s, SessionPolicy) and s.session_header == "x-user-session"
    assert describe(s)["session_header"] == "x-user-session"
    assert make_policy({"name": "session"}).session_header == "x-session-id"
    assert make_policy({"name": "kv_aware"}).session_header is None


@pytest.mark.parametrize("cfg, message", [
    ({"name": "fastest"}, "unknown policy name 'fastest'; expected one of ttft, kv_aware, round_robin"),
    ({"name": 3}, "unknown policy name 3"),
    ([("name", "kv_aware")], "policy must be a mapping"),
    ({"name": "kv_aware", "tier_credits": {}}, "unknown key(s) 'tier_credits' in policy 'kv_aware'"),
    ({"name": "round_robin", "load_weight": 1}, "unknown key(s) 'load_weight' in policy 'round_robin'"),
    ({"tier_credit": {"gpu": 1.5}}, "policy.tier_credit.gpu must be between 0 and 1, got 1.5"),
    ({"tier_credit": {"cpu": -0.1}}, "policy.tier_credit.cpu must be between 0 and 1"),
    ({"tier_credit": {"nvme": 0.5}}, "unknown key(s) 'nvme' in policy.tier_credit"),
    ({"tier_credit": [1, 0.75]}, "policy.tier_credit must be a mapping"),
    ({"tier_credit": {"ssd": "0.25"}}, "policy.tier_credit.ssd must be a finite number, got '0.25'"),
    ({"name": "kv_aware", "load_weight": -1}, "policy.load_weight must be >= 0, got -1"),
    ({"name": "kv_aware", "load_weight": True}, "policy.load_weight must be a finite number, got True"),
    ({"name": "kv_aware", "temperature": float("inf")}, "policy.temperature must be a finite number"),
    ({"name": "kv_aware", "overload_guard": {"ratio": 0.9}}, "policy.overload_guard.ratio must be >= 1"),
    ({"name": "kv_aware", "overload_guard": {"enabled": "yes"}}, "policy.overload_guard.enabled must be true or false"),
    ({"name": "kv_aware", "overload_guard": {"limit": 3}}, "unknown key(s) 'limit' in policy.overload_guard"),
    ({"name": "least_load", "decode_tokens_per_request": -5},
     "policy.decode_tokens_per_request must be >= 0"),
    ({"name": "session", "session_header": "x session"}, "policy.session_header must be an HTTP header"),
    ({"name": "session", "session_header": ""}, "policy.session_header must be an HTTP header"),
])
def test_factory_rejects_bad_config(cfg, message):
    with pytest.raises(ValueError) as err:
        make_policy(cfg)
    assert message in str(err.value)


def test_score_of_finds_each_candidates_score_and_none_for_a_stranger():
    workers = [f"w{i}" for i in range(300)]
    decision = TTFTPolicy().choose(req(40), [cand(w, gpu=i % 7, in_flight=i % 3) for i, w in enumerate(workers)])
    assert decision.score_of(decision.worker_id) is decision.scores[0]
    for score in decision.scores:  # every holder asked once, as the dispatch queue's sizing does
        assert decision.score_of(score.worker_id) is score
    assert decision.score_of("w300") is None
    assert Decision("a", "load", []).score_of("a") is None
    first, second = CandidateScore("b", TierMatch(gpu=2), 0, 1.0), CandidateScore("b", TierMatch(gpu=5), 0, 2.0)
    assert Decision("a", "load", [CandidateScore("a", TierMatch(), 0, 0.0), first, second]).score_of("b") is first
