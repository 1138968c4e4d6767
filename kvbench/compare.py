"""``kvroute bench compare A.json B.json``: do two bench reports rank the same targets alike?

Used to check a simulator against real workers (the same workload and routers on both): prints
both tables, then for each figure (TTFT p50 and p90, hit rate) the order of the targets the two
have in common in each report and Kendall's tau between the two orders (1: the same order, -1:
reversed; tau-a, ties counted as neither concordant nor discordant; Kendall 1938).
"""
from __future__ import annotations

import argparse
import json
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

FIGURES = (("TTFT p50", lambda t: t["ttft_ms"]["p50"], False), ("TTFT p90", lambda t: t["ttft_ms"]["p90"], False),
           ("hit rate", lambda t: t["hit_rate"], True))


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two equally long sequences of values (pure). Raises ValueError when
    their lengths differ or are below 2."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("kendall_tau needs two sequences of the same length >= 2")
    s = 0
    for i, j in combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        s += (da * db > 0) - (da * db < 0)
    return s / (len(a) * (len(a) - 1) / 2)


def agreement(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per figure: ``{"figure", "order_a", "order_b", "kendall_tau"}`` over the targets in both
    reports (orders best first)."""
    ta = {t["name"]: t for t in a["targets"]}
    tb = {t["name"]: t for t in b["targets"]}
    names = [n for n in ta if n in tb]
    out = []
    for label, get, higher_better in FIGURES:
        va, vb = [get(ta[n]) for n in names], [get(tb[n]) for n in names]
        if len(names) < 2 or None in va or None in vb:
            continue
        order = (lambda vals: [n for _, n in sorted(zip(vals, names), reverse=higher_better)])
        out.append({"figure": label, "order_a": order(va), "order_b": order(vb), "kendall_tau": kendall_tau(va, vb)})
    return out


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``kvroute bench compare`` to the ``bench`` subparsers."""
    p = sub.add_parser("compare", help="rank agreement of two bench reports (e.g. sims vs real workers)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="a report written by kvroute bench run/rig --json")
    p.add_argument("b", type=Path, help="another report over the same targets")
    p.set_defaults(func=_compare)


def _compare(args: argparse.Namespace) -> int:
    from kvbench.report import table

    try:
        a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
        tables = [f"== {path}\n{table(rep)}\n" for path, rep in ((args.a, a), (args.b, b))]
        rows = agreement(a, b)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"kvroute bench compare: not two bench reports ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print("\n".join(tables))
    for row in rows:
        print(f"{row['figure']:<9} tau {row['kendall_tau']:+.2f}   A: {' > '.join(row['order_a'])}\n"
              f"{'':<20}B: {' > '.join(row['order_b'])}")
    return 0
