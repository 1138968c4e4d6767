#!/usr/bin/env python3
"""Moving host-memory KV blocks between two processes over loopback TCP: raw TCP, our peer path
(offload_agent.peer's PeerServer + PeerClient) and, when installed, Mooncake's transfer engine
(TCP transport) and NIXL (UCX backend), side by side in Gbit/s of payload and as a ratio to raw TCP.

    .venv/bin/python benchmarks/bench_transfer_engines.py [--repeats 5] [--block-kib 64,2048]
        [--blocks 16,256] [--engine-python /tmp/te-venv/bin/python] [--methods ...]
        [--json FILE] [--plot DIR]

The transfer engines are optional: each is imported in its own process (by ``--engine-python``,
default this interpreter, so they can live in a scratch virtualenv apart from the repo's); one
that does not import is reported as "not installed" (or "does not load", with the import error)
and the rest still run. Nothing here needs a GPU. A scratch virtualenv that has both (CPU-only
Debian 12, Python 3.11; none of this belongs in the repo's own environment):

    python3 -m venv /tmp/te-venv
    /tmp/te-venv/bin/pip install nixl      # 1.5.1: pulls nixl-cu12, nixl-cu13 and torch (~6 GB)
    /tmp/te-venv/bin/pip install mooncake-transfer-engine-non-cuda
    apt-get install libibverbs1            # the non-CUDA Mooncake wheel still links libibverbs.so.1

(the plain ``mooncake-transfer-engine`` wheel also links libcudart.so.12, libcuda.so.1 and
libmlx5.so.1, so it does not import on a host without the GPU driver.)

Methods (each a server process holding the source buffer and a client process pulling into its
own destination buffer, both kept for the whole run; connections and registrations made once,
before any timing):

- ``raw-tcp``: one TCP connection (TCP_NODELAY, as our peer path sets); the client sends (block bytes, count), the server ``sendall``s
  each block straight from its buffer, the client ``recv_into``s its buffer: what plain Python
  sockets move on this machine, the reference of the ratios.
- ``kvroute-peer``: :class:`offload_agent.peer.server.PeerServer` (its defaults, one per block
  size, over a slab source that, like the agent's CPU tier, lends each block in place,
  ``lend_block``, checksummed after the send, and can copy it out, ``read_block``) and
  :class:`offload_agent.peer.client.PeerClient` pulling straight into the destination buffer
  (``into``, as the agent pulls into its pull area). Framing, checksums, key and fingerprint
  checks included. ``kvroute-peer-copy`` (only when named): the same source without
  ``lend_block``, so every block is copied out by the server's reading thread (the path of
  SSD-held blocks).
- ``mooncake-tcp``: ``mooncake.engine.TransferEngine`` on both sides, ``initialize("127.0.0.1",
  "P2PHANDSHAKE", "tcp", "")`` (no metadata server), both buffers registered, the client does
  ``batch_transfer_sync_read`` of the blocks (one descriptor per block).
- ``nixl-ucx-tcp``: ``nixl._api.nixl_agent`` with backend UCX and ``UCX_TLS=tcp`` on both sides
  (metadata exchanged out of band), both buffers registered as DRAM, the client makes a READ
  request of one descriptor per block (``initialize_xfer``, inside the timing: a caller pays it for
  every new set of blocks), posts it and polls ``check_xfer_state`` until DONE. The server's agent
  has NIXL's progress thread (UCX over TCP needs the target to progress: without it a READ never
  completes), the client's has none (its polling progresses it; with both, three threads spin for
  one transfer, which on a 2-core machine about halved the rate).
- ``nixl-ucx-default``: the same with UCX's own choice of transports; between two processes of
  one host that is shared memory / CMA, not the network, so it says what one host allows, not
  what a link between machines does (a reference only, not a transport to compare).

Cases: every block size x blocks per transfer (default 64 KiB and 2 MiB x 16 and 256). Per case
and method: one untimed transfer into a zeroed destination whose bytes are then compared with the
source's (the run fails on a mismatch), then ``--repeats`` timed transfers; the repeats go round
the methods in turn (round r of every method before round r+1), so they share the machine's noise;
the processes of the methods not being measured are stopped (SIGSTOP) meanwhile, as an idle NIXL
agent's progress thread spins a core (measured here: ~0.9 core per idle agent).
Time: from the client issuing the transfer to all bytes in its buffer. Printed: the median
Gbit/s of payload (8 x bytes / s) per method and case, its ratio to raw TCP's median in the same
case, min-max of the repeats; then the CPU seconds the client and the server spent per GB moved
(process CPU time of all threads; the server's read just before and after the transfer), which a
machine shared with other work disturbs less than wall time.

``--json FILE`` (:mod:`lab.figures`): table ``transfer`` (per method and case:
``method``, ``block_bytes``, ``blocks``, ``payload_bytes``, ``bits_per_s`` (median),
``ratio_to_raw_tcp``, ``min_bits_per_s``, ``max_bits_per_s``, ``runs_s``, ``repeats``,
``verified``, ``client_cpu_ns_per_byte`` and ``server_cpu_ns_per_byte``: medians of each
process's CPU time over the transfer, all its threads, per payload byte), table ``methods``
(per method: ``method``, ``status`` ran / not installed / does not load / failed, ``detail``,
``version``, ``python``); ``load_average_start`` and ``load_average_end``: the 1-minute load
average around the run; ``peer_path_revision``: the last commit of offload_agent/peer, with
``+uncommitted`` when the working tree measured differs from it. ``--plot DIR``: ``transfer.png``.
"""
from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import random
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
TAG = "@@kvr-te "                 # protocol lines between the parent and its children start with this
ENGINES = {"mooncake-tcp", "nixl-ucx-tcp", "nixl-ucx-default"}
DEFAULT_METHODS = ["raw-tcp", "kvroute-peer", "mooncake-tcp", "nixl-ucx-tcp", "nixl-ucx-default"]
ALL_METHODS = DEFAULT_METHODS + ["kvroute-peer-copy"]
PATTERN_PERIOD = (1 << 20) + 7    # source bytes repeat with this period: no two blocks alike


