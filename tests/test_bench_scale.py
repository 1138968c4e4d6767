"""``benchmarks/bench_scale.py --quick``: virtual workers' event streams into the index and into a
real ``kvroute serve``; the figures it reports are checked against what the streams should make."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.tokenization import PromptTokenizer
from kvbench import scale
from kvbench.trace import DEFAULT_TRACE, expand_trace, read_trace
from kvbench.words import OneTokenWords
from simulator.block_pool import engine_block_hashes

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests/fixtures/tiny-model"


def test_trace_tokens_match_expand_trace_and_engine_hashes_the_simulators():
    words = OneTokenWords(PromptTokenizer(str(TINY)))
    word_ids = [words.tokenizer.encode_text(" " + w, False)[0] for w in words.words]
    tokens = scale.TraceTokens(word_ids, words.tokenizer.encode_text("", True))
    rows = read_trace(DEFAULT_TRACE, limit=3)
    for req, row in zip(expand_trace(rows, words, 512, 16).requests, rows):
        assert tokens.prompt(row.hash_ids, row.input_length) == req.prompt_token_ids
    ids = tokens.prompt(rows[0].hash_ids, rows[0].input_length)
    assert scale.engine_hashes(ids, 16) == engine_block_hashes(ids, 16, scale.ENGINE_SEED)
    # a copy is another conversation from block 0 on; its later trace blocks are the same ids
    other = tokens.prompt(rows[0].hash_ids, rows[0].input_length, copy=1)
    assert other[:512] != ids[:512] and other[512:] == ids[512:]
    assert scale.largest_cluster(1e-6, 500.0, 2.0) == pytest.approx(1000.0)


def test_quick_run_reports_what_the_streams_make(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_scale.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["tables"]["scale"]
    assert [r["workers"] for r in rows] == [8, 32]
    for r in rows:
        d = r["direct"]
        assert d["entries"] == d["entries_expected"] > 0 and d["entries_match"]
        assert d["routed_prompts_found"] == d["routed_prompts_checked"] == r["workers"]
        assert d["long_prompt_blocks"] == d["long_prompt_matched_blocks"] == 2048
        for key in ("ingest_state_bytes_per_entry", "index_bytes_per_entry", "index_heap_bytes_per_entry"):
            assert d[key] > 0, key
        run = d["ingest_runs"][0]
        assert run["events"] == r["events"] > 0 and run["blocks"] == r["blocks"] > 0
        assert 0 < run["events_per_cpu_s"] < run["blocks_per_cpu_s"]  # every event carries a block or more
        for kind in ("trace", "long"):
            assert d["lookups"][kind]["lookups"] > 0 and 0 < d["lookups"][kind]["p50_ms"] <= d["lookups"][kind]["p99_ms"]
        assert d["decode"]["wide_vocab_bytes_per_event"] > d["decode"]["test_vocab_bytes_per_event"] > 0
        assert r["steady_events_per_request"] > 0 and r["largest_cluster_direct"] > 0
        g = r["gateway"]
        assert "error" not in g, g
        gi = g["ingest"]
        assert gi["entries"] == d["entries"] and gi["entries_match"]
        assert gi["events_per_cpu_s"] > 0 and gi["rss_bytes_per_entry"] != 0
        assert g["idle_cpu_ms_per_s"] >= 0
        # the fleet answers vLLM's filtered /metrics form, and the gateway scraped every worker in it
        assert g["load_scrape"] == {"filtered": r["workers"], "whole": 0, "undecided": 0}
        assert g["requests"]["ok"] == g["requests"]["sent"] > 0 and g["requests"]["cpu_ms_per_request"] > 0
        assert r["largest_cluster_gateway"] > 0
