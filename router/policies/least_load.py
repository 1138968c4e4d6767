"""``least_load``: the worker with the least outstanding work (:mod:`router.policies.load`:
in-flight requests and predicted prefill tokens, plus the engine's queue when scraped); ties go to
worker-id order, ``request.rand`` picking among equals. Reason label ``load``.
"""
from __future__ import annotations

from router.policies.base import Candidate, CandidateScore, Decision, RouteRequest
from router.policies.load import LoadModelPolicy
from router.policies.ranking import chosen_first, lowest


class LeastLoadPolicy(LoadModelPolicy):
    """Lowest load wins. ``CandidateScore.load`` and ``cost`` are both the load in blocks."""

    name = "least_load"
    uses_index = False

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        scores = self.score(request, candidates)
        best = lowest(scores, [_load], _worker, request.rand)
        return Decision(best.worker_id, "load", chosen_first(scores, best, _load_order))

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[CandidateScore]:
        """Every candidate scored by load (cost = load), in input order."""
        out = []
        for c in candidates:
            load = self.load_model.load_blocks(c.load, request.block_size)
            out.append(CandidateScore(c.worker_id, c.matched, load, load))
        return out


def _load(s: CandidateScore) -> float:
    return s.load


def _worker(s: CandidateScore) -> str:
    return s.worker_id


def _load_order(s: CandidateScore) -> tuple[float, str]:
    return (s.load, s.worker_id)
