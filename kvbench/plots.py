"""PNG plots of a bench report (``--plot DIR``), with matplotlib's non-interactive Agg backend:

- ``ttft_cdf.png``: the CDF of TTFT per target (log x axis);
- ``hit_rate_over_time.png``: the prefix-hit rate per target over the run, in windows of requests
  by send time (cached / prompt tokens of the requests sent in the window);
- ``worker_load.png``: requests and prefill tokens per worker, per target (grouped bars).

matplotlib is in the ``bench`` extra; without it :func:`write_plots` raises RuntimeError.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

WINDOWS = 20  # points on the hit-rate-over-time curve


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvroute[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def hit_rate_series(records: list[dict[str, Any]], windows: int = WINDOWS) -> list[tuple[float, float]]:
    """``(mid send time s, hit rate)`` over ``windows`` equal slices of the successful requests
    ordered by send time (pure; used by the plot)."""
    ok = sorted((r for r in records if r["error"] is None), key=lambda r: r["start_s"])
    if not ok:
        return []
    per = max(1, -(-len(ok) // windows))
    out = []
    for lo in range(0, len(ok), per):
        chunk = ok[lo:lo + per]
        prompt = sum(r["prompt_tokens"] for r in chunk)
        if prompt:
            out.append(((chunk[0]["start_s"] + chunk[-1]["start_s"]) / 2,
                        sum(r["cached_tokens"] for r in chunk) / prompt))
    return out


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the three PNGs into ``out_dir`` (created); returns their paths."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = report["targets"]
    title = f"{report['workload']['name']}: {report['workload']['requests']} requests, {report['arrivals']}"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in targets:
        ttft = sorted(r["ttft_ms"] for r in t["records"] if r["error"] is None and r["ttft_ms"] is not None)
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=t["name"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out_dir / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in targets:
        series = hit_rate_series([r for r in t["records"] if r.get("repeat", 0) == 0])  # the first run
        if series:
            ax.plot([x for x, _ in series], [y for _, y in series], marker=".", label=t["name"])
    ax.axhline(report["workload"]["ideal_hit_rate"], color="grey", linestyle="--", label="ideal (whole run)")
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("prefix-hit rate")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out_dir / "hit_rate_over_time.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    workers = sorted({w for t in targets for w in t["per_worker"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / max(1, len(targets))
    for k, t in enumerate(targets):
        xs = [i + k * width for i in range(len(workers))]
        for ax, key in zip(axes, ("requests", "prefill_tokens")):
            ax.bar(xs, [t["per_worker"].get(w, {}).get(key, 0) for w in workers], width, label=t["name"])
    for ax, label in zip(axes, ("requests", "prefill tokens (uncached)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workers))], workers)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    paths.append(out_dir / "worker_load.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths
