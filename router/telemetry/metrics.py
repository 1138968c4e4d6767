"""The gateway's Prometheus metrics (``GET /metrics``), every name prefixed ``kvroute_``.

| name | type | labels | what |
|---|---|---|---|
| kvroute_requests_total | counter | worker, status | proxied and gateway-answered requests (worker "none" before a choice) |
| kvroute_route_decisions_total | counter | policy, reason | policy decisions by the policy's reason label |
| kvroute_index_lookup_seconds | histogram | | one ``index.match`` |
| kvroute_tokenize_seconds | histogram | | tokenization + block keys of one request (pool wait included) |
| kvroute_ttft_seconds | histogram | worker | request received to first body byte from the worker |
| kvroute_in_flight | gauge | worker | requests sent and unfinished (current registration) |
| kvroute_worker_healthy | gauge | worker | 1 up, 0 down or unknown |
| kvroute_worker_role | gauge | worker, role | 1 for the worker's role (``both``, ``prefill``, ``decode``; info style: one series per worker) |
| kvroute_tokenization_fallbacks_total | counter | model, reason | requests routed by load, exact tokens unavailable |
| kvroute_pd_requests_total | counter | model, outcome | requests of a model with P/D on: ``split`` (two legs), ``whole`` (the prefill leg skipped), ``prefill_failed`` (the prefill leg failed or timed out, served whole by the decode worker), ``prefill_rejected`` (the prefill worker answered a 4xx, passed to the client) |
| kvroute_predicted_cached_tokens | histogram | worker | predicted prefix-hit tokens per request (chosen worker; a split request's prefill worker) |
| kvroute_actual_cached_tokens | histogram | worker | the worker's ``usage.prompt_tokens_details.cached_tokens`` |
| kvroute_cached_tokens_error_tokens | histogram | worker | ``abs(actual - predicted)`` per request |
| kvroute_upstream_retries_total | counter | | connect failures retried on the next-best worker |
| kvroute_route_off_longest_prefix_total | counter | policy, reason | decisions whose worker matched fewer blocks than the longest holder |
| kvroute_predicted_ttft_seconds | histogram | worker | the policy's TTFT prediction for the chosen worker (streamed requests) |
| kvroute_ttft_prediction_ratio | histogram | worker | observed / predicted TTFT from dispatch, per streamed request (1 = exact) |
| kvroute_worker_prefill_ms_per_token | gauge | worker | learned prefill milliseconds per token (absent until learned) |
| kvroute_evidence_trusted | gauge | worker | 1 while the worker's reported cached tokens agree with the index, 0 while its evidence is distrusted |
| kvroute_worker_events_live | gauge | worker | 1 while the worker's KV events flow, 0 while they do not (embedded mode; absent without an event stream) |
| kvroute_worker_blocks | gauge | worker, tier | KV blocks the worker holds per tier (``gpu``, ``cpu``, ``ssd``) as its KV events say (embedded mode; absent with a Redis index, whose agents ingest) |
| kvroute_worker_events_age_seconds | gauge | worker | seconds since the last KV-event batch from the worker was applied (embedded mode; absent until one is) |
| kvroute_worker_event_batches_received_total | counter | worker | KV-event batches received from the worker (embedded mode) |
| kvroute_worker_event_gaps_total | counter | worker | sequence gaps in the worker's KV-event stream (embedded mode) |
| kvroute_worker_event_replays_total | counter | worker | replay requests the worker's publisher answered, the first catch-up included (embedded mode) |
| kvroute_worker_event_resyncs_total | counter | worker | full resyncs of the worker's index entries (embedded mode) |
| kvroute_worker_event_skipped_total | counter | worker, type, reason | KV events left out of the worker's batches, the rest applied: ``unknown_type`` (a type this version does not know, named by ``type``) or ``malformed`` (a known type that does not decode) (embedded mode; absent until one is) |
| kvroute_evidence_distrust_total | counter | worker | times a worker's evidence became distrusted |
| kvroute_index_unavailable_total | counter | | lookups that found the shared index down (routed by load alone) |
| kvroute_index_write_failures_total | counter | | speculative inserts of a routed prompt's keys that found the shared index down |
| kvroute_admission_rejected_total | counter | reason | requests answered 429 by admission control (``queue_full``, ``queue_timeout``) |
| kvroute_admission_wait_seconds | histogram | | time a request waited for an admission slot |
| kvroute_admission_in_flight, kvroute_admission_queued | gauge | | admitted requests in flight; requests waiting for a slot (this process's: with ``--processes N`` the sum over ``process`` is the gateway's, which the limits bound) |
| kvroute_dispatch_queue_wait_seconds | histogram | | time a request waited in the dispatch queue (policy ``queue``) for an open worker |
| kvroute_dispatch_queue_queued | gauge | | requests waiting in the dispatch queue now |
| kvroute_dispatch_queue_rematches_total | counter | change | index lookups again for a waiting request (``queue.rematch_ms``): ``gained`` (a worker holds more of its prompt than before), ``lost`` (one holds less), ``none``; a lookup with both counts both |
| kvroute_dispatch_queue_decisions_total | counter | workers | decisions again for a request waiting in the dispatch queue with ``affinity: policy``: ``all_workers`` (every routable worker scored), ``changed_workers`` (only the worker it waits for, its prefix holders and the workers whose state changed since its last decision: :meth:`router.route.dispatch_queue.DispatchQueue._decide`) |
| kvroute_broken_streams_total | counter | worker, reason | streams a worker broke or left silent past ``stream_idle_s`` (ended with an error event) |
| kvroute_tokenize_cache_total | counter | result | prefix token cache outcome per encoded text (``hit``, ``miss``, ``fallback``: junction unsafe, encoded whole) |
| kvroute_tokenize_pieces_total | counter | engine | text pieces (between special tokens) of a byte-level BPE tokenizer :mod:`kvcore.bpe_fast` applies to, by the engine that encoded them: ``tiktoken`` (ASCII), ``tokenizers`` (the rest); the same ids either way |
| kvroute_peer_credit_blocks_total | counter | worker | prompt blocks real decisions credited the chosen worker for pulling from a peer (:mod:`router.estimates.peer_credit`) |
| kvroute_worker_peer_link_bytes_per_second | gauge | worker | the worker's measured peer-pull link speed, as its agent publishes it (Redis index; absent until it has pulled) |
| kvroute_worker_call_failures_total | counter | worker, call | the gateway's own calls to a worker (``models``: ``GET /v1/models``) that failed or timed out; the answer skips that worker |
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.estimates.peer_credit import PeerInfo
from router.telemetry.lean import LeanCounter, LeanHistogram
from router.workers.registry import WorkerRegistration

disable_created_metrics()  # no *_created series: they double the exposition for nothing here

_LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)
_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# the embedded KV-event ingestor's counters exported per worker (keys of ``EventIngestor.state()``)
_EVENT_COUNTERS = {
    "batches_received": "KV-event batches received from the worker (embedded mode)",
    "gaps": "Sequence gaps in the worker's KV-event stream (embedded mode)",
    "replays": "KV-event replay requests the worker answered (embedded mode)",
    "resyncs": "Full resyncs of the worker's index entries (embedded mode)",
}


class _WorkerGauges(Collector):
    """In-flight, health, role and KV-event ingest state per worker, read from the registry at
    scrape time (no stale series for removed workers, no counters to keep in step)."""

    def __init__(self, workers: Callable[[], Iterable[WorkerRegistration]]) -> None:
        self._workers = workers

    def collect(self):
        in_flight = GaugeMetricFamily("kvroute_in_flight", "Requests sent to the worker and unfinished",
                                      labels=["worker"])
        healthy = GaugeMetricFamily("kvroute_worker_healthy", "1 when the worker is up", labels=["worker"])
        role = GaugeMetricFamily("kvroute_worker_role", "1 for the worker's role (both, prefill, decode)",
                                 labels=["worker", "role"])
        trusted = GaugeMetricFamily("kvroute_evidence_trusted",
                                    "1 while the worker's reported cached tokens agree with the index",
                                    labels=["worker"])
        rate = GaugeMetricFamily("kvroute_worker_prefill_ms_per_token",
                                 "Learned prefill milliseconds per token", labels=["worker"])
        events_live = GaugeMetricFamily("kvroute_worker_events_live",
                                        "1 while the worker's KV events flow, 0 while they do not (embedded mode)",
                                        labels=["worker"])
        blocks = GaugeMetricFamily("kvroute_worker_blocks",
                                   "KV blocks the worker holds per tier as its KV events say (embedded mode)",
                                   labels=["worker", "tier"])
        events_age = GaugeMetricFamily(
            "kvroute_worker_events_age_seconds",
            "Seconds since the last KV-event batch from the worker was applied (embedded mode)", labels=["worker"])
        event_counters = {key: CounterMetricFamily(f"kvroute_worker_event_{key}", doc, labels=["worker"])
                          for key, doc in _EVENT_COUNTERS.items()}
        skipped = CounterMetricFamily(
            "kvroute_worker_event_skipped",
            "KV events left out of the worker's batches (unknown type or malformed), the rest applied "
            "(embedded mode)", labels=["worker", "type", "reason"])
        for reg in self._workers():
            state = reg.event_state()
            if state is not None:
                for tier, n in state["blocks"].items():
                    blocks.add_metric([reg.id, tier], n)
                if state["last_event_age_s"] is not None:
                    events_age.add_metric([reg.id], state["last_event_age_s"])
                for key, family in event_counters.items():
                    family.add_metric([reg.id], state[key])
                for reason, by_type in state.get("events_not_decoded", {}).items():
                    for kind, n in by_type.items():
                        skipped.add_metric([reg.id, kind, reason], n)
            if reg.events.live is not None:
                events_live.add_metric([reg.id], 1 if reg.events.live else 0)
            in_flight.add_metric([reg.id], reg.in_flight)
            healthy.add_metric([reg.id], 1 if reg.healthy else 0)
            role.add_metric([reg.id, reg.role], 1)
            trusted.add_metric([reg.id], 1 if reg.evidence.trusted else 0)
            learned = reg.prefill_rate.learned
            if learned is not None:
                rate.add_metric([reg.id], learned.ms_per_token)
        yield in_flight
        yield healthy
        yield role
        yield trusted
        yield rate
        yield events_live
        yield blocks
        yield events_age
        yield from event_counters.values()
        yield skipped


class _PeerLinks(Collector):
    """Each worker's measured peer-pull link speed, read from the peer table at scrape time."""

    def __init__(self, peers: Callable[[], Mapping[str, PeerInfo]]) -> None:
        self._peers = peers

    def collect(self):
        family = GaugeMetricFamily("kvroute_worker_peer_link_bytes_per_second",
                                   "Measured peer-pull link speed of the worker (bytes/s)", labels=["worker"])
        for worker, info in sorted(self._peers().items()):
            if info.link_bytes_per_s is not None:
                family.add_metric([worker], info.link_bytes_per_s)
        yield family


