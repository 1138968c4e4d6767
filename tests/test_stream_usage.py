"""The gateway's one change to a request body (asking a stream for usage) and its undoing, on
streams captured from vLLM 0.32 (tests/fixtures/vllm_streams: the same request with and without
``stream_options.include_usage``; the e2e suite checks the same against a live vLLM).
"""
from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.relay.stream_usage import UsageStrip, UsageTap, request_stream_usage

STREAMS = Path(__file__).parent / "fixtures" / "vllm_streams"
_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def masked(stream: bytes) -> bytes:
    """``stream`` with every ``id`` and ``created`` value blanked (they differ per request)."""
    return _VOLATILE.sub(rb'"\1":0', stream)


def _body(**fields) -> tuple[bytes, dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    return orjson.dumps(body), body


# (stream_options as the client sent it, or "absent") -> stream_options sent upstream, or None: unchanged
ASKED = [
    ("absent", {"include_usage": True}),
    (None, {"include_usage": True, "continuous_usage_stats": False}),
    ({}, {"include_usage": True, "continuous_usage_stats": False}),
    ({"include_usage": False}, {"include_usage": True, "continuous_usage_stats": False}),
    ({"continuous_usage_stats": True}, {"include_usage": True, "continuous_usage_stats": False}),
    ({"continuous_usage_stats": False}, {"include_usage": True, "continuous_usage_stats": False}),
    ({"include_usage": False, "continuous_usage_stats": True},
     {"include_usage": True, "continuous_usage_stats": False}),
    ({"include_usage": False, "continuous_usage_stats": False},
     {"include_usage": True, "continuous_usage_stats": False}),
    ({"include_usage": True}, None),
    ({"include_usage": True, "continuous_usage_stats": True}, None),
    ({"include_usage": True, "continuous_usage_stats": False}, None),
    ({"include_usage": "yes"}, None),          # vLLM coerces or refuses: never guessed
    ({"include_usage": 0}, None),
    ({"continuous_usage_stats": "true"}, None),
    ("not an object", None),                   # vLLM's own 400 must come back
]


@pytest.mark.parametrize("client,upstream", ASKED, ids=[str(a[0]) for a in ASKED])
def test_usage_is_asked_for_only_when_the_client_would_get_none(client, upstream):
    raw, body = _body() if client == "absent" else _body(stream_options=client)
    out, strip = request_stream_usage(raw, body)
    if upstream is None:
        assert (out, strip) == (raw, False)
        return
    assert strip
    sent = orjson.loads(out)
    assert sent["stream_options"] == upstream
    assert {k: v for k, v in sent.items() if k != "stream_options"} == {
        k: v for k, v in body.items() if k != "stream_options"}


@pytest.mark.parametrize("fields", [{"n": 2}, {"n": 3, "stream_options": {"include_usage": False}}])
def test_several_choices_are_never_changed(fields):
    raw, body = _body(**fields)
    assert request_stream_usage(raw, body) == (raw, False)


@pytest.mark.parametrize("prompt,changed", [("hi", True), ([1, 2, 3], True), (["hi"], True), ([[1, 2]], True),
                                            (["a", "b"], False), ([[1], [2]], False)])
def test_completions_with_several_prompts_are_never_changed(prompt, changed):
    body = {"model": "tiny", "prompt": prompt, "stream": True}
    raw = orjson.dumps(body)
    out, strip = request_stream_usage(raw, body)
    assert strip is changed and (out != raw) is changed


@pytest.mark.parametrize("kind", ["chat", "cmpl"])
@pytest.mark.parametrize("cut", [1, 9, 100, 100000])
def test_strip_gives_the_client_vllms_stream_without_usage(kind, cut):
    """vLLM 0.32 moves ``system_fingerprint`` from the terminal chunk to the usage chunk when usage
    is asked for: the strip must give it back, byte for byte, however the reads are cut."""
    with_usage = (STREAMS / f"{kind}_usage.sse").read_bytes()
    plain = (STREAMS / f"{kind}_plain.sse").read_bytes()
    assert b'"choices":[]' in with_usage and b"system_fingerprint" in plain  # the fixtures are what we think
    strip = UsageStrip()
    got = b"".join(strip.feed(with_usage[i:i + cut]) for i in range(0, len(with_usage), cut)) + strip.finish()
    assert masked(got) == masked(plain)
    assert strip.cached_tokens == 0


def test_strip_without_fingerprint_forwards_the_terminal_chunk_unchanged():
    """A server run with ``--fingerprint-mode none`` stamps no chunk: nothing is added."""
    with_usage = re.sub(rb',"system_fingerprint":"[^"]*"', b"", (STREAMS / "chat_usage.sse").read_bytes())
    strip = UsageStrip()
    got = strip.feed(with_usage) + strip.finish()
    events = with_usage.split(b"\n\n")
    assert got == b"\n\n".join(e for e in events if b'"choices":[]' not in e)
    assert b"system_fingerprint" not in got


def test_strip_holds_the_terminal_chunk_only_until_the_usage_chunk():
    plain_events = (STREAMS / "chat_usage.sse").read_bytes().split(b"\n\n")[:-1]
    terminal = next(e for e in plain_events if b'"finish_reason":"length"' in e) + b"\n\n"
    usage = next(e for e in plain_events if b'"choices":[]' in e) + b"\n\n"
    strip = UsageStrip()
    assert strip.feed(terminal) == b""  # held: its fingerprint comes with the usage chunk
    out = strip.feed(usage)
    assert out.endswith(b'"system_fingerprint":"vllm-0.32.0-ed75ccb3"}\n\n') and out.startswith(terminal[:-4])
    assert strip.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert strip.finish() == b""


def test_strip_flushes_a_held_chunk_when_no_usage_comes():
    terminal = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}\n\n'
    strip = UsageStrip()
    assert strip.feed(terminal) == b""
    assert strip.feed(b"data: [DONE]\n\n") == b""
    assert strip.finish() == terminal + b"data: [DONE]\n\n"
    assert strip.cached_tokens is None


