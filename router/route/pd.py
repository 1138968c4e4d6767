"""Prefill-decode disaggregation: which worker serves each leg, and the legs' bodies (pure).

For a model whose ``policy.pd`` is on (:mod:`router.policies.pd`) the routable workers form two
pools by role (:class:`router.config.schema.WorkerConfig`): prefill (``prefill`` or ``both``) and decode
(``decode`` or ``both``). With either pool empty the request is routed whole by the live policy
over every routable worker (reason ``no_prefill_pool`` / ``no_decode_pool``). Otherwise:

1. The decode worker: the lowest decode cost over the decode pool, in tokens of work scaled by
   the worker's KV pressure::

       held     = min(matched blocks (all tiers), (prompt_tokens - 1) // block_size) x block_size
                  (0 while the worker's evidence is distrusted; vLLM's cap on a prefix hit)
       uncached = all_prompt_tokens - held
       decodes  = load.in_flight + load.unseen_running + load.unseen_waiting
       kv_room  = max(MIN_KV_ROOM, 1 - load.kv_usage)     (1 before the first scrape)
       cost     = (decodes x DECODE_TOKENS_PER_REQUEST + load.prefill_tokens + uncached) / kv_room

   ``uncached`` is what the worker would compute served whole, or receive from the prefill
   worker; a prefix it already holds costs neither. Ties go to the larger ``held``, then to
   worker-id order with the request's ``rand`` picking (as :func:`router.policies.ranking.lowest`).
   Reason ``prefix_hit`` when the winner holds more than the least-holding candidate, ``load``
   otherwise, ``no_tokens`` without exact tokens.
2. Split or whole: when the decode worker's ``uncached`` is below ``min_prefill_tokens`` the
   prefill leg is skipped and the decode worker serves the request whole (outcome ``whole``,
   reason ``decode_holds_prefix`` when it holds part of the prompt, ``short_prompt`` otherwise).
   Else the request is split (outcome ``split``, reason ``uncached_tokens``; ``no_tokens`` when
   exact tokens are unknown: such a prompt is long or odd, and prefill is what the prefill pool
   is for).
3. The prefill worker: the ``ttft`` policy's choice over the prefill pool (the live policy when
   it is ``ttft``, else one with the default settings): the lowest predicted prefill finish from
   its cached prefix in the index, its prefill queue and its learned rate. A prefix cached on a
   prefill worker and on no decode worker is computed there (its cache credit wins it the leg).
   When the same worker (role ``both``) wins both legs, it serves the request whole
   (reason ``same_worker``).

The legs' bodies follow vLLM's protocol (``kv_transfer_params``; the gateway never looks inside
the prefill worker's answer beyond checking it is an object): :func:`prefill_body`,
:func:`decode_body`, :func:`transfer_params`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from router.policies.base import Candidate, CandidateScore, Decision, Policy, RouteRequest
from router.policies.ranking import EPS, chosen_first, lowest
from router.policies.ttft import TTFTPolicy

DECODE_TOKENS_PER_REQUEST = 128  # one request on the decode worker, priced in tokens of work
MIN_KV_ROOM = 0.05  # a full KV cache multiplies a candidate's cost by 20, never by infinity
PREFILL_ROLES = frozenset({"prefill", "both"})
DECODE_ROLES = frozenset({"decode", "both"})

# what a prefill leg asks of the worker (vLLM: nixl/connector request_finished, the toy proxy)
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}

Outcome = Literal["split", "whole"]


@dataclass
class DecodeScore:
    """One decode-pool candidate: the module docstring's figures (tokens; ``uncached`` None when
    the prompt's tokens are unknown)."""

    worker_id: str
    held_tokens: int
    uncached_tokens: int | None
    decodes: int
    kv_room: float
    cost: float
    score: CandidateScore

    def as_dict(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "matched_blocks": self.score.matched.as_dict(),
                "held_tokens": self.held_tokens, "uncached_tokens": self.uncached_tokens,
                "decodes": self.decodes, "kv_room": round(self.kv_room, 4), "cost": round(self.cost, 3),
                "note": self.score.note}


@dataclass
class PDLegs:
    """The disaggregation part of a plan. ``outcome``: ``split`` (two legs) or ``whole`` (the
    decode worker, or with ``pooled`` False the live policy's choice, serves it all); ``reason``:
    the module docstring's; ``decode``: the decode pool's scores, best first (empty when not
    ``pooled``); ``prefill``: the prefill leg's :class:`router.route.plan.RoutePlan` (None unless
    split)."""

    outcome: Outcome
    reason: str
    min_prefill_tokens: int
    pooled: bool = True
    decode: list[DecodeScore] = field(default_factory=list)
    prefill: Any = None  # router.route.plan.RoutePlan (that module imports this one)

    @property
    def split(self) -> bool:
        return self.outcome == "split"

    @property
    def decode_worker(self) -> str | None:
        return self.decode[0].worker_id if self.decode else None

    @property
    def prefill_worker(self) -> str | None:
        return self.prefill.decision.worker_id if self.prefill is not None else None

    def dispatched_to(self, worker_id: str) -> None:
        """The dispatch queue re-chose ``worker_id`` (a decode-pool candidate) for a request the
        decode pool serves whole: its figures go first, so :attr:`decode_worker` names it."""
        self.decode.sort(key=lambda d: d.worker_id != worker_id)

    @property
    def uncached_tokens(self) -> int | None:
        """The decode worker's uncached prompt tokens (None: unknown or not pooled)."""
        return self.decode[0].uncached_tokens if self.decode else None

    def as_dict(self) -> dict[str, Any]:
        """The ``pd`` entry of ``POST /admin/explain`` and of a decision log entry."""
        prefill = None
        if self.prefill is not None:
            p = self.prefill
            chosen = p.decision.worker_id
            ttft = p.predicted_ttft_ms(chosen)
            prefill = {"worker": chosen, "reason": p.decision.reason, "policy": p.policy_name,
                       "predicted_ttft_ms": None if ttft is None else round(ttft, 3),
                       "predicted_cached_tokens": p.predicted_cached_tokens(chosen),
                       "candidates": [s.as_dict() for s in p.decision.scores]}
        return {"outcome": self.outcome, "reason": self.reason, "min_prefill_tokens": self.min_prefill_tokens,
                "decode_worker": self.decode_worker, "prefill_worker": self.prefill_worker,
                "decode": {"uncached_tokens": self.uncached_tokens, "candidates": [d.as_dict() for d in self.decode]},
                "prefill": prefill}


