"""The ``ttft`` policy's cost model, the spreading rule, the learned prefill rate and evidence
trust: real predictions in milliseconds for constructed candidates (pure unit tests).

Block size 16; the prior line is 25 ms + 0.1 ms per token of work; a decoding request weighs
DECODE_INTERFERENCE_TOKENS (16) tokens.
"""
from __future__ import annotations

import random
import statistics

import pytest

from kvcore.index.base import TierMatch
from router.config.schema import WorkerConfig
from router.estimates.evidence import EvidenceTrust
from router.estimates.prefill_rate import (DECODE_INTERFERENCE_TOKENS, MODEL_LINE_TOLERANCE, PrefillRate,
                                          PrefillRateEstimator, _moved, theil_sen, work_tokens)
from router.policies.base import Candidate, RouteRequest, WorkerLoad
from router.policies.factory import DEFAULT_POLICY, describe, make_policy
from router.shared.load_table import OthersLoad
from router.workers.registry import WorkerRegistration, WorkerRegistry

BS = 16


def cand(worker: str, gpu: int = 0, cpu: int = 0, ssd: int = 0, prefill_tokens: int = 0,
         decoding: int = 0, in_flight: int | None = None, unseen_waiting: int = 0, unseen_running: int = 0,
         rate: PrefillRate | None = None, trusted: bool = True, uses: int = 0) -> Candidate:
    """``uses``: recent requests through the candidate's matched prefix (2 or more: hot)."""
    if in_flight is None:
        in_flight = decoding + (1 if prefill_tokens else 0)
    load = WorkerLoad(in_flight=in_flight, prefill_tokens=prefill_tokens, decoding=decoding,
                      unseen_waiting=unseen_waiting, unseen_running=unseen_running)
    return Candidate(worker, load, TierMatch(gpu=gpu, cpu=cpu, ssd=ssd), rate, trusted, prefix_uses=uses)


def req(prompt_tokens: int | None, rand: float = 0.0) -> RouteRequest:
    blocks = (prompt_tokens or 0) // BS
    return RouteRequest(model="tiny", prompt_tokens=prompt_tokens, block_size=BS, num_blocks=blocks, rand=rand)


def ttfts(decision) -> dict[str, float]:
    return {s.worker_id: s.predicted_ttft_ms for s in decision.scores}


def test_ttft_config_defaults_round_trip():
    assert DEFAULT_POLICY == "ttft"  # with its dispatch queue on; why: docs/tuning/ttft_policy.md
    cfg = describe(make_policy({"name": "ttft"}))
    assert cfg == {"name": "ttft", "tier_credit": {"gpu": 1.0, "cpu": 0.75, "ssd": 0.25},
                   "prefill_overhead_ms": 25.0, "prefill_ms_per_token": 0.1, "learn_prefill_rate": True,
                   "engine_waiting_prefill_tokens": 1024.0, "spread_margin": 1.0, "recompute_weight": 1.0,
                   "private_recompute_weight": 3.0, "private_affinity_wait_s": 5.0,
                   "queue": {"enabled": True, "worker_prefills": 1, "holder_prefills": 2, "worker_queue_ms": 50.0,
                             "settle_ms": 50.0, "affinity": "policy", "affinity_wait_s": 5.0, "max_wait_s": 10.0,
                             "rematch_ms": 200.0},
                   "pd": {"enabled": False, "models": [], "min_prefill_tokens": 256, "prefill_timeout_s": None}}
    assert describe(make_policy(cfg)) == cfg  # round trip


def test_prediction_counts_queue_own_prefill_and_decodes():
    policy = make_policy({"name": "ttft"})
    assert (policy.spread_margin, policy.recompute_weight, policy.private_recompute_weight) == (1.0, 1.0, 3.0)
    # 1000-token prompt; w0 holds 40 of 62 blocks in GPU and has 2000 tokens queued and 3 decoding;
    # it is one conversation's history (1 recent request through it: its previous turn)
    d = policy.choose(req(1000), [cand("w0", gpu=40, prefill_tokens=2000, decoding=3, uses=1), cand("w1")])
    # w0: 25 + 0.1 x (2000 + (1000 - 640) + 16 x 3) = 265.8 ms; w1: 25 + 0.1 x 1000 = 125 ms
    assert ttfts(d) == pytest.approx({"w0": 265.8, "w1": 125.0})
    # ranked: w1 is charged the 640 held tokens it would compute again, 3 x 0.1 x 640 = 192 ms more
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")
    assert d.scores[0].as_dict()["predicted_ttft_ms"] == 265.8
    assert d.affinity_wait_s == 5.0  # and it may wait private_affinity_wait_s in the queue for w0
    assert (d.scores[0].note, d.scores[1].note) == ("private prefix (recent uses: 1)", "")
    # the same prefix hot (2 recent requests through it) is charged recompute_weight (1):
    # 125 + 64 = 189 < 265.8, so a second copy is made
    d = policy.choose(req(1000), [cand("w0", gpu=40, prefill_tokens=2000, decoding=3, uses=2), cand("w1")])
    assert (d.worker_id, d.reason, d.affinity_wait_s) == ("w1", "spread", None)
    assert [s.note for s in d.scores] == ["", "hot prefix (recent uses: 2)"]
    d = make_policy({"name": "ttft", "recompute_weight": 3}).choose(
        req(1000), [cand("w0", gpu=40, prefill_tokens=2000, decoding=3, uses=2), cand("w1")])
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")  # 125 + 192 = 317 > 265.8
    # no holder at all: the queue's wait
    assert policy.choose(req(1000), [cand("w0"), cand("w1")]).affinity_wait_s is None


