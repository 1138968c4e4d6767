"""Routing policies: the interface (:mod:`router.policies.base`), one module per policy, and the
factory that builds one from the ``policy:`` config (:func:`make_policy`, :func:`describe`)."""
from router.policies.base import Candidate, CandidateScore, Decision, Policy, RouteRequest, WorkerLoad
from router.policies.factory import POLICY_NAMES, describe, make_policy

__all__ = ["POLICY_NAMES", "Candidate", "CandidateScore", "Decision", "Policy", "RouteRequest",
           "WorkerLoad", "describe", "make_policy"]
