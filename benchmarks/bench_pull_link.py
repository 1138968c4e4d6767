#!/usr/bin/env python3
"""Throughput of a peer pull on loopback, hop by hop, against a plain TCP socket moving the same
bytes. Prints, per block size and pull size, each method's median Gbit/s over ``--repeats``
rounds and its ratio to raw TCP:

- ``raw_tcp``: a plain sender process writes the pull's bytes on a kept TCP connection, this
  process receives them with ``recv_into`` into one buffer;
- ``peer``: this process's :class:`PeerClient` pulls the blocks into one buffer (``into``) from
  agent A's :class:`PeerServer` (agent A a :class:`TierService` in its own process, its blocks in
  its CPU tier file), checksums verified;
- ``agent``: the connector's side, :meth:`AgentLink.pull` from this process to agent B (a
  :class:`TierService` in its own process) which pulls from agent A into its pull area; the blocks
  read where they landed (``into`` None: what a connector that maps the pull area gets);
- ``agent_into``: the same, with the blocks copied into the caller's buffer as they land.

    .venv/bin/python benchmarks/bench_pull_link.py [--repeats 5] [--block-bytes 65536 2097152]
        [--blocks 16 256] [--json out.json] [--plot plots/]

After a warm-up run of each method (connections made, pages touched), ``--repeats`` rounds run
each method once, one after the other, so that they share the machine's noise; a run is as many
pulls one after the other as move ``--run-mib`` (each pull from its request to its last byte). A
method's ratio is the median over the rounds of its Gbit/s over raw TCP's in the same round. Aim:
``agent`` >= 0.8 x ``raw_tcp``. Each process is one Python interpreter; on a machine with fewer
cores than the three (four with raw TCP) processes, the figures are the CPUs', not the code's.

``--json FILE`` writes table ``pull_link`` (per block size, pull size and method: ``gbit_s`` (the
median), ``runs_gbit_s`` (each round's), ``ratio_to_raw_tcp`` (the median of the rounds' ratios),
``pull_bytes``, ``block_bytes``, ``blocks``, ``repeats``); ``--plot DIR`` draws ``pull_link.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# numpy (the agent's slot map) needs no BLAS: no idle BLAS threads in any process here (inherited)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from kvcore.index.memory import MemoryIndex  # noqa: E402
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402
from offload_agent.agent_link import AgentLink  # noqa: E402
from offload_agent.peer.client import PeerClient  # noqa: E402
from offload_agent.tier_service import TierService  # noqa: E402
from offload_agent.tiers.shm_slab import ShmSlab  # noqa: E402

METHODS = ("raw_tcp", "peer", "agent", "agent_into")
BLOCK_TOKENS = 16
DEADLINE_MS = 60_000.0
START_TIMEOUT_S = 300  # a loaded machine may take long to start a process and fill its tier
_SIZE = struct.Struct("<Q")


def block_keys(n: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest() for i in range(n)]


def hello_header(block_bytes: int) -> dict:
    digest = hashlib.blake2b(f"bench shard {block_bytes}".encode(), digest_size=16).digest()
    return {"op": "hello", "role": "worker", "pid": 0, "block_bytes": block_bytes, "fingerprint": {},
            "fingerprint_digest": digest.hex()}


class OnePeer(MemoryIndex):
    """Agent B's index: its only peer is agent A at ``addr``."""

    def __init__(self, addr: str, engine_hex: str) -> None:
        super().__init__()
        self.state = {"a": {"peer": {"serve": addr, "engine_fingerprint": engine_hex}}}

    async def worker_states(self) -> dict:
        return self.state


# ---- the other processes ---------------------------------------------------------------------
def raw_sender(conn, nbytes: int) -> None:
    """On the one connection it accepts, send ``size`` bytes for every 8-byte size asked, until it
    closes."""
    lsock = socket.create_server(("127.0.0.1", 0))
    conn.send(lsock.getsockname()[1])
    data = memoryview(bytearray(b"\x5a" * nbytes))
    lsock.settimeout(120)
    sock, _ = lsock.accept()
    sock.settimeout(120)
    with sock:
        while (ask := sock.recv(8)) and len(ask) == 8:
            sock.sendall(data[:_SIZE.unpack(ask)[0]])


def agent_process(conn, role: str, work: str, block_bytes: int, blocks: int, peer_addr: str | None) -> None:
    asyncio.run(_agent(conn, role, Path(work), block_bytes, blocks, peer_addr))


async def _agent(conn, role: str, work: Path, block_bytes: int, blocks: int, peer_addr: str | None) -> None:
    hello = hello_header(block_bytes)
    index = MemoryIndex() if peer_addr is None else OnePeer(peer_addr, hello["fingerprint_digest"])
    svc = TierService(role, "bench", BLOCK_TOKENS, work / f"{role}.sock", work / f"{role}.shm", blocks * block_bytes,
                      index, serve=("127.0.0.1", 0) if role == "a" else None, peer_pull_max_bytes=blocks * block_bytes,
                      remove_on_exit=True)
    await svc.start()
    try:
        if role == "a":  # agent A's connector has stored every block in its CPU tier
            answer = await asyncio.to_thread(AgentLink(str(svc.socket_path)).call, hello)
            shm = ShmSlab.attach(answer["shm_path"])
            for slot, key in enumerate(block_keys(blocks)):
                shm.begin_write(slot)
                shm.slot_view(slot)[:] = bytes([slot % 251]) * block_bytes
                shm.end_write(slot, key)
            shm.close()
        conn.send(svc.serving_at or str(svc.socket_path))
        await asyncio.to_thread(conn.recv)  # until told to stop
    finally:
        await svc.stop()