def test_vllm_caps_a_full_hit_one_token_short():
    policy = make_policy({"name": "ttft"})
    # 64 tokens = 4 full blocks, all cached: vLLM still computes the last token, so 3 blocks count
    d = policy.choose(req(64), [cand("w0", gpu=4)])
    assert ttfts(d)["w0"] == pytest.approx(25 + 0.1 * (64 - 48))


def test_holder_wins_while_its_queue_is_shorter_than_recomputing():
    policy = make_policy({"name": "ttft", "recompute_weight": 0, "private_recompute_weight": 0})  # predicted TTFT alone
    # 2000-token prompt, 100 blocks (1600 tokens) cached on w0: recompute elsewhere costs 2000
    # tokens, the holder 400 + its queue. Queue 1500: holder 1900 < 2000 -> prefix_hit.
    d = policy.choose(req(2000), [cand("w0", gpu=100, prefill_tokens=1500), cand("w1")])
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")
    # Queue 1700: holder 2100 > 2000 -> the prefix is recomputed on w1 (spread)
    d = policy.choose(req(2000), [cand("w0", gpu=100, prefill_tokens=1700), cand("w1")])
    assert (d.worker_id, d.reason) == ("w1", "spread")
    assert d.ranked_worker_ids() == ["w1", "w0"]


@pytest.mark.parametrize("weight", [1.0, 3.0])
def test_hot_prefix_spreads_to_a_second_holder_then_shares(weight):
    """A shared system prompt held by w0 only; requests arrive a little faster than one worker
    prefills their own parts (160 tokens each, 120 drained between arrivals). w0 takes them until
    its queue costs more than recomputing the prefix, charged 1 + ``recompute_weight`` times
    (this request waits for it, and so do those behind it); then one cold worker recomputes it
    once and holds it too (its events say so), and from then on the two holders share the
    requests. The third worker is never used: the prefix is neither pinned nor scattered."""
    policy = make_policy({"name": "ttft", "recompute_weight": weight})
    prompt, shared_blocks = 1600, 90  # 1440 shared tokens + 160 own
    queue = {"w0": 0, "w1": 0, "w2": 0}
    holders = {"w0"}
    chosen, reasons, queue_at_spread = [], [], None
    for i in range(300):
        cands = [cand(w, gpu=shared_blocks if w in holders else 0, prefill_tokens=queue[w],
                      uses=i if w in holders else 0) for w in queue]
        d = policy.choose(req(prompt, rand=(i * 0.618) % 1), cands)
        if d.reason == "spread" and queue_at_spread is None:
            queue_at_spread = queue["w0"]
        chosen.append(d.worker_id)
        reasons.append(d.reason)
        queue[d.worker_id] += prompt - (shared_blocks * BS if d.worker_id in holders else 0)
        holders.add(d.worker_id)
        queue = {w: max(0, q - 120) for w, q in queue.items()}
    first = reasons.index("spread")
    assert chosen[:first] == ["w0"] * first and first > 60
    # the holder's queue + own part had passed the full prompt plus the prefix `weight` times more
    assert queue_at_spread + 160 > 1600 + weight * 1440
    assert queue_at_spread + 160 - 40 <= 1600 + weight * 1440  # (and not a request later)
    assert reasons.count("spread") == 1  # the prefix was copied once
    second = chosen[first]
    assert len(holders) == 2 and second != "w0"
    # the new holder catches up with w0's queue, then the two alternate
    tail = chosen[-30:]
    assert set(tail) == {"w0", second} and all(a != b for a, b in zip(tail, tail[1:]))


