"""The decision log (``router/route/decision_log.py``) and ``GET /admin/decisions``: the ring alone
(bounded, newest first, filters, candidates cut) and its summary (windowed counts in time
buckets: ``GET /admin/summary``, tested over HTTP in test_dashboard_browser.py), then a real
gateway over two `kvroute sim` workers driven by the ``openai`` SDK: every decision of real
traffic is listed under its request id with the worker the request went to, the cached tokens
the worker reported and the predicted ones, and explained requests are not listed."""
from __future__ import annotations

import time

import httpx
import pytest

from conftest import ADMIN_TOKEN, wait_until
from kvcore.index.base import TierMatch
from router.config.schema import ModelConfig
from router.policies.base import CandidateScore, Decision, RouteRequest
from router.route.decision_log import MAX_CANDIDATES, DecisionLog, SummaryWindowError, merge_summaries
from router.route.plan import RoutePlan
from test_gateway_e2e import BLOCK, assert_openai_error, chat_body, running_two_sim_gateway


def _plan(chosen: str, workers: int = 2) -> RoutePlan:
    ids = [chosen] + [f"x{i}" for i in range(workers - 1)]
    scores = [CandidateScore(w, TierMatch(gpu=3 if w == chosen else 0), load=0.0, cost=float(i))
              for i, w in enumerate(ids)]
    return RoutePlan(ModelConfig(name="m", block_size=16), None, None, {}, RouteRequest("m", None, 16),
                     Decision(chosen, "prefix_hit", scores), "kv_aware")


def test_ring_keeps_the_newest_and_filters():
    log = DecisionLog(capacity=3)
    entries = [log.record(_plan(f"w{i % 2}"), f"r{i}", queue_wait_ms=i) for i in range(5)]
    DecisionLog.sent(entries[4], "w1")  # a retry moved r4 from w0 to w1
    DecisionLog.usage(entries[3], 48)
    DecisionLog.first_token(entries[3], 12.3456)
    got = log.snapshot()
    assert [d["request_id"] for d in got] == ["r4", "r3", "r2"]
    assert log.recorded == 5 and len(log) == 3
    r3 = got[1]
    assert (r3["chosen"], r3["worker"], r3["actual_cached_tokens"], r3["upstream_ttft_ms"]) == ("w1", None, 48, 12.346)
    assert r3["queue_wait_ms"] == 3 and r3["reason"] == "prefix_hit" and r3["policy"] == "kv_aware"
    assert r3["candidates"][0] == {"worker": "w1", "matched_blocks": {"gpu": 3, "cpu": 0, "ssd": 0},
                                   "load": 0.0, "cost": 0.0, "note": ""}
    assert [d["request_id"] for d in log.snapshot(limit=1)] == ["r4"]
    assert [d["request_id"] for d in log.snapshot(worker="w1")] == ["r4", "r3"]  # r4 by where it went
    assert [d["request_id"] for d in log.snapshot(worker="w0")] == ["r2"]
    assert log.snapshot(since_unix_s=got[0]["time_unix_s"]) == []
    got[0]["worker"] = "changed"  # a snapshot is a copy
    assert log.snapshot(limit=1)[0]["worker"] == "w1"


def test_gateway_ms_is_the_time_to_the_send_less_the_queue_wait():
    log = DecisionLog()
    entry = log.record(_plan("w0"), "r", queue_wait_ms=30.0)
    assert entry["gateway_ms"] is None  # not sent yet
    DecisionLog.sent(entry, "w0", arrived_s=time.perf_counter() - 0.050)  # arrived 50 ms ago
    assert 20.0 <= entry["gateway_ms"] < 20.0 + 1000.0  # 50 ms less the 30 ms queued, plus this call
    DecisionLog.sent(entry, "w1")  # no arrival time given: the figure stays
    assert entry["worker"] == "w1" and entry["gateway_ms"] >= 20.0
    quick = log.record(_plan("w0"), "q", queue_wait_ms=500.0)
    DecisionLog.sent(quick, "w0", arrived_s=time.perf_counter())
    assert quick["gateway_ms"] == 0.0  # never negative


def test_candidates_are_cut_and_zero_capacity_keeps_nothing():
    log = DecisionLog(capacity=2)
    plan = _plan("w0", workers=40)
    log.record(plan, "big")
    [entry] = log.snapshot()
    # the candidates are written when read, where and as explain writes them
    assert list(entry)[3:12] == list(plan.explain())
    assert entry["candidates"] == plan.explain(MAX_CANDIDATES)["candidates"]
    assert len(entry["candidates"]) == MAX_CANDIDATES and entry["candidates_total"] == 40
    assert [c["worker"] for c in entry["candidates"][:3]] == ["w0", "x0", "x1"]
    assert entry["candidates"][1] == {"worker": "x0", "matched_blocks": {"gpu": 0, "cpu": 0, "ssd": 0},
                                      "load": 0.0, "cost": 1.0, "note": ""}
    off = DecisionLog(capacity=0)
    assert off.record(_plan("w0"), "r") is None and off.snapshot() == [] and len(off) == 0