# ---- helpers used by every process (standard library only: the engine processes may run in a
# ---- virtualenv without the repo's dependencies) ---------------------------------------------
def say(kind: str, payload: object = None) -> None:
    """One protocol line to the parent."""
    sys.stdout.write(f"{TAG}{kind} {json.dumps(payload)}\n")
    sys.stdout.flush()


def pattern(n: int) -> bytearray:
    """``n`` deterministic bytes (the source's content; the client rebuilds them to verify)."""
    chunk = random.Random(7).randbytes(PATTERN_PERIOD)
    buf = bytearray(n)
    view = memoryview(buf)
    for off in range(0, n, PATTERN_PERIOD):
        piece = min(PATTERN_PERIOD, n - off)
        view[off:off + piece] = chunk[:piece]
    return buf


def address_of(buf: bytearray) -> tuple[int, object]:
    """The address of ``buf``'s bytes and the ctypes object that must be kept alive with it."""
    arr = (ctypes.c_char * len(buf)).from_buffer(buf)
    return ctypes.addressof(arr), arr


def block_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def fingerprint(block_bytes: int) -> bytes:
    return hashlib.blake2b(f"bench-transfer-{block_bytes}".encode(), digest_size=16).digest()


def wait_stdin_eof() -> None:
    """Answer the parent's ``cpu`` lines with this process's CPU seconds (all threads) until EOF."""
    while sys.stdin.readline():
        say("CPU", time.process_time())


