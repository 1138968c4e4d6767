"""A fake Kubernetes API server on loopback speaking enough of the API for the official client's
list and watch of pods (``GET /api/v1/namespaces/{ns}/pods``), so discovery is tested with the
real ``kubernetes`` client and no cluster.

- List: ``{"kind": "PodList", "metadata": {"resourceVersion"}, "items": [...]}`` filtered by
  ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-joined).
- Watch (``?watch=true``): JSON lines ``{"type", "object"}`` of every recorded change after
  ``resourceVersion``, then new ones as they happen, until ``timeoutSeconds`` (then a
  ``BOOKMARK`` when ``allowWatchBookmarks``), the client leaving, or :meth:`FakeKubeAPI.stop`.
  A resourceVersion older than the last :meth:`FakeKubeAPI.compact` gets the ``ERROR`` event
  with a 410 ``Status`` (or, with ``gone_as_status``, the HTTP status 410), as a real server
  does once etcd has compacted it; :meth:`compact` also ends open watches that way.
  As a real server's watch cache does, a pod that comes to match the selector is ``ADDED`` and
  one that stops matching is ``DELETED`` (its last matching state, the new resourceVersion).
- :meth:`FakeKubeAPI.fail_next` answers the next requests with an error status;
  :meth:`FakeKubeAPI.refuse_watches` answers every watch with one until called with None (a
  watch that cannot reconnect, or a server that cannot serve the cursor: 504 "Too large resource
  version", in the stream or as the HTTP status); :meth:`FakeKubeAPI.drop_watches` ends the open
  watches now, cleanly or by cutting the connection (``open_watches`` counts them).

Changes made with ``record=False`` advance the resourceVersion without an event: with
:meth:`compact` they stand for what a client misses while its watch is broken, which only a
re-list shows.
"""
from __future__ import annotations

import copy
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


