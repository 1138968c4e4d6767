"""The peer client: pulls a prefix chain of KV blocks from another agent's :class:`PeerServer`
(wire format: :mod:`offload_agent.peer.protocol`).

Behaviour:

- :meth:`PeerClient.pull` never raises for network or peer problems; it returns a
  :class:`PullResult` whose ``blocks`` consecutive blocks from ``keys[0]`` were verified (checksum,
  key, index and fingerprint) and handed to ``on_block``, and whose ``error`` says why it stopped
  early. ``error`` starts with one of these kinds, then ``": "`` and details::

      miss        the peer does not hold the next block
      checksum    a payload's xxh3_64 differs from its frame's (corrupted in transit)
      deadline    ``deadline_s`` passed; the blocks that came by then are kept
      busy        the peer's concurrency limit (or connection limit) stayed full
      refused     the peer serves another fingerprint or block size, or rejected the request
      auth        secret missing on one side, wrong, or the peer could not prove it
      connection  connect failed or timed out, or the connection broke
      protocol    the peer broke the wire format (wrong key/index/fingerprint/length)
      source      the peer failed reading a block it holds

  A pull stops at the first missing or bad block: the blocks after it are useless (a prefix chain).
- Authentication: with a ``secret`` the client answers the server's challenge and requires the
  server's proof, so it only talks to servers that know the same secret (a server without one
  fails with ``auth``); without a secret it only talks to servers that require none.
- Lent blocks: a pull into a buffer (``into``) tells the server it takes blocks sent from the
  server's memory in place (REQUEST_LENT_OK); such a block is handed to ``on_block`` once the
  CHECKS frame that covers it has come and its checksum matched. When the server reports a lent
  block TORN (its owner rewrote it while it was sent), the pull asks again from that block on the
  same connection, at most ``MAX_TORN_RETRIES`` times (then ``source``).
- Connections: kept per address for the next pull (keep-alive, at most ``max_idle_per_peer``
  idle ones); one that broke, timed out mid-stream or carried a bad frame is closed. A pull on a
  kept connection that the server had closed meanwhile is retried once on a new one. Requests
  longer than the server's ``max keys`` go as several requests on the same connection.
- Links: :meth:`link_stats` keeps per-address measures over the pulls (see there).
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import ipaddress
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from offload_agent.peer import protocol as p
from offload_agent.peer.sockio import PeerClosed, SockIO

ERR_MISS = "miss"
ERR_CHECKSUM = "checksum"
ERR_DEADLINE = "deadline"
ERR_BUSY = "busy"
ERR_REFUSED = "refused"
ERR_AUTH = "auth"
ERR_CONNECTION = "connection"
ERR_PROTOCOL = "protocol"
ERR_SOURCE = "source"
# kinds that say something is wrong with the link or the peer (counted in link_stats' failures)
FAILURE_KINDS = frozenset({ERR_CHECKSUM, ERR_AUTH, ERR_CONNECTION, ERR_PROTOCOL, ERR_SOURCE})

_STATUS_KIND = {p.Status.MISS: ERR_MISS, p.Status.MISMATCH: ERR_REFUSED, p.Status.BUSY: ERR_BUSY,
                p.Status.BAD_REQUEST: ERR_REFUSED, p.Status.AUTH: ERR_AUTH, p.Status.VERSION: ERR_REFUSED,
                p.Status.SOURCE_ERROR: ERR_SOURCE}

_BLOCK_OK = p.FrameHeader(p.FrameType.BLOCK, p.Status.OK, 0)  # a BLOCK frame header as expected (fast path)
_LENT_OK = p.FrameHeader(p.FrameType.LENT_BLOCK, p.Status.OK, 0)
OnBlock = Callable[[int, memoryview], Awaitable[None] | None]

BANDWIDTH_MIN_SAMPLE_BYTES = 256 << 10  # smaller pulls say too little about bandwidth
BANDWIDTH_FULL_WEIGHT_BYTES = 4 << 20    # a pull this large counts fully in the average
EWMA_ALPHA = 0.3
DIRECT_READ_MIN_BYTES = 256 << 10  # blocks this large are received straight into ``into`` (smaller: staged)
MAX_TORN_RETRIES = 3  # a pull asks again from a torn lent block at most this often


@dataclass
class PullResult:
    """What one :meth:`PeerClient.pull` got: ``blocks`` consecutive blocks from ``keys[0]``
    received, verified and handed to ``on_block``; ``payload_bytes`` their bytes; ``seconds`` the
    pull's wall time; ``error`` None when every block came, else ``"<kind>: <details>"`` (kinds in
    the module docstring)."""

    blocks: int
    payload_bytes: int
    seconds: float
    error: str | None = None

    @property
    def kind(self) -> str | None:
        """The error's kind (``"miss"``, ``"deadline"``, ...), None without error."""
        return None if self.error is None else self.error.split(":", 1)[0]


