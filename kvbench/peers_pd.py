"""Peer routers' prefill-decode (P/D) modes for ``kvroute bench rig --pd P:D``, and the split a P/D
run shows in the workers' own counters.

Each peer runs in front of the rig's workers with roles (workers 0..P-1 prefill, the next D decode)
and speaks vLLM's P/D protocol (``kv_transfer_params``: a ``do_remote_decode`` prefill leg with
``max_tokens: 1``, then the client's request to a decode worker with the prefill answer's params):

- ``vllm-router-pd:<policy>`` (vllm-router 0.1.17): ``--vllm-pd-disaggregation --prefill URL
  --decode URL`` with its default ``--kv-connector nixl`` (NIXL's pull: the prefill answer's params
  go to the decode worker as they are). ``cache_aware`` (its default policy, for both pools) or
  ``kv_aware``, which scores the prefill workers from their KV events (``--pd-kv-events
  URL=ENDPOINT``; vllm-router fixes their block size at 16 and only indexes events published on
  the topic ``""``, vLLM's default, which the rig's workers use).
- ``smg-pd:<policy>`` (smg 1.13.0): ``--pd-disaggregation`` with the workers listed in a file
  discovery manifest (``--discovery-provider file``) that names their KV connector
  (``"kv_connector": "NixlConnector"``, the manifest's form of its ``smg.ai/kv-connector`` pod
  annotation). Without a connector smg pairs vLLM workers as ``vllm/?/?`` and sends both legs
  without ``kv_transfer_params``: the decode worker computes the whole prompt again.

sglang-router 0.3.2 cannot run P/D against vLLM (:data:`PD_REFUSED`): its ``--pd-disaggregation``
sends the client's whole request to a prefill and a decode worker at once with SGLang's bootstrap
fields (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``) and no ``kv_transfer_params``,
which vLLM ignores, so both workers compute the prompt and the prefill worker decodes the whole
answer too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench.peers import (HEALTH_FAILURES, HEALTH_TIMEOUT_S, REQUEST_TIMEOUT_S, SHUTDOWN_GRACE_S,
                                 STARTUP_CHECK_INTERVAL_S, PeerRouter, RigWorker, RouterLaunch, _counter_by_label,
                                 _fmt, vllm_router_service_flags)
from kvroute.up import free_ports

PD_EVENTS_BLOCK_SIZE = 16  # vllm-router's --pd-kv-events: "Block size is 16" (its --help)

PD_REFUSED = {
    "sglang-pd": "sglang-router's --pd-disaggregation speaks SGLang's bootstrap protocol (the whole request "
                 "to a prefill and a decode worker at once, with bootstrap_host/port/room), not vLLM's "
                 "kv_transfer_params: on vLLM workers both would compute the prompt; it has no vLLM mode",
}


def split_pd(workers: list[RigWorker], roles: list[str]) -> tuple[list[RigWorker], list[RigWorker]]:
    """(prefill workers, decode workers) by role; ValueError when either pool is empty."""
    prefill = [w for w, r in zip(workers, roles) if r == "prefill"]
    decode = [w for w, r in zip(workers, roles) if r == "decode"]
    if not prefill or not decode or len(roles) != len(workers):
        raise ValueError(f"P/D needs a role per worker and both pools non-empty, got {roles}")
    return prefill, decode


class PdPeer(PeerRouter):
    """A peer router in its P/D mode; ``launch_pd`` replaces ``launch``."""
    policy: str

    def launch(self, *a, **kw) -> RouterLaunch:  # pragma: no cover - the rig calls launch_pd
        raise TypeError(f"{self.name} needs worker roles: launch_pd")

    def launch_pd(self, port: int, workers: list[RigWorker], roles: list[str], model_dir: Path,
                  served_model_name: str, block_size: int, log_dir: Path) -> RouterLaunch:
        raise NotImplementedError

    def refusal(self, block_size: int) -> str | None:
        """Why this peer cannot run with these settings, None when it can."""
        return None


class VllmRouterPd(PdPeer):
    module = "vllm_router.launch_router"

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.name = f"vllm-router P/D {policy}"

    def refusal(self, block_size: int) -> str | None:
        if self.policy == "kv_aware" and block_size != PD_EVENTS_BLOCK_SIZE:
            return (f"vllm-router-pd:kv_aware reads the prefill workers' KV events at block size "
                    f"{PD_EVENTS_BLOCK_SIZE} only (--pd-kv-events): run the rig with --block-size 16")
        return None

    def launch_pd(self, port: int, workers: list[RigWorker], roles: list[str], model_dir: Path,
                  served_model_name: str, block_size: int, log_dir: Path) -> RouterLaunch:
        prefill, decode = split_pd(workers, roles)
        metrics_port = free_ports(1)[0]
        argv = [self.python(), "-m", self.module, "--host", "127.0.0.1", "--port", str(port),
                "--vllm-pd-disaggregation",
                # no bootstrap port: NIXL needs none (the decode side reads remote_host/port from the params)
                *[a for w in prefill for a in ("--prefill", w.url)],
                *[a for w in decode for a in ("--decode", w.url)],
                "--kv-connector", "nixl",  # its default, stated: the sims answer NIXL-shaped params
                "--policy", self.policy]
        if self.policy == "kv_aware":
            argv += [a for w in prefill for a in ("--pd-kv-events", f"{w.url}={w.events}")]
        argv += vllm_router_service_flags(metrics_port)
        # it tokenizes each prompt (the workers' /tokenize) and loads the model's config from here
        env = {"VLLM_ROUTER_TOKENIZER": str(model_dir)}
        return RouterLaunch(argv, env, f"http://127.0.0.1:{port}", "/readiness",
                            f"http://127.0.0.1:{metrics_port}/metrics")

    def event_path(self, metrics_text: str) -> str | None:
        """Its P/D legs by worker pool and, for kv_aware, whether the prefill workers' KV events
        credited any prefix (``vllm_router_pd_credited_prefix_tokens_total``,
        ``vllm_router_kv_placement_lookups_total{result}``)."""
        legs = (f"vllm-router P/D legs: prefill "
                f"{sum(_counter_by_label(metrics_text, 'vllm_router_pd_prefill_requests_total', 'worker').values()):g}, "
                f"decode {sum(_counter_by_label(metrics_text, 'vllm_router_pd_decode_requests_total', 'worker').values()):g}")
        if self.policy != "kv_aware":
            return legs
        lookups = _counter_by_label(metrics_text, "vllm_router_kv_placement_lookups_total", "result")
        credited = sum(_counter_by_label(metrics_text, "vllm_router_pd_credited_prefix_tokens_total", "").values())
        hits = sum(v for k, v in lookups.items() if "hit" in k)
        state = "engaged" if hits else "NOT engaged"
        return f"{legs}; kv_aware prefill events {state}: lookups {_fmt(lookups)}, credited prefix tokens {credited:g}"


class SmgPd(PdPeer):
    module = "smg.launch_router"

    def __init__(self, policy: str = "cache_aware") -> None:
        self.policy = policy
        self.name = f"smg P/D {policy}"

    @staticmethod
    def manifest(workers: list[RigWorker], roles: list[str]) -> dict[str, Any]:
        """smg's file discovery manifest: every worker with its P/D role and vLLM's NIXL connector."""
        split_pd(workers, roles)
        return {"version": 1, "workers": [{"url": w.url, "worker_type": r, "kv_connector": "NixlConnector"}
                                          for w, r in zip(workers, roles)]}

    def launch_pd(self, port: int, workers: list[RigWorker], roles: list[str], model_dir: Path,
                  served_model_name: str, block_size: int, log_dir: Path) -> RouterLaunch:
        path = log_dir / f"smg-pd-{self.policy}-workers.json"
        path.write_text(json.dumps(self.manifest(workers, roles)))
        metrics_port = free_ports(1)[0]
        argv = [self.python(), "-m", self.module, "--host", "127.0.0.1", "--port", str(port),
                "--pd-disaggregation", "--discovery-provider", "file", "--discovery-file", str(path),
                "--policy", self.policy, "--model-path", str(model_dir), "--block-size", str(block_size),
                # the same settings as the rig's unified smg (kvbench.peers.SmgRouter)
                "--disable-retries", "--disable-circuit-breaker",
                "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
                "--health-failure-threshold", str(HEALTH_FAILURES),
                "--worker-startup-check-interval", str(STARTUP_CHECK_INTERVAL_S),
                "--request-timeout-secs", str(REQUEST_TIMEOUT_S),
                "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S),
                "--worker-stall-secs", "120", "--worker-wedge-secs", "600",
                "--disable-worker-overload-protection",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--log-level", "warn"]
        if self.policy == "cache_aware":
            argv += ["--cache-threshold", "0.3", "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5"]
        return RouterLaunch(argv, {}, f"http://127.0.0.1:{port}", "/readiness",
                            f"http://127.0.0.1:{metrics_port}/metrics")


PD_PEERS: dict[str, PdPeer] = {
    "vllm-router-pd:cache_aware": VllmRouterPd("cache_aware"),
    "vllm-router-pd:kv_aware": VllmRouterPd("kv_aware"),
    "smg-pd:cache_aware": SmgPd("cache_aware"),
}

# worker counters read before and after a P/D run (vLLM 0.32 names; the sim serves them too)
ENGINE_COUNTERS = {"requests": "vllm:request_success_total", "prompt_tokens": "vllm:prompt_tokens_total",
                   "local_hit_tokens": "vllm:prefix_cache_hits_total",
                   "transferred_tokens": "vllm:external_prefix_cache_hits_total",
                   "kv_loads": "vllm:nixl_xfer_time_seconds_count"}


def engine_counters(samples: dict[str, float]) -> dict[str, float]:
    """:data:`ENGINE_COUNTERS` out of one worker's ``metric_samples`` (0 for a missing one)."""
    return {k: samples.get(name, 0.0) for k, name in ENGINE_COUNTERS.items()}


