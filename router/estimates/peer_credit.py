"""Peer pull: a worker that misses a prefix another worker holds may pull those KV blocks from
that worker's offload agent over TCP instead of computing them. This module is the gateway's
side of it: what each worker's agent says about pulling, which blocks a candidate could pull,
and what a pulled block is worth against computing it.

Where the gateway learns it. Every agent writing a Redis index publishes its ingest state with
each heartbeat (:meth:`kvcore.index.redis.RedisIndex.heartbeat`); an agent with peer pull adds a
``"peer"`` mapping to it::

    {"serve": "10.0.0.5:7601",     # host:port where this agent serves its blocks to peers (absent: none)
     "pull": true,                 # this worker's KV connector pulls missing blocks from peers
     "block_bytes": 65536,         # bytes of one KV block, all layers
     "block_size": 32,             # tokens per block
     "fingerprint": "9f1c...",     # hex digest of the KV layout: blocks move only between equal ones
     "link_bytes_per_s": 1.1e9,    # measured over its recent pulls; null until it has pulled
     "pull_overhead_ms": 2.0,      # measured fixed cost of one pull; null until measured
     "pulls": 12, "pulled_blocks": 700, "failed_pulls": 0}

With the gateway's embedded index, agents started with ``kvroute agent --index http://GATEWAY``
publish the same state to the gateway instead (``PUT /admin/workers/{id}/peer``, kept for a TTL:
:mod:`router.workers.peer_states`). :class:`router.workers.peers.PeerPoller` reads every agent's state
(:meth:`~kvcore.index.base.SupportsWorkerStates.worker_states` of
:class:`router.workers.peer_states.PeerStateSource`: the published ones over a shared index's, one
Redis round trip) every ``interval_s`` into a :class:`router.workers.peers.PeerTable`, which
routing reads. Without agents that publish, the table stays empty and
no candidate is credited for peer blocks. A field of the wrong type or out of range is read as
absent, so an agent of another release can never fail routing.

Peer blocks of a candidate W (:func:`peer_blocks_by_worker`)::

    creditable     = (prompt_tokens - 1) // block_size          # vLLM always computes the last token
    best           = max over servers V != W of V.matched.total  (0 when none)
    peer_blocks(W) = max(0, min(best, creditable) - W.matched.total)    when W's agent says pull

A server is a worker whose agent publishes a ``serve`` address, that the index matches for the
prompt, whose layout ``fingerprint`` equals W's (when W's agent publishes one: the agent pulls only
between equal layouts), and whose evidence the gateway credits when it is registered here (W's
agent, which does not know that, may still try a distrusted longer holder first; its blocks are
then reported missing and computed). All of V's matched run
counts as servable, whatever its tier split (:class:`kvcore.index.base.TierMatch` puts the run's
GPU-resident head in ``gpu``): V's KV connector saves every prompt block into its CPU tier as it
computes it, so a block in V's GPU cache is in V's CPU tier as well, where its agent serves it.
(A block V's CPU tier has since evicted while its GPU still holds it is the exception; the
puller then computes it.)

Worth of one pulled block (:func:`peer_credit_per_block`), the share of its prefill it saves::

    pull_ms_per_block    = 1000 x block_bytes / link_bytes_per_s + pull_overhead_ms / blocks
    prefill_ms_per_block = ms_per_token x block_size
    credit               = clamp(1 - pull_ms_per_block / prefill_ms_per_block, 0, 1)

``link_bytes_per_s`` and ``pull_overhead_ms`` are the puller's own measurements; until it has
measured them the policy's priors stand in (``peer_link_gbit_s``, default 10 Gbit/s, and
``peer_pull_overhead_ms``, default 1 ms), so a fresh cluster can pull at all. ``ms_per_token``
is the puller's prefill rate as the policy knows it. A configured ``tier_credit.peer`` replaces
the whole computation by a fixed weight. The policies then credit ``peer_blocks x credit`` blocks
on top of the tier-weighted credit of the worker's own matches, so the pull's time appears in a
predicted TTFT as ``peer_blocks x block_size x ms_per_token x (1 - credit)``, which is
``peer_blocks x pull_ms_per_block`` whenever the credit is not clamped.

Pure: the poll and the table of the latest states are :mod:`router.workers.peers`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvcore.index.base import TierMatch

DEFAULT_PEER_LINK_GBIT_S = 10.0  # prior link speed until a worker has measured its pulls
DEFAULT_PEER_PULL_OVERHEAD_MS = 1.0  # prior fixed cost of one pull: a LAN round trip, the peer's lookup

SOURCE_CONFIG = "config"  # tier_credit.peer fixed the weight
SOURCE_MEASURED = "measured"  # the puller's measured link speed (and overhead when measured)
SOURCE_PRIOR = "prior"  # the policy's prior link speed and overhead: the puller has not measured yet
SOURCE_UNKNOWN = "unknown_block_bytes"  # the puller's agent did not say how large a block is: no credit


def gbit_s_to_bytes_per_s(gbit_s: float) -> float:
    """Link speed in Gbit/s (10^9 bits per second) as bytes per second."""
    return gbit_s * 1e9 / 8.0


def peer_credit_per_block(block_bytes: float, link_bytes_per_s: float, pull_overhead_ms: float, blocks: int,
                          ms_per_token: float, block_size: int) -> float:
    """The share (0..1) of one block's prefill that pulling it from a peer saves, when ``blocks``
    blocks are pulled in one pull (module docstring)::

        1 - (1000 x block_bytes / link_bytes_per_s + pull_overhead_ms / blocks) / (ms_per_token x block_size)

    clamped to [0, 1]. ``block_bytes``: bytes of one block (all layers); ``link_bytes_per_s``:
    the link's speed; ``pull_overhead_ms``: fixed milliseconds per pull, shared by its blocks;
    ``ms_per_token``: the puller's prefill milliseconds per token; ``block_size``: tokens per
    block (the size ``block_bytes`` refers to). 0.0 when ``blocks`` <= 0 (nothing to pull).
    Raises ValueError when ``link_bytes_per_s``, ``ms_per_token`` or ``block_size`` is not
    positive, ``block_bytes`` or ``pull_overhead_ms`` is negative, or any figure is not finite."""
    for name, value in (("block_bytes", block_bytes), ("pull_overhead_ms", pull_overhead_ms)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    for name, value in (("link_bytes_per_s", link_bytes_per_s), ("ms_per_token", ms_per_token),
                        ("block_size", block_size)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if blocks <= 0:
        return 0.0
    pull_ms = 1000.0 * block_bytes / link_bytes_per_s + pull_overhead_ms / blocks
    prefill_ms = ms_per_token * block_size
    return min(1.0, max(0.0, 1.0 - pull_ms / prefill_ms))


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def _non_negative(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _skipping(breakers: Any) -> frozenset[str]:
    """The peers an agent's published ``breakers`` (peer id -> ``open_s``, ``trying``, ...) say
    it skips now; anything malformed counts as not skipped."""
    if not isinstance(breakers, Mapping):
        return frozenset()
    out = set()
    for peer, st in breakers.items():
        if isinstance(peer, str) and isinstance(st, Mapping):
            open_s = st.get("open_s")
            if st.get("trying") is True or (isinstance(open_s, (int, float)) and not isinstance(open_s, bool)
                                             and open_s > 0):
                out.add(peer)
    return frozenset(out)


@dataclass(frozen=True)
class PeerInfo:
    """One worker's peer-pull state as its agent last published it (module docstring).

    ``serve``: ``host:port`` its agent serves blocks on, None when it serves none; ``pull``:
    whether its connector pulls from peers; ``block_bytes`` (bytes) and ``block_size`` (tokens)
    of one block, None when not said; ``fingerprint``: hex digest of its KV layout (blocks move
    only between equal ones), None when not said; ``link_bytes_per_s`` and ``pull_overhead_ms``: measured
    over its recent pulls, None until measured; ``pulls``, ``pulled_blocks``, ``failed_pulls``:
    its counters; ``skipping``: worker ids of the peers its agent skips now after failed pulls
    (its breaker, ``peer.breakers`` entries with ``open_s`` > 0 or ``trying``): no credit from them
    for this worker until the agent tries them again."""

    serve: str | None = None
    pull: bool = False
    block_bytes: int | None = None
    block_size: int | None = None
    fingerprint: str | None = None
    link_bytes_per_s: float | None = None
    pull_overhead_ms: float | None = None
    pulls: int = 0
    pulled_blocks: int = 0
    failed_pulls: int = 0
    skipping: frozenset[str] = frozenset()

    @classmethod
    def from_state(cls, state: Any) -> PeerInfo | None:
        """The ``"peer"`` mapping of an agent's published state, None when the state has none (an
        agent without peer pull). Never raises: a field of the wrong type or out of range is read
        as absent (``serve`` None, ``pull`` False, a figure None, a counter 0)."""
        peer = state.get("peer") if isinstance(state, Mapping) else None
        if not isinstance(peer, Mapping):
            return None
        serve = peer.get("serve")
        fingerprint = peer.get("fingerprint")
        block_bytes = _positive(peer.get("block_bytes"))
        block_size = _positive(peer.get("block_size"))
        return cls(serve=serve if isinstance(serve, str) and serve else None,
                   pull=peer.get("pull") is True,
                   block_bytes=int(block_bytes) if block_bytes is not None else None,
                   block_size=int(block_size) if block_size is not None and block_size >= 1 else None,
                   fingerprint=fingerprint if isinstance(fingerprint, str) and fingerprint else None,
                   link_bytes_per_s=_positive(peer.get("link_bytes_per_s")),
                   pull_overhead_ms=_non_negative(peer.get("pull_overhead_ms")),
                   pulls=_count(peer.get("pulls")), pulled_blocks=_count(peer.get("pulled_blocks")),
                   failed_pulls=_count(peer.get("failed_pulls")), skipping=_skipping(peer.get("breakers")))

    def as_dict(self) -> dict[str, Any]:
        """For ``GET /admin/workers`` (the published shape)."""
        return {"serve": self.serve, "pull": self.pull, "block_bytes": self.block_bytes,
                "block_size": self.block_size, "fingerprint": self.fingerprint,
                "link_bytes_per_s": self.link_bytes_per_s,
                "pull_overhead_ms": self.pull_overhead_ms, "pulls": self.pulls,
                "pulled_blocks": self.pulled_blocks, "failed_pulls": self.failed_pulls,
                "skipping": sorted(self.skipping)}


@dataclass(frozen=True)
class PeerPricing:
    """How a policy weighs a peer block: ``fixed_credit`` (``tier_credit.peer``, 0..1) when
    configured, else :func:`peer_credit_per_block` from the puller's measurements, with
    ``prior_link_bytes_per_s`` and ``prior_overhead_ms`` standing in for what it has not
    measured yet."""

    fixed_credit: float | None = None
    prior_link_bytes_per_s: float = gbit_s_to_bytes_per_s(DEFAULT_PEER_LINK_GBIT_S)
    prior_overhead_ms: float = DEFAULT_PEER_PULL_OVERHEAD_MS

    def credit(self, puller: PeerInfo | None, blocks: int, ms_per_token: float,
               block_size: int) -> tuple[float, str]:
        """``(credit per block 0..1, source)`` for ``blocks`` peer blocks pulled by a worker whose
        agent published ``puller``, whose prefill takes ``ms_per_token`` ms per token, for
        blocks of ``block_size`` tokens (used when the agent did not say its block size). The
        source is one of :data:`SOURCE_CONFIG`, :data:`SOURCE_MEASURED`, :data:`SOURCE_PRIOR`
        (the link speed was not measured yet) or :data:`SOURCE_UNKNOWN` (no block size in
        bytes: credit 0). ``(0.0, "")`` when ``blocks`` <= 0."""
        if blocks <= 0:
            return 0.0, ""
        if self.fixed_credit is not None:
            return self.fixed_credit, SOURCE_CONFIG
        if puller is None or puller.block_bytes is None:
            return 0.0, SOURCE_UNKNOWN
        link = puller.link_bytes_per_s
        source = SOURCE_MEASURED if link is not None else SOURCE_PRIOR
        overhead = puller.pull_overhead_ms if puller.pull_overhead_ms is not None else self.prior_overhead_ms
        credit = peer_credit_per_block(puller.block_bytes, link if link is not None else self.prior_link_bytes_per_s,
                                       overhead, blocks, max(ms_per_token, 1e-9),
                                       puller.block_size or max(1, block_size))
        return credit, source


def peer_blocks_by_worker(candidates: Iterable[tuple[str, TierMatch]], matches: Mapping[str, TierMatch],
                          peers: Mapping[str, PeerInfo], creditable_blocks: int,
                          distrusted: Callable[[str], bool] = lambda _: False) -> dict[str, tuple[int, str]]:
    """For each candidate ``(worker id, its own match)`` whose agent pulls, ``(peer blocks, the
    peer's worker id)`` (module docstring); candidates with no peer blocks are left out.
    ``matches``: the index's answer for the prompt, per worker (candidates or not);
    ``peers``: peer info by worker id; ``creditable_blocks``: prompt blocks a hit may cover,
    ``(prompt_tokens - 1) // block_size``; ``distrusted(worker id)``: True for a worker whose
    index entries the gateway does not credit (never a peer). The peer is the server with the
    longest match among those of the candidate's layout fingerprint (any, when the candidate's
    agent publishes none) that the candidate's agent is not skipping (``PeerInfo.skipping``),
    ties to the lower worker id. O(servers log servers) plus, per
    candidate, a scan that stops at the first server that fits (the first or second one when
    every agent has one layout)."""
    if creditable_blocks <= 0:
        return {}
    servers = sorted(((match.total, wid, info.fingerprint) for wid, match in matches.items()
                      if (info := peers.get(wid)) is not None and info.serve is not None and match.total > 0
                      and not distrusted(wid)), key=lambda t: (-t[0], t[1]))
    if not servers:
        return {}
    out: dict[str, tuple[int, str]] = {}
    for wid, own in candidates:
        info = peers.get(wid)
        if info is None or not info.pull:
            continue
        best = next((s for s in servers if s[1] != wid and s[1] not in info.skipping
                     and (info.fingerprint is None or s[2] == info.fingerprint)), None)
        if best is None:
            continue
        n = min(best[0], creditable_blocks) - own.total
        if n > 0:
            out[wid] = (n, best[1])
    return out
