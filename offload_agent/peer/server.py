"""The peer server: serves this agent's KV blocks to other agents (wire format:
:mod:`offload_agent.peer.protocol`).

Behaviour:

- Handshake: each connection starts with HELLO; another magic or version gets HELLO_REPLY
  VERSION, more than ``max_connections`` open connections get HELLO_REPLY BUSY, both then closed.
  With a ``secret`` the server requires AUTH before any REQUEST (a wrong proof: AUTH_REPLY AUTH; a
  REQUEST first: END AUTH; both closed and counted in ``auth_failures``); without one it accepts
  anyone.
- Sources: one :class:`BlockSource`, or a :class:`BlockSources` (the agent's KV shards, each
  with its own fingerprint digest): a REQUEST is served from the source whose fingerprint digest
  equals the request's.
- Requests: a REQUEST whose fingerprint digest no source has, or whose block bytes differ from
  that source's, gets END MISMATCH. Otherwise it waits for one of ``max_concurrent`` slots, at
  most ``queue_wait_s`` (FIFO; with ``max_waiting`` requests already waiting, or after the wait,
  it gets END BUSY; a client that closed the connection meanwhile is dropped without reading
  anything for it).
  With a slot, when the client takes lent blocks (REQUEST flag ``REQUEST_LENT_OK``) and the
  source lends them (``lend_block``), the event loop sends blocks from the first straight from the
  source's memory as LENT_BLOCK frames, in ``sendmsg`` batches of about ``SEND_BATCH_BYTES``, then
  checksums each one and checks that the source did not change it meanwhile: a CHECKS frame for
  the good ones (it goes out with the next batch), END TORN at the first changed one. From the
  first block the source does not lend (or for every block, otherwise), a worker thread reads the
  blocks in order (``BlockSource.read_block``) into a ring of preallocated frames (``ring_bytes``)
  and checksums them, while the event loop sends the ready frames with one ``sendmsg`` (woken by
  the thread every ``WAKE_BYTES``, at the end, or before a read that may block). The
  first key the source lacks ends the request with END MISS (``blocks`` = the keys served); a
  source exception ends it with END SOURCE_ERROR. The slot is held until the reading thread ends,
  so at most ``max_concurrent`` threads ever read the source.
- Limits: frames outside the protocol's length bounds (REQUEST: at most ``max_keys`` keys) get END
  BAD_REQUEST and the connection is closed. The handshake and each request body or send must
  complete within ``io_timeout_s``; a connection idle for ``idle_timeout_s`` between requests is
  closed. A source read has no time limit (the client's deadline covers it).
- :meth:`close` stops accepting, closes every connection and returns without waiting for a
  source read in progress (it cannot be interrupted; its thread ends when the read returns).
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

from offload_agent.peer import protocol as p
from offload_agent.peer.sockio import PeerClosed, SockIO

log = logging.getLogger("kvroute.agent.peer")
# the reading thread wakes the waiting event loop once this much is ready (or the ring is full, or
# it is done, or before a read from the source that may take long)
WAKE_BYTES = 256 << 10
SEND_BATCH_BYTES = 1 << 20  # blocks lent in place go out in sendmsg batches of about this much


@runtime_checkable
class BlockSource(Protocol):
    """Where the server reads blocks from (the agent implements it over its shm slab and SSD folder).

    ``fingerprint_digest``: 16-byte layout digest (:meth:`TierFingerprint.digest`) of every block;
    ``block_bytes``: bytes of one block (all layers).
    """

    fingerprint_digest: bytes
    block_bytes: int

    def read_block(self, key: bytes, out: memoryview) -> bool:
        """Fill ``out`` (``block_bytes``, writable) with the bytes of the block of tier key ``key``
        (16 B), consistently; False when not held. May block (SSD read): the server calls it in a
        worker thread, from several threads at once (up to ``max_concurrent``)."""
        ...

    # Optional: ``lend_block(key) -> (view, unchanged) | None``, the block's bytes in place (a
    # view that stays mapped) and a callable that is True while those bytes have not changed since
    # the call; None: not lent (``read_block`` is then asked). Called on the event loop: it must
    # answer from what it knows, without blocking. And ``refresh()``, called in a worker thread
    # when the first key of a request is not lent, to bring what it knows up to date.


@runtime_checkable
class BlockSources(Protocol):
    """Several block sources, one per fingerprint digest (the agent's KV shards)."""

    def source_for(self, fingerprint_digest: bytes) -> BlockSource | None:
        """The source of blocks of ``fingerprint_digest`` (16 B), None when none; called on the
        event loop, must not block."""
        ...


class _OneSource:
    """A single :class:`BlockSource` as :class:`BlockSources`."""

    def __init__(self, source: BlockSource) -> None:
        if len(source.fingerprint_digest) != p.DIGEST_BYTES:
            raise ValueError(f"source fingerprint digest must be {p.DIGEST_BYTES} bytes")
        if not 1 <= source.block_bytes <= p.MAX_BLOCK_BYTES:
            raise ValueError(f"source block_bytes must be 1..{p.MAX_BLOCK_BYTES}, got {source.block_bytes}")
        self.source = source

    def source_for(self, fingerprint_digest: bytes) -> BlockSource | None:
        return self.source if fingerprint_digest == self.source.fingerprint_digest else None


class _Slots:
    """At most ``limit`` holders; FIFO waiters, at most ``max_waiting`` of them, each for a bounded time."""

    def __init__(self, limit: int, max_waiting: int) -> None:
        self.limit = limit
        self.max_waiting = max_waiting
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self, wait_s: float) -> bool:
        """Take a slot, waiting at most ``wait_s``; False when none came (the caller is busy)."""
        if self.active < self.limit and not self.waiting:
            self.active += 1
            return True
        if wait_s <= 0 or self.waiting >= self.max_waiting:
            return False
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(wait_s):
                await fut
            return True  # release() handed its slot over (active unchanged)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return True  # handed over just as the wait ran out: keep it
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            raise
        finally:
            fut.cancel()
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def release(self) -> None:
        """Give a slot back: to the first waiter still waiting, else to the pool."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Producer:
    """One request's blocks: a worker thread (:meth:`run`) reads and checksums them into a ring
    of ``slots`` whole BLOCK frames; the event loop (:meth:`stream`) sends the ready ones."""

    def __init__(self, loop: asyncio.AbstractEventLoop, source: BlockSource, req: p.Request,
                 ring: bytearray, slots: int, first: int = 0) -> None:
        self.loop = loop
        self.source = source
        self.req = req
        self.ring = ring
        self.view = memoryview(ring)
        self.slots = slots
        self.frame_bytes = p.BLOCK_PREFIX_BYTES + req.block_bytes
        self.first = first  # blocks before it were sent already
        self.cond = threading.Condition()
        self.produced = 0  # frames ready (written by the thread)
        self.sent = 0      # frames handed to the kernel (written by the loop)
        self.done = False
        self.stop = False
        self.status = p.Status.OK
        self.reason = ""
        self._waiter: asyncio.Future[None] | None = None

    # ---- worker thread ----
    def run(self) -> None:
        req, fb = self.req, self.frame_bytes
        i = 0
        try:
            for i in range(self.first, len(req.keys)):
                key = req.keys[i]
                with self.cond:
                    while self.produced - self.sent >= self.slots and not self.stop:
                        self.cond.wait()
                    if self.stop:
                        return
                    slot = self.produced % self.slots
                base = slot * fb
                with self.cond:  # the read may take long (a file): let the loop send what is ready
                    if self.produced > self.sent:
                        self._wake_locked()
                payload = self.view[base + p.BLOCK_PREFIX_BYTES:base + fb]
                if not self.source.read_block(key, payload):
                    self.status, self.reason = p.Status.MISS, f"block {i} ({key.hex()}) not held"
                    return
                checksum = p.payload_checksum(payload)
                p.pack_block_prefix_into(self.ring, base, req.request_id, i, req.fingerprint, key, checksum,
                                         req.block_bytes)
                with self.cond:
                    self.produced += 1
                    ready = self.produced - self.sent
                    if ready * fb >= WAKE_BYTES or ready >= self.slots or i + 1 == len(req.keys):
                        self._wake_locked()  # a batch worth a loop wake-up (else the next one is)
        except Exception as exc:  # the source failed: report it, never kill the server
            log.warning("peer source failed reading block %d: %r", i, exc)
            self.status, self.reason = p.Status.SOURCE_ERROR, f"source error at block {i}: {exc!r}"
        finally:
            with self.cond:
                self.done = True
                self._wake_locked()

    def _wake_locked(self) -> None:
        fut, self._waiter = self._waiter, None
        if fut is not None:
            try:
                self.loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    # ---- event loop ----
    async def stream(self, io: SockIO, io_timeout_s: float, on_sent) -> None:
        """Send frames as the thread readies them until it is done. Raises OSError/TimeoutError
        when the client is gone or too slow."""
        fb, slots = self.frame_bytes, self.slots
        while True:
            fut = None
            with self.cond:
                avail, done = self.produced - self.sent, self.done
                if not avail and not done:
                    fut = self.loop.create_future()
                    self._waiter = fut
            if avail:
                ready = (k % slots for k in range(self.sent, self.sent + avail))
                parts = [self.view[j * fb:(j + 1) * fb] for j in ready]
                io.deadline = self.loop.time() + io_timeout_s
                await io.send_parts(parts)
                with self.cond:
                    self.sent += avail
                    self.cond.notify()
                on_sent(avail)
            elif done:
                return
            else:
                await fut

    def request_stop(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()


class PeerServer:
    """Serves ``source``'s blocks on ``host:port`` (port 0: any free one); see the module docstring.
    ``source``: a :class:`BlockSource`, or :class:`BlockSources` to serve several fingerprints.

    ``secret``: shared secret (bytes) clients must prove, None to accept anyone;
    ``max_concurrent``: requests served at once (= source reading threads); ``max_keys``: most keys
    in one request (<= 65536); ``queue_wait_s``: how long a request waits for a slot before END
    BUSY (0: not at all); ``max_waiting``: most requests waiting at once (default 4 x
    max_concurrent); ``max_connections``: open connections; ``ring_bytes``: frames buffered per
    request (at least 2 frames); ``io_timeout_s``/``idle_timeout_s``: see the module docstring.
    Raises ValueError for a bad source or limit.
    """

    def __init__(self, source: BlockSource | BlockSources, host: str = "127.0.0.1", port: int = 0, *,
                 secret: bytes | None = None, max_concurrent: int = 4, max_keys: int = 4096,
                 queue_wait_s: float = 1.0, max_waiting: int | None = None, max_connections: int = 64,
                 ring_bytes: int = 4 << 20, io_timeout_s: float = 10.0, idle_timeout_s: float = 120.0) -> None:
        self.sources: BlockSources = source if isinstance(source, BlockSources) else _OneSource(source)
        if not 1 <= max_keys <= p.MAX_KEYS_LIMIT:
            raise ValueError(f"max_keys must be 1..{p.MAX_KEYS_LIMIT}, got {max_keys}")
        if max_concurrent < 1 or max_connections < 1:
            raise ValueError("max_concurrent and max_connections must be >= 1")
        if secret is not None and not secret:
            raise ValueError("an empty secret; pass None for no authentication")
        self.host = host
        self.port = port
        self.secret = bytes(secret) if secret is not None else None
        self.max_concurrent = max_concurrent
        self.max_keys = max_keys
        self.queue_wait_s = queue_wait_s
        self.max_connections = max_connections
        self.ring_bytes = ring_bytes
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._slots = _Slots(max_concurrent, 4 * max_concurrent if max_waiting is None else max_waiting)
        self._counts = {"connections": 0, "connections_open": 0, "connections_refused": 0, "requests": 0,
                        "blocks_served": 0, "bytes_served": 0, "misses": 0, "mismatches": 0, "busy": 0,
                        "bad_requests": 0, "auth_failures": 0, "source_errors": 0, "disconnects": 0,
                        "blocks_lent": 0, "torn": 0}
        self._free_rings: list[bytearray] = []
        self._lsock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self._executor: ThreadPoolExecutor | None = None
        self.address: tuple[str, int] | None = None

    # ---- lifecycle ----
    async def start(self) -> tuple[str, int]:
        """Bind and listen; returns the bound ``(host, port)``. Raises OSError (e.g. port in use)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        lsock = socket.create_server((self.host, self.port), family=family, backlog=128)
        lsock.setblocking(False)
        self._lsock = lsock
        self._executor = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="peer-read")
        host, port = lsock.getsockname()[:2]
        self.address = (host, port)
        self._accept_task = asyncio.create_task(self._accept_loop(lsock))
        return self.address

    async def close(self) -> None:
        """Stop accepting, close every connection; idempotent."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
            self._accept_task = None
        if self._lsock is not None:
            self._lsock.close()
            self._lsock = None
        tasks = list(self._conn_tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def stats(self) -> dict[str, int]:
        """Counters since start: ``connections`` (accepted), ``connections_open``,
        ``connections_refused`` (over max_connections), ``requests`` (decoded REQUEST frames),
        ``blocks_served``/``bytes_served`` (payload bytes handed to the kernel), ``misses``,
        ``mismatches``, ``busy``, ``bad_requests``, ``auth_failures``, ``source_errors``,
        ``disconnects`` (client gone mid-stream); gauges ``active`` (requests holding a slot,
        reading threads included) and ``waiting`` (requests waiting for one)."""
        return {**self._counts, "active": self._slots.active, "waiting": self._slots.waiting}

    # ---- connections ----
    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(lsock)
            except OSError as exc:  # e.g. out of file descriptors: back off a little
                log.warning("peer server accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve_connection(sock))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)

    async def _serve_connection(self, sock: socket.socket) -> None:
        io = SockIO(sock, staging_bytes=64 << 10)
        self._counts["connections"] += 1
        self._counts["connections_open"] += 1
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await self._session(io)
        except (PeerClosed, OSError, p.FrameError) as exc:  # TimeoutError is an OSError
            log.debug("peer connection ended: %r", exc)
        except Exception:  # a bug here must not go unnoticed, nor stop the server
            log.exception("peer connection failed")
        finally:
            self._counts["connections_open"] -= 1
            io.close()

    async def _send_end(self, io: SockIO, status: p.Status, request_id: int, blocks: int, reason: str) -> None:
        io.deadline = asyncio.get_running_loop().time() + self.io_timeout_s
        await io.send(p.encode_end(status, request_id, blocks, reason))

    async def _session(self, io: SockIO) -> None:
        loop = asyncio.get_running_loop()
        io.deadline = loop.time() + self.io_timeout_s
        head = p.decode_frame_header(await io.read_exact(p.FRAME_HEADER_BYTES))
        if head.type is not p.FrameType.HELLO:
            await io.send(p.encode_hello_reply(p.Status.BAD_REQUEST))
            return
        try:
            client_nonce = p.decode_hello(await io.read_exact(head.body_bytes))
        except p.VersionError:
            await io.send(p.encode_hello_reply(p.Status.VERSION))
            return
        if self._counts["connections_open"] > self.max_connections:
            self._counts["connections_refused"] += 1
            await io.send(p.encode_hello_reply(p.Status.BUSY))
            return
        server_nonce = os.urandom(p.NONCE_BYTES)
        await io.send(p.encode_hello_reply(p.Status.OK, self.secret is not None, server_nonce, self.max_keys))
        authed = self.secret is None
        while True:
            io.deadline = loop.time() + self.idle_timeout_s
            try:
                head = p.decode_frame_header(await io.read_exact(p.FRAME_HEADER_BYTES), max_keys=self.max_keys)
            except p.FrameError as exc:
                self._counts["bad_requests"] += 1
                await self._send_end(io, p.Status.BAD_REQUEST, 0, 0, str(exc))
                return
            io.deadline = loop.time() + self.io_timeout_s
            if head.type is p.FrameType.AUTH and self.secret is not None and not authed:
                proof = bytes(await io.read_exact(head.body_bytes))
                if not hmac.compare_digest(proof, p.client_proof(self.secret, server_nonce, client_nonce)):
                    self._counts["auth_failures"] += 1
                    await io.send(p.encode_auth_reply(p.Status.AUTH))
                    return
                authed = True
                await io.send(p.encode_auth_reply(p.Status.OK, p.server_proof(self.secret, client_nonce, server_nonce)))
            elif head.type is p.FrameType.REQUEST:
                body = await io.read_payload(head.body_bytes, memoryview(bytearray(head.body_bytes)))
                try:
                    req = p.decode_request(body)
                except p.FrameError as exc:
                    self._counts["bad_requests"] += 1
                    await self._send_end(io, p.Status.BAD_REQUEST, 0, 0, str(exc))
                    return
                self._counts["requests"] += 1
                if not authed:
                    self._counts["auth_failures"] += 1
                    await self._send_end(io, p.Status.AUTH, req.request_id, 0, "authenticate first")
                    return
                await self._serve_request(io, req)
            else:
                self._counts["bad_requests"] += 1
                await self._send_end(io, p.Status.BAD_REQUEST, 0, 0, f"unexpected {head.type.name} frame")
                return

    # ---- one request ----
    async def _serve_request(self, io: SockIO, req: p.Request) -> None:
        source = self.sources.source_for(req.fingerprint)
        block_bytes = source.block_bytes if source is not None else 0
        if source is None or req.block_bytes != block_bytes:
            self._counts["mismatches"] += 1
            what = "fingerprint differs" if source is None else f"block bytes differ (server: {block_bytes})"
            await self._send_end(io, p.Status.MISMATCH, req.request_id, 0, what)
            return
        if not req.keys:
            await self._send_end(io, p.Status.OK, req.request_id, 0, "")
            return
        if not await self._slots.acquire(self.queue_wait_s):
            self._counts["busy"] += 1
            await self._send_end(io, p.Status.BUSY, req.request_id, 0,
                                 f"{self._slots.active} requests in progress, {self._slots.waiting} waiting")
            return
        if io.peer_gone():  # it left while waiting for the slot (its deadline): read nothing for it
            self._slots.release()
            self._counts["disconnects"] += 1
            raise PeerClosed("client left while its request waited")
        def on_sent(n: int) -> None:
            self._counts["blocks_served"] += n
            self._counts["bytes_served"] += n * block_bytes

        try:
            first, ended = await self._send_lent(io, req, source, on_sent)
        except BaseException as exc:
            self._slots.release()
            if isinstance(exc, (OSError, PeerClosed)):
                self._counts["disconnects"] += 1
            raise
        if ended:  # all lent, or one torn: the END went out
            self._slots.release()
            return
        loop = asyncio.get_running_loop()
        frame_bytes = p.BLOCK_PREFIX_BYTES + block_bytes
        slots = max(2, self.ring_bytes // frame_bytes)
        ring = self._take_ring(slots * frame_bytes)
        producer = _Producer(loop, source, req, ring, slots, first)
        ring_users = [2]  # the reading thread and this task: the ring is reused when both are done

        def drop_ring() -> None:
            ring_users[0] -= 1
            if ring_users[0] == 0 and len(self._free_rings) < self.max_concurrent:
                self._free_rings.append(ring)

        def thread_ended(_: object) -> None:
            self._slots.release()
            drop_ring()

        try:
            assert self._executor is not None, "server not started"
            thread = loop.run_in_executor(self._executor, producer.run)
        except BaseException:
            self._slots.release()
            raise
        thread.add_done_callback(thread_ended)
        try:
            await producer.stream(io, self.io_timeout_s, on_sent)
        except (OSError, PeerClosed):
            self._counts["disconnects"] += 1
            raise
        finally:
            producer.request_stop()
            drop_ring()
        if producer.status is p.Status.MISS:
            self._counts["misses"] += 1
        elif producer.status is p.Status.SOURCE_ERROR:
            self._counts["source_errors"] += 1
        await self._send_end(io, producer.status, req.request_id, first + producer.sent, producer.reason)

    async def _send_lent(self, io: SockIO, req: p.Request, source: BlockSource, on_sent) -> tuple[int, bool]:
        """Send blocks from the first as LENT_BLOCK frames while the source lends them, each batch's
        CHECKS with the next batch (see the module docstring). Returns ``(sent, ended)``: the blocks
        sent and checked, and whether the END went out (all of them: END OK; a changed one: END
        TORN); otherwise the CHECKS went out and the reading thread goes on from ``sent``. Raises
        OSError/PeerClosed/TimeoutError."""
        lend = getattr(source, "lend_block", None)
        if lend is None or not req.flags & p.REQUEST_LENT_OK:
            return 0, False
        loop = asyncio.get_running_loop()
        pb, keys, rid = p.BLOCK_PREFIX_BYTES, req.keys, req.request_id
        found = lend(keys[0])
        refresh = getattr(source, "refresh", None)
        if found is None and refresh is not None:
            assert self._executor is not None, "server not started"
            await loop.run_in_executor(self._executor, refresh)
            found = lend(keys[0])
        batch = max(1, SEND_BATCH_BYTES // (pb + req.block_bytes))
        prefixes = memoryview(bytearray(pb * min(batch, len(keys))))
        sent = 0
        checks: bytes = b""  # the last batch's CHECKS, to go out with the next one
        while found is not None:
            lent = []
            parts: list[memoryview] = [memoryview(checks)] if checks else []
            for i in range(sent, min(sent + batch, len(keys))):
                if i > sent:
                    found = lend(keys[i])
                    if found is None:
                        break
                at = (i - sent) * pb
                p.pack_block_prefix_into(prefixes, at, rid, i, req.fingerprint, keys[i], 0, req.block_bytes,
                                         p.FrameType.LENT_BLOCK)
                parts += (prefixes[at:at + pb], found[0])
                lent.append(found)
            io.deadline = loop.time() + self.io_timeout_s
            await io.send_parts(parts)
            sums = []
            for view, unchanged in lent:  # after the kernel took the bytes: checksum, then the seqlock
                checksum = p.payload_checksum(view)
                if not unchanged():
                    break
                sums.append(checksum)
            checks = p.encode_checks(rid, sent, sums) if sums else b""
            sent += len(sums)
            self._counts["blocks_lent"] += len(sums)
            on_sent(len(sums))
            if len(sums) < len(lent):
                self._counts["torn"] += 1
                await io.send(checks + p.encode_end(p.Status.TORN, rid, sent, f"block {sent} changed while sent"))
                return sent, True
            if sent == len(keys):
                await io.send(checks + p.encode_end(p.Status.OK, rid, sent, ""))
                return sent, True
            if found is not None:
                found = lend(keys[sent])
        if checks:
            await io.send(checks)
        return sent, False

    def _take_ring(self, nbytes: int) -> bytearray:
        while self._free_rings:
            ring = self._free_rings.pop()
            if len(ring) == nbytes:
                return ring
        return bytearray(nbytes)
