"""benchmarks/bench_probe_cpu.py runs end to end at a tiny size: 4 virtual workers followed by a
2-process gateway, every process probing and then one prober; the workers' own call counts show
the prober answering for both processes (counts, not timings). The workers also publish KV events,
which the benchmark checks reached the gateway's index for every worker."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_probe_cpu_prints_and_writes_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_probe_cpu.py"), "--workers", "4",
                          "--processes", "2", "--seconds", "3", "--settle-s", "2", "--event-rate", "10",
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["tables"]["idle"]}
    assert set(rows) == {"every process", "one prober"}
    assert all(r["workers"] == 4 and r["processes"] == 2 and r["gateway_cpu_ms_per_s"] > 0 for r in rows.values())
    # 4 workers, a health probe every 2 s and a scrape every 1 s: ~6 calls/s per process that calls
    every, one = rows["every process"]["worker_calls_per_s"], rows["one prober"]["worker_calls_per_s"]
    assert 9 <= every <= 15 and 4 <= one <= 8, (every, one)
    assert "one prober" in run.stdout and "every process" in run.stdout
