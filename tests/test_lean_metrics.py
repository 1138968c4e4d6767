"""router.telemetry.lean against prometheus_client's own Counter and Histogram: the same updates
give the same exposition, byte for byte."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from router.telemetry.lean import LeanCounter, LeanHistogram

TOKENS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def test_histograms_and_counters_expose_what_prometheus_client_exposes():
    disable_created_metrics()  # as the gateway does (router.telemetry.metrics)
    lib, lean = CollectorRegistry(), CollectorRegistry()
    made = []
    for reg, counter, histogram in ((lib, Counter, Histogram), (lean, LeanCounter, LeanHistogram)):
        made.append((histogram("kvroute_t_tokens", "tokens", ["worker"], buckets=TOKENS, registry=reg),
                     histogram("kvroute_t_seconds", "seconds", buckets=SECONDS, registry=reg),
                     counter("kvroute_t_requests", "requests", ["worker", "status"], registry=reg),
                     counter("kvroute_t_retries", "retries", registry=reg),
                     counter("kvroute_t_unused", "never updated", ["reason"], registry=reg)))
    for tokens, seconds, requests, retries, _ in made:
        for v in (0, 1, 16, 17, 300, 131072, 131073, 10**7):  # on, between and past the bounds
            tokens.labels("w0").observe(v)
        tokens.labels("w1").observe(5)
        for v in (0.0, 0.0001, 0.00010001, 0.3, 12.5):
            seconds.observe(v)
        requests.labels("w0", "200").inc()
        requests.labels("w0", "200").inc(2.5)
        requests.labels("w1", "503").inc()
        retries.inc()
    assert generate_latest(lean) == generate_latest(lib)
    assert b'kvroute_t_tokens_bucket{le="16.0",worker="w0"} 3.0' in generate_latest(lean)
    assert b"kvroute_t_unused" in generate_latest(lean)  # HELP and TYPE, no sample: as prometheus_client


def test_values_and_refusals():
    counter = LeanCounter("c", "c", ["worker"])
    counter.labels("w0").inc(3)
    assert counter.labels("w0").value == 3.0
    status = LeanCounter("s", "s", ["status"])
    status.labels(200).inc()
    status.labels(200).inc()  # a value that is not a string names the same series each time
    assert status.labels("200").value == 2.0
    with pytest.raises(ValueError):
        counter.labels("w0").inc(-1)
    with pytest.raises(ValueError):
        counter.labels("w0", "extra")
    histogram = LeanHistogram("h", "h", buckets=(1, 2))
    histogram.observe(1.5)
    histogram.observe(7)
    series = histogram.labels()
    assert series.counts == [0, 1, 1] and series.sum == 8.5
    with pytest.raises(ValueError):
        LeanHistogram("h", "h", buckets=(2, 1))


def test_a_second_metric_of_a_name_is_refused_as_prometheus_client_refuses_it():
    registry = CollectorRegistry()
    LeanCounter("kvroute_t_dup", "first", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        LeanCounter("kvroute_t_dup", "second", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("kvroute_t_dup", "a library one", registry=registry)