def test_summary_folds_the_window_into_buckets():
    """``summary`` (``GET /admin/summary``): decisions of the window only, in time buckets; token
    sums and hit rates over the decisions whose cached tokens came back; buckets start at
    multiples of the bucket width, the last one holding now."""
    now = 1_000_009.0  # buckets from 999_950 to 1_000_010
    log = DecisionLog(capacity=10)

    def decided(age_s, chosen, reason="prefix_hit", prompt=None, predicted=None, actual=None, sent=None):
        entry = log.record(_plan(chosen), f"r{log.recorded}")
        entry.update(time_unix_s=now - age_s, reason=reason, prompt_tokens=prompt, predicted_cached_tokens=predicted)
        if sent:
            DecisionLog.sent(entry, sent)
        if actual is not None:
            DecisionLog.usage(entry, actual)

    decided(400, "w0", prompt=100, predicted=100, actual=100)  # before the window
    decided(55, "w0", "load", prompt=100, predicted=0, actual=0, sent="w0")
    decided(52, "w1", prompt=200, predicted=160, actual=128, sent="w0")  # a retry moved it to w0
    decided(3, "w1", prompt=100, predicted=64, actual=96, sent="w1")
    decided(2, "w1", prompt=300, predicted=256)  # still running: no cached tokens yet
    decided(1, "w0", "load")  # tokenization fell back: no prompt tokens
    got = log.summary(window_s=60, bucket_s=10, now_unix_s=now)
    assert got["totals"] == {"decisions": 5, "reported": 3, "prompt_tokens": 400, "predicted_cached_tokens": 224,
                             "actual_cached_tokens": 224}
    assert (got["hit_rate"], got["predicted_hit_rate"]) == (0.56, 0.56)
    assert got["by_reason"] == {"prefix_hit": 3, "load": 2} and got["by_worker"] == {"w0": 3, "w1": 2}
    assert [b["start_unix_s"] for b in got["series"]] == [999_950 + 10 * i for i in range(6)]
    assert [b["decisions"] for b in got["series"]] == [2, 0, 0, 0, 0, 3]
    first, last = got["series"][0], got["series"][-1]
    assert (first["prompt_tokens"], first["actual_cached_tokens"], first["hit_rate"]) == (300, 128, 0.4267)
    assert (last["reported"], last["hit_rate"], last["predicted_hit_rate"]) == (1, 0.96, 0.64)
    assert got["series"][1]["hit_rate"] is None  # no tokens: no rate (not 0)
    assert (got["recorded"], got["kept"], got["oldest_kept_unix_s"]) == (6, 10, now - 400)
    assert len(log.summary(window_s=25, bucket_s=10, now_unix_s=now)["series"]) == 3  # a partial bucket counts
    assert log.summary(window_s=60, bucket_s=10, now_unix_s=now + 1)["series"][0]["decisions"] == 0  # 999_960 on
    assert log.summary(window_s=3600, now_unix_s=now)["totals"]["decisions"] == 6
    for window_s, bucket_s, param in ((0, 10, "window_s"), (float("nan"), 10, "window_s"), (3601, 10, "window_s"),
                                      (60, 0, "bucket_s"), (60, 61, "bucket_s"), (3600, 1, "bucket_s"),
                                      (60, float("nan"), "bucket_s")):
        with pytest.raises(SummaryWindowError) as err:
            log.summary(window_s, bucket_s, now_unix_s=now)
        assert err.value.param == param
    empty = DecisionLog(capacity=0).summary(now_unix_s=now)
    assert empty["totals"]["decisions"] == 0 and empty["hit_rate"] is None and empty["oldest_kept_unix_s"] is None


