"""One wrapper per step of the route (:meth:`router.route.planner.Router.plan`): the step's span
and the histogram of its duration, so a step's body holds no timer or span bookkeeping."""
from __future__ import annotations

import time
from typing import Any

from router.telemetry import tracing
from router.telemetry.lean import LeanHistogram


class step:
    """``with step(name, seconds) as span:``: span ``name`` around the block
    (:func:`router.telemetry.tracing.span`: a no-op while tracing is off; ``span`` takes
    attributes through :func:`~router.telemetry.tracing.set_attributes`) and, when the block ends
    without an exception, its duration in seconds observed into ``seconds`` (None: not timed)."""

    __slots__ = ("_span", "_seconds", "_t0")

    def __init__(self, name: str, seconds: LeanHistogram | None = None) -> None:
        self._span = tracing.span(name)
        self._seconds = seconds
        self._t0 = 0.0

    def __enter__(self) -> Any:
        self._t0 = time.perf_counter()
        return self._span.__enter__()

    def __exit__(self, exc_type, exc, tb) -> bool | None:
        if exc_type is None and self._seconds is not None:
            self._seconds.observe(time.perf_counter() - self._t0)
        return self._span.__exit__(exc_type, exc, tb)
