"""tools/gpu_check_connector.py runs on CPU (``--device cpu --tiny``): exit 0, every correctness
section that applies on CPU has ok rows, the CUDA-only ones are recorded as skipped, and the perf
rows carry numbers for every size."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check_connector.py"), "--device", "cpu",
                           "--tiny", "--out", str(tmp_path), "--budget-s", "120"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())
    by = {}
    for r in rows:
        by.setdefault(r["section"], []).append(r)

    env = by["env"][0]
    assert env["torch"].startswith("2.") and env["slab"] == "local" and env["slab_pinned"] is False
    assert env["uname_r"]
    assert env["dev_shm_free"] is None or env["dev_shm_free"] >= 0

    # A: 6 layouts of vLLM 0.32 + 2 legacy, x 3 dtypes, all ok
    a = by["A"]
    assert len(a) == 8 * 3 and all(r["ok"] is True for r in a), [r for r in a if not r["ok"]]
    assert {r["layout"] for r in a} == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "2BNHD", "B2NHD"}
    assert {r["dtype"] for r in a} == {"bf16", "uint8", "fp8e4m3"}
    for section, count in (("B", 2), ("D", 1), ("F", 1), ("G", 2)):
        assert len(by[section]) == count and all(r["ok"] is True for r in by[section]), by[section]
    assert "invalid [" in by["D"][0]["note"] and "4 spills" in by["D"][0]["note"]
    for section in ("C", "E", "H"):
        assert by[section][0]["ok"] is None and "CUDA only" in by[section][0]["note"]

    perf = by["perf"]
    for layout in ("LBNHC", "BLHNC"):
        for what in ("save", "load"):
            got = [r for r in perf if r["layout"] == layout and r["note"].startswith(what)]
            assert sorted(r["n"] for r in got) == [1, 8, 32]
            for r in got:
                assert r["bytes"] == r["n"] * 16384
                assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["ratio"] > 0 and r["host_ms"] >= 0
    base = [r for r in perf if r["layout"] == "baseline-host"]
    assert len(base) == 6 and all(r["gbps"] > 0 for r in base)
    for layout in ("copies-4k", "proto-BL"):  # per-(block, layer) copies; BLHNC one copy per block
        got = [r for r in perf if r["layout"] == layout]
        assert sorted(r["n"] for r in got) == [1, 8, 32] and all(r["gbps"] > 0 and r["ratio"] > 0 for r in got)
    assert by["done"][0]["note"].startswith("0 correctness failures")
    assert "section |" in proc.stdout  # the table
