"""Counters and histograms for the per-request path, exposed through prometheus_client's
registry and text format.

prometheus_client's own ``Counter`` and ``Histogram`` take a lock for every update and walk the
bucket bounds in Python; a request updates a dozen of them. These keep plain numbers instead:
an update is an addition (a histogram's bucket is found by ``bisect``), and the cumulative
buckets are made at scrape time. The exposition is the one prometheus_client writes for its own
(``<name>_total``; ``_bucket`` with ``le`` as Go formats floats, ``_count``, ``_sum``; a metric
without labels always shows a sample, one with labels a sample per label values seen).

Updates are not locked: call them from the event loop's thread only (every gateway update is).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterValue:
    """One series of a :class:`LeanCounter`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (>= 0; raises ValueError otherwise, as prometheus_client does)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramValue:
    """One series of a :class:`LeanHistogram`: per-bucket counts (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        """Count ``amount`` in the first bucket whose upper bound is >= it."""
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _Lean(Collector):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._series: dict[tuple[str, ...], object] = {}
        if not self.labelnames:
            self._series[()] = self._new()
        if registry is not None:
            registry.register(self)

    def _new(self) -> object:
        raise NotImplementedError

    def labels(self, *values: str) -> object:
        """The series for these label values (as strings), made on first use. Raises
        ValueError on a wrong number of values."""
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values, got {len(values)}")
            key = tuple(str(v) for v in values)  # values that are not strings: their series, kept
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = self._new()
        return series

    def _family(self):
        raise NotImplementedError

    def _fill(self, family) -> None:
        raise NotImplementedError

    def describe(self) -> Iterator:
        """The family without samples: the registry checks its names at registration, as for
        prometheus_client's own metrics (a second metric of the same name is refused)."""
        yield self._family()

    def collect(self) -> Iterator:
        family = self._family()
        self._fill(family)
        yield family


class LeanCounter(_Lean):
    """A counter exposed as ``<name>_total``; ``labels(...)`` gives a :class:`CounterValue`, and
    one without labels is updated with :meth:`inc` on itself."""

    def _new(self) -> CounterValue:
        return CounterValue()

    def inc(self, amount: float = 1) -> None:
        self._series[()].inc(amount)  # type: ignore[attr-defined]

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _fill(self, family: CounterMetricFamily) -> None:
        for values, series in list(self._series.items()):
            family.add_metric(list(values), series.value)  # type: ignore[attr-defined]


class LeanHistogram(_Lean):
    """A histogram with upper bounds ``buckets`` (ascending; +Inf is added);
    ``labels(...)`` gives a :class:`HistogramValue`, and one without labels is updated with
    :meth:`observe` on itself."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = (), registry: CollectorRegistry | None = None) -> None:
        bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if not bounds or list(bounds) != sorted(bounds):
            raise ValueError(f"{name}: buckets must be ascending and not empty")
        self.bounds = bounds
        self._le = [floatToGoString(b) for b in bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HistogramValue:
        return HistogramValue(self.bounds)

    def observe(self, amount: float) -> None:
        self._series[()].observe(amount)  # type: ignore[attr-defined]

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _fill(self, family: HistogramMetricFamily) -> None:
        for values, series in list(self._series.items()):
            acc = 0
            buckets = []
            for le, n in zip(self._le, series.counts):  # type: ignore[attr-defined]
                acc += n
                buckets.append((le, acc))
            # prometheus_client leaves _sum out when a bound is negative (the sum may fall)
            sum_value = series.sum if self.bounds[0] >= 0 else None  # type: ignore[attr-defined]
            family.add_metric(list(values), buckets, sum_value)
