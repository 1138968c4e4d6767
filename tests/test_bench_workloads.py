"""kvroute bench: workload expansion (block alignment, exact lengths), the ideal hit rate, arrivals
and the figures, on the tiny model's real tokenizer."""
from __future__ import annotations

import json

import pytest

from kvcore.block_keys import block_keys
from kvcore.tokenization import PromptTokenizer
from kvbench import synthetic, trace
from kvbench.arrivals import Arrivals
from kvbench.client import RequestRecord
from kvbench.stats import percentile, summarize
from kvbench.words import OneTokenWords
from kvbench.workload import BenchRequest, Workload, ideal_cached_tokens


@pytest.fixture(scope="module")
def words(tiny_model):
    return OneTokenWords(PromptTokenizer(tiny_model))


def _row(ts_ms, n_tokens, ids, out=100):
    return trace.TraceRow(ts_ms, n_tokens, out, tuple(ids))


def test_one_token_words_encode_one_token_each(words):
    assert len(words.words) >= 8
    sample = words.block(7, 100)
    ids = words.tokenizer.encode_text(words.text(sample), False)
    assert len(ids) == 100
    assert [words.tokenizer.decode([i]) for i in ids] == [" " + w for w in sample]
    assert words.block(7, 40) == sample[:40]  # a shorter request of the same id: a prefix of it
    assert words.block(8, 100) != sample


def test_trace_shared_hash_ids_give_identical_blocks_at_the_same_positions(words):
    k = 32
    rows = [_row(0, 4 * 512, [0, 1, 2, 3]), _row(1000, 3 * 512 + 256, [0, 1, 9, 10]),
            _row(2500, 2 * 512, [0, 11])]
    w = trace.expand_trace(rows, words, block_tokens=k, block_size=32, time_scale=2.0)
    a, b, c = (r.prompt_token_ids for r in w.requests)
    assert (len(a), len(b), len(c)) == (4 * k, 3 * k + k // 2, 2 * k)  # exact, partial block scaled
    assert a[:2 * k] == b[:2 * k]          # hash ids 0, 1 shared: tokens 0..63 identical
    assert a[2 * k:3 * k] != b[2 * k:3 * k]  # id 2 vs 9: different block
    assert a[:k] == c[:k] and a[k:2 * k] != c[k:2 * k]
    ka, kb = block_keys(a, 32, "m"), block_keys(b, 32, "m")
    assert ka[:2] == kb[:2] and ka[2] != kb[2]  # engine blocks line up with trace blocks
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.25]
    assert [r.output_tokens for r in w.requests] == [round(100 * k / 512)] * 3
    assert all(r.endpoint == "completions" and r.body["prompt"].startswith(" ") for r in w.requests)


def test_trace_prompts_are_cut_to_the_context_at_whole_blocks(words):
    rows = [_row(0, 10 * 512, range(10), out=512)]
    w = trace.expand_trace(rows, words, block_tokens=64, block_size=32, max_model_len=400)
    # 400 tokens of context minus 64 of output leave 336: five whole 64-token blocks
    assert len(w.requests[0].prompt_token_ids) == 320
    w = trace.expand_trace(rows, words, block_tokens=64, block_size=32, output_tokens=4, max_prompt_tokens=200)
    assert len(w.requests[0].prompt_token_ids) == 192 and w.requests[0].output_tokens == 4


def test_read_trace_rejects_inconsistent_rows(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 1500, "output_length": 3, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="t.jsonl:1"):
        trace.read_trace(path)
    rows = trace.read_trace(trace.DEFAULT_TRACE, limit=5)  # the shipped slice
    assert len(rows) == 5 and rows[0].hash_ids[0] == 0


def test_ideal_cached_tokens_by_hand():
    a = list(range(100, 164))               # 2 blocks of 32
    b = a + list(range(500, 540))            # shares a's 2 blocks, 1 more full block
    c = a[:32] + list(range(900, 964))       # shares only block 0
    d = list(a)                              # identical to a: the last token is always computed
    assert ideal_cached_tokens([a, b, c, d], 32) == [0, 64, 32, 32]
    w = Workload("x", [BenchRequest(i, "completions", {}, p, 1) for i, p in enumerate([a, b, c, d])], 32)
    assert w.ideal_hit_rate() == pytest.approx(128 / (64 + 104 + 96 + 64))
    assert w.distinct_blocks() == 2 + 1 + 2