class _PullError(Exception):
    def __init__(self, kind: str, detail: str, keep_conn: bool = False) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.keep_conn = keep_conn


class _Stale(Exception):
    """A kept connection the server had closed before our request."""


class _Torn(Exception):
    """The server reported a lent block torn (END TORN); ``blocks`` of the request came good."""

    def __init__(self, blocks: int) -> None:
        super().__init__(f"torn after {blocks} blocks")
        self.blocks = blocks


class _CallbackFailed(Exception):
    pass


class _Conn:
    def __init__(self, io: SockIO, max_keys: int) -> None:
        self.io = io
        self.max_keys = max_keys
        self.next_request_id = 1


class _Link:
    """Measures of one peer address (see :meth:`PeerClient.link_stats`)."""

    def __init__(self) -> None:
        self.pulls = 0
        self.failures = 0
        self.blocks = 0
        self.payload_bytes = 0
        self.last_error: str | None = None
        self._bw_num = 0.0
        self._bw_den = 0.0
        self.rtt_ms: float | None = None
        self.overhead_ms: float | None = None
        self.connect_ms: float | None = None

    @staticmethod
    def _ewma(old: float | None, sample: float) -> float:
        return sample if old is None else old + EWMA_ALPHA * (sample - old)

    def add_bandwidth(self, payload_bytes: int, seconds: float) -> None:
        if payload_bytes < BANDWIDTH_MIN_SAMPLE_BYTES or seconds <= 0:
            return
        a = EWMA_ALPHA * min(1.0, payload_bytes / BANDWIDTH_FULL_WEIGHT_BYTES)
        self._bw_num = (1 - a) * self._bw_num + a * payload_bytes / seconds
        self._bw_den = (1 - a) * self._bw_den + a

    @property
    def bytes_per_s(self) -> float | None:
        return self._bw_num / self._bw_den if self._bw_den > 0 else None


class _Pull:
    """The state of one pull across its requests."""

    def __init__(self, addr: str, fingerprint: bytes, block_bytes: int, keys: list[bytes], deadline: float,
                 on_block: OnBlock, into: memoryview | None, connect_timeout_s: float) -> None:
        self.addr = addr
        self.connect_timeout_s = connect_timeout_s
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.keys = keys
        self.deadline = deadline
        self.on_block = on_block
        self.into = into
        self.blocks = 0
        self.callback_exc: BaseException | None = None
        # time.perf_counter() marks for link_stats (loop.time() may tick in ms, as uvloop's does)
        self.first_frame_at: float | None = None
        self.last_block_at: float | None = None
        self.request_sent_at: float | None = None
        self.fallback: memoryview | None = None


def _parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {addr!r}: expected host:port")
    return host.strip("[]"), int(port)


