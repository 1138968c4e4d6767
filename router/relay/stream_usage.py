"""Reading the worker's usage (``usage.prompt_tokens_details.cached_tokens``) from a response
without changing what the client gets. This module holds the gateway's only change to a request
body and its undoing.

- Non-streamed responses: the gateway forwards the body bytes first, then parses a copy
  (:func:`cached_tokens_of_body`).
- Streams where the client asked for usage (``stream_options.include_usage`` true): bytes pass
  through untouched; :class:`UsageTap` keeps the last few KiB and parses the usage chunk at the end.
- Streams of one sequence (``n`` 1, one prompt) where it did not: the gateway asks the worker for
  usage (:func:`request_stream_usage`: ``include_usage`` true, ``continuous_usage_stats`` false)
  and :class:`UsageStrip` undoes what that changes in vLLM's stream (0.32,
  ``vllm/entrypoints/openai/{chat_completion,completion}/serving.py``, ``should_include_usage``):
  (1) the usage-only chunk ``data: {..., "choices": [], "usage": {...}}`` before ``data: [DONE]``
  is removed; (2) vLLM stamps ``system_fingerprint`` on the terminal chunk (the one with a
  ``finish_reason``) only when no usage chunk follows, and on the usage chunk otherwise: the
  terminal chunk is held until the usage chunk arrives (the next event) and gets the usage
  chunk's fingerprint as its last field, where vLLM puts it. Every other byte is forwarded
  unchanged, in order, as it arrives; an SSE event split across two reads is held until its end
  arrives (vLLM writes each event in one piece, so this is rare), for any line ending SSE allows.
- Anything else (``n`` > 1, several prompts, ``stream_options`` values vLLM would coerce or
  refuse): the body goes unchanged and the client's stream is only tapped. Holding one
  sequence's terminal chunk would delay the other sequences' tokens, and guessing vLLM's
  coercions could change the answer: those requests are not measured.
"""
from __future__ import annotations

import re
from collections import deque
from typing import Any

import orjson

_TAIL_BYTES = 16384
_USAGE = re.compile(rb'"usage":\s*\{')           # vLLM writes compact JSON; spaces tolerated
_USAGE_ONLY = re.compile(rb'"choices":\s*\[\s*\]')  # the usage chunk has no choices
_FINISHED = re.compile(rb'(?<!\\)"finish_reason":\s*"')  # a terminal chunk (not null; not in text)
_FINGERPRINT = re.compile(rb'(?<!\\)"system_fingerprint":\s*("(?:[^"\\]|\\.)*")')
_USAGE_OPTION = b',"stream_options":{"include_usage":true}'
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")  # a line end, then an empty line


def _one_sequence(body: dict[str, Any]) -> bool:
    """True when the stream carries one sequence: ``n`` absent or 1, and one prompt (chat, a
    completions string, one token-id list, or a list of one of those)."""
    n = body.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt) == 1
    return True


def request_stream_usage(raw: bytes, body: dict[str, Any]) -> tuple[bytes, bool]:
    """``(body bytes to send, strip)`` for a streaming request (``raw``: its bytes, ``body``:
    parsed). When the client did not ask for usage and the stream carries one sequence, usage
    is asked for: ``,"stream_options":{"include_usage":true}`` appended before the closing brace
    when ``stream_options`` is absent (no re-serialization), else the body re-serialized with
    ``include_usage: true, continuous_usage_stats: false`` (per-chunk usage is gated by
    ``include_usage`` in vLLM, so the client would have had none); ``strip`` is then True. The
    unchanged bytes and False otherwise (see the module docstring)."""
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            return raw, False  # vLLM refuses it: its own 400 must reach the client
        include, continuous = opts.get("include_usage"), opts.get("continuous_usage_stats")
        if not (include is None or include is False) or not (continuous is None or isinstance(continuous, bool)):
            return raw, False  # usage asked for, or a value vLLM would coerce (0, "yes") or refuse
    if not _one_sequence(body):
        return raw, False
    if "stream_options" not in body:
        end = raw.rfind(b"}")
        if end > 0:
            return raw[:end] + _USAGE_OPTION + raw[end:], True
    new_opts = {**(opts or {}), "include_usage": True, "continuous_usage_stats": False}
    return orjson.dumps({**body, "stream_options": new_opts}), True


def cached_tokens_of_usage(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI chat / completions usage),
    ``usage.input_tokens_details.cached_tokens`` (Responses) or ``usage.cache_read_input_tokens``
    (Anthropic's, which vLLM fills from the same figure), else None."""
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("cache_read_input_tokens"), int):
        return usage["cache_read_input_tokens"]
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))  # chat / responses
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
    for line in event.splitlines():  # any SSE line end: LF, CRLF or CR
        if line.startswith(b"data:") and _USAGE.search(line):
            try:
                obj = orjson.loads(line[5:].strip())
            except orjson.JSONDecodeError:
                return None
            if not isinstance(obj, dict):
                return None
            usage = obj.get("usage")
            if usage is None and isinstance(obj.get("response"), dict):  # Responses: response.completed
                usage = obj["response"].get("usage")
            return usage if isinstance(usage, dict) else None
    return None


