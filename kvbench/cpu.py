"""CPU seconds spent by the rig's processes while one router replays the workload: the router's
own (every process of it) and the workers' (API servers and engines). On a host whose cores
also run the engines, a router's CPU is taken from them: this shows how much.

Read with psutil (``cpu_times()`` user + system of each process and its descendants; a process
that exits during the run loses what it spent, so figures are lower bounds). ``CpuMeter`` is the
I/O; :func:`cpu_report` is pure.
"""
from __future__ import annotations

from typing import Any

import psutil


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and all its live descendants; 0.0 for a
    process that is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


class CpuMeter:
    """CPU seconds of named process trees between :meth:`start` and :meth:`stop`.
    ``roots``: name -> root pids (e.g. ``{"router": [pid], "workers": [pid, pid]}``)."""

    def __init__(self, roots: dict[str, list[int]]) -> None:
        self.roots = roots
        self._before: dict[str, float] = {}
        self.spent_s: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {name: sum(tree_cpu_s(pid) for pid in pids) for name, pids in self.roots.items()}

    def start(self) -> None:
        self._before = self._now()

    def stop(self) -> dict[str, float]:
        """CPU seconds per name since :meth:`start` (never below 0)."""
        after = self._now()
        self.spent_s = {name: max(0.0, after[name] - self._before.get(name, 0.0)) for name in after}
        return self.spent_s


def cpu_report(spent_s: dict[str, float], requests: int, duration_s: float) -> dict[str, Any]:
    """The ``cpu`` entry of a rig result: per name, CPU seconds, milliseconds per request and
    mean cores busy over the run (``spent / duration_s``). ``requests`` and ``duration_s`` > 0
    (else the per-request and core figures are None)."""
    out: dict[str, Any] = {}
    for name, s in spent_s.items():
        out[name] = {"cpu_s": round(s, 3),
                     "ms_per_request": round(1000.0 * s / requests, 2) if requests > 0 else None,
                     "cores": round(s / duration_s, 3) if duration_s > 0 else None}
    return out
