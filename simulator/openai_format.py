"""Response bodies of the simulated server, in the shapes vLLM 0.32's OpenAI server sends.

- Non-streaming: ``text_completion`` / ``chat.completion`` objects with ``usage``
  (``prompt_tokens_details`` is ``{"cached_tokens": n}`` only with
  ``--enable-prompt-tokens-details``, else null).
- Streaming: Server-Sent Events ``b"data: {json}\\n\\n"`` per chunk, ``b"data: [DONE]\\n\\n"`` last.
  Chat streams open each choice with a ``{"role": "assistant", "content": ""}`` delta, sent with
  the first engine output (after the prefill, as vLLM's serving_chat does); the last token
  chunk of a choice carries its ``finish_reason`` (and ``system_fingerprint``, unless a usage
  chunk follows); with ``stream_options.include_usage`` a final chunk has ``"choices": []``, the
  usage and the fingerprint.
- Errors: ``{"error": {"message", "type", "param", "code"}}`` (vLLM's ``ErrorResponse``).
- ``kv_transfer_params``: null, except on a non-streaming answer to a P/D prefill leg
  (``do_remote_decode``), where it holds what the decode worker needs (:mod:`simulator.app`).
"""
from __future__ import annotations

from typing import Any

import orjson

SSE_DONE = b"data: [DONE]\n\n"
SYSTEM_FINGERPRINT = "kvroute-sim"
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body for an HTTP status."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


def sse(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None,
          created_cache_tokens: int | None = None) -> dict[str, Any]:
    """The ``usage`` object; ``cached_tokens`` None leaves ``prompt_tokens_details`` null;
    ``created_cache_tokens`` (chat only, as vLLM 0.32's chat serving adds it) joins the details."""
    details = None
    if cached_tokens is not None:
        details = {"cached_tokens": cached_tokens}
        if created_cache_tokens is not None:
            details["created_cache_tokens"] = created_cache_tokens
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": details}


def _head(rid: str, obj: str, created: int, model: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model}


def completion(rid: str, created: int, model: str, texts: list[str], reasons: list[str],
               use: dict[str, Any], kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Non-streaming ``/v1/completions`` body; ``texts[i]``/``reasons[i]`` per choice index."""
    body = _head(rid, "text_completion", created, model)
    body["choices"] = [{"index": i, "text": t, "logprobs": None, "finish_reason": r, "stop_reason": None,
                        "prompt_logprobs": None} for i, (t, r) in enumerate(zip(texts, reasons))]
    body.update(service_tier=None, system_fingerprint=SYSTEM_FINGERPRINT, usage=use,
                kv_transfer_params=kv_transfer_params)
    return body


def chat_completion(rid: str, created: int, model: str, texts: list[str], reasons: list[str],
                    use: dict[str, Any], kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Non-streaming ``/v1/chat/completions`` body."""
    body = _head(rid, "chat.completion", created, model)
    body["choices"] = [{"index": i, "message": {"role": "assistant", "content": t, "refusal": None,
                                                "annotations": None, "audio": None, "function_call": None,
                                                "tool_calls": [], "reasoning": None},
                        "logprobs": None, "finish_reason": r, "stop_reason": None}
                       for i, (t, r) in enumerate(zip(texts, reasons))]
    # vLLM 0.32's unstreamed chat usage also carries its null multimodal and completion details
    details = use.get("prompt_tokens_details")
    use = {**use, "prompt_tokens_details": None if details is None else {**details, "multimodal_tokens": None},
           "completion_tokens_details": None}
    body.update(service_tier=None, system_fingerprint=SYSTEM_FINGERPRINT, usage=use,
                prompt_logprobs=None, kv_transfer_params=kv_transfer_params)
    return body


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk for choice ``index``."""
    body = _head(rid, "text_completion", created, model)
    body["choices"] = [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
                        "stop_reason": None}]
    return body


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk`` for choice ``index``."""
    body = _head(rid, "chat.completion.chunk", created, model)
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    body["choices"] = [choice]
    return body


def usage_chunk(rid: str, obj: str, created: int, model: str, use: dict[str, Any]) -> dict[str, Any]:
    """The final ``include_usage`` chunk: no choices, the request's usage."""
    body = _head(rid, obj, created, model)
    body["choices"] = []
    body["usage"] = use
    body["system_fingerprint"] = SYSTEM_FINGERPRINT
    return body
