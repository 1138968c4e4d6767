"""The local link between a vLLM worker's KV connector and its offload agent: one Unix socket.

Every message, each way, is a frame: a 4-byte big-endian length, that many bytes of a UTF-8 JSON
object (the header, at most :data:`MAX_HEADER_BYTES`), then ``header["payload_bytes"]`` raw bytes
when that key is present and > 0. The connector asks, the agent answers, one request at a time per
connection. Requests (``op``) and answers:

``hello`` ``{"op": "hello", "role": "scheduler"|"worker", "pid": int, "block_bytes": int,
"fingerprint": {TierFingerprint fields}, "fingerprint_digest": hex, "shard": {"tp_rank",
"tp_size", "pp_rank", "pp_size"}, "engine_digest": hex, "engine_block_bytes": int}``
    -> ``{"ok": true, "worker_id", "shm_path", "num_slots", "ssd_dir" (str or null),
    "ssd_tier_bytes", "peer_pull": bool}``. ``block_bytes`` and ``fingerprint_digest`` are this
    KV shard's; ``engine_digest`` (16 bytes) is the same for every shard of the engine and its
    scheduler; ``engine_block_bytes`` is one block summed over all shards (the CPU tier holds
    ``num_slots`` = its bytes // ``engine_block_bytes`` blocks, in every shard's file). Without
    ``"shard"`` (older connectors): shard tp 0/1, pp 0/1 with ``engine_digest`` =
    ``fingerprint_digest``. A worker's hello makes (or reuses) its shard's CPU tier file
    ``shm_path`` (:mod:`offload_agent.tiers.shm_slab`); a scheduler's hello (shard tp 0, pp 0)
    makes none and gets shard (0, 0)'s path, which may not exist yet. The connector maps it,
    writes its SSD files in ``ssd_dir`` and pulls from peers only when ``peer_pull``.
``locate`` ``{"op": "locate", "start_block": s, "max_blocks": n, "cache_salt": str|null,
"payload_bytes": 4 x tokens}`` + the prompt's token ids ``[0, (s + n) x block_size)`` as
little-endian uint32
    -> ``{"ok": true, "peer": worker id or null, "blocks": m}``: a peer's agent holds blocks
    ``s .. s + m - 1`` of this prompt (by the cluster index), m <= n.
``pull`` ``{"op": "pull", "peer": id, "deadline_ms": x, "fingerprint_digest": hex,
"payload_bytes": 16 x k}`` + k tier keys (``fingerprint_digest``: the asking shard's, absent:
shard (0, 0); a shard that said no hello: ``ok`` false)
    -> ``{"ok": true, "blocks": j, "error": str|null, "payload_bytes": j x block_bytes}`` + the
    bytes of the first j blocks, each verified by the agent (checksum, key, fingerprint); j < k
    with ``error`` saying why the rest did not come (the connector recomputes them).

Any failure answers ``{"ok": false, "error": "..."}``. Standard library only (the connector side
runs in vLLM's interpreter).
"""
from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

MAX_HEADER_BYTES = 1 << 20
_LEN = struct.Struct(">I")


class AgentLinkError(Exception):
    """The agent did not answer (absent, gone, too slow) or answered nonsense."""


def encode_frame(header: dict[str, Any], payload: bytes | memoryview | None = None) -> list[bytes | memoryview]:
    """The byte pieces of one frame (header's ``payload_bytes`` set from ``payload``)."""
    if payload is not None:
        header = {**header, "payload_bytes": memoryview(payload).nbytes}
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    pieces: list[bytes | memoryview] = [_LEN.pack(len(raw)) + raw]
    if payload is not None and memoryview(payload).nbytes:
        pieces.append(memoryview(payload).cast("B"))
    return pieces


def header_length(prefix: bytes) -> int:
    """The header length a frame's 4-byte prefix announces; AgentLinkError beyond
    :data:`MAX_HEADER_BYTES`."""
    n = _LEN.unpack(prefix)[0]
    if n > MAX_HEADER_BYTES:
        raise AgentLinkError(f"header of {n} bytes")
    return n


def decode_header(raw: bytes) -> dict[str, Any]:
    """Parse a header; AgentLinkError unless it is a JSON object with a sane ``payload_bytes``."""
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise AgentLinkError(f"bad header: {exc}") from exc
    if not isinstance(header, dict):
        raise AgentLinkError("header is not a JSON object")
    n = header.get("payload_bytes", 0)
    if not isinstance(n, int) or n < 0:
        raise AgentLinkError(f"bad payload_bytes {n!r}")
    return header


class AgentLink:
    """The connector's blocking client of its agent's socket ``path``; reconnects after a
    failure. ``timeout_s``: default per-call limit. Once a ``hello`` has been answered, every
    new connection starts with that hello again, so an agent that restarted (and reopened the CPU
    tier file it left) knows the layout before the next request. Not thread-safe (one per
    connector side)."""

    def __init__(self, path: str, timeout_s: float = 2.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._hello: dict[str, Any] | None = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise AgentLinkError(f"agent socket {self.path}: {exc}") from exc
            self._sock = sock
        return self._sock

    def _recv_exact(self, sock: socket.socket, out: memoryview, deadline: float) -> None:
        got = 0
        while got < out.nbytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline")
            sock.settimeout(left)
            n = sock.recv_into(out[got:])
            if n == 0:
                raise EOFError("agent closed the connection")
            got += n

    def call(self, header: dict[str, Any], payload: bytes | memoryview | None = None,
             timeout_s: float | None = None, into: memoryview | None = None) -> dict[str, Any]:
        """Send one request, return the answer's header. Its payload is read into ``into`` (which
        must be large enough) or dropped. A kept connection found closed by the agent (it
        restarted) is replaced once, the hello first. Raises AgentLinkError on any failure (the
        connection is then closed: a late answer can never be taken for the next request's)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            kept = self._sock is not None
            try:
                answer = self._request(header, payload, deadline, into)
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, EOFError):
                if not kept:
                    raise
                self.close()  # a kept connection the agent closed (it restarted): once more, fresh
                answer = self._request(header, payload, deadline, into)
            if header.get("op") == "hello" and answer.get("ok"):
                self._hello = header
            return answer
        except AgentLinkError:
            self.close()
            raise
        except (OSError, ValueError, EOFError) as exc:
            self.close()
            raise AgentLinkError(f"agent socket {self.path}: {exc or type(exc).__name__}") from exc

    def _request(self, header: dict[str, Any], payload, deadline: float, into: memoryview | None) -> dict[str, Any]:
        """One request on the current connection; a new connection starts with the kept hello."""
        fresh = self._sock is None
        sock = self._connect()
        if fresh and self._hello is not None and header.get("op") != "hello":
            again = self._exchange(sock, self._hello, None, deadline, None)
            if not again.get("ok"):
                raise AgentLinkError(f"hello after reconnecting refused: {again.get('error')}")
        return self._exchange(sock, header, payload, deadline, into)

    def _exchange(self, sock: socket.socket, header: dict[str, Any], payload, deadline: float,
                  into: memoryview | None) -> dict[str, Any]:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        for piece in encode_frame(header, payload):
            sock.sendall(piece)
        head = bytearray(4)
        self._recv_exact(sock, memoryview(head), deadline)
        raw = bytearray(header_length(bytes(head)))
        self._recv_exact(sock, memoryview(raw), deadline)
        answer = decode_header(bytes(raw))
        size = answer.get("payload_bytes", 0)
        if size:
            sink = memoryview(bytearray(size)) if into is None or into.nbytes < size else into[:size]
            self._recv_exact(sock, sink, deadline)
        return answer
