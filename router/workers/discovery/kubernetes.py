"""Worker discovery from Kubernetes pods (the I/O half; the pod -> worker mapping is
:mod:`router.workers.discovery.pods`).

:class:`KubernetesDiscovery` runs while the gateway runs (:meth:`router.gateway.Gateway.start`
starts it when the config has ``discovery.kubernetes``, :meth:`~router.gateway.Gateway.stop`
stops it). It lists the pods matching the label selector, then watches them with the official
client's ``kubernetes.watch.Watch`` over ``CoreV1Api.list_namespaced_pod``, the way client-go's
reflector does:

- the list gives a ``resourceVersion``; each watch starts from the last one seen (objects and
  ``BOOKMARK`` events advance it) and runs ``watch_timeout_s`` on the server, then the next
  watch resumes from there;
- ``410 Gone`` (an ``ERROR`` event in the stream or the HTTP status: the version was compacted
  away) or ``504`` "Too large resource version" (an API server behind the cursor, e.g. after a
  failover) lists again at once; the list replaces the whole picture, so pods that went during the
  gap are removed (every worker discovery owns whose pod is not in the list);
- any other failure (connection refused or reset, 5xx, 403, a bad body) waits
  ``backoff_initial_s``, doubling up to ``backoff_max_s``, reset by the next watch that works;
  the next watch resumes from the cursor (the server replays what happened meanwhile, deletions
  included), but after ``RELIST_AFTER_FAILED_WATCHES`` failed watches in a row it lists again
  instead: a cursor that cannot be served must not keep the workers of deleted pods forever.

The client is synchronous (urllib3), so listing and watching run in one daemon thread that hands
each result to the event loop; the gateway is changed only on the loop, one change at a time.

What a pod's state does (:func:`router.workers.discovery.pods.map_pod`), worker id = pod name:

- **Ready** (``Ready=True``, a pod IP, its ports resolved): added with ``Gateway.add_worker``; a
  worker that discovery had drained is undrained; a changed address re-adds it.
- **not Ready** (readiness probe failing, restarting container): drained at once (no new
  requests; requests in flight finish; its index entries stay, so a short blip loses no cache
  knowledge) and removed if still not Ready ``not_ready_remove_s`` later (0: removed at once).
  A not Ready pod whose IP was cleared (a kubelet eviction clears it) or changed has no engine
  left at the worker's address: removed at once.
- **gone** (``DELETED`` event, missing from a re-list, ``deletionTimestamp`` set, phase
  Succeeded/Failed, ``status.reason`` Evicted, labels no longer matching): removed with
  ``Gateway.remove_worker`` at once: its index entries are purged and requests in flight on it
  finish.
- **replaced** (the pod of a worker's name shows another ``metadata.uid``: deleted and created
  again, e.g. a StatefulSet pod, while the watch was away): the old worker is removed at once
  (its index entries were the old engine's cache), whatever the new pod's state; the new pod is a
  new worker when Ready.
- **address taken over** (a Ready pod has the URL of another pod's discovered worker: that pod's
  IP went to this one before its own change arrived): the other worker is removed at once.

Every removal goes through ``Gateway.remove_worker`` (index entries purged, requests in flight
finish), and one pod that fails to apply does not stop the rest of a list from applying.
- **skipped** (its role label, ``role_label``, is not prefill, decode or both): a WARNING
  (once per pod and value), and treated as gone. A Ready pod's role follows its label: a
  changed label changes the worker's role in place (no re-registration; its index entries and
  counts stay); a role set through the admin API holds until the pod's next change.

Only workers discovery added are touched (the registration it made, not just the id): a
configured or admin-added worker with a pod's name is left alone (logged), also one added by hand
after the discovered one was removed through the admin API. An operator's drain of a discovered worker is kept (discovery undrains
only what it drained); a discovered worker removed through the admin API comes back on its pod's
next change while the pod is Ready.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from router.config.discovery import KubernetesDiscoveryConfig
from router.config.schema import WorkerConfig
from router.workers.discovery.pods import PodView, map_pod, pod_name
from router.workers.registry import WorkerRegistration, WorkerRegistry

log = logging.getLogger("kvroute.discovery.kubernetes")

SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
CONNECT_TIMEOUT_S = 10.0
LIST_READ_TIMEOUT_S = 60.0
WATCH_READ_GRACE_S = 30.0  # a watch's read timeout: its server-side timeout plus this
RELIST_AFTER_FAILED_WATCHES = 3  # failed watches in a row after which the next attempt lists again
STOP_WAIT_S = 3.0  # how long stop() waits for the thread to notice


def make_api_client(cfg: KubernetesDiscoveryConfig) -> tuple[Any, str]:
    """``(kubernetes.client.ApiClient, namespace)`` for ``cfg``: ``api_server`` (plain, no
    credentials: ``kubectl proxy`` or a test server); else the in-cluster service account when
    running in a pod (``KUBERNETES_SERVICE_HOST`` set) and no ``kubeconfig`` is named; else the
    kubeconfig file (``$KUBECONFIG`` or ``~/.kube/config`` when None) and ``context``. The
    namespace is ``cfg.namespace``, else the service account's, else the context's, else
    ``default``. Raises ValueError when no configuration can be loaded."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    conf = client.Configuration()
    namespace = cfg.namespace
    try:
        if cfg.api_server:
            conf.host = cfg.api_server
        elif os.environ.get("KUBERNETES_SERVICE_HOST") and not cfg.kubeconfig:
            config.load_incluster_config(client_configuration=conf)
            if namespace is None and SA_NAMESPACE_FILE.is_file():
                namespace = SA_NAMESPACE_FILE.read_text().strip() or None
        else:
            config.load_kube_config(config_file=cfg.kubeconfig, context=cfg.context,
                                    client_configuration=conf, persist_config=False)
            if namespace is None:
                contexts, active = config.list_kube_config_contexts(cfg.kubeconfig)
                chosen = next((c for c in contexts if c.get("name") == cfg.context), active) if cfg.context else active
                namespace = ((chosen or {}).get("context") or {}).get("namespace")
    except (ConfigException, OSError) as exc:
        raise ValueError(f"discovery.kubernetes: cannot load a Kubernetes client configuration: {exc}") from None
    return client.ApiClient(conf), namespace or "default"


