"""OpenAI Responses bodies and stream events as vLLM 0.32 writes them for a model without
Harmony (``vllm/entrypoints/openai/responses/serving.py``, ``streaming_events.py``), for the
simulator's ``/v1/responses``.

A stream is ``response.created``, ``response.in_progress``, then with the first token
``response.output_item.added`` (the assistant message) and ``response.content_part.added``
(its ``output_text`` part), one ``response.output_text.delta`` per token, then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
``response.completed`` carrying the whole response with its usage. Every event is an SSE
``event:`` line and JSON ``data`` with ``type`` and a ``sequence_number`` counting from 0.
"""
from __future__ import annotations

from typing import Any

import orjson


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, cache_write_tokens: int = 0) -> dict[str, Any]:
    """vLLM 0.32's ``ResponseUsage`` for a one-turn answer (``responses/protocol.py``: its
    per-turn lists stay empty outside tool-calling contexts, and are serialized)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": cache_write_tokens,
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt_tokens + output_tokens}


def message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                   "logprobs": []}]
    return {"type": "message", "id": f"msg_{rid[5:]}", "role": "assistant", "status": status, "content": content}


def response(rid: str, created: int, model: str, status: str, output: list[dict[str, Any]],
             use: dict[str, Any] | None) -> dict[str, Any]:
    """The response object (``status`` "in_progress" or "completed")."""
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "output": output, "usage": use}


class ResponseStream:
    """The events of one streamed response, numbered in order."""

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.sequence = 0
        self.text = ""

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        out = b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
            {"type": kind, "sequence_number": self.sequence, **data}) + b"\n\n"
        self.sequence += 1
        return out

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        head = response(self.rid, self.created, self.model, "in_progress", [], None)
        return self._event("response.created", {"response": head}) + self._event("response.in_progress",
                                                                                {"response": head})

    def first_token(self) -> bytes:
        """The message item and its text part, announced before the first delta."""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self._event("response.output_item.added",
                            {"output_index": 0, "item": message_item(self.rid, "", "in_progress")})
                + self._event("response.content_part.added",
                              {"output_index": 0, "item_id": f"msg_{self.rid[5:]}", "content_index": 0,
                               "part": part}))

    def delta(self, piece: str) -> bytes:
        self.text += piece
        return self._event("response.output_text.delta", {"output_index": 0, "item_id": f"msg_{self.rid[5:]}",
                                                          "content_index": 0, "delta": piece, "logprobs": []})

    def end(self, use: dict[str, Any]) -> bytes:
        """The done events and ``response.completed`` with ``use``."""
        item = message_item(self.rid, self.text, "completed")
        item_id = item["id"]
        return (self._event("response.output_text.done", {"output_index": 0, "item_id": item_id,
                                                          "content_index": 0, "text": self.text, "logprobs": []})
                + self._event("response.content_part.done", {"output_index": 0, "item_id": item_id,
                                                            "content_index": 0, "part": item["content"][0]})
                + self._event("response.output_item.done", {"output_index": 0, "item": item})
                + self._event("response.completed", {"response": response(
                    self.rid, self.created, self.model, "completed", [item], use)}))
