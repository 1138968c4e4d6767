"""Peer routers for ``kvroute bench rig``: how to launch each one in front of the rig's workers.

The rig starts N workers, then runs one router after another on them and replays a workload through
each. This module only knows the peers' command lines; the rig starts, waits for and stops them.

Peers (PyPI packages, pinned in pyproject's ``bench`` extra or installed in a virtualenv of their own):

- ``sglang-router`` 0.3.2 (module ``sglang_router``): policies ``cache_aware`` and ``round_robin``.
- ``smg`` 1.13.0 (module ``smg``), SGLang's model gateway: policy ``cache_aware``. Its wheel installs
  a console script named ``smg``, as does sglang-router's, so the two cannot share a virtualenv
  without one overwriting the other's script; smg lives in ``.venv-peers-smg``.
- ``vllm-router`` 0.1.17 (module ``vllm_router``): policy ``kv_aware``, fed by the workers' ZMQ KV
  events. It tokenizes each request by calling the worker's ``/tokenize`` and needs the model
  directory in ``VLLM_ROUTER_TOKENIZER``. It credits a prefix only when it can recompute the
  worker's block hashes, i.e. on real vLLM; :meth:`VllmRouterKvAware.event_path` reads its
  ``/metrics`` to say whether that happened.

A peer's interpreter is looked up in this process's virtualenv first, then in every
``<repo>/.venv-peers*`` virtualenv (``KVR_PEER_VENVS``, a ``os.pathsep``-separated list of
virtualenv folders, is searched before both). Each peer runs as ``<python> -m <module>``, so it needs
no console script on PATH; every peer exits on SIGTERM within a couple of seconds.
"""
from __future__ import annotations

import abc
import glob
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvroute.up import free_ports

REPO_ROOT = Path(__file__).resolve().parents[1]

# Shared by every peer: the rig's workers are CPU vLLM servers (or simulators) that can be slow to
# answer while they prefill long prompts, and a benchmark must neither lose a worker nor send a
# request twice.
REQUEST_TIMEOUT_S = 3600      # a long prompt on a CPU worker can take minutes; never cut it off
HEALTH_TIMEOUT_S = 30         # /health of a busy CPU vLLM can take seconds (default 5)
HEALTH_FAILURES = 10          # consecutive failed probes before a worker is marked unhealthy (default 3)
STARTUP_CHECK_INTERVAL_S = 1  # the workers are already up: register them at once (default 30)
SHUTDOWN_GRACE_S = 2          # on SIGTERM the rig is done with the router: do not wait for in-flight work


@dataclass(frozen=True)
class RigWorker:
    """One worker the rig started."""
    id: str            # "w0"
    url: str           # "http://127.0.0.1:8101"
    events: str        # ZMQ PUB endpoint of its KV events, "tcp://127.0.0.1:5557"
    replay: str        # ZMQ replay (ROUTER) endpoint, "tcp://127.0.0.1:5558"


@dataclass
class RouterLaunch:
    argv: list[str]
    env: dict[str, str]      # added to os.environ
    base_url: str            # "http://127.0.0.1:PORT" (OpenAI API under /v1)
    ready_path: str          # GET base_url+ready_path answers 200 once it routes
    metrics_url: str | None = None  # its Prometheus text (feed it to PeerRouter.event_path)


def _venvs() -> list[Path]:
    """Virtualenvs searched for a peer's module, in order (see the module docstring)."""
    extra = [Path(p) for p in os.environ.get("KVR_PEER_VENVS", "").split(os.pathsep) if p]
    return extra + [Path(sys.prefix)] + [Path(p) for p in sorted(glob.glob(str(REPO_ROOT / ".venv-peers*")))]


def _module_in_venv(venv: Path, module: str) -> bool:
    if venv.resolve() == Path(sys.prefix).resolve():
        return importlib.util.find_spec(module) is not None
    return any(glob.glob(str(venv / "lib" / "python*" / "site-packages" / module / "__init__.py")))


def find_python(module: str) -> str | None:
    """The interpreter of the first virtualenv (see :func:`_venvs`) where ``module`` is installed."""
    for venv in _venvs():
        if venv.resolve() == Path(sys.prefix).resolve():
            if _module_in_venv(venv, module):
                return sys.executable
            continue
        py = venv / "bin" / "python"
        if py.exists() and _module_in_venv(venv, module):
            return str(py)
    return None