def start(target, *args):
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if not parent.poll(START_TIMEOUT_S):
        raise RuntimeError(f"{target.__name__} did not start")
    return proc, parent, parent.recv()


# ---- one block size --------------------------------------------------------------------------
async def measure(block_bytes: int, pulls: list[int], repeats: int, work: Path,
                  min_run_bytes: int) -> dict[tuple[int, str], list[float]]:
    """Gbit/s of every method and pull size, ``repeats`` runs each (a run: as many pulls, one
    after the other, as move ``min_run_bytes``, at least one)."""
    most = max(pulls)
    keys, digest = block_keys(most), bytes.fromhex(hello_header(block_bytes)["fingerprint_digest"])
    procs = []
    try:
        procs.append(start(raw_sender, most * block_bytes))
        raw = socket.create_connection(("127.0.0.1", procs[-1][2]), timeout=60)
        procs.append(start(agent_process, "a", str(work), block_bytes, most, None))
        peer_addr = procs[-1][2]
        procs.append(start(agent_process, "b", str(work), block_bytes, most, peer_addr))
        link = AgentLink(procs[-1][2], timeout_s=60)
        assert link.call(hello_header(block_bytes))["ok"]
        client = PeerClient()
        buf = memoryview(bytearray(most * block_bytes))

        def raw_pull(n: int) -> int:
            raw.sendall(_SIZE.pack(n * block_bytes))
            got = 0
            while got < n * block_bytes:
                got += raw.recv_into(buf[got:n * block_bytes])
            return n

        async def peer_pull(n: int) -> int:
            res = await client.pull(peer_addr, digest, block_bytes, keys[:n], DEADLINE_MS / 1000,
                                    lambda i, data: None, into=buf)
            return res.blocks

        def agent_pull(n: int, into: memoryview | None) -> int:
            got = link.pull("a", keys[:n], digest, DEADLINE_MS, into)
            return got.blocks

        async def run(method: str, n: int) -> float:
            pulls = max(1, min_run_bytes // (n * block_bytes))
            t0 = time.perf_counter()
            for _ in range(pulls):
                if method == "raw_tcp":
                    got = raw_pull(n)
                elif method == "peer":
                    got = await peer_pull(n)
                else:
                    got = agent_pull(n, buf if method == "agent_into" else None)
                if got != n:
                    raise RuntimeError(f"{method}: {got} of {n} blocks came")
            return pulls * n * block_bytes * 8 / (time.perf_counter() - t0) / 1e9

        out: dict[tuple[int, str], list[float]] = {}
        for n in pulls:
            for method in METHODS:          # a warm-up run each: connections made, pages touched
                await run(method, n)
            for _ in range(repeats):        # rounds of one run of each method: they share the noise
                for method in METHODS:
                    out.setdefault((n, method), []).append(await run(method, n))
        await client.close()
        link.close()
        raw.close()
        return out
    finally:
        for proc, pipe, _ in procs:
            pipe.send("stop")
        for proc, pipe, _ in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each method per size (default 5)")
    ap.add_argument("--block-bytes", type=int, nargs="+", default=[64 << 10, 2 << 20])
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 256], help="blocks per pull")
    ap.add_argument("--run-mib", type=int, default=64,
                    help="a run is as many pulls as move this many MiB, one after the other (default 64)")
    add_output_args(ap)
    args = ap.parse_args()
    fig = new_figures("bench_pull_link", args)
    print(f"pull throughput on loopback, Gbit/s, median of {args.repeats} rounds of one run (>= {args.run_mib} MiB) "
          "per method (ratio to raw TCP: median of the rounds')")
    print(f"{'block':>9} {'blocks':>6} " + " ".join(f"{m:>17}" for m in METHODS))
    rows = []
    shm_dir = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="kvr-bench-pull-", dir=shm_dir) as work:
        for bb in args.block_bytes:
            runs = asyncio.run(measure(bb, args.blocks, args.repeats, Path(work), args.run_mib << 20))
            for n in args.blocks:
                raw = runs[(n, "raw_tcp")]
                cells = []
                for m in METHODS:
                    med = statistics.median(runs[(n, m)])
                    ratio = statistics.median(x / r for x, r in zip(runs[(n, m)], raw))
                    rows.append({"method": m, "block_bytes": bb, "blocks": n, "pull_bytes": n * bb,
                                 "repeats": args.repeats, "gbit_s": med, "runs_gbit_s": runs[(n, m)],
                                 "ratio_to_raw_tcp": ratio})
                    cells.append(f"{med:8.2f} ({ratio:4.2f}x)")
                print(f"{bb >> 10:>6}KiB {n:>6} " + " ".join(f"{c:>17}" for c in cells), flush=True)
    add_table(fig, "pull_link", rows)
    add_chart(fig, "bars", "pull_link.png", table="pull_link", group_by=["block_bytes", "blocks"], values=["gbit_s"],
              series_by="method", ylabel="Gbit/s", title=f"pull throughput on loopback, median of {args.repeats}")
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
