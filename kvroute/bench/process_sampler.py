"""Peak memory and open file descriptors of a running process, sampled in a background thread
(psutil), for benchmarks and soak tests that report them."""
from __future__ import annotations

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
