"""The e2e cluster, started once for the package: ``kvroute up --engine vllm`` with two real vLLM
servers (the generated "tiny" model and two generated LoRA adapters, prefix caching, KV events +
replay, ``/reset_prefix_cache`` and ``/v1/chat/completions/render`` enabled), the gateway with its embedded index, and one
``kvroute agent`` per worker writing the workers' real KV events into a real Redis.

vLLM is found through ``$KVR_VLLM_PYTHON`` (``make test`` sets it; ``make install-vllm`` installs
vLLM into ``.venv-vllm``). Without it every test here fails: this suite is never skipped.

Every process has a hard deadline (``timeout``); ``kvroute up`` stops its vLLM servers when it
stops (and they get SIGTERM if it is killed), so nothing outlives the suite.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from conftest import ADMIN_TOKEN, Proc, admin_get, free_port, kvroute_argv, logs_excerpt, running_up, wait_workers_idle

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_lora, ensure_model  # noqa: E402
from kvbench.workers import metric_samples, reset_prefix_cache  # noqa: E402

from kvcore.index.base import TierMatch  # noqa: E402
from kvcore.index.redis import RedisIndex  # noqa: E402

MODEL_NAME = "tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
# KV capacity per worker, in blocks: more than max_model_len / block_size (vLLM reserves one
# block), small enough that the routing test's 20 conversations (219 blocks) do not fit on one
# worker, large enough that half of them fit on each.
GPU_BLOCKS = 176
UP_DEADLINE_S = 1200       # hard limit on the whole cluster's life
READY_TIMEOUT_S = 600      # two vLLM servers load in 1-3 min on 2 shared cores
REDIS_TIMEOUT_S = 10.0     # reads of the agents' index; the default 0.5 s is too short on a busy machine
VLLM_ARGS = "--enforce-eager --enable-scale-out --dtype bfloat16"  # eager: no 1-min torch.compile warm-up
LORA_ADAPTERS = {"sql": 1, "chat": 2}  # adapter name -> make_lora.py seed; every worker serves both


@functools.cache
def vllm_python() -> str:
    """``$KVR_VLLM_PYTHON`` checked to import vllm (once per session); fails the test (never
    skips) otherwise."""
    py = os.environ.get("KVR_VLLM_PYTHON", "")
    if not py or shutil.which(py) is None:
        pytest.fail("KVR_VLLM_PYTHON is not set to an interpreter with vLLM: run `make install-vllm` "
                    "(or `make test`, which sets it), or export KVR_VLLM_PYTHON=/path/to/vllm-venv/bin/python")
    done = subprocess.run([py, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"{py} cannot import vllm:\n{done.stderr[-2000:]}")
    return py


UP_READY_S = 600


@contextlib.contextmanager
def vllm_up(name: str, model: Path, served_name: str, log_dir: Path, *flags: str) -> Iterator[str]:
    """``kvroute up --engine vllm`` of ``model`` as ``served_name`` for one test module: block size
    32, a 1,024-token context, the ``kv_aware`` policy, eager bfloat16, the admin token and vLLM's
    dev mode (``/reset_prefix_cache``), plus ``flags`` (``--workers N``, cache size...). Yields the
    gateway's base URL; stopped on exit."""
    with running_up(name, [
            "--engine", "vllm", "--vllm-python", vllm_python(), "--model", str(model),
            "--served-model-name", served_name, "--port", str(free_port()), "--block-size", "32",
            "--max-model-len", "1024", "--policy", "kv_aware", "--vllm-args", "--enforce-eager --dtype bfloat16",
            "--ready-timeout-s", str(UP_READY_S), *flags],
            log_dir, {"KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN, "VLLM_SERVER_DEV_MODE": "1"}, UP_READY_S + 60) as base:
        yield base


@dataclass
class Worker:
    """One vLLM server as the gateway lists it."""

    id: str
    url: str
    events: str
    replay: str


@dataclass
class VllmCluster:
    """Handles on the running e2e cluster."""

    base: str
    workers: dict[str, Worker]
    model_dir: Path
    lora_dirs: dict[str, Path]
    redis_url: str
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    # ---- clients ------------------------------------------------------------------------------
    def openai(self, base: str | None = None, **kw) -> OpenAI:
        """The ``openai`` SDK pointed at the gateway (or at ``base``, e.g. a worker's URL)."""
        return OpenAI(base_url=(base or self.base) + "/v1", api_key="x", max_retries=0, timeout=120, **kw)

    def admin(self, method: str, path: str, json=None) -> httpx.Response:
        return httpx.request(method, self.base + path, json=json, timeout=60,
                             headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    def explain(self, body: dict, path: str | None = None) -> dict:
        """``POST /admin/explain`` of ``body`` (the body of routed ``path``, when given)."""
        r = self.admin("POST", "/admin/explain" + (f"?path={path}" if path else ""), body)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout_s: float = 30) -> None:
        """:func:`conftest.wait_workers_idle` on this cluster's gateway."""
        wait_workers_idle(self.base, timeout_s)

    def set_policy(self, policy: dict) -> dict:
        r = self.admin("PUT", "/admin/policy", policy)
        assert r.status_code == 200, r.text
        return r.json()

    # ---- workers ------------------------------------------------------------------------------
    def metrics(self, worker_id: str) -> dict[str, float]:
        """A worker's Prometheus samples: ``name`` -> value summed over label sets."""
        return metric_samples(self.workers[worker_id].url)

    def reset_prefix_caches(self, timeout_s: float = 60) -> None:
        """``POST /reset_prefix_cache`` on every worker (plus one sub-block request each, which
        makes vLLM publish the clear), then wait until the gateway's index and what this
        cluster's agents hold in Redis are empty (the AllBlocksCleared events arrived, speculative
        entries expired). Other workers in the session's Redis are not this cluster's: an agent
        of an earlier module that was killed rather than stopped leaves its blocks there. Fails
        the test after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        for w in self.workers.values():
            reset_prefix_cache(w.url, MODEL_NAME, timeout_s)
        while time.monotonic() < end:
            idx = admin_get(self.base + "/admin/index").json()["workers"]
            gw_blocks = sum(sum(e["blocks"].values()) + e.get("speculative_blocks", 0) for e in idx.values())
            held = redis_blocks(self.redis_url)
            if gw_blocks == 0 and not any(held.get(w, 0) for w in self.workers):
                return
            time.sleep(0.25)
        pytest.fail(f"indexes not empty {timeout_s}s after /reset_prefix_cache: gateway {idx}; "
                    f"Redis blocks per worker {held}")


def redis_match(redis_url: str, keys: list[int]) -> dict[str, TierMatch]:
    """What the agents published: per worker, the run of ``keys`` held from block 0, by tier."""
    async def go() -> dict[str, TierMatch]:
        index = RedisIndex(redis_url, socket_timeout_s=REDIS_TIMEOUT_S)
        try:
            return await index.match(keys)
        finally:
            await index.close()
    return asyncio.run(go())


def redis_blocks(redis_url: str) -> dict[str, int]:
    """Blocks the agents hold in Redis, per worker holding any (every tier)."""
    async def go() -> dict[str, int]:
        index = RedisIndex(redis_url, socket_timeout_s=REDIS_TIMEOUT_S)
        try:
            return {w: sum(st.blocks.values()) for w, st in (await index.stats()).items()}
        finally:
            await index.close()
    return asyncio.run(go())


def _redis_live(redis_url: str) -> set[str]:
    async def go() -> set[str]:
        index = RedisIndex(redis_url, socket_timeout_s=REDIS_TIMEOUT_S)
        try:
            return await index.live_workers()
        finally:
            await index.close()
    return asyncio.run(go())


def _wait_for(what: str, check, timeout_s: float, procs: list[Proc], log_dir: Path):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for p in procs:
            if not p.alive():
                pytest.fail(f"{p.name} exited with {p.popen.returncode} while waiting for {what}:\n"
                            f"{p.log_tail(60)}\n{logs_excerpt(log_dir)}")
        value = check()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"no {what} after {timeout_s:.0f}s:\n{logs_excerpt(log_dir)}")


def pytest_collection_modifyitems(session, config, items):
    """Run this package's tests that do not use ``cluster`` before those that do, so the two vLLM
    servers of ``cluster`` (torn down at the package's end) never share the CPUs with servers
    other e2e tests start. Order is otherwise kept. Tests using ``cluster`` get a timeout that
    covers the servers' start."""
    here = Path(__file__).parent
    idx = [i for i, it in enumerate(items) if here in Path(str(it.fspath)).parents]
    if not idx:
        return
    mine = [items[i] for i in idx]
    ordered = sorted(mine, key=lambda it: "cluster" in getattr(it, "fixturenames", ()))
    for i, it in zip(idx, ordered):
        items[i] = it
        if "cluster" in getattr(it, "fixturenames", ()):  # the first one waits for the servers
            it.add_marker(pytest.mark.timeout(READY_TIMEOUT_S + 300))


@pytest.fixture(scope="package")
def e2e_model() -> Path:
    """The generated "tiny" model (tools/make_model.py), made with the vLLM interpreter once."""
    return ensure_model("tiny", vllm_python())


@pytest.fixture(scope="package")
def cluster(e2e_model, redis_url, tmp_path_factory) -> VllmCluster:
    """The running cluster; stopped after the last e2e test."""
    py = vllm_python()
    lora_dirs = {name: ensure_lora(e2e_model, seed, py) for name, seed in LORA_ADAPTERS.items()}
    log_dir = tmp_path_factory.mktemp("e2e-logs")
    up_logs = log_dir / "up"
    port = free_port()
    t0 = time.monotonic()
    up = Proc("kvroute-up", kvroute_argv(
        "up", "--engine", "vllm", "--vllm-python", py, "--workers", "2", "--model", str(e2e_model),
        "--served-model-name", MODEL_NAME, "--port", str(port), "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(GPU_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN),
        "--vllm-args", VLLM_ARGS, "--log-dir", str(up_logs), "--ready-timeout-s", str(READY_TIMEOUT_S),
        "--lora-modules", *(f"{name}={path}" for name, path in lora_dirs.items())),
        log_dir, env={"VLLM_SERVER_DEV_MODE": "1", "KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN},
        deadline_s=UP_DEADLINE_S)
    procs = [up]
    try:
        def ready():
            m = re.search(r"gateway ready: (http://\S+)/v1", up.log_path.read_text(errors="replace"))
            return m.group(1) if m else None
        base = _wait_for("`kvroute up` ready line", ready, READY_TIMEOUT_S + 60, procs, up_logs)
        print(f"\n[e2e] kvroute up --engine vllm ready in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        listed = httpx.get(base + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                           timeout=30).json()["workers"]
        workers = {w["id"]: Worker(w["id"], w["url"], w["events"], w["replay"]) for w in listed}
        assert sorted(workers) == ["w0", "w1"]
        for w in workers.values():
            procs.append(Proc(f"agent-{w.id}", kvroute_argv(
                "agent", "--worker-id", w.id, "--events", w.events, "--replay", w.replay,
                "--index", redis_url, "--model", MODEL_NAME, "--block-size", str(BLOCK_SIZE),
                "--heartbeat-ttl-s", "60"), log_dir, deadline_s=UP_DEADLINE_S))
        _wait_for("agent heartbeats in Redis", lambda: _redis_live(redis_url) >= set(workers), 60, procs, log_dir)
        c = VllmCluster(base, workers, e2e_model, lora_dirs, redis_url, log_dir, procs)
        # Everything `kvroute up` started (vLLM API servers, their engine processes, the gateway).
        started = psutil.Process(up.popen.pid).children(recursive=True)
        yield c
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=30)
    # `kvroute up` stopped on SIGTERM: no process it started outlives it, no worker port stays bound.
    _, alive = psutil.wait_procs(started, timeout=30)
    for proc in alive:
        proc.kill()
    assert alive == [], f"left running after kvroute up stopped: {[p.pid for p in alive]}"
    for w in workers.values():
        host, port = w.url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            assert sock.connect_ex((host, int(port))) != 0, f"{w.id} port {port} still accepts connections"