def cursor_unservable(exc: Any) -> bool:
    """Whether an ``ApiException`` says the watch cannot resume from its resourceVersion: 410
    Gone (compacted away) or the API server's "Too large resource version" (504, cause
    ``ResourceVersionTooLarge``: the server is behind the cursor, e.g. after a failover or an
    etcd restore); either way only a new list helps."""
    if exc.status == 410:
        return True
    text = f"{exc.reason or ''} {exc.body or ''}".lower()
    return exc.status == 504 and ("too large resource version" in text or "resourceversiontoolarge" in text)


@dataclass(frozen=True)
class _Owned:
    """A worker discovery registered: the registration it made (a worker of the same id added
    by other hands later is not discovery's), and the pod's uid and IP it was made from."""

    reg: "WorkerRegistration"
    uid: str | None
    ip: str | None


class WorkerSink(Protocol):
    """What discovery changes: :class:`router.gateway.Gateway` is one. ``add_worker`` raises
    ValueError when the worker cannot be added (:class:`router.errors.WorkerExists`: its id or
    address is taken)."""

    registry: WorkerRegistry

    async def add_worker(self, wcfg: WorkerConfig) -> WorkerRegistration: ...

    async def drain_worker(self, worker_id: str) -> WorkerRegistration: ...

    async def remove_worker(self, worker_id: str) -> WorkerRegistration: ...