def make_pod(name: str, port: int, *, ready: bool = True, labels: dict[str, str] | None = None,
             ip: str | None = "127.0.0.1", namespace: str = "default", phase: str = "Running",
             port_name: str = "http", extra_ports: dict[str, int] | None = None, uid: str | None = None,
             reason: str | None = None, deletion_timestamp: str | None = None) -> dict[str, Any]:
    """A Pod object as the API serves it: one container declaring ``port`` under ``port_name``
    (and ``extra_ports`` name -> number), status with ``podIP`` (none when ``ip`` is None) and a
    Ready condition; ``uid`` (default ``uid-<name>``: another one is a new pod of the same name),
    ``status.reason`` (e.g. ``Evicted``) and ``metadata.deletionTimestamp`` when given."""
    ports = [{"name": port_name, "containerPort": port, "protocol": "TCP"}]
    ports += [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in (extra_ports or {}).items()]
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Initialized", "status": "True"},
                       {"type": "Ready", "status": "True" if ready else "False"},
                       {"type": "ContainersReady", "status": "True" if ready else "False"},
                       {"type": "PodScheduled", "status": "True"}],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    if reason:
        status["reason"] = reason
        status["message"] = f"The pod was {reason.lower()}."
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}",
                            "labels": dict(labels or {"app.kubernetes.io/name": "vllm-worker"})}
    if deletion_timestamp:
        meta["deletionTimestamp"] = deletion_timestamp
    return {
        "kind": "Pod", "apiVersion": "v1", "metadata": meta,
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "ports": ports}]},
        "status": status,
    }


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = (x.strip() for x in term.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = (x.strip() for x in term.replace("==", "=").split("=", 1))
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class FakeKubeAPI:
    """The fake server; :meth:`start` binds 127.0.0.1 on a free port (``url``), :meth:`stop` ends
    every stream and closes it. Thread-safe: tests change pods while the client watches.
    ``requests``: ``(path, query)`` of every request served, in order (``request_times``: when)."""

    def __init__(self, start_rv: int = 1000, bookmarks: bool = True) -> None:
        self._cond = threading.Condition()
        self._bookmarks = bookmarks  # False: a watch's timeout ends it without a BOOKMARK
        self._end_open = True
        self._rv = start_rv
        self._compacted_rv = 0  # a watch from a version below this gets 410
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        # (resourceVersion, type, object, the object before the change: None for ADDED, DELETED)
        self._events: list[tuple[int, str, dict[str, Any], dict[str, Any] | None]] = []
        self._gone_as_status = False
        self._fail: list[int] = []
        self._refuse: tuple[int, str, str, bool] | None = None  # refuse_watches' answer
        self._drop_gen = 0  # drop_watches() counts up; a watch opened under an older one ends
        self._drop_clean = True
        self.open_watches = 0
        self._closing = False
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.request_times: list[float] = []  # time.monotonic() of each, in the same order
        self.authorizations: list[str | None] = []  # each request's Authorization header
        self.gone_sent: list[str] = []  # each 410 answered: "event" (ERROR in a stream) or "status"
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "FakeKubeAPI":
        """Serve in a daemon thread; returns self."""
        api = self

        class Handler(_Handler):
            fake = api

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="fake-kube-api", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, the server's address (after :meth:`start`)."""
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        """End every open watch and close the server."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> "FakeKubeAPI":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what tests do -----------------------------------------------------------------------
    def put_pod(self, pod: dict[str, Any], record: bool = True) -> str:
        """Create or replace a pod (``ADDED`` or ``MODIFIED``); returns its new resourceVersion."""
        pod = copy.deepcopy(pod)
        meta = pod["metadata"]
        key = (meta.get("namespace", "default"), meta["name"])
        with self._cond:
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            prev = self._pods.get(key)
            kind = "MODIFIED" if prev is not None else "ADDED"
            self._pods[key] = pod
            if record:
                self._events.append((self._rv, kind, copy.deepcopy(pod), copy.deepcopy(prev)))
            self._cond.notify_all()
            return meta["resourceVersion"]

    def delete_pod(self, name: str, namespace: str = "default", record: bool = True) -> None:
        """Delete a pod (``DELETED`` with its last state). Raises KeyError when absent."""
        with self._cond:
            pod = self._pods.pop((namespace, name))
            self._rv += 1
            pod["metadata"]["resourceVersion"] = str(self._rv)
            if record:
                self._events.append((self._rv, "DELETED", copy.deepcopy(pod), None))
            self._cond.notify_all()

    def compact(self, gone_as_status: bool = False, end_open_watches: bool = True) -> None:
        """Forget the change history up to now: open watches end with a 410 ``ERROR`` event
        (unless not ``end_open_watches``: they run to their timeout) and resuming from an older
        resourceVersion gets 410 (the HTTP status itself when ``gone_as_status``), so the
        client must list again."""
        with self._cond:
            self._rv += 1
            self._compacted_rv = self._rv
            self._events.clear()
            self._gone_as_status = gone_as_status
            self._end_open = end_open_watches
            self._cond.notify_all()

    def fail_next(self, n: int, status: int = 500) -> None:
        """Answer the next ``n`` requests with ``status`` and a ``Status`` body."""
        with self._cond:
            self._fail.extend([status] * n)

    def refuse_watches(self, status: int | None = 503, message: str = "watch refused",
                       reason: str = "ServiceUnavailable", in_stream: bool = False) -> None:
        """From now on answer every watch request with ``status`` and a ``Status`` body (lists are
        served), until called with ``status=None``; ``in_stream``: as the ``ERROR`` event of a 200
        stream instead, as a real server answers a watch it cannot serve. E.g. ``504``,
        ``"Too large resource version: ..."``, ``"Timeout"`` for a cursor the server is behind."""
        with self._cond:
            self._refuse = None if status is None else (status, reason, message, in_stream)

    def drop_watches(self, clean: bool = False) -> None:
        """End every open watch now, without sending the changes still pending for it:
        ``clean`` with the stream's last chunk (a watch that ends normally), else by cutting the
        connection mid-stream (the client sees an error and reconnects)."""
        with self._cond:
            self._drop_gen += 1
            self._drop_clean = clean
            self._cond.notify_all()

    def count(self, watch: bool) -> int:
        """How many list (``watch=False``) or watch requests were served so far."""
        return sum(1 for _, q in list(self.requests) if _is_watch(q) == watch)

    # ---- serving (handler threads) -----------------------------------------------------------
    def _take_failure(self) -> int | None:
        with self._cond:
            return self._fail.pop(0) if self._fail else None

    def _list(self, namespace: str, selector: str) -> dict[str, Any]:
        with self._cond:
            items = [copy.deepcopy(p) for (ns, _), p in sorted(self._pods.items())
                     if ns == namespace and _selector_matches(selector, p["metadata"].get("labels") or {})]
            for p in items:
                p.pop("kind", None)
                p.pop("apiVersion", None)
            return {"kind": "PodList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _watch(self, handler: "_Handler", namespace: str, selector: str, rv: int, timeout_s: float,
               bookmarks: bool) -> None:
        end = time.monotonic() + timeout_s
        cursor = rv
        with self._cond:
            too_old = rv < self._compacted_rv
            as_status = self._gone_as_status
            gen = self._drop_gen
            refuse = self._refuse
        if refuse is not None:
            code, reason, message, in_stream = refuse
            if not in_stream:
                handler.send_json(code, _status(code, reason, message))
                return
            handler.start_stream()
            handler.send_line({"type": "ERROR", "object": _status(code, reason, message)})
            handler.end_stream()
            return
        if too_old and as_status:
            self.gone_sent.append("status")
            handler.send_json(410, _status(410, "Expired", f"too old resource version: {rv} ({self._compacted_rv})"))
            return
        handler.start_stream()
        cut = False
        with self._cond:
            self.open_watches += 1
        try:
            if too_old:
                self.gone_sent.append("event")
                handler.send_line({"type": "ERROR", "object": _status(410, "Expired", "too old resource version")})
                return
            while True:
                with self._cond:
                    pending = [(v, k, p, b) for v, k, p, b in self._events if v > cursor]
                    outcome = None
                    if self._drop_gen != gen:
                        pending, outcome, cut = [], "dropped", not self._drop_clean
                    elif not pending:
                        if self._closing:
                            outcome = "closing"
                        elif cursor < self._compacted_rv and self._end_open:
                            outcome = "gone"
                        elif time.monotonic() >= end:
                            outcome = "timeout"
                        else:
                            self._cond.wait(min(end - time.monotonic(), 0.5))
                            continue
                    current = self._rv
                for v, k, p, before in pending:
                    cursor = v
                    meta = p["metadata"]
                    if meta.get("namespace", "default") != namespace:
                        continue
                    now_in = _selector_matches(selector, meta.get("labels") or {})
                    was_in = before is not None and _selector_matches(
                        selector, before["metadata"].get("labels") or {})
                    if k == "MODIFIED" and now_in != was_in:  # into or out of the selection
                        if now_in:
                            handler.send_line({"type": "ADDED", "object": p})
                        else:
                            assert before is not None
                            gone = copy.deepcopy(before)
                            gone["metadata"]["resourceVersion"] = str(v)
                            handler.send_line({"type": "DELETED", "object": gone})
                    elif now_in:
                        handler.send_line({"type": k, "object": p})
                if outcome == "gone":
                    self.gone_sent.append("event")
                    handler.send_line({"type": "ERROR", "object": _status(410, "Expired", "too old resource version")})
                elif outcome == "timeout" and bookmarks and self._bookmarks:
                    handler.send_line({"type": "BOOKMARK", "object": {
                        "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(current)}}})
                if outcome is not None:
                    return
        finally:
            with self._cond:
                self.open_watches -= 1
            if cut:
                handler.cut()
            else:
                handler.end_stream()


def _is_watch(query: dict[str, str]) -> bool:
    return query.get("watch", "").lower() in ("true", "1")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeKubeAPI

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def send_json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def send_line(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def cut(self) -> None:
        """Close the connection mid-stream: no last chunk, so the client sees a broken response."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def end_stream(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            pass
        self.close_connection = True

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        with self.fake._cond:
            self.fake.requests.append((parts.path, query))
            self.fake.request_times.append(time.monotonic())
            self.fake.authorizations.append(self.headers.get("Authorization"))
        failure = self.fake._take_failure()
        if failure is not None:
            self.send_json(failure, _status(failure, "InternalError", "injected failure"))
            return
        segs = parts.path.strip("/").split("/")
        if len(segs) != 5 or segs[:3] != ["api", "v1", "namespaces"] or segs[4] != "pods":
            self.send_json(404, _status(404, "NotFound", f"no route {parts.path}"))
            return
        namespace, selector = segs[3], query.get("labelSelector", "")
        try:
            if _is_watch(query):
                self.fake._watch(self, namespace, selector, int(query.get("resourceVersion") or 0),
                                 float(query.get("timeoutSeconds") or 1800),
                                 query.get("allowWatchBookmarks", "").lower() in ("true", "1"))
            else:
                self.send_json(200, self.fake._list(namespace, selector))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
