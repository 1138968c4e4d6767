"""``kvroute up``: the main job on one host.

Starts N workers (``--workers N``, ids ``w0``..; or a prefill-decode cluster, ``--prefill-workers P
--decode-workers D``: ids ``p0``.. with role ``prefill`` and ``d0``.. with role ``decode``, the
gateway's ``policy.pd`` on; with ``--engine vllm`` the KV moves through our connector and the
agents, so that needs ``--cpu-tier-bytes``) (``kvroute sim`` processes, or real vLLM OpenAI servers run by the interpreter
``--vllm-python`` with prefix caching, ZMQ KV events + replay, prompt-token details and the given
block size), one offload agent per worker when the index is Redis (it writes the worker's KV
events there) or when vLLM workers have CPU/SSD tiers, and the gateway (``kvroute serve``) on
``--port``. With tiers the agents own them and pull blocks from each other (started before their
workers, whose KV connector says hello to the agent as vLLM starts); with the embedded in-memory
index the gateway subscribes to the workers' KV events itself and the agents use the gateway as
their index (``kvroute agent --index http://127.0.0.1:PORT``: peer lookups and their published
peer states; they wait quietly for the gateway, which starts once the workers answer); shows progress while the workers load, prints the gateway URL once every part answers
and the gateway sees every worker healthy; on Ctrl-C, SIGTERM or the death of any child, stops every
process it started (each child runs in its own process group, terminated then killed) and exits.

Only the CLI contract of each part is used here: this module imports neither the router nor the
agent.
"""
from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvcore.lora_modules import parse_lora_modules
from kvcore.sliding_window import declared_window_tokens
from kvroute.engines import agent_argv, kvroute_argv, sim_argv, tier_argv_env, vllm_argv, vllm_env

STOP_GRACE_S = 10.0
GATEWAY_GRACE_S = 8.0  # under STOP_GRACE_S: the gateway exits before it is killed
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000  # below it: the well-known ports and the registered ports services most often use


PORT_RANGE_ENV = "KVROUTE_PORT_RANGE"


def port_range_from_env(value: str | None) -> range | None:
    """The ports of :data:`PORT_RANGE_ENV` (``LOW-HIGH``, both included), None when unset or empty.
    Raises ValueError, naming the variable, on another shape or a range outside 1-65535."""
    if not value or not value.strip():
        return None
    low_s, sep, high_s = value.strip().partition("-")
    try:
        low, high = int(low_s), int(high_s)
    except ValueError:
        low = high = 0
    if not sep or not 1 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH, two ports with 1 <= LOW <= HIGH <= 65535 "
                         f"(e.g. 20000-24999)")
    return range(low, high + 1)


def below_ephemeral_range(path: Path = _EPHEMERAL_RANGE) -> range | None:
    """``_LOWEST_PORT`` up to the kernel's ephemeral range (Linux ``net.ipv4.ip_local_port_range``,
    32768-60999 by default), None where that range cannot be read or leaves fewer than 1,000 ports
    below it. A port bound with port 0 (vLLM's engine and executor sockets, ZMQ's wildcard binds,
    every outgoing connection) always comes from the ephemeral range, so a port chosen below it is
    never taken by one of those between being chosen and being bound."""
    try:
        low, _ = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return None
    return range(_LOWEST_PORT, low) if low - _LOWEST_PORT >= 1000 else None


def _chosen_port_range() -> range | None:
    """Ports to choose from: those of :data:`PORT_RANGE_ENV` where it is set (launchers that run
    side by side on one host, each given its own range, never choose the same port; a range that
    reaches into the ephemeral one loses :func:`below_ephemeral_range`'s guarantee), else
    :func:`below_ephemeral_range`. Raises ValueError on a malformed :data:`PORT_RANGE_ENV`."""
    chosen = port_range_from_env(os.environ.get(PORT_RANGE_ENV))
    return chosen if chosen is not None else below_ephemeral_range()


