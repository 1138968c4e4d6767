"""Reading the worker's usage (``usage.prompt_tokens_details.cached_tokens``) from a response
without changing what the client gets, except in one documented case.

- Non-streamed responses: the gateway forwards the body bytes first, then parses a copy
  (:func:`cached_tokens_of_body`).
- Streams where the client asked for usage (``stream_options.include_usage``): bytes pass through
  untouched; :class:`UsageTap` keeps the last few KiB and parses the usage chunk at the end.
- Streams where it did not: the gateway asks the worker for usage (:func:`request_stream_usage`,
  the one place the request body is changed) and :class:`UsageStrip` removes that usage-only
  chunk (vLLM sends ``data: {..., "choices": [], "usage": {...}}`` before ``data: [DONE]``) so
  the client sees what it would have seen from vLLM. Every other byte is forwarded unchanged and
  in order; the only difference is that an SSE event split across two reads is held until its
  end arrives (vLLM writes each event in one piece, so this is rare).
"""
from __future__ import annotations

import re
from typing import Any

import orjson

_TAIL_BYTES = 16384
_USAGE = re.compile(rb'"usage":\s*\{')           # vLLM writes compact JSON; spaces tolerated
_USAGE_ONLY = re.compile(rb'"choices":\s*\[\s*\]')  # the usage chunk has no choices
_USAGE_OPTION = b',"stream_options":{"include_usage":true}'


def request_stream_usage(raw: bytes, body: dict[str, Any]) -> tuple[bytes, bool]:
    """``(body bytes to send, strip)`` for a streaming request. When the client did not ask for
    usage, the option is added: appended before the closing brace when ``stream_options`` is
    absent (no re-serialization), else the parsed body is re-serialized with
    ``include_usage: true``; ``strip`` is then True. Unchanged bytes and False otherwise."""
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_usage") is True:
        return raw, False
    if "stream_options" not in body:
        end = raw.rfind(b"}")
        if end > 0:
            return raw[:end] + _USAGE_OPTION + raw[end:], True
    new_opts = dict(opts) if isinstance(opts, dict) else {}
    new_opts["include_usage"] = True
    return orjson.dumps({**body, "stream_options": new_opts}), True


def cached_tokens_of_usage(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI / vLLM usage object), else None."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) else None


def cached_tokens_of_body(body: bytes) -> int | None:
    """Cached tokens from a non-streamed JSON response body, None when absent or unparsable."""
    if not _USAGE.search(body):
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return cached_tokens_of_usage(obj.get("usage")) if isinstance(obj, dict) else None


def _usage_of_event(event: bytes) -> dict[str, Any] | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and _USAGE.search(line):
            try:
                obj = orjson.loads(line[5:].strip())
            except orjson.JSONDecodeError:
                return None
            usage = obj.get("usage") if isinstance(obj, dict) else None
            return usage if isinstance(usage, dict) else None
    return None


class UsageTap:
    """Watches a stream passed through unchanged; :attr:`cached_tokens` after :meth:`finish`."""

    def __init__(self) -> None:
        self._tail = b""
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Returns ``chunk`` itself (to send); keeps a bounded copy of the stream's tail."""
        tail = self._tail + chunk
        self._tail = tail[-_TAIL_BYTES:] if len(tail) > _TAIL_BYTES else tail
        return chunk

    def finish(self) -> bytes:
        """End of stream: parse the last usage chunk seen; returns b"" (nothing held)."""
        for event in reversed(self._tail.split(b"\n\n")):
            if _USAGE.search(event):
                self.cached_tokens = cached_tokens_of_usage(_usage_of_event(event))
                break
        self._tail = b""
        return b""


class UsageStrip:
    """Forwards whole SSE events and drops the usage-only event the gateway asked for; its
    cached tokens land in :attr:`cached_tokens`."""

    def __init__(self) -> None:
        self._pending = b""
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send now (possibly b""): every complete event so far, minus the usage one."""
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n") + 2
        if cut == 1:
            self._pending = data
            return b""
        self._pending = data[cut:]
        done = data[:cut]
        if _USAGE_ONLY.search(done) and _USAGE.search(done):
            done = self._drop_usage_events(done)
        return done

    def _drop_usage_events(self, data: bytes) -> bytes:
        kept = []
        for event in data[:-2].split(b"\n\n"):
            if _USAGE_ONLY.search(event) and _USAGE.search(event):
                usage = _usage_of_event(event)
                if usage is not None:
                    self.cached_tokens = cached_tokens_of_usage(usage)
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def finish(self) -> bytes:
        """End of stream: whatever partial event is still held (normally b"")."""
        rest, self._pending = self._pending, b""
        return rest
