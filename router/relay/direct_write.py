"""Writing a relayed response straight to uvicorn's transport, past the ASGI ``send`` coroutine.

Through ASGI, each streamed piece costs a future, a task switch and a ``send`` coroutine, and a
whole answer two socket writes (its head, then its body). :func:`writer_for` gives the relay a
:class:`DirectWriter` that writes the bytes uvicorn's httptools protocol writes for the same ASGI
messages (``RequestResponseCycle.send``, uvicorn/protocols/http/httptools_impl.py): a piece as one
chunk of the chunked body, a whole answer (head and body) in one write. A stream's last message
still goes through ``send``, so its completion is uvicorn's; a whole answer is completed as
``send``'s last message completes one (keep-alive or close, the next pipelined request, the end
seen by ``receive``), without waiting for the client to read it, as the ASGI path does not.

A writer is given only where that holds: ``send`` is the bound ``send`` of uvicorn's httptools
``RequestResponseCycle`` (no middleware in between: a CORS request or tracing keeps ASGI), with
uvicorn's access log off (it is written in ``send``); otherwise the caller sends ASGI messages.
"""
from __future__ import annotations

from collections.abc import Callable

try:  # uvicorn[standard]'s httptools protocol; without it every response goes through ASGI
    from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, RequestResponseCycle
except ImportError:  # pragma: no cover - httptools is a dependency
    RequestResponseCycle = None

_OWN_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection"})


class DirectWriter:
    """Writes one response's bytes to the client's transport (see the module docstring)."""

    __slots__ = ("_cycle", "_transport", "_flow")

    def __init__(self, cycle) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow

    @property
    def chunked(self) -> bool:
        """Whether the response's head has been sent (through ``send``) and its body is chunked:
        the condition for :meth:`chunk`."""
        c = self._cycle
        return c.response_started and c.chunked_encoding is True and not c.response_complete

    def chunk(self, body: bytes) -> None:
        """``body`` (non-empty) as one chunk of a chunked body, as ``send`` of
        ``{"type": "http.response.body", "body": body, "more_body": True}`` writes it; nothing
        once the client has gone (or its transport is closing, before uvicorn has heard)."""
        transport = self._transport
        if not self._cycle.disconnected and not transport.is_closing():
            transport.write(b"%x\r\n%s\r\n" % (len(body), body))

    @property
    def paused(self) -> bool:
        """The client's socket buffer is past its high-water mark: wait for :meth:`drain`."""
        return self._flow.write_paused and not self._cycle.disconnected

    async def drain(self) -> None:
        """Until the client's socket buffer drains (or the client goes)."""
        if self.paused:
            await self._flow.drain()

    def whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write a whole answer, head and ``body``, in one write, as ``send`` writes
        ``http.response.start`` with ``headers`` plus a ``Content-Length`` of ``len(body)``,
        then the body, and complete the response as ``send`` does at the last message (the
        caller sends nothing more). False, with nothing written, where ``send`` must write it
        itself: a response already started, a client gone or its socket full (``send`` waits
        first), a status uvicorn has no line for or that carries no body (1xx, 204, 304), or
        ``headers`` naming ``Content-Length``, ``Transfer-Encoding`` or ``Connection``. Raises
        RuntimeError on a header name or value uvicorn refuses (a newline), as ``send`` does."""
        c = self._cycle
        line = STATUS_LINE.get(status)
        if c.response_started or c.disconnected or self._flow.write_paused or self._transport.is_closing() \
                or line is None or status < 200 or status in (204, 304):
            return False
        all_headers = (*c.default_headers, *headers)
        # send's checks of each name and value, made once over all of them ("a" is valid in both)
        if HEADER_RE.search(b"a".join([name for name, _ in all_headers])):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(b"a".join([value for _, value in all_headers])):
            raise RuntimeError("Invalid HTTP header value.")
        content = [line]
        for name, value in all_headers:
            name = name.lower()
            if name in _OWN_HEADERS:
                return False
            content += (name, b": ", value, b"\r\n")
        content += (b"content-length: ", b"%d" % len(body), b"\r\n")
        if not c.keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        c.response_started = True
        c.waiting_for_100_continue = False
        c.chunked_encoding = False
        c.expected_content_length = 0
        self._transport.write(b"".join(content))
        # send's completion of the last message: no drain (the ASGI path writes its body into a
        # socket it found free and returns; a slow client must not hold the relay, its worker
        # connection and its in-flight counts)
        c.response_complete = True
        c.message_event.set()
        if not c.keep_alive:
            self._transport.close()
        c.on_response()
        return True


def writer_for(send: Callable) -> DirectWriter | None:
    """A :class:`DirectWriter` for the response ``send`` belongs to, or None where the relay
    must keep to ASGI (see the module docstring)."""
    cycle = getattr(send, "__self__", None)
    if RequestResponseCycle is None or type(cycle) is not RequestResponseCycle or cycle.access_log:
        return None
    if getattr(send, "__func__", None) is not RequestResponseCycle.send:
        return None
    return DirectWriter(cycle)