def free_ports(n: int, host: str = "127.0.0.1", avoid: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now and none in ``avoid`` (e.g. a port chosen for a
    process that has not bound it yet), drawn at random, each port at most once, from
    :data:`PORT_RANGE_ENV`'s range where it is set (never anything else), else from below the
    kernel's ephemeral range (:func:`_chosen_port_range`; then from the ephemeral range through
    port 0 where there is no room below or none was free there). All are
    held open while choosing, so one call never returns the same port twice; another process
    choosing ports for itself may still take one before it is used. Raises RuntimeError when
    ``n`` ports cannot be found, ValueError on a malformed :data:`PORT_RANGE_ENV`."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    chosen_from = _chosen_port_range()
    only_chosen = port_range_from_env(os.environ.get(PORT_RANGE_ENV)) is not None  # never port 0
    draw = secrets.SystemRandom()
    candidates = draw.sample(chosen_from, min(len(chosen_from), 50 * n)) if chosen_from is not None else []
    try:
        for port in [*candidates, *([] if only_chosen else [0] * 1000)]:
            if len(ports) == n:
                break
            if port in avoid or port in ports:
                continue
            sock = socket.socket()
            try:
                sock.bind((host, port))
            except OSError:  # in use (or lingering); draw again
                sock.close()
                continue
            socks.append(sock)
            if sock.getsockname()[1] not in avoid:
                ports.append(sock.getsockname()[1])
        if len(ports) < n:
            within = f" in {PORT_RANGE_ENV}={os.environ[PORT_RANGE_ENV]}" if only_chosen else ""
            raise RuntimeError(f"no {n} free TCP ports on {host}{within}")
        return ports
    finally:
        for sock in socks:
            sock.close()


def free_port_runs(n: int, length: int, avoid: set[int], host: str = "127.0.0.1", tries: int = 200) -> list[int]:
    """The first ports of ``n`` runs of ``length`` consecutive TCP ports free on ``host`` now, no two
    runs overlapping and none in ``avoid`` (a data parallel worker's ranks publish on its event
    port + rank), each run inside :func:`free_ports`' range when it starts there. Raises
    RuntimeError when ``tries`` candidate runs were not enough."""
    starts: list[int] = []
    taken: set[int] = set(avoid)
    chosen_from = _chosen_port_range()
    for _ in range(tries):
        if len(starts) == n:
            break
        try:
            start = free_ports(1, host)[0]
        except RuntimeError:  # no free port left in the range: a failed try
            continue
        run = range(start, start + length)
        outside = chosen_from is not None and start in chosen_from and run[-1] not in chosen_from
        if run[-1] > 65535 or outside or taken.intersection(run):
            continue
        socks = []
        try:
            for port in run:
                sock = socket.socket()
                socks.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        starts.append(start)
        taken.update(run)
    if len(starts) < n:
        raise RuntimeError(f"no {n} runs of {length} free consecutive ports on {host}")
    return starts


@dataclass
class Child:
    """One started process, its role and log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    health_url: str | None = None


@dataclass
class Cluster:
    """Everything ``up`` started, stopped together by :meth:`stop`."""

    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], log_dir: Path, health_url: str | None = None,
              env: dict[str, str] | None = None) -> Child:
        """Start ``argv`` in its own process group, output to ``log_dir/name.log``; ``env`` is
        added to this process's environment."""
        log_path = log_dir / f"{name}.log"
        log = open(log_path, "w")
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **env} if env else None, preexec_fn=_die_with_parent)
        log.close()
        child = Child(name, popen, log_path, health_url)
        self.children.append(child)
        return child

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.popen.poll() is not None), None)

    def stop(self) -> None:
        """Stop the children newest first, each in turn: SIGTERM its process group, wait up to
        :data:`STOP_GRACE_S` for the group to empty (vLLM's engine and worker processes outlive
        its API server briefly), SIGKILL what is left, then the next. The gateway (started last)
        goes first and finishes its requests in flight (``GATEWAY_GRACE_S``) while the agents
        and workers still run; the agents go before the workers they follow."""
        for c in reversed(self.children):
            _signal_group(c.popen, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            try:
                c.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            while _group_alive(c.popen) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(c.popen) or c.popen.poll() is None:
                _signal_group(c.popen, signal.SIGKILL)
                c.popen.wait(5)


def _die_with_parent() -> None:
    """In the child before exec (Linux): get SIGTERM when ``up`` dies, even by SIGKILL, so a
    killed ``up`` leaves no worker behind. A no-op where prctl is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _group_alive(popen: subprocess.Popen) -> bool:
    """True while any process of ``popen``'s process group (its pid, see start_new_session) lives."""
    popen.poll()  # reap the leader so it does not count as a zombie member
    try:
        os.killpg(popen.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, http.client.HTTPException):
        # HTTPException: the port answers, but not in HTTP (another process bound it with
        # SO_REUSEADDR before the worker's server listened; the worker then fails to listen)
        return False


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-n:])
    except OSError:
        return ""


