"""A benchmark workload: the requests to send, with their exact prompt token ids, and what an
infinite prefix cache would hit on them.

Every workload (``trace``, ``shared-prefix``, ``multiturn``) is expanded once into a
:class:`Workload` before anything is sent, so every target gets the same bodies in the same order
and the ideal hit rate is a property of the prompts alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcore.block_keys import block_keys
from kvbench.capacity import capacity_hit_rate


@dataclass
class BenchRequest:
    """One request of a workload.

    ``endpoint``: ``"completions"`` or ``"chat"`` (``/v1/completions`` or ``/v1/chat/completions``);
    ``body``: the OpenAI body without ``model``/``stream``/``max_tokens`` (the runner adds them);
    ``prompt_token_ids``: the prompt exactly as vLLM tokenizes ``body``; ``output_tokens``: tokens to
    generate (sent as ``max_tokens`` with ``ignore_eos``); ``arrival_s``: send time from the start
    under trace timing, None when the arrival process decides; ``after``: index of a request that
    must have finished before this one is sent (the previous turn of a conversation), or None;
    ``group``: the conversation / prefix group / trace session it belongs to (for reports).
    """

    index: int
    endpoint: str
    body: dict[str, Any]
    prompt_token_ids: list[int]
    output_tokens: int
    arrival_s: float | None = None
    after: int | None = None
    group: str = ""


@dataclass
class Workload:
    """The expanded workload. ``block_size``: the engine's block size in tokens, the granularity
    of the ideal hit rate; ``params``: how it was made (goes into the JSON report)."""

    name: str
    requests: list[BenchRequest]
    block_size: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    def ideal_cached_tokens(self) -> list[int]:
        """Per request, in order: the tokens an infinite prefix cache shared by all workers would
        serve (see :func:`ideal_cached_tokens`)."""
        return ideal_cached_tokens([r.prompt_token_ids for r in self.requests], self.block_size)

    def ideal_hit_rate(self) -> float:
        """Ideal cached tokens / prompt tokens over the whole workload (0 for an empty one)."""
        total = self.prompt_tokens
        return sum(self.ideal_cached_tokens()) / total if total else 0.0

    def distinct_blocks(self) -> int:
        """Distinct full blocks over all prompts: the KV blocks a cache needs to hold everything."""
        seen: set[int] = set()
        for r in self.requests:
            seen.update(block_keys(r.prompt_token_ids, self.block_size, "bench"))
        return len(seen)

    def capacity_hit_rate(self, capacity_blocks: int) -> float:
        """The most any router could hit when the whole cluster holds ``capacity_blocks`` KV
        blocks (:func:`kvbench.capacity.capacity_hit_rate`: Belady's eviction on one shared
        cache), at most :meth:`ideal_hit_rate`. Raises ValueError on a negative capacity."""
        return capacity_hit_rate([r.prompt_token_ids for r in self.requests], self.block_size, capacity_blocks)

    def summary(self, capacity_blocks: int | None = None) -> dict[str, Any]:
        """Shape of the workload for the JSON report (``ideal_hit_rate`` included); with
        ``capacity_blocks`` (KV blocks of all workers together) also ``capacity_blocks`` and
        ``capacity_hit_rate`` (:meth:`capacity_hit_rate`)."""
        n = len(self.requests)
        out = {"name": self.name, **self.params, "requests": n, "block_size": self.block_size,
               "prompt_tokens": self.prompt_tokens,
               "mean_prompt_tokens": self.prompt_tokens / n if n else 0.0,
               "total_output_tokens": sum(r.output_tokens for r in self.requests),
               "distinct_blocks": self.distinct_blocks(), "ideal_hit_rate": self.ideal_hit_rate()}
        if capacity_blocks is not None:
            out["capacity_blocks"] = capacity_blocks
            out["capacity_hit_rate"] = self.capacity_hit_rate(capacity_blocks)
        return out


def ideal_cached_tokens(prompts: list[list[int]], block_size: int) -> list[int]:
    """For each prompt in send order, the tokens a cache that never evicts and is shared by every
    worker would serve: the longest run of its full blocks, from block 0, that an earlier prompt
    also had, capped as vLLM caps a hit (at least the last prompt token is computed, so at most
    ``(len - 1) // block_size`` blocks; vLLM 0.32 ``KVCacheManager.get_computed_blocks``).

    ``prompts``: token id lists; ``block_size`` > 0 tokens. Returns ints, multiples of block_size.
    """
    seen: set[int] = set()
    out = []
    for ids in prompts:
        keys = block_keys(ids, block_size, "bench")
        hit = 0
        while hit < len(keys) and keys[hit] in seen:
            hit += 1
        out.append(min(hit, (len(ids) - 1) // block_size) * block_size if ids else 0)
        seen.update(keys)
    return out
