"""The simulated engine: vLLM-style continuous batching over a :class:`BlockPool`.

Each step (one asyncio iteration of :meth:`Engine.run`):

1. every running request gets a slot for one more token (a new block when it crosses a block
   boundary; if none is free, the most recently admitted request is preempted: its blocks are
   freed and it goes back to the front of the queue to be recomputed, as vLLM's recompute
   preemption); a request still in a chunked prefill gets its next chunk instead;
2. waiting requests are admitted first come first served while fewer than ``max_num_seqs`` run and
   their blocks fit: prefix hit from the pool, new blocks for the rest;
   the step's tokens (one per decode, the uncached prompt tokens of each prefill) stay within
   ``max_num_batched_tokens``: a prefill that does not fit is chunked over the next steps, as vLLM
   V1's scheduler does (``vllm/v1/core/sched/scheduler.py``), and emits its first token with the
   step that finishes it;
3. newly full blocks get engine hashes (``BlockStored``); the step lasts
   :meth:`TimingModel.step_s`; then its KV events are published as one batch and each scheduled
   request receives its next output token.

Output tokens are fixed when a request is made (:mod:`simulator.outputs`); the engine only paces them.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from simulator.block_pool import Block, BlockPool, engine_block_hashes
from simulator.timing import TimingModel

MAX_LAG_S = 0.05  # a late engine catches up on at most this much lost time


@dataclass(eq=False)
class SimRequest:
    """One sequence in the engine (a choice of an OpenAI request).

    ``output_token_ids`` is fixed up front; the engine reveals them one per step by putting
    ``(index, token id)`` on ``sink`` (an asyncio.Queue the choices of one HTTP request share),
    then ``(index, None)`` when the sequence ends (finished or aborted).
    ``extra_keys``: per-block extra keys for the engine hash, e.g. ``[[salt]]`` for a cache salt.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    extra_keys: list[Any] | None = None
    report_full: bool = False
    index: int = 0
    sink: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival_s: float = field(default_factory=time.monotonic)
    # engine state
    num_output: int = 0
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0
    num_cached_tokens: int | None = None  # prefix hit tokens at first schedule
    prefill_target: int = 0  # tokens to compute before the first output token of this admission
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    finished: bool = False
    aborted: bool = False

    def all_token_ids(self) -> list[int]:
        """Prompt tokens plus the output tokens produced so far."""
        return self.prompt_token_ids + self.output_token_ids[:self.num_output]


@dataclass
class EngineStats:
    """Counters behind ``/metrics`` (token counts are tokens, not requests)."""

    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    request_success: int = 0
    preemptions: int = 0
    steps: int = 0


@dataclass
class Step:
    """One engine step: the requests it runs and its wall duration in seconds."""

    scheduled: list[SimRequest]
    duration_s: float
    worked: bool = True  # False when nothing ran (nothing fits yet)


class RequestTooLong(ValueError):
    """The request cannot fit in the block pool even alone."""


