"""``benchmarks/bench_queue_scale.py`` runs small: every waiting request stays queued for its
busy holder while other workers open, is decided over every worker at the first opening and over
the changed workers only at each later one, and the table has one row per waiting count."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_quick_run_keeps_each_request_waiting_for_its_holder_and_prints_a_row_per_count():
    printed = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_queue_scale.py"), "--workers", "12",
                              "--waiting", "1,4", "--openings", "6"], capture_output=True, text=True, timeout=120,
                             check=True).stdout.splitlines()
    assert printed[0].split() == ["workers", "waiting", "pump", "ms", "p50", "max", "per", "waiting", "ms", "left",
                                  "decisions:", "all", "changed", "only"]
    rows = [line.split() for line in printed[1:]]
    # (workers, waiting, left, decisions over every worker, over the changed ones): 6 openings
    assert [(r[0], r[1], r[5], r[6], r[7]) for r in rows] == [("12", "1", "0", "1", "5"), ("12", "4", "0", "4", "20")]
    assert all(float(r[2]) <= float(r[3]) for r in rows)  # the median is at most the largest


def test_fresh_requests_at_an_empty_queue_keep_their_decision():
    printed = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_queue_scale.py"), "--workers", "4,12",
                              "--fresh", "20"], capture_output=True, text=True, timeout=120,
                             check=True).stdout.splitlines()
    assert printed[0].split() == ["workers", "requests", "plan", "us", "p50", "take_turn", "us", "p50", "kept"]
    rows = [line.split() for line in printed[1:]]
    assert [(r[0], r[1], r[4]) for r in rows] == [("4", "20", "20"), ("12", "20", "20")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
