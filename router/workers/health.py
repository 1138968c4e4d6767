"""A worker's health from its probe results, with hysteresis.

The first result sets the state directly; afterwards ``fail_threshold`` failures in a row mark
the worker down and ``rise_threshold`` successes in a row mark it up again (``health_check`` in
the config, DESIGN.md), so one lost probe neither drops a busy worker nor one good answer
readmits a flapping one.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvroute.registry")


class ProbeHealth:
    """``healthy``: None until the first probe result, then True/False; ``last_error``: the last
    failed probe's reason while failing (None after a success); ``first_probe`` is set once any
    result arrived (start-up waits on it)."""

    __slots__ = ("worker_id", "healthy", "last_error", "first_probe", "_ok_streak", "_fail_streak")

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.healthy: bool | None = None
        self.last_error: str | None = None
        self.first_probe = asyncio.Event()
        self._ok_streak = 0
        self._fail_streak = 0

    def record(self, ok: bool, fail_threshold: int, rise_threshold: int, error: str | None = None) -> bool:
        """Apply one probe result; returns True when ``healthy`` changed. Logs a WARNING when the
        worker goes down, INFO when it comes up (the first result included)."""
        before = self.healthy
        if ok:
            self._ok_streak += 1
            self._fail_streak = 0
            self.last_error = None
            if self.healthy is None or (self.healthy is False and self._ok_streak >= rise_threshold):
                self.healthy = True
        else:
            self._fail_streak += 1
            self._ok_streak = 0
            self.last_error = error
            if self.healthy is None or (self.healthy is True and self._fail_streak >= fail_threshold):
                self.healthy = False
        self.first_probe.set()
        if before != self.healthy:
            log.log(logging.INFO if self.healthy else logging.WARNING, "worker %s is now %s%s", self.worker_id,
                    "up" if self.healthy else "down", f" ({error})" if error else "")
        return before != self.healthy
