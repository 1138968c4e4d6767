"""A routing decision with everything that led to it: what ``POST /admin/explain`` answers, what
the decision log and the trace record, what the relay and the feedback step read per worker.

Built by :class:`router.route.planner.Router`; pure (reads the plan, changes nothing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcore.index.base import NO_MATCH, TierMatch
from router.config.schema import ModelConfig
from router.policies.base import CandidateScore, Decision, RouteRequest
from router.route.pd import PDLegs
from router.route.prompt_blocks import PromptBlocks
from router.workers.registry import WorkerRegistration


@dataclass
class RoutePlan:
    """A routing decision with everything that led to it.

    ``model``: the base model; ``lora_name``: the adapter named by the body, if any;
    ``blocks``: the prompt's tokens and keys (None when the policy does not use the index);
    ``matches``: per worker, matched blocks by tier; ``workers``: the candidates' registrations
    by id, at decision time; ``pd``: for a model with disaggregation on (:mod:`router.route.pd`), the
    legs: ``decision`` is then the decode leg's (or the whole request's) and ``pd.prefill`` the
    prefill leg's plan when split; None for other models.
    """

    model: ModelConfig
    lora_name: str | None
    blocks: PromptBlocks | None
    matches: dict[str, TierMatch]
    request: RouteRequest
    decision: Decision
    policy_name: str
    workers: dict[str, WorkerRegistration] = field(default_factory=dict)
    pd: PDLegs | None = None

    def ranked(self) -> list[WorkerRegistration]:
        """Candidates' registrations, best first."""
        return [self.workers[w] for w in self.decision.ranked_worker_ids() if w in self.workers]

    def predicted_cached_tokens(self, worker_id: str) -> int | None:
        """Prefix-hit tokens the worker should report (vLLM's ``cached_tokens``) for the first
        prompt: matched blocks in any tier plus blocks it pulls from a peer (vLLM counts a pulled
        token as cached, source ``p2p``), capped as vLLM caps a hit at ``prompt_len - 1`` tokens,
        times the block size. None when the tokens are unknown."""
        score = self._score(worker_id)
        return self._cached_tokens(worker_id, score.peer_blocks if score is not None else 0)

    def _cached_tokens(self, worker_id: str, peer_blocks: int = 0) -> int | None:
        if self.blocks is None or self.blocks.token_ids is None:
            return None
        match = self.matches.get(worker_id)
        held = (match.total if match is not None else 0) + peer_blocks
        n = len(self.blocks.token_ids[0])
        bs = self.model.block_size
        return min(held, max(0, n - 1) // bs) * bs

    def _score(self, worker_id: str) -> CandidateScore | None:
        return self.decision.score_of(worker_id)

    def predicted_ttft_ms(self, worker_id: str) -> float | None:
        """The policy's TTFT prediction (ms from dispatch) for ``worker_id``, None when the policy
        makes none."""
        score = self._score(worker_id)
        return score.predicted_ttft_ms if score is not None else None

    def predicted_work_tokens(self, worker_id: str) -> float | None:
        """The work (prefill tokens, :func:`router.estimates.prefill_rate.work_tokens`) the policy predicted
        ``worker_id``'s TTFT from, None when the policy makes no prediction."""
        score = self._score(worker_id)
        return score.work_tokens if score is not None else None

    def uncached_tokens(self, worker_id: str) -> int:
        """Prompt tokens the worker must prefill (all prompts), 0 when unknown. Blocks it pulls
        from a peer count at the share of their prefill the pull takes (``1 - peer_credit``):
        the pull occupies the worker that long before its prefill."""
        if self.blocks is None or self.blocks.token_ids is None:
            return 0
        uncached = (self.blocks.prompt_tokens or 0) - (self._cached_tokens(worker_id) or 0)
        score = self._score(worker_id)
        if score is not None and score.peer_blocks > 0:
            uncached -= round(score.peer_credit_blocks * self.model.block_size)
        return max(0, uncached)

    def explain(self, max_candidates: int | None = None) -> dict[str, Any]:
        """The ``POST /admin/explain`` answer (DESIGN.md); ``max_candidates``: only the best that
        many candidates (the chosen first), all when None."""
        tokens = self.blocks.prompt_tokens if self.blocks is not None else None
        out = {
            "prompt_tokens": tokens,
            "blocks": len(self.blocks.first_keys) if self.blocks is not None else 0,
            "candidates": [s.as_dict() for s in self.decision.scores[:max_candidates]],
            "chosen": self.decision.worker_id,
            "predicted_cached_tokens": self.predicted_cached_tokens(self.decision.worker_id),
            "predicted_ttft_ms": _rounded(self.predicted_ttft_ms(self.decision.worker_id)),
            "reason": self.decision.reason,
            "policy": self.policy_name,
            "tokenization_fallback": self.blocks.fallback if self.blocks is not None else None,
        }
        if self.pd is not None:  # both legs (router.route.pd.PDLegs.as_dict)
            out["pd"] = self.pd.as_dict()
        return out

    def trace_attributes(self) -> dict[str, Any]:
        """The decision as span attributes (:data:`router.telemetry.tracing.ATTR` keys; None: unknown):
        the requested model, policy, prompt tokens (all prompts), blocks (first prompt), the
        chosen worker, its matched blocks (all tiers, then per tier), the reason, candidates and
        the predicted cached tokens and TTFT (ms) there."""
        chosen = self.decision.worker_id
        match = self.matches.get(chosen) or NO_MATCH
        return {
            "model": self.lora_name or self.model.name,
            "policy": self.policy_name,
            "prompt_tokens": self.blocks.prompt_tokens if self.blocks is not None else None,
            "blocks": len(self.blocks.first_keys) if self.blocks is not None else 0,
            "chosen": chosen,
            "reason": self.decision.reason,
            "candidates": len(self.decision.scores),
            "matched_blocks": match.total,
            "kvroute.matched_blocks.gpu": match.gpu,
            "kvroute.matched_blocks.cpu": match.cpu,
            "kvroute.matched_blocks.ssd": match.ssd,
            "predicted_cached_tokens": self.predicted_cached_tokens(chosen),
            "predicted_ttft_ms": _rounded(self.predicted_ttft_ms(chosen)),
            "tokenization_fallback": self.blocks.fallback if self.blocks is not None else None,
        }


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)
