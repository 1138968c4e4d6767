"""The local link between a vLLM worker's KV connector and its offload agent: one Unix socket.

Every message, each way, is a frame: a 4-byte big-endian length, that many bytes of a UTF-8 JSON
object (the header, at most :data:`MAX_HEADER_BYTES`), then ``header["payload_bytes"]`` raw bytes
when that key is present and > 0. The connector asks, the agent answers, one request at a time per
connection. Requests (``op``) and answers:

``hello`` ``{"op": "hello", "role": "scheduler"|"worker", "pid": int, "block_bytes": int,
"fingerprint": {TierFingerprint fields}, "fingerprint_digest": hex, "shard": {"tp_rank",
"tp_size", "pp_rank", "pp_size"}, "engine_digest": hex, "engine_block_bytes": int}``
    -> ``{"ok": true, "worker_id", "shm_path", "num_slots", "ssd_dir" (str or null),
    "ssd_tier_bytes", "peer_pull": bool, "serves_peers": bool, "pull_path", "pull_bytes"}`` (the
    last two for a worker with peer pull: its shard's pull area, below; ``serves_peers``: the
    agent serves its tiers to peers, which a P/D prefill side needs). ``block_bytes`` and ``fingerprint_digest``
    are this KV shard's; ``engine_digest`` (16 bytes) is the same for every shard of the engine and its
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
``pull`` ``{"op": "pull", "peer": id, "deadline_ms": x, "connect_timeout_ms": y, "fingerprint_digest": hex,
"stream": true, "payload_bytes": 16 x k}`` + k tier keys (``fingerprint_digest``: the asking
shard's, absent: shard (0, 0); a shard that said no hello: ``ok`` false; ``connect_timeout_ms``:
the bound on reaching the peer's agent, absent: 1000)
    -> progress frames ``{"blocks": n}`` (no ``"ok"``; n grows, about every MiB) while the
    agent receives the blocks into the shard's *pull area*, then ``{"ok": true, "blocks": j,
    "error": str|null}``: blocks ``0 .. j-1`` lie verified (checksum, key, fingerprint) at
    ``[i x block_bytes, (i + 1) x block_bytes)`` of the pull area; j < k with ``error`` saying
    why the rest did not come (``"<kind>: ..."`` as :class:`offload_agent.peer.client.PullResult`,
    or ``room: ...`` when the keys do not all fit the area: the connector recomputes them).
    Without ``"stream"`` (older connectors) no progress frames, and the answer carries
    ``"payload_bytes": j x block_bytes`` + the blocks' bytes.

The pull area is a shared memory file the agent makes at a worker's hello (the hello's answer then
adds ``"pull_path"`` and ``"pull_bytes"``: :func:`create_pull_area`), one per shard, written
only by the agent and only during a pull of that shard (one at a time), so the connector reads
blocks there between a progress frame and its next request without a copy through the socket
(:meth:`AgentLink.pull` maps it; the area's memory can be registered for DMA).

Any failure answers ``{"ok": false, "error": "..."}``. Standard library only (the connector side
runs in vLLM's interpreter).
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from offload_agent.tiers.shm_slab import reserve

MAX_HEADER_BYTES = 1 << 20
READ_AHEAD_BYTES = 64 << 10  # the most a read of a frame's header takes from the socket at once
PULL_ANSWER_SLACK_S = 1.0  # how long past a pull's deadline the connector waits for the agent's answer
_LEN = struct.Struct(">I")


def pull_area_path(shm_path: str | os.PathLike) -> str:
    """The pull area file of the shard whose CPU tier file is ``shm_path``."""
    return f"{os.fspath(shm_path)}-pull"


def create_pull_area(path: str | os.PathLike, size_bytes: int) -> mmap.mmap:
    """The agent's side: map the pull area ``path`` of ``size_bytes`` (raw block bytes, no
    header), reusing a file of that size (a connector may have it mapped), else making a new one
    under that name (a mapping of the old one stays valid). Every page is reserved
    (``posix_fallocate``), so an area that does not fit in ``/dev/shm`` fails here, never as a
    bus error while a pull writes it. Raises OSError, ValueError for a size < 1."""
    if size_bytes < 1:
        raise ValueError(f"pull area of {size_bytes} bytes")
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDWR)
        if os.fstat(fd).st_size != size_bytes:
            os.close(fd)
            fd = -1
    except FileNotFoundError:
        fd = -1
    fresh = fd < 0
    tmp = f"{path}.{os.getpid()}.tmp"
    if fresh:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if fresh:
            os.ftruncate(fd, size_bytes)
        reserve(fd, size_bytes, f"the pull area {path}")
        area = mmap.mmap(fd, size_bytes)
        if fresh:
            os.replace(tmp, path)
        return area
    except BaseException:
        if fresh:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    finally:
        os.close(fd)


def map_pull_area(path: str | os.PathLike, size_bytes: int) -> mmap.mmap:
    """Map an existing pull area read-write. Raises OSError (FileNotFoundError), ValueError when
    the file is not ``size_bytes`` long."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != size_bytes:
            raise ValueError(f"pull area {os.fspath(path)}: {size} bytes, expected {size_bytes}")
        return mmap.mmap(fd, size_bytes)
    finally:
        os.close(fd)


