"""Per-worker prefill speed, learned online from the TTFTs the gateway observes.

The model (all times in milliseconds from dispatch to the worker's first streamed byte)::

    work_tokens = queued_tokens + own_tokens + DECODE_INTERFERENCE_TOKENS x decoding
    ttft_ms     = overhead_ms + ms_per_token x work_tokens

- ``queued_tokens``: uncached prompt tokens of the gateway's own dispatches to the worker that had
  not produced their first byte when this request was sent (prefill ahead of it);
- ``own_tokens``: this request's uncached prompt tokens (the worker's reported ``cached_tokens``
  when learning, the index's tier-weighted prediction when predicting);
- ``decoding``: requests past their first byte on the worker at dispatch. Each adds a decode slot
  to every step the prefill shares with them; :data:`DECODE_INTERFERENCE_TOKENS` prices one in
  prefill tokens (vLLM's chunked prefill puts decodes and prefill chunks in one step, so a
  decoding sequence costs each of the prefill's steps a few prefill tokens' worth; the
  derivation of the figure: docs/tuning/prefill_rate.md).

Fit: Theil-Sen (the median of the pairwise slopes, intercept the median residual; Sen 1968) over
the last :data:`WINDOW` samples, its intercept capped at the 10th percentile of the TTFTs seen
(the slope then re-taken as the median of ``(ttft - overhead) / work``), so a few outliers (a GC
pause, a preemption, a request stuck behind a long decode) move neither figure, and memory is
bounded. The fit is refreshed every
:data:`REFIT_EVERY` samples. Until :data:`MIN_SAMPLES` samples with distinct work have been seen
the caller's prior is used. One estimator per worker and one per model (all of its workers'
samples); a worker's :meth:`PrefillRateEstimator.speed_factor` against its model's line is what
the ``ttft`` policy scales that line by.

The model's line is every worker's reference, so each new line makes every worker's speed factor
be computed again (a median over each worker's window: O(workers x window) per new line). It is
therefore published with a dead band, :data:`MODEL_LINE_TOLERANCE`: a refit replaces the
published line only where the two predict more than that share apart at the window's median or
largest work (between those two, the relative gap is largest at one of them). Below the median,
where the overhead is most of a prediction, the published line may be further from the latest
fit than that: the overhead is the noisiest figure of a fit, and checking there too would
republish it far more often. Refits of a steady line, which move it by its noise, leave it and the
factors as they are; a real change of speed moves it within a few refits. The published line's
``samples`` are those of the fit it came from. Pure computation: no clock, no I/O.
"""
from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

DECODE_INTERFERENCE_TOKENS = 16.0
DEFAULT_PREFILL_MS_PER_TOKEN = 0.1  # the prior prefill rate, 10k tokens/s: an 8B model on one mid-size GPU
WINDOW = 64
MIN_SAMPLES = 8
REFIT_EVERY = 4
MODEL_LINE_TOLERANCE = 0.05  # a model's line is replaced when a refit predicts >5% otherwise (module docstring)
_MIN_MS_PER_TOKEN = 1e-5  # a fitted slope is never taken below this (prefill is never free)