def test_conversation_follows_its_cpu_tier_when_that_is_fastest():
    policy = make_policy({"name": "ttft", "spread_margin": 1.0, "private_recompute_weight": 1.0})
    # turn 3 of a chat: 3000 tokens, 150 blocks of history evicted from w0's GPU to its CPU tier
    d = policy.choose(req(3000), [cand("w0", cpu=150, prefill_tokens=500), cand("w1")])
    # w0: 25 + 0.1 x (500 + 3000 - 0.75 x 2400) = 195 ms; w1: 325 ms
    assert ttfts(d) == pytest.approx({"w0": 195.0, "w1": 325.0})
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")
    # from SSD (credit 0.25: 600 tokens saved) it pays with the same queue (235 vs 325 + 60
    # charged), but not with 1500 queued (415 vs 385)
    d = policy.choose(req(3000), [cand("w0", ssd=150, prefill_tokens=1500), cand("w1")])
    assert (d.worker_id, d.reason) == ("w1", "spread")


def test_prefix_gone_everywhere_goes_by_queue():
    policy = make_policy({"name": "ttft"})
    d = policy.choose(req(800), [cand("w0", prefill_tokens=900), cand("w1", decoding=4),
                                 cand("w2", prefill_tokens=100)])
    assert ttfts(d) == pytest.approx({"w0": 195.0, "w1": 25 + 0.1 * (800 + 64), "w2": 115.0})
    assert (d.worker_id, d.reason) == ("w1", "load")


def test_a_slower_worker_by_its_speed_factor_loses():
    policy = make_policy({"name": "ttft", "recompute_weight": 0, "private_recompute_weight": 0})
    model_line = PrefillRate(20.0, 0.25, 64)  # learned from every worker's TTFTs together
    slow, fast = cand("slow", gpu=30), cand("fast")
    slow.prefill_speed, fast.prefill_speed = (2.0, 48), (0.5, 48)  # median observed / model line
    for c in (slow, fast):
        c.model_prefill_rate = model_line
    d = policy.choose(req(1000), [slow, fast])
    # factors shrunk toward 1 by 48 / (48 + 16): slow 1.75x, fast 0.625x the model's line
    assert ttfts(d) == pytest.approx({"slow": 1.75 * (20 + 0.25 * 520), "fast": 0.625 * (20 + 0.25 * 1000)})
    assert d.worker_id == "fast"
    frozen = make_policy({"name": "ttft", "learn_prefill_rate": False, "recompute_weight": 0,
                          "private_recompute_weight": 0})
    assert frozen.choose(req(1000), [slow, fast]).worker_id == "slow"  # the prior for both: the hit wins


def test_noisy_lines_of_identical_workers_do_not_outrank_a_cached_prefix():
    """Identical workers' own lines (overhead, slope) fitted to ~30 noisy TTFTs each:
    (91 ms, 0.055) and (98 ms, 0.092); shrunk toward their median they would rank the worker
    holding 800 of a 924-token prompt below an idle one holding nothing. Their speed factors
    against the model's line are near 1, so the holder wins (docs/tuning/prefill_rate.md)."""
    policy = make_policy({"name": "ttft"})
    model_line = PrefillRate(95.0, 0.073, 64)
    holder = cand("holder", gpu=50, rate=PrefillRate(98.0, 0.092, 26))
    other = cand("other", rate=PrefillRate(91.0, 0.055, 37))
    holder.prefill_speed, other.prefill_speed = (1.04, 26), (0.97, 37)
    for c in (holder, other):
        c.model_prefill_rate = model_line
    d = policy.choose(req(924), [holder, other])
    k_holder, k_other = 1 + 0.04 * 26 / 42, 1 - 0.03 * 37 / 53
    assert ttfts(d) == pytest.approx({"holder": k_holder * (95 + 0.073 * (924 - 800)),
                                      "other": k_other * (95 + 0.073 * 924)})
    assert (d.worker_id, d.reason) == ("holder", "prefix_hit")


def test_the_models_line_until_a_worker_has_a_factor_and_the_prior_before_that():
    policy = make_policy({"name": "ttft"})
    model_line = PrefillRate(20.0, 0.5, 8)  # learned from all workers' requests together
    cands = [cand("w0", rate=PrefillRate(10.0, 0.2, 64)), cand("w1")]
    for c in cands:
        c.model_prefill_rate = model_line
    cands[0].prefill_speed = (0.5, 16)
    t = ttfts(policy.choose(req(1000), cands))
    # w1 has no factor: the model's line; w0's own line is not used, its factor (halved to 0.75) is
    assert t == pytest.approx({"w1": 520.0, "w0": 0.75 * 520.0})
    # nothing learned anywhere: the configured prior
    assert ttfts(policy.choose(req(1000), [cand("w0"), cand("w1")]))["w1"] == pytest.approx(25 + 0.1 * 1000)


