"""Benchmarks draw (issue 14): :mod:`lab.figures` on a synthetic figures dict (JSON
round-trip, one valid PNG per chart, redrawn from the JSON alone), and the three cheapest
benchmark scripts run end to end with tiny settings and ``--json``/``--plot``: their JSON holds
the shared keys and tables of real numbers, their PNGs exist.

Each script runs in its own session with a timeout; the processes a script starts have their own
hard deadlines (``timeout -s KILL``), so everything stops by itself."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lab import figures as F

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCRIPT_TIMEOUT_S = 180


def assert_pngs(folder: Path, names: set[str]) -> None:
    """The files in ``folder`` are ``names``, each a non-empty PNG (subfolders are not looked at)."""
    assert {p.name for p in folder.iterdir() if p.is_file()} == names
    for name in names:
        data = (folder / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, name


def synthetic() -> dict:
    fig = F.new_figures("synthetic", {"requests": 3, "out": Path("/tmp/x"), "ratio": float("nan")},
                        argv=["--requests", "3"])
    F.add_table(fig, "latency", [
        {"workload": "short", "target": t, "p50_ms": p50, "p99_ms": p50 * 3, "added_p50_ms": None if t == "direct"
         else p50 - 1.0} for t, p50 in (("direct", 1.0), ("kvroute", 1.5), ("other", 1.2))])
    F.add_table(fig, "latency", [{"workload": "long", "target": "direct", "p50_ms": 4.0, "p99_ms": float("inf")}])
    F.add_table(fig, "memory", [{"what": "gateway", "rss_idle_bytes": 50 * 2**20, "rss_peak_bytes": 80 * 2**20}])
    for t, scale in (("direct", 1.0), ("kvroute", 1.3)):
        F.add_samples(fig, "ttft_ms", t, [scale * (1 + i % 7) for i in range(50)])
        F.add_series(fig, "hit_rate", t, [(i, min(1.0, scale * i / 10)) for i in range(10)])
    fig["report"] = {
        "workload": {"name": "synthetic", "requests": 4, "ideal_hit_rate": 0.5}, "arrivals": "closed loop",
        "targets": [{"name": t, "per_worker": {"w0": {"requests": 2, "prefill_tokens": 10},
                                               "w1": {"requests": 2, "prefill_tokens": 30}},
                     "records": [{"start_s": i * 0.1, "ttft_ms": 5.0 + i, "prompt_tokens": 20, "cached_tokens": 5 * i,
                                  "error": None} for i in range(4)]} for t in ("a", "b")]}
    F.add_chart(fig, "bars", "latency.png", table="latency", group_by="workload", series_by="target",
                values=["p50_ms", "p99_ms", "added_p50_ms"], ylabel="ms", log_y=True, title="latency")
    F.add_chart(fig, "bars", "latency_h.png", table="latency", group_by=["workload", "target"],
                values=["p50_ms", "p99_ms"], ylabel="ms", horizontal=True)
    F.add_chart(fig, "bars", "memory.png", table="memory", group_by="what",
                values=["rss_idle_bytes", "rss_peak_bytes"], scale=1 / 2**20, ylabel="MiB")
    F.add_chart(fig, "bars", "missing.png", table="no such table", group_by="x", values=["y"])
    F.add_chart(fig, "cdf", "ttft_cdf.png", samples="ttft_ms", xlabel="TTFT (ms)")
    F.add_chart(fig, "lines", "hit_rate.png", series="hit_rate", ylabel="hit rate", hline=0.5)
    F.add_chart(fig, "bench_report", "report")
    return fig


def test_output_args_and_chart_kinds():
    ap = argparse.ArgumentParser()
    F.add_output_args(ap)
    assert vars(ap.parse_args([])) == {"json": None, "plot": None}
    args = ap.parse_args(["--json", "out/f.json", "--plot", "plots"])
    assert args.json == Path("out/f.json") and args.plot == Path("plots")
    with pytest.raises(ValueError, match="chart kind"):
        F.add_chart(F.new_figures("x"), "pie", "p.png")


def test_synthetic_figures_round_trip_and_draw(tmp_path):
    fig = synthetic()
    args = argparse.Namespace(json=tmp_path / "deep" / "figures.json", plot=tmp_path / "plots")
    paths = F.emit(fig, args, log=None)
    assert paths[0] == args.json
    loaded = json.loads(args.json.read_text())  # strict JSON: NaN and inf became null
    assert loaded == F.jsonable(fig)
    assert loaded["benchmark"] == "synthetic" and loaded["argv"] == ["--requests", "3"]
    assert loaded["cpu_count"] == os.cpu_count() and loaded["settings"] == {"requests": 3, "out": "/tmp/x",
                                                                            "ratio": None}
    assert loaded["tables"]["latency"][3]["p99_ms"] is None
    assert loaded["samples"]["ttft_ms"]["kvroute"][0] == pytest.approx(1.3)
    drawn = {"latency.png", "latency_h.png", "memory.png", "ttft_cdf.png", "hit_rate.png"}
    report = {"ttft_cdf.png", "hit_rate_over_time.png", "worker_load.png"}
    assert sorted(paths[1:]) == sorted([args.plot / n for n in drawn] + [args.plot / "report" / n for n in report])
    assert_pngs(args.plot, drawn)  # "missing.png" (no data) is left out
    assert_pngs(args.plot / "report", report)

    # the JSON alone is enough to draw the same charts again
    assert F.main([str(args.json), "--plot", str(tmp_path / "again")]) == 0
    assert_pngs(tmp_path / "again", drawn)
    assert_pngs(tmp_path / "again" / "report", report)


def run_script(name: str, *argv: str) -> subprocess.CompletedProcess:
    """``benchmarks/NAME.py ARGV`` in its own session; its whole group is killed on a timeout."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{name} ran past {SCRIPT_TIMEOUT_S}s:\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def numbers(rows: list[dict]) -> list[float]:
    return [v for r in rows for v in r.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]


