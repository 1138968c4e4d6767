"""The route step, shared by real requests and ``POST /admin/explain``.

body -> model -> token ids -> block keys -> ``index.match`` -> candidates -> ``policy.choose``
-> :class:`~router.route.plan.RoutePlan`. Planning changes nothing but the tie-break draw counter (see
:meth:`Router._draw`); :meth:`Router.commit` then records the routed
prompt's keys in the index as speculative entries for the worker actually used (short TTL when
the worker publishes KV events, which confirm or drop them; long TTL in approximate mode), and
:meth:`Router.withdraw` takes back the new ones when that worker refused the request or could not
be connected to.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import aiohttp

from kvcore.block_keys import block_keys
from kvcore.index.base import NO_MATCH, KVIndex, TierMatch
from kvcore.index.errors import IndexUnavailable
from kvcore.sliding_window import window_blocks, window_hits, window_keys
from kvcore.tokenization import BadPrompt
from router.config.schema import ModelConfig, RoutingConfig
from router.errors import bad_request, no_healthy_worker, unknown_model
from router.estimates.peer_credit import peer_blocks_by_worker
from router.estimates.prefix_uses import PrefixUses
from router.estimates.prefill_rate import PrefillRate
from router.policies.base import Candidate, Decision, Policy, RouteRequest, WorkerLoad
from router.policies.factory import describe, make_policy
from router.route.pd import PDLegs, choose_decode, pools, prefill_policy, split_or_whole
from router.route.plan import RoutePlan
from router.route.prompt_blocks import AGENT_KINDS, PromptBlocks, PromptKind, TokenizerPool, request_extras
from router.route.render import RENDER_PATHS, RenderFailed, render_prompt
from router.telemetry import tracing
from router.telemetry.steps import step
from router.telemetry.metrics import GatewayMetrics
from router.workers.peers import PeerTable
from router.workers.registry import WorkerRegistration, WorkerRegistry

log = logging.getLogger("kvroute.routing")


class WorkerState(NamedTuple):
    """What a policy's candidate takes from one worker itself (:meth:`Router.worker_state`): its
    load, learned TTFT line, evidence trust and weight, and speed factor against the model's line."""

    reg: WorkerRegistration
    load: WorkerLoad
    prefill_rate: PrefillRate | None
    evidence_credited: bool
    evidence_weight: float
    prefill_speed: tuple[float, int] | None


_new_tuple = tuple.__new__