class Engine:
    """Continuous-batching scheduler. Use from one asyncio loop: :meth:`add`, :meth:`abort`,
    :meth:`reset_prefix_cache`, and :meth:`run` as a background task.

    ``publish(events)``: called with each step's KV events (skipped when a step has none).
    ``max_num_batched_tokens``: the token budget of one step (None: unlimited).
    """

    def __init__(self, pool: BlockPool, timing: TimingModel, max_num_seqs: int, seed: int,
                 publish: Callable[[list], Any] | None = None, max_num_batched_tokens: int | None = None) -> None:
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.publish = publish
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = EngineStats()
        self._wake = asyncio.Event()

    # ---- API ----------------------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        """Queue a request. Raises RequestTooLong if its prompt and output can never fit."""
        total = len(req.prompt_token_ids) + max(0, len(req.output_token_ids) - 1)
        if -(-total // self.pool.block_size) > self.pool.num_usable_blocks:
            raise RequestTooLong(
                f"request needs {total} tokens of KV cache; only "
                f"{self.pool.num_usable_blocks * self.pool.block_size} fit")
        self.stats.prompt_tokens += len(req.prompt_token_ids)
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client went away): frees its blocks; no-op when already finished."""
        if req.finished:
            return
        req.finished = req.aborted = True
        if req in self.running:
            self.running.remove(req)
            self.pool.free(req.blocks)
            req.blocks = []
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.sink.put_nowait((req.index, None))
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset: False while requests hold blocks. The AllBlocksCleared event goes out
        with the next step's batch, as in vLLM."""
        return self.pool.reset()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Step forever (cancel to stop); sleeps each step's simulated duration."""
        loop = asyncio.get_running_loop()
        clock = loop.time()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                clock = loop.time()
            step = self.schedule()
            if not step.worked:  # nothing fits yet: wait for an abort or a new request
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), MAX_LAG_S)
                continue
            clock = max(clock, loop.time() - MAX_LAG_S) + step.duration_s
            await asyncio.sleep(max(0.0, clock - loop.time()))
            self.complete(step)

    def schedule(self) -> "Step":
        """Start a step: pick the requests, take their blocks, cache newly full blocks."""
        scheduled, prefill_tokens, num_prefills, attention = self._schedule()
        num_decodes = sum(1 for r in scheduled if r.num_computed_tokens > r.prefill_target)
        return Step(scheduled, self.timing.step_s(prefill_tokens, num_prefills, num_decodes, attention),
                    worked=bool(scheduled) or num_prefills > 0)

    def complete(self, step: "Step") -> None:
        """End a step: publish its KV events as one batch, hand out one token per request."""
        self.stats.steps += 1
        events = self.pool.take_events()
        if events and self.publish is not None:
            self.publish(events)
        self._advance(step.scheduled)

    def _schedule(self) -> tuple[list[SimRequest], int, int, int]:
        """Pick this step's requests; returns (scheduled, uncached prefill tokens, prefills, and
        the prefills' attention work: sum over them of uncached x prompt tokens)."""
        scheduled: list[SimRequest] = []
        bs = self.pool.block_size
        budget = self.max_num_batched_tokens or (1 << 62)
        prefill_tokens = 0
        num_prefills = 0
        attention = 0
        for req in list(self.running):
            if req not in self.running:  # preempted by an earlier request this step
                continue
            if req.num_computed_tokens < req.prefill_target:  # the next chunk of its prefill
                if budget <= 0:
                    continue
                chunk = min(req.prefill_target - req.num_computed_tokens, budget)
                budget -= chunk
                req.num_computed_tokens += chunk
                self._cache_blocks(req)
                prefill_tokens += chunk
                attention += chunk * req.num_computed_tokens
                num_prefills += 1
                if req.num_computed_tokens == req.prefill_target:
                    scheduled.append(req)
                continue
            if budget <= 0:
                continue
            budget -= 1
            need = -(-(req.num_computed_tokens + 1) // bs) - len(req.blocks)
            while need > 0 and self.pool.num_free_blocks < need:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req not in self.running:
                continue
            if need > 0:
                req.blocks += self.pool.allocate(need)
            req.num_computed_tokens += 1
            self._cache_blocks(req)
            scheduled.append(req)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            tokens = req.all_token_ids()
            self._extend_hashes(req, tokens)
            hit = self.pool.longest_hit(req.block_hashes, len(tokens))
            need = -(-len(tokens) // bs) - len(hit)
            if need > self.pool.num_free_blocks - sum(1 for b in hit if b.ref_cnt == 0):
                break
            self.waiting.popleft()
            self.pool.touch(hit)
            req.blocks = hit + self.pool.allocate(need)
            hit_tokens = len(hit) * bs
            if req.num_cached_tokens is None:
                req.num_cached_tokens = hit_tokens
                self.stats.prefix_cache_queries_tokens += len(tokens)
                self.stats.prefix_cache_hits_tokens += hit_tokens
            if req.report_full and hit:
                self.pool.announce(req.block_hashes, tokens, len(hit), req.extra_keys)
            req.num_hashed_blocks = len(hit)
            chunk = min(len(tokens) - hit_tokens, budget)
            budget -= chunk
            req.prefill_target = len(tokens)
            req.num_computed_tokens = hit_tokens + chunk
            self._cache_blocks(req)
            prefill_tokens += chunk
            attention += chunk * req.num_computed_tokens
            num_prefills += 1
            self.running.append(req)
            if req.num_computed_tokens == req.prefill_target:
                scheduled.append(req)
        return scheduled, prefill_tokens, num_prefills, attention

    def _extend_hashes(self, req: SimRequest, tokens: list[int]) -> None:
        have = len(req.block_hashes)
        if len(tokens) // self.pool.block_size > have:
            req.block_hashes += engine_block_hashes(
                tokens, self.pool.block_size, self.seed, req.extra_keys, start=have,
                parent=req.block_hashes[-1] if have else None)

    def _cache_blocks(self, req: SimRequest) -> None:
        full = req.num_computed_tokens // self.pool.block_size
        if full > req.num_hashed_blocks:
            tokens = req.all_token_ids()
            self._extend_hashes(req, tokens)
            self.pool.cache_full_blocks(req.blocks, req.block_hashes, tokens, req.num_hashed_blocks,
                                        full, req.extra_keys)
            req.num_hashed_blocks = full

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed_tokens = 0
        req.num_hashed_blocks = 0
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _advance(self, scheduled: list[SimRequest]) -> None:
        """After the step: each scheduled request samples its next token; finished ones leave."""
        for req in scheduled:
            if req.finished:  # aborted during the step
                continue
            token = req.output_token_ids[req.num_output]
            req.num_output += 1
            self.stats.generation_tokens += 1
            req.sink.put_nowait((req.index, token))
            if req.num_output >= len(req.output_token_ids):
                req.finished = True
                self.running.remove(req)
                self.pool.free(req.blocks)
                req.blocks = []
                self.stats.request_success += 1
                req.sink.put_nowait((req.index, None))
