"""``kvroute up``: the main job on one host.

Starts N workers (``kvroute sim`` processes), one offload agent per worker when the index is Redis
(with the embedded in-memory index the gateway subscribes to the workers' KV events itself), and
the gateway (``kvroute serve``) on ``--port``; prints the gateway URL when every part answers; on
Ctrl-C, SIGTERM or the death of any child, stops every process it started (each child runs in its
own process group, terminated then killed) and exits.

Only the CLI contract of each part is used here: this module imports neither the router nor the
agent.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
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

STOP_GRACE_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

    def start(self, name: str, argv: list[str], log_dir: Path, health_url: str | None = None) -> Child:
        log_path = log_dir / f"{name}.log"
        log = open(log_path, "w")
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        child = Child(name, popen, log_path, health_url)
        self.children.append(child)
        return child

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.popen.poll() is not None), None)

    def stop(self) -> None:
        for c in reversed(self.children):
            _signal_group(c.popen, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for c in self.children:
            try:
                c.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(c.popen, signal.SIGKILL)
                c.popen.wait(5)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-n:])
    except OSError:
        return ""


def _kvroute(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvroute", *args]


def _wait_ready(cluster: Cluster, timeout_s: float, out) -> None:
    """Wait until every child with a health URL answers 200; print progress; raise on a death."""
    pending = [c for c in cluster.children if c.health_url]
    start = time.monotonic()
    shown = -1
    while pending:
        dead = cluster.dead_child()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited with {dead.popen.returncode} during start-up:\n"
                               f"{_tail(dead.log_path)}")
        pending = [c for c in pending if not _healthy(c.health_url)]
        ready = sum(1 for c in cluster.children if c.health_url) - len(pending)
        if ready != shown:
            total = sum(1 for c in cluster.children if c.health_url)
            print(f"[kvroute up] {ready}/{total} ready ({time.monotonic() - start:.0f}s)", file=out, flush=True)
            shown = ready
        if not pending:
            return
        if time.monotonic() - start > timeout_s:
            names = ", ".join(c.name for c in pending)
            raise TimeoutError(f"not ready after {timeout_s:.0f}s: {names}")
        time.sleep(0.25)


def gateway_config(args: argparse.Namespace, workers: list[dict], port: int) -> dict:
    """The gateway config (DESIGN.md schema) for the cluster ``up`` starts."""
    index = {"backend": "memory"} if args.index == "memory" else {"backend": "redis", "url": args.index}
    return {
        "listen": {"host": args.host, "port": port},
        "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
        "models": [{"name": args.served_model_name, "tokenizer": str(Path(args.model).resolve()),
                    "block_size": args.block_size}],
        "index": index,
        "workers": workers,
        "policy": {"name": args.policy},
    }


def run(args: argparse.Namespace) -> int:
    """Start the cluster, print the gateway URL, block until a signal or a child's death."""
    out = sys.stdout
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvroute-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster()
    stop_reason: list[str] = []

    def on_signal(signum, _frame):
        stop_reason.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    token_note = "from KVROUTE_ADMIN_TOKEN"
    if not os.environ.get("KVROUTE_ADMIN_TOKEN"):
        os.environ["KVROUTE_ADMIN_TOKEN"] = secrets.token_urlsafe(18)  # inherited by the gateway
        token_note = os.environ["KVROUTE_ADMIN_TOKEN"]
    try:
        workers = []
        for i in range(args.workers):
            wid = f"w{i}"
            port, ev_port, replay_port = free_port(), free_port(), free_port()
            events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                          "endpoint": f"tcp://*:{ev_port}",
                          "replay_endpoint": f"tcp://*:{replay_port}"}
            argv = _kvroute("sim", "--model", str(args.model), "--served-model-name", args.served_model_name,
                            "--host", "127.0.0.1", "--port", str(port), "--block-size", str(args.block_size),
                            "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events_cfg),
                            "--seed", str(i))
            if args.num_gpu_blocks_override:
                argv += ["--num-gpu-blocks-override", str(args.num_gpu_blocks_override)]
            if args.speedup != 1.0:
                argv += ["--speedup", str(args.speedup)]
            url = f"http://127.0.0.1:{port}"
            cluster.start(wid, argv, log_dir, url + "/health")
            events, replay = f"tcp://127.0.0.1:{ev_port}", f"tcp://127.0.0.1:{replay_port}"
            workers.append({"id": wid, "url": url, "model": args.served_model_name,
                            "events": events, "replay": replay})
            if args.index != "memory":
                cluster.start(f"agent-{wid}", _kvroute(
                    "agent", "--worker-id", wid, "--events", events, "--replay", replay,
                    "--index", args.index, "--model", args.served_model_name,
                    "--block-size", str(args.block_size)), log_dir)
        cfg_path = log_dir / "gateway.yaml"
        gw_workers = workers if args.index == "memory" else [
            {k: v for k, v in w.items() if k not in ("events", "replay")} for w in workers]
        cfg_path.write_text(json.dumps(gateway_config(args, gw_workers, args.port), indent=2))
        base = f"http://{args.host if args.host != '0.0.0.0' else '127.0.0.1'}:{args.port}"
        cluster.start("gateway", _kvroute("serve", "--config", str(cfg_path)), log_dir, base + "/health")
        print(f"[kvroute up] starting {args.workers} {args.engine} worker(s) and the gateway; logs in {log_dir}",
              file=out, flush=True)
        _wait_ready(cluster, args.ready_timeout_s, out)
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
        print(f"[kvroute up] {stop_reason[0] if stop_reason else 'interrupted'}: stopping", file=out, flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"[kvroute up] failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()


def register(subparsers) -> None:
    """Add the ``up`` subcommand."""
    p = subparsers.add_parser("up", help="run N workers, their agents and the gateway on this host",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    p.add_argument("--engine", choices=["sim"], default="sim", help="worker engine (default sim)")
    p.add_argument("--model", required=True, help="model directory (HF tokenizer + chat template)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the dir name)")
    p.add_argument("--host", default="127.0.0.1", help="gateway listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV block (default 32)")
    p.add_argument("--index", default="memory", help="'memory' (embedded, default) or a redis:// URL")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV capacity per worker, in blocks")
    p.add_argument("--policy", default="kv_aware", help="routing policy (default kv_aware)")
    p.add_argument("--speedup", type=float, default=1.0, help="simulated workers run this many times faster")
    p.add_argument("--log-dir", default=None, help="where each process logs (default: a temp dir)")
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="give up start-up after this long")

    def func(args: argparse.Namespace) -> int:
        if args.served_model_name is None:
            args.served_model_name = Path(args.model).name
        if args.workers < 1:
            p.error("--workers must be >= 1")
        if args.index != "memory" and not args.index.startswith(("redis://", "rediss://", "unix://")):
            p.error("--index must be 'memory' or a redis:// URL")
        return run(args)

    p.set_defaults(func=func)
