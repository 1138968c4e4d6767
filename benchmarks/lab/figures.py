"""The figures of a benchmark script (``benchmarks/*.py``) as JSON (``--json FILE``) and as PNG
charts (``--plot DIR``), with matplotlib's non-interactive Agg backend.

A script builds one *figures* dict with :func:`new_figures`, puts what it prints into it and hands
it to :func:`emit` at the end. The dict (and the JSON file, which is the dict itself):

- ``benchmark``: the script's name (``"bench_sim"``); ``argv``: its command line; ``settings``:
  its parsed arguments (JSON-able: paths as strings); ``cpu_count``: ``os.cpu_count()`` of the
  machine; ``unix_time_s``: when the figures were made;
- ``tables``: ``{name: [row, ...]}``, each row a flat dict of one printed line, with the unit in
  each key (``_ms``, ``_s``, ``_tokens``, ``_bytes``, ``_per_s``; counts are named by what they
  count, ``requests``, ``cases``; ratios and shares are plain fractions, 0.5 not 50 %);
- ``samples``: ``{name: {series: [value, ...]}}``, e.g. latencies in ms per target, for a CDF;
- ``series``: ``{name: {series: [[x, y], ...]}}``, e.g. a figure over time, for a line chart;
- ``report``: optionally a ``kvroute bench``-style report (``workload``, ``arrivals``,
  ``targets`` with ``records`` and ``per_worker``), drawn by :func:`kvbench.plots.write_plots`
  (TTFT CDF per target, hit rate over time, per-worker load);
- ``charts``: what ``--plot`` draws, one spec per PNG (see :func:`add_chart`); drawing reads only
  the dict, so ``python -m lab.figures FILE.json --plot DIR`` redraws a saved run;
- anything else a script adds (``bench_overload.py`` and ``bench_resilience.py`` keep the
  top-level keys their ``--json`` always had).

Non-finite numbers (NaN, inf) are written as ``null``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from kvbench.plots import _pyplot, write_plots

CHART_KINDS = ("bars", "cdf", "lines", "bench_report")
_DPI = 110


# ---- arguments and the dict ------------------------------------------------------------------
def add_output_args(parser: argparse.ArgumentParser, json_help: str | None = None) -> None:
    """Add ``--json FILE`` (``args.json``: Path or None) and ``--plot DIR`` (``args.plot``: Path or
    None) to ``parser``."""
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help=json_help or "write the figures (every table, the settings, the CPU count) "
                                          "to FILE as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR",
                        help="draw the figures as PNG charts into DIR (created; needs matplotlib)")


def jsonable(value: Any) -> Any:
    """``value`` with everything JSON cannot hold made plain: paths and other objects as ``str``,
    tuples and sets as lists, non-finite floats as None (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    return str(value)


def new_figures(benchmark: str, args: argparse.Namespace | dict[str, Any] | None = None,
                argv: Sequence[str] | None = None) -> dict[str, Any]:
    """An empty figures dict for ``benchmark`` (see the module docstring): ``settings`` from
    ``args`` (a Namespace or dict; ``json`` and ``plot`` included), ``argv`` defaulting to
    ``sys.argv[1:]``, ``cpu_count`` of this machine."""
    settings = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    return {"benchmark": benchmark, "argv": list(sys.argv[1:] if argv is None else argv),
            "settings": jsonable(settings), "cpu_count": os.cpu_count(), "unix_time_s": time.time(),
            "tables": {}, "samples": {}, "series": {}, "charts": []}


def add_table(figures: dict[str, Any], name: str, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append ``rows`` (flat dicts, units in the keys) to table ``name``; returns the table."""
    table = figures["tables"].setdefault(name, [])
    table.extend(dict(r) for r in rows)
    return table


def add_samples(figures: dict[str, Any], name: str, series: str, values: Iterable[float]) -> None:
    """Add ``values`` (e.g. latencies in ms) to ``samples[name][series]``."""
    figures["samples"].setdefault(name, {}).setdefault(series, []).extend(float(v) for v in values)


def add_series(figures: dict[str, Any], name: str, series: str, points: Iterable[Sequence[float]]) -> None:
    """Add ``(x, y)`` points to ``series[name][series]`` (a line of a line chart)."""
    figures["series"].setdefault(name, {}).setdefault(series, []).extend([float(x), float(y)] for x, y in points)


def add_chart(figures: dict[str, Any], kind: str, file: str, **spec: Any) -> None:
    """Ask ``--plot`` for one PNG ``file`` of ``kind``; ``spec`` is the keyword arguments of the
    plot function, with the data named, not given:

    - ``"bars"``: ``table=NAME`` and :func:`plot_bars`'s ``group_by``, ``values``, ``series_by``,
      ``title``, ``ylabel``, ``scale``, ``log_y``, ``horizontal``;
    - ``"cdf"``: ``samples=NAME`` and :func:`plot_cdf`'s ``xlabel``, ``title``, ``log_x``;
    - ``"lines"``: ``series=NAME`` and :func:`plot_lines`'s ``xlabel``, ``ylabel``, ``title``,
      ``hline``, ``log_y``;
    - ``"bench_report"``: no spec; ``file`` is a folder under DIR (``"."`` for DIR itself) where
      :func:`kvbench.plots.write_plots` draws ``figures["report"]``.
    """
    if kind not in CHART_KINDS:
        raise ValueError(f"chart kind {kind!r}: expected one of {CHART_KINDS}")
    figures["charts"].append({"kind": kind, "file": file, **spec})


def write_json(figures: dict[str, Any], path: Path) -> Path:
    """Write ``figures`` to ``path`` as indented JSON (folder created; NaN/inf as null); returns
    the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(figures), indent=1))
    return path