class _CounterFromTotals(Collector):
    """A counter whose per-label totals are read from ``totals()`` at scrape time."""

    def __init__(self, name: str, doc: str, label: str, totals: Callable[[], dict[str, int]]) -> None:
        self._name, self._doc, self._label, self._totals = name, doc, label, totals

    def collect(self):
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, n in self._totals().items():
            family.add_metric([value], n)
        yield family


class GatewayMetrics:
    """Every gateway metric on its own CollectorRegistry (one per app, so tests can run many)."""

    def __init__(self, workers: Callable[[], Iterable[WorkerRegistration]]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = LeanCounter("kvroute_requests", "Requests by worker and HTTP status",
                                    ["worker", "status"], registry=r)
        self.route_decisions = LeanCounter("kvroute_route_decisions", "Routing decisions by reason",
                                           ["policy", "reason"], registry=r)
        self.lookup_s = LeanHistogram("kvroute_index_lookup_seconds", "Index match latency",
                                      buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tokenize_s = LeanHistogram("kvroute_tokenize_seconds", "Tokenization and block-key latency",
                                        buckets=_LATENCY_BUCKETS_S, registry=r)
        self.ttft_s = LeanHistogram("kvroute_ttft_seconds", "Time to the worker's first body byte",
                                    ["worker"], buckets=_TTFT_BUCKETS_S, registry=r)
        self.tokenization_fallbacks = LeanCounter(
            "kvroute_tokenization_fallbacks", "Requests routed by load because exact tokens were unavailable",
            ["model", "reason"], registry=r)
        self.predicted_cached = LeanHistogram("kvroute_predicted_cached_tokens",
                                              "Predicted prefix-hit tokens per request", ["worker"],
                                              buckets=_TOKEN_BUCKETS, registry=r)
        self.actual_cached = LeanHistogram("kvroute_actual_cached_tokens",
                                           "Worker-reported cached tokens per request", ["worker"],
                                           buckets=_TOKEN_BUCKETS, registry=r)
        self.cached_error = LeanHistogram("kvroute_cached_tokens_error_tokens",
                                          "abs(actual - predicted) cached tokens per request", ["worker"],
                                          buckets=_TOKEN_BUCKETS, registry=r)
        self.index_unavailable = LeanCounter(
            "kvroute_index_unavailable", "Lookups that found the shared index down (routed by load alone)",
            registry=r)
        self.index_write_failures = LeanCounter(
            "kvroute_index_write_failures",
            "Speculative inserts of a routed prompt's keys that found the shared index down", registry=r)
        self.worker_call_failures = LeanCounter(
            "kvroute_worker_call_failures", "The gateway's own calls to a worker that failed or timed out",
            ["worker", "call"], registry=r)
        self.admission_rejected = LeanCounter("kvroute_admission_rejected",
                                              "Requests answered 429 by admission control", ["reason"], registry=r)
        self.admission_wait_s = LeanHistogram("kvroute_admission_wait_seconds", "Time waited for an admission slot",
                                              buckets=_TTFT_BUCKETS_S, registry=r)
        self.dispatch_queue_wait_s = LeanHistogram("kvroute_dispatch_queue_wait_seconds",
                                                   "Time waited in the dispatch queue for an open worker",
                                                   buckets=_TTFT_BUCKETS_S, registry=r)
        self.dispatch_queue_rematches = LeanCounter("kvroute_dispatch_queue_rematches",
                                                    "Index lookups again for a request waiting in the dispatch queue",
                                                    ["change"], registry=r)
        self.dispatch_queue_decisions = LeanCounter("kvroute_dispatch_queue_decisions",
                                                     "Decisions again for a request waiting in the dispatch queue",
                                                     ["workers"], registry=r)
        self.broken_streams = LeanCounter("kvroute_broken_streams", "Streams a worker broke or left silent mid-way",
                                          ["worker", "reason"], registry=r)
        self.retries = LeanCounter("kvroute_upstream_retries", "Connect failures retried on the next-best worker",
                                   registry=r)
        self.off_longest_prefix = LeanCounter(
            "kvroute_route_off_longest_prefix",
            "Decisions whose worker matched fewer prompt blocks than the longest holder",
            ["policy", "reason"], registry=r)
        self.predicted_ttft_s = LeanHistogram("kvroute_predicted_ttft_seconds",
                                              "Predicted TTFT from dispatch of the chosen worker", ["worker"],
                                              buckets=_TTFT_BUCKETS_S, registry=r)
        self.ttft_prediction_ratio = LeanHistogram("kvroute_ttft_prediction_ratio",
                                                   "Observed over predicted TTFT from dispatch", ["worker"],
                                                   buckets=_RATIO_BUCKETS, registry=r)
        self.evidence_distrust = LeanCounter("kvroute_evidence_distrust",
                                             "Times a worker's prefix evidence became distrusted", ["worker"],
                                             registry=r)
        self.peer_credit_blocks = LeanCounter(
            "kvroute_peer_credit_blocks",
            "Prompt blocks decisions credited the chosen worker for pulling from a peer", ["worker"], registry=r)
        self.pd_requests = LeanCounter("kvroute_pd_requests", "Requests of a model with P/D on, by outcome",
                                       ["model", "outcome"], registry=r)
        r.register(_WorkerGauges(workers))

    def child(self, metric: LeanCounter | LeanHistogram, *values: str) -> Any:
        """``metric.labels(*values)``: the series of those label values (every label value here
        comes from a bounded set: worker ids, models, policies, reasons, outcomes)."""
        return metric.labels(*values)

    def watch_admission(self, in_flight: Callable[[], float], queued: Callable[[], float]) -> None:
        """Expose admission control's slots in use and queue length, read at scrape time."""
        Gauge("kvroute_admission_in_flight", "Admitted requests in flight (this process's)",
              registry=self.registry).set_function(in_flight)
        Gauge("kvroute_admission_queued", "Requests waiting for an admission slot (this process's)",
              registry=self.registry).set_function(queued)

    def watch_tokenize_cache(self, totals: Callable[[], dict[str, int]]) -> None:
        """Expose the prefix token cache's ``{"hit", "miss", "fallback"}`` counts, read at scrape time."""
        self.registry.register(_CounterFromTotals("kvroute_tokenize_cache", "Prefix token cache outcomes",
                                                  "result", totals))

    def watch_tokenize_engines(self, totals: Callable[[], dict[str, int]]) -> None:
        """Expose the text pieces each encoding engine took, ``{"tiktoken", "tokenizers"}``, read at scrape time."""
        self.registry.register(_CounterFromTotals("kvroute_tokenize_pieces", "Text pieces encoded, by engine",
                                                  "engine", totals))

    def watch_worker_calls(self, calls: Callable[[], dict[str, int]], applied: Callable[[], dict[str, int]]) -> None:
        """Expose, with ``kvroute serve --processes N``, the health probes and load scrapes this
        process made itself and the prober's results it applied, by kind (:mod:`router.shared.probe_table`)."""
        self.registry.register(_CounterFromTotals("kvroute_worker_calls", "Health probes and load scrapes this "
                                                  "process made itself", "kind", calls))
        self.registry.register(_CounterFromTotals("kvroute_worker_results_applied", "Health probes and load "
                                                  "scrapes of the prober process applied here (those that "
                                                  "change this process's view)", "kind", applied))

    def watch_peer_links(self, peers: Callable[[], Mapping[str, PeerInfo]]) -> None:
        """Expose each worker's measured peer-pull link speed (``peers()``: peer info by worker
        id, :meth:`router.workers.peers.PeerTable.current`), read at scrape time."""
        self.registry.register(_PeerLinks(peers))

    def watch_dispatch_queue(self, queued: Callable[[], float]) -> None:
        """Expose the dispatch queue's length, read at scrape time."""
        Gauge("kvroute_dispatch_queue_queued", "Requests waiting in the dispatch queue",
              registry=self.registry).set_function(queued)

    def record_response(self, worker_id: str, status: int, ttft_s: float) -> None:
        """A worker answered with ``status`` after ``ttft_s`` seconds (first body byte)."""
        self.child(self.requests, worker_id, str(status)).inc()
        self.child(self.ttft_s, worker_id).observe(ttft_s)

    def record_cached_tokens(self, worker_id: str, predicted: int, actual: int) -> None:
        """One request's predicted vs actual prefix-hit tokens."""
        self.child(self.predicted_cached, worker_id).observe(predicted)
        self.child(self.actual_cached, worker_id).observe(actual)
        self.child(self.cached_error, worker_id).observe(abs(actual - predicted))

    def record_ttft_prediction(self, worker_id: str, predicted_ms: float, observed_ms: float) -> None:
        """One streamed request's predicted and observed TTFT, both from dispatch."""
        self.child(self.predicted_ttft_s, worker_id).observe(predicted_ms / 1000.0)
        if predicted_ms > 0:
            self.child(self.ttft_prediction_ratio, worker_id).observe(observed_ms / predicted_ms)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
