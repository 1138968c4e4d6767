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

P/D disaggregation (vLLM's protocol, ``kv_transfer_params``):

- ``remote_decode`` (a prefill worker's leg): served as any request; when it finishes, the ids of
  the blocks that held its prompt are kept in ``final_block_ids`` for the answer's params. The
  blocks are freed as usual and stay cached (vLLM's prefill side holds them until the decode side
  has read them; the simulated decode side reads nothing, so nothing is held).
- ``remote_prefill`` (a decode worker's leg): admitted like any request, but the prompt's uncached
  tokens are loaded over the worker's link instead of computed. ``kv_load`` says which: ``"prompt"``
  (vLLM's own connectors, NixlConnector and MooncakeConnector: every prompt token, the partial
  block included, all counted as cached; the last one is then computed again for its logits;
  ``nixl/base_scheduler.py``'s ``_get_remote_prefill_token_count`` and the scheduler's
  ``_update_waiting_for_remote_kv``) or ``"full_blocks"`` (kvroute's tiers
  connector, whose agents hold only full blocks: at most ``(len - 1) // block_size`` blocks). The
  request waits in ``receiving``, outside the steps, for :meth:`TimingModel.transfer_s` of those
  tokens (transfers queue on the one link), then joins the running requests with the loaded full
  blocks cached (``BlockStored``) and computes only the rest. ``num_cached_tokens`` counts local
  hits plus loaded tokens, as vLLM's does.

A request scheduled for exactly one new token is decode-shaped work whatever its phase (the last
prompt token after a full load, a prompt one token past its cached blocks): vLLM V1 batches
it in the same forward pass as the decodes, so the step prices it as one more decoding sequence,
not as a prefill with its fixed cost.
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
KV_LOAD_MODES = ("prompt", "full_blocks")


@dataclass(eq=False)
class SimRequest:
    """One sequence in the engine (a choice of an OpenAI request).

    ``output_token_ids`` is fixed up front; the engine reveals them one per step by putting
    ``(index, token id)`` on ``sink`` (an asyncio.Queue the choices of one HTTP request share),
    then ``(index, None)`` when the sequence ends (finished or aborted).
    ``extra_keys``: per-block extra keys for the engine hash, e.g. ``[[salt]]`` for a cache salt;
    ``lora_name``: the LoRA adapter the request names (mixed into every block's hash), or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    extra_keys: list[Any] | None = None
    lora_name: str | None = None
    report_full: bool = False
    remote_prefill: bool = False  # load the uncached prompt KV (Engine.kv_load says which) instead of computing it
    remote_decode: bool = False  # a prefill leg: keep the prompt's block ids at the end
    index: int = 0
    sink: asyncio.Queue = field(default_factory=asyncio.Queue)
    engine: Any = None  # the Engine (data parallel rank) it was added to
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
    # P/D state
    local_hit_tokens: int = 0  # prefix hit at first admission (the rest of num_cached_tokens came over the link)
    transferred_tokens: int = 0  # prompt tokens loaded over the link instead of computed
    transfer_sim_s: float = 0.0  # their transfer time, simulated seconds
    kv_ready_s: float | None = None  # engine clock time the load completes
    final_block_ids: list[int] | None = None  # remote_decode: the prompt's block ids at the end

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
    external_queries_tokens: int = 0  # prompt tokens of requests asking for a remote prefill
    external_hits_tokens: int = 0  # prompt tokens loaded over the link
    kv_transfers: int = 0
    kv_transfer_sim_s: float = 0.0  # simulated seconds of all loads
    kv_transfer_bytes: float = 0.0


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
    ``clock``: the time source of KV loads (seconds); :meth:`run` sets it to its event loop's clock.
    ``kv_load``: what a ``remote_prefill`` request loads, one of :data:`KV_LOAD_MODES` (module doc).
    """

    def __init__(self, pool: BlockPool, timing: TimingModel, max_num_seqs: int, seed: int,
                 publish: Callable[[list], Any] | None = None, max_num_batched_tokens: int | None = None,
                 kv_load: str = "prompt") -> None:
        if kv_load not in KV_LOAD_MODES:
            raise ValueError(f"kv_load must be one of {', '.join(KV_LOAD_MODES)}, not {kv_load!r}")
        self.kv_load = kv_load
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.publish = publish
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.receiving: list[SimRequest] = []  # admitted, loading their prompt's KV over the link
        self.clock: Callable[[], float] = time.monotonic
        self._link_free_s = 0.0  # clock time the link finishes its last queued transfer
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
        req.engine = self
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client went away): frees its blocks; no-op when already finished."""
        if req.finished:
            return
        req.finished = req.aborted = True
        if req in self.running or req in self.receiving:
            (self.running if req in self.running else self.receiving).remove(req)
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
        """Queued requests, those loading remote KV included (vLLM keeps them in its waiting queue)."""
        return len(self.waiting) + len(self.receiving)

    # ---- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Step forever (cancel to stop); sleeps each step's simulated duration."""
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        clock = loop.time()
        while True:
            if not self.running and not self.waiting and not self.receiving:
                self._wake.clear()
                await self._wake.wait()
                clock = loop.time()
            step = self.schedule()
            if not step.worked:  # nothing fits yet: wait for an abort, a new request or a KV load
                self._wake.clear()
                wait_s = MAX_LAG_S
                if self.receiving:
                    wait_s = min(wait_s, max(0.0, min(r.kv_ready_s for r in self.receiving) - loop.time()))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)
                continue
            clock = max(clock, loop.time() - MAX_LAG_S) + step.duration_s
            await asyncio.sleep(max(0.0, clock - loop.time()))
            self.complete(step)

    def schedule(self) -> "Step":
        """Start a step: pick the requests, take their blocks, cache newly full blocks."""
        self._take_received(self.clock())
        scheduled, prefill_tokens, num_prefills, attention, one_token = self._schedule()
        num_decodes = sum(1 for r in scheduled if r.num_computed_tokens > r.prefill_target) + one_token
        return Step(scheduled, self.timing.step_s(prefill_tokens, num_prefills, num_decodes, attention),
                    worked=bool(scheduled) or num_prefills > 0 or one_token > 0)

    def complete(self, step: "Step") -> None:
        """End a step: publish its KV events as one batch, hand out one token per request."""
        self.stats.steps += 1
        events = self.pool.take_events()
        if events and self.publish is not None:
            self.publish(events)
        self._advance(step.scheduled)

    def _schedule(self) -> tuple[list[SimRequest], int, int, int, int]:
        """Pick this step's requests; returns (scheduled, uncached prefill tokens, prefills, the
        prefills' attention work: sum over them of uncached x prompt tokens, and the prompt chunks
        of exactly one token, which are priced as decodes and left out of the prefill terms)."""
        scheduled: list[SimRequest] = []
        bs = self.pool.block_size
        budget = self.max_num_batched_tokens or (1 << 62)
        prefill_tokens = 0
        num_prefills = 0
        attention = 0
        one_token = 0

        def add_chunk(req: SimRequest, chunk: int) -> None:
            nonlocal prefill_tokens, attention, num_prefills, one_token
            if chunk == 1:
                one_token += 1
                return
            prefill_tokens += chunk
            attention += chunk * req.num_computed_tokens
            num_prefills += 1

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
                add_chunk(req, chunk)
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
            first = req.num_cached_tokens is None
            if first:
                req.num_cached_tokens = req.local_hit_tokens = hit_tokens
                self.stats.prefix_cache_queries_tokens += len(tokens)
                self.stats.prefix_cache_hits_tokens += hit_tokens
            if req.report_full and hit:
                self.pool.announce(req.block_hashes, tokens, len(hit), req.extra_keys, req.lora_name)
            req.num_hashed_blocks = len(hit)
            if first and req.remote_prefill and self._start_load(req, hit_tokens):
                continue
            chunk = min(len(tokens) - hit_tokens, budget)
            budget -= chunk
            req.prefill_target = len(tokens)
            req.num_computed_tokens = hit_tokens + chunk
            self._cache_blocks(req)
            add_chunk(req, chunk)
            self.running.append(req)
            if req.num_computed_tokens == req.prefill_target:
                scheduled.append(req)
        return scheduled, prefill_tokens, num_prefills, attention, one_token

    def _start_load(self, req: SimRequest, hit_tokens: int) -> bool:
        """Queue the link transfer of ``req``'s uncached prompt tokens (per ``kv_load``; its blocks
        are taken); False when there is nothing to load (it is then computed as any other)."""
        bs = self.pool.block_size
        n = len(req.prompt_token_ids)
        loadable = n if self.kv_load == "prompt" else (n - 1) // bs * bs
        tokens = max(0, loadable - hit_tokens)
        self.stats.external_queries_tokens += n - hit_tokens
        if tokens == 0:
            return False
        now = self.clock()
        req.transferred_tokens = tokens
        req.transfer_sim_s = self.timing.transfer_sim_s(tokens)
        req.kv_ready_s = self._link_free_s = max(now, self._link_free_s) + self.timing.transfer_s(tokens)
        req.num_cached_tokens = hit_tokens + tokens
        req.num_computed_tokens = hit_tokens
        req.prefill_target = n
        self.stats.external_hits_tokens += tokens
        self.stats.kv_transfers += 1
        self.stats.kv_transfer_sim_s += req.transfer_sim_s
        self.stats.kv_transfer_bytes += tokens * self.timing.kv_bytes_per_token
        self.receiving.append(req)
        return True

    def _take_received(self, now: float) -> None:
        """Requests whose load has completed by ``now`` join the running ones (while seats are
        free), their loaded blocks cached, the rest of the prompt left to compute."""
        for req in [r for r in self.receiving if r.kv_ready_s <= now]:
            if len(self.running) >= self.max_num_seqs:
                return
            self.receiving.remove(req)
            # a prompt loaded whole still computes its last token (the scheduler's
            # _update_waiting_for_remote_kv), for the logits of the first output token
            req.num_computed_tokens = min(req.local_hit_tokens + req.transferred_tokens, len(req.prompt_token_ids) - 1)
            self._cache_blocks(req)
            self.running.append(req)

    def _extend_hashes(self, req: SimRequest, tokens: list[int]) -> None:
        have = len(req.block_hashes)
        if len(tokens) // self.pool.block_size > have:
            req.block_hashes += engine_block_hashes(
                tokens, self.pool.block_size, self.seed, req.extra_keys, start=have,
                parent=req.block_hashes[-1] if have else None, lora_name=req.lora_name)

    def _cache_blocks(self, req: SimRequest) -> None:
        full = req.num_computed_tokens // self.pool.block_size
        if full > req.num_hashed_blocks:
            tokens = req.all_token_ids()
            self._extend_hashes(req, tokens)
            self.pool.cache_full_blocks(req.blocks, req.block_hashes, tokens, req.num_hashed_blocks,
                                        full, req.extra_keys, req.lora_name)
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
                if req.remote_decode:
                    req.final_block_ids = [b.block_id for b in
                                           req.blocks[:-(-len(req.prompt_token_ids) // self.pool.block_size)]]
                self.running.remove(req)
                self.pool.free(req.blocks)
                req.blocks = []
                self.stats.request_success += 1
                req.sink.put_nowait((req.index, None))
