"""Shared test fixtures: the tiny model, the real-vLLM capture, free ports, and processes started
on loopback that always stop (each has a hard deadline and is killed at teardown)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

# the one free-ports helper: the benchmarks, `kvroute up` and the tests use it
from kvroute.up import PORT_RANGE_ENV, below_ephemeral_range, free_ports

# benchmarks/lab/ (network namespaces, LRU replay, process CPU sampling, --json/--plot figures) is
# the benchmarks' own library, not part of the installed package: tests import it as `lab`
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# tests/torch run in vLLM's interpreter (torch), by their own config: `make test` runs both suites
collect_ignore = ["torch"]

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY_MODEL = FIXTURES / "tiny-model"
CAPTURE = FIXTURES / "vllm_0.32_cpu_capture.json"
ADMIN_TOKEN = "test-admin-token"
PROCESS_DEADLINE_S = 600  # no process a test starts outlives this
# a server shared by the whole session (the session redis) lives as long as CI lets a run take
# (90 min): the suite takes over 10 min, so the 600 s deadline killed it under the last tests
SESSION_DEADLINE_S = 5400


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test`` with ``TEST_WORKERS`` 2, its default on 2+ CPUs; ``-n 2
    --dist loadfile``): each module runs whole on
    one worker (its module fixtures start once), and the e2e package is one unit, so its vLLM
    servers never run beside each other (vLLM's CPU build binds every server's threads to the
    same core; ``e2e/conftest.py`` orders that package) and its ``cluster`` starts once. The
    package comes first in collection order, so one worker takes it while the other runs the
    rest. (xdist's ``loadgroup`` marks do not group under pytest 9.2, whose node ids xdist 3.8
    cannot rewrite.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleOrE2E(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/e2e" if module.startswith("tests/e2e/") else module

    return ModuleOrE2E(config, log)


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker process chooses ports from its own slice of the range below
    the ephemeral ports (``KVROUTE_PORT_RANGE``, inherited by every ``kvroute up`` a test starts):
    a port chosen for a vLLM server still loading (it binds with SO_REUSEADDR but listens only
    once its engine is up, tens of seconds later) is then never chosen and bound by a test on the
    other worker meanwhile (a CI run once found a ZMQ publisher on a worker's HTTP port). Left
    alone when the variable is set already."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    whole = below_ephemeral_range()
    if count < 2 or not worker.startswith("gw") or os.environ.get(PORT_RANGE_ENV) or whole is None:
        return
    size = len(whole) // count
    low = whole.start + int(worker[2:]) * size
    os.environ[PORT_RANGE_ENV] = f"{low}-{low + size - 1}"


def free_port() -> int:
    """One free TCP port on 127.0.0.1 (for a setup that needs several, use :func:`free_ports`)."""
    return free_ports(1)[0]


def log_excerpt(text: str, tail_chars: int = 3000) -> str:
    """``text``'s last ``tail_chars`` characters, then its first traceback (to the exception line
    ending it; at most 4,000 characters) when that lies further up: a failed start's root cause
    (vLLM's engine core traceback, its lines prefixed ``(EngineCore_DP0 pid=N) ``) ends the failure
    message, where a truncated CI log still shows it, instead of being cut above the wrappers'
    tracebacks."""
    tail = text[-tail_chars:]
    start = text.find("Traceback (most recent call last):")
    if start < 0 or start >= len(text) - len(tail):
        return tail
    line_start = text.rfind("\n", 0, start) + 1
    prefix = text[line_start:start]
    first = []
    for line in text[line_start:].splitlines(True):
        if not line.startswith(prefix):
            continue  # another process's line, interleaved
        body = line[len(prefix):]
        first.append(body)
        if body.strip() and not body[:1].isspace() and not body.startswith(
                ("Traceback", "During handling", "The above exception")):
            break
    return f"{tail}\n[...]\n[first traceback, {prefix.strip() or 'top level'}]\n{''.join(first)[-4000:]}"


def logs_excerpt(log_dir: Path) -> str:
    """:func:`log_excerpt` of every ``*.log`` in ``log_dir``, those with a traceback last."""
    texts = {p.name: p.read_text(errors="replace") for p in sorted(log_dir.glob("*.log"))}
    order = sorted(texts, key=lambda name: "Traceback (most recent call last)" in texts[name])
    return "\n".join(f"--- {name}\n{log_excerpt(texts[name])}" for name in order)


def wait_workers_idle(base: str, timeout_s: float = 30) -> None:
    """Wait until a load scrape taken after this call shows every worker of the gateway at
    ``base`` idle (nothing running or waiting, nothing in flight through the gateway), so a
    decision explained next is not made on a scrape from the previous request's run while the
    request sent after it sees the next one. Fails the test after ``timeout_s``."""
    start = time.monotonic()
    while True:
        since = time.monotonic() - start  # before the call: a scrape younger than this is newer than start
        ws = httpx.get(base + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                       timeout=30).json()["workers"]
        if all(w["in_flight"] == 0 and w["engine"]["running"] == 0 and w["engine"]["waiting"] == 0
               and w["engine"]["scrape_age_s"] is not None and w["engine"]["scrape_age_s"] < since
               for w in ws):
            return
        if since > timeout_s:
            pytest.fail(f"workers not idle in a scrape within {timeout_s}s: {ws}")
        time.sleep(0.1)


def wait_until(check, timeout_s: float = 20.0, what: str = "condition", interval_s: float = 0.1):
    """Poll ``check()`` every ``interval_s`` until it returns something truthy and return that;
    raise AssertionError naming ``what`` and the last value after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= end:
            raise AssertionError(f"{what} not reached in {timeout_s}s (last: {last!r})")
        time.sleep(interval_s)


def admin_get(url: str, timeout_s: float = 20.0) -> httpx.Response:
    """``GET url`` with the admin token; an answer of 503 ``index_unavailable`` is asked again
    for up to ``timeout_s``: a gateway on a Redis index answers so for a moment
    (``retry_after_s``) after one Redis call passed its read timeout (0.5 s), which a loaded
    machine makes happen (the parallel suite did, once per few CI runs). Other answers are
    returned as they are."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def answered() -> httpx.Response | None:
        got = httpx.get(url, headers=headers, timeout=60)
        unavailable = got.status_code == 503 and got.json()["error"]["code"] == "index_unavailable"
        return None if unavailable else got
    return wait_until(answered, timeout_s, what=f"GET {url} answered with the index available")


class Proc:
    """A subprocess in its own session with a hard deadline; ``stop()`` kills the whole group."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 deadline_s: float = PROCESS_DEADLINE_S) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        e = dict(os.environ)
        e.setdefault("KVROUTE_ADMIN_TOKEN", ADMIN_TOKEN)
        if env:
            e.update(env)
        # `timeout` makes the process stop by itself even if the test runner dies.
        full = ["timeout", "-s", "KILL", str(int(deadline_s))] + argv
        self._log = open(self.log_path, "w")
        self.popen = subprocess.Popen(full, stdout=self._log, stderr=subprocess.STDOUT, env=e,
                                      start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40) -> str:
        """The log's last ``n`` lines, followed by its first traceback when that is further up."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        tail = "".join(text.splitlines(True)[-n:])
        return log_excerpt(text, len(tail))

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 10) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        self._log.close()


class ServerExited(RuntimeError):
    """A process :func:`wait_http` waited on exited before it answered (the message ends with its
    log's root cause, :func:`log_excerpt`)."""


def wait_http(url: str, proc: Proc | None = None, timeout_s: float = 60) -> None:
    """Poll ``url`` until it answers below 500; raise with the process log if it never does."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and not proc.alive():
            raise ServerExited(f"{proc.name} exited {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready in {timeout_s}s:\n{proc.log_tail() if proc else ''}")


def serve_gateway(cfg: dict, log_dir: Path, started: list[Proc], name: str = "gateway") -> tuple[str, Path, Proc]:
    """Write ``cfg`` to ``log_dir/<name>.yaml`` and start ``kvroute serve`` on it (appended to
    ``started``, which the caller stops); wait until it answers. ``(base URL, config path, process)``."""
    import yaml

    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc(name, kvroute_argv("serve", "--config", str(path)), log_dir)
    started.append(proc)
    base = f"http://127.0.0.1:{cfg['listen']['port']}"
    wait_http(base + "/health", proc, timeout_s=180)
    return base, path, proc


# what vLLM's API server logs when its engine core failed to start (vllm/v1/engine/utils.py)
ENGINE_START_FAILED = "Engine core initialization failed"


@contextlib.contextmanager
def running_up(name: str, up_args: list[str], log_dir: Path, env: dict[str, str], ready_s: float = 180):
    """``kvroute up`` with ``up_args`` (``--log-dir`` added: ``log_dir/up``) until its gateway-ready
    line, stopped on exit; yields the gateway's base URL. Fails the test with the logs when it exits
    or is not ready within ``ready_s``. When it exits because a vLLM engine failed to start
    (:data:`ENGINE_START_FAILED`), it is started once more after a warning ending with that log's
    root cause, the failed run's logs kept beside (``up-failed``): a CI machine once failed a
    module's servers that way, its root cause cut from the log."""
    for attempt in (1, 2):
        proc = Proc(name, kvroute_argv("up", *up_args, "--log-dir", str(log_dir / "up")), log_dir, env=env,
                    deadline_s=ready_s + 900)
        try:
            end = time.monotonic() + ready_s
            while not (m := re.search(r"gateway ready: (http://\S+)/v1", proc.log_path.read_text(errors="replace"))):
                if not proc.alive() or time.monotonic() > end:
                    logs = logs_excerpt(log_dir / "up")
                    if attempt == 1 and not proc.alive() and ENGINE_START_FAILED in logs:
                        break
                    pytest.fail(f"kvroute up not ready:\n{proc.log_tail()}\n{logs}")
                time.sleep(0.2)
            else:
                yield m.group(1)
                return
        finally:
            proc.stop(timeout_s=60)
        warnings.warn(f"kvroute up ({name}): a vLLM engine failed to start; starting again once:\n{logs}")
        (log_dir / "up").rename(log_dir / "up-failed")
        proc.log_path.rename(log_dir / f"{name}-failed.log")


def metric(base: str, name: str, **labels) -> float:
    """The value of the gateway's series ``name{labels}`` in ``base``'s ``/metrics`` (labels in
    sorted order, as prometheus-client writes them); 0.0 when the series is absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if labels else name
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def kvroute_argv(*args: str) -> list[str]:
    """argv running the ``kvroute`` CLI with this interpreter."""
    return [sys.executable, "-m", "kvroute", *args]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return TINY_MODEL


@pytest.fixture(scope="session")
def capture() -> dict:
    """The real vLLM 0.32 CPU capture: steps (requests, /tokenize answers) and ZMQ frames."""
    return json.loads(CAPTURE.read_text())


@pytest.fixture(scope="session")
def vllm_snippets(tmp_path_factory):
    """Runs snippets in vLLM's interpreter (``$KVR_VLLM_PYTHON``, checked as the e2e suite checks
    it), paying vLLM's import once a session: :class:`vllm_snippets.VllmSnippets`."""
    from e2e.conftest import vllm_python
    from vllm_snippets import VllmSnippets

    runner = VllmSnippets(vllm_python(), tmp_path_factory.mktemp("vllm-snippets") / "snippets.log")
    yield runner
    runner.close()


@pytest.fixture
def procs(tmp_path):
    """Factory: ``procs(name, argv, env=None) -> Proc``; every process is stopped at teardown."""
    started: list[Proc] = []

    def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, argv, tmp_path, env)
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on loopback for the session (``make test`` installs it: ``make install-system``)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not on PATH (`make install-system` installs it; `make test` runs that first)")
    port = free_port()
    p = Proc("redis", redis_argv(exe, port), tmp_path_factory.mktemp("redis"), deadline_s=SESSION_DEADLINE_S)
    wait_redis(port, p)
    yield f"redis://127.0.0.1:{port}/0"
    p.stop()


def redis_argv(exe: str, port: int) -> list[str]:
    """A redis-server (or valkey-server) on loopback ``port``, nothing persisted."""
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def wait_redis(port: int, proc: Proc, timeout_s: float = 10.0) -> None:
    """Wait until the server on loopback ``port`` answers PING; else stop ``proc`` and fail with
    its log."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    proc.stop()
    pytest.fail(f"{proc.name} did not answer PING on port {port}:\n{proc.log_tail()}")