def test_speed_factor_is_the_median_ratio_to_the_models_line():
    est = PrefillRateEstimator()
    model_line = PrefillRate(10.0, 0.1)
    for i in range(7):
        est.observe(100.0 * (i + 1), 2 * (10.0 + 10.0 * (i + 1)))
    assert est.speed_factor(model_line) is None  # fewer than MIN_SAMPLES
    est.observe(800.0, 2 * 90.0)
    est.observe(900.0, 5000.0)  # one stall: the median does not move
    assert est.speed_factor(model_line) == (pytest.approx(2.0), 9)
    assert est.speed_factor(PrefillRate(20.0, 0.2)) == (pytest.approx(1.0), 9)  # a new reference


def test_a_models_line_moves_only_past_its_dead_band():
    """A noisy steady stream refits the line every 4 samples; with a 5% dead band the published
    line (the object every worker's cached speed factor is keyed on) is replaced only by a refit
    that predicts more than 5% away from it at the window's median or largest work; a real change
    of speed is published within a window of samples."""
    rng = random.Random(7)
    model = PrefillRateEstimator(tolerance=MODEL_LINE_TOLERANCE)
    plain = PrefillRateEstimator()  # the same samples, every refit published

    def observe(ms_per_token: float) -> None:
        work = rng.uniform(100, 3000)
        ttft_ms = (20 + ms_per_token * work) * (1 + abs(rng.gauss(0, 0.2)))
        model.observe(work, ttft_ms)
        plain.observe(work, ttft_ms)

    expected, refits, republished = None, 0, 0
    for _ in range(400):
        fit_before, published_before = plain.learned, model.learned
        observe(0.05)
        if plain.learned is fit_before:
            assert model.learned is published_before
            continue
        refits += 1
        xs = [x for x, _ in plain._samples]
        fit = plain.learned
        if expected is None or any(abs(fit.ttft_ms(x) - expected.ttft_ms(x)) > 0.05 * expected.ttft_ms(x)
                                   for x in (statistics.median_low(xs), max(xs))):
            expected = fit
            republished += 1
            assert model.learned == fit
        else:
            assert model.learned is published_before
    # the first fit, then a few of the ~100 refits (4 with this seed); without the band, all of them
    assert refits >= 95 and 2 <= republished <= refits // 10, (refits, republished)
    # twice as slow from now on: published within one window
    for _ in range(64):
        observe(0.1)
    assert model.learned.ms_per_token == pytest.approx(0.1, rel=0.25)


def test_the_dead_band_is_checked_at_the_windows_median_and_largest_work():
    xs = [100.0, 1000.0, 1500.0, 2000.0, 3000.0]  # median 1500, largest 3000
    published = PrefillRate(100.0, 0.01)  # 115 ms at 1500, 130 at 3000
    # the overhead up, the slope down: +6.7% at the median, +4.2% at the largest work
    assert _moved(published, PrefillRate(110.0, 0.0085), xs, 0.05)
    # the slope up alone: +2.6% at the median, +5.8% at the largest work
    assert _moved(published, PrefillRate(100.0, 0.0125), xs, 0.05)
    # -4.3% at the median, +3.8% at the largest work: kept, though -14% at the smallest
    assert not _moved(published, PrefillRate(85.0, 0.025 / 1.5), xs, 0.05)
    # a non-finite published line is always replaced
    assert _moved(PrefillRate(float("nan"), 0.01), published, xs, 0.05)
    assert _moved(PrefillRate(float("inf"), 0.01), published, xs, 0.05)


def test_the_gateway_publishes_the_models_line_with_the_dead_band_and_each_workers_without():
    registry = WorkerRegistry()
    assert registry.model_rate("tiny").tolerance == MODEL_LINE_TOLERANCE == 0.05
    assert registry.model_rate("tiny") is registry.model_rate("tiny")
    assert WorkerRegistration(WorkerConfig(id="w0", url="http://127.0.0.1:9", model="tiny")).prefill_rate.tolerance == 0.0


def test_a_workers_load_is_its_own_requests_plus_the_other_processes_and_its_scrape():
    reg = WorkerRegistration(WorkerConfig(id="w0", url="http://127.0.0.1:9", model="tiny"))
    reg.in_flight, reg.prefill_tokens, reg.decoding = 3, 500, 2
    reg.engine_running, reg.engine_waiting, reg.kv_usage = 7, 4, 0.25
    reg.unseen_running, reg.unseen_waiting = 5, 1
    reg.others = lambda: OthersLoad(in_flight=10, prefill_tokens=2000, decoding=20)
    assert reg.load() == WorkerLoad(in_flight=13, prefill_tokens=2500, decoding=22, engine_running=7,
                                    engine_waiting=4, kv_usage=0.25, unseen_running=5, unseen_waiting=1)