def test_finish_reason_inside_generated_text_is_not_a_terminal_chunk():
    chunk = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"\\"finish_reason\\":\\"x\\""},"finish_reason":null}]}\n\n'
    strip = UsageStrip()
    assert strip.feed(chunk) == chunk


@pytest.mark.parametrize("eol", [b"\r\n", b"\r", b"\n"])
def test_strip_forwards_each_event_as_it_ends_for_any_sse_line_end(eol):
    """SSE allows CRLF, CR or LF line ends: each event is sent the moment its blank line arrives
    (the worker's timing), the usage event is dropped and the fingerprint still comes back."""
    events = (STREAMS / "chat_usage.sse").read_bytes().split(b"\n\n")[:-1]
    framed = [e + eol + eol for e in events]
    strip = UsageStrip()
    out = []
    for e in framed:
        out.append(strip.feed(e))
    out.append(strip.finish())
    plain = [e + eol + eol for e in (STREAMS / "chat_plain.sse").read_bytes().split(b"\n\n")[:-1]]
    assert masked(b"".join(out)) == masked(b"".join(plain))
    assert out[0] == framed[0] and out[1] == framed[1]  # content events: at once, unchanged
    assert strip.cached_tokens == 0


@pytest.mark.parametrize("events,cached", [
    # Anthropic (vLLM's /v1/messages): message_delta carries the final usage
    ([b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":9}}}\n\n',
      b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
      b'"usage":{"input_tokens":4,"output_tokens":2,"cache_read_input_tokens":64}}\n\n',
      b'event: message_stop\ndata: {"type":"message_stop"}\n\n'], 64),
    # OpenAI Responses: response.completed carries the response, its usage inside
    ([b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1","usage":null}}\n\n',
      b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1",'
      b'"usage":{"input_tokens":80,"input_tokens_details":{"cached_tokens":32},"output_tokens":2}}}\n\n'], 32),
])
def test_the_tap_reads_the_agent_apis_stream_usage(events, cached):
    tap = UsageTap()
    out = b"".join(tap.feed(e) for e in events) + tap.finish()
    assert out == b"".join(events) and tap.cached_tokens == cached


@settings(max_examples=200, deadline=None)
@given(eol=st.sampled_from([b"\r\n", b"\r", b"\n"]), cuts=st.lists(st.integers(0, 4000), max_size=12),
       extra_newlines=st.lists(st.integers(0, 3), min_size=0, max_size=30))
def test_strip_output_does_not_depend_on_how_the_stream_is_cut(eol, cuts, extra_newlines):
    """However the worker's bytes are cut into reads (inside events, at line ends, between the two
    line ends of an event's end, with blank lines between events), the client gets the same bytes:
    the one-read result, which is vLLM's stream without usage."""
    events = (STREAMS / "chat_usage.sse").read_bytes().split(b"\n\n")[:-1]
    stream = b"".join(e + eol + eol + eol * (extra_newlines[i] if i < len(extra_newlines) else 0)
                      for i, e in enumerate(events))
    whole = UsageStrip()
    want = whole.feed(stream) + whole.finish()
    strip = UsageStrip()
    bounds = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    got = b"".join(strip.feed(stream[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a) + strip.finish()
    assert got == want and strip.cached_tokens == whole.cached_tokens == 0
    assert b'"choices":[]' not in got and b"[DONE]" in got


def test_a_read_ending_inside_a_crlf_pair_holds_the_event_until_the_lf():
    """A read that ends with the ``\\r`` of an event's last ``\\r\\n``: the event is not complete
    yet (the next read begins with its ``\\n``), so the dropped usage event leaves no stray
    ``\\n`` behind (a case the cut-anywhere property found)."""
    events = (STREAMS / "chat_usage.sse").read_bytes().split(b"\n\n")[:-1]
    stream = b"".join(e + b"\r\n\r\n" for e in events)
    whole = UsageStrip()
    want = whole.feed(stream) + whole.finish()
    usage_end = stream.index(b"data: [DONE]")
    strip = UsageStrip()
    got = strip.feed(stream[:usage_end - 1]) + strip.feed(stream[usage_end - 1:]) + strip.finish()
    assert got == want and got.endswith(b'"}\r\n\r\ndata: [DONE]\r\n\r\n')
    assert b'"choices":[]' not in got and strip.cached_tokens == 0


def test_the_tap_keeps_a_bounded_tail_of_a_long_stream():
    """A long stream (3,000 token events, ~300 KB) in reads of one event: the tap holds about its
    last 16 KiB (plus one read), not the stream, and finds the usage at its end."""
    from router.relay.stream_usage import _TAIL_BYTES
    token = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"%d","finish_reason":null}]}\n\n'
    usage = (b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":90,"completion_tokens":3000,'
             b'"prompt_tokens_details":{"cached_tokens":48}}}\n\n')
    tap = UsageTap()
    held = 0
    for i in range(3000):
        assert tap.feed(token % i) == token % i
        held = max(held, tap._tail_bytes)
    tap.feed(usage)
    tap.feed(b"data: [DONE]\n\n")
    assert _TAIL_BYTES <= held < _TAIL_BYTES + len(token % 2999)
    assert tap.finish() == b"" and tap.cached_tokens == 48
