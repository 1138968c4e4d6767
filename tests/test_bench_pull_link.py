"""benchmarks/bench_pull_link.py runs end to end at tiny sizes (one repeat): raw TCP, the peer
client and the agent link each move every block (the script fails when one comes short), and the
figures are printed and written with their units (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_pull_link_prints_and_writes_every_method(tmp_path: Path) -> None:
    out = tmp_path / "pull.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pull_link.py"), "--repeats", "1",
                          "--block-bytes", "4096", "8192", "--blocks", "2", "5", "--run-mib", "0", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "median of 1 rounds" in lines[0] and lines[1].split() == ["block", "blocks", "raw_tcp", "peer", "agent",
                                                                  "agent_into"]
    assert [ln.split()[:2] for ln in lines[2:]] == [["4KiB", "2"], ["4KiB", "5"], ["8KiB", "2"], ["8KiB", "5"]]
    rows = json.loads(out.read_text())["tables"]["pull_link"]
    assert len(rows) == 16 and {r["method"] for r in rows} == {"raw_tcp", "peer", "agent", "agent_into"}
    for r in rows:
        assert r["pull_bytes"] == r["block_bytes"] * r["blocks"] and r["repeats"] == 1
        assert r["gbit_s"] > 0 and r["runs_gbit_s"] == [r["gbit_s"]] and r["ratio_to_raw_tcp"] > 0
    assert [r["ratio_to_raw_tcp"] for r in rows if r["method"] == "raw_tcp"] == [1.0] * 4