def test_a_dead_band_outside_zero_to_one_is_refused():
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="tolerance"):
            PrefillRateEstimator(tolerance=bad)


def test_other_clients_requests_count_as_queue():
    policy = make_policy({"name": "ttft", "engine_waiting_prefill_tokens": 500})
    d = policy.choose(req(400), [cand("w0", gpu=20, unseen_waiting=2), cand("w1", unseen_running=3)])
    # w0: 25 + 0.1 x (1000 + 400 - 320) = 133; w1: 25 + 0.1 x (400 + 48) = 69.8
    assert ttfts(d) == pytest.approx({"w0": 133.0, "w1": 69.8})


def test_distrusted_evidence_earns_no_credit():
    policy = make_policy({"name": "ttft"})
    d = policy.choose(req(2000), [cand("w0", gpu=120, trusted=False), cand("w1", gpu=10)])
    assert d.worker_id == "w1"
    scores = {s.worker_id: s for s in d.scores}
    assert scores["w0"].note == "evidence distrusted"
    assert scores["w0"].predicted_ttft_ms == pytest.approx(225.0)
    kv = make_policy({"name": "kv_aware"}).choose(req(2000), [cand("w0", gpu=120, trusted=False),
                                                              cand("w1", gpu=10)])
    assert kv.worker_id == "w1"


def test_credit_is_weighted_by_the_hits_a_worker_has_been_realising():
    """Under KV pressure a worker evicts part of a matched prefix before its prefill: a holder
    that realised 40 % of its predicted hits is credited 40 % of its match."""
    policy = make_policy({"name": "ttft", "recompute_weight": 0, "private_recompute_weight": 0})
    holder = cand("w0", gpu=60, prefill_tokens=600)  # 960 of a 1000-token prompt matched
    d = policy.choose(req(1000), [holder, cand("w1")])
    assert (d.worker_id, ttfts(d)["w0"]) == ("w0", pytest.approx(25 + 0.1 * (600 + 40)))
    holder.evidence_weight = 0.4
    d = policy.choose(req(1000), [holder, cand("w1")])
    # w0: 25 + 0.1 x (600 + 1000 - 384) = 146.6 ms; w1: 125 ms
    assert ttfts(d) == pytest.approx({"w0": 146.6, "w1": 125.0})
    assert (d.worker_id, d.reason) == ("w1", "spread")


def test_two_holders_of_a_prefix_compete_on_time_whatever_their_evidence_weights():
    """The margin guards the longest holder against workers holding less; two holders of the same
    prefix with slightly different evidence weights are both holders: the faster one wins. (Two
    holders of one prefix: a hot prefix that spread, so charged ``recompute_weight``, 1 x 0.1 x
    0.03 x 1440 = 4.32 ms on b.)"""
    policy = make_policy({"name": "ttft"})
    a = cand("a", gpu=90, prefill_tokens=200, uses=4)
    b = cand("b", gpu=90, uses=4)
    a.evidence_weight, b.evidence_weight = 1.0, 0.97
    d = policy.choose(req(1600), [a, b])
    # a: 25 + 0.1 x (200 + 160) = 61 ms; b: 25 + 0.1 x (1600 - 0.97 x 1440) = 45.32 ms
    assert ttfts(d) == pytest.approx({"a": 61.0, "b": 45.32})
    assert (d.worker_id, d.reason) == ("b", "load")  # both hold the prefix: time alone decides


def test_every_prompt_of_a_body_is_prefill_work():
    policy = make_policy({"name": "ttft"})
    r = RouteRequest(model="tiny", prompt_tokens=500, all_prompt_tokens=1500, block_size=BS, num_blocks=31)
    d = policy.choose(r, [cand("w0", gpu=20)])
    # credit on the first prompt only (320 tokens); all 1500 tokens are prefilled
    assert ttfts(d)["w0"] == pytest.approx(25 + 0.1 * (1500 - 320))
    assert d.scores[0].work_tokens == pytest.approx(1180)


def test_cold_ties_share_traffic_and_no_tokens_goes_by_queue():
    policy = make_policy({"name": "ttft"})
    picks = {policy.choose(req(500, rand=r), [cand("a"), cand("b")]).worker_id for r in (0.1, 0.9)}
    assert picks == {"a", "b"}
    d = policy.choose(req(None), [cand("a", prefill_tokens=300), cand("b")])
    assert (d.worker_id, d.reason) == ("b", "no_tokens")


