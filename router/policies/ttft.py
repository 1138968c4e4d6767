"""``ttft`` (the default policy): send a request to the worker that will give it its first token
soonest. Its dispatch queue (:mod:`router.route.dispatch_queue`, ``queue.enabled`` true by default for
this policy only) holds requests in the gateway until a worker is free for them, shortest prefill
first; the choice below is then made among the free workers, or the request waits while this
policy prefers a busy one (``queue.affinity_wait_s``, 5 s for this policy); its queue defaults
are ``worker_prefills: 1, worker_queue_ms: 50`` (:mod:`router.policies.queue` says why). Tuning
runs, and this policy against other routers: docs/tuning/ttft_policy.md.

Predicted TTFT of a candidate, in milliseconds from dispatch (:mod:`router.estimates.prefill_rate`)::

    credit_tokens = min(gpu x tier_credit.gpu + cpu x tier_credit.cpu + ssd x tier_credit.ssd,
                        (prompt_tokens - 1) // block_size) x block_size x evidence_weight
                  + peer_blocks x block_size x peer_credit
    own_tokens    = all_prompt_tokens - credit_tokens      (every prompt of the body is prefilled)
    queued_tokens = load.prefill_tokens + load.unseen_waiting x engine_waiting_prefill_tokens
    decoding      = load.decoding + load.unseen_running
    ttft_ms       = rate.overhead_ms + rate.ms_per_token x work_tokens(queued, own, decoding)

``rate`` (:meth:`TTFTPolicy.rate_of`, ``learn_prefill_rate``) is the
:class:`~router.estimates.prefill_rate.PrefillRate` line learned from the observed TTFTs of all of the model's
workers together, times the worker's own speed factor against that line (the median of its
observed / predicted TTFTs, shrunk toward 1 while it has few samples); the configured prior
(``prefill_overhead_ms``, ``prefill_ms_per_token``) until the model's line is learned. A line of
the worker's own (two figures fitted to a few dozen noisy TTFTs) ranks identical workers apart
by more than a cached prefix saves (docs/tuning/prefill_rate.md); one factor per worker does not,
and still tells a slower worker from a faster one.
``evidence_weight`` is the share of its predicted hits the worker has been realising
(:mod:`router.estimates.evidence`: 0 while distrusted; under heavy KV pressure a worker evicts part of a
matched prefix before its prefill, and crediting all of it sends it more than it can take). ``gpu``/``cpu``/``ssd`` are matched blocks by tier; the
``(prompt_tokens - 1) // block_size`` cap is vLLM's (the last prompt token is always computed).
The tier credits say how much of a block's prefill a tier hit saves (default gpu 1.0, cpu 0.75,
ssd 0.25, Dynamo's device/host/disk weights): a turn whose history left its holder's GPU but
sits in that worker's CPU tier still goes there when that is fastest.

Peer pull (:mod:`router.estimates.peer_credit`): ``peer_blocks`` are the prompt blocks past the candidate's
own run that another worker's agent serves and the candidate's connector pulls (0 without peer
pull: the prediction is as it was). ``peer_credit`` (0..1) is ``tier_credit.peer`` when configured,
else :func:`router.estimates.peer_credit.peer_credit_per_block` of the candidate's measured link speed and pull
overhead (until measured: ``peer_link_gbit_s``, default 10, and ``peer_pull_overhead_ms``, default
1) against ``rate.ms_per_token`` below; so the pull's own time stays in the prediction, as
``peer_blocks x block_size x rate.ms_per_token x (1 - peer_credit)`` ms (``peer_blocks`` x the
pull's milliseconds per block, unless clamped). Pulled blocks do not make a candidate a holder
below (holding is its own cache), but they are credit: the recompute term charges only what it
would compute.

The load is the gateway's own accounting (updated at dispatch, first byte and end, so it is never
older than the last request; a non-streamed request's prefill counts as done once its predicted
TTFT has passed, since its first byte comes only with the whole answer), plus what the engine's
last ``/metrics`` scrape showed beyond the gateway's own requests at that moment (other clients),
so a stale scrape never counts the gateway's own requests twice.

Selection: the lowest rank, where::

    rank_ms = ttft_ms x (spread_margin if not a longest holder else 1)
            + weight x rate.ms_per_token x (top_credit_tokens - credit_tokens)
    weight  = recompute_weight if the longest holders' prefix is hot, else private_recompute_weight

A longest holder holds (tier-weighted, evidence weights aside) within one block of the most any
candidate holds; holders of one prefix compete on time alone. The second term charges the prefix
a placement would compute again, beyond the best-credited candidate's, once more: greedy TTFT
counts that work only in this request's own wait, yet every request queued behind it on that
worker waits for it too, and a second copy of a prefix evicts others. A multiplicative margin
alone (``spread_margin``) lets follow-up turns leave the worker holding their history, and miss.

Hot or private (:mod:`router.estimates.prefix_uses`): a prefix is hot when ``HOT_PREFIX_USES`` (2) or more
of the gateway's recent requests passed through the last block a longest holder matched (a
system prompt, a shared document), private otherwise (a conversation's history: only its own
earlier turn went through it). A second copy of a hot prefix serves every request queued behind
the first, so it is charged ``recompute_weight`` (1) and waited for ``queue.affinity_wait_s``
(5 s); moving a conversation buys nothing beyond this request, so its history is charged
``private_recompute_weight`` (3) and waited for ``private_affinity_wait_s`` (5 s,
``Decision.affinity_wait_s``). One weight for both serves one kind of prefix at the other's
expense: a weight that keeps conversations with their history piles the requests sharing a hot
prefix on its holders, and one that spreads those sends follow-ups away from their history. A
larger private weight with a longer wait keeps more history at home but lengthens the tail TTFT
and, on fast prefills, the median; 3 and 5 s balance the two (tuning runs:
docs/tuning/ttft_policy.md).

Ties (within 1e-9 ms) go to more prefix credit (no second copy of a prefix for nothing), then to
less queued work; remaining ties in worker-id order, ``request.rand`` picking one. This is also
the hot-prefix rule: when the longest holder's queue costs more than recomputing the prefix
elsewhere (charged twice), another worker gets the request; it then holds the prefix as well,
and its KV events tell the index so; holders then share by time. A conversation stays where its
history is for as long as that is the best place.

Reasons: ``no_tokens`` (no exact tokens: queue alone), ``peer_pull`` (the winner is credited
for blocks it pulls from a peer), ``spread`` (the longest holder lost on its queue),
``prefix_hit`` (the winner has more credit than the least), ``load``.
Candidates whose evidence is distrusted are noted ``evidence distrusted``; the longest holders
are noted ``hot prefix (recent uses: N)`` or ``private prefix (recent uses: N)``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.estimates.prefill_rate import DECODE_INTERFERENCE_TOKENS, DEFAULT_PREFILL_MS_PER_TOKEN, PrefillRate
from router.policies._config import boolean, check_keys, number
from router.policies.base import Candidate, CandidateScore, Decision, Policy, RouteRequest
from router.policies.kv_aware import (DEFAULT_TIER_CREDIT, PEER, PEER_KEYS, PeerSettings, note_peer, peer_credit,
                                      tier_credit_from_config, tier_weighted_blocks)
from router.policies.queue import QueueSettings
from router.policies.ranking import EPS, chosen_first, lowest

DEFAULT_PREFILL_OVERHEAD_MS = 25.0
DEFAULT_ENGINE_WAITING_PREFILL_TOKENS = 1024.0
DEFAULT_SPREAD_MARGIN = 1.0
DEFAULT_RECOMPUTE_WEIGHT = 1.0
DEFAULT_PRIVATE_RECOMPUTE_WEIGHT = 3.0
DEFAULT_PRIVATE_AFFINITY_WAIT_S = 5.0
HOT_PREFIX_USES = 2  # recent requests through a prefix's last block that make it hot, not private
SPEED_PRIOR_SAMPLES = 16  # a worker's speed factor weighs samples / (samples + 16) against 1


@dataclass
class _Scored:
    score: CandidateScore
    credit_tokens: float
    queued_tokens: float
    held_tokens: float = 0.0
    holder: bool = True
    ms_per_token: float = 0.0
    rank_ms: float = 0.0
    prefix_uses: int = 0

    @property
    def worker_id(self) -> str:
        return self.score.worker_id

    @property
    def ttft_ms(self) -> float:
        return self.score.predicted_ttft_ms or 0.0


class TTFTPolicy(Policy):
    """Lowest predicted TTFT; see the module docstring."""

    name = "ttft"
    uses_index = True
    ranks_alone = True  # a rank: its own TTFT, margin and credit against the matched candidates' best
    default_queue = QueueSettings(enabled=True, worker_prefills=1, worker_queue_ms=50.0, affinity_wait_s=5.0)
    CONFIG_KEYS: tuple[str, ...] = ("tier_credit", "prefill_overhead_ms", "prefill_ms_per_token",
                                    "learn_prefill_rate", "engine_waiting_prefill_tokens", "spread_margin",
                                    "recompute_weight", "private_recompute_weight",
                                    "private_affinity_wait_s") + PEER_KEYS

    def __init__(self, tier_credit: Mapping[str, float] | None = None,
                 prior: PrefillRate | None = None, learn_prefill_rate: bool = True,
                 engine_waiting_prefill_tokens: float = DEFAULT_ENGINE_WAITING_PREFILL_TOKENS,
                 spread_margin: float = DEFAULT_SPREAD_MARGIN,
                 recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
                 private_recompute_weight: float = DEFAULT_PRIVATE_RECOMPUTE_WEIGHT,
                 private_affinity_wait_s: float = DEFAULT_PRIVATE_AFFINITY_WAIT_S,
                 peer: PeerSettings | None = None) -> None:
        self.tier_credit = {**DEFAULT_TIER_CREDIT, **(tier_credit or {})}
        self.peer = peer or PeerSettings(self.tier_credit.get(PEER))
        self.peer_pricing = self.peer.pricing
        self.prior = prior or PrefillRate(DEFAULT_PREFILL_OVERHEAD_MS, DEFAULT_PREFILL_MS_PER_TOKEN)
        self.learn_prefill_rate = learn_prefill_rate
        self.engine_waiting_prefill_tokens = engine_waiting_prefill_tokens
        self.spread_margin = spread_margin
        self.recompute_weight = recompute_weight
        self.private_recompute_weight = private_recompute_weight
        self.private_affinity_wait_s = private_affinity_wait_s

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> TTFTPolicy:
        """Build from the policy config without ``name``. Raises ValueError on unknown keys, a tier
        credit outside [0, 1] or for an unknown tier, a negative figure, a zero
        ``prefill_ms_per_token`` or a bad peer-pull prior (:class:`PeerSettings`)."""
        where = "policy"
        check_keys(cfg, cls.CONFIG_KEYS, f"policy {cls.name!r}")
        tier_credit = tier_credit_from_config(cfg)
        prior = PrefillRate(number(cfg, "prefill_overhead_ms", DEFAULT_PREFILL_OVERHEAD_MS, where),
                            number(cfg, "prefill_ms_per_token", DEFAULT_PREFILL_MS_PER_TOKEN, where, lo=1e-6))
        return cls(tier_credit=tier_credit, prior=prior,
                   learn_prefill_rate=boolean(cfg, "learn_prefill_rate", True, where),
                   engine_waiting_prefill_tokens=number(cfg, "engine_waiting_prefill_tokens",
                                                        DEFAULT_ENGINE_WAITING_PREFILL_TOKENS, where),
                   spread_margin=number(cfg, "spread_margin", DEFAULT_SPREAD_MARGIN, where, lo=1.0),
                   recompute_weight=number(cfg, "recompute_weight", DEFAULT_RECOMPUTE_WEIGHT, where),
                   private_recompute_weight=number(cfg, "private_recompute_weight",
                                                   DEFAULT_PRIVATE_RECOMPUTE_WEIGHT, where),
                   private_affinity_wait_s=number(cfg, "private_affinity_wait_s",
                                                  DEFAULT_PRIVATE_AFFINITY_WAIT_S, where),
                   peer=PeerSettings.from_config(cfg, tier_credit, where))

    def config(self) -> dict[str, Any]:
        """The effective config without ``name`` (peer-pull keys only when set)."""
        return {"tier_credit": dict(self.tier_credit), "prefill_overhead_ms": self.prior.overhead_ms,
                "prefill_ms_per_token": self.prior.ms_per_token,
                "learn_prefill_rate": self.learn_prefill_rate,
                "engine_waiting_prefill_tokens": self.engine_waiting_prefill_tokens,
                "spread_margin": self.spread_margin, "recompute_weight": self.recompute_weight,
                "private_recompute_weight": self.private_recompute_weight,
                "private_affinity_wait_s": self.private_affinity_wait_s,
                **self.peer.config()}

    def rate_of(self, candidate: Candidate) -> PrefillRate:
        """The TTFT line used for ``candidate``: the line learned from all of its model's workers
        (``Candidate.model_prefill_rate``) scaled by the worker's speed factor against it
        (``Candidate.prefill_speed``, :meth:`~router.estimates.prefill_rate.PrefillRateEstimator.speed_factor`)
        shrunk toward 1 with weight ``samples / (samples + SPEED_PRIOR_SAMPLES)``; the model's line
        as it is for a worker without a factor yet; the configured prior before the model's line
        is learned (or with ``learn_prefill_rate`` off)."""
        model = candidate.model_prefill_rate
        if not self.learn_prefill_rate or model is None:
            return self.prior
        if candidate.prefill_speed is None:
            return model
        factor, samples = candidate.prefill_speed
        k = 1.0 + (factor - 1.0) * samples / (samples + SPEED_PRIOR_SAMPLES)
        return PrefillRate(model.overhead_ms * k, model.ms_per_token * k, samples)

    def held_tokens(self, candidate: Candidate, prompt_tokens: int, block_size: int) -> float:
        """Prompt tokens the candidate holds by the index, tier-weighted, with vLLM's cap (0 when
        its evidence is distrusted): who holds the longest prefix."""
        if not candidate.evidence_trusted or prompt_tokens <= 0:
            return 0.0
        credit_blocks = tier_weighted_blocks(candidate.matched, self.tier_credit)
        return min(credit_blocks, (prompt_tokens - 1) // block_size) * block_size

    def _score(self, candidate: Candidate, request: RouteRequest, prompt_tokens: int, block_size: int,
               total_tokens: int) -> _Scored:
        """One candidate's prediction and the figures its rank is made of; ``total_tokens``:
        every prompt's tokens (``max(prompt_tokens, all_prompt_tokens)``). A candidate without
        a match or peer blocks skips their arithmetic (its held and credited tokens are 0)."""
        load = candidate.load
        matched = candidate.matched
        if matched.gpu or matched.cpu or matched.ssd:
            held = self.held_tokens(candidate, prompt_tokens, block_size)
            credit = held * _weight(candidate)
        else:
            held = credit = 0.0
        # rate_of(candidate) inlined, without its PrefillRate (test_ttft_policy checks the two agree)
        model = candidate.model_prefill_rate
        if model is None or not self.learn_prefill_rate:
            overhead_ms, ms_per_token = self.prior.overhead_ms, self.prior.ms_per_token
        elif candidate.prefill_speed is None:
            overhead_ms, ms_per_token = model.overhead_ms, model.ms_per_token
        else:
            factor, samples = candidate.prefill_speed
            k = 1.0 + (factor - 1.0) * samples / (samples + SPEED_PRIOR_SAMPLES)
            overhead_ms, ms_per_token = model.overhead_ms * k, model.ms_per_token * k
        peer_blocks = 0
        if candidate.peer_blocks > 0:
            peer_blocks, peer_weight, source = peer_credit(candidate, self.peer_pricing, request, ms_per_token)
            if peer_blocks:
                credit += peer_blocks * block_size * peer_weight
        # max(0, x) as conditionals, the same values (this runs once per candidate per decision)
        prefill, waiting = load.prefill_tokens, load.unseen_waiting
        queued = (prefill if prefill > 0 else 0) + (waiting if waiting > 0 else 0) * self.engine_waiting_prefill_tokens
        running, unseen = load.decoding, load.unseen_running
        decoding = (running if running > 0 else 0) + (unseen if unseen > 0 else 0)
        own = total_tokens - credit
        # work_tokens(queued, own, decoding), then rate.ttft_ms(work), inlined (a quarter of a
        # 1,024-candidate choose); test_ttft_policy checks both against those helpers
        work = ((queued if queued > 0.0 else 0.0) + (own if own > 0.0 else 0.0)
                + DECODE_INTERFERENCE_TOKENS * (decoding if decoding > 0.0 else 0.0))
        ttft_ms = overhead_ms + ms_per_token * (work if work > 0.0 else 0.0)
        score = CandidateScore(candidate.worker_id, matched, queued, ttft_ms,
                               "" if candidate.evidence_trusted else "evidence distrusted", ttft_ms, work)
        if peer_blocks:
            note_peer(score, candidate, peer_blocks, peer_weight, source)
        # positional (keywords cost ~6% of a 1,024-candidate choose): score, credit_tokens,
        # queued_tokens, held_tokens, holder, ms_per_token, rank_ms (set by choose), prefix_uses
        return _Scored(score, credit, queued, held, True, ms_per_token, 0.0, candidate.prefix_uses)

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        prompt_tokens = request.prompt_tokens
        bs = max(1, request.block_size)
        prompt = prompt_tokens or 0
        total = prompt if request.all_prompt_tokens is None else max(prompt, request.all_prompt_tokens)
        score = self._score
        scored = [score(c, request, prompt, bs, total) for c in candidates]
        # the rank (module docstring): a worker holding less than the longest prefix (by more
        # than a block, evidence weights aside) is scaled by the margin, and the prefix it would
        # recompute beyond the best-credited candidate's is charged once more
        top_held = top_credit = -math.inf
        min_held = math.inf
        for s in scored:  # max and min of the figures below, in one pass
            held = s.held_tokens
            if held > top_held:
                top_held = held
            if held < min_held:
                min_held = held
            if s.credit_tokens > top_credit:
                top_credit = s.credit_tokens
        hold_cut = top_held - bs + EPS
        hot = False
        for s in scored:
            s.holder = holder = s.held_tokens >= hold_cut
            if holder and not hot and s.held_tokens > 0 and s.prefix_uses >= HOT_PREFIX_USES:
                # hot: some holder's matched prefix had HOT_PREFIX_USES or more of the gateway's
                # recent requests through its last block (router.estimates.prefix_uses); not hot:
                # a conversation's history, or no holder at all
                hot = True
        weight = self.recompute_weight if hot else self.private_recompute_weight
        kind = "hot" if hot else "private"
        for s in scored:
            if s.holder and s.held_tokens > 0:
                prefix_note = f"{kind} prefix (recent uses: {s.prefix_uses})"
                s.score.note = f"{s.score.note}; {prefix_note}" if s.score.note else prefix_note
            s.rank_ms = (s.ttft_ms * (1.0 if s.holder else self.spread_margin)
                         + weight * s.ms_per_token * (top_credit - s.credit_tokens))
        best = lowest(scored, [_rank, _uncredited, _queued], _worker, request.rand)
        if prompt_tokens is None:
            reason = "no_tokens"
        elif best.score.peer_credit_blocks > EPS:
            reason = "peer_pull"
        elif not best.holder:
            reason = "spread"
        elif best.held_tokens > min_held + EPS:
            reason = "prefix_hit"
        else:
            reason = "load"
        ranked = chosen_first(scored, best, _order)
        private = not hot and top_held > 0
        return Decision(best.worker_id, reason, [s.score for s in ranked],
                        affinity_wait_s=self.private_affinity_wait_s if private else None)


def _weight(candidate: Candidate) -> float:
    return min(1.0, max(0.0, candidate.evidence_weight))


def _order(s: _Scored) -> tuple[float, float, float, str]:
    return (s.rank_ms, -s.credit_tokens, s.queued_tokens, s.worker_id)


def _rank(s: _Scored) -> float:
    return s.rank_ms


def _uncredited(s: _Scored) -> float:
    return -s.credit_tokens


def _queued(s: _Scored) -> float:
    return s.queued_tokens


def _worker(s: _Scored) -> str:
    return s.worker_id
