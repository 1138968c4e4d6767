"""``/admin/*`` (DESIGN.md "Admin HTTP"), behind a bearer token; 401 without it.

| method path | answer |
|---|---|
| GET /admin/workers | ``{"workers": [worker entry + {"blocks": {gpu, cpu, ssd}, "speculative_blocks", "peer"}], "models": {model: {"prefill_rate"}}}`` (``models``: each base model's TTFT line learned from all of its workers, the entry's ``prefill_rate`` shape, as published: a refit within 5% of it leaves it and its ``samples`` as they were, :data:`router.estimates.prefill_rate.MODEL_LINE_TOLERANCE`; a worker's ``prefill_rate.speed_factor``: its TTFTs over that line's, the median, which ``ttft`` scales the line by, null until known; ``peer``: the worker's peer-pull state as routing uses it, :class:`router.estimates.peer_credit.PeerInfo`: ``serve``, ``pull``, ``block_bytes``, ``block_size``, ``link_bytes_per_s``, ``pull_overhead_ms``, ``pulls``, ``pulled_blocks``, ``failed_pulls``, ``skipping`` (peers its agent skips after failed pulls); null when its agent publishes none) |
| POST /admin/workers | body: a config worker ``{id?, url, model, events?, replay?, role?}`` -> 201 the entry; 400 bad, 409 id taken |
| PUT /admin/workers/{id}/role | body ``{"role": R}`` (R: "both", "prefill" or "decode") -> 200 the entry with its new ``role`` (requests in flight keep their leg); 400 bad role, 404 unknown |
| DELETE /admin/workers/{id} | 200 ``{"removed": id}``; index entries purged, in-flight requests finish; 404 unknown |
| POST /admin/workers/{id}/drain[?wait_s=S] | 200 the entry (``draining: true``; ``drained: true`` once its in-flight count is 0; with ``wait_s`` the answer waits up to S s for that); 404 unknown |
| GET /admin/policy | the live policy mapping (the config's ``policy`` section) |
| PUT /admin/policy | body: a policy mapping; validated and swapped atomically; 200 the new mapping, 400 bad |
| GET /admin/index | ``{"backend", "workers": {id: {"blocks", "speculative_blocks", "kv_events"}}}`` (``kv_events``: the embedded ingestor's, or with Redis the worker's agent's, seq, event age, gaps, replays, resyncs; null without one); ``lookup_passes``: ``native`` where the C extension of the lookups over many workers is built, else ``numpy`` (kvcore/index/chain_rows.py); with ``--processes N`` also ``"host_index"``: the shared index's ``keys``, ``holder_sets``, ``evicted_keys``, ``dropped_keys``, ``takeovers``, ``writer_pid``, ``writer`` (this process), bounds and file bytes |
| POST /admin/explain[?path] | a chat or completions body (or the body of routed ``path``, e.g. ``/v1/messages``) -> ``{"prompt_tokens", "blocks", "candidates", "chosen", "reason", ...}``; nothing is sent. A candidate a peer can supply blocks to also has ``peer_blocks``, ``peer_worker``, ``peer_credit`` (the weight per block) and ``peer_credit_source`` (``config``, ``measured``, ``prior``, ``unknown_block_bytes``) |
| GET /admin/decisions[?limit=N&worker=ID&since_unix_s=T] | ``{"decisions": [...], "kept", "recorded"}``: recent decisions of real traffic, newest first (:mod:`router.route.decision_log`); 400 bad limit |
| GET /admin/summary[?window_s=W&bucket_s=B] | the decisions of the last W s (default 300) in counts and B-second buckets (default 10): ``{"totals", "hit_rate", "predicted_hit_rate", "by_reason", "by_worker", "series": [...], ...}`` (:meth:`router.route.decision_log.DecisionLog.summary`; drawn by ``GET /dashboard``); 400 bad window or bucket |

Errors use the OpenAI error shape. The routes an offload agent uses with the gateway's index
(``POST /admin/index/match``, ``GET /admin/peers``, ``PUT``/``DELETE /admin/workers/{id}/peer``)
are in :mod:`router.edge.admin_peers`.

With ``kvroute serve --processes N`` (:mod:`router.processes.group`): a change (workers added, removed,
drained or given a role, a new policy) is applied by the process that gets it and then sent to every
sibling; ``/admin/decisions`` and ``/admin/summary`` merge every process's decisions; worker
counts are every process's.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from functools import partial
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from kvcore.index import chain_rows
from kvcore.index.base import SupportsWorkerStates
from kvcore.index.errors import IndexUnavailable
from kvcore.index.host import HostIndex
from router.config.schema import WORKER_ROLES, WorkerConfig, validation_message
from router.edge.admin_peers import add_peer_routes
from router.edge.endpoints import parse_json_object
from router.errors import GatewayError, WorkerExists, bad_request
from router.gateway import Gateway
from router.processes.group import is_from_sibling
from router.route.decision_log import (DEFAULT_SUMMARY_BUCKET_S, DEFAULT_SUMMARY_WINDOW_S, SummaryWindowError,
                                       merge_summaries)
from router.route.prompt_blocks import ROUTED_PATHS

log = logging.getLogger("kvroute.admin")


MAX_DRAIN_WAIT_S = 3600.0
DRAIN_POLL_S = 0.05


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _not_found(worker_id: str) -> GatewayError:
    return GatewayError(404, f"no worker {worker_id!r}", "not_found_error", "worker_not_found", "id")


def _json_text(value: Any, limit: int = 200) -> str:
    """``value`` as JSON text cut to ``limit`` characters (for error messages)."""
    text = orjson.dumps(value).decode()
    return text if len(text) <= limit else text[:limit] + "..."


def _first_field(exc: ValidationError) -> str | None:
    errors = exc.errors()
    loc = errors[0].get("loc") if errors else None
    return str(loc[0]) if loc else None


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]  # the app's gateway (router.edge.app sets app.state)


def require_token(request: Request) -> None:
    expected = request.app.state.gateway.admin_token
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not expected or scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
        raise GatewayError(401, "admin API needs 'Authorization: Bearer <admin token>'",
                           "authentication_error", "invalid_admin_token")


async def index_stats(gateway: Gateway) -> dict[str, Any]:
    try:
        return await gateway.index.stats()
    except IndexUnavailable as exc:  # Redis down: routing goes on on load alone; say so here
        raise GatewayError(503, str(exc), "service_unavailable", "index_unavailable") from None


async def agent_states(gateway: Gateway) -> dict[str, dict[str, Any]]:
    # a shared index (Redis): each worker's agent publishes its ingest state there
    if not isinstance(gateway.index, SupportsWorkerStates):
        return {}
    try:
        return await gateway.index.worker_states()
    except IndexUnavailable:
        return {}


async def list_workers(gateway: GatewayDep) -> Response:
    stats = await index_stats(gateway)
    agents = await agent_states(gateway)
    out = []
    for reg in gateway.registry.all():
        entry = reg.describe()
        if entry.get("kv_events") is None:
            entry["kv_events"] = agents.get(reg.id)
        st = stats.get(reg.id)
        entry["blocks"] = dict(st.blocks) if st else {"gpu": 0, "cpu": 0, "ssd": 0}
        entry["speculative_blocks"] = st.speculative_blocks if st else 0
        peer = gateway.peers.get(reg.id)
        entry["peer"] = peer.as_dict() if peer is not None else None
        speed = gateway.registry.prefill_speed(reg)
        entry["prefill_rate"]["speed_factor"] = round(speed[0], 3) if speed is not None else None
        out.append(entry)
    models = {m: {"prefill_rate": gateway.registry.model_rate(m).state()}
              for m in sorted({reg.model for reg in gateway.registry.all()})}
    return _json({"workers": out, "models": models})


async def to_siblings(gateway: Gateway, request: Request, method: str, path: str, body: Any = None) -> None:
    """Send a change this process applied to the other gateway processes (not when it came
    from one of them)."""
    group = gateway.group
    if group is None or is_from_sibling(request.headers):
        return
    import orjson

    raw = orjson.dumps(body) if body is not None else None
    for index, status, answer in await group.fanout(method, path, raw, {"content-type": "application/json"}):
        if status >= 300:
            log.warning("gateway process %d answered %d to %s %s: %s", index, status, method, path,
                        answer[:300].decode("utf-8", "replace"))


async def add_worker(gateway: GatewayDep, request: Request) -> Response:
    body = parse_json_object(await request.body())
    try:
        wcfg = WorkerConfig.model_validate(body)
    except ValidationError as exc:
        raise bad_request(f"invalid worker: {validation_message(exc)}", _first_field(exc)) from None
    if wcfg.data_parallel_size > 1:
        raise bad_request("add one data parallel rank per request (data_parallel_rank), not data_parallel_size",
                          "data_parallel_size")
    try:
        reg = await gateway.add_worker(wcfg)
    except WorkerExists as exc:
        raise GatewayError(409, str(exc), "invalid_request_error", "worker_exists", "id") from None
    except ValueError as exc:
        raise bad_request(str(exc), "model") from None
    await to_siblings(gateway, request, "POST", "/admin/workers", {**body, "id": reg.id})
    return _json(reg.describe(), 201)


async def remove_worker(gateway: GatewayDep, worker_id: str, request: Request) -> Response:
    try:
        await gateway.remove_worker(worker_id)
    except KeyError:
        raise _not_found(worker_id) from None
    await to_siblings(gateway, request, "DELETE", f"/admin/workers/{worker_id}")
    return _json({"removed": worker_id})


async def drain_worker(gateway: GatewayDep, worker_id: str, request: Request, wait_s: float = 0.0) -> Response:
    if not 0 <= wait_s <= MAX_DRAIN_WAIT_S:
        raise bad_request(f"wait_s must be in 0..{MAX_DRAIN_WAIT_S:g}", "wait_s")
    try:
        reg = await gateway.drain_worker(worker_id)
    except KeyError:
        raise _not_found(worker_id) from None
    await to_siblings(gateway, request, "POST", f"/admin/workers/{worker_id}/drain")
    deadline = asyncio.get_running_loop().time() + wait_s
    while reg.total_in_flight > 0 and asyncio.get_running_loop().time() < deadline and not reg.removed:
        await asyncio.sleep(DRAIN_POLL_S)
    return _json(reg.describe())


async def set_worker_role(gateway: GatewayDep, worker_id: str, request: Request) -> Response:
    body = parse_json_object(await request.body())
    role = body.get("role")
    if set(body) != {"role"} or role not in WORKER_ROLES:
        raise bad_request(f"body must be {{\"role\": one of {', '.join(WORKER_ROLES)}}}, got "
                          f"{_json_text(body)}", "role")
    try:
        reg = await gateway.set_worker_role(worker_id, role)
    except KeyError:
        raise _not_found(worker_id) from None
    await to_siblings(gateway, request, "PUT", f"/admin/workers/{worker_id}/role", {"role": role})
    return _json(reg.describe())


async def get_policy(gateway: GatewayDep) -> Response:
    return _json(gateway.policy.config)


async def put_policy(gateway: GatewayDep, request: Request) -> Response:
    body = parse_json_object(await request.body())
    try:
        gateway.set_policy(body)
    except ValueError as exc:
        raise bad_request(f"invalid policy: {exc}", "policy") from None
    await to_siblings(gateway, request, "PUT", "/admin/policy", body)
    return _json(gateway.policy.config)


async def get_index(gateway: GatewayDep) -> Response:
    stats = await index_stats(gateway)
    workers: dict[str, Any] = {}
    for wid, st in stats.items():
        workers[wid] = {"blocks": dict(st.blocks), "speculative_blocks": st.speculative_blocks}
    agents = await agent_states(gateway)  # with Redis: also workers whose agent runs but not registered here
    for wid in [reg.id for reg in gateway.registry.all()] + list(agents):
        workers.setdefault(wid, {"blocks": {"gpu": 0, "cpu": 0, "ssd": 0}, "speculative_blocks": 0})
    for wid, entry in workers.items():
        reg = gateway.registry.get(wid)
        state = reg.event_state() if reg is not None else None
        entry["kv_events"] = state if state is not None else agents.get(wid)
    out: dict[str, Any] = {"backend": gateway.cfg.index.backend, "workers": workers,
                           "lookup_passes": "native" if chain_rows.NATIVE else "numpy"}
    if hasattr(gateway.index, "__len__"):
        out["keys"] = len(gateway.index)
    if hasattr(gateway.index, "dropped_keys"):
        out["dropped_keys"] = gateway.index.dropped_keys
    if isinstance(gateway.index, HostIndex):
        host = gateway.index
        out["host_index"] = {**host.counters(), "writer": host.writer, "max_keys": host.max_keys,
                             "max_workers": host.max_workers, "max_holder_sets": host.max_holder_sets,
                             **{f"file_{k}_bytes": v for k, v in host.file_bytes().items()}}
    return _json(out)


async def list_decisions(gateway: GatewayDep, request: Request, limit: int | None = None, worker: str | None = None,
                         since_unix_s: float | None = None) -> Response:
    if limit is not None and limit < 1:
        raise bad_request("limit must be >= 1", "limit")
    ring = gateway.decisions
    out = {"decisions": ring.snapshot(limit, worker, since_unix_s), "kept": ring.capacity,
           "recorded": ring.recorded}
    if gateway.group is not None and not is_from_sibling(request.headers):
        query = f"?{request.url.query}" if request.url.query else ""
        for _, status, answer in await gateway.group.fanout("GET", "/admin/decisions" + query):
            if status == 200:
                theirs = orjson.loads(answer)
                out["decisions"] += theirs["decisions"]
                out["kept"] += theirs["kept"]
                out["recorded"] += theirs["recorded"]
        out["decisions"].sort(key=lambda d: d["time_unix_s"], reverse=True)
        out["decisions"] = out["decisions"][:limit]
    return _json(out)


async def summarize_decisions(gateway: GatewayDep, request: Request, window_s: float = DEFAULT_SUMMARY_WINDOW_S,
                              bucket_s: float = DEFAULT_SUMMARY_BUCKET_S) -> Response:
    try:
        out = gateway.decisions.summary(window_s, bucket_s)
    except SummaryWindowError as exc:
        raise bad_request(str(exc), exc.param) from None
    if gateway.group is not None and not is_from_sibling(request.headers):
        theirs = [orjson.loads(answer) for _, status, answer in await gateway.group.fanout(
            "GET", f"/admin/summary?window_s={window_s!r}&bucket_s={bucket_s!r}") if status == 200]
        out = merge_summaries([out, *theirs])
    return _json(out)


async def explain(gateway: GatewayDep, request: Request) -> Response:
    raw = await request.body()
    body = parse_json_object(raw)
    path = request.query_params.get("path")
    if path is None:
        kind = "chat" if "messages" in body else "completion"
    elif path in ROUTED_PATHS:
        kind = ROUTED_PATHS[path]
    else:
        raise bad_request(f"path must be one of {', '.join(ROUTED_PATHS)}", "path")
    plan = await gateway.router.plan(kind, body, request.scope["headers"], raw, explain=True)
    return _json(plan.explain())


def make_admin_router(gateway: Gateway) -> APIRouter:
    """The admin routes of the module docstring, behind :func:`require_token`, for the app whose
    ``state.gateway`` is ``gateway``."""
    api = APIRouter(prefix="/admin", dependencies=[Depends(require_token)])
    add_peer_routes(api, gateway, partial(to_siblings, gateway))
    api.add_api_route("/workers", list_workers, methods=["GET"])
    api.add_api_route("/workers", add_worker, methods=["POST"])
    api.add_api_route("/workers/{worker_id}", remove_worker, methods=["DELETE"])
    api.add_api_route("/workers/{worker_id}/drain", drain_worker, methods=["POST"])
    api.add_api_route("/workers/{worker_id}/role", set_worker_role, methods=["PUT"])
    api.add_api_route("/policy", get_policy, methods=["GET"])
    api.add_api_route("/policy", put_policy, methods=["PUT"])
    api.add_api_route("/index", get_index, methods=["GET"])
    api.add_api_route("/decisions", list_decisions, methods=["GET"])
    api.add_api_route("/summary", summarize_decisions, methods=["GET"])
    api.add_api_route("/explain", explain, methods=["POST"])
    return api