def test_summaries_of_several_processes_merge_bucket_by_bucket():
    now = 1_000_009.0
    logs = [DecisionLog(capacity=4), DecisionLog(capacity=4)]
    for log, ages in zip(logs, ((30, 2), (31, 1, -1.2))):  # the last one in the bucket from 1_000_010
        for age in ages:
            entry = log.record(_plan("w0"), "r")
            entry.update(time_unix_s=now - age, prompt_tokens=100, predicted_cached_tokens=50)
            DecisionLog.sent(entry, f"w{len(ages) % 2}")
            DecisionLog.usage(entry, 25)
    mine = logs[0].summary(60, 10, now_unix_s=now)
    theirs = logs[1].summary(60, 10, now_unix_s=now + 1.5)  # already one bucket on
    got = merge_summaries([mine, theirs])
    assert [b["start_unix_s"] for b in got["series"]] == [999_960 + 10 * i for i in range(6)]
    assert [b["decisions"] for b in got["series"]] == [0, 2, 0, 0, 2, 1]  # 999_950 (mine only) left out
    assert got["totals"] == {"decisions": 5, "reported": 5, "prompt_tokens": 500, "predicted_cached_tokens": 250,
                             "actual_cached_tokens": 125}
    assert (got["hit_rate"], got["predicted_hit_rate"]) == (0.25, 0.5)
    assert got["by_worker"] == {"w0": 2, "w1": 3} and got["by_reason"] == {"prefix_hit": 5}
    assert (got["kept"], got["recorded"], got["now_unix_s"], got["oldest_kept_unix_s"]) == (8, 5, now + 1.5, now - 31)
    with pytest.raises(ValueError):
        merge_summaries([mine, logs[1].summary(60, 5, now_unix_s=now)])


@pytest.fixture(scope="module")
def gw(tmp_path_factory, tiny_model):
    with running_two_sim_gateway(tmp_path_factory, tiny_model, "decisions", routing={"decisions_kept": 5}) as (base, _, _):
        yield base


def _decisions(base: str, query: str = "", token: str | None = ADMIN_TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(base + "/admin/decisions" + query, headers=headers, timeout=30)


def test_real_decisions_are_listed_with_their_outcome(gw):
    from openai import OpenAI

    cli = OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0, timeout=60)
    sent = {}
    for rid, question in (("dl-cold", "first"), ("dl-warm", "second question")):
        r = cli.chat.completions.with_raw_response.create(**chat_body("decision-log", question),
                                                           extra_headers={"x-request-id": rid})
        sent[rid] = (r.headers["x-kvroute-worker"], r.parse().usage)
    stream = cli.chat.completions.create(**chat_body("decision-log", "third one"), stream=True,
                                         stream_options={"include_usage": True},
                                         extra_headers={"x-request-id": "dl-stream"})
    chunks = list(stream)
    stream_cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    httpx.post(gw + "/admin/explain", json=chat_body("decision-log", "not sent"), timeout=30,
               headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).raise_for_status()
    # the streamed answer's usage is booked as its stream ends, after the client has it
    got = wait_until(lambda: (lambda ds: ds if ds[0]["actual_cached_tokens"] is not None else None)(
        _decisions(gw).json()["decisions"]), what="the streamed request's usage in the log")
    body = _decisions(gw).json()
    assert body["kept"] == 5 and body["recorded"] == 3
    assert [d["request_id"] for d in got] == ["dl-stream", "dl-warm", "dl-cold"]  # explain is not traffic
    by_id = {d["request_id"]: d for d in got}
    for rid, (worker, usage) in sent.items():
        d = by_id[rid]
        assert d["chosen"] == d["worker"] == worker
        assert d["actual_cached_tokens"] == usage.prompt_tokens_details.cached_tokens
        assert d["prompt_tokens"] == usage.prompt_tokens and d["model"] == "tiny"
        assert {c["worker"] for c in d["candidates"]} == {"w0", "w1"} and d["candidates_total"] == 2
        assert d["queue_wait_ms"] >= 0 and d["policy"] == "ttft"
        assert d["gateway_ms"] > 0  # parse, tokenize, lookup, choose: never free
    warm, cold = by_id["dl-warm"], by_id["dl-cold"]
    assert cold["predicted_cached_tokens"] == 0 and cold["actual_cached_tokens"] == 0
    # the warm turn shares the system prompt's full blocks with the cold one, on the same worker
    assert warm["worker"] == cold["worker"] and warm["reason"] == "prefix_hit"
    assert warm["predicted_cached_tokens"] == warm["actual_cached_tokens"] >= 8 * BLOCK
    streamed = by_id["dl-stream"]
    assert streamed["actual_cached_tokens"] == stream_cached == streamed["predicted_cached_tokens"]
    assert streamed["upstream_ttft_ms"] > 0
    # filters, the ring's bound and the admin token
    assert [d["request_id"] for d in _decisions(gw, "?limit=1").json()["decisions"]] == ["dl-stream"]
    assert {d["request_id"] for d in _decisions(gw, f"?worker={warm['worker']}").json()["decisions"]} >= {
        "dl-cold", "dl-warm"}
    for i in range(6):
        cli.chat.completions.create(**chat_body(f"fill-{i}"), extra_headers={"x-request-id": f"fill-{i}"})
    assert [d["request_id"] for d in _decisions(gw).json()["decisions"]] == [f"fill-{i}" for i in (5, 4, 3, 2, 1)]
    assert_openai_error(_decisions(gw, "?limit=0"), 400)
    assert_openai_error(_decisions(gw, "?limit=many"), 400)
    assert_openai_error(_decisions(gw, token=None), 401)