def test_recomputed_prefix_is_charged_once_more():
    # 2000-token prompt, 1600 cached on w0 (1700 queued): w0 235 ms predicted, cold w1 225 ms
    cands = [cand("w0", gpu=100, prefill_tokens=1700), cand("w1")]
    d = make_policy({"name": "ttft", "recompute_weight": 0, "private_recompute_weight": 0}).choose(req(2000), cands)
    assert (d.worker_id, d.reason) == ("w1", "spread")  # TTFT alone
    once = {"name": "ttft", "recompute_weight": 1, "private_recompute_weight": 1}
    d = make_policy(once).choose(req(2000), cands)  # w1 ranked 225 + 0.1 x 1600 = 385
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")
    assert ttfts(d) == pytest.approx({"w0": 235.0, "w1": 225.0})  # predictions are not changed
    # w0 at 25 + 0.1 x (queued + 400): 3100 queued -> 375 ms, stays; 3300 -> 395 ms > 385: spread.
    # Weight 3 for a hot prefix (uses 2) ranks w1 225 + 3 x 160 = 705, so w0 keeps it up to 6400
    # queued, as the default weight 3 for a private one (uses 1); a private one at weight 10 ranks
    # w1 1825: up to 17,600 queued; a hot one at the default weight 1 as ``once``
    three = {"name": "ttft", "recompute_weight": 3}
    ten = {"name": "ttft", "private_recompute_weight": 10}
    for cfg, queued, uses, winner in ((once, 3100, 2, "w0"), (once, 3300, 2, "w1"), (once, 3300, 1, "w1"),
                                      (three, 6300, 2, "w0"), (three, 6500, 2, "w1"),
                                      ({"name": "ttft"}, 3100, 2, "w0"), ({"name": "ttft"}, 3300, 2, "w1"),
                                      ({"name": "ttft"}, 6300, 1, "w0"), ({"name": "ttft"}, 6500, 1, "w1"),
                                      (ten, 17500, 1, "w0"), (ten, 17700, 1, "w1"), (ten, 3300, 2, "w1")):
        d = make_policy(cfg).choose(req(2000), [cand("w0", gpu=100, prefill_tokens=queued, uses=uses), cand("w1")])
        assert d.worker_id == winner, (cfg, queued, uses)


def test_spread_margin_multiplies_a_non_holders_prediction():
    cands = [cand("w0", gpu=100, prefill_tokens=1700), cand("w1")]
    policy = make_policy({"name": "ttft", "recompute_weight": 0, "private_recompute_weight": 0, "spread_margin": 1.3})
    d = policy.choose(req(2000), cands)  # 1.3 x 225 = 292.5 > 235: stay
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")
    d = policy.choose(req(2000), [cand("w0", gpu=100, prefill_tokens=2400), cand("w1")])  # 305 > 292.5
    assert (d.worker_id, d.reason) == ("w1", "spread")


@pytest.mark.parametrize("bad, message", [
    ({"spread_margin": 0.9}, "spread_margin"),
    ({"recompute_weight": -1}, "recompute_weight"),
    ({"prefill_ms_per_token": 0}, "prefill_ms_per_token"),
    ({"prefill_overhead_ms": -1}, "prefill_overhead_ms"),
    ({"tier_credit": {"cpu": 1.5}}, "tier_credit.cpu"),
    ({"learn_prefill_rate": "yes"}, "learn_prefill_rate"),
    ({"load_weight": 1}, "unknown key"),
])
def test_bad_config_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        make_policy({"name": "ttft", **bad})


# ---- the learned prefill rate ------------------------------------------------------------------

def test_theil_sen_ignores_outliers():
    xs = [float(x) for x in range(0, 2000, 100)]
    ys = [20 + 0.05 * x for x in xs]
    ys[3] += 5000  # a GC pause
    ys[7] = 0.0  # a bogus sample
    intercept, slope = theil_sen(xs, ys)
    assert slope == pytest.approx(0.05, rel=1e-6) and intercept == pytest.approx(20.0, abs=1e-6)
    assert theil_sen([5.0, 5.0], [1.0, 2.0]) is None
    assert theil_sen([], []) is None and theil_sen([5.0], [1.0]) is None  # no pair at all