# (script, tiny settings, {table: keys every row has}, PNGs drawn)
CASES = [
    ("bench_routing_quality", ["--limit", "60", "--workers", "2"],
     {"policies": {"policy", "hit_rate", "gpu_hit_rate", "requests_max_over_mean", "ttft_p50_ms", "ttft_p90_ms"},
      "per_worker": {"policy", "worker", "requests", "prefill_tokens"}},
     {"ttft_cdf.png", "hit_rate_over_time.png", "worker_load.png", "hit_rate.png", "load_imbalance.png"}),
    ("bench_sim", ["--requests", "40", "--concurrency", "1,4"],
     {"throughput": {"concurrency", "mode", "requests_per_s", "sim_cpu_per_request_ms", "client_cpu_per_request_ms"},
      "sim": {"start_s", "rss_idle_bytes", "rss_loaded_bytes", "idle_cpu_core_share", "sims_fit_by_memory"}},
     {"requests_per_s.png", "cpu_per_request.png", "rss.png"}),
    ("bench_fuzz", ["--examples", "3", "--only", "GET /health", "--only", "POST /v1/chat/completions"],
     {"operations": {"operation", "cases", "wall_s", "status_2xx", "status_4xx", "status_5xx", "statuses"},
      "summary": {"cases", "gateway_5xx", "bad_4xx", "property_failures", "run_s"}},
     {"statuses_per_operation.png", "summary.png"}),
    # the scale-out cluster, small: sims with agents on a Redis index, 2 gateway processes
    ("bench_cluster", ["--workers", "3", "--processes", "2", "--limit", "30", "--time-scale", "4", "--idle-s", "2",
                       "--lookup-repeats", "1", "--model", str(ROOT / "tests/fixtures/tiny-model")],
     {"cluster": {"workers", "gateway_processes", "requests", "errors", "hit_rate", "ideal_hit_rate",
                  "gateway_cpu_per_request_ms", "events_applied_per_s", "gateway_lookup_p99_ms",
                  "redis_used_memory_bytes", "index_blocks", "index_bytes_per_block"},
      "lookups": {"prompt", "lookups", "p50_ms", "p99_ms"}},
     {"lookups.png"}),
]