_LOG_PREFIX = re.compile(r"^(\(\S+ pid=\d+\)\s*)?(\w+\s+\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\s+\[[^\]]*\]\s*)?")


def _last_line(path: Path, width: int = 110) -> str:
    """The last non-empty line of a child's log without vLLM's "(Proc pid=N) INFO date [file]" prefix."""
    lines = [ln.strip() for ln in _tail(path, 5).splitlines() if ln.strip()]
    if not lines:
        return "(no output yet)"
    text = _LOG_PREFIX.sub("", lines[-1])
    return text if len(text) <= width else text[:width - 3] + "..."


def _gateway_sees_workers(base: str, n_workers: int) -> bool:
    """True when the gateway's /admin/workers lists ``n_workers`` workers, all healthy."""
    req = urllib.request.Request(base + "/admin/workers",
                                 headers={"Authorization": f"Bearer {os.environ['KVROUTE_ADMIN_TOKEN']}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            workers = json.loads(r.read()).get("workers", [])
    except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError):
        return False
    return len(workers) == n_workers and all(w.get("healthy") for w in workers)


def wait_cluster_ready(cluster: Cluster, timeout_s: float, out, progress_every_s: float = 15.0) -> None:
    """Wait until every child with a health URL answers 200, showing progress on ``out``; raise
    RuntimeError on a child's death, TimeoutError after ``timeout_s``.

    Progress: on a terminal (``out`` a TTY, rich installed) a live display with a line per child
    that was not ready at the first check (spinner, elapsed seconds, the last line of its log, then
    "ready"); otherwise plain lines (the count at each change and, every ``progress_every_s``, the
    last log line of each pending child), so logs and tests read them as before."""
    children = [c for c in cluster.children if c.health_url]
    if not children:
        return
    pending = children
    start = time.monotonic()
    view: _PlainReadyView | _LiveReadyView | None = None
    try:
        while True:
            dead = cluster.dead_child()
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with {dead.popen.returncode} during start-up:\n"
                                   f"{_tail(dead.log_path)}")
            pending = [c for c in pending if not _healthy(c.health_url)]
            if view is None:
                view = _LiveReadyView.open(out, pending, start) or _PlainReadyView(out, start, progress_every_s)
            view.update(len(children) - len(pending), len(children), pending)
            if not pending:
                view.close(ok=True)
                return
            if time.monotonic() - start > timeout_s:
                names = ", ".join(c.name for c in pending)
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {names}")
            time.sleep(0.25)
    finally:
        if view is not None:
            view.close(ok=False)


class _PlainReadyView:
    """Start-up progress as log lines: "[kvroute up] k/n ready (Ts)" at each change of k and, every
    ``every_s``, one line per pending child with the last line of its log."""

    def __init__(self, out, start: float, every_s: float) -> None:
        self.out, self.start, self.every_s = out, start, every_s
        self.shown = -1
        self.next_detail = start + every_s

    def update(self, ready: int, total: int, pending: list[Child]) -> None:
        """Print what changed since the last call (see the class doc)."""
        now = time.monotonic()
        if ready != self.shown:
            print(f"[kvroute up] {ready}/{total} ready ({now - self.start:.0f}s)", file=self.out, flush=True)
            self.shown = ready
        if pending and now >= self.next_detail:
            self.next_detail += self.every_s
            for c in pending:
                print(f"[kvroute up]   {c.name} loading ({now - self.start:.0f}s): {_last_line(c.log_path)}",
                      file=self.out, flush=True)

    def close(self, ok: bool) -> None:
        """Nothing to tidy up: every line is already printed."""


