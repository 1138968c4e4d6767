"""``benchmarks/bench_model_line.py`` runs small and prints both variants: with every refit
published, each refit of the model's line is a new line; with the dead band, fewer are."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_quick_run_prints_both_variants_and_the_dead_band_publishes_fewer_lines():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_model_line.py"), "--workers", "16",
                          "--requests", "80", "--rounds", "2"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.splitlines()[0] == "16 workers, 80 requests x 2 rounds per variant, noise 0.2"
    rows = {m.group(1): [float(m.group(i)) for i in range(2, 7)]
            for m in re.finditer(r"^(dead band 0\.05|every refit)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)/(\d+)$",
                                 out, re.M)}
    assert set(rows) == {"dead band 0.05", "every refit"}, out
    assert rows["every refit"][3:] == [40.0, 40.0]  # 2 x 80 requests: a refit every 4th, each published
    assert rows["dead band 0.05"][4] == 40.0 and 0 <= rows["dead band 0.05"][3] < 40
    assert all(v > 0 for row in rows.values() for v in row[:3])
