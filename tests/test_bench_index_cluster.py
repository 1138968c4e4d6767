"""benchmarks/bench_index_cluster.py runs end to end in its quick mode: it starts a 3-shard Redis
Cluster, populates 8 and then 32 workers through it, checks that the plain cluster index, its
mirror and the memory index agree, and prints and writes p50/p99 per variant (values, not
timings, are asserted)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.index import chain_rows

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"cluster (plain)", "cluster + mirror", "memory", "redis-py RedisCluster (fetch)"}


def test_bench_index_cluster_quick_prints_and_writes_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_index_cluster.py"), "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    sizes = json.loads(out.read_text())["sizes"]
    assert [s["workers"] for s in sizes] == [8, 32]
    for s in sizes:
        assert set(s["variants"]) == VARIANTS
        assert sorted(s["partitions_per_shard"].values()) == [5, 5, 6]
        for v in s["variants"].values():
            assert 0 < v["p50_ms"] <= v["p99_ms"] and len(v["repeats_p50_p99_ms"]) == 1
    assert "3-shard Redis Cluster" in run.stdout and "cluster + mirror" in run.stdout


def test_timed_picks_the_variants_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "mirror.json"
    bench = [sys.executable, str(REPO / "benchmarks" / "bench_index_cluster.py"), "--quick", "--workers", "8"]
    run = subprocess.run([*bench, "--timed", "cluster + mirror", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    [size] = json.loads(out.read_text())["sizes"]
    assert size["workers"] == 8 and set(size["variants"]) == {"cluster + mirror"}
    bad = subprocess.run([*bench, "--timed", "mirror"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "--timed: variants of cluster (plain), cluster + mirror" in bad.stderr
    bad = subprocess.run([*bench, "--paths", "fortran"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "--paths: ['fortran']: not available" in bad.stderr


def test_paths_time_each_variant_once_per_lookup_path(tmp_path: Path) -> None:
    if chain_rows.native is None:
        pytest.skip("the C extension is not built: numpy is the only path")
    out = tmp_path / "paths.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_index_cluster.py"), "--quick",
                          "--workers", "8", "--timed", "cluster + mirror,memory", "--paths", "native,numpy",
                          "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    [size] = json.loads(out.read_text())["sizes"]
    assert set(size["variants"]) == {f"{v} [{p}]" for v in ("cluster + mirror", "memory") for p in ("native", "numpy")}
    assert all(len(v["repeats_p50_p99_ms"]) == 1 for v in size["variants"].values())