def test_theil_sen_is_the_median_of_the_pairwise_slopes_exactly():
    """The numpy form gives the very floats of the definition (Sen 1968) on random windows with
    repeated x (pairs of equal x have no slope) and odd and even pair counts."""
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(2, 64)
        xs = [float(rng.choice([rng.randint(0, 5000), rng.randint(0, 3)])) for _ in range(n)]
        ys = [rng.uniform(1, 900) for _ in range(n)]
        slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i]]
        if not slopes:
            assert theil_sen(xs, ys) is None
            continue
        slope = statistics.median(slopes)
        assert theil_sen(xs, ys) == (statistics.median(y - slope * x for x, y in zip(xs, ys)), slope)


def test_estimator_learns_a_noisy_line_with_bounded_memory():
    rng = random.Random(7)
    est = PrefillRateEstimator()
    prior = PrefillRate(25.0, 0.1)
    assert est.rate(prior) is prior
    for i in range(500):
        work = rng.uniform(100, 6000)
        noise = rng.gauss(0, 8) + (3000 if i % 17 == 0 else 0)  # 6 % of requests hit a stall
        est.observe(work, 40 + 0.074 * work + noise)
    rate = est.rate(prior)
    assert rate.ms_per_token == pytest.approx(0.074, rel=0.05)
    assert rate.overhead_ms == pytest.approx(40, abs=10)
    assert rate.samples == 64 and est.observed == 500  # the window bounds memory
    est.observe(-1.0, 10.0)
    est.observe(100.0, float("nan"))
    assert est.observed == 500


def test_estimator_needs_distinct_samples_before_it_trusts_itself():
    est = PrefillRateEstimator()
    for _ in range(20):
        est.observe(100.0, 50.0)
    assert est.learned is None  # one x value says nothing about the slope
    for w in (200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0):
        est.observe(w, 40 + 0.1 * w)
    assert est.learned.ms_per_token == pytest.approx(0.1) and est.learned.overhead_ms == pytest.approx(40.0)


def test_decode_interference_is_priced_in_tokens():
    assert DECODE_INTERFERENCE_TOKENS == 16.0
    rate = PrefillRate(25.0, 0.1)
    assert rate.ttft_ms(0) == 25.0 and rate.as_dict()["tokens_per_s"] == 10000.0


# ---- evidence trust ----------------------------------------------------------------------------

def test_evidence_distrusted_when_reports_run_below_predictions_then_trusted_again():
    ev = EvidenceTrust()
    for _ in range(7):
        assert ev.observe(1024, 32) is None  # not enough seen yet to judge
    assert ev.trusted and ev.state()["agreement"] is None
    assert ev.observe(1024, 32) is False  # 8th: agreement 32/1024
    assert not ev.trusted and ev.state() == {"trusted": False, "agreement": 0.031, "credit_weight": 0.0,
                                             "requests": 8, "changes": 1}
    ev.observe(0, 0)  # nothing predicted: no evidence either way
    assert ev.state()["requests"] == 8
    changed = [ev.observe(1024, 1024) for _ in range(32)]
    assert changed.count(True) == 1 and ev.trusted
    # hysteresis: agreement between 0.25 and 0.5 does not flip a trusted worker (an eviction race
    # under KV pressure realises part of a matched prefix)
    for _ in range(32):
        assert ev.observe(1000, 400) is None
    assert ev.trusted and ev.state()["agreement"] == 0.4 and ev.credit_weight == pytest.approx(0.4)


def test_reports_above_predictions_are_agreement():
    ev = EvidenceTrust()
    for _ in range(10):
        ev.observe(512, 4096)
    assert ev.trusted and ev.agreement == 1.0


# ---- the gateway's accounting ------------------------------------------------------------------

def registration() -> WorkerRegistration:
    return WorkerRegistration(WorkerConfig(id="w0", url="http://127.0.0.1:9", model="tiny"))


def test_scrape_counts_other_clients_requests_once():
    reg = registration()
    handles = [reg.begin(100) for _ in range(4)]  # four of ours, none past first byte
    reg.record_scrape(running=4, waiting=4, kv_usage=0.5)
    # ours are the 4 waiting; the 4 running are someone else's
    assert (reg.unseen_running, reg.unseen_waiting) == (4, 0)
    handles[0].first_byte()
    handles[1].first_byte()
    reg.record_scrape(running=3, waiting=3, kv_usage=0.5)
    # 2 of ours before first byte take 2 of the 3 waiting; 2 of ours decode among the 3 running
    assert (reg.unseen_running, reg.unseen_waiting) == (1, 1)
    reg.forget_scrape()
    assert (reg.engine_running, reg.unseen_running, reg.unseen_waiting) == (None, 0, 0)