class UsageTap:
    """Watches a stream passed through unchanged; :attr:`cached_tokens` after :meth:`finish`."""

    def __init__(self) -> None:
        self._tail: deque[bytes] = deque()  # the last chunks, at least the stream's last _TAIL_BYTES
        self._tail_bytes = 0
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Returns ``chunk`` itself (to send); keeps the chunks that hold the stream's last
        ``_TAIL_BYTES`` (no copy: a long stream's tail is not rebuilt per chunk)."""
        tail = self._tail
        tail.append(chunk)
        self._tail_bytes += len(chunk)
        while self._tail_bytes - len(tail[0]) >= _TAIL_BYTES:
            self._tail_bytes -= len(tail.popleft())
        return chunk

    def finish(self) -> bytes:
        """End of stream: parse the last usage chunk within the stream's last ``_TAIL_BYTES``;
        returns b"" (nothing held)."""
        tail = b"".join(self._tail)[-_TAIL_BYTES:]
        for event in reversed(tail.split(b"\n\n")):
            if _USAGE.search(event):
                self.cached_tokens = cached_tokens_of_usage(_usage_of_event(event))
                break
        self._tail.clear()
        self._tail_bytes = 0
        return b""


class UsageStrip:
    """Forwards whole SSE events, drops the usage-only event the gateway asked for and gives its
    ``system_fingerprint`` back to the terminal event (module docstring); the usage's cached
    tokens land in :attr:`cached_tokens`."""

    def __init__(self) -> None:
        self._pending = b""
        self._held: list[bytes] = []  # the terminal event and any after it, until the usage event
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send now (possibly b""): every complete event so far, minus the usage one
        and the held ones."""
        data = self._pending + chunk if self._pending else chunk
        if data[-2:] == b"\n\n" and data[-3:-2] not in (b"\n", b"\r"):
            # ends exactly at an event's end (a match of _EVENT_END holds only line-end bytes, so
            # none can reach back past data[-3]): the whole of it is complete events
            events, done = None, data
            self._pending = b""
        else:
            events = _split_events(data)
            self._pending = events.pop()
            if not events:
                return b""
            done = b"".join(events)
        if not self._held and not _may_finish(done) and not (b'"usage":' in done and _USAGE_ONLY.search(done)
                                                             and _USAGE.search(done)):
            return done  # the common case: content events only
        if events is None:
            events = _split_events(data)[:-1]
        elif not self._pending and data[-1:] == b"\r":
            # the last event's terminator may go on: its final "\r" may be the first half of a
            # "\r\n" whose "\n" comes with the next read, and an event dropped or held now would
            # leave that "\n" behind alone; it waits for the next read
            self._pending = events.pop()
        return b"".join(self._event(e) for e in events)

    def _event(self, event: bytes) -> bytes:
        if _USAGE_ONLY.search(event) and _USAGE.search(event):
            usage = _usage_of_event(event)
            if usage is not None:
                self.cached_tokens = cached_tokens_of_usage(usage)
                found = _FINGERPRINT.search(event)
                held, self._held = self._held, []
                return b"".join(_with_fingerprint(e, found.group(1)) if found else e for e in held)
        if self._held or (_FINISHED.search(event) and not _FINGERPRINT.search(event)):
            self._held.append(event)
            return b""
        return event

    def finish(self) -> bytes:
        """End of stream: whatever is still held, unchanged (normally b"")."""
        rest = b"".join(self._held) + self._pending
        self._held, self._pending = [], b""
        return rest


def _may_finish(data: bytes) -> bool:
    """Whether :data:`_FINISHED` may match ``data``: False for certain when every
    ``"finish_reason":`` in it is followed by ``null`` (every content event of vLLM's), which two
    byte counts tell without the regex."""
    n = data.count(b'"finish_reason":')
    return n != 0 and n != data.count(b'"finish_reason":null') and _FINISHED.search(data) is not None


def _split_events(data: bytes) -> list[bytes]:
    """``data`` cut after each SSE event's end (a blank line, whatever the line ends: ``\\n``,
    ``\\r\\n`` or ``\\r``, as the SSE spec allows): the complete events, each with its
    terminator, then the incomplete rest (possibly b""). Joined, they are ``data``."""
    out = []
    start = 0
    for m in _EVENT_END.finditer(data):
        out.append(data[start:m.end()])
        start = m.end()
    out.append(data[start:])
    return out


def _with_fingerprint(event: bytes, fingerprint: bytes) -> bytes:
    """A terminal event with ``"system_fingerprint": fingerprint`` (a JSON string's bytes) as
    its JSON object's last field; other events (``[DONE]``) unchanged."""
    if not _FINISHED.search(event) or _FINGERPRINT.search(event):
        return event
    end = event.rfind(b"}")
    return event[:end] + b',"system_fingerprint":' + fingerprint + event[end:] if end > 0 else event
