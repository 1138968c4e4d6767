"""Test helper: a worker that misbehaves in one way, on a raw asyncio TCP server (so it can break
HTTP itself). ``GET /health`` always answers 200 (so the gateway keeps it healthy); every other
request gets the ``--mode``:

- ``hang``: read the request, never answer (a wedged server);
- ``stall``: answer 200 ``text/event-stream`` headers and one event, then nothing (a stream
  that stops mid-way);
- ``garbage``: answer bytes that are not HTTP;
- ``status``: answer ``--status`` (default 429) with ``Retry-After: 7`` and a vLLM-shaped error
  (a worker shedding load);
- ``slow``: hold each ``POST`` ``--hold-s`` seconds (or the body's ``"test_hold_s"``), then
  answer a one-token chat completion; ``GET /stats`` answers ``{"active", "max_active",
  "served"}`` (requests held now, the most held at once, answered), ``GET /metrics`` an empty
  page (a worker with admission limits to check: how many requests reached it at once).

Run: ``python tests/bad_worker.py --port P --mode M``; it exits by itself after ``--life-s``.
"""
from __future__ import annotations

import argparse
import asyncio
import json

STATS = {"active": 0, "max_active": 0, "served": 0}
COMPLETION = {"id": "chatcmpl-slow", "object": "chat.completion", "created": 0, "model": "tiny",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

STALL_EVENT = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'


def _response(status: int, body: bytes, content_type: bytes = b"application/json",
              extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (status, content_type, len(body), extra)
            + body)


async def _slow(method: str, path: str, body: bytes, hold_s: float) -> bytes:
    if method == "GET" and path == "/stats":
        return _response(200, json.dumps(STATS).encode())
    if method != "POST":
        return _response(200, b"", b"text/plain")
    try:
        hold_s = float(json.loads(body).get("test_hold_s", hold_s))
    except (ValueError, AttributeError):
        pass
    STATS["active"] += 1
    STATS["max_active"] = max(STATS["max_active"], STATS["active"])
    try:
        await asyncio.sleep(hold_s)
    finally:
        STATS["active"] -= 1
    STATS["served"] += 1
    return _response(200, json.dumps(COMPLETION).encode())


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mode: str, status: int,
                  hold_s: float) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length) if length else b""
            if path == "/health":
                writer.write(_response(200, b"{}"))
            elif mode == "slow":
                writer.write(await _slow(method, path, body, hold_s))
            elif mode == "hang":
                await asyncio.sleep(3600)
            elif mode == "stall":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                             + b"%x\r\n%s\r\n" % (len(STALL_EVENT), STALL_EVENT))
                await writer.drain()
                await asyncio.sleep(3600)
            elif mode == "garbage":
                writer.write(b"\x00\x01 this is not HTTP \xff\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            else:
                body = json.dumps({"error": {"message": "server busy", "type": "ServiceUnavailableError",
                                             "param": None, "code": status}}).encode()
                writer.write(_response(status, body, extra=b"retry-after: 7\r\n"))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _main(port: int, mode: str, status: int, life_s: float, hold_s: float) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, mode, status, hold_s), "127.0.0.1", port)
    async with server:
        await asyncio.sleep(life_s)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=["hang", "stall", "garbage", "status", "slow"], required=True)
    p.add_argument("--status", type=int, default=429)
    p.add_argument("--life-s", type=float, default=600.0)
    p.add_argument("--hold-s", type=float, default=2.0)
    a = p.parse_args()
    asyncio.run(_main(a.port, a.mode, a.status, a.life_s, a.hold_s))