# ---- probes ----------------------------------------------------------------------------------
def probe(method: str) -> dict:
    """Whether ``method``'s engine imports here: ``{"status", "detail", "version"}``."""
    from importlib import metadata

    def version(*dists: str) -> str:
        found = []
        for d in dists:
            try:
                found.append(f"{d} {metadata.version(d)}")
            except metadata.PackageNotFoundError:
                pass
        return ", ".join(found)

    try:
        if method == "mooncake-tcp":
            import mooncake.engine  # noqa: F401
            return {"status": "ran", "detail": "", "version": version(
                "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13")}
        import nixl
        from nixl._api import nixl_agent  # noqa: F401
        pkg = getattr(getattr(nixl, "_pkg", None), "__name__", "?")
        return {"status": "ran", "detail": f"module {pkg}", "version": version("nixl", "nixl-cu12", "nixl-cu13")}
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("mooncake", "nixl", "nixl_cu12", "nixl_cu13"):
            return {"status": "not installed", "detail": str(exc), "version": ""}
        return {"status": "does not load", "detail": f"{type(exc).__name__}: {exc}", "version": ""}
    except Exception as exc:    # a wheel that imports but lacks a shared library (libcudart, libibverbs)
        return {"status": "does not load", "detail": f"{type(exc).__name__}: {exc}", "version": ""}


