"""The routing policy interface: candidates in, a decision with its reasons out. Pure: no I/O, no
clock reads except through the request, so ``/admin/explain`` and tests call exactly what routing
calls.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from kvcore.index.base import TierMatch
from router.estimates.peer_credit import PeerInfo
from router.estimates.prefill_rate import PrefillRate
from router.policies.pd import PDSettings
from router.policies.queue import QueueSettings


@dataclass
class WorkerLoad:
    """A worker's load as the gateway sees it at decision time.

    ``in_flight``: requests the gateway sent and that have not finished;
    ``prefill_tokens``: uncached prompt tokens of in-flight requests that have not produced their
    first byte yet (predicted at routing time); ``decoding``: in-flight requests past their first
    byte; ``engine_running`` / ``engine_waiting`` / ``kv_usage`` (0..1): last scrape of the worker's
    ``/metrics`` (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``), None before the first scrape; ``unseen_running`` /
    ``unseen_waiting``: how many of the scraped running / waiting requests were not the gateway's
    own at the moment of that scrape (other gateways' or clients'), 0 before the first scrape.
    """

    in_flight: int = 0
    prefill_tokens: int = 0
    decoding: int = 0
    engine_running: int | None = None
    engine_waiting: int | None = None
    kv_usage: float | None = None
    unseen_running: int = 0
    unseen_waiting: int = 0


@dataclass
class Candidate:
    """One healthy, non-draining worker serving the request's model.

    ``prefill_rate``: the worker's learned TTFT line (:mod:`router.estimates.prefill_rate`), None before it
    has been learned; ``evidence_trusted``: False while the worker's reported cached tokens run
    well below the index's predictions (:mod:`router.estimates.evidence`): policies then give its matches
    no credit; ``evidence_weight`` (0..1): the share of its predicted hits it has been realising
    (:attr:`router.estimates.evidence.EvidenceTrust.credit_weight`).

    Peer pull (:mod:`router.estimates.peer_credit`): ``peer``: what the worker's agent publishes about
    pulling (its link measurements), None without peer pull; ``peer_blocks``: prompt blocks past
    its own matched run that it can pull from another worker, ``peer_worker`` (0 / None: none).

    ``model_prefill_rate``: the TTFT line learned from every worker of the request's model (the
    same for every candidate), None before it has been learned; ``prefill_speed``: this
    worker's ``(speed factor, samples)`` against that line
    (:meth:`router.estimates.prefill_rate.PrefillRateEstimator.speed_factor`), None until it has enough.

    ``prefix_uses``: how many of the gateway's recent requests passed through the last block of
    this candidate's matched prefix (:mod:`router.estimates.prefix_uses`; 0 without a match): 0 or 1 for a
    conversation's history, more for a prefix many requests share.
    """

    worker_id: str
    load: WorkerLoad
    matched: TierMatch = field(default_factory=TierMatch)
    prefill_rate: PrefillRate | None = None
    evidence_trusted: bool = True
    evidence_weight: float = 1.0
    peer: PeerInfo | None = None
    peer_blocks: int = 0
    peer_worker: str | None = None
    model_prefill_rate: PrefillRate | None = None
    prefill_speed: tuple[float, int] | None = None
    prefix_uses: int = 0


@dataclass
class RouteRequest:
    """What a policy may know of the request.

    ``prompt_tokens``: tokens of the (first) prompt, None when exact tokens could not be made
    (route by load); ``all_prompt_tokens``: of every prompt of the body (a completions body may
    carry several; the index is matched on the first), None when unknown;
    ``num_blocks``: full blocks of the prompt; ``session_key``: the sticky-session key (header or
    body ``user``), None when absent; ``rand``: a uniform [0, 1) draw supplied by the caller (used
    only by a softmax temperature > 0), so a decision is reproducible from its inputs.
    """

    model: str
    prompt_tokens: int | None
    block_size: int
    num_blocks: int = 0
    all_prompt_tokens: int | None = None
    session_key: str | None = None
    rand: float = 0.0


@dataclass
class CandidateScore:
    """How a policy scored one candidate: ``cost`` (lower wins; None when not scored) and
    ``load`` (the policy's load figure), plus a note (e.g. "overloaded", "evidence distrusted");
    ``predicted_ttft_ms``: the policy's TTFT prediction from dispatch, when it makes one, and
    ``work_tokens``, the work it predicted from (:func:`router.estimates.prefill_rate.work_tokens`).
    Peer pull: ``peer_blocks`` blocks from ``peer_worker``, each credited ``peer_credit`` (0..1)
    of a block, the weight's ``peer_credit_source`` (:mod:`router.estimates.peer_credit`: ``config``,
    ``measured``, ``prior``, ``unknown_block_bytes``)."""

    worker_id: str
    matched: TierMatch
    load: float
    cost: float | None
    note: str = ""
    predicted_ttft_ms: float | None = None
    work_tokens: float | None = None
    peer_blocks: int = 0
    peer_worker: str | None = None
    peer_credit: float = 0.0
    peer_credit_source: str = ""

    @property
    def peer_credit_blocks(self) -> float:
        """Blocks of prefill the peer pull is credited with: ``peer_blocks x peer_credit``."""
        return self.peer_blocks * self.peer_credit

    def as_dict(self) -> dict[str, Any]:
        """One ``candidates`` entry of ``POST /admin/explain``; the ``peer_*`` keys only when a
        peer can supply blocks to this candidate."""
        out = {"worker": self.worker_id, "matched_blocks": self.matched.as_dict(),
               "load": self.load, "cost": self.cost, "note": self.note}
        if self.predicted_ttft_ms is not None:
            out["predicted_ttft_ms"] = round(self.predicted_ttft_ms, 3)
        if self.peer_blocks > 0:
            out["peer_blocks"] = self.peer_blocks
            out["peer_worker"] = self.peer_worker
            out["peer_credit"] = round(self.peer_credit, 4)
            out["peer_credit_source"] = self.peer_credit_source
        return out


@dataclass
class Decision:
    """The chosen worker, the reason label (a Prometheus label value: e.g. ``prefix_hit``,
    ``load``, ``round_robin``, ``session``, ``overload_guard``), and every candidate's score, the
    best first. ``affinity_wait_s``: how long this request may wait in the dispatch queue for
    the worker the policy prefers, when the policy sets it for this request; None: the queue's
    ``affinity_wait_s``."""

    worker_id: str
    reason: str
    scores: list[CandidateScore]
    affinity_wait_s: float | None = None
    _score_by_id: dict[str, CandidateScore] | None = field(default=None, init=False, repr=False, compare=False)

    def ranked_worker_ids(self) -> list[str]:
        """Candidates best first (the gateway retries a connect failure on the second)."""
        return [s.worker_id for s in self.scores]

    def score_of(self, worker_id: str) -> CandidateScore | None:
        """``worker_id``'s score (the first one, were an id listed twice), None when it was no
        candidate. The chosen worker's is found at once; others through an index of ``scores``
        built at the first such call (``scores`` must not change after it), so callers that ask
        about every holder cost O(candidates), not O(candidates^2)."""
        scores = self.scores
        if scores and scores[0].worker_id == worker_id:
            return scores[0]
        if self._score_by_id is None:
            self._score_by_id = {s.worker_id: s for s in reversed(scores)}
        return self._score_by_id.get(worker_id)


class Policy(abc.ABC):
    """A routing policy. ``uses_index``: whether the gateway must look up prefix matches before
    calling :meth:`choose` (False lets it skip tokenization's lookup cost); ``session_header``:
    the request header (lower case) whose value the gateway puts in ``RouteRequest.session_key``
    (else the body's ``user``), None when the policy has no use for a session key; ``queue``:
    the dispatch queue's settings (the config's ``queue`` key, set by the factory), whose
    defaults are ``default_queue``; ``pd``: prefill-decode disaggregation (the config's ``pd``
    key, :mod:`router.policies.pd`, set by the factory; off by default). ``ranks_alone``: with no
    peer pulls, each candidate's rank depends only on its own fields, the request and the
    fields of the candidates the request's prefix matched (so the best of a subset holding the
    chosen worker, every matched one and every candidate that changed, load waiting ahead of it
    included, is the best of all: the dispatch queue re-scores only those,
    :meth:`router.route.dispatch_queue.DispatchQueue._decide`); False unless a policy says so."""

    name: str = ""
    uses_index: bool = False
    ranks_alone: bool = False
    session_header: str | None = None
    default_queue: QueueSettings = QueueSettings()
    queue: QueueSettings = QueueSettings()
    pd: PDSettings = PDSettings()

    @abc.abstractmethod
    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        """Pick one of ``candidates`` (non-empty). Must not raise for any non-empty input."""
