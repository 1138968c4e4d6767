"""``GET /metrics`` of the simulated server: vLLM 0.32's metric names (``vllm/v1/metrics/loggers.py``)
with labels ``model_name`` and ``engine`` (the data parallel rank: one label set per rank, as
vLLM's per-engine loggers), read from the engines at scrape time.

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

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from simulator.block_pool import BlockPool
from simulator.config import SimConfig
from simulator.engine import Engine


class RankView(Protocol):
    """What the collector reads of one data parallel rank (:class:`simulator.app.SimRank`)."""

    rank: int
    pool: BlockPool
    engine: Engine


class ServerView(Protocol):
    """What the collector reads of a server (:class:`simulator.app.SimServer`)."""

    cfg: SimConfig
    model: str
    ranks: Sequence[RankView]


class _EngineCollector:
    """A prometheus-client collector reading one server's engine and block pool."""

    def __init__(self, server: ServerView) -> None:
        self.server = server

    def collect(self):
        s = self.server
        names = ["model_name", "engine"]
        ranks = [([s.model, str(r.rank)], r) for r in s.ranks]  # one label set per data parallel rank

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            for labels, r in ranks:
                g.add_metric(labels, value(r))
            return g

        def counter(name: str, doc: str, value) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            for labels, r in ranks:
                c.add_metric(labels, value(r))
            return c

        def by_source(name: str, doc: str, sources) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names + ["source"])
            for labels, r in ranks:
                for source, value in sources(r.engine.stats).items():
                    c.add_metric(labels + [source], value)
            return c

        def histogram(name: str, doc: str, count, total) -> HistogramMetricFamily:
            h = HistogramMetricFamily(name, doc, labels=names)
            for labels, r in ranks:
                h.add_metric(labels, [("+Inf", count(r.engine.stats))], total(r.engine.stats))
            return h

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    lambda r: r.engine.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    lambda r: r.engine.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda r: r.pool.usage())
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      lambda r: r.engine.stats.prefix_cache_queries_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      lambda r: r.engine.stats.prefix_cache_hits_tokens)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lambda r: r.engine.stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      lambda r: r.engine.stats.generation_tokens)
        yield counter("vllm:request_success", "Count of successfully processed requests.",
                      lambda r: r.engine.stats.request_success)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      lambda r: r.engine.stats.preemptions)
        yield counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                      "cross-instance cache sharing, in terms of number of queried tokens.",
                      lambda r: r.engine.stats.external_queries_tokens)
        yield counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                      "cross-instance cache sharing, in terms of number of cached tokens.",
                      lambda r: r.engine.stats.external_hits_tokens)
        yield by_source("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", lambda st: {
            "local_compute": st.prompt_tokens - st.prefix_cache_hits_tokens - st.external_hits_tokens,
            "local_cache_hit": st.prefix_cache_hits_tokens, "external_kv_transfer": st.external_hits_tokens})
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                      lambda r: r.engine.stats.prefix_cache_hits_tokens + r.engine.stats.external_hits_tokens)
        yield by_source("vllm:prompt_tokens_cached_by_source",
                        "Prefix-cache hit tokens by the cache tier that supplied them.",
                        lambda st: {"device": st.prefix_cache_hits_tokens, "p2p": st.external_hits_tokens})
        yield histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                        lambda st: st.kv_transfers, lambda st: st.kv_transfer_sim_s)
        yield histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                        lambda st: st.kv_transfers, lambda st: st.kv_transfer_bytes)
        info = {"block_size": str(s.cfg.block_size), "hash_block_size": str(s.cfg.block_size),
                "num_gpu_blocks": str(s.cfg.num_gpu_blocks), "num_cpu_blocks": "None",
                "enable_prefix_caching": "True", "prefix_caching_hash_algo": "xxhash_sim",
                "engine": "0"}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
        for r in s.ranks:
            g.add_metric(list({**info, "engine": str(r.rank)}.values()), 1.0)
        yield g


def make_registry(server: ServerView) -> CollectorRegistry:
    """A fresh registry holding one collector for ``server``; its names are learnt by one collect
    at registration (``auto_describe``), so prometheus_client's ``name[]`` filter
    (``restricted_registry``, what ``GET /metrics/?name[]=...`` answers) finds them."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_EngineCollector(server))
    return registry
