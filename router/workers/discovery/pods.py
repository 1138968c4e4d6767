"""Pure mapping from a Kubernetes pod (the API's JSON object, as a dict) to a gateway worker.

No I/O and no ``kubernetes`` import: :mod:`router.workers.discovery.kubernetes` feeds it the pods it
lists and watches. A pod is

- ``ready``: phase Running (or unset), not being deleted, condition ``Ready=True``, a pod IP and
  every configured port resolved: it is the worker ``WorkerConfig(id=<pod name>,
  url=<scheme>://<pod IP>:<port>, model, events=tcp://<pod IP>:<events_port>,
  replay=tcp://<pod IP>:<replay_port>, role=<the pod's role label>)`` (events/replay only when
  configured; role ``both`` when the pod has no ``role_label`` label);
- ``not_ready``: alive but not serving (starting, readiness probe failing, no IP yet, or a named
  port its containers do not declare);
- ``gone``: being deleted (``metadata.deletionTimestamp`` set), finished (phase Succeeded or
  Failed) or evicted (``status.reason`` ``Evicted``, whatever the phase says): it will not serve
  again.

Each view carries the pod's ``uid`` and ``podIP`` too: discovery tells by them that the pod behind
a worker was replaced (same name, another uid) or lost its address (IP cleared or changed), which
leaves nothing of the registered worker to keep.

Port fields of the config take a number (used as is) or a containerPort ``name`` looked up in the
pod's ``spec.containers[*].ports`` (first match in container order), so pods may publish different
port numbers under one name.

A pod whose role label is not ``prefill``, ``decode`` or ``both`` is no worker at all
(:func:`map_pod` raises ValueError; discovery skips it with a warning): serving it as ``both``
would send whole requests to a pod its operator meant for one leg.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from router.config.discovery import KubernetesDiscoveryConfig, PortRef
from router.config.schema import WORKER_ROLES, WorkerConfig

PodState = Literal["ready", "not_ready", "gone"]


@dataclass(frozen=True)
class PodView:
    """What one pod means to the gateway. ``name``: the pod name (the worker id); ``state``: see
    the module docstring; ``worker``: the worker to register (only when ``state == "ready"``);
    ``reason``: why it is not ready or gone ("" when ready); ``resource_version``: the pod's
    ``metadata.resourceVersion``, ``uid``: its ``metadata.uid``, ``ip``: its ``status.podIP``
    (each None when absent)."""

    name: str
    state: PodState
    worker: WorkerConfig | None
    reason: str
    resource_version: str | None
    uid: str | None = None
    ip: str | None = None


def pod_name(pod: dict[str, Any]) -> str:
    """``metadata.name`` of a pod dict. Raises ValueError when it has none."""
    name = (pod.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("pod without metadata.name")
    return name


def resolve_port(pod: dict[str, Any], ref: PortRef) -> int | None:
    """``ref`` itself when a number; else the ``containerPort`` named ``ref`` in the pod's
    containers (first in container order), or None when no container declares it."""
    if isinstance(ref, int):
        return ref
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == ref and isinstance(port.get("containerPort"), int):
                return port["containerPort"]
    return None


def pod_role(pod: dict[str, Any], label: str) -> str:
    """The pod's role from its ``label`` label (``both`` when absent). Raises ValueError when
    the value is not one of ``prefill``, ``decode``, ``both``."""
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(label)
    if value is None:
        return "both"
    if value not in WORKER_ROLES:
        raise ValueError(f"label {label}={value!r} is not one of {', '.join(WORKER_ROLES)}")
    return value


def _is_ready(status: dict[str, Any]) -> bool:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP goes in brackets in a URL or endpoint


def map_pod(pod: dict[str, Any], cfg: KubernetesDiscoveryConfig) -> PodView:
    """The gateway's view of ``pod`` (a Pod as the API serves it in JSON: ``metadata``, ``spec``,
    ``status``) under ``cfg``. Raises ValueError when the pod has no name, its name cannot be
    a worker id, or its role label is bad (:func:`pod_role`; not checked on a pod that is gone)."""
    name = pod_name(pod)
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    rv = meta.get("resourceVersion")
    uid = meta.get("uid") if isinstance(meta.get("uid"), str) and meta.get("uid") else None
    ip = status.get("podIP") if isinstance(status.get("podIP"), str) and status.get("podIP") else None

    def view(state: PodState, reason: str, worker: WorkerConfig | None = None) -> PodView:
        return PodView(name, state, worker, reason, rv, uid, ip)

    if meta.get("deletionTimestamp"):
        return view("gone", "terminating")
    phase = status.get("phase")
    if phase in ("Succeeded", "Failed"):
        why = f" ({status['reason']})" if isinstance(status.get("reason"), str) and status.get("reason") else ""
        return view("gone", f"phase {phase}{why}")
    if status.get("reason") == "Evicted":
        return view("gone", "evicted")
    role = pod_role(pod, cfg.role_label)
    if phase not in (None, "Running"):
        return view("not_ready", f"phase {phase}")
    if not _is_ready(status):
        return view("not_ready", "condition Ready is not True")
    if not ip:
        return view("not_ready", "no pod IP")
    ports: dict[str, int | None] = {}
    for field in ("port", "events_port", "replay_port"):
        ref = getattr(cfg, field)
        if ref is None:
            ports[field] = None
            continue
        number = resolve_port(pod, ref)
        if number is None:
            return view("not_ready", f"no containerPort named {ref!r} ({field})")
        ports[field] = number
    host = _host(ip)
    events = f"tcp://{host}:{ports['events_port']}" if ports["events_port"] else None
    replay = f"tcp://{host}:{ports['replay_port']}" if ports["replay_port"] else None
    worker = WorkerConfig(id=name, url=f"{cfg.scheme}://{host}:{ports['port']}", model=cfg.model,
                          events=events, replay=replay, role=role)
    return view("ready", "", worker)