class _LiveReadyView:
    """Start-up progress as a rich live display on a terminal: one line per child still starting
    (spinner, elapsed seconds, the last line of its log, "ready" once it answers), and one plain
    "[kvroute up] k/n ready (Ts)" line when all are."""

    def __init__(self, out, progress, children: list[Child], start: float, escape) -> None:
        self.out, self.progress, self.start, self.escape = out, progress, start, escape
        self.tasks = {c.name: progress.add_task(c.name, total=1, status="starting") for c in children}
        self.ready: set[str] = set()
        self.total = 0
        self.closed = False
        progress.start()

    @classmethod
    def open(cls, out, pending: list[Child], start: float) -> "_LiveReadyView | None":
        """The live view of ``pending``, or None (plain lines) when ``out`` is not a terminal,
        nothing is pending or rich is missing."""
        if not pending or not getattr(out, "isatty", lambda: False)():
            return None
        try:
            from rich.console import Console
            from rich.markup import escape
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        except ImportError:
            return None
        console = Console(file=out)
        if not console.is_terminal or console.is_dumb_terminal:
            return None
        progress = Progress(SpinnerColumn(finished_text="[green]✓"), TextColumn("[bold]{task.description:<10}"),
                            TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console,
                            redirect_stdout=False, redirect_stderr=False)
        return cls(out, progress, pending, start, escape)

    def update(self, ready: int, total: int, pending: list[Child]) -> None:
        """Mark the children that answered ready; show each other one's last log line."""
        self.total = total
        waiting = {c.name for c in pending}
        width = max(20, self.progress.console.width - 32)
        for c in pending:
            if c.name in self.tasks:
                self.progress.update(self.tasks[c.name], status=f"[dim]{self.escape(_last_line(c.log_path, width))}")
        for name, task in self.tasks.items():
            if name not in waiting and name not in self.ready:
                self.ready.add(name)
                self.progress.update(task, completed=1, status="[green]ready")

    def close(self, ok: bool) -> None:
        """Stop the display (once), leaving its last state on screen; on success print the
        "k/n ready" line the plain view prints."""
        if self.closed:
            return
        self.closed = True
        self.progress.stop()
        if ok:
            print(f"[kvroute up] {self.total}/{self.total} ready ({time.monotonic() - self.start:.0f}s)",
                  file=self.out, flush=True)


@dataclass(frozen=True)
class WorkerPlan:
    """One worker ``up`` starts: ``id`` (the gateway's and its agent's worker id), ``index``
    among all the workers (its sim seed, its slice of the cores or its GPU) and ``role``."""

    id: str
    index: int
    role: str = "both"


def plan_workers(args: argparse.Namespace) -> list[WorkerPlan]:
    """The workers to start: ``w0``.. (``--workers N``, role ``both``), or ``p0``.. (role
    ``prefill``) then ``d0``.. (role ``decode``) for ``--prefill-workers P --decode-workers D``."""
    if is_pd(args):
        return ([WorkerPlan(f"p{i}", i, "prefill") for i in range(args.prefill_workers)]
                + [WorkerPlan(f"d{i}", args.prefill_workers + i, "decode") for i in range(args.decode_workers)])
    return [WorkerPlan(f"w{i}", i) for i in range(args.workers)]


def is_pd(args: argparse.Namespace) -> bool:
    """True for a prefill-decode cluster (``--prefill-workers``/``--decode-workers`` given)."""
    return getattr(args, "prefill_workers", None) is not None


def gateway_config(args: argparse.Namespace, workers: list[dict], port: int) -> dict:
    """The gateway config (DESIGN.md schema) for the cluster ``up`` starts; a prefill-decode
    cluster's workers carry their ``role`` (``workers`` entries as given) and its policy has
    ``pd: {enabled: true}`` (every model)."""
    index = {"backend": "memory"} if args.index == "memory" else {"backend": "redis", "url": args.index}
    policy: dict = {"name": args.policy}
    if is_pd(args):
        policy["pd"] = {"enabled": True}
    return {
        "listen": {"host": args.host, "port": port},
        "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
        "models": [{"name": args.served_model_name, "tokenizer": str(Path(args.model).resolve()),
                    "block_size": args.block_size,
                    **({"lora_adapters": list(args.lora)} if getattr(args, "lora", None) else {}),
                    **({"sliding_window_tokens": window} if (window := model_window_tokens(args.model)) else {})}],
        "index": index,
        "workers": workers,
        "policy": policy,
        # stopped first on the way down: its requests in flight finish while the workers still run
        "timeouts": {"shutdown_grace_s": GATEWAY_GRACE_S},
    }


def model_window_tokens(model: str) -> int | None:
    """The sliding window a hybrid model's ``config.json`` declares
    (:func:`kvcore.sliding_window.declared_window_tokens`), None without one or without the file."""
    try:
        hf_config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return declared_window_tokens(hf_config) if isinstance(hf_config, dict) else None


def model_has_media_inputs(model: str) -> bool:
    """Whether the model directory's ``config.json`` has a vision or audio tower (a multimodal
    model: its workers get vLLM's render endpoints, :mod:`router.route.render`)."""
    try:
        hf_config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(hf_config, dict) and any(k in hf_config for k in ("vision_config", "audio_config"))