def test_shared_prefix_groups_share_exactly_their_prefix(words):
    w = synthetic.shared_prefix(words, 32, groups=3, prompts_per_group=4, shared_tokens=96, own_tokens=20,
                                output_tokens=5)
    assert len(w.requests) == 12
    by_group: dict[str, list[list[int]]] = {}
    for r in w.requests:
        assert len(r.prompt_token_ids) == 116 and r.output_tokens == 5
        by_group.setdefault(r.group, []).append(r.prompt_token_ids)
    assert sorted(by_group) == ["g0", "g1", "g2"]
    for ids in by_group.values():
        assert all(p[:96] == ids[0][:96] for p in ids) and len({tuple(p[96:]) for p in ids}) == 4
    assert by_group["g0"][0][:96] != by_group["g1"][0][:96]
    # each group's 3 full shared blocks are computed once: ideal = 3 blocks x 3 later prompts x 3 groups
    assert sum(w.ideal_cached_tokens()) == 3 * 3 * 96


def test_multiturn_resends_history_and_waits_for_the_previous_turn(words):
    w = synthetic.multiturn(words, 32, conversations=3, turns=3, system_prompts=1, system_tokens=64,
                            user_tokens=10, reply_tokens=8, output_tokens=4)
    assert len(w.requests) == 9 and all(r.endpoint == "chat" for r in w.requests)
    by_conv: dict[str, list[BenchRequest]] = {}
    for r in w.requests:
        by_conv.setdefault(r.group, []).append(r)
    for turns in by_conv.values():
        assert [t.after for t in turns] == [None, turns[0].index, turns[1].index]
        for prev, nxt in zip(turns, turns[1:]):
            assert len(nxt.body["messages"]) == len(prev.body["messages"]) + 2
            # the next prompt starts with the previous one's messages, rendered the same way
            n_prev_msgs = words.tokenizer.encode_chat({"messages": prev.body["messages"],
                                                       "add_generation_prompt": False})
            assert nxt.prompt_token_ids[:len(n_prev_msgs)] == n_prev_msgs
    assert [r.after is None for r in w.requests[:3]] == [True, True, True]  # round by round


def test_kv_pressure_grows_the_live_prefixes_past_the_cluster(words):
    def make(groups):
        return synthetic.shared_prefix(words, 32, groups, 2, 128, 32, 4)
    base = make(2).distinct_blocks()
    w = synthetic.scale_for_kv_pressure(make, 2, cluster_kv_blocks=base, ratio=3.0)
    assert w.distinct_blocks() >= 3 * base
    assert w.params["kv_pressure"] == {"ratio": 3.0, "cluster_kv_blocks": base,
                                       "distinct_blocks": w.distinct_blocks()}


def test_arrivals():
    reqs = [BenchRequest(i, "completions", {}, [1], 1, arrival_s=i * 0.5) for i in range(2000)]
    w = Workload("t", reqs, 16)
    assert Arrivals("trace").send_times_s(w)[:3] == [0.0, 0.5, 1.0]
    times = Arrivals("rate", rate=20.0, seed=1).send_times_s(w)
    assert times == Arrivals("rate", rate=20.0, seed=1).send_times_s(w)  # seeded
    assert 2000 / times[-1] == pytest.approx(20.0, rel=0.1)
    assert Arrivals("concurrency", concurrency=3).send_times_s(w) is None
    with pytest.raises(ValueError, match="no timestamps"):
        Arrivals("trace").send_times_s(Workload("m", [BenchRequest(0, "chat", {}, [1], 1)], 16))
    with pytest.raises(ValueError):
        Arrivals("rate", rate=0)


def test_percentile_and_summary_figures():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    recs = [RequestRecord(0, "g", 0.0, 200, ttft_ms=100.0, e2e_ms=300.0, itl_ms=[10.0, 20.0], prompt_tokens=100,
                          cached_tokens=64, completion_tokens=3, worker="w0", cached_reported=True),
            RequestRecord(1, "g", 0.1, 200, ttft_ms=900.0, e2e_ms=1000.0, itl_ms=[30.0], prompt_tokens=100,
                          cached_tokens=0, completion_tokens=2, worker="w1", cached_reported=True),
            RequestRecord(2, "g", 0.2, 200, ttft_ms=50.0, e2e_ms=80.0, prompt_tokens=100, cached_tokens=96,
                          completion_tokens=1, worker="w0", cached_reported=True),
            RequestRecord(3, "g", 0.3, 502, error="HTTP 502")]
    s = summarize("t", recs, 2.0, [0, 64, 96, 96], ttft_target_ms=500.0)
    assert (s["requests"], s["errors"]) == (4, 1)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["p50"] == pytest.approx(20.0)
    assert s["goodput"] == pytest.approx(2 / 4)
    assert s["hit_rate"] == pytest.approx(160 / 300)
    assert s["ideal_hit_rate"] == pytest.approx(160 / 300) and s["hit_rate_of_ideal"] == pytest.approx(1.0)
    assert s["throughput_tokens_per_s"] == pytest.approx(3.0)
    assert s["per_worker"] == {"w0": {"requests": 2, "prefill_tokens": 40, "cached_tokens": 160},
                               "w1": {"requests": 1, "prefill_tokens": 100, "cached_tokens": 0}}
    assert s["requests_max_over_mean"] == pytest.approx(2 / 1.5)
    assert s["prefill_max_over_mean"] == pytest.approx(100 / 70)
    assert len(s["records"]) == 4 and s["records"][3]["status"] == 502