@pytest.mark.parametrize("name,argv,tables,pngs", CASES, ids=[c[0] for c in CASES])
def test_benchmark_script_writes_json_and_pngs(tmp_path, name, argv, tables, pngs):
    out_json, plot_dir = tmp_path / "figures.json", tmp_path / "plots"
    r = run_script(name, *argv, "--json", str(out_json), "--plot", str(plot_dir))
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip() and "figures: " + str(out_json) in r.stderr  # tables on stdout, files on stderr

    fig = json.loads(out_json.read_text())
    assert fig["benchmark"] == name and fig["argv"][:len(argv)] == argv and fig["cpu_count"] == os.cpu_count()
    assert fig["settings"]["json"] == str(out_json) and fig["settings"]["plot"] == str(plot_dir)
    for table, keys in tables.items():
        rows = fig["tables"][table]
        assert rows and all(keys <= set(row) for row in rows), (table, rows[:2])
        values = numbers(rows)
        assert values and all(math.isfinite(v) for v in values) and any(v > 0 for v in values), (table, rows[:2])
    assert_pngs(plot_dir, pngs)

    if name == "bench_cluster":
        (row,) = fig["tables"]["cluster"]
        assert (row["workers"], row["gateway_processes"], row["requests"], row["errors"]) == (3, 2, 30, 0)
        assert 0 <= row["hit_rate"] <= row["ideal_hit_rate"] <= 1 and row["index_blocks"] > 0
        assert row["events_applied_per_s"] > 0 and row["gateway_cpu_per_request_ms"] > 0
        assert [r["prompt"] for r in fig["tables"]["lookups"]] == ["slice prompts", "2048-block prompt held by 3 workers"]

    if name == "bench_routing_quality":
        policies = {row["policy"]: row for row in fig["tables"]["policies"]}
        assert list(policies) == ["kv_aware", "kv_aware no guard", "kv_aware load_weight .5", "kv_aware no load",
                                  "round_robin", "least_load", "session"]
        assert all(0 < p["hit_rate"] <= 1 and p["requests"] == 60 for p in policies.values())
        report = fig["report"]
        assert 0 < report["workload"]["ideal_hit_rate"] <= 1
        for target in report["targets"]:
            assert len(target["records"]) == 60
            assert sum(w["requests"] for w in target["per_worker"].values()) == 60
            records = target["records"]
            hit = sum(x["cached_tokens"] for x in records) / sum(x["prompt_tokens"] for x in records)
            assert hit == pytest.approx(policies[target["name"]]["hit_rate"])
    elif name == "bench_sim":
        rows = fig["tables"]["throughput"]
        assert [(row["concurrency"], row["mode"]) for row in rows] == [(1, "plain"), (1, "stream"), (4, "plain"),
                                                                       (4, "stream")]
        assert all(row["requests_per_s"] > 0 for row in rows)
        assert fig["tables"]["sim"][0]["rss_loaded_bytes"] > 10 * 2**20
    elif name == "bench_fuzz":
        ops = {row["operation"]: row for row in fig["tables"]["operations"]}
        assert set(ops) == {"GET /health", "POST /v1/chat/completions"}
        assert all(row["cases"] > 0 and sum(row[f"status_{c}xx"] for c in "2345") == row["cases"]
                   for row in ops.values())
        assert fig["tables"]["summary"][0]["cases"] == sum(row["cases"] for row in ops.values())
        assert fig["failures"] == [] and fig["tables"]["summary"][0]["gateway_5xx"] == 0
