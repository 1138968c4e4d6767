"""benchmarks/bench_transfer_engines.py as a script, briefly (tiny blocks, 1 repeat): it prints and
writes rows for raw TCP and our peer path, every case's bytes verified; a transfer engine that is
not importable by this interpreter is reported as such and the rest still runs (one that is
importable is run too and must not fail). No timing assertions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_transfer_engines.py"
ENGINES = ("mooncake-tcp", "nixl-ucx-tcp")


def _run(tmp_path: Path, methods: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "te.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--repeats", "1", "--block-kib", "4,16", "--blocks", "2,3",
                           "--methods", methods, "--engine-python", sys.executable, "--setup-timeout-s", "60",
                           "--transfer-timeout-s", "30", "--deadline-s", "240", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_raw_tcp_and_peer_path_rows_printed_and_written(tmp_path):
    proc, fig = _run(tmp_path, ",".join(("raw-tcp", "kvroute-peer") + ENGINES))
    assert "median of 1 repeats" in proc.stdout
    assert "raw-tcp" in proc.stdout and "kvroute-peer" in proc.stdout
    assert "4 KiB x 2" in proc.stdout and "16 KiB x 3" in proc.stdout
    assert fig["benchmark"] == "bench_transfer_engines" and fig["settings"]["repeats"] == 1
    rows = fig["tables"]["transfer"]
    cases = {(4096, 2), (4096, 3), (16384, 2), (16384, 3)}
    for method in ("raw-tcp", "kvroute-peer"):
        mine = [r for r in rows if r["method"] == method]
        assert {(r["block_bytes"], r["blocks"]) for r in mine} == cases
        for r in mine:
            assert r["payload_bytes"] == r["block_bytes"] * r["blocks"]
            assert r["bits_per_s"] > 0 and r["repeats"] == 1 and len(r["runs_s"]) == 1 and r["verified"] is True
            assert r["ratio_to_raw_tcp"] > 0
    assert all(r["ratio_to_raw_tcp"] == 1.0 for r in rows if r["method"] == "raw-tcp")
    status = {m["method"]: m for m in fig["tables"]["methods"]}
    assert status["raw-tcp"]["status"] == status["kvroute-peer"]["status"] == "ran"
    for engine in ENGINES:             # not installed / does not load here: said so, no rows; else it ran
        st = status[engine]
        assert st["status"] in ("ran", "not installed", "does not load"), st
        engine_rows = [r for r in rows if r["method"] == engine]
        if st["status"] == "ran":
            assert len(engine_rows) == len(cases) and all(r["verified"] for r in engine_rows)
        else:
            assert not engine_rows and f"{engine}: {st['status']}" in proc.stdout


def test_an_unknown_method_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--methods", "raw-tcp,carrier-pigeon"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "carrier-pigeon" in proc.stderr
