"""Non-blocking socket reads and writes on the event loop with a staging buffer and a deadline.

:class:`SockIO` reads with ``recv_into`` into a preallocated staging buffer (so small frames cost
no syscall each) or straight into the caller's buffer for large payloads, and writes with
``loop.sock_sendall`` (the data is in the kernel when it returns, so the caller may reuse its
buffer). Shared by the peer server and client.
"""
from __future__ import annotations

import asyncio
import socket


_IOV_MAX = 1024  # most buffers one sendmsg takes (Linux)


class PeerClosed(ConnectionError):
    """The other side closed the connection (EOF)."""


class SockIO:
    """One connected socket (made non-blocking here). ``deadline`` (event loop time, s, or None)
    bounds every wait; past it a wait raises TimeoutError. ``staging_bytes``: size of the staging
    buffer, the most :meth:`read_exact` can return. ``read_ahead``: whether a read into the staging
    buffer takes all the socket has (fewer syscalls for small frames) or only the bytes asked for
    (so that a large payload after them goes straight into its destination with
    :meth:`read_into`, copied once). Not for concurrent use by several tasks."""

    def __init__(self, sock: socket.socket, staging_bytes: int = 1 << 20) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.deadline: float | None = None
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray(staging_bytes)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self.read_ahead = True

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet read."""
        return self._end - self._start

    async def _recv_into(self, view: memoryview) -> int:
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            async with asyncio.timeout_at(self.deadline):
                n = await self._loop.sock_recv_into(self.sock, view)
        if n == 0:
            raise PeerClosed("peer closed the connection")
        return n

    async def _fill(self, n: int) -> None:
        """Make at least ``n`` bytes (<= staging size) contiguous in the staging buffer."""
        avail = self._end - self._start
        if self._start + n > len(self._buf):
            self._buf[:avail] = self._buf[self._start:self._end]
            self._start, self._end = 0, avail
        while self._end - self._start < n:
            upto = len(self._buf) if self.read_ahead else self._start + n
            self._end += await self._recv_into(self._view[self._end:upto])

    async def read_exact(self, n: int) -> memoryview:
        """The next ``n`` bytes (n <= staging size) as a view valid until the next read.
        Raises PeerClosed, OSError, TimeoutError (deadline)."""
        if self._end - self._start < n:
            if n > len(self._buf):
                raise ValueError(f"read_exact({n}) beyond the staging buffer of {len(self._buf)} bytes")
            if self._start == self._end:
                self._start = self._end = 0
            await self._fill(n)
        v = self._view[self._start:self._start + n]
        self._start += n
        return v

    async def read_payload(self, n: int, fallback: memoryview) -> memoryview:
        """The next ``n`` bytes as a view valid until the next read: into the staging buffer when
        they fit there cheaply (no copy when already received), else into ``fallback`` (writable,
        at least ``n`` bytes) with large reads straight from the socket. Raises like read_exact."""
        avail = self._end - self._start
        if avail >= n or n <= len(self._buf) // 4:
            return await self.read_exact(n)
        dst = fallback[:n]
        dst[:avail] = self._view[self._start:self._end]
        self._start = self._end = 0
        got = avail
        while got < n:
            got += await self._recv_into(dst[got:])
        return dst

    async def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` (writable, any size) with the next ``dst.nbytes`` bytes: what is buffered
        is copied, the rest received straight into it. Raises like read_exact."""
        n = dst.nbytes
        got = min(n, self._end - self._start)
        dst[:got] = self._view[self._start:self._start + got]
        self._start += got
        while got < n:
            got += await self._recv_into(dst[got:])

    async def send(self, data) -> None:
        """Send all of ``data`` (bytes-like); returns once the kernel has it. Raises OSError,
        TimeoutError (deadline: part of it may have gone)."""
        async with asyncio.timeout_at(self.deadline):
            await self._loop.sock_sendall(self.sock, data)

    async def send_parts(self, parts: list[memoryview]) -> None:
        """Send the byte views ``parts`` in order (``sendmsg``, no joining copy); returns once the
        kernel has them all. Raises like :meth:`send`."""
        i = 0
        async with asyncio.timeout_at(self.deadline):
            while i < len(parts):
                try:
                    n = self.sock.sendmsg(parts[i:i + _IOV_MAX])
                except (BlockingIOError, InterruptedError):
                    await self._writable()
                    continue
                while i < len(parts) and n >= parts[i].nbytes:
                    n -= parts[i].nbytes
                    i += 1
                if n:
                    parts[i] = parts[i][n:]

    async def _writable(self) -> None:
        fut = self._loop.create_future()
        fd = self.sock.fileno()
        self._loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    def at_eof_or_junk(self) -> bool:
        """True when the idle connection is no longer usable: closed by the peer, in error, or
        with unexpected bytes waiting (checked without blocking)."""
        if self._end != self._start:
            return True
        try:
            self.sock.recv(1, socket.MSG_PEEK)
            return True  # b"" (EOF) or bytes nobody asked for: not usable
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def peer_gone(self) -> bool:
        """True when the peer has closed the connection or it is in error (checked without
        blocking; bytes waiting to be read do not count as gone)."""
        if self._end != self._start:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        """Close the socket (idempotent)."""
        try:
            self.sock.close()
        except OSError:
            pass
