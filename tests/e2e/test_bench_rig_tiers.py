"""``kvroute bench rig --engine vllm --cpu-tier-bytes``: two real vLLM servers (the generated
"tiny" model) whose caches are too small for a multi-turn workload, each with a CPU tier behind
kvroute's KV connector. The tier serves what the engines evicted, so the hit rate passes the
capacity bound of the engines' own blocks (the most any router could hit without a tier), and
the reset between runs empties the tiers too: the second run's first turns miss again.
"""
from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from conftest import kvroute_argv
from e2e.conftest import REPO, vllm_python
from e2e.tier_checks import TINY_BLOCK_BYTES
from kvbench.flags import workload_from_args
from model_cache import ensure_model

GPU_BLOCKS = 24            # per worker: 2 x 24 blocks hold half of the workload's 96 distinct blocks
CPU_TIER_BYTES = 200 * TINY_BLOCK_BYTES  # room for every block of the workload on each worker
RIG_TIMEOUT_S = 900


def test_a_cpu_tier_lifts_hits_past_what_the_engines_blocks_allow_and_is_reset_between_runs(tmp_path):
    model = ensure_model("tiny", vllm_python())
    flags = ["--workload", "multiturn", "--model", "tiny", "--tokenizer", str(model), "--conversations", "6",
             "--turns", "3", "--system-tokens", "300", "--user-tokens", "40", "--reply-tokens", "30",
             "--output-tokens", "4", "--concurrency", "2"]
    out = tmp_path / "rig.json"
    argv = kvroute_argv("bench", "rig", "--engine", "vllm", "--vllm-python", vllm_python(), "--workers", "2",
                        "--num-gpu-blocks-override", str(GPU_BLOCKS), "--max-model-len", "640",
                        "--vllm-args", "--enforce-eager --dtype bfloat16", "--cpu-tier-bytes", str(CPU_TIER_BYTES),
                        "--routers", "kvroute:ttft", "--repeats", "2", "--no-progress", "--json", str(out),
                        "--log-dir", str(tmp_path / "logs"), *flags)
    r = subprocess.run(["timeout", "-s", "INT", "-k", "30", str(RIG_TIMEOUT_S), *argv], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[rig] warming the workers up (8 requests each)" in r.stderr
    report = json.loads(out.read_text())
    assert report["rig"]["cpu_tier_bytes_per_worker"] == CPU_TIER_BYTES
    assert "capacity_hit_rate" not in report["workload"]  # the engines' blocks alone bound nothing here

    # the same requests the rig built: what the engines' 48 blocks allow without a tier
    ns = argparse.Namespace(tokenizer=str(model), block_size=32, workload="multiturn", output_tokens=4,
                            conversations=6, turns=3, system_prompts=None, system_tokens=300, user_tokens=40,
                            reply_tokens=30, seed=0, kv_pressure=None)
    workload = workload_from_args(ns)
    assert workload.distinct_blocks() >= 2 * 2 * GPU_BLOCKS  # the engines hold at most half of it
    bound = workload.capacity_hit_rate(2 * GPU_BLOCKS)
    assert bound < workload.ideal_hit_rate()

    (t,) = report["targets"]
    assert (t["requests"], t["errors"], t["runs"]) == (36, 0, 2)
    for run in t["repeats"]:
        assert run["hit_rate"] > bound + 0.05, (run["hit_rate"], bound)  # served from the CPU tiers
        # the engines' own TTFT histograms counted exactly this run's requests, each within the client's
        engine = run["engine_ttft_ms"]
        assert engine["requests"] == 18
        assert 0 < engine["mean"] < run["ttft_ms"]["mean"]
        assert engine["outside_mean"] == pytest.approx(run["ttft_ms"]["mean"] - engine["mean"], abs=0.11)
    second = sorted((rec for rec in t["records"] if rec["repeat"] == 1), key=lambda rec: rec["index"])
    # the first turns of the second run: nothing of the first run survived in a cache or a tier
    assert [rec["cached_tokens"] for rec in second[:6]] == [0] * 6
    assert sum(rec["cached_tokens"] for rec in second[6:]) > 0