def test_repeats_aggregate_to_medians_and_keep_every_run():
    from kvbench.stats import aggregate_repeats

    def run(p50, hit, errors, w0):
        return {"name": "r", "requests": 10, "errors": errors, "ttft_ms": {"p50": p50, "p90": None},
                "hit_rate": hit, "per_worker": {"w0": {"requests": w0}}, "records": [{"index": 0}],
                "note": f"decisions: load {w0}"}
    agg = aggregate_repeats([run(100.0, 0.5, 0, 4), run(300.0, 0.1, 1, 6), run(200.0, 0.3, 0, 5)])
    assert agg["ttft_ms"] == {"p50": 200.0, "p90": None}
    assert agg["hit_rate"] == pytest.approx(0.3) and agg["per_worker"] == {"w0": {"requests": 5}}
    assert (agg["errors"], agg["runs"], agg["requests"]) == (1, 3, 30)  # totals over the runs
    assert [r["ttft_ms"]["p50"] for r in agg["repeats"]] == [100.0, 300.0, 200.0]
    assert [r["repeat"] for r in agg["records"]] == [0, 1, 2]
    assert agg["note"] == "run 1 of 3: decisions: load 4"  # a note is text: the first run's, said so
    assert aggregate_repeats([run(1.0, 0.2, 0, 1)])["runs"] == 1


def test_the_table_shows_each_runs_figures_under_a_repeated_target():
    from kvbench.report import per_run, table
    from kvbench.stats import aggregate_repeats

    def run(p50, p90, hit):
        return {"name": "kvroute:ttft", "requests": 4, "errors": 0, "ttft_ms": {"p50": p50, "p90": p90, "p99": p90},
                "itl_ms": {"p50": 1.0, "p99": 2.0}, "throughput_tokens_per_s": 9.0, "goodput": 1.0,
                "hit_rate": hit, "hit_rate_of_ideal": 0.5, "requests_max_over_mean": 1.0,
                "prefill_max_over_mean": 1.0, "ttft_target_ms": 1000.0, "records": []}
    agg = aggregate_repeats([run(124.4, 400.0, 0.361), run(166.0, None, 0.398), run(142.0, 380.0, 0.3625)])
    line = "per run: TTFT p50 124, 166, 142; p90 400, -, 380; hit rate 0.361, 0.398, 0.362"
    assert per_run(agg) == line  # in run order, beside the medians (p50 142)
    report = {"workload": {"name": "multiturn", "requests": 4, "mean_prompt_tokens": 900.0, "ideal_hit_rate": 0.7},
              "arrivals": "closed loop", "targets": [agg, {**run(150.0, 390.0, 0.2), "runs": 1}]}
    lines = table(report).splitlines()
    assert lines[0].endswith("medians of 3 runs") and lines[3].strip() == line
    assert len(lines) == 5 and per_run(report["targets"][1]) is None  # a single run: no such line


def test_kendall_tau_and_rank_agreement():
    from kvbench.compare import agreement, kendall_tau

    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(4 / 6)

    def rep(vals):
        return {"targets": [{"name": n, "ttft_ms": {"p50": p, "p90": p}, "hit_rate": h} for n, p, h in vals]}
    rows = agreement(rep([("a", 100, 0.5), ("b", 200, 0.4), ("c", 300, 0.1)]),
                     rep([("b", 20, 0.3), ("a", 10, 0.6), ("c", 30, 0.35), ("d", 1, 0.9)]))
    assert [r["figure"] for r in rows] == ["TTFT p50", "TTFT p90", "hit rate"]
    assert rows[0]["order_a"] == rows[0]["order_b"] == ["a", "b", "c"] and rows[0]["kendall_tau"] == 1.0
    assert rows[2]["order_a"] == ["a", "b", "c"] and rows[2]["order_b"] == ["a", "c", "b"]
    assert rows[2]["kendall_tau"] == pytest.approx(1 / 3)