class KubernetesDiscovery:
    """Keeps the gateway's discovered workers equal to the Ready pods of ``cfg.label_selector``.

    ``gateway``: what it changes (``add_worker``, ``remove_worker``, ``drain_worker``,
    ``registry``); ``api_client``: a ``kubernetes.client.ApiClient`` and ``namespace`` to use
    instead of :func:`make_api_client` (tests). :meth:`start` raises ValueError when no client
    configuration loads; nothing else it does raises: API failures are logged and retried."""

    def __init__(self, gateway: WorkerSink, cfg: KubernetesDiscoveryConfig, api_client: Any = None,
                 namespace: str | None = None) -> None:
        self.gateway = gateway
        self.cfg = cfg
        self._api_client = api_client
        self._own_client = api_client is None  # made in start(), closed in stop()
        self.namespace = namespace or cfg.namespace
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._apply_task: asyncio.Task | None = None
        self._stop = threading.Event()
        self._watch: Any = None  # the kubernetes.watch.Watch streaming now, for stop()
        self._pods: dict[str, PodView] = {}  # the last view of every pod the API showed
        self._owned: dict[str, _Owned] = {}  # worker id -> the registration discovery made
        self._drained: set[str] = set()  # of those, the ones discovery drained
        self._not_ready_since: dict[str, float] = {}  # monotonic s a registered pod turned not Ready
        self._conflicts: set[str] = set()  # pod names taken by a worker discovery does not own
        self._skipped: dict[str | None, str] = {}  # pod name -> why map_pod refused it (warned once)
        # counters for state(); written by the thread (ints: one writer each, atomic enough)
        self.lists = 0
        self.watches = 0
        self.relists_gone = 0
        self.relists_after_errors = 0
        self.errors = 0
        self.last_error: str | None = None
        self.resource_version: str | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the client configuration (raises ValueError when none loads) and start the
        list/watch thread and the task applying its results; returns at once (the first pods
        are added as the list arrives)."""
        if self._api_client is None:
            self._api_client, self.namespace = make_api_client(self.cfg)
        self.namespace = self.namespace or "default"
        from kubernetes import client

        self._core = client.CoreV1Api(self._api_client)
        self._loop = asyncio.get_running_loop()
        self._apply_task = self._loop.create_task(self._apply_loop(), name="k8s-discovery-apply")
        self._thread = threading.Thread(target=self._run_thread, name="k8s-discovery-watch", daemon=True)
        self._thread.start()
        log.info("kubernetes discovery: watching pods %r in namespace %s", self.cfg.label_selector,
                 self.namespace)

    async def stop(self) -> None:
        """Stop watching (the open watch's socket is shut down so the thread wakes at once) and
        stop applying; the discovered workers stay registered (the gateway is stopping)."""
        self._stop.set()
        deadline = time.monotonic() + STOP_WAIT_S
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            w = self._watch
            if w is not None:
                w.stop()  # repeated: a watch that was just opening gets its socket shut too
            await asyncio.sleep(0.02)
        if self._thread is not None and self._thread.is_alive():
            log.warning("kubernetes discovery: the watch thread did not stop in %ss; left behind (daemon)",
                        STOP_WAIT_S)
        elif self._own_client and self._api_client is not None:
            self._api_client.close()
        if self._apply_task is not None:
            self._apply_task.cancel()
            await asyncio.gather(self._apply_task, return_exceptions=True)

    def owns(self, worker_id: str) -> bool:
        """Whether the registered worker ``worker_id`` is one this discovery registered (config
        reloads keep it): the very registration, so a worker re-added by other hands under the
        id of a discovered one that was removed through the admin API is not."""
        return self._mine(worker_id) is not None

    def _mine(self, name: str) -> "WorkerRegistration | None":
        owned = self._owned.get(name)
        if owned is None or self.gateway.registry.get(name) is not owned.reg:
            return None
        return owned.reg

    def state(self) -> dict[str, Any]:
        """For operators: namespace, selector, counters (``lists``, ``watches``,
        ``relists_gone``: re-lists after 410 Gone or a too large resource version,
        ``relists_after_errors``: after ``RELIST_AFTER_FAILED_WATCHES`` failed watches in a row,
        ``errors``), ``last_error``, the last ``resource_version``, the discovered ``workers``
        registered now (sorted) and the ``pods`` seen with their state."""
        return {"namespace": self.namespace, "label_selector": self.cfg.label_selector,
                "lists": self.lists, "watches": self.watches, "relists_gone": self.relists_gone,
                "relists_after_errors": self.relists_after_errors,
                "errors": self.errors, "last_error": self.last_error,
                "resource_version": self.resource_version,
                "workers": sorted(n for n in self._owned if self._mine(n) is not None),
                "pods": {n: v.state for n, v in sorted(self._pods.items())}}

    # ---- the thread: list, then watch from the list's resourceVersion -------------------------
    def _emit(self, kind: str, payload: Any) -> None:
        loop = self._loop
        if loop is None or self._stop.is_set():
            return
        try:
            loop.call_soon_threadsafe(self._queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop closed under us: the gateway is gone
            self._stop.set()

    def _run_thread(self) -> None:
        from kubernetes.client.exceptions import ApiException

        # self.resource_version is the cursor: None lists (again); every event and bookmark
        # advances it, so a watch broken mid-stream resumes after its last event
        self.resource_version = None
        backoff_s = self.cfg.backoff_initial_s
        failed_watches = 0  # in a row; a watch that works resets it
        while not self._stop.is_set():
            watching = False
            try:
                if self.resource_version is None:
                    self._list()
                watching = True
                started = time.monotonic()
                events = self._watch_once()
                if events or time.monotonic() - started >= 1.0:
                    backoff_s = self.cfg.backoff_initial_s
                    failed_watches = 0
                    continue
                problem = "the watch ended at once without events"  # a server that keeps closing
            except ApiException as exc:
                if watching and cursor_unservable(exc):
                    why = "is gone (410)" if exc.status == 410 else f"is too large for the server ({exc.status})"
                    log.info("kubernetes discovery: resourceVersion %s %s: listing again", self.resource_version, why)
                    self.relists_gone += 1
                    self.resource_version = None
                    failed_watches = 0
                    continue
                problem = f"API error {exc.status}: {exc.reason}"
            except Exception as exc:  # connection errors, timeouts, a body that is not JSON
                problem = f"{type(exc).__name__}: {exc}"
            if self._stop.is_set():
                break
            self.errors += 1
            self.last_error = problem
            if watching:
                failed_watches += 1
                if failed_watches >= RELIST_AFTER_FAILED_WATCHES:
                    # the server may never serve this cursor (or a proxy breaks every watch):
                    # a list shows what went meanwhile, deletions included
                    log.warning("kubernetes discovery: %d watches failed in a row (last: %s); listing "
                                "again in %.1fs", failed_watches, problem, backoff_s)
                    self.relists_after_errors += 1
                    self.resource_version = None
                    failed_watches = 0
                    self._stop.wait(backoff_s)
                    backoff_s = min(backoff_s * 2, self.cfg.backoff_max_s)
                    continue
            log.warning("kubernetes discovery: %s; retrying in %.1fs", problem, backoff_s)
            self._stop.wait(backoff_s)
            backoff_s = min(backoff_s * 2, self.cfg.backoff_max_s)

    def _list(self) -> None:
        """List the selected pods; hands them over whole (``sync``) and sets the cursor to the
        list's resourceVersion. Raises ApiException, the transport's errors or ValueError."""
        resp = self._core.list_namespaced_pod(
            self.namespace, label_selector=self.cfg.label_selector, _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_S, LIST_READ_TIMEOUT_S))
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if not isinstance(rv, str) or not rv:
            raise ValueError("pod list without metadata.resourceVersion")
        self.lists += 1
        self._emit("sync", list(body.get("items") or []))
        self.resource_version = rv

    def _watch_once(self) -> int:
        """One watch request from the cursor until the server ends it (``watch_timeout_s``) or
        stop; returns the number of events. Raises ApiException (410 among them) or the
        transport's errors."""
        from kubernetes import watch

        w = watch.Watch(return_type=object)  # objects stay the API's JSON dicts: no model classes
        self._watch = w
        if self._stop.is_set():
            return 0
        self.watches += 1
        events = 0
        try:
            # timeout_seconds makes Watch.stream end with the server's timeout and leave every
            # 410 to us (it would otherwise retry once by itself)
            for event in w.stream(self._core.list_namespaced_pod, self.namespace,
                                  label_selector=self.cfg.label_selector, resource_version=self.resource_version,
                                  allow_watch_bookmarks=True, timeout_seconds=self.cfg.watch_timeout_s,
                                  _request_timeout=(CONNECT_TIMEOUT_S, self.cfg.watch_timeout_s + WATCH_READ_GRACE_S)):
                if self._stop.is_set():
                    w.stop()
                    break
                if not isinstance(event, dict):  # a blank or unparsable line: the client yields None
                    continue
                kind = event.get("type")
                obj = event.get("raw_object") or {}
                events += 1
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._emit(kind, obj)
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if new_rv:
                    self.resource_version = new_rv
        finally:
            self._watch = None
        return events

    # ---- on the loop: apply what the API said -----------------------------------------------
    async def _apply_loop(self) -> None:
        while True:
            kind, payload = await self._queue.get()
            try:
                if kind == "sync":
                    await self._sync(payload)
                elif kind == "expire":
                    await self._expire(payload)
                else:
                    await self._event(kind, payload)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad pod or gateway call must not end discovery
                log.exception("kubernetes discovery: applying %s failed", kind)

    async def _sync(self, pods: list[dict[str, Any]]) -> None:
        views: dict[str, PodView] = {}
        for pod in pods:
            view = self._view(pod)
            if view is not None:
                views[view.name] = view
        listed = {(pod.get("metadata") or {}).get("name") for pod in pods}
        for name in [n for n in self._skipped if n not in listed]:
            del self._skipped[name]
        # each pod on its own: one that fails (logged) must not leave the rest as they were
        for name in sorted((set(self._pods) | set(self._owned)) - set(views)):
            self._pods.pop(name, None)
            await self._guarded(self._remove(name, "not in the pod list any more"), name)
        for view in views.values():
            await self._guarded(self._apply(view), view.name)

    async def _guarded(self, change: Any, name: str) -> None:
        try:
            await change
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kubernetes discovery: applying pod %s failed", name)

    async def _event(self, kind: str, pod: dict[str, Any]) -> None:
        if kind == "DELETED":
            try:
                name = pod_name(pod)
            except ValueError:
                return
            self._pods.pop(name, None)
            self._skipped.pop(name, None)
            await self._remove(name, "pod deleted")
            return
        view = self._view(pod)
        if view is not None:
            await self._apply(view)
            return
        name = (pod.get("metadata") or {}).get("name")
        if isinstance(name, str) and name:  # skipped (a bad role label): as gone
            self._pods.pop(name, None)
            await self._remove(name, f"skipped: {self._skipped.get(name)}")

    def _view(self, pod: dict[str, Any]) -> PodView | None:
        name = (pod.get("metadata") or {}).get("name")
        try:
            view = map_pod(pod, self.cfg)
        except ValueError as exc:  # pydantic's ValidationError is one
            if self._skipped.get(name) != str(exc):
                log.warning("kubernetes discovery: pod %s skipped: %s", name, exc)
            self._skipped[name] = str(exc)
            return None
        self._skipped.pop(name, None)
        return view

    async def _apply(self, view: PodView) -> None:
        before = self._pods.get(view.name)
        self._pods[view.name] = view
        owned = self._owned.get(view.name)
        if owned is not None and owned.uid and view.uid and owned.uid != view.uid:
            # deleted and created again under its name while we did not look (a missed DELETED,
            # a re-list): nothing of the old engine is left, whatever state the new pod is in
            await self._remove(view.name, f"pod replaced (uid {owned.uid} -> {view.uid})")
        if view.state == "gone":
            self._pods.pop(view.name, None)
            await self._remove(view.name, view.reason)
        elif view.state == "ready":
            await self._ready(view)
        else:
            if before is None or before.state != "not_ready":
                log.info("kubernetes discovery: pod %s is not ready (%s)", view.name, view.reason)
            await self._not_ready(view)

    async def _ready(self, view: PodView) -> None:
        name, wcfg = view.name, view.worker
        assert wcfg is not None
        self._not_ready_since.pop(name, None)
        reg = self.gateway.registry.get(name)
        if reg is not None and self._mine(name) is None:
            if name not in self._conflicts:
                self._conflicts.add(name)
                log.warning("kubernetes discovery: pod %s is Ready but a worker of that id was configured "
                            "or added by hand; left alone", name)
            return
        if reg is not None and reg.role != wcfg.role and reg.cfg.model_copy(update={"role": wcfg.role}) == wcfg:
            log.info("kubernetes discovery: pod %s: role %s -> %s (its %s label)", name, reg.role, wcfg.role,
                     self.cfg.role_label)
            reg.set_role(wcfg.role)
        if reg is not None and reg.cfg == wcfg:
            if name in self._drained:
                self._drained.discard(name)
                reg.draining = False
                log.info("kubernetes discovery: pod %s is Ready again: worker undrained", name)
            return
        if reg is not None:  # same pod, new address (a restarted sandbox): register it anew
            await self._remove(name, f"address changed to {wcfg.url}")
        # a pod's IP is its own while it lives: another discovered worker at this URL is a pod
        # whose loss of the address has not reached us yet (an eviction's status write, a
        # deletion still to come): its engine is not there
        for other in [n for n, o in self._owned.items() if n != name and o.reg.url == wcfg.url]:
            if self._mine(other) is not None:
                await self._remove(other, f"its address {wcfg.url} is now pod {name}'s")
        try:
            added = await self.gateway.add_worker(wcfg)
        except ValueError as exc:  # router.errors.WorkerExists among them
            if name not in self._conflicts:
                self._conflicts.add(name)
                log.warning("kubernetes discovery: pod %s not added: %s", name, exc)
            return
        self._conflicts.discard(name)
        self._owned[name] = _Owned(added, view.uid, view.ip)
        log.info("kubernetes discovery: pod %s is Ready: worker added at %s", name, wcfg.url)

    async def _not_ready(self, view: PodView) -> None:
        name = view.name
        reg = self._mine(name)
        if reg is None:
            return
        owned_ip = self._owned[name].ip
        if view.ip != owned_ip:
            # the kubelet clears the IP of a pod it evicts (the phase may say Failed only later,
            # or never reach us): no engine is left at the worker's address to drain
            await self._remove(name, f"pod IP {'cleared' if not view.ip else f'changed to {view.ip}'} "
                                     f"({view.reason})")
            return
        if self.cfg.not_ready_remove_s == 0:
            await self._remove(name, view.reason)
            return
        if name not in self._not_ready_since:
            self._not_ready_since[name] = time.monotonic()
            assert self._loop is not None
            self._loop.call_later(self.cfg.not_ready_remove_s, self._queue.put_nowait, ("expire", name))
        if not reg.draining:
            await self.gateway.drain_worker(name)
            self._drained.add(name)
            log.info("kubernetes discovery: pod %s is not ready: worker drained, removed if still not "
                     "ready in %.0fs", name, self.cfg.not_ready_remove_s)

    async def _expire(self, name: str) -> None:
        since = self._not_ready_since.get(name)
        view = self._pods.get(name)
        if since is None or view is None or view.state != "not_ready":
            return
        if time.monotonic() - since < self.cfg.not_ready_remove_s - 0.05:
            return  # a later not-ready spell: its own timer comes
        await self._remove(name, f"not ready for {self.cfg.not_ready_remove_s:.0f}s ({view.reason})")

    async def _remove(self, name: str, reason: str) -> None:
        """Remove discovery's worker ``name`` (index entries purged, requests in flight finish);
        nothing when it has none registered (never one added by other hands)."""
        self._not_ready_since.pop(name, None)
        self._drained.discard(name)
        self._conflicts.discard(name)
        owned = self._owned.pop(name, None)
        if owned is None or self.gateway.registry.get(name) is not owned.reg:
            return  # none, or removed (maybe re-added by hand) through the admin API meanwhile
        try:
            await self.gateway.remove_worker(name)
        except KeyError:
            return
        log.info("kubernetes discovery: worker %s removed: %s", name, reason)