def draw(figures: dict[str, Any], out_dir: Path) -> list[Path]:
    """Draw every chart of ``figures["charts"]`` into ``out_dir`` (created); returns the PNG paths.
    A chart whose data is empty is left out."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for chart in figures.get("charts", []):
        spec = {k: v for k, v in chart.items() if k not in ("kind", "file")}
        kind, target = chart["kind"], out_dir / chart["file"]
        if kind == "bars":
            rows = (figures.get("tables") or {}).get(spec.pop("table"), [])
            if rows:
                paths.append(plot_bars(target, rows, **spec))
        elif kind == "cdf":
            samples = (figures.get("samples") or {}).get(spec.pop("samples"), {})
            if any(samples.values()):
                paths.append(plot_cdf(target, samples, **spec))
        elif kind == "lines":
            series = (figures.get("series") or {}).get(spec.pop("series"), {})
            if any(series.values()):
                paths.append(plot_lines(target, series, **spec))
        elif kind == "bench_report" and (figures.get("report") or {}).get("targets"):
            paths.extend(write_plots(figures["report"], target))
    return paths


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def emit(figures: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None] | None = _stderr) -> list[Path]:
    """The end of a benchmark: write ``figures`` to ``args.json`` when given and draw its charts
    into ``args.plot`` when given; says which files on ``log`` (default: stderr, so the printed
    tables stay as they were; None: silent); returns the paths written (JSON first)."""
    paths: list[Path] = []
    if getattr(args, "json", None):
        paths.append(write_json(figures, args.json))
    if getattr(args, "plot", None):
        paths.extend(draw(figures, args.plot))
    if log is not None and paths:
        log("figures: " + ", ".join(str(p) for p in paths))
    return paths


# ---- plots -----------------------------------------------------------------------------------
def _label(row: dict[str, Any], keys: str | Sequence[str]) -> str:
    keys = [keys] if isinstance(keys, str) else list(keys)
    return ", ".join(str(row.get(k)) for k in keys)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def plot_bars(path: Path, rows: Sequence[dict[str, Any]], group_by: str | Sequence[str],
              values: Sequence[str], series_by: str | None = None, title: str = "", ylabel: str = "",
              scale: float = 1.0, log_y: bool = False, horizontal: bool = False) -> Path:
    """A grouped-bar chart of a table, written to ``path`` (PNG); returns ``path``.

    ``rows``: the table (dicts). ``group_by``: the key(s) whose values (joined by ", ") label the
    groups along the axis. Without ``series_by``: one chart, one bar per key of ``values`` in each
    group. With ``series_by`` (a key, e.g. ``"target"``): one panel per key of ``values``, one bar
    per distinct value of ``series_by`` in each group. Bar heights are ``row[key] * scale``
    (missing or None: no bar); ``ylabel`` names the unit after scaling. ``horizontal`` lays the
    bars along the y axis (long group labels). A table of one row without ``series_by`` is drawn
    with one bar per key of ``values``, labelled by the key. Groups and series without any number
    take no room."""
    plt = _pyplot()
    groups = list(dict.fromkeys(_label(r, group_by) for r in rows))
    if series_by is None and len(groups) == 1:
        panels = [(ylabel, [(groups[0], {v: r.get(v) for r in rows for v in values})])]
        groups = list(values)
    elif series_by is None:
        panels = [(ylabel, [(v, {_label(r, group_by): r.get(v) for r in rows}) for v in values])]
    else:
        names = list(dict.fromkeys(str(r.get(series_by)) for r in rows))
        panels = [(f"{v}" + (f" ({ylabel})" if ylabel else ""),
                   [(s, {_label(r, group_by): r.get(v) for r in rows if str(r.get(series_by)) == s})
                    for s in names]) for v in values]
    panels = [(label, [(name, by) for name, by in bars if any(_number(h) for h in by.values())])
              for label, bars in panels]  # a series without a number takes no room
    groups = [g for g in groups if any(_number(by.get(g)) for _, bars in panels for _, by in bars)] or groups
    tilt = len(groups) > 4 or sum(len(g) for g in groups) > 60  # long labels along x are tilted
    n_bars = max([len(bars) for _, bars in panels] + [1])
    width = 0.8 / max(1, n_bars)
    if horizontal:  # inches the bars of one panel need
        panel_w, panel_h = 7.5, min(max(3.0, 1.0 + len(groups) * (0.12 + 0.08 * n_bars)), 16.0)
    else:
        panel_w, panel_h = min(max(6.0, 1.2 + 0.3 * len(groups) * n_bars), 20.0), 3.8
    fig, axes = plt.subplots(len(panels), 1, figsize=(panel_w, panel_h * len(panels)), squeeze=False)
    for ax, (label, bars) in zip(axes[:, 0], panels):
        for k, (name, by_group) in enumerate(bars):
            pos = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(groups))]
            heights = [by_group.get(g) for g in groups]
            keep = [(p, h * scale) for p, h in zip(pos, heights) if _number(h)]
            if horizontal:
                ax.barh([p for p, _ in keep], [h for _, h in keep], width, label=name)
            else:
                ax.bar([p for p, _ in keep], [h for _, h in keep], width, label=name)
        if horizontal:
            ax.set_yticks(range(len(groups)), groups, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(label)
            if log_y:
                ax.set_xscale("log")
            ax.grid(True, axis="x", alpha=0.3)
        else:
            ax.set_xticks(range(len(groups)), groups, fontsize=8, rotation=20 if tilt else 0,
                          ha="right" if tilt else "center")
            ax.set_ylabel(label)
            if log_y:
                ax.set_yscale("log")
            ax.grid(True, axis="y", alpha=0.3)
        if len(bars) > 1:
            ax.legend(fontsize=8)
    axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def plot_cdf(path: Path, samples: dict[str, Sequence[float]], xlabel: str = "latency (ms)", title: str = "",
             log_x: bool = True) -> Path:
    """The empirical CDF of each series of ``samples`` (``{name: values}``, e.g. latencies in ms
    per target), one step line each, written to ``path`` (PNG); returns ``path``. ``log_x`` is
    dropped when a value is not above 0."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    positive = True
    for name, values in samples.items():
        xs = sorted(v for v in values if v is not None and math.isfinite(v))
        if xs:
            positive = positive and xs[0] > 0
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{name} ({len(xs)})")
    if log_x and positive:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of samples")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_lines(path: Path, series: dict[str, Sequence[Sequence[float]]], xlabel: str = "time (s)",
               ylabel: str = "", title: str = "", hline: float | None = None, log_y: bool = False) -> Path:
    """One line per series of ``series`` (``{name: [(x, y), ...]}``, e.g. a figure over time),
    with an optional dashed reference line at ``y = hline``, written to ``path`` (PNG); returns
    ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        pts = [(x, y) for x, y in points if y is not None]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=".", label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m lab.figures FILE.json --plot DIR``: redraw a saved run's charts."""
    ap = argparse.ArgumentParser(description="Redraw the charts of a benchmark's --json figures.")
    ap.add_argument("figures", type=Path, help="a JSON file written by a benchmark's --json")
    ap.add_argument("--plot", type=Path, required=True, metavar="DIR", help="folder for the PNGs")
    args = ap.parse_args(argv)
    for p in draw(json.loads(args.figures.read_text()), args.plot):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