def pools(roles: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(prefill pool, decode pool)`` worker ids from ``{worker id: role}`` (a ``both`` worker
    is in both)."""
    return ([w for w, r in roles.items() if r in PREFILL_ROLES], [w for w, r in roles.items() if r in DECODE_ROLES])


def score_decode(request: RouteRequest, candidate: Candidate) -> DecodeScore:
    """One decode candidate's figures and cost (module docstring, step 1)."""
    bs = max(1, request.block_size)
    load = candidate.load
    held = 0
    if candidate.evidence_trusted and request.prompt_tokens:
        held = min(candidate.matched.total, max(0, request.prompt_tokens - 1) // bs) * bs
    uncached = None
    if request.prompt_tokens is not None:
        total = max(request.prompt_tokens, request.all_prompt_tokens or 0)
        uncached = max(0, total - held)
    decodes = max(0, load.in_flight) + max(0, load.unseen_running) + max(0, load.unseen_waiting)
    room = 1.0 if load.kv_usage is None else max(MIN_KV_ROOM, 1.0 - load.kv_usage)
    cost = (decodes * DECODE_TOKENS_PER_REQUEST + max(0, load.prefill_tokens) + (uncached or 0)) / room
    note = "" if candidate.evidence_trusted else "evidence distrusted"
    score = CandidateScore(candidate.worker_id, candidate.matched, load=float(decodes), cost=cost, note=note)
    return DecodeScore(candidate.worker_id, held, uncached, decodes, room, cost, score)


def choose_decode(request: RouteRequest, candidates: list[Candidate]) -> tuple[Decision, list[DecodeScore]]:
    """The decode leg's decision over ``candidates`` (non-empty) and every candidate's figures,
    the chosen first (module docstring, step 1)."""
    scored = [score_decode(request, c) for c in candidates]
    best = lowest(scored, [lambda d: d.cost, lambda d: -d.held_tokens], lambda d: d.worker_id, request.rand)
    if request.prompt_tokens is None:
        reason = "no_tokens"
    elif best.held_tokens > min(d.held_tokens for d in scored) + EPS:
        reason = "prefix_hit"
    else:
        reason = "load"
    ranked = chosen_first(scored, best, lambda d: (d.cost, -d.held_tokens, d.worker_id))
    return Decision(best.worker_id, reason, [d.score for d in ranked]), ranked


class DecodePolicy(Policy):
    """The decode leg's choice as a :class:`Policy` (step 1), for the dispatch queue to re-choose
    a whole request's decode worker among the decode pool's open workers."""

    name = "pd_decode"
    uses_index = True
    ranks_alone = True  # a cost from the candidate's own load and match (score_decode)

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        return choose_decode(request, candidates)[0]


DECODE_POLICY = DecodePolicy()


def split_or_whole(decode: DecodeScore, min_prefill_tokens: int) -> tuple[Outcome, str]:
    """``(outcome, reason)`` for the chosen decode worker (module docstring, step 2)."""
    if decode.uncached_tokens is None:
        return "split", "no_tokens"
    if decode.uncached_tokens < min_prefill_tokens:
        return "whole", "decode_holds_prefix" if decode.held_tokens > 0 else "short_prompt"
    return "split", "uncached_tokens"


def prefill_policy(live: Policy) -> TTFTPolicy:
    """The policy that chooses the prefill leg: the live one when it is ``ttft``, else ``ttft``
    with its defaults (module docstring, step 3)."""
    return live if isinstance(live, TTFTPolicy) else _DEFAULT_TTFT


_DEFAULT_TTFT = TTFTPolicy()


def prefill_body(body: dict[str, Any], kind: str) -> bytes:
    """The prefill leg's body: the client's ``body`` with ``max_tokens: 1`` (a chat body's
    ``max_completion_tokens`` too, when it sets it), ``stream: false``, no ``stream_options``,
    ``n: 1`` and :data:`PREFILL_KV_TRANSFER_PARAMS`. ``kind``: ``chat`` or ``completion``."""
    out = dict(body)
    out["max_tokens"] = 1
    if kind == "chat" and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["n"] = 1
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return orjson.dumps(out)


def decode_body(raw: bytes, params: dict[str, Any]) -> bytes:
    """The decode leg's body: the client's body (``raw``, a JSON object, as it would be sent whole)
    with ``kv_transfer_params`` set to the prefill worker's ``params``, nothing else changed."""
    obj = orjson.loads(raw)
    obj["kv_transfer_params"] = params
    return orjson.dumps(obj)


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` object of a prefill worker's 200 answer, None when the answer
    is not a JSON object or carries none (the request is then served whole)."""
    try:
        obj = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
    return params if isinstance(params, dict) else None
