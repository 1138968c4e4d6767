"""``kvroute bench rig``: N workers, then each router in turn on the same workers, the same
workload through each, one table.

Sequence: start the workers (``kvroute sim`` or vLLM, launched as ``kvroute up`` launches them,
with ``VLLM_SERVER_DEV_MODE=1`` so their prefix caches can be reset); for each router: start it in
front of every worker, wait until it routes, empty every worker's prefix cache (and, for kvroute,
wait until its index has heard the clears), replay the workload with the workers' counters read
before and after, stop the router. The workers run through the whole rig, so every router meets the
same engines; only their caches are reset.

Routers are named ``kvroute:<policy>`` (a gateway started with ``kvroute serve``, its embedded index
fed by the workers' KV events; ``<policy>`` a policy name or a label given by ``--policy-config``),
``kvroute-pd:<policy>`` (the same gateway with the workers' roles from ``RigSpec.roles`` and
``policy.pd`` on: prefill-decode disaggregation, vLLM's ``kv_transfer_params`` protocol)
or a key of :data:`kvbench.peers.PEERS` (peers that are not installed are skipped, and said so),
or with roles a key of :data:`kvbench.peers_pd.PD_PEERS` (a peer's own P/D mode). A P/D run
also reports what the workers' counters say of it (:func:`kvbench.peers_pd.engine_split`).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from kvbench import workers as worker_http
from kvbench.client import send
from kvbench.cpu import CpuMeter, cpu_report
from kvbench.peers import PEERS, RigWorker, RouterLaunch
from kvbench.peers_pd import PD_PEERS, engine_counters, engine_split
from kvbench.runner import RunSettings, Target, run_target
from kvbench.ttft_split import describe, ttft_split
from kvbench.workload import Workload
from kvroute.up import Cluster, free_ports, wait_cluster_ready

ADMIN_TOKEN_ENV = "KVROUTE_ADMIN_TOKEN"
INDEX_CLEAR_TIMEOUT_S = 15.0
ROUTER_READY_TIMEOUT_S = 120.0
GATEWAY_SETTLE_S = 3.0
RIG_DECISIONS_KEPT = 20_000  # the whole decision log of a run (a few MiB per thousand requests)


@dataclass
class RigSpec:
    """What the rig starts. ``engine``: ``sim`` or ``vllm``; ``worker_argv``: builds worker i's
    (argv, env) from its ports; ``policy_configs``: kvroute policy label -> policy config;
    ``reset_tiers``: the workers run kvroute's KV connector with tiers, which the reset between
    routers empties as well."""

    workers: int
    engine: str
    model_dir: Path
    served_model_name: str
    block_size: int
    log_dir: Path
    worker_argv: Any  # callable (i, port, events_cfg) -> (argv, env)
    policy_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    ready_timeout_s: float = 900.0
    gateway_processes: int = 1  # kvroute serve --processes for every kvroute target
    reset_tiers: bool = False  # the workers have CPU tiers: empty them too between routers
    roles: list[str] | None = None  # P/D: worker i's role (prefill | decode) for kvroute-pd targets
    pd_policy: dict[str, Any] = field(default_factory=dict)  # P/D: policy.pd besides enabled (min_prefill_tokens)


KVROUTE_PREFIXES = ("kvroute:", "kvroute-pd:")


def is_kvroute(name: str) -> bool:
    """True for a router the rig runs as a kvroute gateway (unified or P/D)."""
    return name.startswith(KVROUTE_PREFIXES)


WARM_UP_REQUESTS = 8  # per worker, two at a time


def warm_up(workers: list[RigWorker], workload: Workload, model: str, timeout_s: float) -> None:
    """Send each worker the workload's first ``WARM_UP_REQUESTS`` requests directly, two at a
    time, before any router runs. A real engine compiles kernels and allocates buffers on its
    first prefills and batches (a cold vLLM-CPU worker with a CPU tier took 1.4 s for its first
    prefills, ~0.1 s later on), and the rig's first router would pay for it alone, once per rig;
    the prefix caches are reset before every router anyway. Raises RuntimeError naming the
    worker and the error when a warm-up request fails."""
    requests = workload.requests[:WARM_UP_REQUESTS]

    async def one(session: aiohttp.ClientSession, w: RigWorker) -> list[str]:
        errors = []
        for i in range(0, len(requests), 2):
            recs = await asyncio.gather(*(send(session, w.url, r, model, 0.0, timeout_s) for r in requests[i:i + 2]))
            errors += [f"{w.id}: {rec.error}" for rec in recs if rec.error]
        return errors

    async def every() -> list[str]:
        async with aiohttp.ClientSession() as session:
            found = await asyncio.gather(*(one(session, w) for w in workers))
        return [e for errors in found for e in errors]

    errors = asyncio.run(every())
    if errors:
        raise RuntimeError(f"warm-up requests failed: {'; '.join(errors[:3])}")


def start_workers(spec: RigSpec, cluster: Cluster) -> list[RigWorker]:
    """Start every worker and wait until each answers ``/health``. Raises RuntimeError /
    TimeoutError (from :func:`kvroute.up.wait_cluster_ready`) when one dies or never answers."""
    ports = free_ports(3 * spec.workers)
    out = []
    for i in range(spec.workers):
        port, ev, replay = ports[3 * i:3 * i + 3]
        # topic "": vLLM's default; vllm-router's P/D KV index drops events on any other topic
        events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                      "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{replay}"}
        argv, env = spec.worker_argv(i, port, events_cfg)
        url = f"http://127.0.0.1:{port}"
        cluster.start(f"w{i}", argv, spec.log_dir, url + "/health", {**(env or {}), "VLLM_SERVER_DEV_MODE": "1"})
        out.append(RigWorker(f"w{i}", url, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{replay}"))
    wait_cluster_ready(cluster, spec.ready_timeout_s, sys.stderr)
    return out


def kvroute_launch(spec: RigSpec, policy: dict[str, Any], port: int, workers: list[RigWorker],
                   label: str, roles: list[str] | None = None) -> RouterLaunch:
    """A ``kvroute serve`` gateway in front of ``workers`` with ``policy`` (embedded index);
    ``roles``: worker i's role (the config's ``role``), None for every worker ``both``."""
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"token_env": ADMIN_TOKEN_ENV},
        "models": [{"name": spec.served_model_name, "tokenizer": str(spec.model_dir.resolve()),
                    "block_size": spec.block_size}],
        "index": {"backend": "memory"},
        "workers": [{"id": w.id, "url": w.url, "model": spec.served_model_name, "events": w.events,
                     "replay": w.replay, **({"role": roles[i]} if roles else {})} for i, w in enumerate(workers)],
        "policy": policy,
        "routing": {"decisions_kept": RIG_DECISIONS_KEPT},
    }
    path = spec.log_dir / f"{label.replace(':', '-')}.yaml"
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return RouterLaunch([sys.executable, "-m", "kvroute", "serve", "--config", str(path),
                         "--processes", str(spec.gateway_processes)], {},
                        f"http://127.0.0.1:{port}", "/health", f"http://127.0.0.1:{port}/metrics")


def _admin_get(base: str, path: str) -> dict[str, Any]:
    r = httpx.get(base + path, headers={"Authorization": f"Bearer {os.environ[ADMIN_TOKEN_ENV]}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def _wait_until(cond, timeout_s: float, what: str) -> None:
    _, ok = worker_http.poll_until(cond, bool, timeout_s, interval_s=0.2)
    if not ok:
        raise TimeoutError(f"{what} not within {timeout_s:.0f}s")


def _kvroute_ready(base: str, n: int) -> bool:
    try:
        ws = _admin_get(base, "/admin/workers")["workers"]
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return len(ws) == n and all(w.get("healthy") for w in ws)


def _index_empty(base: str) -> bool:
    try:
        ws = _admin_get(base, "/admin/index")["workers"]
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return all(sum(w["blocks"].values()) == 0 for w in ws.values())


def kvroute_note(metrics_text: str) -> dict[str, Any]:
    """What a kvroute gateway's ``/metrics`` tells of its run: decisions by reason
    (``kvroute_route_decisions_total``) and predicted against worker-reported cached tokens
    (``kvroute_predicted_cached_tokens`` / ``kvroute_actual_cached_tokens`` sums, and the mean
    absolute error per request from ``kvroute_cached_tokens_error_tokens``), decisions that went
    past the longest prefix holder by reason (``kvroute_route_off_longest_prefix_total``), and
    the mean observed / predicted TTFT (``kvroute_ttft_prediction_ratio``), and P/D requests by
    outcome (``kvroute_pd_requests_total``: split, whole, prefill_failed, prefill_rejected; empty
    without P/D)."""
    from prometheus_client.parser import text_string_to_metric_families

    reasons: dict[str, float] = {}
    off_longest: dict[str, float] = {}
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for smp in fam.samples:
            if smp.name == "kvroute_route_decisions_total":
                reasons[smp.labels.get("reason", "")] = reasons.get(smp.labels.get("reason", ""), 0) + smp.value
            elif smp.name == "kvroute_route_off_longest_prefix_total":
                label = smp.labels.get("reason", "")
                off_longest[label] = off_longest.get(label, 0) + smp.value
            elif smp.name.endswith(("_sum", "_count")) and smp.name.startswith("kvroute_"):
                sums[smp.name] = sums.get(smp.name, 0.0) + smp.value
    pd = {}
    for fam in text_string_to_metric_families(metrics_text):
        for smp in fam.samples:
            if smp.name == "kvroute_pd_requests_total":
                pd[smp.labels.get("outcome", "")] = pd.get(smp.labels.get("outcome", ""), 0) + int(smp.value)
    n = sums.get("kvroute_cached_tokens_error_tokens_count", 0.0)
    ratio_n = sums.get("kvroute_ttft_prediction_ratio_count", 0.0)
    return {"decisions_by_reason": {k: int(v) for k, v in sorted(reasons.items())},
            "off_longest_prefix_by_reason": {k: int(v) for k, v in sorted(off_longest.items())},
            "ttft_observed_over_predicted_mean": (sums.get("kvroute_ttft_prediction_ratio_sum", 0.0) / ratio_n
                                                  if ratio_n else None),
            "predicted_cached_tokens": int(sums.get("kvroute_predicted_cached_tokens_sum", 0)),
            "reported_cached_tokens": int(sums.get("kvroute_actual_cached_tokens_sum", 0)),
            "reported_requests": int(sums.get("kvroute_actual_cached_tokens_count", 0)),
            "pd_requests_by_outcome": dict(sorted(pd.items())),
            "cached_tokens_mae": sums.get("kvroute_cached_tokens_error_tokens_sum", 0.0) / n if n else None}


def pd_share(by_outcome: dict[str, int]) -> dict[str, Any]:
    """The split of a P/D run's requests from the gateway's ``kvroute_pd_requests_total`` counts
    by outcome: ``{"split", "whole", "prefill_failed", "prefill_rejected", "split_share",
    "describe"}`` (share of split requests among all counted, None when none was counted)."""
    counts = {k: int(by_outcome.get(k, 0)) for k in ("split", "whole", "prefill_failed", "prefill_rejected")}
    total = sum(counts.values())
    share = counts["split"] / total if total else None
    text = (f"{counts['split']} split, {counts['whole']} whole, {counts['prefill_failed']} prefill failed"
            + (f", {counts['prefill_rejected']} prefill rejected (4xx)" if counts["prefill_rejected"] else "")
            + (f" ({share:.0%} split)" if share is not None else " (no P/D counter: the gateway has no P/D path?)"))
    return {**counts, "split_share": share, "describe": text}


def save_decisions(decisions: list[dict[str, Any]], log_dir: Path, name: str) -> Path:
    """Write a kvroute gateway's decision log of one run (``GET /admin/decisions``, oldest first)
    to ``log_dir/decisions-<name>-<n>.json``, n counting the runs of that router; returns the
    path. Each entry's ``request_id`` starts with the workload index (``bench-<i>-...``)."""
    stem = f"decisions-{name.replace(':', '-')}"
    n = sum(1 for _ in log_dir.glob(f"{stem}-*.json"))
    path = log_dir / f"{stem}-{n}.json"
    path.write_text(json.dumps(list(reversed(decisions))))
    return path