class PolicyHolder:
    """The live policy; :meth:`replace` builds (validates) the new one first, then swaps it in one
    assignment, so a request sees either the old policy or the new one, never a mix."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self._policy: Policy = _make_policy(cfg)

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def config(self) -> dict[str, Any]:
        """The live policy's effective config, defaults filled in (``GET /admin/policy``); the
        same mapping given back to ``PUT /admin/policy`` builds an equal policy."""
        return describe(self._policy)

    def replace(self, cfg: dict[str, Any]) -> Policy:
        """Build a policy from ``cfg`` and make it live. Raises ValueError when ``cfg`` is bad
        (the old policy stays)."""
        policy = _make_policy(cfg)
        self._policy = policy
        return policy


def _make_policy(cfg: dict[str, Any]) -> Policy:
    if not isinstance(cfg, dict):
        raise ValueError("policy must be an object")
    return make_policy(cfg)


_GOLDEN = 0.6180339887498949  # frac(golden ratio): n * _GOLDEN mod 1 covers [0, 1) evenly


class Router:
    """Plans routes for the configured models over the registry's workers."""

    def __init__(self, models: list[ModelConfig], tokenizers: TokenizerPool, index: KVIndex,
                 registry: WorkerRegistry, policy: PolicyHolder, metrics: GatewayMetrics,
                 routing: RoutingConfig, peers: PeerTable | None = None) -> None:
        self._models: dict[str, tuple[ModelConfig, str | None]] = {}
        self._bases = list(models)
        for m in models:
            self._models[m.name] = (m, None)
            for adapter in m.lora_adapters:
                self._models[adapter] = (m, adapter)
        self.tokenizers = tokenizers
        self.index = index
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.routing = routing
        self.peers = peers or PeerTable()  # the agents' peer-pull states (router.workers.peers), polled by the gateway
        self.prefix_uses = PrefixUses()  # recent dispatches per block key: hot against private prefixes
        self._draws = 0
        # the upstream session, for render calls (router.route.render); set by the gateway once started
        self.render_session: Callable[[], aiohttp.ClientSession] | None = None
        self._render_failed_until: dict[str, float] = {}  # render URL -> monotonic s to retry it at

    def resolve_model(self, body: dict[str, Any]) -> tuple[ModelConfig, str | None]:
        """``(base model, adapter name or None)`` for the body's ``model``. A body without one
        (absent, null or "") is served by the one configured model, as vLLM serves it with its
        one served model (``_is_model_supported`` in vllm/entrypoints/serve/engine/serving.py,
        0.32). Raises GatewayError 400 (not a string; or absent while several models are
        configured: the message lists them) or 404 (unknown)."""
        name = body.get("model")
        if name is None or name == "":
            if len(self._bases) == 1:
                return self._bases[0], None
            raise bad_request(f"'model' is required: this gateway serves several models; choose one of "
                              f"{', '.join(sorted(self._models))}", "model")
        if not isinstance(name, str):
            raise bad_request("'model' must be a string", "model")
        found = self._models.get(name)
        if found is None:
            raise unknown_model(name)
        return found

    @staticmethod
    def session_key(policy: Policy, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> str | None:
        """The sticky-session key for a policy that wants one (``policy.session_header`` set): that
        header's value, else the body's ``user``; None otherwise."""
        if policy.session_header is None:
            return None
        wanted = policy.session_header.lower().encode("latin-1")
        for name, value in headers:
            if name == wanted:
                return value.decode("latin-1")
        user = body.get("user")
        return user if isinstance(user, str) and user else None

    def _draw(self, consume: bool) -> float:
        """The next tie-break draw (``RouteRequest.rand``): ``n x 0.618... mod 1`` for the n-th
        routed request, a low-discrepancy sequence, so cold prompts that tie on cost alternate
        over equal workers instead of piling up by chance; explain peeks at the draw the next
        request will get without consuming it."""
        n = self._draws + 1
        if consume:
            self._draws = n
        return (n * _GOLDEN) % 1.0

    async def plan(self, kind: PromptKind, body: dict[str, Any], headers: list[tuple[bytes, bytes]],
                   raw: bytes, explain: bool = False) -> RoutePlan:
        """Decide where ``body`` (whose bytes are ``raw``) goes. A real request consumes one
        tie-break draw (:meth:`_draw`) and changes nothing else but metrics. ``explain``: for
        ``POST /admin/explain``: tokens and keys are made even when the policy does not use the
        index, and the draw is only peeked at, so explaining a body and then sending it give the
        same decision when nothing else is routed in between. Raises GatewayError: 400 bad body,
        404 unknown model, 503 no routable worker."""
        model, lora_name = self.resolve_model(body)
        regs = self.registry.routable(model.name)
        if not regs:
            raise no_healthy_worker(model.name)
        policy = self.policy.policy
        pd_applies = policy.pd.applies_to(model.name)
        pd_on = pd_applies and kind not in AGENT_KINDS  # P/D legs are chat/completions bodies
        uses_index = policy.uses_index or pd_on
        blocks: PromptBlocks | None = None
        if uses_index or explain:
            blocks = await self._tokenize_step(model, kind, body, headers, raw, regs, lora_name)
        matches: dict[str, TierMatch] = {}
        if blocks is not None and blocks.first_keys and uses_index:
            matches = await self._lookup_step(model, blocks)
        first_tokens = all_tokens = None
        if blocks is not None and blocks.token_ids is not None:
            first_tokens = len(blocks.token_ids[0])
            all_tokens = sum(len(t) for t in blocks.token_ids)
        request = RouteRequest(model=model.name, prompt_tokens=first_tokens, all_prompt_tokens=all_tokens,
                               block_size=model.block_size,
                               num_blocks=len(blocks.first_keys) if blocks is not None else 0,
                               session_key=self.session_key(policy, body, headers),
                               rand=self._draw(consume=not explain))
        regs = [r for r in regs if r.routable]  # a probe may have run during tokenization
        if pd_applies and not pd_on:  # an agent API's request: served whole by the decode pool
            _, decode_ids = pools({r.id: r.role for r in regs})
            regs = [r for r in regs if r.id in decode_ids] or regs
        if not regs:
            raise no_healthy_worker(model.name)
        with step("kvroute.choose") as span:
            if pd_on:
                plan = self._plan_pd(RoutePlan(model, lora_name, blocks, matches, request, Decision("", "", []),
                                               policy.name or ""), policy, regs)
                decision = plan.decision
            else:
                decision = policy.choose(request, self._candidates(regs, matches, request, blocks))
                plan = RoutePlan(model, lora_name, blocks, matches, request, decision, policy.name or "",
                                 {r.id: r for r in regs})
            tracing.set_attributes(span, {"policy": policy.name or "", "candidates": len(decision.scores),
                                          "chosen": decision.worker_id, "reason": decision.reason})
        return plan

    async def _tokenize_step(self, model: ModelConfig, kind: PromptKind, body: dict[str, Any],
                             headers: list[tuple[bytes, bytes]], raw: bytes, regs: list[WorkerRegistration],
                             lora_name: str | None) -> PromptBlocks:
        """Prompt token ids and block keys (span ``kvroute.tokenize``, a prompt with media in a
        child span ``kvroute.render``; ``kvroute_tokenize_seconds``); a fallback is counted by
        model and reason. Raises GatewayError 400 (BadPrompt)."""
        with step("kvroute.tokenize", self.metrics.tokenize_s) as span:
            try:
                if len(raw) > self.routing.max_tokenize_bytes:
                    # past any context length: tokenizing it would hold the gateway's CPU for
                    # seconds, and the worker refuses it anyway
                    blocks = PromptBlocks(None, fallback="too_large")
                else:
                    blocks = await self.tokenizers.prompt_blocks(
                        model, kind, body, lora_name, inline=len(raw) <= self.routing.inline_tokenize_max_bytes)
            except BadPrompt as exc:
                raise bad_request(str(exc), "prompt" if kind == "completion" else "messages") from None
            tracing.set_attributes(span, {"prompt_tokens": blocks.prompt_tokens, "blocks": len(blocks.first_keys),
                                          "tokenization_fallback": blocks.fallback})
            if blocks.fallback == "multimodal":
                with step("kvroute.render") as render_span:
                    blocks = await self._rendered(model, kind, body, headers, regs, lora_name)
                    tracing.set_attributes(render_span, {"prompt_tokens": blocks.prompt_tokens,
                                                         "tokenization_fallback": blocks.fallback})
        if blocks.fallback is not None:
            self.metrics.tokenization_fallbacks.labels(model.name, blocks.fallback).inc()
        return blocks

    async def _lookup_step(self, model: ModelConfig, blocks: PromptBlocks) -> dict[str, TierMatch]:
        """The index lookup (span ``kvroute.lookup``, ``kvroute_index_lookup_seconds``); empty, and
        counted in ``kvroute_index_unavailable_total``, when the index cannot answer: the request
        is routed on load alone."""
        matches: dict[str, TierMatch] = {}
        with step("kvroute.lookup", self.metrics.lookup_s) as span:
            try:
                matches = await self._matches(model, blocks)
            except IndexUnavailable:
                self.metrics.index_unavailable.inc()
                tracing.set_attributes(span, {"index_unavailable": True})
            tracing.set_attributes(span, {"blocks": len(blocks.first_keys), "matched_workers": len(matches)})
        return matches

    async def _matches(self, model: ModelConfig, blocks: PromptBlocks) -> dict[str, TierMatch]:
        """Per worker, the blocks of ``blocks``' first prompt it holds by tier (a hybrid model's
        window rule applied). Raises IndexUnavailable."""
        matches = await self.index.match(blocks.first_keys)
        if model.sliding_window_tokens is not None and matches:
            matches = await self._window_limited(model, blocks, matches)
        return matches

    async def rematch(self, plan: RoutePlan) -> RoutePlan:
        """``plan`` with its prompt looked up in the index again: what the workers hold now, for
        a request that has waited since ``plan`` was made (the dispatch queue). ``plan`` itself
        when it has no block keys or the index is unavailable (counted in
        ``kvroute_index_unavailable_total``)."""
        if plan.blocks is None or not plan.blocks.first_keys:
            return plan
        try:
            matches = await self._matches(plan.model, plan.blocks)
        except IndexUnavailable:
            self.metrics.index_unavailable.inc()
            return plan
        return replace(plan, matches=matches)

    async def _rendered(self, model: ModelConfig, kind: PromptKind, body: dict[str, Any],
                        headers: list[tuple[bytes, bytes]], regs: list[WorkerRegistration],
                        lora_name: str | None) -> PromptBlocks:
        """A prompt with media, tokenized and hashed by a vLLM render endpoint (:mod:`router.route.render`):
        the model's ``render_url``, else its least busy routable worker. Its block keys mix in
        each item's hash where its placeholders lie, as vLLM's block hashes do. Falls back (a
        ``render_<reason>`` label, or ``multimodal`` when rendering is off or the endpoint rests
        after failing itself, not on one bad body) rather than raising; BadPrompt for a bad
        ``cache_salt``."""
        rendered = PromptBlocks(None, fallback="multimodal")
        if not self.routing.render_multimodal or self.render_session is None or kind not in RENDER_PATHS:
            return rendered
        url = model.render_url or min(regs, key=lambda r: r.in_flight).url
        if self._render_failed_until.get(url, 0.0) > time.monotonic():
            return rendered
        auth = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), None)
        try:
            got = await render_prompt(self.render_session(), url, kind, body, self.routing.render_timeout_s, auth)
        except RenderFailed as exc:
            if exc.endpoint_down:
                self._render_failed_until[url] = time.monotonic() + self.routing.render_retry_s
                log.warning("rendering multimodal prompts failed (routing them by load for %.0f s): %s",
                            self.routing.render_retry_s, exc)
            else:  # this body only: the worker will answer it as it sees fit
                log.info("rendering a multimodal prompt failed: %s", exc)
            return PromptBlocks(None, fallback=f"render_{exc.reason}")
        extras = replace(request_extras(body, lora_name), mm_hashes=got.media)
        return PromptBlocks([got.token_ids], [block_keys(got.token_ids, model.block_size, model.name, extras)])

    async def _window_limited(self, model: ModelConfig, blocks: PromptBlocks,
                              matches: dict[str, TierMatch]) -> dict[str, TierMatch]:
        """``matches`` of a hybrid model cut to what vLLM reuses (:mod:`kvcore.sliding_window`):
        each worker's gpu run, capped at the blocks a hit may cover (``prompt_len - 1`` tokens),
        down to the last end its window group holds. Such a model has no cpu or ssd tier (the
        connector refuses it), so those are dropped. Raises IndexUnavailable."""
        assert model.sliding_window_tokens is not None and blocks.token_ids is not None
        n = len(blocks.token_ids[0])
        cap = max(0, n - 1) // model.block_size
        wkeys = window_keys(blocks.first_keys[:cap])
        need = window_blocks(model.sliding_window_tokens, model.block_size)
        hits = await window_hits({w: min(m.gpu, cap) for w, m in matches.items()}, wkeys, need,
                                self.index.gpu_holders)
        return {w: TierMatch(gpu=e) for w, e in hits.items() if e > 0}

    def _plan_pd(self, base: RoutePlan, policy: Policy, regs: list[WorkerRegistration]) -> RoutePlan:
        """``base`` (tokens, matches, request; no decision yet) decided for a model with
        disaggregation on (:mod:`router.route.pd`): the decode leg over the decode pool, then split or
        whole, then the prefill leg over the prefill pool; with a pool empty, the live policy over
        ``regs`` for a whole request."""
        request, matches, blocks = base.request, base.matches, base.blocks
        minimum = policy.pd.min_prefill_tokens
        by_id = {r.id: r for r in regs}
        prefill_ids, decode_ids = pools({r.id: r.role for r in regs})
        if not prefill_ids or not decode_ids:
            decision = policy.choose(request, self._candidates(regs, matches, request, blocks))
            reason = "no_prefill_pool" if not prefill_ids else "no_decode_pool"
            return replace(base, decision=decision, workers=by_id,
                           pd=PDLegs("whole", reason, minimum, pooled=False))
        decode_regs = [by_id[w] for w in decode_ids]
        decision, scores = choose_decode(request, self._candidates(decode_regs, matches, request, blocks))
        outcome, reason = split_or_whole(scores[0], minimum)
        legs = PDLegs(outcome, reason, minimum, decode=scores)
        if legs.split:
            prefill_regs = [by_id[w] for w in prefill_ids]
            chooser = prefill_policy(policy)
            prefill = chooser.choose(request, self._candidates(prefill_regs, matches, request, blocks))
            if prefill.worker_id == decision.worker_id:  # a "both" worker won both legs
                legs.outcome, legs.reason = "whole", "same_worker"
            else:
                legs.prefill = replace(base, decision=prefill, policy_name=chooser.name,
                                       workers={r.id: r for r in prefill_regs})
        return replace(base, decision=decision, workers={r.id: r for r in decode_regs}, pd=legs)

    def redecide(self, plan: RoutePlan, regs: list[WorkerRegistration],
                  backlog_tokens: Mapping[str, float] | None = None, policy: Policy | None = None,
                  states: Mapping[str, WorkerState] | None = None) -> RoutePlan:
        """The live policy's (or ``policy``'s: a prefill leg's) choice among ``regs`` (non-empty),
        with their load as it is now and the prefix matches ``plan`` looked up: a new plan
        sharing ``plan``'s tokens and matches (the dispatch queue's decision once workers open).
        ``backlog_tokens``: per worker id, prefill tokens of requests waiting in the gateway
        ahead of this one for that worker, added to its load; ``states``: per worker id, the
        state to decide on (:meth:`worker_state`, taken a moment ago) instead of the live one
        (a worker not in it: its live state). Consumes no tie-break draw."""
        policy = self.policy.policy if policy is None else policy
        candidates = self._candidates(regs, plan.matches, plan.request, plan.blocks, states)
        for c in candidates:
            extra = (backlog_tokens or {}).get(c.worker_id, 0.0)
            if extra:
                c.load = replace(c.load, prefill_tokens=c.load.prefill_tokens + int(extra))
        decision = policy.choose(plan.request, candidates)
        return RoutePlan(plan.model, plan.lora_name, plan.blocks, plan.matches, plan.request, decision,
                         policy.name or "", {r.id: r for r in regs}, plan.pd)

    def pin(self, plan: RoutePlan, worker_id: str, reason: str) -> RoutePlan:
        """``plan`` sent to ``worker_id`` (one of its candidates) whatever the policy chose, for
        ``reason`` (e.g. ``stored_response``: the worker holds state the request needs); the
        other candidates follow in the policy's order."""
        scores = sorted(plan.decision.scores, key=lambda s: s.worker_id != worker_id)
        return replace(plan, decision=Decision(worker_id, reason, scores))

    def record_decision(self, plan: RoutePlan) -> None:
        """Count a real (not explained) decision, and whether it went past the longest holder;
        with tracing on, put it on the current (the request's) span."""
        self.metrics.child(self.metrics.route_decisions, plan.policy_name, plan.decision.reason).inc()
        chosen_score = plan._score(plan.decision.worker_id)
        if chosen_score is not None and chosen_score.peer_credit_blocks > 0:
            self.metrics.child(self.metrics.peer_credit_blocks, plan.decision.worker_id).inc(
                chosen_score.peer_blocks)
        if tracing.enabled():
            tracing.set_attributes(tracing.current_span(), plan.trace_attributes())
        held = [m.total for w, m in plan.matches.items() if w in plan.workers]
        if held:
            longest = max(held)
            chosen = plan.matches.get(plan.decision.worker_id)
            if (chosen.total if chosen is not None else 0) < longest:
                self.metrics.child(self.metrics.off_longest_prefix, plan.policy_name, plan.decision.reason).inc()

    async def commit(self, plan: RoutePlan, reg: WorkerRegistration, count_use: bool = True) -> None:
        """Record the prompt's keys as speculative entries on the worker the request went to, and
        count the first prompt's keys as used (:attr:`prefix_uses`; ``count_use`` False for the
        prefill leg of a split request, whose decode leg counts it)."""
        if plan.blocks is None or not plan.blocks.keys:
            return
        if count_use:
            self.prefix_uses.record(plan.blocks.first_keys)
        # events confirm the entries soon (the gateway's own ingest, or an agent writing a shared
        # index): keep them only that long, so a worker whose agent died stops attracting prompts
        event_fed = reg.has_events or self.index.agent_fed(reg.id)
        ttl = self.routing.speculative_ttl_s if event_fed else self.routing.approx_ttl_s
        window = plan.model.sliding_window_tokens
        need = window_blocks(window, plan.model.block_size) if window is not None else 0
        try:
            for keys in plan.blocks.keys:
                if not keys:
                    continue
                await self.index.store_speculative(reg.id, keys, ttl)
                if need:  # a hybrid model's window group caches the prompt's last full blocks
                    await self.index.store_speculative(reg.id, window_keys(keys[-need:]), ttl)
        except IndexUnavailable:  # the next lookup falls back to load as well
            self.metrics.index_write_failures.inc()

    async def withdraw(self, plan: RoutePlan, reg: WorkerRegistration) -> None:
        """Take back what :meth:`commit` added on ``reg`` when the worker refused the request (a
        4xx: vLLM validates a request before it schedules it) or could not be connected to, so
        it computed none of the prompt: the first prompt's speculative entries past the run the
        worker held at planning (that run stays: another request put it there, or the engine
        did). Two requests planned at once that both add the same new keys on one worker, one
        accepted and one refused, lose them both (an under-report until the next request or
        event; with the Redis mirror, in every gateway replica); other prompts of a batched
        completions body keep theirs (their TTL). Its uses stay counted (the prompt was asked
        for). Never raises: it runs on a request's error path (before a retry or the worker's
        answer), so a failure is counted or logged."""
        keys = plan.blocks.first_keys if plan.blocks is not None else []
        held = plan.matches.get(reg.id)
        added = keys[held.total:] if held is not None else keys
        if not added:
            return
        window = plan.model.sliding_window_tokens
        need = window_blocks(window, plan.model.block_size) if window is not None else 0
        try:
            await self.index.drop_speculative(reg.id, added)
            if need and len(added) == len(keys):  # its window keys were new with the prompt
                await self.index.drop_speculative(reg.id, window_keys(keys[-need:]))
        except IndexUnavailable:
            self.metrics.index_write_failures.inc()
        except Exception:
            log.exception("withdrawing speculative entries on %s failed", reg.id)

    def ranked_by_load(self, body: dict[str, Any]) -> list[WorkerRegistration]:
        """For endpoints forwarded without routing (embeddings, tokenize, ...): routable
        workers of the body's model, least in-flight first. Raises GatewayError 400/404/503."""
        model, _ = self.resolve_model(body)
        regs = self.registry.routable(model.name)
        if not regs:
            raise no_healthy_worker(model.name)
        return sorted(regs, key=lambda r: r.in_flight)


    def worker_state(self, reg: WorkerRegistration) -> WorkerState:
        """Everything :meth:`_candidates` takes from ``reg`` itself (not from the request, its
        matches or the peers): two equal states of one worker give equal candidates for one
        request. The dispatch queue compares them between its looks
        (:meth:`router.route.dispatch_queue.DispatchQueue._decide`)."""
        # tuple.__new__ skips the named tuple's own __new__ (a third of this call; once per worker per look)
        return _new_tuple(WorkerState, (reg, reg.load(), reg.prefill_rate.learned, reg.evidence_credited,
                                        reg.evidence.credit_weight, self.registry.prefill_speed(reg)))

    def holder_uses(self, plan: RoutePlan) -> dict[str, int]:
        """Per worker ``plan`` matched, the recent uses of its matched prefix as its candidate
        carries them (``Candidate.prefix_uses``)."""
        keys = plan.blocks.first_keys if plan.blocks is not None else []
        return {wid: self._uses_at(keys, m.total) for wid, m in plan.matches.items()}

    def _uses_at(self, keys: list[int], matched_blocks: int) -> int:
        """:attr:`prefix_uses` at the last of ``keys`` (a prompt's first keys) a worker holding
        ``matched_blocks`` matched; 0 when it matched none."""
        depth = min(matched_blocks, len(keys))
        return self.prefix_uses.uses(keys[depth - 1]) if depth > 0 else 0

    def _candidates(self, regs: list[WorkerRegistration], matches: dict[str, TierMatch],
                    request: RouteRequest, blocks: PromptBlocks | None = None,
                    states: Mapping[str, WorkerState] | None = None) -> list[Candidate]:
        """The policy's candidates: each routable worker's load, match, learned rate (and the
        model's, :meth:`~router.workers.registry.WorkerRegistry.model_rate`, with the worker's speed
        factor against it) and evidence, the recent
        uses of its matched prefix (:attr:`prefix_uses` at the last matched block of ``blocks``),
        and, when agents publish peer-pull states (:mod:`router.estimates.peer_credit`), its peer info and the
        blocks it can pull from a peer (capped by the prompt's creditable blocks,
        ``(prompt_tokens - 1) // block_size``; a worker registered here whose evidence is not
        credited is no peer). ``states``: as :meth:`redecide`'s (the fields :meth:`worker_state`
        reads, inline below without one; test_dispatch_queue_changed checks the two agree)."""
        model_rate = self.registry.model_rate(request.model).learned
        if states is None:
            # registry.prefill_speed(r) inlined: every r serves request.model, whose line is model_rate
            out = [Candidate(r.id, r.load(), matches.get(r.id) or NO_MATCH, r.prefill_rate.learned,
                             r.evidence_credited, r.evidence.credit_weight, model_prefill_rate=model_rate,
                             prefill_speed=None if model_rate is None else r.prefill_rate.speed_factor(model_rate))
                   for r in regs]
        else:
            out = []
            for r in regs:
                st = states.get(r.id) or self.worker_state(r)
                out.append(Candidate(r.id, st.load, matches.get(r.id) or NO_MATCH, st.prefill_rate,
                                     st.evidence_credited, st.evidence_weight, model_prefill_rate=model_rate,
                                     prefill_speed=st.prefill_speed))
        keys = blocks.first_keys if blocks is not None else []
        for c in out:
            if c.matched.total > 0:
                c.prefix_uses = self._uses_at(keys, c.matched.total)
        peers = self.peers.current()
        if not peers or not matches or not request.prompt_tokens:
            return out
        creditable = (request.prompt_tokens - 1) // max(1, request.block_size)

        def distrusted(worker_id: str) -> bool:
            reg = self.registry.get(worker_id)
            return reg is not None and not reg.evidence_credited

        supply = peer_blocks_by_worker(((c.worker_id, c.matched) for c in out), matches, peers, creditable,
                                       distrusted)
        for c in out:
            c.peer = peers.get(c.worker_id)
            if c.worker_id in supply:
                c.peer_blocks, c.peer_worker = supply[c.worker_id]
        return out


__all__ = ["PolicyHolder", "Router", "WorkerState"]