@dataclass(frozen=True)
class PrefillRate:
    """A worker's TTFT line: ``overhead_ms`` (>= 0) plus ``ms_per_token`` (> 0) per token of work.
    ``samples``: observations behind it (0: a prior)."""

    overhead_ms: float
    ms_per_token: float
    samples: int = 0

    def ttft_ms(self, work_tokens: float) -> float:
        """Predicted milliseconds to first token for ``work_tokens`` tokens of work (>= 0)."""
        return self.overhead_ms + self.ms_per_token * max(0.0, work_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {"overhead_ms": round(self.overhead_ms, 3), "ms_per_token": round(self.ms_per_token, 6),
                "tokens_per_s": round(1000.0 / self.ms_per_token, 1), "samples": self.samples}


def work_tokens(queued_tokens: float, own_tokens: float, decoding: float) -> float:
    """The work ahead of a request's first token, in prefill tokens (module docstring)."""
    return max(0.0, queued_tokens) + max(0.0, own_tokens) + DECODE_INTERFERENCE_TOKENS * max(0.0, decoding)


@functools.lru_cache(maxsize=8)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays ``(i, j)`` of every pair ``i < j`` of ``n`` points."""
    return np.triu_indices(n, k=1)


def _median(a: np.ndarray) -> float:
    """The median of ``a`` (1-D, non-empty), as ``statistics.median`` gives it: the middle value,
    or the mean of the two middle values of an even count. One ``np.partition``, where
    ``np.median`` adds a dozen calls of its own (a refit runs cache-cold between requests, where
    each numpy call costs several microseconds)."""
    h = a.size // 2
    if a.size % 2:
        return float(np.partition(a, h)[h])
    middle = np.partition(a, (h - 1, h))
    return (float(middle[h - 1]) + float(middle[h])) / 2


def theil_sen(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of the Theil-Sen line through the points, or None when fewer than
    two points have distinct x. O(n^2) in the number of points: the pairwise slopes in one numpy
    pass (the same IEEE operations and medians as the pure-Python form, and much faster: a
    gateway refits two lines every few requests)."""
    x = np.array(xs, dtype=np.float64)
    y = np.array(ys, dtype=np.float64)
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    dy = y[j] - y[i]
    keep = dx != 0
    if keep.all() and keep.size:
        slopes = dy / dx
    elif keep.any():
        slopes = dy[keep] / dx[keep]
    else:
        return None
    slope = _median(slopes)
    return _median(y - slope * x), slope


def _moved(published: PrefillRate, fitted: PrefillRate, xs: list[float], tolerance: float) -> bool:
    """Whether ``fitted`` predicts more than ``tolerance`` (a share) away from ``published`` at
    the median or the largest of ``xs`` (the window's work, non-empty)."""
    for x in (statistics.median_low(xs), max(xs)):
        before = published.ttft_ms(x)
        if not math.isfinite(before) or abs(fitted.ttft_ms(x) - before) > tolerance * before:
            return True  # (a non-finite published line is always replaced)
    return False


class PrefillRateEstimator:
    """Learns one worker's (or one model's) :class:`PrefillRate` from ``(work_tokens, ttft_ms)``
    observations. ``tolerance``: the dead band of :attr:`learned` (0: every refit is published;
    the model's line uses :data:`MODEL_LINE_TOLERANCE`, module docstring)."""

    def __init__(self, window: int = WINDOW, tolerance: float = 0.0) -> None:
        if not 0.0 <= tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
        self.tolerance = tolerance
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._since_fit = 0
        self._fit: PrefillRate | None = None
        self.observed = 0
        self._factor_key: tuple[PrefillRate, int] | None = None
        self._factor: tuple[float, int] | None = None

    def observe(self, work: float, ttft_ms: float) -> None:
        """One request: ``work`` tokens of work (:func:`work_tokens`) took ``ttft_ms`` from
        dispatch to first byte. Negative or non-finite figures are ignored."""
        if not (0.0 <= work < float("inf") and 0.0 <= ttft_ms < float("inf")):
            return
        self._samples.append((work, ttft_ms))
        self.observed += 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or self._fit is None:
            self._refit()

    def _refit(self) -> None:
        self._since_fit = 0
        if len({x for x, _ in self._samples}) < MIN_SAMPLES:
            return
        xs = [x for x, _ in self._samples]
        ys = [y for _, y in self._samples]
        line = theil_sen(xs, ys)
        if line is None:
            return
        intercept, slope = line
        fastest_ms = statistics.quantiles(ys, n=10)[0]
        if intercept > fastest_ms:
            # the overhead is at most what the fastest tenth of requests took: a line above that
            # has traded slope for intercept (mostly equal work and a few stalls), and a near-zero
            # slope values every cached prefix at nothing (an example:
            # docs/tuning/prefill_rate.md); the slope is re-taken through the capped intercept
            intercept = fastest_ms
            slope = statistics.median((y - intercept) / x for x, y in zip(xs, ys) if x > 0)
            slope = max(slope, _MIN_MS_PER_TOKEN)
        else:
            slope = max(slope, _MIN_MS_PER_TOKEN)
            # the intercept is re-taken with the clamped slope, so the line still runs through the data
            intercept = statistics.median(y - slope * x for x, y in zip(xs, ys))
        line = PrefillRate(max(0.0, intercept), slope, len(xs))
        if self._fit is None or self.tolerance <= 0.0 or _moved(self._fit, line, xs, self.tolerance):
            self._fit = line

    def speed_factor(self, reference: PrefillRate) -> tuple[float, int] | None:
        """How this worker's TTFTs compare with ``reference`` (the line of all of its model's
        workers): ``(median over the window of observed / reference.ttft_ms(work), samples)``,
        None before :data:`MIN_SAMPLES` samples or when the reference predicts nothing. One
        robust figure per worker, where a line of its own is two that trade against each other:
        fitted to a few dozen noisy TTFTs, identical workers' own lines differ by enough to rank
        a worker holding most of a prompt below an idle one holding none (figures:
        docs/tuning/prefill_rate.md). Cached until the next sample or a new reference."""
        key = (reference, self.observed)
        if self._factor_key == key:
            return self._factor
        self._factor_key = key
        self._factor = None
        if len(self._samples) >= MIN_SAMPLES:
            # reference.ttft_ms(x) inlined (observe keeps x >= 0): this runs for every worker
            # each time the model's line is republished
            overhead_ms, ms_per_token = reference.overhead_ms, reference.ms_per_token
            ratios = [y / p for x, y in self._samples if (p := overhead_ms + ms_per_token * x) > 0]
            if len(ratios) >= MIN_SAMPLES:
                self._factor = (statistics.median(ratios), len(ratios))
        return self._factor

    def rate(self, prior: PrefillRate) -> PrefillRate:
        """The learned line, or ``prior`` until enough samples have been seen."""
        return self._fit if self._fit is not None else prior

    def state(self) -> dict[str, Any]:
        """``{"learned", "observed"}`` plus the learned line's :meth:`PrefillRate.as_dict` once
        learned (the ``prefill_rate`` entries of ``GET /admin/workers``)."""
        out: dict[str, Any] = {"learned": self._fit is not None, "observed": self.observed}
        if self._fit is not None:
            out.update(self._fit.as_dict())
        return out

    @property
    def learned(self) -> PrefillRate | None:
        """The learned line, None before :data:`MIN_SAMPLES` distinct samples."""
        return self._fit
