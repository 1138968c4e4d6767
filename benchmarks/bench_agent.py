"""Offload agent and index speed, in-memory and Redis side by side.

1. Ingest: blocks per second one agent sustains for decode (msgpack) + translate (block keys) +
   apply (index writes), on vLLM-shaped batches: chained BlockStored events of ``--blocks-per-event``
   blocks, and BlockRemoved events for older blocks (a steady state: as many removed as stored).
2. Lookup: latency p50/p99 of ``index.match(keys)`` for a ``--prompt-tokens`` prompt against
   ``--workers`` workers each holding ``--blocks-per-worker`` blocks; every worker holds a prefix of
   the prompt (worker i: i/workers of it, so runs end at different depths) plus filler blocks.
3. Redis bytes per block (``INFO memory`` before/after the lookup population).

Starts its own redis-server on a free loopback port unless ``--redis-url`` is given.
Aims (issue 4): ingest >= 200k blocks/s in-memory; lookup p99 < 1 ms in-memory, < 3 ms Redis.

    .venv/bin/python benchmarks/bench_agent.py                 # full size (about 2 GB RAM, ~2 min)
    .venv/bin/python benchmarks/bench_agent.py --quick         # small sizes, seconds
"""
from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from kvcore.block_keys import block_keys
from kvcore.events import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex
from kvcore.kv_events import EventTranslator, write_ops

MODEL = "bench-model"


def make_payloads(n_events: int, blocks_per_event: int, block_size: int, seed: int = 0) -> tuple[list[bytes], int]:
    """vLLM-shaped payloads: prompts of 4 events chained through parent hashes; once 2000 blocks
    are held, each new event's blocks are matched by removals of the oldest ones."""
    rnd = random.Random(seed)
    payloads, held, next_hash, n_blocks = [], [], 1, 0
    parent = None
    for i in range(n_events):
        if i % 4 == 0:
            parent = None
        hashes = list(range(next_hash, next_hash + blocks_per_event))
        next_hash += blocks_per_event
        tokens = [rnd.randrange(32000) for _ in range(blocks_per_event * block_size)]
        events = [BlockStored(hashes, parent, tokens, block_size, None, "GPU", None)]
        parent = hashes[-1]
        held.extend(hashes)
        if len(held) > 2000:
            gone, held = held[:blocks_per_event], held[blocks_per_event:]
            events.append(BlockRemoved(gone, "GPU"))
            n_blocks += len(gone)
        n_blocks += blocks_per_event
        payloads.append(encode_batch(EventBatch(time.time(), events, 0)))
    return payloads, n_blocks


async def bench_ingest(index, payloads: list[bytes], n_blocks: int, block_size: int) -> dict[str, float]:
    tr = EventTranslator(MODEL, block_size)
    t0 = time.perf_counter()
    for p in payloads:
        await write_ops(index, "w0", tr.translate(decode_batch(p)))
    dt = time.perf_counter() - t0
    # translate + apply only (payloads decoded beforehand), on a fresh translator and worker
    batches = [decode_batch(p) for p in payloads]
    tr2 = EventTranslator(MODEL, block_size)
    t1 = time.perf_counter()
    for b in batches:
        await write_ops(index, "w1", tr2.translate(b))
    dt2 = time.perf_counter() - t1
    t2 = time.perf_counter()
    tr3 = EventTranslator(MODEL, block_size)
    for b in batches:
        tr3.translate(b)
    dt3 = time.perf_counter() - t2
    return {"blocks_per_s": n_blocks / dt, "no_decode_blocks_per_s": n_blocks / dt2,
            "translate_only_blocks_per_s": n_blocks / dt3}


