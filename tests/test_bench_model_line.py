"""``benchmarks/bench_model_line.py`` runs small and reports both variants: with every refit
published, each refit of the model's line (one per 4 requests) is a new line; with the dead
band (the registry's own estimator), fewer are."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_quick_run_reports_both_variants_and_the_dead_band_publishes_fewer_lines(tmp_path):
    out = tmp_path / "model_line.json"
    printed = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_model_line.py"), "--workers", "16",
                              "--requests", "80", "--rounds", "2", "--json", str(out)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    assert printed.splitlines()[0] == "16 workers, 80 requests x 2 rounds per variant, noise 0.2"
    rows = {r["model_line"]: r for r in json.loads(out.read_text())["tables"]["model_line"]}
    assert set(rows) == {"dead band 0.05", "every refit"}
    # 2 x 80 requests on warm estimators: a refit every 4th, each one published without the band
    assert rows["every refit"]["refits"] == rows["every refit"]["lines_published"] == 40
    assert rows["dead band 0.05"]["refits"] == 40 and rows["dead band 0.05"]["lines_published"] < 10
    assert all(r["workers"] == 16 for r in rows.values())
    for name, r in rows.items():
        assert f"{r['lines_published']:>8}/{r['refits']}" in printed and printed.count(name) == 1
