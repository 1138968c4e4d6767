"""kvroute bench end to end on simulated workers: `bench rig` with kvroute's kv_aware and round
robin on the same two sims, and `bench run` against one sim with its counters and cache reset."""
from __future__ import annotations

import json
import subprocess

from conftest import kvroute_argv

from kvcore.tokenization import PromptTokenizer
from kvbench import synthetic
from kvbench.rig import engine_ttft_report
from kvbench.rig_cli import rotated
from kvbench.words import OneTokenWords

RIG_TIMEOUT_S = 240


def test_rig_runs_kv_aware_and_round_robin_on_the_same_sims(tiny_model, tmp_path):
    out = tmp_path / "rig.json"
    argv = kvroute_argv("bench", "rig", "--workers", "2", "--engine", "sim", "--speedup", "10",
                        "--routers", "kvroute:kv_aware,kvroute:round_robin", "--workload", "shared-prefix",
                        "--model", "tiny", "--tokenizer", str(tiny_model), "--groups", "2",
                        "--prompts-per-group", "6", "--shared-tokens", "256", "--own-tokens", "40",
                        "--output-tokens", "8", "--concurrency", "2", "--repeats", "2", "--no-progress", "--json", str(out),
                        "--num-gpu-blocks-override", "64",
                        "--plot", str(tmp_path / "plots"), "--log-dir", str(tmp_path / "logs"))
    r = subprocess.run(["timeout", "-s", "INT", "-k", "20", str(RIG_TIMEOUT_S), *argv],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    # the same requests the rig built, rebuilt here: the figures are checked against them
    words = OneTokenWords(PromptTokenizer(tiny_model))
    workload = synthetic.shared_prefix(words, 32, 2, 6, 256, 40, 8)
    assert report["workload"]["requests"] == 12
    assert report["workload"]["ideal_hit_rate"] == workload.ideal_hit_rate()
    # the capacity bound of the cluster's 2 x 64 blocks: room for every block, so the ideal
    assert (report["workload"]["capacity_blocks"], report["workload"]["capacity_hit_rate"]) == (128, workload.ideal_hit_rate())
    assert f"ideal hit rate {workload.ideal_hit_rate():.3f}, at most {workload.ideal_hit_rate():.3f} in 128 KV blocks" in r.stderr
    assert [t["name"] for t in report["targets"]] == ["kvroute:kv_aware", "kvroute:round_robin"]
    lengths = [len(q.prompt_token_ids) for q in workload.requests]
    for t in report["targets"]:
        assert (t["requests"], t["errors"], t["runs"]) == (24, 0, 2)  # totals; figures are medians of 2 runs
        assert [rec["repeat"] for rec in t["records"]] == [0] * 12 + [1] * 12
        assert [run["requests"] for run in t["repeats"]] == [12, 12]
        recs = t["records"][:12]
        assert [rec["prompt_tokens"] for rec in t["records"]] == lengths * 2  # exact, as vLLM counts them
        assert all(rec["completion_tokens"] == 8 and rec["status"] == 200 for rec in recs)
        assert {rec["worker"] for rec in recs} <= {"w0", "w1"}
        assert [sum(w["requests"] for w in run["per_worker"].values()) for run in t["repeats"]] == [12, 12]
        assert 0 < t["ttft_ms"]["p50"] <= t["ttft_ms"]["p90"] <= t["ttft_ms"]["p99"]
        assert t["hit_rate"] <= report["workload"]["ideal_hit_rate"] + 1e-9
    kv, rr = report["targets"]
    # caches were reset between routers: round robin's first request of each group is a miss
    assert rr["records"][0]["cached_tokens"] == 0 and kv["records"][0]["cached_tokens"] == 0
    # round robin spreads evenly; it recomputes each 256-token prefix on both workers
    assert rr["per_worker"]["w0"]["requests"] == rr["per_worker"]["w1"]["requests"] == 6
    assert kv["cached_tokens"] >= rr["cached_tokens"]
    for run in kv["repeats"]:  # the gateway's own account of each run, from its /metrics
        assert sum(run["gateway"]["decisions_by_reason"].values()) == 12
        # also for streams whose client closed on [DONE] before the worker's end of stream
        assert run["gateway"]["reported_cached_tokens"] == run["cached_tokens"]
        assert run["gateway"]["reported_requests"] == 12
        split = run["gateway"]["ttft_split_ms"]  # every request paired with its decision
        assert split["requests"] == 12 and split["gateway"]["mean"] > 0 and split["worker"]["mean"] > 0
        assert "TTFT split, mean/p90 ms: gateway " in run["note"]
    # each kvroute run's decision log, saved beside the logs: one entry per request, oldest first,
    # named by workload index, with the worker and the cached tokens the records show
    for label, target in (("kv_aware", kv), ("round_robin", rr)):
        for n in range(2):
            decisions = json.loads((tmp_path / "logs" / f"decisions-kvroute-{label}-{n}.json").read_text())
            assert len(decisions) == 12
            recs = {rec["index"]: rec for rec in target["records"] if rec["repeat"] == n}
            for d in decisions:
                rec = recs[int(d["request_id"].split("-")[1])]
                tokens = rec["prompt_tokens"] if label == "kv_aware" else None  # round robin never tokenizes
                assert (d["worker"], d["actual_cached_tokens"], d["prompt_tokens"]) == (
                    rec["worker"], rec["cached_tokens"], tokens)
                assert d["policy"] == label
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "hit_rate_over_time.png", "ttft_cdf.png", "worker_load.png"]
    assert "kvroute:kv_aware" in r.stdout and "hit rate" in r.stdout  # the table
    assert r.stdout.count("per run: TTFT p50 ") == 2  # each target's two runs, beside the medians
    # each round starts one router later: no router always runs first after the workers start
    order = [line.split(": ", 1)[1] for line in r.stderr.splitlines() if line.startswith("[rig] run ")]
    assert order == ["kvroute:kv_aware", "kvroute:round_robin", "kvroute:round_robin", "kvroute:kv_aware"]


