"""benchmarks/bench_routing_quality.py as a script: by default it reads the trace slice the repo
ships, and a missing ``--trace`` is an error (exit 2), not a silent skip."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_routing_quality.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_default_trace_is_the_shipped_slice():
    r = run("--limit", "40", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("40 requests, 2 workers x 1000 GPU")
    rows = [line.split()[0] for line in r.stdout.splitlines()[3:]]
    assert rows == ["kv_aware"] * 4 + ["round_robin", "least_load", "session"]


def test_missing_trace_fails_with_a_clear_message(tmp_path):
    missing = tmp_path / "nope.jsonl"
    r = run("--trace", str(missing))
    assert r.returncode == 2 and r.stdout == ""
    assert f"trace {missing} not found" in r.stderr and "--trace PATH" in r.stderr