class PeerRouter(abc.ABC):
    name: str        # table label, e.g. "sglang-router cache_aware"
    module: str      # the Python module that runs it (``python -m <module>``)

    def installed(self) -> bool:
        """Its module is installed in one of the searched virtualenvs."""
        return find_python(self.module.split(".")[0]) is not None

    def python(self) -> str:
        py = find_python(self.module.split(".")[0])
        if py is None:
            raise RuntimeError(f"{self.name}: module {self.module} is not installed in any of "
                               f"{[str(v) for v in _venvs()]}")
        return py

    @abc.abstractmethod
    def launch(self, port: int, workers: list[RigWorker], model_dir: Path, served_model_name: str,
               block_size: int) -> RouterLaunch: ...

    def event_path(self, metrics_text: str) -> str | None:
        """One line on whether its KV-event path engaged; None when it has none."""
        return None


class _SglangFamily(PeerRouter):
    """sglang-router and smg share their command line (smg is sglang-router's successor)."""
    policy: str

    def _common(self, port: int, metrics_port: int, workers: list[RigWorker], model_dir: Path) -> list[str]:
        return [
            self.python(), "-m", self.module,
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *[w.url for w in workers],
            "--policy", self.policy,
            # Local tokenizer files: never reach for a hub download of the served name.
            "--model-path", str(model_dir),
            # No router-side retries: a retried request would be prefilled twice and counted once.
            "--disable-retries",
            # The circuit breaker takes a worker out after a run of errors/timeouts; a slow CPU
            # worker must stay in the pool for the whole benchmark.
            "--disable-circuit-breaker",
            "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
            "--health-failure-threshold", str(HEALTH_FAILURES),
            "--worker-startup-check-interval", str(STARTUP_CHECK_INTERVAL_S),
            "--request-timeout-secs", str(REQUEST_TIMEOUT_S),
            "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S),
            # Its metrics listener defaults to port 29000 on all interfaces: give each run its own
            # port on loopback so two routers never collide.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", "warn",
        ]

    def _cache_aware(self) -> list[str]:
        if self.policy != "cache_aware":
            return []
        return [
            # The docs' advice is to start from the default match threshold (0.3: a request sticks
            # to the worker holding >= 30% of its prompt as prefix) and lower it only for hot spots.
            "--cache-threshold", "0.3",
            # Homogeneous workers and steady traffic: the docs recommend the higher (default)
            # balance thresholds, which favour cache affinity; load balancing takes over only when
            # the busiest worker has 64 more requests in flight and 1.5x the least busy one's.
            "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5",
        ]


