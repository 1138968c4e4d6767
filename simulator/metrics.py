"""``GET /metrics`` of the simulated server: vLLM 0.32's metric names (``vllm/v1/metrics/loggers.py``)
with labels ``model_name`` and ``engine="0"``, read from the engine at scrape time.

Exposed: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(0..1) gauges; ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (tokens),
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:request_success_total``,
``vllm:num_preemptions_total`` counters; ``vllm:cache_config_info`` = 1 with the cache settings as
labels. P/D (KV loaded from a prefill worker instead of computed, :mod:`simulator.engine`):
``vllm:external_prefix_cache_queries_total`` / ``vllm:external_prefix_cache_hits_total`` (tokens
asked of / loaded over the link), ``vllm:prompt_tokens_by_source_total{source}`` (local_compute,
local_cache_hit, external_kv_transfer), ``vllm:prompt_tokens_cached_total`` and
``vllm:prompt_tokens_cached_by_source_total{source}`` (device, p2p: vLLM's CacheHitSource for
NixlConnector), and NixlConnector's ``vllm:nixl_xfer_time_seconds`` (simulated seconds) and
``vllm:nixl_bytes_transferred`` histograms (sum and count only, one ``+Inf`` bucket). Each server has its own ``CollectorRegistry``, never the global one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from simulator.app import SimServer


class _EngineCollector:
    """A prometheus-client collector reading one server's engine and block pool."""

    def __init__(self, server: "SimServer") -> None:
        self.server = server

    def collect(self):
        s = self.server
        engine, stats = s.engine, s.engine.stats
        names = ["model_name", "engine"]
        labels = [s.model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    engine.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    engine.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.pool.usage())
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      stats.prefix_cache_queries_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stats.prefix_cache_hits_tokens)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
        yield counter("vllm:request_success", "Count of successfully processed requests.", stats.request_success)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions)
        yield counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                      "cross-instance cache sharing, in terms of number of queried tokens.",
                      stats.external_queries_tokens)
        yield counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                      "cross-instance cache sharing, in terms of number of cached tokens.", stats.external_hits_tokens)
        local_hits, external = stats.prefix_cache_hits_tokens, stats.external_hits_tokens
        by_source = {"local_compute": stats.prompt_tokens - local_hits - external,
                     "local_cache_hit": local_hits, "external_kv_transfer": external}
        c = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                labels=names + ["source"])
        for source, value in by_source.items():
            c.add_metric(labels + [source], value)
        yield c
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                      local_hits + external)
        c = CounterMetricFamily("vllm:prompt_tokens_cached_by_source",
                                "Prefix-cache hit tokens by the cache tier that supplied them.",
                                labels=names + ["source"])
        c.add_metric(labels + ["device"], local_hits)
        c.add_metric(labels + ["p2p"], external)
        yield c
        h = HistogramMetricFamily("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV "
                                  "Cache transfers.", labels=names)
        h.add_metric(labels, [("+Inf", stats.kv_transfers)], stats.kv_transfer_sim_s)
        yield h
        h = HistogramMetricFamily("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV "
                                  "Cache transfers.", labels=names)
        h.add_metric(labels, [("+Inf", stats.kv_transfers)], stats.kv_transfer_bytes)
        yield h
        info = {"block_size": str(s.cfg.block_size), "hash_block_size": str(s.cfg.block_size),
                "num_gpu_blocks": str(s.cfg.num_gpu_blocks), "num_cpu_blocks": "None",
                "enable_prefix_caching": "True", "prefix_caching_hash_algo": "xxhash_sim",
                "engine": "0"}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
        g.add_metric(list(info.values()), 1.0)
        yield g


def make_registry(server: "SimServer") -> CollectorRegistry:
    """A fresh registry holding one collector for ``server``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(server))
    return registry