class PeerClient:
    """Pulls blocks from peers; see the module docstring. ``secret``: the shared secret (bytes) or
    None; ``connect_timeout_s``: bound on TCP connect plus handshake (and the pull's deadline
    bounds it too); ``max_idle_per_peer``: connections kept per address. Use from one event loop."""

    def __init__(self, secret: bytes | None = None, connect_timeout_s: float = 1.0, *,
                 max_idle_per_peer: int = 2, staging_bytes: int = 1 << 20) -> None:
        if secret is not None and not secret:
            raise ValueError("an empty secret; pass None for no authentication")
        self.secret = bytes(secret) if secret is not None else None
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_peer = max_idle_per_peer
        self.staging_bytes = staging_bytes
        self._idle: dict[str, list[_Conn]] = {}
        self._links: dict[str, _Link] = {}

    # ---- public ----
    async def pull(self, addr: str, fingerprint_digest: bytes, block_bytes: int, keys: list[bytes],
                   deadline_s: float, on_block: OnBlock, *, into: memoryview | None = None,
                   connect_timeout_s: float | None = None) -> PullResult:
        """Pull the blocks of ``keys`` (16-byte tier keys, a prefix chain) from the peer at
        ``addr`` (``"host:port"``), stopping at the first missing or bad one or after
        ``deadline_s`` seconds from now.

        ``on_block(i, payload)`` is called for block i in order, only after its checksum, key and
        fingerprint were verified; ``payload`` (``block_bytes`` bytes) is valid only during the
        call; it may return an awaitable, which is awaited (and not cut by the deadline).
        ``connect_timeout_s``: this pull's bound on connect plus handshake (default: the client's).
        ``into`` (writable, at least ``len(keys) x block_bytes`` bytes): block i is received
        straight into ``into[i x block_bytes:]`` (no copy; ``payload`` is that view, valid after
        the call; the bytes of a block that failed its checksum are left there too). Returns a
        :class:`PullResult`. Raises ValueError for a malformed address, digest, key or block size,
        or a too small ``into``, and whatever ``on_block`` raises (the connection is then closed).
        """
        host_port = _parse_addr(addr)
        if len(fingerprint_digest) != p.DIGEST_BYTES:
            raise ValueError(f"fingerprint digest must be {p.DIGEST_BYTES} bytes")
        if not 1 <= block_bytes <= p.MAX_BLOCK_BYTES:
            raise ValueError(f"block_bytes must be 1..{p.MAX_BLOCK_BYTES}, got {block_bytes}")
        if any(len(k) != p.KEY_BYTES for k in keys):
            raise ValueError(f"tier keys must be {p.KEY_BYTES} bytes each")
        if into is not None:
            into = memoryview(into).cast("B")
            if into.nbytes < len(keys) * block_bytes or into.readonly:
                raise ValueError(f"into: {into.nbytes} bytes{' read-only' if into.readonly else ''}, "
                                 f"{len(keys)} blocks need {len(keys) * block_bytes}")
        loop = asyncio.get_running_loop()
        if not keys:
            return PullResult(0, 0, 0.0, None)
        t0 = time.perf_counter()
        link = self._links.setdefault(addr, _Link())
        st = _Pull(addr, bytes(fingerprint_digest), block_bytes, list(keys), loop.time() + deadline_s, on_block,
                   into, self.connect_timeout_s if connect_timeout_s is None else connect_timeout_s)
        error: str | None = None
        try:
            await self._pull(st, host_port, link)
        except _PullError as exc:
            error = str(exc)
        except _CallbackFailed:
            assert st.callback_exc is not None
            raise st.callback_exc from None
        seconds = time.perf_counter() - t0
        payload_bytes = st.blocks * block_bytes
        link.pulls += 1
        link.blocks += st.blocks
        link.payload_bytes += payload_bytes
        if error is not None:
            link.last_error = error
            if error.split(":", 1)[0] in FAILURE_KINDS:
                link.failures += 1
        if st.first_frame_at is not None and st.request_sent_at is not None:
            link.overhead_ms = link._ewma(link.overhead_ms, (st.first_frame_at - st.request_sent_at) * 1000)
        if st.blocks and st.last_block_at is not None and st.first_frame_at is not None:
            link.add_bandwidth(payload_bytes, st.last_block_at - st.first_frame_at)
        return PullResult(st.blocks, payload_bytes, seconds, error)

    def link_stats(self, addr: str) -> dict | None:
        """Measures of the link to ``addr`` over this client's pulls, None before any pull:
        ``bytes_per_s`` (payload bytes over the time from the first response frame to the last
        verified block, ``on_block`` included; a weighted EWMA where pulls under 256 KiB do not count
        and pulls under 4 MiB count in proportion to their size; None before such a pull),
        ``overhead_ms`` (EWMA of request sent to first response frame: round trip plus the peer's
        first read), ``rtt_ms`` (EWMA of the hello round trip), ``connect_ms`` (EWMA of TCP connect
        plus handshake), ``pulls``, ``failures`` (pulls ended by a checksum, auth, connection,
        protocol or source error), ``blocks``, ``payload_bytes``, ``last_error``."""
        link = self._links.get(addr)
        if link is None:
            return None
        return {"bytes_per_s": link.bytes_per_s, "overhead_ms": link.overhead_ms, "rtt_ms": link.rtt_ms,
                "connect_ms": link.connect_ms, "pulls": link.pulls, "failures": link.failures,
                "blocks": link.blocks, "payload_bytes": link.payload_bytes, "last_error": link.last_error}

    async def close(self) -> None:
        """Close the kept connections (pulls in progress close their own)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.io.close()
        self._idle.clear()

    # ---- connections ----
    async def _connect(self, st: _Pull, host: str, port: int, link: _Link) -> _Conn:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        limit = min(st.deadline, loop.time() + st.connect_timeout_s)
        try:
            async with asyncio.timeout_at(limit):
                sock = await self._open_socket(host, port)
        except TimeoutError:
            raise self._timeout_error(st, "connect timed out") from None
        except OSError as exc:
            raise _PullError(ERR_CONNECTION, f"connect to {st.addr}: {exc}") from None
        io = SockIO(sock, self.staging_bytes)
        io.deadline = limit
        try:
            conn = await self._handshake(io, link)
        except TimeoutError:
            io.close()
            raise self._timeout_error(st, "handshake timed out") from None
        except _PullError:
            io.close()
            raise
        except (PeerClosed, OSError) as exc:
            io.close()
            raise _PullError(ERR_CONNECTION, f"handshake with {st.addr}: {exc}") from None
        except p.FrameError as exc:
            io.close()
            raise _PullError(ERR_PROTOCOL, f"handshake with {st.addr}: {exc}") from None
        link.connect_ms = link._ewma(link.connect_ms, (time.perf_counter() - t0) * 1000)
        return conn

    def _timeout_error(self, st: _Pull, what: str) -> _PullError:
        if asyncio.get_running_loop().time() >= st.deadline:
            return _PullError(ERR_DEADLINE, f"{what} at the pull's deadline")
        return _PullError(ERR_CONNECTION, f"{what} after {st.connect_timeout_s} s ({st.addr})")

    @staticmethod
    async def _open_socket(host: str, port: int) -> socket.socket:
        loop = asyncio.get_running_loop()
        try:
            ip = ipaddress.ip_address(host)
            infos = [(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM, 0, "",
                      (host, port))]
        except ValueError:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        last: OSError = OSError(f"no address for {host}")
        for family, type_, proto, _, sockaddr in infos:
            sock = socket.socket(family, type_, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, sockaddr)
            except OSError as exc:
                sock.close()
                last = exc
                continue
            except BaseException:
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        raise last

    async def _handshake(self, io: SockIO, link: _Link) -> _Conn:
        client_nonce = os.urandom(p.NONCE_BYTES)
        t0 = time.perf_counter()
        await io.send(p.encode_hello(client_nonce))
        head = p.decode_frame_header(await io.read_exact(p.FRAME_HEADER_BYTES))
        if head.type is not p.FrameType.HELLO_REPLY:
            raise p.FrameError(f"{head.type.name} instead of HELLO_REPLY")
        body = await io.read_exact(head.body_bytes)
        link.rtt_ms = link._ewma(link.rtt_ms, (time.perf_counter() - t0) * 1000)
        if head.status is not p.Status.OK:
            kind = ERR_BUSY if head.status is p.Status.BUSY else ERR_REFUSED
            raise _PullError(kind, f"peer answered hello with {head.status.name}")
        hello = p.decode_hello_reply(body)
        if hello.auth_required and self.secret is None:
            raise _PullError(ERR_AUTH, "the peer requires a shared secret and this client has none")
        if self.secret is not None:
            if not hello.auth_required:
                raise _PullError(ERR_AUTH, "the peer requires no secret, so it cannot prove it knows ours")
            await io.send(p.encode_auth(p.client_proof(self.secret, hello.server_nonce, client_nonce)))
            head = p.decode_frame_header(await io.read_exact(p.FRAME_HEADER_BYTES))
            if head.type is not p.FrameType.AUTH_REPLY:
                raise p.FrameError(f"{head.type.name} instead of AUTH_REPLY")
            proof = bytes(await io.read_exact(head.body_bytes))
            if head.status is not p.Status.OK:
                raise _PullError(ERR_AUTH, f"the peer refused our proof ({head.status.name})")
            if not hmac.compare_digest(proof, p.server_proof(self.secret, client_nonce, hello.server_nonce)):
                raise _PullError(ERR_AUTH, "the peer's proof is wrong: it does not know our secret")
        return _Conn(io, hello.max_keys)

    def _checkin(self, addr: str, conn: _Conn) -> None:
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self.max_idle_per_peer:
            conn.io.deadline = None
            idle.append(conn)
        else:
            conn.io.close()

    def _checkout_idle(self, addr: str) -> _Conn | None:
        idle = self._idle.get(addr)
        while idle:
            conn = idle.pop()
            if not conn.io.at_eof_or_junk():
                return conn
            conn.io.close()
        return None

    # ---- pulling ----
    async def _pull(self, st: _Pull, host_port: tuple[str, int], link: _Link) -> None:
        conn = self._checkout_idle(st.addr)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(st, *host_port, link)
        keep = False
        torn = 0
        try:
            pos = 0
            while pos < len(st.keys):
                chunk = st.keys[pos:pos + conn.max_keys]
                try:
                    try:
                        await self._request(conn, st, pos, chunk, first_on_conn=reused and pos == 0)
                    except _Stale:
                        conn.io.close()
                        reused = False
                        st.request_sent_at = None
                        conn = await self._connect(st, *host_port, link)
                        await self._request(conn, st, pos, chunk, first_on_conn=False)
                except _Torn as exc:
                    torn += 1
                    if torn > MAX_TORN_RETRIES:
                        raise _PullError(ERR_SOURCE, f"block {pos + exc.blocks} from {st.addr} changed while sent, "
                                                     f"{torn} times", keep_conn=True) from None
                    pos += exc.blocks
                    continue
                pos += len(chunk)
            keep = True
        except _PullError as exc:
            keep = exc.keep_conn
            raise
        except TimeoutError:
            raise _PullError(ERR_DEADLINE, f"{st.blocks} of {len(st.keys)} blocks came in time") from None
        except PeerClosed as exc:
            raise _PullError(ERR_CONNECTION, f"{exc} after {st.blocks} blocks") from None
        except OSError as exc:
            raise _PullError(ERR_CONNECTION, f"{exc!r} after {st.blocks} blocks") from None
        except p.FrameError as exc:
            raise _PullError(ERR_PROTOCOL, str(exc)) from None
        finally:
            if keep:
                self._checkin(st.addr, conn)
            else:
                conn.io.close()

    @staticmethod
    async def _accept(st: _Pull, index: int, payload: memoryview, checksum: int) -> None:
        """Verify block ``index`` of the pull against ``checksum``, give it to ``on_block`` and
        count it. Raises _PullError (checksum), _CallbackFailed, TimeoutError (the deadline passed
        with blocks still to come)."""
        if p.payload_checksum(payload) != checksum:
            raise _PullError(ERR_CHECKSUM, f"block {index} from {st.addr}: checksum mismatch")
        try:
            r = st.on_block(index, payload)
            if r is not None and inspect.isawaitable(r):
                await r
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            st.callback_exc = exc
            raise _CallbackFailed() from None
        st.blocks += 1
        st.last_block_at = time.perf_counter()
        if st.blocks < len(st.keys) and asyncio.get_running_loop().time() >= st.deadline:
            raise TimeoutError

    async def _request(self, conn: _Conn, st: _Pull, offset: int, chunk: list[bytes], first_on_conn: bool) -> None:
        """One REQUEST for ``chunk`` (keys ``offset..``) and its response. Raises _PullError,
        _Stale (only when ``first_on_conn`` and nothing came), _Torn (END TORN: the connection stays
        usable), TimeoutError (deadline), PeerClosed, OSError, FrameError."""
        io = conn.io
        io.deadline = st.deadline
        # with a destination, large payloads go straight into it: read no further than asked
        io.read_ahead = st.into is None or st.block_bytes < DIRECT_READ_MIN_BYTES
        rid = conn.next_request_id
        conn.next_request_id = (rid + 1) & 0xFFFFFFFF
        bb = st.block_bytes
        flags = p.REQUEST_LENT_OK if st.into is not None else 0  # lent blocks wait in ``into`` for their checks
        try:
            await io.send(p.encode_request(rid, st.fingerprint, bb, chunk, flags))
            if st.request_sent_at is None:
                st.request_sent_at = time.perf_counter()
            raw = await io.read_exact(p.FRAME_HEADER_BYTES)
        except (PeerClosed, ConnectionError) as exc:
            if first_on_conn:
                raise _Stale() from exc
            raise
        if st.first_frame_at is None:
            st.first_frame_at = time.perf_counter()
        i = 0        # blocks of this request verified and handed on
        landed = 0   # blocks of this request received (lent ones may wait for their checks)
        block_frame = p.encode_frame_header(p.FrameType.BLOCK, p.Status.OK, p.BLOCK_HEAD_BYTES + bb)
        lent_frame = p.encode_frame_header(p.FrameType.LENT_BLOCK, p.Status.OK, p.BLOCK_HEAD_BYTES + bb)
        while True:
            if raw == block_frame:
                head = _BLOCK_OK
            elif raw == lent_frame:
                head = _LENT_OK
            else:
                head = p.decode_frame_header(raw, block_bytes=bb)
            if head.type is p.FrameType.END:
                end = p.decode_end(await io.read_exact(head.body_bytes))
                if end.request_id != rid or end.blocks != i:
                    raise p.FrameError(f"END for request {end.request_id} with {end.blocks} blocks, "
                                       f"expected request {rid} with {i}")
                if head.status is p.Status.TORN:
                    raise _Torn(i)
                if landed != i:
                    raise p.FrameError(f"END {head.status.name} before the checks of blocks {i}..{landed - 1}")
                if head.status is p.Status.OK:
                    if i != len(chunk):
                        raise p.FrameError(f"END OK after {i} of {len(chunk)} blocks")
                    return
                keep = head.status in p.KEEPALIVE_STATUSES
                kind = _STATUS_KIND[head.status]
                if head.status is p.Status.MISS:
                    detail = f"block {offset + i} not held by {st.addr}"
                else:
                    detail = f"{head.status.name} from {st.addr} at block {offset + i}"
                raise _PullError(kind, f"{detail}: {end.reason}" if end.reason else detail, keep_conn=keep)
            if head.type is p.FrameType.CHECKS:
                if st.into is None:
                    raise p.FrameError("CHECKS in answer to a request that took no lent blocks")
                c_rid, c_first, sums = p.decode_checks(await io.read_exact(head.body_bytes))
                if c_rid != rid or c_first != i or i + len(sums) > landed:
                    raise p.FrameError(f"CHECKS of request {c_rid} for blocks {c_first}.. (+{len(sums)}), "
                                       f"expected request {rid} from block {i}, {landed - i} waiting")
                for checksum in sums:
                    await self._accept(st, offset + i, st.into[(offset + i) * bb:(offset + i + 1) * bb], checksum)
                    i += 1
                raw = await io.read_exact(p.FRAME_HEADER_BYTES)
                continue
            lent = head.type is p.FrameType.LENT_BLOCK
            if not lent and head.type is not p.FrameType.BLOCK:
                raise p.FrameError(f"unexpected {head.type.name} frame in a response")
            if lent and st.into is None:
                raise p.FrameError("LENT_BLOCK in answer to a request that took no lent blocks")
            if not lent and landed != i:
                raise p.FrameError(f"BLOCK {landed} before the checks of blocks {i}..{landed - 1}")
            b_rid, b_index, b_fp, b_key, b_checksum = p.BLOCK_HEAD.unpack(await io.read_exact(p.BLOCK_HEAD_BYTES))
            if b_rid != rid or b_index != landed or landed >= len(chunk):
                raise p.FrameError(f"BLOCK {b_index} of request {b_rid}, expected {landed} of {rid}")
            if b_key != chunk[landed]:
                raise _PullError(ERR_PROTOCOL, f"block {offset + landed}: the peer sent key {b_key.hex()}, "
                                               f"not {chunk[landed].hex()}")
            if b_fp != st.fingerprint:
                raise _PullError(ERR_PROTOCOL, f"block {offset + landed}: another fingerprint")
            if st.into is not None:
                payload = st.into[(offset + landed) * bb:(offset + landed + 1) * bb]
                await io.read_into(payload)
            else:
                if st.fallback is None:
                    st.fallback = memoryview(bytearray(bb))
                payload = await io.read_payload(bb, st.fallback)
            landed += 1
            if not lent:
                await self._accept(st, offset + i, payload, b_checksum)
                i += 1
            raw = await io.read_exact(p.FRAME_HEADER_BYTES)