class LinkPull(NamedTuple):
    """What :meth:`AgentLink.pull` got: ``blocks`` consecutive blocks from ``keys[0]``, verified
    by the agent; ``error`` None when every block came, else why the rest did not (the peer
    client's ``"<kind>: <details>"``, or the agent's or the link's trouble); ``view``: their bytes
    (``blocks x block_bytes``; in ``into``, or in the pull area when no ``into`` was given), None
    when no block came."""

    blocks: int
    error: str | None
    view: memoryview | None


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
        self._ahead = bytearray()  # bytes received beyond the frame parts read so far
        self._hello: dict[str, Any] | None = None
        self.hello_answer: dict[str, Any] | None = None  # the agent's last answer to our hello
        self._area: tuple[str, tuple[int, int], memoryview] | None = None  # path, (dev, inode), map

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._ahead.clear()  # what was read ahead belongs to that connection

    def connect(self) -> None:
        """Open the connection now rather than at the first call; AgentLinkError when the agent
        does not answer on ``path``."""
        self._connect()

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
        """Fill ``out``: from the bytes read ahead first, then straight from the socket."""
        got = min(len(self._ahead), out.nbytes)
        out[:got] = self._ahead[:got]
        del self._ahead[:got]
        while got < out.nbytes:
            sock.settimeout(self._left(deadline))
            n = sock.recv_into(out[got:])
            if n == 0:
                raise EOFError("agent closed the connection")
            got += n

    def _read_bytes(self, sock: socket.socket, n: int, deadline: float) -> bytes:
        """The next ``n`` bytes (a frame's small parts), reading ahead what the socket has."""
        while len(self._ahead) < n:
            sock.settimeout(self._left(deadline))
            chunk = sock.recv(READ_AHEAD_BYTES)
            if not chunk:
                raise EOFError("agent closed the connection")
            self._ahead += chunk
        out = bytes(self._ahead[:n])
        del self._ahead[:n]
        return out

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline")
        return left

    def call(self, header: dict[str, Any], payload: bytes | memoryview | None = None,
             timeout_s: float | None = None, into: memoryview | None = None) -> dict[str, Any]:
        """Send one request, return the answer's header. Its payload is read into ``into`` (which
        must be large enough) or dropped. A kept connection found closed by the agent (it
        restarted) is replaced once, the hello first. Raises AgentLinkError on any failure (the
        connection is then closed: a late answer can never be taken for the next request's)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            return self._request(header, payload, deadline, into)
        except AgentLinkError:
            self.close()
            raise
        except (OSError, ValueError, EOFError) as exc:
            self.close()
            raise AgentLinkError(f"agent socket {self.path}: {exc or type(exc).__name__}") from exc

    def _request(self, header: dict[str, Any], payload, deadline: float, into: memoryview | None) -> dict[str, Any]:
        """Send one request and read the first frame of its answer; a kept connection the agent
        closed (it restarted) is replaced once, and a new connection starts with the kept hello."""
        kept = self._sock is not None
        try:
            answer = self._send_and_read(header, payload, deadline, into)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, EOFError):
            if not kept:
                raise
            self.close()  # a kept connection the agent closed (it restarted): once more, fresh
            answer = self._send_and_read(header, payload, deadline, into)
        if header.get("op") == "hello" and answer.get("ok"):
            self._hello, self.hello_answer = header, answer
        return answer

    def _send_and_read(self, header: dict[str, Any], payload, deadline: float,
                       into: memoryview | None) -> dict[str, Any]:
        fresh = self._sock is None
        sock = self._connect()
        if fresh and self._hello is not None and header.get("op") != "hello":
            self._send(sock, self._hello, None, deadline)
            again = self._read_frame(sock, deadline, None)
            if not again.get("ok"):
                raise AgentLinkError(f"hello after reconnecting refused: {again.get('error')}")
            self.hello_answer = again
        self._send(sock, header, payload, deadline)
        return self._read_frame(sock, deadline, into)

    def _send(self, sock: socket.socket, header: dict[str, Any], payload, deadline: float) -> None:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        pieces = encode_frame(header, payload)
        if sum(memoryview(p).nbytes for p in pieces) <= READ_AHEAD_BYTES:
            pieces = [b"".join(pieces)]  # a small request in one send
        for piece in pieces:
            sock.sendall(piece)

    def _read_frame(self, sock: socket.socket, deadline: float, into: memoryview | None) -> dict[str, Any]:
        head_bytes = header_length(self._read_bytes(sock, 4, deadline))
        answer = decode_header(self._read_bytes(sock, head_bytes, deadline))
        size = answer.get("payload_bytes", 0)
        if size:
            sink = memoryview(bytearray(size)) if into is None or into.nbytes < size else into[:size]
            self._recv_exact(sock, sink, deadline)
        return answer

    # ---- pulls -------------------------------------------------------------------------------
    def pull_area(self) -> memoryview | None:
        """The mapped pull area of this link's shard (writable host memory, ``pull_bytes`` of the
        hello's answer; a caller may register it for DMA), None before a worker's hello or
        without peer pull. Mapped again when the agent has made a new one under the path. Raises
        OSError or ValueError when it cannot be mapped."""
        answer = self.hello_answer
        if not answer or not answer.get("pull_path"):
            return None
        path = answer["pull_path"]
        st = os.stat(path)
        ident = (st.st_dev, st.st_ino)
        if self._area is None or self._area[:2] != (path, ident):
            self._area = (path, ident, memoryview(map_pull_area(path, int(answer["pull_bytes"]))))
        return self._area[2]

    def pull(self, peer: str, keys: list[bytes], fingerprint_digest: bytes, deadline_ms: float,
             into: memoryview | None = None, on_blocks: Callable[[int], None] | None = None,
             connect_timeout_ms: float | None = None) -> LinkPull:
        """Have the agent pull ``keys`` (16-byte tier keys, a prefix chain) of this link's shard
        (``fingerprint_digest``, 16 bytes, the one its hello said) from ``peer`` (a worker id
        from ``locate``) within ``deadline_ms`` (the agent's connect and handshake with the peer
        within ``connect_timeout_ms``, default 1000). Needs an answered worker hello (its
        ``block_bytes`` sizes the blocks).

        The agent receives the blocks into this shard's pull area (:meth:`pull_area`) and says
        how many have landed as they come; ``on_blocks(n)`` is called with each new count (blocks
        ``0..n-1`` readable), after they are copied into ``into`` when given (writable, at least
        ``len(keys) x block_bytes`` bytes). Returns a :class:`LinkPull`; its ``view`` of the
        pull area is valid until the next pull on this link. Never raises for the agent's or the
        peer's trouble (the blocks so far and the error come back; a too small or read-only
        ``into``, no hello, an agent that is gone or too slow: ``blocks`` 0 or those that landed);
        raises what ``on_blocks`` raises (the connection is then closed)."""
        if self._hello is None or self._hello.get("role") != "worker":
            return LinkPull(0, "no worker hello on this link: the block size is unknown", None)
        if bytes(fingerprint_digest).hex() != self._hello.get("fingerprint_digest"):
            return LinkPull(0, "fingerprint_digest is not this link's shard (its hello's)", None)
        bb = int(self._hello["block_bytes"])
        dst = memoryview(into).cast("B") if into is not None else None
        if dst is not None and (dst.nbytes < len(keys) * bb or dst.readonly):
            return LinkPull(0, f"into: {dst.nbytes} bytes{' read-only' if dst.readonly else ''}, "
                               f"{len(keys)} blocks need {len(keys) * bb}", None)
        header = {"op": "pull", "peer": peer, "deadline_ms": deadline_ms, "stream": True,
                  "fingerprint_digest": bytes(fingerprint_digest).hex()}
        if connect_timeout_ms is not None:
            header["connect_timeout_ms"] = connect_timeout_ms
        deadline = time.monotonic() + deadline_ms / 1000 + PULL_ANSWER_SLACK_S
        landed, area = 0, None
        try:
            answer = self._request(header, memoryview(b"".join(keys)), deadline, None)
            while True:
                final = "ok" in answer  # else a progress frame
                if final and not answer["ok"]:
                    return LinkPull(0, str(answer.get("error")), None)
                blocks = min(int(answer["blocks"]), len(keys))
                if blocks > landed:
                    if area is None:
                        area = self.pull_area()
                    landed = self._take(area, blocks, landed, bb, dst, on_blocks)
                if final:
                    break
                answer = self._read_frame(self._connect(), deadline, None)
            error = answer.get("error")
        except (AgentLinkError, OSError, ValueError, EOFError, KeyError, TypeError) as exc:
            self.close()  # a late frame can never be read as the next request's answer
            error = f"agent: {exc or type(exc).__name__}"
        except BaseException:
            self.close()
            raise
        if not landed:
            return LinkPull(0, error, None)
        view = dst[:landed * bb] if dst is not None else area[:landed * bb]
        return LinkPull(landed, error, view)

    @staticmethod
    def _take(area: memoryview | None, blocks: int, landed: int, bb: int, dst: memoryview | None,
              on_blocks: Callable[[int], None] | None) -> int:
        """Blocks ``landed..blocks-1`` have landed: copy them into ``dst``, tell ``on_blocks``."""
        if area is None:
            raise AgentLinkError("the agent streams a pull but gave no pull area in its hello")
        if blocks * bb > area.nbytes:
            raise AgentLinkError(f"{blocks} blocks beyond the pull area of {area.nbytes} bytes")
        if dst is not None:
            dst[landed * bb:blocks * bb] = area[landed * bb:blocks * bb]
        if on_blocks is not None:
            on_blocks(blocks)
        return blocks