def test_each_round_of_a_rig_run_starts_one_router_later():
    routers = ["kvroute:ttft", "kvroute:round_robin", "sglang:cache_aware"]
    assert [rotated(routers, rep) for rep in range(4)] == [
        routers, routers[1:] + routers[:1], routers[2:] + routers[:2], routers]
    assert rotated([], 3) == [] and rotated(["a"], 5) == ["a"]


def test_run_against_one_sim_reads_its_counters_after_a_reset(tiny_model, tmp_path, procs):
    from conftest import free_port, wait_http

    port = free_port()
    sim = procs("sim", kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny",
                                    "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
                                    "--enable-prompt-tokens-details", "--speedup", "20"))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", sim)
    out = tmp_path / "run.json"
    argv = kvroute_argv("bench", "run", "--target", f"direct={url}/v1", "--worker", f"s0={url}", "--reset-cache",
                        "--workload", "multiturn", "--model", "tiny", "--tokenizer", str(tiny_model),
                        "--block-size", "32", "--conversations", "3", "--turns", "2", "--system-tokens", "96",
                        "--output-tokens", "4", "--rate", "50", "--no-progress", "--json", str(out),
                        "--cluster-kv-blocks", "1000")
    for _ in range(2):  # twice: the reset makes the second run start cold too
        r = subprocess.run(["timeout", "-k", "10", "120", *argv], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        report = json.loads(out.read_text())
        t = report["targets"][0]
        assert (t["requests"], t["errors"]) == (6, 0)
        # 1,000 blocks hold the whole workload: the capacity bound is the ideal, and said so
        w = report["workload"]
        assert (w["capacity_blocks"], w["capacity_hit_rate"]) == (1000, w["ideal_hit_rate"])
        assert f"ideal hit rate {w['ideal_hit_rate']:.3f}, at most {w['ideal_hit_rate']:.3f} in 1000 KV blocks" in r.stderr
        assert all(rec["worker"] is None for rec in t["records"])  # no router header: counters used
        assert t["per_worker"] == {"s0": {"requests": 6, "prefill_tokens": t["prompt_tokens"] - t["cached_tokens"],
                                          "cached_tokens": t["cached_tokens"]}}
        # one worker, one cache: every second turn hits its whole first turn's full blocks
        assert t["hit_rate"] == t["ideal_hit_rate"] > 0


def test_bad_flags_and_unreachable_targets_get_a_clear_error_and_exit_2(tiny_model, tmp_path):
    from conftest import free_port

    base = ["bench", "run", "--workload", "trace", "--model", "tiny", "--tokenizer", str(tiny_model)]
    dead = f"dead=http://127.0.0.1:{free_port()}"
    r = subprocess.run(kvroute_argv(*base, "--target", dead, "--limit", "0"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--limit: must be >= 1" in r.stderr
    r = subprocess.run(kvroute_argv(*base, "--target", dead, "--limit", "5"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "no answer from http://127.0.0.1:" in r.stderr and "Traceback" not in r.stderr
    bad_trace = tmp_path / "t.jsonl"
    bad_trace.write_text('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n')
    r = subprocess.run(kvroute_argv("bench", "rig", "--workload", "trace", "--trace", str(bad_trace), "--model", "tiny",
                                    "--tokenizer", str(tiny_model), "--routers", "kvroute:no_such_policy"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown policy name 'no_such_policy'" in r.stderr
    r = subprocess.run(kvroute_argv("bench", "rig", "--workload", "trace", "--trace", str(bad_trace), "--model", "tiny",
                                    "--tokenizer", str(tiny_model), "--routers", "kvroute:kv_aware"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "t.jsonl:1: input_length must be >= 1" in r.stderr


def test_engine_ttft_report_is_the_runs_share_of_the_engines_histograms():
    """(seconds, requests) summed over the workers before and after a run: 3 requests took 0.6 s
    in the engines, the client saw 250 ms on average, so 50 ms was outside the engines."""
    assert engine_ttft_report((10.0, 40), (10.6, 43), 250.0) == {"mean": 200.0, "requests": 3, "outside_mean": 50.0}
    assert engine_ttft_report(None, (10.6, 43), 250.0) is None      # a simulated worker: no histogram
    assert engine_ttft_report((10.0, 40), (10.0, 40), 250.0) is None  # no request reached an engine
    assert engine_ttft_report((10.0, 40), (10.6, 43), None) is None   # no client TTFT