def launch_router(name: str, spec: RigSpec, workers: list[RigWorker], port: int) -> RouterLaunch:
    """The launch of router ``name`` (module docstring). Raises KeyError for an unknown name."""
    if is_kvroute(name):
        label = name.split(":", 1)[1]
        policy = spec.policy_configs.get(label, {"name": label})
        if name.startswith("kvroute-pd:"):
            if not spec.roles:
                raise ValueError(f"{name} needs worker roles (bench rig --pd P:D)")
            policy = {**policy, "pd": {**spec.pd_policy, "enabled": True}}
            return kvroute_launch(spec, policy, port, workers, name, spec.roles)
        return kvroute_launch(spec, policy, port, workers, name)
    if name in PD_PEERS:
        if not spec.roles:
            raise ValueError(f"{name} needs worker roles (bench rig --pd P:D)")
        return PD_PEERS[name].launch_pd(port, workers, spec.roles, spec.model_dir, spec.served_model_name,
                                        spec.block_size, spec.log_dir)
    return PEERS[name].launch(port, workers, spec.model_dir, spec.served_model_name, spec.block_size)


def run_router(name: str, spec: RigSpec, workers: list[RigWorker], workload: Workload,
               settings: RunSettings, cluster: Cluster) -> dict[str, Any]:
    """Start router ``name``, reset the caches, replay the workload, stop it; its report entry
    (a ``note`` says what a peer's metrics tell of its KV-event path)."""
    port = free_ports(1)[0]
    launch = launch_router(name, spec, workers, port)
    child = cluster.start(f"router-{name.replace(':', '-')}", launch.argv, spec.log_dir,
                          launch.base_url + launch.ready_path, launch.env)
    try:
        wait_cluster_ready(cluster, ROUTER_READY_TIMEOUT_S, sys.stderr)
        if is_kvroute(name):
            _wait_until(lambda: _kvroute_ready(launch.base_url, len(workers)), ROUTER_READY_TIMEOUT_S,
                        f"{name} seeing every worker healthy")
        for w in workers:
            worker_http.reset_prefix_cache(w.url, spec.served_model_name, external=spec.reset_tiers)
        if is_kvroute(name):
            _wait_until(lambda: _index_empty(launch.base_url), INDEX_CLEAR_TIMEOUT_S, f"{name}'s index emptied")
        worker_ids = {w.id for w in workers}
        worker_pids = [c.popen.pid for c in cluster.children if c.name in worker_ids]
        pd_run = name.startswith("kvroute-pd:") or name in PD_PEERS
        counters_before = _engine_counters(workers) if pd_run else {}
        engine_ttft_before = _engine_ttft(workers)
        meter = CpuMeter({"router": [child.popen.pid], "workers": worker_pids})
        meter.start()
        result = run_target(Target(name, launch.base_url), workload, settings)
        result["cpu"] = cpu_report(meter.stop(), result["requests"], result["duration_s"])
        result["engine_ttft_ms"] = engine_ttft_report(engine_ttft_before, _engine_ttft(workers),
                                                      result["ttft_ms"]["mean"])
        if pd_run:
            engine = _engine_split(workers, spec.roles or [], counters_before, result["requests"] - result["errors"])
        if is_kvroute(name):
            ok = result["requests"] - result["errors"]
            # the gateway books a request's usage as its stream ends: wait until all are booked
            gw, _ = worker_http.poll_until(lambda: kvroute_note(httpx.get(launch.metrics_url, timeout=10).text),
                                           lambda note: note["reported_requests"] >= ok, GATEWAY_SETTLE_S)
            result["gateway"] = gw
            gw["workers"] = {w["id"]: {k: w.get(k) for k in ("prefill_rate", "evidence")}
                             for w in _admin_get(launch.base_url, "/admin/workers")["workers"]}
            decisions = _admin_get(launch.base_url, "/admin/decisions")["decisions"]
            save_decisions(decisions, spec.log_dir, name)
            split = ttft_split(result.get("records", []), decisions)
            gw["ttft_split_ms"] = split
            reasons = ", ".join(f"{k} {v}" for k, v in gw["decisions_by_reason"].items())
            result["note"] = (f"decisions: {reasons}; predicted cached tokens {gw['predicted_cached_tokens']}, "
                              f"reported {gw['reported_cached_tokens']} (usage booked for {gw['reported_requests']} "
                              f"of {ok} requests)")
            off = sum(gw["off_longest_prefix_by_reason"].values())
            if off:
                result["note"] += f"; {off} sent past the longest prefix holder"
            if gw["ttft_observed_over_predicted_mean"] is not None:
                result["note"] += f"; TTFT observed/predicted mean {gw['ttft_observed_over_predicted_mean']:.2f}"
            if split is not None:
                result["note"] += f"; {describe(split)}"
            if name.startswith("kvroute-pd:"):
                result["pd"] = {**pd_share(gw["pd_requests_by_outcome"]), "engine": engine}
                result["note"] += "; P/D: " + result["pd"]["describe"] + "; " + engine["describe"]
        elif launch.metrics_url:
            peer = PD_PEERS.get(name) or PEERS[name]
            try:
                note = peer.event_path(httpx.get(launch.metrics_url, timeout=10).text)
            except httpx.HTTPError as exc:
                note = f"metrics unreadable: {exc}"
            if name in PD_PEERS:  # the peer has no split counter of kvroute's kind: the workers' counters
                result["pd"] = {"split_share": engine["split_share"], "describe": engine["describe"], "engine": engine}
                note = "; ".join(x for x in ("P/D: " + engine["describe"], note) if x)
            if note:
                result["note"] = note
        return result
    finally:
        _stop_child(cluster, child)


