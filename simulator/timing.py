"""How long a simulated engine step takes (wall seconds), from the ``kvroute sim`` timing flags.

One step runs the prefills admitted in it plus one decode token for every running request,
like vLLM's continuous batching with chunked prefill:

    step_ms = [prefill_overhead_ms + prefill_ms_per_token * uncached prompt tokens]  (if any prefill)
            + [decode_ms_per_token * (1 + (batch - 1) * DECODE_SLOWDOWN_PER_SEQ)]     (if any decode)

and the wall time is ``step_ms / speedup / 1000``. Defaults are roughly an 8B model on one H100.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFILL_OVERHEAD_MS = 25.0
DEFAULT_PREFILL_MS_PER_TOKEN = 0.2
DEFAULT_DECODE_MS_PER_TOKEN = 12.0
DECODE_SLOWDOWN_PER_SEQ = 1.0 / 64  # a batch of 65 decodes takes twice as long per step as 1


@dataclass(frozen=True)
class TimingModel:
    """Step-time model. All ``*_ms`` are simulated milliseconds; ``speedup`` divides them."""

    prefill_overhead_ms: float = DEFAULT_PREFILL_OVERHEAD_MS
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    decode_ms_per_token: float = DEFAULT_DECODE_MS_PER_TOKEN
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if min(self.prefill_overhead_ms, self.prefill_ms_per_token, self.decode_ms_per_token) < 0:
            raise ValueError("timing costs must be >= 0")

    def step_ms(self, prefill_tokens: int, num_prefills: int, num_decodes: int) -> float:
        """Simulated milliseconds of one step (before ``speedup``)."""
        ms = 0.0
        if num_prefills:
            ms += self.prefill_overhead_ms + self.prefill_ms_per_token * prefill_tokens
        if num_decodes:
            ms += self.decode_ms_per_token * (1.0 + (num_decodes - 1) * DECODE_SLOWDOWN_PER_SEQ)
        return ms

    def step_s(self, prefill_tokens: int, num_prefills: int, num_decodes: int) -> float:
        """Wall seconds of one step (after ``speedup``)."""
        return self.step_ms(prefill_tokens, num_prefills, num_decodes) / self.speedup / 1000.0
