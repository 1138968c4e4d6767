#!/usr/bin/env python3
"""The hostile-input fuzzing of tests/resilience/test_fuzz.py, run longer: every operation of the
gateway's OpenAPI schema (``GET /openapi.json``) gets ``--examples`` schemathesis cases (positive
and negative generation, seeded) against a real ``kvroute serve`` in front of two ``kvroute sim``
workers. Failures do not stop the run: it prints, per operation, the cases tried and each status
seen, then the gateway-made 5xx count (the goal is 0), the worker-attributed 5xx, every other
breach of the property (a 4xx not in the OpenAI error shape), each with a curl line, and the
run time. Exit status 1 when anything broke the property.

Usage: python benchmarks/bench_fuzz.py [--examples 300] [--seed 12] [--only 'POST /v1/completions']
       [--json FILE] [--plot DIR]
Everything runs on loopback and stops by itself (each process has a deadline).

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``operations`` (per
operation: ``cases``, ``wall_s``, ``status_2xx``/``status_4xx``/``status_5xx`` counts and
``statuses`` by status and origin), table ``summary`` (one row: ``cases``, ``gateway_5xx``,
``bad_4xx``, ``no_answer``, ``worker_5xx``, ``rig_5xx``, ``property_failures``, ``run_s``) and
``failures``. ``--plot DIR`` draws ``statuses_per_operation.png`` and ``summary.png``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "resilience")]

import test_fuzz as fuzz  # noqa: E402  (tests/resilience/test_fuzz.py: the rig, the property, the runner)

from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402


def _by_class(seen: Counter) -> dict[str, int]:
    """Counts per status class (``status_2xx``...) of statuses keyed ``"<status> <origin>"``."""
    out = {f"status_{c}xx": 0 for c in "2345"}
    for key, n in seen.items():
        code = str(key).split()[0]
        if code[:1] in "2345" and len(code) == 3:
            out[f"status_{code[0]}xx"] += n
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=300, help="cases per operation (default 300)")
    ap.add_argument("--seed", type=int, default=fuzz.SEED, help=f"hypothesis seed (default {fuzz.SEED})")
    ap.add_argument("--only", action="append", default=None, metavar="'METHOD /path'",
                    help="fuzz only this operation (repeatable)")
    add_output_args(ap)
    args = ap.parse_args()
    fig = new_figures("bench_fuzz", args)
    labels = args.only or list(fuzz.OPERATIONS)
    unknown = sorted(set(labels) - set(fuzz.OPERATIONS))
    if unknown:
        ap.error(f"unknown operation(s) {unknown}; choose from {list(fuzz.OPERATIONS)}")

    t0 = time.monotonic()
    started: list = []
    tally = fuzz.Tally()
    with tempfile.TemporaryDirectory(prefix="bench-fuzz-") as tmp:
        try:
            base = fuzz.start_rig(Path(tmp), started)
            schema = fuzz.load_schema(base)
            print(f"rig up in {time.monotonic() - t0:.1f} s: gateway {base}, workers {', '.join(fuzz.SIM_IDS)}; "
                  f"{args.examples} examples per operation, seed {args.seed}", flush=True)
            for label in labels:
                t1 = time.monotonic()
                fuzz.fuzz_operation(schema, label, base, args.examples, tally, seed=args.seed, stop_at_first=False)
                seen = tally.statuses[label]
                add_table(fig, "operations", [{"operation": label, "cases": tally.tried(label),
                                               "wall_s": time.monotonic() - t1, **_by_class(seen),
                                               "statuses": dict(sorted(seen.items()))}])
                print(f"{label:<42} {tally.tried(label):>5} cases {time.monotonic() - t1:6.1f} s   "
                      + "  ".join(f"{s}: {n}" for s, n in sorted(seen.items())), flush=True)
        finally:
            for p in reversed(started):
                p.stop()
            if tally.failures or any(not p.alive() and p.popen.returncode not in (0, -15) for p in started):
                for p in started:
                    print(f"--- {p.name} log tail ---\n{p.log_tail(15)}")

    total: Counter = Counter()
    for seen in tally.statuses.values():
        total.update(seen)
    print(f"\ncases tried: {sum(total.values())} over {len(labels)} operations")
    print("statuses (by origin: x-kvroute-worker or not): "
          + "  ".join(f"{s}: {n}" for s, n in sorted(total.items())))
    print(f"gateway-made 5xx: {tally.kinds['gateway_5xx']} (goal 0)")
    print(f"4xx not in the OpenAI error shape: {tally.kinds['bad_4xx']} (goal 0)")
    print(f"requests without an answer (connection dropped, timeout): {tally.kinds['no_answer']} (goal 0)")
    print(f"worker 5xx (a sim's own, or the gateway's 502/504 or stream error event naming it): "
          f"{tally.kinds['worker_5xx']}")
    print(f"503 for GET /version (the sims serve none): {tally.kinds['rig_5xx']}")
    print(f"property failures: {len(tally.failures)}")
    for f in tally.failures[:50]:
        print("  " + f)
    print(f"run time: {time.monotonic() - t0:.1f} s")
    add_table(fig, "summary", [{"operations": len(labels), "cases": sum(total.values()),
                                "gateway_5xx": tally.kinds["gateway_5xx"], "bad_4xx": tally.kinds["bad_4xx"],
                                "no_answer": tally.kinds["no_answer"], "worker_5xx": tally.kinds["worker_5xx"],
                                "rig_5xx": tally.kinds["rig_5xx"], "property_failures": len(tally.failures),
                                "run_s": time.monotonic() - t0}])
    fig["statuses"] = dict(sorted(total.items()))
    fig["failures"] = list(tally.failures)
    add_chart(fig, "bars", "statuses_per_operation.png", table="operations", group_by="operation",
              values=["status_2xx", "status_4xx", "status_5xx"], horizontal=True, ylabel="cases",
              title=f"fuzz cases per operation by status class, seed {args.seed}")
    add_chart(fig, "bars", "summary.png", table="summary", group_by="operations",
              values=["gateway_5xx", "bad_4xx", "no_answer", "worker_5xx", "rig_5xx", "property_failures"],
              ylabel="cases", title=f"property breaches (goal 0), worker and rig 5xx; {sum(total.values())} cases over "
                    f"{len(labels)} operations")
    emit(fig, args)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