ENGINE_TTFT = "vllm:time_to_first_token_seconds"


def _engine_ttft(workers: list[RigWorker]) -> tuple[float, float] | None:
    """``(seconds, requests)`` of the workers' own TTFT histograms summed (vLLM's
    ``vllm:time_to_first_token_seconds``), None when a worker has none (the simulator)."""
    total_s = count = 0.0
    for w in workers:
        samples = worker_http.metric_samples(w.url)
        if ENGINE_TTFT + "_count" not in samples:
            return None
        total_s += samples[ENGINE_TTFT + "_sum"]
        count += samples[ENGINE_TTFT + "_count"]
    return total_s, count


def engine_ttft_report(before: tuple[float, float] | None, after: tuple[float, float] | None,
                       client_mean_ms: float | None) -> dict[str, Any] | None:
    """The run's TTFT as the engines measured it, beside the client's: ``{"mean": ms, "requests":
    n, "outside_mean": ms}``. vLLM times a request from its input processor (after the API server
    rendered and tokenized it) to its first token (``vllm/v1/metrics/stats.py``), so
    ``outside_mean`` (client mean less engine mean) is what the router and the HTTP hops added:
    the same measure for every router. None without both readings or without requests."""
    if before is None or after is None or client_mean_ms is None:
        return None
    requests = after[1] - before[1]
    if requests <= 0:
        return None
    mean_ms = (after[0] - before[0]) / requests * 1e3
    return {"mean": round(mean_ms, 1), "requests": int(requests), "outside_mean": round(client_mean_ms - mean_ms, 1)}


def _engine_counters(workers: list[RigWorker]) -> dict[str, dict[str, float]]:
    """Every worker's :func:`kvbench.peers_pd.engine_counters` now."""
    return {w.id: engine_counters(worker_http.metric_samples(w.url)) for w in workers}


def _engine_split(workers: list[RigWorker], roles: list[str], before: dict, answered: int) -> dict[str, Any]:
    """:func:`kvbench.peers_pd.engine_split` of a P/D run, once the decode workers have
    counted ``answered`` requests (they count one a moment after its stream ends) or after
    :data:`GATEWAY_SETTLE_S`."""
    by_id = {w.id: r for w, r in zip(workers, roles)}

    def decoded(now: dict) -> bool:
        return sum(now[w]["requests"] - before[w]["requests"] for w in now if by_id.get(w) == "decode") >= answered

    after, _ = worker_http.poll_until(lambda: _engine_counters(workers), decoded, GATEWAY_SETTLE_S)
    return engine_split(before, after, by_id, answered)


def _stop_child(cluster: Cluster, child) -> None:
    """Stop one router (its process group) and forget it."""
    one = Cluster([child])
    one.stop()
    cluster.children.remove(child)
