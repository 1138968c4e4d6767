"""Index lookups through a Redis Cluster: the sharded index (plain and mirrored) against memory.

Starts a ``--shards``-node Redis Cluster on loopback (``redis-server --cluster-enabled yes``, joined
by ``redis-cli --cluster create``, nothing persisted; or ``--cluster-url``, any node of one), then
for each worker count in ``--workers`` and each layout in ``--prefix-groups``: a fresh namespace
where the workers hold prefixes of a ``--prompt-tokens`` prompt (32k tokens = 2,048 blocks of 16)
plus filler up to ``--blocks-per-worker`` blocks: with 0 prefix groups worker i holds the first
(i+1)/workers of the prompt (every worker its own length: every block has other holders, the
costliest case for the bitmask chains); with G groups the workers are split into G equal groups
and group g holds the first (g+1)/G (holders change at G blocks only). The entries are written
through :class:`kvcore.index.redis_cluster.RedisClusterIndex` (the agents' path). Then
``--repeats`` x ``--rounds`` interleaved rounds, one ``match`` of the prompt per variant per round
in a shuffled order, each with the prompt's keys as fresh ints:

- ``cluster (plain)``: :class:`~kvcore.index.redis_cluster.RedisClusterIndex`, one pipeline per node;
- ``cluster + mirror``: :class:`~kvcore.index.redis_cluster_mirror.RedisClusterMirrorIndex` (local);
- ``memory``: :class:`~kvcore.index.memory.MemoryIndex` with the same entries (all three must agree);
- ``redis-py RedisCluster (fetch)``: the plain variant's bitmap fetch alone (one ``MGET`` per
  partition) through redis-py's ``RedisCluster`` pipeline, for comparison with the pre-encoded
  per-node pipelines (no match computed).

``--paths native,numpy`` times the variants once per lookup path within each repeat (the C passes
of ``kvcore/index/_chain_native.c`` and the numpy ones of :mod:`kvcore.index.chain_rows`).

``--timed`` names the variants timed (default all four); an untimed ``memory`` is not built (the
variants' answers are then checked against each other). A gateway holds one index: timed alone,
the mirror's lookups do not share the caches with two more 4M-entry indexes and a 1 MB fetch.

Prints p50/p99 wall ms per repeat and over all repeats, and writes them with ``--json``.

    .venv/bin/python benchmarks/bench_index_cluster.py            # 64, 256, 1,024 workers (a few minutes)
    .venv/bin/python benchmarks/bench_index_cluster.py --quick    # small, seconds
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_agent import MODEL, populate, stop_group  # noqa: E402
from bench_index_lookup import closed_loop, pct  # noqa: E402
from redis.asyncio.cluster import RedisCluster  # noqa: E402

from kvcore.block_keys import block_keys  # noqa: E402
from kvcore.index import chain_rows  # noqa: E402
from kvcore.index.memory import MemoryIndex  # noqa: E402
from kvcore.index.redis_cluster import RedisClusterIndex  # noqa: E402
from kvcore.index.redis_cluster_mirror import RedisClusterMirrorIndex  # noqa: E402
from kvcore.kv_events.ingest import write_ops  # noqa: E402
from kvroute.up import free_ports  # noqa: E402


VARIANTS = ("cluster (plain)", "cluster + mirror", "memory", "redis-py RedisCluster (fetch)")


def cluster_info(port: int) -> str:
    """``CLUSTER INFO`` of the node on loopback ``port`` ("" when it does not answer)."""
    try:
        return subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True,
                              timeout=5).stdout
    except subprocess.TimeoutExpired:
        return ""


def start_cluster(shards: int, deadline_s: int = 3600) -> tuple[list[subprocess.Popen], str]:
    """``shards`` cluster-enabled redis-servers on loopback (each killed after ``deadline_s``),
    joined into one cluster; returns the processes and a URL of one node. Raises SystemExit when
    redis-server/redis-cli are missing or the cluster is not ok within 30 s."""
    exe = shutil.which("redis-server")
    if exe is None or shutil.which("redis-cli") is None:
        raise SystemExit("redis-server / redis-cli not on PATH (or pass --cluster-url)")
    ports = free_ports(2 * shards)
    root = Path(tempfile.mkdtemp(prefix="kvr-bench-cluster-"))
    procs = []
    for port, bus in zip(ports[:shards], ports[shards:]):
        d = root / str(port)
        d.mkdir()
        procs.append(subprocess.Popen(
            ["timeout", "-s", "KILL", str(deadline_s), exe, "--port", str(port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-port", str(bus), "--cluster-config-file", str(d / "nodes.conf"),
             "--dir", str(d), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    end = time.monotonic() + 30
    while not all("cluster_state" in cluster_info(p) for p in ports[:shards]):
        if time.monotonic() > end:
            raise SystemExit("cluster nodes did not start")
        time.sleep(0.05)
    run = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports[:shards]],
                          "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
    if run.returncode:
        raise SystemExit(f"redis-cli --cluster create failed: {run.stdout[-1000:]}{run.stderr[-1000:]}")
    while not all("cluster_state:ok" in cluster_info(p) for p in ports[:shards]):
        if time.monotonic() > end:
            raise SystemExit("cluster not ok in 30 s")
        time.sleep(0.05)
    return procs, f"redis://127.0.0.1:{ports[0]}/0"


class RedisPyFetch:
    """The plain variant's bitmap fetch (one MGET per partition) through redis-py's RedisCluster
    pipeline; ``match`` returns nothing."""

    def __init__(self, url: str, like: RedisClusterIndex) -> None:
        self.rc = RedisCluster.from_url(url)
        self.like = like

    async def match(self, keys: list[int]) -> dict:
        groups = self.like._split(keys)
        pipe = self.rc.pipeline(transaction=False)
        for part, ks in groups.items():
            prefix = self.like.part_prefixes[part].encode() + b"b:"
            pipe.execute_command("MGET", *[prefix + struct.pack(">Q", k) for k in ks])
        await pipe.execute()
        return {}

    async def close(self) -> None:
        await self.rc.aclose()


async def populate_groups(index, prompt: list[int], workers: int, groups: int, blocks_per_worker: int,
                          chunk: int = 20_000) -> None:
    """Worker i (of ``groups`` equal groups, i * groups // workers its group g) holds the first
    (g+1)/groups of ``prompt`` plus random filler up to ``blocks_per_worker`` blocks (``groups`` 0:
    :func:`bench_agent.populate`, every worker its own prefix length)."""
    if not groups:
        await populate(index, prompt, workers, blocks_per_worker, chunk)
        return
    rnd = random.Random(1)
    n = len(prompt)
    for w in range(workers):
        g = w * groups // workers
        held = prompt[:max(1, (g + 1) * n // groups)]
        keys = held + [rnd.getrandbits(64) for _ in range(blocks_per_worker - len(held))]
        for i in range(0, len(keys), chunk):
            await write_ops(index, f"worker-{w:04d}", [("store", "gpu", keys[i:i + chunk])])


async def one_size(url: str, workers: int, groups: int, args: argparse.Namespace, prompt: list[int],
                   rnd: random.Random) -> dict:
    ns = f"benchcl{workers}_{groups}_{random.getrandbits(24):06x}"
    packed = struct.pack(f">{len(prompt)}Q", *prompt)
    writer = RedisClusterIndex(url, namespace=ns, socket_timeout_s=60, heartbeat_ttl_s=36000)
    t0 = time.perf_counter()
    await populate_groups(writer, prompt, workers, groups, args.blocks_per_worker)
    populate_s = time.perf_counter() - t0
    plain = RedisClusterIndex(url, namespace=ns, socket_timeout_s=30, heartbeat_ttl_s=36000)
    mirror = RedisClusterMirrorIndex(url, namespace=ns, socket_timeout_s=5, heartbeat_ttl_s=36000,
                                     bootstrap_timeout_s=300)
    t0 = time.perf_counter()
    await mirror.open()
    bootstrap_s = time.perf_counter() - t0
    variants = {"cluster (plain)": plain, "cluster + mirror": mirror}
    if "memory" in args.timed:
        variants["memory"] = MemoryIndex()
        await populate_groups(variants["memory"], prompt, workers, groups, args.blocks_per_worker)
    results = {v: await idx.match(prompt) for v, idx in variants.items()}
    assert all(r == results["cluster (plain)"] for r in results.values()), "variants disagree"
    assert len(results["cluster (plain)"]) == workers
    fetch = RedisPyFetch(url, plain)
    variants["redis-py RedisCluster (fetch)"] = fetch
    variants = {v: idx for v, idx in variants.items() if v in args.timed}
    shards = {f"{h}:{p}": len(v) for (h, p), v in plain.shard_of_partitions().items()}
    layout = f"{groups} prefix groups" if groups else "each worker its own prefix length"
    print(f"\n{workers} workers x {args.blocks_per_worker} blocks ({layout}), {len(prompt)}-block prompt "
          f"({len(results['cluster (plain)'])} "
          f"match); partitions per shard {shards}; populated through the cluster in {populate_s:.1f} s; mirror "
          f"bootstrap {bootstrap_s:.1f} s")
    print(f"  {'variant':30} " + " ".join(f"{'rep' + str(r + 1) + ' p50/p99':>16}" for r in range(args.repeats))
          + f" {'all p50':>8} {'all p99':>8}")
    # with several --paths, each repeat times every variant once per path, the paths in turn
    labels = {(v, p): (f"{v} [{p}]" if len(args.paths) > 1 else v) for v in variants for p in args.paths}
    lat_all: dict[str, list[float]] = {label: [] for label in labels.values()}
    reps: dict[str, list[tuple[float, float]]] = {label: [] for label in labels.values()}
    await closed_loop(variants, packed, min(20, args.rounds), rnd)  # warm-up, not counted
    for _ in range(args.repeats):
        for lookup_path in args.paths:
            chain_rows.use_native(lookup_path == "native")
            lat, _cpu = await closed_loop(variants, packed, args.rounds, rnd)
            for v, ls in lat.items():
                label = labels[v, lookup_path]
                lat_all[label] += ls
                reps[label].append((statistics.median(ls), pct(ls, 0.99)))
    out = {}
    for v in lat_all:
        print(f"  {v:30} " + " ".join(f"{a:>7.3f}/{b:<8.3f}" for a, b in reps[v])
              + f" {statistics.median(lat_all[v]):>8.3f} {pct(lat_all[v], 0.99):>8.3f}")
        out[v] = {"p50_ms": statistics.median(lat_all[v]), "p99_ms": pct(lat_all[v], 0.99),
                  "repeats_p50_p99_ms": reps[v]}
    for idx in (writer, plain, mirror, fetch):
        await idx.close()
    return {"workers": workers, "prefix_groups": groups, "blocks_per_worker": args.blocks_per_worker,
            "populate_s": populate_s,
            "bootstrap_s": bootstrap_s, "partitions_per_shard": shards, "variants": out}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster-url", default=None, help="a node of a running cluster (default: start one)")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="8 and 32 workers, own prefix lengths, a 4k-token prompt, 1 repeat of 30 rounds")
    ap.add_argument("--workers", default=None,
                    help="worker counts, comma-separated (one run each; default 64,256,1024, quick 8,32)")
    ap.add_argument("--prefix-groups", default="0,8",
                    help="layouts, comma-separated: 0 = every worker its own prefix length, G = G groups of workers")
    ap.add_argument("--blocks-per-worker", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=32_768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timed", default=",".join(VARIANTS),
                    help=f"variants timed, comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--paths", type=lambda v: v.split(","), default=chain_rows.lookup_paths()[:1],
                    help="lookup passes, comma-separated: native (the C extension, the default where built), numpy; "
                         "several are timed in turn within each repeat")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    args.timed = [v.strip() for v in args.timed.split(",") if v.strip()]
    if not args.timed or set(args.timed) - set(VARIANTS):
        ap.error(f"--timed: variants of {', '.join(VARIANTS)}")
    if bad := [p for p in args.paths if p not in chain_rows.lookup_paths()]:
        ap.error(f"--paths: {bad}: not available (this install has {', '.join(chain_rows.lookup_paths())})")
    if args.quick:
        args.blocks_per_worker, args.prompt_tokens, args.rounds, args.repeats = 512, 4096, 30, 1
        args.prefix_groups = "0"
    args.workers = args.workers or ("8,32" if args.quick else "64,256,1024")
    procs: list[subprocess.Popen] = []
    url = args.cluster_url
    if url is None:
        procs, url = start_cluster(args.shards)
    try:
        prompt = block_keys([random.Random(2).randrange(32000) for _ in range(args.prompt_tokens)],
                            args.block_size, MODEL)
        rnd = random.Random(5)
        print(f"{args.shards}-shard Redis Cluster at {url}; {args.repeats} repeats x {args.rounds} interleaved "
              f"rounds per worker count (wall ms per lookup)")
        sizes = [await one_size(url, int(w), int(g), args, prompt, rnd)
                 for g in args.prefix_groups.split(",") for w in args.workers.split(",")]
        if args.json:
            args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                             "sizes": sizes}, indent=1))
    finally:
        for p in procs:
            stop_group(p)


if __name__ == "__main__":
    asyncio.run(main())