async def populate(index, prompt_keys: list[int], workers: int, blocks_per_worker: int, chunk: int = 20_000) -> None:
    rnd = random.Random(1)
    n = len(prompt_keys)
    for w in range(workers):
        held = prompt_keys[:max(1, (w + 1) * n // workers)]
        filler = [rnd.getrandbits(64) for _ in range(blocks_per_worker - len(held))]
        keys = held + filler
        for i in range(0, len(keys), chunk):
            await write_ops(index, f"worker-{w:03d}", [("store", "gpu", keys[i:i + chunk])])


async def bench_lookup(index, prompt_keys: list[int], rounds: int) -> dict[str, float]:
    # a prefix of varying length per lookup, and the full prompt
    lat = []
    expected_workers = None
    for r in range(rounds):
        t0 = time.perf_counter()
        m = await index.match(prompt_keys)
        lat.append((time.perf_counter() - t0) * 1000)
        if expected_workers is None:
            expected_workers = len(m)
    lat.sort()
    return {"p50_ms": statistics.median(lat), "p99_ms": lat[int(len(lat) * 0.99) - 1],
            "max_ms": lat[-1], "workers_matched": expected_workers}


def start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not on PATH (or pass --redis-url)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["timeout", "-s", "KILL", "1800", exe, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", tempfile.gettempdir()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


async def used_memory(index: RedisIndex) -> int:
    return int((await index._redis.info("memory"))["used_memory"])


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (vLLM GPU default 16)")
    ap.add_argument("--blocks-per-event", type=int, default=16)
    ap.add_argument("--events", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks-per-worker", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=32_768)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--skip-redis", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.events, args.workers, args.blocks_per_worker, args.rounds = 500, 8, 5_000, 100

    proc = None
    if not args.skip_redis and args.redis_url is None:
        proc, args.redis_url = start_redis()
    try:
        payloads, n_blocks = make_payloads(args.events, args.blocks_per_event, args.block_size)
        rows: dict[str, dict[str, float]] = {}
        rows["memory"] = await bench_ingest(MemoryIndex(), payloads, n_blocks, args.block_size)
        redis_index = None
        if not args.skip_redis:
            # long heartbeat TTL: no agent keeps these workers alive while the benchmark populates
            redis_index = RedisIndex(args.redis_url, namespace="bench", socket_timeout_s=30, heartbeat_ttl_s=3600)
            await redis_index._redis.flushdb()
            rows["redis"] = await bench_ingest(redis_index, payloads, n_blocks, args.block_size)
        print(f"ingest: {n_blocks} blocks in {len(payloads)} batches ({args.blocks_per_event} blocks/event, "
              f"block size {args.block_size}); aim >= 200000 blocks/s in-memory")
        print(f"  {'backend':8} {'decode+translate+apply':>24} {'translate+apply':>16} {'translate only':>15}")
        for name, r in rows.items():
            print(f"  {name:8} {r['blocks_per_s']:>18,.0f} b/s {r['no_decode_blocks_per_s']:>12,.0f} b/s "
                  f"{r['translate_only_blocks_per_s']:>11,.0f} b/s")

        n_prompt_blocks = args.prompt_tokens // args.block_size
        prompt_keys = block_keys([random.Random(2).randrange(32000) for _ in range(args.prompt_tokens)],
                                 args.block_size, MODEL)
        look: dict[str, dict[str, float]] = {}
        mem = MemoryIndex()
        t0 = time.perf_counter()
        await populate(mem, prompt_keys, args.workers, args.blocks_per_worker)
        pop_mem = time.perf_counter() - t0
        look["memory"] = await bench_lookup(mem, prompt_keys, args.rounds)
        del mem
        bytes_per_block = None
        if redis_index is not None:
            await redis_index._redis.flushdb()
            before = await used_memory(redis_index)
            t0 = time.perf_counter()
            await populate(redis_index, prompt_keys, args.workers, args.blocks_per_worker)
            pop_redis = time.perf_counter() - t0
            bytes_per_block = (await used_memory(redis_index) - before) / (args.workers * args.blocks_per_worker)
            look["redis"] = await bench_lookup(redis_index, prompt_keys, args.rounds)
            await redis_index._redis.flushdb()
            await redis_index.close()
        print(f"lookup: {args.prompt_tokens}-token prompt ({n_prompt_blocks} blocks) against {args.workers} "
              f"workers x {args.blocks_per_worker} blocks; aims p99 < 1 ms in-memory, < 3 ms Redis")
        print(f"  {'backend':8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'matched':>8} {'populate s':>11}")
        for name, r in look.items():
            pop = pop_mem if name == "memory" else pop_redis
            print(f"  {name:8} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['max_ms']:>8.3f} "
                  f"{r['workers_matched']:>8} {pop:>11.1f}")
        if bytes_per_block is not None:
            print(f"redis memory: {bytes_per_block:.0f} bytes per (block, worker) entry "
                  f"(distinct blocks, one worker each, gpu tier)")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
