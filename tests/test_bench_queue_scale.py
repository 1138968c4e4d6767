"""``benchmarks/bench_queue_scale.py`` runs small: every waiting request stays queued for its
busy holder while other workers open, and the table has one row per waiting count."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_quick_run_keeps_each_request_waiting_for_its_holder_and_prints_a_row_per_count():
    printed = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_queue_scale.py"), "--workers", "12",
                              "--waiting", "1,4", "--openings", "6"], capture_output=True, text=True, timeout=120,
                             check=True).stdout.splitlines()
    assert printed[0].split() == ["workers", "waiting", "pump", "ms", "p50", "max", "per", "waiting", "ms", "left"]
    rows = [line.split() for line in printed[1:]]
    assert [(r[0], r[1], r[-1]) for r in rows] == [("12", "1", "0"), ("12", "4", "0")]
    assert all(float(r[2]) <= float(r[3]) for r in rows)  # the median is at most the largest
