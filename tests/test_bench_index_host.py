"""benchmarks/bench_index_host.py runs end to end in its quick mode (16 and 64 workers): it fills a
host index, checks every worker's match, and times lookups in a second process on each lookup
path (values, not timings, are asserted)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvcore.index import chain_rows

REPO = Path(__file__).resolve().parents[1]
BENCH = [sys.executable, str(REPO / "benchmarks" / "bench_index_host.py"), "--quick"]


def test_quick_ladder_times_both_paths_and_writes_the_rows(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    paths = ["native", "numpy"] if chain_rows.native is not None else ["numpy"]
    run = subprocess.run([*BENCH, "--shape", "ladder", "--write-rate", "500", "--out", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert (doc["shape"], doc["prompt_blocks"], doc["blocks_per_worker"]) == ("ladder", 256, 512)
    assert [r["workers"] for r in doc["rows"]] == [16, 64]
    for row in doc["rows"]:
        assert row["entries"] == row["workers"] * 512 and row["dropped_keys"] == 0
        assert list(row["paths"]) == paths
        for fig in row["paths"].values():
            assert 0 < fig["host_lookup_ms"]["p50"] <= fig["host_lookup_ms"]["p99"]
            assert fig["host_lookup_under_writes_ms"]["writes_applied"] > 0
            assert fig["memory_lookup_ms"]["p50"] > 0
        assert row["host_lookup_ms"] == row["paths"][paths[0]]["host_lookup_ms"]
    for p in paths:
        assert f"{p:>6}: lookup p50/p99" in run.stdout


def test_an_unknown_path_is_refused() -> None:
    bad = subprocess.run([*BENCH, "--paths", "fortran"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "--paths: ['fortran']: not available" in bad.stderr