class SglangRouter(_SglangFamily):
    module = "sglang_router.launch_router"

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.name = f"sglang-router {policy}"

    def launch(self, port: int, workers: list[RigWorker], model_dir: Path, served_model_name: str,
               block_size: int) -> RouterLaunch:
        # sglang-router 0.3.2 over HTTP matches prompts as text (no block size to set).
        metrics_port = free_ports(1)[0]
        argv = self._common(port, metrics_port, workers, model_dir) + self._cache_aware()
        return RouterLaunch(argv=argv, env={}, base_url=f"http://127.0.0.1:{port}",
                            # 200 with {"healthy_workers": N} only once workers are registered
                            ready_path="/readiness", metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")


class SmgRouter(_SglangFamily):
    module = "smg.launch_router"

    def __init__(self, policy: str = "cache_aware") -> None:
        self.policy = policy
        self.name = f"smg {policy}"

    def launch(self, port: int, workers: list[RigWorker], model_dir: Path, served_model_name: str,
               block_size: int) -> RouterLaunch:
        metrics_port = free_ports(1)[0]
        argv = self._common(port, metrics_port, workers, model_dir) + self._cache_aware() + [
            # The engine's KV block size, so its tree is cut at the engine's page boundaries
            # (used by its event-driven index; HTTP workers fall back to its text tree).
            "--block-size", str(block_size),
            # Its liveness heuristics exclude a worker after 2 s without contact or 3 s without a
            # token while requests are queued: a CPU worker prefilling a long prompt trips both.
            "--worker-stall-secs", "120", "--worker-wedge-secs", "600",
            # Overload protection leaves out a worker with >= 8 waiting requests or >= 80% KV usage;
            # CPU workers with a small KV cache sit there for most of a run, which would turn the
            # comparison of cache-aware policies into one of overload filters.
            "--disable-worker-overload-protection",
        ]
        return RouterLaunch(argv=argv, env={}, base_url=f"http://127.0.0.1:{port}",
                            ready_path="/readiness", metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")


def vllm_router_service_flags(metrics_port: int) -> list[str]:
    """vllm-router's flags shared by its rig launches (unified and P/D): no retries, no circuit
    breaker, the rig's health and timeout settings, /metrics on loopback at ``metrics_port``."""
    return [
        "--disable-retries",           # a retry would prefill the prompt a second time
        "--disable-circuit-breaker",   # keep slow CPU workers in the pool
        "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
        "--health-failure-threshold", str(HEALTH_FAILURES),
        "--worker-startup-check-interval", str(STARTUP_CHECK_INTERVAL_S),
        "--request-timeout-secs", str(REQUEST_TIMEOUT_S),
        # /metrics tells whether the event path engaged (event_path reads it).
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", "warning",
    ]


class VllmRouterKvAware(PeerRouter):
    module = "vllm_router.launch_router"
    name = "vllm-router kv_aware"

    def launch(self, port: int, workers: list[RigWorker], model_dir: Path, served_model_name: str,
               block_size: int) -> RouterLaunch:
        metrics_port = free_ports(1)[0]
        argv = [
            self.python(), "-m", self.module,
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *[w.url for w in workers],
            "--policy", "kv_aware",
            # Each worker's KV event stream (it connects a SUB socket) and its replay socket, so a
            # gap in sequence numbers is filled instead of dropping that worker's ownership.
            *[a for w in workers for a in ("--kv-event-source", f"{w.url}={w.events}")],
            *[a for w in workers for a in ("--kv-event-replay-source", f"{w.url}={w.replay}")],
            # Block size and model identity must equal the engines' to recompute their block hashes.
            "--kv-event-block-size", str(block_size),
            "--kv-event-model", served_model_name,
            # Temperature 0: always the lowest-cost worker (the documented default, stated here).
            "--router-temperature", "0",
            *vllm_router_service_flags(metrics_port),
        ]
        # kv_aware tokenizes each prompt (through the worker's /tokenize) and loads the model's
        # tokenizer and config from this directory.
        env = {"VLLM_ROUTER_TOKENIZER": str(model_dir)}
        return RouterLaunch(argv=argv, env=env, base_url=f"http://127.0.0.1:{port}", ready_path="/readiness",
                            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")

    def event_path(self, metrics_text: str) -> str | None:
        """Whether kv_aware credited any cached prefix from the workers' KV events.

        Reads ``vllm_router_kv_placement_lookups_total{result}`` (a placement lookup in the
        event-built index: ``miss`` when no worker holds a block of the prompt),
        ``vllm_router_kv_routing_inputs_total{transport,result}`` (how the prompt's tokens were
        obtained) and ``vllm_router_prefix_routing_decisions_total{outcome}``.
        """
        lookups = _counter_by_label(metrics_text, "vllm_router_kv_placement_lookups_total", "result")
        inputs = _counter_by_label(metrics_text, "vllm_router_kv_routing_inputs_total", "result")
        decisions = _counter_by_label(metrics_text, "vllm_router_prefix_routing_decisions_total", "outcome")
        total = sum(lookups.values())
        hits = sum(v for k, v in lookups.items() if "hit" in k)
        detail = (f"lookups {_fmt(lookups)}; token inputs {_fmt(inputs)}; decisions {_fmt(decisions)}")
        if total == 0:
            return f"kv_aware event path NOT engaged: no placement lookups ({detail})"
        if hits > 0:
            return f"kv_aware event path engaged: {hits:g} of {total:g} placement lookups hit ({detail})"
        return f"kv_aware event path NOT engaged: 0 of {total:g} placement lookups hit ({detail})"


_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _counter_by_label(text: str, metric: str, label: str) -> dict[str, float]:
    """Sum of ``metric``'s samples grouped by one label's value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group("name") != metric:
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def _fmt(d: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(d.items())) or "none"


PEERS: dict[str, PeerRouter] = {
    "sglang:cache_aware": SglangRouter("cache_aware"),
    "sglang:round_robin": SglangRouter("round_robin"),
    "smg:cache_aware": SmgRouter("cache_aware"),
    "vllm-router:kv_aware": VllmRouterKvAware(),
}


def installed_peers() -> list[str]:
    """Keys of PEERS whose router is installed."""
    return [key for key, peer in PEERS.items() if peer.installed()]


__all__ = ["RigWorker", "RouterLaunch", "PeerRouter", "PEERS", "installed_peers", "find_python"]