def lora_adapters(items: list[str], check_files: bool) -> dict[str, Path]:
    """``--lora-modules`` items (vLLM's ``NAME=PATH`` or JSON ``{"name", "path"}`` forms) as name ->
    absolute path. ``check_files``: each path must be a PEFT adapter directory (with
    ``adapter_config.json``), as vLLM loads it at start. Raises ValueError naming the bad item."""
    out: dict[str, Path] = {}
    for name, path in parse_lora_modules(items).items():
        resolved = Path(path).expanduser().resolve()
        if check_files and not (resolved / "adapter_config.json").is_file():
            raise ValueError(f"--lora-modules: {path} has no adapter_config.json (a PEFT LoRA adapter directory)")
        out[name] = resolved
    return out


def run(args: argparse.Namespace) -> int:
    """Start the cluster, print the gateway URL, block until a signal or a child's death."""
    out = sys.stdout
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvroute-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster()
    stop_reason: list[str] = []

    def on_signal(signum, _frame):
        if stop_reason:  # already stopping (a group signal can arrive twice, e.g. via `timeout`)
            return
        stop_reason.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    token_note = "from KVROUTE_ADMIN_TOKEN"
    if not os.environ.get("KVROUTE_ADMIN_TOKEN"):
        os.environ["KVROUTE_ADMIN_TOKEN"] = secrets.token_urlsafe(18)  # inherited by the gateway
        token_note = os.environ["KVROUTE_ADMIN_TOKEN"]
    base = f"http://{args.host if args.host != '0.0.0.0' else '127.0.0.1'}:{args.port}"
    try:
        workers = []
        plan = plan_workers(args)
        # the gateway's port is chosen by the operator but bound last: no worker may take it first
        ports = free_ports(len(plan), avoid={args.port})
        event_ports = free_port_runs(2 * len(plan), getattr(args, "data_parallel_size", 1), {*ports, args.port})
        for w in plan:
            wid, i = w.id, w.index
            port, ev_port, replay_port = ports[i], event_ports[2 * i], event_ports[2 * i + 1]
            events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                          "endpoint": f"tcp://*:{ev_port}",
                          "replay_endpoint": f"tcp://*:{replay_port}"}
            events, replay = f"tcp://127.0.0.1:{ev_port}", f"tcp://127.0.0.1:{replay_port}"
            # with tiers, the agent owns them and pulls from peers (through Redis, or the gateway
            # holding the embedded index): it starts first, so the connector finds it
            owned = args.engine == "vllm" and bool(args.cpu_tier_bytes)
            agent_socket = str(log_dir / f"{wid}-tiers.sock") if owned else None
            if args.index != "memory" or owned:
                cluster.start(f"agent-{wid}", agent_argv(
                    args, i, events, replay, base, agent_socket, f"/dev/shm/kvroute-tier-{os.getpid()}-{wid}",
                    wid), log_dir)
            if args.engine == "vllm":
                argv, env = vllm_argv(args, port, events_cfg), vllm_env(i, len(plan), args.data_parallel_size)
                tier_args, tier_env = tier_argv_env(args, i, agent_socket, wid)
                argv, env = argv + tier_args, {**env, **tier_env}
            else:
                argv, env = sim_argv(args, i, port, events_cfg), None
            url = f"http://127.0.0.1:{port}"
            cluster.start(wid, argv, log_dir, url + "/health", env)
            workers.append({"id": wid, "url": url, "model": args.served_model_name,
                            "events": events, "replay": replay, **({"role": w.role} if is_pd(args) else {}),
                            **({"data_parallel_size": args.data_parallel_size} if args.data_parallel_size > 1 else {})})
        cfg_path = log_dir / "gateway.yaml"
        gw_workers = workers if args.index == "memory" else [
            {k: v for k, v in w.items() if k not in ("events", "replay")} for w in workers]
        cfg_path.write_text(json.dumps(gateway_config(args, gw_workers, args.port), indent=2))
        what = (f"{args.prefill_workers} prefill + {args.decode_workers} decode" if is_pd(args)
                else str(len(plan)))
        print(f"[kvroute up] starting {what} {args.engine} worker(s), then the gateway; logs in {log_dir}",
              file=out, flush=True)
        start = time.monotonic()
        wait_cluster_ready(cluster, args.ready_timeout_s, out)
        # the gateway starts once its workers answer, so its port never takes requests it must refuse
        cluster.start("gateway", kvroute_argv("serve", "--config", str(cfg_path), "--processes", str(getattr(args, "processes", 1))),
                      log_dir, base + "/health")
        wait_cluster_ready(cluster, args.ready_timeout_s, out)
        targets = len(plan) * getattr(args, "data_parallel_size", 1)  # the gateway's workers: one per rank
        while not _gateway_sees_workers(base, targets):  # health hysteresis: a few seconds
            dead = cluster.dead_child()
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with {dead.popen.returncode}:\n{_tail(dead.log_path)}")
            if time.monotonic() - start > args.ready_timeout_s:
                raise TimeoutError("the gateway never saw every worker healthy")
            time.sleep(0.25)
        print(f"[kvroute up] gateway ready: {base}/v1  (model {args.served_model_name!r}; Ctrl-C stops all)",
              file=out, flush=True)
        print(f"[kvroute up] admin API: {base}/admin/workers  (bearer token: {token_note})", file=out, flush=True)
        while True:
            dead = cluster.dead_child()
            if dead is not None:
                print(f"[kvroute up] {dead.name} exited with {dead.popen.returncode}; stopping everything:\n"
                      f"{_tail(dead.log_path)}", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        stop_reason.append("interrupted")
        print(f"[kvroute up] {stop_reason[0]}: stopping", file=out, flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"[kvroute up] failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # stopping is bounded (STOP_GRACE_S, then SIGKILL)
        cluster.stop()


def register(subparsers) -> None:
    """Add the ``up`` subcommand."""
    p = subparsers.add_parser("up", help="run N workers, their agents and the gateway on this host",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=None, help="number of workers, ids w0.. (default 2)")
    p.add_argument("--prefill-workers", type=int, default=None, metavar="P",
                   help="prefill-decode cluster (with --decode-workers, instead of --workers): P prefill "
                        "workers p0.. and the gateway's P/D on; --engine vllm needs --cpu-tier-bytes")
    p.add_argument("--decode-workers", type=int, default=None, metavar="D",
                   help="prefill-decode cluster: D decode workers d0.. (with --prefill-workers)")
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                   help="worker engine: simulated (default) or real vLLM run by --vllm-python")
    p.add_argument("--model", required=True, help="model directory (HF tokenizer + chat template)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the dir name)")
    p.add_argument("--host", default="127.0.0.1", help="gateway listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV block (default 32)")
    p.add_argument("--index", default="memory", help="'memory' (embedded, default) or a redis:// URL")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV capacity per worker, in blocks")
    p.add_argument("--max-model-len", type=int, default=None, help="workers' context length in tokens (vLLM's flag)")
    p.add_argument("--vllm-python", default=os.environ.get("KVR_VLLM_PYTHON", "python"),
                   help="interpreter with vLLM installed (default: $KVR_VLLM_PYTHON, else 'python')")
    p.add_argument("--vllm-args", default="", metavar="'ARGS'",
                   help="extra flags for each vLLM server, one shell-quoted string (e.g. '--dtype bfloat16')")
    p.add_argument("--cpu-tier-bytes", type=int, default=None,
                   help="vllm engine: RAM per worker for the CPU tier of KV blocks (enables the tiers: an agent per "
                        "worker owns them and pulls blocks from the other workers' agents)")
    p.add_argument("--ssd-tier-dir", default=None,
                   help="vllm engine: folder for the SSD tier (one subfolder per worker)")
    p.add_argument("--ssd-tier-bytes", type=int, default=None, help="vllm engine: bytes of SSD tier per worker")
    p.add_argument("--tier-option", action="append", default=[], metavar="KEY=VALUE",
                   help="vllm engine with tiers: a KV connector setting, repeatable: peer_locate_timeout_ms "
                        "(default 100), peer_pull_deadline_ms (1000), peer_connect_timeout_ms (1000), "
                        "peer_pull_min_blocks (4), agent_wait_s (10)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters every worker serves beside the model (vLLM's flag and forms: NAME=PATH or "
                        "JSON with name and path); vLLM workers get --enable-lora and --max-loras, the gateway "
                        "routes each adapter on its own cached blocks")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="engines per worker (vLLM's flag: each its own KV cache behind the worker's one URL); the "
                        "gateway routes to each rank as a worker of its own, <id>-dp<rank> (default 1)")
    p.add_argument("--policy", default="ttft",
                   help="routing policy (default ttft: lowest predicted TTFT, dispatch queue on; kv_aware, "
                        "round_robin, least_load, session)")
    p.add_argument("--speedup", type=float, default=1.0, help="simulated workers run this many times faster")
    p.add_argument("--processes", type=int, default=1,
                   help="gateway processes on the one port (kvroute serve --processes; default 1)")
    p.add_argument("--log-dir", default=None, help="where each process logs (default: a temp dir)")
    p.add_argument("--ready-timeout-s", type=float, default=None,
                   help="give up start-up after this long (default 300 s for sim, 900 s for vLLM)")

    def func(args: argparse.Namespace) -> int:
        if args.served_model_name is None:
            args.served_model_name = Path(args.model).name
        pd_flags = (args.prefill_workers, args.decode_workers)
        if any(v is not None for v in pd_flags):
            if args.workers is not None:
                p.error("--workers and --prefill-workers/--decode-workers are exclusive "
                        "(a P/D cluster's size is P + D)")
            if None in pd_flags:
                p.error("--prefill-workers and --decode-workers go together")
            if min(pd_flags) < 1:
                p.error("--prefill-workers and --decode-workers must be >= 1")
            if args.engine == "vllm" and not args.cpu_tier_bytes:
                p.error("--engine vllm with --prefill-workers/--decode-workers moves the KV through kvroute's "
                        "connector and one agent per worker: give --cpu-tier-bytes N (RAM per worker for the "
                        "tier the prefill side keeps the prompt's blocks in and the decode side loads them into)")
        elif args.workers is None:
            args.workers = 2
        elif args.workers < 1:
            p.error("--workers must be >= 1")
        if args.ready_timeout_s is None:
            args.ready_timeout_s = 900.0 if args.engine == "vllm" else 300.0
        if args.engine == "vllm" and shutil.which(args.vllm_python) is None:
            p.error(f"--vllm-python {args.vllm_python!r} is not an executable (set KVR_VLLM_PYTHON)")
        if args.index != "memory" and not args.index.startswith(("redis://", "rediss://", "unix://")):
            p.error("--index must be 'memory' or a redis:// URL")
        tier_flags = (args.cpu_tier_bytes, args.ssd_tier_dir, args.ssd_tier_bytes)
        if any(v is not None for v in tier_flags):
            if args.engine != "vllm":
                p.error("the CPU/SSD tiers need --engine vllm (they live behind vLLM's KV connector)")
            if not args.cpu_tier_bytes or args.cpu_tier_bytes <= 0:
                p.error("--cpu-tier-bytes must be > 0 when tiers are used")
            if (args.ssd_tier_dir is None) != (args.ssd_tier_bytes is None) or (args.ssd_tier_bytes or 1) <= 0:
                p.error("--ssd-tier-dir and --ssd-tier-bytes (> 0) go together")
        try:
            args.lora = lora_adapters(args.lora_modules, args.engine == "vllm")
            args.media_inputs = model_has_media_inputs(args.model)
        except ValueError as exc:
            p.error(str(exc))
        if args.data_parallel_size < 1:
            p.error("--data-parallel-size must be >= 1")
        if args.data_parallel_size > 1 and (is_pd(args) or args.index != "memory" or args.cpu_tier_bytes):
            p.error("--data-parallel-size > 1 works with the embedded index only (no P/D, no redis index, no "
                    "tiers): the agents and kvroute's KV connector follow one engine per worker")
        if args.lora and is_pd(args):
            p.error("--lora-modules with --prefill-workers/--decode-workers is not supported: kvroute's KV "
                    "connector moves no LoRA request's KV, so a decode worker would compute every prompt again")
        if (is_pd(args) or args.cpu_tier_bytes) and model_window_tokens(args.model):
            p.error(f"{args.model} is a hybrid model (sliding-window layers): kvroute's KV connector, which the "
                    "CPU/SSD tiers and --prefill-workers/--decode-workers need, moves only single-group KV caches")
        try:
            port_range_from_env(os.environ.get(PORT_RANGE_ENV))
        except ValueError as exc:
            p.error(str(exc))
        if args.tier_option:
            if not args.cpu_tier_bytes:
                p.error("--tier-option needs the tiers (--engine vllm --cpu-tier-bytes N)")
            try:
                tier_argv_env(args, 0)
            except ValueError as exc:
                p.error(str(exc))
        return run(args)

    p.set_defaults(func=func)
