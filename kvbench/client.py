"""One streamed OpenAI request, timed: the client side of ``kvroute bench``.

What is measured, per request (times from a monotonic clock, in ms):

- TTFT: from sending the request to the first SSE event carrying generated text (a chat stream's
  role-only first chunk does not count; vLLM sends it with the first token, some servers before);
- ITL: the gaps between successive text-carrying events after the first;
- end-to-end latency: to the end of the stream;
- ``prompt_tokens``, ``cached_tokens`` (``usage.prompt_tokens_details.cached_tokens``, the prefix
  hit vLLM reports with ``--enable-prompt-tokens-details``) and ``completion_tokens`` from the
  usage chunk (``stream_options.include_usage``);
- the worker that served it: the ``x-kvroute-worker`` response header when the router sets one.

The agent APIs stream their own events: ``/v1/messages`` (Anthropic: text in ``content_block_delta``;
``prompt_tokens`` = ``input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``
(vLLM's ``_build_anthropic_usage`` takes both out of ``input_tokens``), the cached part being
``cache_read_input_tokens``, from ``message_start`` and ``message_delta``; ends with ``message_stop``) and
``/v1/responses`` (text in ``response.output_text.delta``; usage's ``input_tokens``,
``input_tokens_details.cached_tokens`` and ``output_tokens`` from ``response.completed``, which
ends it).

An HTTP status other than 200, an error event in the stream, a stream without ``[DONE]`` or a
transport error makes an error record (``error`` set), never an exception.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from kvbench.workload import BenchRequest

WORKER_HEADER = "x-kvroute-worker"
REQUEST_ID_PREFIX = "bench-"  # x-request-id bench-<workload index>-<random>: the gateway's decision log keys


@dataclass
class RequestRecord:
    """The outcome of one request. ``start_s``: send time from the start of the run;
    ``*_ms`` None when not reached; ``status``: HTTP status (0 on a transport error)."""

    index: int
    group: str
    start_s: float
    status: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: str | None = None
    error: str | None = None
    cached_reported: bool = False  # usage carried prompt_tokens_details.cached_tokens

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["itl_ms"] = [round(x, 3) for x in self.itl_ms]
        return d


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
         "responses": "/v1/responses"}


def request_body(req: BenchRequest, model: str) -> dict[str, Any]:
    """The JSON body sent for ``req``: its body plus model, streaming with usage, and exactly
    ``output_tokens`` tokens (``max_tokens`` with vLLM's ``ignore_eos``). The agent APIs send no
    ``ignore_eos``: vLLM's Messages API has none, and routers with OpenAI's strict Responses schema
    (smg) refuse the field, so an answer may end early at EOS (Responses' ``max_output_tokens``)."""
    if req.endpoint == "messages":
        return {"model": model, **req.body, "max_tokens": req.output_tokens, "stream": True}
    if req.endpoint == "responses":
        return {"model": model, **req.body, "max_output_tokens": req.output_tokens, "stream": True}
    return {"model": model, **req.body, "max_tokens": req.output_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def _agent_event(rec: RequestRecord, event: dict) -> tuple[bool, bool]:
    """Read one Messages or Responses stream event into ``rec``: ``(carries text, ends the
    stream)``. An ``error`` event sets ``rec.error``."""
    kind = event.get("type")
    if kind == "error" or kind == "response.failed":
        rec.error = f"stream error: {str(event.get('error') or event.get('response'))[:300]}"
        return False, True
    if kind in ("message_start", "message_delta"):
        usage = (event.get("message") or {}).get("usage") if kind == "message_start" else event.get("usage")
        if isinstance(usage, dict):
            cached = usage.get("cache_read_input_tokens")
            if usage.get("input_tokens") is not None:
                rec.prompt_tokens = (int(usage["input_tokens"]) + int(cached or 0)
                                     + int(usage.get("cache_creation_input_tokens") or 0))
            if cached is not None:
                rec.cached_tokens, rec.cached_reported = int(cached), True
            rec.completion_tokens = int(usage.get("output_tokens") or rec.completion_tokens)
        return False, False
    if kind == "response.completed":
        usage = (event.get("response") or {}).get("usage") or {}
        rec.prompt_tokens = int(usage.get("input_tokens") or 0)
        rec.completion_tokens = int(usage.get("output_tokens") or 0)
        details = usage.get("input_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            rec.cached_tokens, rec.cached_reported = int(details["cached_tokens"]), True
        return False, True
    if kind == "content_block_delta":
        return bool((event.get("delta") or {}).get("text")), False
    if kind == "response.output_text.delta":
        return bool(event.get("delta")), False
    return False, kind == "message_stop"


def _has_text(choices: list[dict]) -> bool:
    for c in choices:
        delta = c.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else c.get("text")
        if text or c.get("finish_reason"):
            return True
    return False


async def send(session: aiohttp.ClientSession, base_url: str, req: BenchRequest, model: str,
               start_s: float, timeout_s: float, headers: dict[str, str] | None = None) -> RequestRecord:
    """POST ``req`` to ``base_url`` (``http://host:port``, the OpenAI API under ``/v1``), read the
    stream to its end, return the record. The request carries ``x-request-id:
    bench-<workload index>-<random>``, so a kvroute gateway's decision log
    (``GET /admin/decisions``) names it. Never raises on HTTP or transport failures."""
    path = PATHS[req.endpoint]
    agent_api = req.endpoint in ("messages", "responses")
    rec = RequestRecord(index=req.index, group=req.group, start_s=start_s)
    request_id = f"{REQUEST_ID_PREFIX}{req.index}-{uuid.uuid4().hex[:12]}"
    t0 = time.monotonic()
    last_text_at: float | None = None
    done = False
    try:
        async with session.post(base_url + path, data=orjson.dumps(request_body(req, model)),
                                headers={"Content-Type": "application/json", "x-request-id": request_id,
                                         **(headers or {})},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            rec.status = resp.status
            rec.worker = resp.headers.get(WORKER_HEADER)
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = orjson.loads(payload)
                if not isinstance(event, dict):
                    rec.error = f"stream event is not a JSON object: {payload[:100]!r}"
                    break
                if agent_api:
                    text, done = _agent_event(rec, event)
                    now = time.monotonic()
                    if text:
                        if last_text_at is None:
                            rec.ttft_ms = 1000 * (now - t0)
                        else:
                            rec.itl_ms.append(1000 * (now - last_text_at))
                        last_text_at = now
                    if done or rec.error:
                        break
                    continue
                if "error" in event:
                    rec.error = f"stream error: {str(event['error'])[:300]}"
                    break
                now = time.monotonic()
                if _has_text(event.get("choices") or []):
                    if last_text_at is None:
                        rec.ttft_ms = 1000 * (now - t0)
                    else:
                        rec.itl_ms.append(1000 * (now - last_text_at))
                    last_text_at = now
                usage = event.get("usage")
                if isinstance(usage, dict) and usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
                        rec.cached_reported = True
    except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, ValueError, TypeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    rec.e2e_ms = 1000 * (time.monotonic() - t0)
    if rec.error is None and not done:
        rec.error = "stream ended without " + ("its last event" if agent_api else "[DONE]")
    return rec
