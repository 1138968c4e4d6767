"""Peak memory and open file descriptors of a running process, sampled in a background thread
(psutil), and the CPU time and wake-ups of process trees, for benchmarks and soak tests that
report them."""
from __future__ import annotations

import os
import threading

import psutil


class Sampler:
    """Peak RSS (bytes) and open fds of ``proc``, sampled every 50 ms while the ``with`` block
    runs: ``peak_rss``, ``peak_fds``. A process that exits stops the sampling."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.peak_rss = proc.memory_info().rss
        self.peak_fds = proc.num_fds()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self.peak_fds = max(self.peak_fds, self.proc.num_fds())
            except psutil.Error:
                return

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def _below(root_pid: int) -> list[psutil.Process]:
    """Every live process below ``root_pid``; [] when it is gone."""
    try:
        return psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return []


def tree_cpu_s(root_pid: int, cmdline_contains: str | None = None) -> float:
    """User + system CPU seconds (children's waited-for time included) of every process below
    ``root_pid`` (not ``root_pid`` itself), or of those whose command line has the argument
    ``cmdline_contains``; processes that end meanwhile are skipped. 0.0 when there are none."""
    total = 0.0
    for proc in _below(root_pid):
        try:
            if cmdline_contains is not None and cmdline_contains not in proc.cmdline():
                continue
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def tree_wakeups(root_pid: int) -> int:
    """Voluntary context switches (a thread going to sleep: one wake-up each) summed over every
    thread of every process below ``root_pid`` (not ``root_pid`` itself), from
    ``/proc/PID/task/TID/status``; 0 when there are none. A thread or process that has ended is
    no longer counted (its entry is gone), so take differences over processes that live on."""
    total = 0
    for proc in _below(root_pid):
        try:
            tids = os.listdir(f"/proc/{proc.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt"))
            except (OSError, StopIteration):
                continue
    return total
