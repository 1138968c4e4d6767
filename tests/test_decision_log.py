"""The decision log (``router/decision_log.py``) and ``GET /admin/decisions``: the ring alone
(bounded, newest first, filters, candidates cut), then a real gateway over two `kvroute sim`
workers driven by the ``openai`` SDK: every decision of real traffic is listed under its request
id with the worker the request went to, the cached tokens the worker reported and the predicted
ones, and explained requests are not listed."""
from __future__ import annotations

import httpx
import pytest

from conftest import ADMIN_TOKEN, Proc, wait_until
from kvcore.index.base import TierMatch
from router.config import ModelConfig
from router.decision_log import MAX_CANDIDATES, DecisionLog
from router.policies.base import CandidateScore, Decision, RouteRequest
from router.routing import RoutePlan
from test_gateway_e2e import BLOCK, assert_openai_error, chat_body, two_sim_gateway


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


def test_candidates_are_cut_and_zero_capacity_keeps_nothing():
    log = DecisionLog(capacity=2)
    entry = log.record(_plan("w0", workers=40), "big")
    assert len(entry["candidates"]) == MAX_CANDIDATES and entry["candidates_total"] == 40
    assert entry["candidates"][0]["worker"] == "w0"
    off = DecisionLog(capacity=0)
    assert off.record(_plan("w0"), "r") is None and off.snapshot() == [] and len(off) == 0


@pytest.fixture(scope="module")
def gw(tmp_path_factory, tiny_model):
    log_dir = tmp_path_factory.mktemp("decisions")
    started: list[Proc] = []
    try:
        base, _, _ = two_sim_gateway(tiny_model, log_dir, started, routing={"decisions_kept": 5})
        yield base
    finally:
        for p in reversed(started):
            p.stop()


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