def engine_split(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                 roles: dict[str, str], requests: int) -> dict[str, Any]:
    """What the workers' own counters say of a P/D run. ``before``/``after``: worker id ->
    :func:`engine_counters`; ``roles``: worker id -> prefill | decode; ``requests``: the run's
    answered requests. Returns ``{"prefill_legs"`` (requests the prefill workers finished),
    ``"decode_requests"``, ``"kv_loads"`` (decode requests that loaded KV from a prefill worker
    over the link: NIXL's transfer count), ``"transferred_tokens"``, ``"decode_local_hit_tokens"``,
    ``"decode_computed_tokens"`` (prompt tokens by source on the decode workers), ``"split_share"``
    (kv_loads / requests, None without requests), ``"describe"}``."""
    def total(role: str, key: str) -> int:
        return int(round(sum(after[w][key] - before.get(w, {}).get(key, 0.0) for w in after if roles.get(w) == role)))

    loads, moved = total("decode", "kv_loads"), total("decode", "transferred_tokens")
    local, prompt = total("decode", "local_hit_tokens"), total("decode", "prompt_tokens")
    out = {"prefill_legs": total("prefill", "requests"), "decode_requests": total("decode", "requests"),
           "kv_loads": loads, "transferred_tokens": moved, "decode_local_hit_tokens": local,
           "decode_computed_tokens": prompt - local - moved,
           "split_share": loads / requests if requests else None}
    share = f" ({out['split_share']:.0%} of {requests})" if requests else ""
    out["describe"] = (f"workers: {loads} decode requests loaded KV from a prefill worker{share}, "
                       f"{out['prefill_legs']} prefill-worker requests; decode prompt tokens {moved} transferred, "
                       f"{local} cached, {out['decode_computed_tokens']} computed")
    if not loads:
        out["describe"] += " - P/D NOT engaged: no KV reached a decode worker"
    return out