def test_in_flight_handle_books_the_queue_it_joined_and_its_ttft():
    reg = registration()
    first = reg.begin(1000)
    second = reg.begin(300)
    assert (second.queued_tokens, second.decoding, reg.prefill_tokens) == (1000, 0, 1300)
    first.first_byte()
    assert first.ttft_ms is not None and first.ttft_ms >= 0
    assert (reg.prefill_tokens, reg.decoding) == (300, 1)
    second.presume_prefilled()  # a non-streamed answer: prefill presumed done, no TTFT measured
    assert (reg.prefill_tokens, reg.decoding, second.ttft_ms) == (0, 2, None)
    second.first_byte()  # idempotent once decoding
    assert reg.decoding == 2
    first.finish()
    second.finish()
    second.finish()
    assert (reg.in_flight, reg.prefill_tokens, reg.decoding) == (0, 0, 0)


def test_a_line_that_traded_slope_for_overhead_is_capped_at_the_fastest_requests():
    """Cold prompts whose TTFTs do not grow with their size (the larger ones came at quieter
    moments of a busy CPU host) and a few cached ones that came back fast: Theil-Sen alone fits a
    flat line with a large overhead, which values a cached prefix at nothing. The overhead is
    capped at the fastest tenth of the TTFTs and the slope re-taken through it."""
    rng = random.Random(3)
    samples = []
    for _ in range(28):
        x = rng.uniform(800, 2400)
        samples.append((x, 260 - 0.05 * (x - 800) + rng.uniform(-30, 30)))
    samples += [(124.0, 50.0 + i) for i in range(4)]
    xs, ys = [x for x, _ in samples], [y for _, y in samples]
    raw_intercept, raw_slope = theil_sen(xs, ys)
    assert raw_slope < 0 and raw_intercept > 200  # the flat line (its slope would be clamped to ~0)
    est = PrefillRateEstimator()
    for x, y in samples:
        est.observe(x, y)
    line = est.learned
    assert line.overhead_ms == pytest.approx(statistics.quantiles(ys, n=10)[0])  # 10th percentile
    assert 50.0 <= line.overhead_ms <= 54.0
    assert line.ms_per_token == pytest.approx(statistics.median((y - line.overhead_ms) / x for x, y in samples))
    assert line.ms_per_token > 0.05
    assert line.ttft_ms(924) - line.ttft_ms(124) > 40  # a cached 800-token prefix is worth something


def test_each_prediction_is_work_tokens_on_the_line_with_negative_figures_taken_as_zero():
    """The policy's per-candidate arithmetic (inlined for speed) gives what work_tokens, rate_of
    and PrefillRate.ttft_ms give, for odd loads too (negative figures count as 0), on the prior,
    the model's line and the line scaled by a speed factor."""
    policy = make_policy({"name": "ttft"})
    rnd = random.Random(7)
    request = req(900)
    candidates = [cand(f"w{i}", gpu=rnd.choice([0, 0, 3, 20, 80]), prefill_tokens=rnd.randint(-50, 3000),
                       decoding=rnd.randint(-2, 20), in_flight=1, unseen_waiting=rnd.randint(-1, 3),
                       unseen_running=rnd.randint(-1, 3), trusted=rnd.random() > 0.2,
                       rate=PrefillRate(rnd.uniform(0, 40), rnd.uniform(0.01, 0.2), 50))
                  for i in range(60)]
    model_line = PrefillRate(31.0, 0.07, 64)
    for c in candidates:
        c.evidence_weight = rnd.choice([1.0, 0.5, 0.0])
        # the line: the prior, the model's, or the model's scaled by a speed factor
        c.model_prefill_rate = rnd.choice([None, model_line, model_line])
        c.prefill_speed = rnd.choice([None, (rnd.uniform(0.5, 2.0), rnd.randint(8, 64))])
    assert {(c.model_prefill_rate is None, c.prefill_speed is None) for c in candidates} == {
        (True, True), (True, False), (False, True), (False, False)}
    decision = policy.choose(request, candidates)
    by_id = {c.worker_id: c for c in candidates}
    assert len(decision.scores) == 60
    for s in decision.scores:
        c, load = by_id[s.worker_id], by_id[s.worker_id].load
        credit = policy.held_tokens(c, 900, BS) * min(1.0, max(0.0, c.evidence_weight))
        queued = max(0, load.prefill_tokens) + max(0, load.unseen_waiting) * policy.engine_waiting_prefill_tokens
        work = work_tokens(queued, 900 - credit, max(0, load.decoding) + max(0, load.unseen_running))
        assert s.load == queued and s.work_tokens == work
        assert s.predicted_ttft_ms == s.cost == policy.rate_of(c).ttft_ms(work)