# ---- servers (one process each) ----------------------------------------------------------------
def serve(method: str, slab_bytes: int, block_sizes: list[int]) -> None:
    slab = pattern(slab_bytes)
    if method == "raw-tcp":
        serve_raw_tcp(slab)
    elif method in ("kvroute-peer", "kvroute-peer-copy"):
        serve_peer(slab, block_sizes, copy=method.endswith("-copy"))
    elif method == "mooncake-tcp":
        from mooncake.engine import TransferEngine
        te = TransferEngine()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake TransferEngine.initialize failed")
        addr, keep = address_of(slab)
        if te.register_memory(addr, slab_bytes) != 0:
            raise RuntimeError("mooncake register_memory failed")
        say("READY", {"target": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr})
        wait_stdin_eof()
        te.unregister_memory(addr)
    else:   # nixl
        from nixl._api import nixl_agent, nixl_agent_config
        agent = nixl_agent(f"srv-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        addr, keep = address_of(slab)
        agent.register_memory([(addr, slab_bytes, 0, "")], "DRAM")
        say("READY", {"metadata": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": addr})
        wait_stdin_eof()


def serve_raw_tcp(slab: bytearray) -> None:
    view = memoryview(slab)
    lsock = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            head = bytearray(16)
            while True:
                got = 0
                while got < 16:
                    n = conn.recv_into(memoryview(head)[got:])
                    if not n:
                        return
                    got += n
                block_bytes, blocks = struct.unpack("<QQ", head)
                for i in range(blocks):
                    conn.sendall(view[i * block_bytes:(i + 1) * block_bytes])

    threading.Thread(target=run, daemon=True).start()
    say("READY", {"port": lsock.getsockname()[1]})
    wait_stdin_eof()


class SlabSource:
    """A BlockSource over a slab: block i of ``block_bytes`` at offset i x block_bytes, key
    :func:`block_key` (i). Like the agent's CPU tier: ``lend_block`` lends the block in place
    (the slab never changes here, so its check always holds), ``read_block`` copies it out
    (clients that take no lent blocks, or ``copy=True``)."""

    def __init__(self, slab: bytearray, block_bytes: int, copy: bool = False) -> None:
        self.view = memoryview(slab)
        self.block_bytes = block_bytes
        self.fingerprint_digest = fingerprint(block_bytes)
        self.index = {block_key(i): i for i in range(len(slab) // block_bytes)}
        if copy:
            self.lend_block = None

    def lend_block(self, key: bytes):
        i = self.index.get(key)
        if i is None:
            return None
        return self.view[i * self.block_bytes:(i + 1) * self.block_bytes], lambda: True

    def read_block(self, key: bytes, out: memoryview) -> bool:
        i = self.index.get(key)
        if i is None:
            return False
        out[:] = self.view[i * self.block_bytes:(i + 1) * self.block_bytes]
        return True


def serve_peer(slab: bytearray, block_sizes: list[int], copy: bool) -> None:
    import asyncio
    sys.path.insert(0, str(REPO))
    from offload_agent.peer.server import PeerServer

    async def main() -> None:
        servers, addrs = [], {}
        for bs in block_sizes:
            srv = PeerServer(SlabSource(slab, bs, copy), "127.0.0.1", 0)
            host, port = await srv.start()
            servers.append(srv)
            addrs[str(bs)] = f"{host}:{port}"
        say("READY", {"addrs": addrs})
        await asyncio.get_running_loop().run_in_executor(None, wait_stdin_eof)
        for srv in servers:
            await srv.close()

    asyncio.run(main())


# ---- clients (one process each): READY, then one "run" command per line ------------------------
class Client:
    """Pulls ``blocks`` blocks of ``block_bytes`` (source offsets i x block_bytes) into ``dest``
    at the same offsets; ``transfer`` returns seconds."""

    def __init__(self, method: str, info: dict, dest_bytes: int) -> None:
        self.method = method
        self.info = info
        self.dest = bytearray(dest_bytes)
        self.view = memoryview(self.dest)
        self.addr, self._keep = address_of(self.dest)
        self.detail = ""
        getattr(self, "_setup_" + method.split("-")[0])()

    def transfer(self, block_bytes: int, blocks: int) -> float:
        return getattr(self, "_transfer_" + self.method.split("-")[0])(block_bytes, blocks)

    # raw TCP
    def _setup_raw(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.info["port"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _transfer_raw(self, block_bytes: int, blocks: int) -> float:
        total = block_bytes * blocks
        t0 = time.perf_counter()
        self.sock.sendall(struct.pack("<QQ", block_bytes, blocks))
        got = 0
        while got < total:
            n = self.sock.recv_into(self.view[got:total])
            if not n:
                raise ConnectionError("raw TCP server closed")
            got += n
        return time.perf_counter() - t0

    # our peer path
    def _setup_kvroute(self) -> None:
        import asyncio
        sys.path.insert(0, str(REPO))
        from offload_agent.peer.client import PeerClient
        self.loop = asyncio.new_event_loop()
        self.peer = PeerClient()
        self.keys = [block_key(i) for i in range(len(self.dest) // min(int(b) for b in self.info["addrs"]))]

    def _transfer_kvroute(self, block_bytes: int, blocks: int) -> float:
        into = self.view[:blocks * block_bytes]

        async def pull():
            return await self.peer.pull(self.info["addrs"][str(block_bytes)], fingerprint(block_bytes), block_bytes,
                                        self.keys[:blocks], 60.0, lambda i, payload: None, into=into)

        t0 = time.perf_counter()
        res = self.loop.run_until_complete(pull())
        dt = time.perf_counter() - t0
        if res.error is not None or res.blocks != blocks:
            raise RuntimeError(f"peer pull: {res.blocks} of {blocks} blocks, error {res.error}")
        return dt

    # Mooncake
    def _setup_mooncake(self) -> None:
        from mooncake.engine import TransferEngine
        self.te = TransferEngine()
        if self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake TransferEngine.initialize failed")
        if self.te.register_memory(self.addr, len(self.dest)) != 0:
            raise RuntimeError("mooncake register_memory failed")

    def _transfer_mooncake(self, block_bytes: int, blocks: int) -> float:
        local = [self.addr + i * block_bytes for i in range(blocks)]
        remote = [self.info["addr"] + i * block_bytes for i in range(blocks)]
        t0 = time.perf_counter()
        rc = self.te.batch_transfer_sync_read(self.info["target"], local, remote, [block_bytes] * blocks)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"mooncake batch_transfer_sync_read returned {rc}")
        return dt

    # NIXL
    def _setup_nixl(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config
        # no progress thread on the pulling side: its own check_xfer_state polling drives UCX (with
        # one, two threads spin for one transfer; on 2 cores that about halved the rate)
        self.agent = nixl_agent(f"cli-{os.getpid()}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory([(self.addr, len(self.dest), 0, "")], "DRAM")
        self.remote = self.agent.add_remote_agent(base64.b64decode(self.info["metadata"]))
        self.detail = f"plugins {','.join(self.agent.get_plugin_list())}; UCX_TLS={os.environ.get('UCX_TLS', '(default)')}"

    def _transfer_nixl(self, block_bytes: int, blocks: int) -> float:
        ag, raddr = self.agent, self.info["addr"]
        t0 = time.perf_counter()
        local = ag.get_xfer_descs([(self.addr + i * block_bytes, block_bytes, 0) for i in range(blocks)], "DRAM")
        remote = ag.get_xfer_descs([(raddr + i * block_bytes, block_bytes, 0) for i in range(blocks)], "DRAM")
        handle = ag.initialize_xfer("READ", local, remote, self.remote)
        state = ag.transfer(handle)
        while state == "PROC":
            state = ag.check_xfer_state(handle)
        dt = time.perf_counter() - t0
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"nixl transfer ended {state}")
        return dt


def client_main(method: str, info: dict, dest_bytes: int) -> None:
    client = Client(method, info, dest_bytes)
    say("READY", {"detail": client.detail})
    for line in sys.stdin:
        block_bytes, blocks, verify = (int(x) for x in line.split())
        try:
            total = block_bytes * blocks
            if verify:
                ctypes.memset(client.addr, 0, total)
            cpu0 = time.process_time()
            dt = client.transfer(block_bytes, blocks)
            cpu = time.process_time() - cpu0
            ok = None
            if verify:
                got = client.dest if total == len(client.dest) else client.dest[:total]
                ok = got == pattern(total)         # bytearray ==: memcmp (memoryview == goes item by item)
            say("DONE", {"seconds": dt, "cpu_s": cpu, "verified": ok})
        except Exception as exc:
            say("ERROR", f"{type(exc).__name__}: {exc}")


# ---- the parent --------------------------------------------------------------------------------
class Child:
    """A child process speaking the tagged-line protocol on its stdout; stderr goes to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_dir: Path, name: str, deadline_s: float) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(["timeout", "-s", "KILL", str(int(deadline_s))] + argv, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)     # its own process group: see signal()
        self.fd = self.proc.stdout.fileno()
        self.buf = b""

    def read(self, timeout_s: float) -> tuple[str, object]:
        """The next tagged line: ``(kind, payload)``; untagged output (native libraries' logs) is
        copied to the log file."""
        end = time.monotonic() + timeout_s
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                at = text.find(TAG)          # a native library's output may precede it on the line
                if at >= 0:
                    kind, _, payload = text[at + len(TAG):].partition(" ")
                    return kind, json.loads(payload)
                self.log.write(line + b"\n")
                self.log.flush()
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer in {timeout_s:.0f} s; log: {self.tail()}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                data = os.read(self.fd, 1 << 16)
                if not data:
                    self.proc.wait()
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log: {self.tail()}")
                self.buf += data

    def signal(self, sig: int) -> None:
        """``sig`` to the child's process group (``timeout`` and the Python process under it)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def tail(self, n: int = 1500) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Method:
    def __init__(self, name: str, python: str) -> None:
        self.name = name
        self.python = python
        self.status = "ran"
        self.detail = ""
        self.version = ""
        self.server: Child | None = None
        self.client: Child | None = None
        self.runs: dict[tuple[int, int], list[float]] = {}
        self.cpu: dict[tuple[int, int], list[tuple[float, float]]] = {}     # (client, server) CPU s
        self.verified: dict[tuple[int, int], bool] = {}

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("UCX_TLS", None)
        if self.name == "nixl-ucx-tcp":
            env["UCX_TLS"] = "tcp"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, args: argparse.Namespace, log_dir: Path, slab_bytes: int, block_sizes: list[int]) -> None:
        common = [self.python, str(SCRIPT), "--method", self.name]
        self.server = Child(common + ["--role", "server", "--slab-bytes", str(slab_bytes), "--block-sizes",
                                      ",".join(map(str, block_sizes))], self.env(), log_dir, self.name + "-server",
                            args.deadline_s)
        kind, info = self.server.read(args.setup_timeout_s)
        if kind != "READY":
            raise RuntimeError(f"server: {kind} {info}")
        self.client = Child(common + ["--role", "client", "--dest-bytes", str(slab_bytes), "--info", json.dumps(info)],
                            self.env(), log_dir, self.name + "-client", args.deadline_s)
        kind, ready = self.client.read(args.setup_timeout_s)
        if kind != "READY":
            raise RuntimeError(f"client: {kind} {ready}")
        self.detail = "; ".join(x for x in (self.detail, ready.get("detail", "")) if x)

    def server_cpu_s(self, timeout_s: float) -> float:
        self.server.send("cpu")
        kind, cpu = self.server.read(timeout_s)
        if kind != "CPU":
            raise RuntimeError(f"server: {kind} {cpu}")
        return cpu

    def run(self, block_bytes: int, blocks: int, verify: bool, timeout_s: float) -> float:
        """One transfer: its seconds; its client and server CPU seconds go to ``self.cpu``."""
        server0 = self.server_cpu_s(timeout_s)
        self.client.send(f"{block_bytes} {blocks} {int(verify)}")
        kind, res = self.client.read(timeout_s)
        if kind != "DONE":
            raise RuntimeError(f"{kind}: {res}; log: {self.client.tail()}")
        if not verify:
            self.cpu.setdefault((block_bytes, blocks), []).append((res["cpu_s"], self.server_cpu_s(timeout_s) - server0))
        if verify:
            self.verified[(block_bytes, blocks)] = bool(res["verified"])
            if not res["verified"]:
                raise RuntimeError(f"{block_bytes} B x {blocks}: the destination's bytes differ from the source's")
        return res["seconds"]

    def pause(self, paused: bool) -> None:
        """SIGSTOP (or SIGCONT) both processes: an idle NIXL agent's progress thread spins a core,
        which would slow the method being measured on a small machine."""
        for child in (self.client, self.server):
            if child is not None:
                child.signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        self.pause(False)
        for child in (self.client, self.server):
            if child is not None:
                child.stop()


def peer_revision() -> str:
    """The last commit of offload_agent/peer, ``+uncommitted`` when the working tree differs
    (the peer path measured is the working tree's)."""
    try:
        rev = subprocess.run(["git", "log", "-1", "--format=%h", "--", "offload_agent/peer"], cwd=REPO,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "offload_agent/peer"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (rev or "?") + ("+uncommitted" if dirty else "")


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def case_label(block_bytes: int, blocks: int) -> str:
    size = f"{block_bytes >> 20} MiB" if block_bytes >= 1 << 20 and block_bytes % (1 << 20) == 0 else \
        f"{block_bytes >> 10} KiB" if block_bytes % 1024 == 0 else f"{block_bytes} B"
    return f"{size} x {blocks}"


def bench(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO))
    from lab.figures import add_chart, add_table, emit, new_figures

    fig = new_figures("bench_transfer_engines", args)
    block_sizes = [kib << 10 for kib in parse_ints(args.block_kib)]
    counts = parse_ints(args.blocks)
    cases = [(bs, n) for bs in block_sizes for n in counts]
    slab_bytes = max(bs * n for bs, n in cases)
    engine_python = args.engine_python or sys.executable
    methods = [Method(m, engine_python if m in ENGINES else sys.executable) for m in args.methods.split(",") if m]
    unknown = [m.name for m in methods if m.name not in ALL_METHODS]
    if unknown:
        print(f"unknown methods {unknown}; known: {', '.join(ALL_METHODS)}", file=sys.stderr)
        return 2
    load0 = os.getloadavg()[0]
    print(f"Loopback transfer of host buffers, {len(cases)} cases, {args.repeats} timed repeats each "
          f"(after one verified warm-up transfer); engines in {engine_python}; {os.cpu_count()} CPUs, "
          f"load average {load0:.2f}")
    failed = False
    log_dir = Path(tempfile.mkdtemp(prefix="kvr-bench-te-"))
    running: list[Method] = []
    try:
        for m in methods:
            if m.name in ENGINES:
                out = subprocess.run([m.python, str(SCRIPT), "--role", "probe", "--method", m.name], env=m.env(),
                                     capture_output=True, text=True, timeout=args.setup_timeout_s)
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith(TAG)]
                res = json.loads(lines[-1][len(TAG):].partition(" ")[2]) if lines else \
                    {"status": "does not load", "detail": (out.stderr.strip().splitlines() or ["?"])[-1], "version": ""}
                m.status, m.detail, m.version = res["status"], res["detail"], res["version"]
                if m.status != "ran":
                    print(f"  {m.name}: {m.status} ({m.detail})")
                    continue
            try:
                m.start(args, log_dir, slab_bytes, block_sizes)
                for bs, n in cases:
                    m.run(bs, n, True, args.transfer_timeout_s)
                m.pause(True)
                running.append(m)
                print(f"  {m.name}: ready{' (' + m.version + ')' if m.version else ''}"
                      f"{'; ' + m.detail if m.detail else ''}; every case's bytes verified")
            except Exception as exc:
                m.status, m.detail = "failed", f"{m.detail}; {exc}".strip("; ")
                print(f"  {m.name}: FAILED: {exc}")
                failed = True
                m.stop()
        for _ in range(args.repeats):
            for bs, n in cases:
                for m in list(running):
                    try:
                        m.pause(False)
                        m.runs.setdefault((bs, n), []).append(m.run(bs, n, False, args.transfer_timeout_s))
                        m.pause(True)
                    except Exception as exc:
                        m.status, m.detail = "failed", f"{m.detail}; {exc}".strip("; ")
                        print(f"  {m.name}: FAILED during the repeats: {exc}")
                        failed = True
                        running.remove(m)
                        m.stop()
    finally:
        for m in methods:
            m.stop()

    load1 = os.getloadavg()[0]
    fig["load_average_start"], fig["load_average_end"] = load0, load1
    fig["peer_path_revision"] = peer_revision()
    ran = [m for m in methods if m.runs]
    raw = next((m for m in methods if m.name == "raw-tcp" and m.runs), None)
    print(f"\nPayload Gbit/s, median of {args.repeats} repeats (ratio to raw TCP; min-max); load average "
          f"{load0:.2f} at the start, {load1:.2f} at the end; peer path at {fig['peer_path_revision']}")
    width = 26
    print(f"  {'case':14s}" + "".join(f"{m.name:>{width}s}" for m in ran))
    rows = []
    for bs, n in cases:
        line = f"  {case_label(bs, n):14s}"
        raw_med = None
        if raw is not None and (bs, n) in raw.runs:
            raw_med = statistics.median(bs * n * 8 / s for s in raw.runs[(bs, n)])
        for m in ran:
            runs = m.runs.get((bs, n))
            if not runs:
                line += f"{'-':>{width}s}"
                continue
            rates = [bs * n * 8 / s for s in runs]
            med = statistics.median(rates)
            ratio = med / raw_med if raw_med else None
            cell = f"{med / 1e9:.2f} ({ratio:.2f}x; {min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f})" if ratio is not None \
                else f"{med / 1e9:.2f} ({min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f})"
            line += f"{cell:>{width}s}"
            cpu = m.cpu.get((bs, n), [])
            rows.append({"method": m.name, "case": case_label(bs, n), "block_bytes": bs, "blocks": n,
                         "payload_bytes": bs * n, "bits_per_s": med, "ratio_to_raw_tcp": ratio,
                         "min_bits_per_s": min(rates), "max_bits_per_s": max(rates), "runs_s": runs,
                         "repeats": len(runs), "verified": m.verified.get((bs, n), False),
                         "client_cpu_ns_per_byte": statistics.median(c * 1e9 / (bs * n) for c, _ in cpu) if cpu else None,
                         "server_cpu_ns_per_byte": statistics.median(v * 1e9 / (bs * n) for _, v in cpu) if cpu else None})
        print(line)
    add_table(fig, "transfer", rows)
    print(f"\nCPU seconds per GB of payload (= ns per byte), median of {args.repeats}: client + server "
          f"(busy-polling threads count in full; less is better on a loaded machine)")
    print(f"  {'case':14s}" + "".join(f"{m.name:>{width}s}" for m in ran))
    for bs, n in cases:
        line = f"  {case_label(bs, n):14s}"
        for m in ran:
            r = next((r for r in rows if r["method"] == m.name and r["blocks"] == n and r["block_bytes"] == bs), None)
            cell = "-" if r is None or r["client_cpu_ns_per_byte"] is None else \
                f"{r['client_cpu_ns_per_byte']:.2f} + {r['server_cpu_ns_per_byte']:.2f}"
            line += f"{cell:>{width}s}"
        print(line)
    add_table(fig, "methods", [{"method": m.name, "status": m.status, "detail": m.detail, "version": m.version,
                                "python": m.python} for m in methods])
    for m in methods:
        if not m.runs:
            print(f"  {m.name}: {m.status}{' (' + m.detail + ')' if m.detail else ''}")
    add_chart(fig, "bars", "transfer.png", table="transfer", group_by="case", values=["bits_per_s"],
              series_by="method", scale=1e-9, ylabel="Gbit/s",
              title=f"Loopback transfer of host buffers, median of {args.repeats}")
    emit(fig, args)
    if failed:
        print(f"children's logs kept in {log_dir}", file=sys.stderr)
    else:
        for p in log_dir.iterdir():
            p.unlink()
        log_dir.rmdir()
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed transfers per method and case (default 5)")
    ap.add_argument("--block-kib", default="64,2048", help="block sizes in KiB, comma-separated (default 64,2048)")
    ap.add_argument("--blocks", default="16,256", help="blocks per transfer, comma-separated (default 16,256)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, of {', '.join(ALL_METHODS)} (default: {','.join(DEFAULT_METHODS)})")
    ap.add_argument("--engine-python", default=os.environ.get("KVR_TE_PYTHON", ""),
                    help="interpreter that has the transfer engines installed (default: $KVR_TE_PYTHON, "
                         "else this one)")
    ap.add_argument("--setup-timeout-s", type=float, default=120.0)
    ap.add_argument("--transfer-timeout-s", type=float, default=120.0)
    ap.add_argument("--deadline-s", type=float, default=1800.0, help="every child is killed after this long")
    # internal: the children
    ap.add_argument("--role", choices=["parent", "server", "client", "probe"], default="parent", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="", help=argparse.SUPPRESS)
    ap.add_argument("--slab-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dest-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--block-sizes", default="", help=argparse.SUPPRESS)
    ap.add_argument("--info", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="write the figures (tables transfer and methods, the settings) to FILE as JSON")
    ap.add_argument("--plot", type=Path, default=None, metavar="DIR",
                    help="draw the figures as PNG charts into DIR (created; needs matplotlib)")
    args = ap.parse_args()
    if args.role == "probe":
        say("PROBE", probe(args.method))
        return 0
    if args.role == "server":
        serve(args.method, args.slab_bytes, parse_ints(args.block_sizes))
        return 0
    if args.role == "client":
        client_main(args.method, json.loads(args.info), args.dest_bytes)
        return 0
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
