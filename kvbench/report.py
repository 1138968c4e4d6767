"""The report of a bench run: the side-by-side table printed at the end and the JSON file
(DESIGN.md ``kvroute bench run``: ``{"workload": {..., "ideal_hit_rate"}, "targets": [...]}``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_COLUMNS = (  # (header, getter, format)
    ("requests", lambda t: t["requests"], "{:.0f}"),
    ("errors", lambda t: t["errors"], "{:.0f}"),
    ("TTFT p50", lambda t: t["ttft_ms"]["p50"], "{:.0f}"),
    ("p90", lambda t: t["ttft_ms"]["p90"], "{:.0f}"),
    ("p99", lambda t: t["ttft_ms"]["p99"], "{:.0f}"),
    ("ITL p50", lambda t: t["itl_ms"]["p50"], "{:.1f}"),
    ("p99", lambda t: t["itl_ms"]["p99"], "{:.1f}"),
    ("tok/s", lambda t: t["throughput_tokens_per_s"], "{:.0f}"),
    ("goodput", lambda t: t["goodput"], "{:.2f}"),
    ("hit rate", lambda t: t["hit_rate"], "{:.3f}"),
    ("of ideal", lambda t: t["hit_rate_of_ideal"], "{:.2f}"),
    ("req max/mean", lambda t: t["requests_max_over_mean"], "{:.2f}"),
    ("prefill max/mean", lambda t: t["prefill_max_over_mean"], "{:.2f}"),
    ("outside engine ms", lambda t: (t.get("engine_ttft_ms") or {}).get("outside_mean"), "{:.1f}"),
    ("router cpu ms/req", lambda t: t.get("cpu", {}).get("router", {}).get("ms_per_request"), "{:.1f}"),
    ("worker cpu ms/req", lambda t: t.get("cpu", {}).get("workers", {}).get("ms_per_request"), "{:.1f}"),
)

_PER_RUN_COLUMNS = (_COLUMNS[2], _COLUMNS[3], _COLUMNS[9])  # TTFT p50, TTFT p90, hit rate: the table's own


def _cell(fmt: str, value: Any) -> str:
    return "-" if value is None else fmt.format(value)


def capacity_note(workload: dict[str, Any]) -> str:
    """``", at most 0.613 in 400 KV blocks"`` when the workload summary carries the capacity bound
    (:mod:`kvbench.capacity`), else ``""``."""
    if workload.get("capacity_hit_rate") is None:
        return ""
    return f", at most {workload['capacity_hit_rate']:.3f} in {workload['capacity_blocks']} KV blocks"


def table(report: dict[str, Any]) -> str:
    """The side-by-side table of every target (times in ms), with a header line naming the
    workload, its ideal hit rate (and capacity bound, :func:`capacity_note`) and the goodput
    target."""
    w = report["workload"]
    targets = report["targets"]
    lines = [f"workload {w['name']}: {w['requests']} requests, {w['mean_prompt_tokens']:.0f} prompt tokens "
             f"on average, ideal hit rate {w['ideal_hit_rate']:.3f}{capacity_note(w)}; arrivals: {report['arrivals']}; "
             f"times in ms; goodput = share with TTFT <= {targets[0]['ttft_target_ms']:.0f} ms"
             + (f"; medians of {targets[0]['runs']} runs" if targets[0].get("runs", 1) > 1 else "")
             if targets else f"workload {w['name']}: no targets"]
    name_w = max([len("target")] + [len(t["name"]) for t in targets])
    widths = [max(len(h), 7) for h, _, _ in _COLUMNS]
    lines.append("target".ljust(name_w) + "".join(f"  {h:>{wd}}" for (h, _, _), wd in zip(_COLUMNS, widths)))
    for t in targets:
        cells = [_cell(fmt, get(t)) for _, get, fmt in _COLUMNS]
        lines.append(t["name"].ljust(name_w) + "".join(f"  {c:>{wd}}" for c, wd in zip(cells, widths)))
        if t.get("note"):
            lines.append(" " * name_w + f"  note: {t['note']}")
        if t.get("errors") and t.get("error_sample"):
            lines.append(" " * name_w + f"  errors: {t['error_sample']}")
        spread = per_run(t)
        if spread:
            lines.append(" " * name_w + f"  {spread}")
    return "\n".join(lines)


def per_run(target: dict[str, Any]) -> str | None:
    """``"per run: TTFT p50 a, b, ...; p90 ...; hit rate ..."``: each run's own figures, in run
    order, under a target measured more than once (its ``repeats``), so a reader sees the spread
    behind the medians in the table (on 2 real vLLM-CPU workers one router's TTFT p50 ran from
    105 to 220 ms over 6 runs); None for a single run."""
    runs = target.get("repeats") or []
    if len(runs) < 2:
        return None
    parts = [f"{header} " + ", ".join(_cell(fmt, get(r)) for r in runs)
             for header, get, fmt in _PER_RUN_COLUMNS]
    return "per run: " + "; ".join(parts)


def write_json(report: dict[str, Any], path: Path) -> None:
    """Write ``report`` (records included) to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
