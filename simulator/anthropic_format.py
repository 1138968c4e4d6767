"""Anthropic Messages response bodies and stream events as vLLM 0.32 writes them
(``vllm/entrypoints/anthropic/serving.py``, ``protocol.py``), for the simulator's ``/v1/messages``.

Usage: ``input_tokens`` is the prompt less its cached and cache-written tokens,
``cache_read_input_tokens`` the cached ones and ``cache_creation_input_tokens`` the ones written
to the prefix cache (the two only when prompt token details are on, as vLLM's
``_build_anthropic_usage``).
"""
from __future__ import annotations

from typing import Any

import orjson

# vLLM's finish reasons as Anthropic stop reasons
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int | None,
          created_cache_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic usage from vLLM's counts: ``input_tokens`` is the prompt less what was read from
    and written to the prefix cache (each only when known)."""
    out: dict[str, Any] = {"input_tokens": max(0, prompt_tokens - (cached_tokens or 0) - (created_cache_tokens or 0)),
                           "output_tokens": output_tokens}
    if cached_tokens is not None:
        out["cache_read_input_tokens"] = cached_tokens
    if created_cache_tokens is not None:
        out["cache_creation_input_tokens"] = created_cache_tokens
    return out


def message(rid: str, model: str, text: str, finish_reason: str, use: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed answer."""
    return {"id": rid, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
            "model": model, "stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None,
            "usage": use}


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One SSE event: ``event: <kind>`` and its JSON ``data`` (which repeats the kind as ``type``)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def stream_start(rid: str, model: str, use: dict[str, Any]) -> bytes:
    """``message_start`` and the text block's ``content_block_start``."""
    head = {"id": rid, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None, "usage": use}
    return (event("message_start", {"message": head})
            + event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))


def text_delta(piece: str) -> bytes:
    return event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})


def stream_end(finish_reason: str, use: dict[str, Any]) -> bytes:
    """``content_block_stop``, ``message_delta`` (stop reason, usage) and ``message_stop``."""
    return (event("content_block_stop", {"index": 0})
            + event("message_delta", {"delta": {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"),
                                                "stop_sequence": None}, "usage": use})
            + event("message_stop", {}))
