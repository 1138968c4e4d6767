"""``kv_aware``: send a request where its prefill is cheapest, counting both the cached prefix and
the work already queued on the worker.

Cost of a candidate, in blocks (lower wins)::

    credit = min(num_blocks, gpu x tier_credit.gpu + cpu x tier_credit.cpu + ssd x tier_credit.ssd
                             + peer_blocks x peer_credit)
    cost   = (num_blocks - credit) + load_weight x load

``gpu``/``cpu``/``ssd`` are the candidate's matched blocks by tier (:class:`TierMatch`), ``load``
the worker's outstanding work in blocks (:mod:`router.policies.load`: predicted prefill tokens
in flight, in-flight requests x ``decode_tokens_per_request``, the engine's queue when scraped).
Absolute blocks, not a match ratio, so a long prompt's hit outweighs a short one's (GIE #2561).
A candidate whose evidence is distrusted (:mod:`router.estimates.evidence`) gets no credit.
The default tier credits (gpu 1.0, cpu 0.75, ssd 0.25) are Dynamo's device/host/disk weights.

Peer pull (:mod:`router.estimates.peer_credit`): ``peer_blocks`` are the prompt blocks past the candidate's
own run that another worker's agent can serve and the candidate's connector pulls (0 without peer
pull, which leaves the cost above as it was). ``peer_credit`` (0..1) is ``tier_credit.peer`` when
configured, else the pull's measured worth: :func:`router.estimates.peer_credit.peer_credit_per_block` from the
candidate's measured link speed and pull overhead (until measured: ``peer_link_gbit_s``, default
10, and ``peer_pull_overhead_ms``, default 1) against its prefill rate (the learned one, else
0.1 ms per token). So a busy holder can lose the request to an idle worker that pulls. The peer
credit does not depend on the candidate's own evidence (the blocks come from the peer, whose
distrusted evidence makes it no peer).

Selection, in order:

1. ``prompt_tokens`` is None (no exact tokens): the least-loaded worker, reason ``no_tokens``.
2. Overload guard (per candidate, so one hot shared prefix cannot pin all traffic on its holder):
   a candidate is skipped when its load exceeds the least-loaded candidate's by more than
   ``overload_guard.excess_tokens`` (in tokens) *and* is more than ``overload_guard.ratio`` times
   it. The least-loaded candidate is never skipped. Reason ``overload_guard`` when the skipped
   candidate would otherwise have won.
3. Among the rest, lowest cost; ties (within 1e-9) to lower load; remaining ties in worker-id
   order, ``request.rand`` picking one (so equal cold workers share traffic; rand 0 -> first).
4. ``temperature`` > 0: instead sample with probability ~ exp(-normalised cost / temperature)
   (:func:`router.policies.ranking.softmax_pick`, driven by ``request.rand``: reproducible).
   Reason ``temperature`` when the sample is not a lowest-cost candidate.
5. Otherwise the reason is ``peer_pull`` when the winner is credited for peer blocks, else
   ``prefix_hit`` when the winner's credit beats the smallest credit among the candidates
   considered (its cache decided), else ``load``.

Scores come back best first: the winner, then the unguarded candidates by (cost, load, id), then
the guarded ones (note ``overloaded``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcore.index.base import TIERS, TierMatch
from router.estimates.peer_credit import (DEFAULT_PEER_LINK_GBIT_S, DEFAULT_PEER_PULL_OVERHEAD_MS, PeerPricing,
                                          gbit_s_to_bytes_per_s)
from router.estimates.prefill_rate import DEFAULT_PREFILL_MS_PER_TOKEN
from router.policies._config import boolean, check_keys, mapping, number
from router.policies.base import Candidate, CandidateScore, Decision, Policy, RouteRequest
from router.policies.load import LOAD_KEYS, LoadModel
from router.policies.ranking import EPS, chosen_first, lowest, softmax_pick

DEFAULT_TIER_CREDIT = {"gpu": 1.0, "cpu": 0.75, "ssd": 0.25}
PEER = "peer"  # the tier_credit key of a block pulled from a peer (absent: weighed by the pull's cost)
PEER_KEYS = ("peer_link_gbit_s", "peer_pull_overhead_ms")


def tier_credit_from_config(cfg: Mapping[str, Any]) -> dict[str, float]:
    """``policy.tier_credit`` with defaults filled in (every tier, each in [0, 1]), plus ``peer``
    (in [0, 1]) only when the config sets it. Raises ValueError when it is not a mapping, names an
    unknown tier or has a bad value."""
    credit_cfg = mapping(cfg.get("tier_credit", {}), "policy.tier_credit")
    check_keys(credit_cfg, TIERS + (PEER,), "policy.tier_credit")
    out = {t: number(credit_cfg, t, DEFAULT_TIER_CREDIT[t], "policy.tier_credit", hi=1.0) for t in TIERS}
    if PEER in credit_cfg:
        out[PEER] = number(credit_cfg, PEER, 0.0, "policy.tier_credit", hi=1.0)
    return out


@dataclass(frozen=True)
class PeerSettings:
    """The peer-pull keys of a policy config (:mod:`router.estimates.peer_credit`): ``fixed_credit``
    (``tier_credit.peer``, 0..1: every peer block weighs that much), ``link_gbit_s``
    (``peer_link_gbit_s``, > 0) and ``pull_overhead_ms`` (``peer_pull_overhead_ms``, >= 0): the
    priors for a worker that has not measured its pulls yet. None: not set in the config (the
    weight then comes from the pull's cost; the priors take their defaults, 10 Gbit/s and 1 ms).
    Keys not set stay out of :meth:`config`, so a policy's effective config is unchanged for a
    cluster without peer pull."""

    fixed_credit: float | None = None
    link_gbit_s: float | None = None
    pull_overhead_ms: float | None = None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], tier_credit: Mapping[str, float], where: str) -> PeerSettings:
        """From a policy config (``tier_credit`` already read by :func:`tier_credit_from_config`).
        Raises ValueError naming the key: a link speed not above 0 or a negative overhead."""
        link = number(cfg, "peer_link_gbit_s", DEFAULT_PEER_LINK_GBIT_S, where) if "peer_link_gbit_s" in cfg else None
        if link is not None and link <= 0:
            raise ValueError(f"{where}.peer_link_gbit_s must be > 0, got {cfg['peer_link_gbit_s']!r}")
        overhead = number(cfg, "peer_pull_overhead_ms", DEFAULT_PEER_PULL_OVERHEAD_MS, where) \
            if "peer_pull_overhead_ms" in cfg else None
        return cls(tier_credit.get(PEER), link, overhead)

    @property
    def pricing(self) -> PeerPricing:
        link = DEFAULT_PEER_LINK_GBIT_S if self.link_gbit_s is None else self.link_gbit_s
        overhead = DEFAULT_PEER_PULL_OVERHEAD_MS if self.pull_overhead_ms is None else self.pull_overhead_ms
        return PeerPricing(self.fixed_credit, gbit_s_to_bytes_per_s(link), overhead)

    def config(self) -> dict[str, float]:
        """The keys set in the config (``tier_credit.peer`` excepted: it is in ``tier_credit``)."""
        out = {}
        if self.link_gbit_s is not None:
            out["peer_link_gbit_s"] = self.link_gbit_s
        if self.pull_overhead_ms is not None:
            out["peer_pull_overhead_ms"] = self.pull_overhead_ms
        return out


def peer_credit(candidate: Candidate, pricing: PeerPricing, request: RouteRequest,
                ms_per_token: float) -> tuple[int, float, str]:
    """``(peer blocks, credit per block, source)`` of ``candidate``: its peer blocks (at most the
    prompt's creditable blocks, ``(prompt_tokens - 1) // block_size``, beyond its own run) and their
    weight (:meth:`router.estimates.peer_credit.PeerPricing.credit`) at ``ms_per_token`` ms per prefill token.
    ``(0, 0.0, "")`` without peer blocks or exact tokens."""
    if candidate.peer_blocks <= 0 or not request.prompt_tokens:
        return 0, 0.0, ""
    bs = max(1, request.block_size)
    blocks = min(candidate.peer_blocks, (request.prompt_tokens - 1) // bs - candidate.matched.total)
    if blocks <= 0:
        return 0, 0.0, ""
    credit, source = pricing.credit(candidate.peer, blocks, ms_per_token, bs)
    return blocks, credit, source


def note_peer(score: CandidateScore, candidate: Candidate, blocks: int, credit: float, source: str) -> None:
    """Put a candidate's peer pull on its score (``POST /admin/explain`` shows it)."""
    if blocks > 0:
        score.peer_blocks, score.peer_worker = blocks, candidate.peer_worker
        score.peer_credit, score.peer_credit_source = credit, source


def tier_weighted_blocks(matched: TierMatch, tier_credit: Mapping[str, float]) -> float:
    """Matched blocks weighted by tier: ``gpu x credit.gpu + cpu x credit.cpu + ssd x credit.ssd``."""
    return matched.gpu * tier_credit["gpu"] + matched.cpu * tier_credit["cpu"] + matched.ssd * tier_credit["ssd"]


@dataclass(frozen=True)
class OverloadGuard:
    """Skip a candidate whose load is more than ``excess_tokens`` above the least-loaded one's and
    more than ``ratio`` times it. Defaults: 32768 tokens (about 3 s of queued prefill at 10k
    tokens/s, or 256 decoding requests at the default decode weight), ratio 1.5 (SMG's
    ``balance_rel_threshold``). The guard is a safety net for hits longer than that (a long shared
    document or agent prompt), where the cost alone would let the holder's queue grow by the whole
    hit; set lower, it skips real conversation hits on long prompts as well (runs:
    docs/tuning/kv_aware_policy.md)."""

    enabled: bool = True
    excess_tokens: float = 32768.0
    ratio: float = 1.5

    @classmethod
    def from_config(cls, value: Any) -> OverloadGuard:
        """From ``policy.overload_guard`` (a mapping; missing keys take defaults; ``null`` or
        ``false`` disables). Raises ValueError on unknown keys or bad values."""
        if value is None or value is False:
            return cls(enabled=False)
        where = "policy.overload_guard"
        cfg = mapping(value, where)
        check_keys(cfg, ("enabled", "excess_tokens", "ratio"), where)
        return cls(enabled=boolean(cfg, "enabled", cls.enabled, where),
                   excess_tokens=number(cfg, "excess_tokens", cls.excess_tokens, where),
                   ratio=number(cfg, "ratio", cls.ratio, where, lo=1.0))

    def config(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "excess_tokens": self.excess_tokens, "ratio": self.ratio}

    def overloaded(self, load: float, min_load: float, block_size: int) -> bool:
        """Whether a candidate with ``load`` blocks is skipped, the least-loaded having ``min_load``."""
        return (self.enabled and (load - min_load) * block_size > self.excess_tokens + EPS
                and load > self.ratio * min_load + EPS)


@dataclass
class _Scored:
    score: CandidateScore
    credit: float
    overloaded: bool = False

    @property
    def worker_id(self) -> str:
        return self.score.worker_id

    @property
    def cost(self) -> float:
        return self.score.cost if self.score.cost is not None else 0.0

    @property
    def load(self) -> float:
        return self.score.load


class KVAwarePolicy(Policy):
    """Prefix credit by tier against load; see the module docstring for the cost and selection."""

    name = "kv_aware"
    uses_index = True
    CONFIG_KEYS: tuple[str, ...] = ("tier_credit", "load_weight", "temperature",
                                    "overload_guard") + LOAD_KEYS + PEER_KEYS

    def __init__(self, tier_credit: Mapping[str, float] | None = None, load_weight: float = 1.0,
                 temperature: float = 0.0, overload_guard: OverloadGuard | None = None,
                 load_model: LoadModel | None = None, peer: PeerSettings | None = None) -> None:
        self.tier_credit = {**DEFAULT_TIER_CREDIT, **(tier_credit or {})}
        self.load_weight = load_weight
        self.temperature = temperature
        self.overload_guard = overload_guard or OverloadGuard()
        self.load_model = load_model or LoadModel()
        self.peer = peer or PeerSettings(self.tier_credit.get(PEER))
        self.peer_pricing = self.peer.pricing

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> KVAwarePolicy:
        """Build from the policy config without ``name``. Raises ValueError on unknown keys, a tier
        credit outside [0, 1] or for an unknown tier, a negative weight or temperature, or a bad
        peer-pull prior (:class:`PeerSettings`)."""
        check_keys(cfg, cls.CONFIG_KEYS, f"policy {cls.name!r}")
        tier_credit = tier_credit_from_config(cfg)
        return cls(tier_credit=tier_credit,
                   load_weight=number(cfg, "load_weight", 1.0, "policy"),
                   temperature=number(cfg, "temperature", 0.0, "policy"),
                   overload_guard=OverloadGuard.from_config(cfg.get("overload_guard", {})),
                   load_model=LoadModel.from_config(cfg, "policy"),
                   peer=PeerSettings.from_config(cfg, tier_credit, "policy"))

    def config(self) -> dict[str, Any]:
        """The effective config without ``name`` (peer-pull keys only when set)."""
        return {"tier_credit": dict(self.tier_credit), "load_weight": self.load_weight,
                "temperature": self.temperature, "overload_guard": self.overload_guard.config(),
                **self.load_model.config(), **self.peer.config()}

    def credit_blocks(self, matched: TierMatch, num_blocks: int) -> float:
        """Prefill blocks the candidate's cache saves, weighted by tier, at most ``num_blocks``."""
        return min(float(max(0, num_blocks)), tier_weighted_blocks(matched, self.tier_credit))

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        bs = request.block_size
        if request.prompt_tokens is None:
            loads = [self.load_model.load_blocks(c.load, bs) for c in candidates]
            scored = [_Scored(CandidateScore(c.worker_id, c.matched, x, x), 0.0)
                      for c, x in zip(candidates, loads)]
            best = lowest(scored, [_load], _worker, request.rand)
            return _decision(best, "no_tokens", scored)

        num_blocks = max(0, request.num_blocks)
        scored = []
        for c in candidates:
            load = self.load_model.load_blocks(c.load, bs)
            credit = self.credit_blocks(c.matched, num_blocks) if c.evidence_trusted else 0.0
            peer_blocks = 0
            if c.peer_blocks > 0:  # (peer_credit's answer is (0, 0.0, "") otherwise)
                peer_blocks, peer_weight, source = peer_credit(
                    c, self.peer_pricing, request,
                    c.prefill_rate.ms_per_token if c.prefill_rate is not None else DEFAULT_PREFILL_MS_PER_TOKEN)
                if peer_blocks:
                    credit = min(float(num_blocks), credit + peer_blocks * peer_weight)
            cost = (num_blocks - credit) + self.load_weight * load
            score = CandidateScore(c.worker_id, c.matched, load, cost)
            if peer_blocks:
                note_peer(score, c, peer_blocks, peer_weight, source)
            if not c.evidence_trusted:
                score.note = "evidence distrusted"  # its matched blocks earn no credit
            scored.append(_Scored(score, credit))
        min_load = min(s.load for s in scored)
        for s in scored:
            s.overloaded = self.overload_guard.overloaded(s.load, min_load, bs)
            if s.overloaded:
                s.score.note = "overloaded"
        eligible = [s for s in scored if not s.overloaded] or scored

        best = lowest(eligible, [_cost, _load], _worker, request.rand)
        chosen = best
        if self.temperature > 0 and len(eligible) > 1:
            ordered = sorted(eligible, key=_order)
            chosen = ordered[softmax_pick([s.cost for s in ordered], self.temperature, request.rand)]

        if len(eligible) < len(scored) and lowest(scored, [_cost, _load], _worker, 0.0).overloaded:
            reason = "overload_guard"
        elif chosen.cost > best.cost + EPS:
            reason = "temperature"
        elif chosen.score.peer_credit_blocks > EPS:
            reason = "peer_pull"
        elif chosen.credit > min(s.credit for s in eligible) + EPS:
            reason = "prefix_hit"
        else:
            reason = "load"
        return _decision(chosen, reason, scored)


def _decision(chosen: _Scored, reason: str, scored: list[_Scored]) -> Decision:
    ranked = chosen_first(scored, chosen, _order)
    return Decision(chosen.worker_id, reason, [s.score for s in ranked])


def _order(s: _Scored) -> tuple[bool, float, float, str]:
    return (s.overloaded, s.cost, s.load, s.worker_id)


def _cost(s: _Scored) -> float:
    return s.cost


def _load(s: _Scored) -> float:
    return s.load


def _worker(s: _Scored) -> str:
    return s.worker_id
