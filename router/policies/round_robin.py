"""``round_robin``: each model's requests take its candidates in turn, in worker-id order.

One counter per model (``itertools.count``, whose ``next`` is atomic under the GIL, so concurrent
callers on one event loop or a few threads never get the same turn). The n-th request of a model
goes to ``sorted(candidates)[n % len(candidates)]``: when workers come or go the rotation goes on
over the new set. Reason label ``round_robin``; ``cost`` is None (not scored), ``load`` is the
load figure of :mod:`router.policies.load`, for display.
"""
from __future__ import annotations

import itertools

from router.policies.base import Candidate, CandidateScore, Decision, RouteRequest
from router.policies.load import LoadModel, LoadModelPolicy


class RoundRobinPolicy(LoadModelPolicy):
    """Per-model rotation over the candidates sorted by worker id."""

    name = "round_robin"
    uses_index = False

    def __init__(self, load_model: LoadModel | None = None) -> None:
        super().__init__(load_model)
        self._turns: dict[str, itertools.count] = {}

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        counter = self._turns.get(request.model)
        if counter is None:
            counter = self._turns.setdefault(request.model, itertools.count())
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        start = next(counter) % len(ordered)
        rotation = ordered[start:] + ordered[:start]
        scores = [CandidateScore(c.worker_id, c.matched,
                                 self.load_model.load_blocks(c.load, request.block_size), None)
                  for c in rotation]
        return Decision(rotation[0].worker_id, "round_robin", scores)
