"""Offload agent and index speed, in-memory and Redis side by side.

1. Ingest: blocks per second one agent sustains for decode (msgpack) + translate (block keys) +
   apply (index writes), on vLLM-shaped batches: chained BlockStored events of ``--blocks-per-event``
   blocks, and BlockRemoved events for older blocks (a steady state: as many removed as stored).
2. Lookup: latency p50/p99 of ``index.match(keys)`` for a ``--prompt-tokens`` prompt against
   ``--workers`` workers each holding ``--blocks-per-worker`` blocks; every worker holds a prefix of
   the prompt (worker i: i/workers of it, so runs end at different depths) plus filler blocks.
   Variants run interleaved, one lookup each per round, so they share the machine's noise:
   Redis with redis-py's hiredis reply parser and with its pure-Python one; with ``--baseline REV``
   also the index backends as they were at git revision ``REV`` (their modules loaded from
   ``git show``), on the same data. Besides wall time: the client's CPU time per lookup and Redis's
   (``INFO commandstats``), which a busy machine disturbs less than wall time.
3. Bytes per (block, worker) entry: Redis ``INFO memory`` and this process's RSS before/after
   populating.

Starts its own redis-server on a free loopback port unless ``--redis-url`` is given.
Aims (issue 4): ingest >= 200k blocks/s in-memory; lookup p99 < 1 ms in-memory, < 3 ms Redis.

    .venv/bin/python benchmarks/bench_agent.py                 # full size (about 4 GB RAM, ~5 min)
    .venv/bin/python benchmarks/bench_agent.py --quick         # small sizes, seconds
    .venv/bin/python benchmarks/bench_agent.py --baseline HEAD~1   # before/after side by side
    .venv/bin/python benchmarks/bench_agent.py --quick --json out.json --plot plots/

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``ingest`` (per backend:
``blocks_per_s``, ``no_decode_blocks_per_s``, ``translate_only_blocks_per_s``), table ``lookup``
(per variant: ``p50_ms``, ``p99_ms``, ``max_ms``, ``cpu_p50_ms``, ``cpu_p99_ms``, ``redis_ms``,
``workers_matched``), table ``populate`` (``populate_s`` per index) and table ``memory``
(``bytes_per_entry`` per index). ``--plot DIR`` draws ``ingest.png`` (events/s as blocks/s per
backend), ``lookup.png`` (lookup latency per variant) and ``memory.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import psutil
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
from redis.utils import HIREDIS_AVAILABLE

from kvcore.block_keys import block_keys
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import RedisIndex
from kvcore.kv_events.ingest import write_ops
from kvcore.kv_events.translate import EventTranslator
from kvcore.kv_events.wire import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvroute.up import free_ports
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures

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


async def bench_lookups(variants: dict[str, object], prompt_keys: list[int], rounds: int,
                        stats_client=None) -> dict[str, dict[str, float]]:
    """Latency of ``index.match(prompt_keys)`` per variant, one lookup of each per round. With
    ``stats_client`` (a redis-py client), Redis's own time per lookup from INFO commandstats."""
    lat: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    server_us: dict[str, float] = {v: 0.0 for v in variants}
    results = {v: await idx.match(prompt_keys) for v, idx in variants.items()}  # warm up, and check
    first = next(iter(results.values()))
    for v, r in results.items():
        assert r == first, f"{v} disagrees with {next(iter(results))}"
    for _ in range(rounds):
        for v, idx in variants.items():
            if stats_client is not None:
                await stats_client.config_resetstat()
            c0, t0 = time.process_time(), time.perf_counter()
            await idx.match(prompt_keys)
            lat[v].append((time.perf_counter() - t0) * 1000)
            cpu[v].append((time.process_time() - c0) * 1000)
            if stats_client is not None:
                info = await stats_client.info("commandstats")
                # a script's own time includes the commands it calls, which are counted again
                script = [st["usec"] for name, st in info.items() if name in ("cmdstat_evalsha", "cmdstat_eval")]
                server_us[v] += sum(script) if script else sum(
                    st["usec"] for name, st in info.items() if name not in ("cmdstat_config", "cmdstat_info"))
    out = {}
    for v in variants:
        ls, cs = sorted(lat[v]), sorted(cpu[v])
        out[v] = {"p50_ms": statistics.median(ls), "p99_ms": ls[int(len(ls) * 0.99) - 1], "max_ms": ls[-1],
                  "cpu_p50_ms": statistics.median(cs), "cpu_p99_ms": cs[int(len(cs) * 0.99) - 1],
                  "server_ms": server_us[v] / rounds / 1000 if stats_client is not None else None,
                  "workers_matched": len(first)}
    return out


def load_baseline(rev: str) -> tuple[type, type]:
    """``(MemoryIndex, RedisIndex)`` as they were at git revision ``rev`` (for before/after runs)."""
    root = Path(__file__).resolve().parent.parent
    classes = []
    for name, cls in (("memory", "MemoryIndex"), ("redis", "RedisIndex")):
        src = subprocess.run(["git", "show", f"{rev}:kvcore/index/{name}.py"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
        mod = types.ModuleType(f"baseline_{name}")
        mod.__file__ = f"{rev}:kvcore/index/{name}.py"
        sys.modules[mod.__name__] = mod
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        classes.append(getattr(mod, cls))
    return classes[0], classes[1]


def redis_variant(cls: type, url: str, hiredis: bool):
    """A reader of the bench namespace, with redis-py's hiredis or pure-Python reply parser."""
    idx = cls(url, namespace="bench", socket_timeout_s=30, heartbeat_ttl_s=3600)
    idx._redis.connection_pool.connection_kwargs["parser_class"] = _AsyncHiredisParser if hiredis else _AsyncRESP2Parser
    return idx


def rss_bytes() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not on PATH (or pass --redis-url)")
    port = free_ports(1)[0]
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
    stop_group(proc)
    raise SystemExit("redis-server did not start")


def stop_group(proc: subprocess.Popen) -> None:
    """Kill ``timeout`` and the redis-server under it (killing ``timeout`` alone orphans it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


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
    ap.add_argument("--baseline", metavar="REV", default=None,
                    help="also run the index backends of this git revision, side by side (e.g. HEAD~1)")
    add_output_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.events, args.workers, args.blocks_per_worker, args.rounds = 500, 8, 5_000, 100
    fig = new_figures("bench_agent", args)

    proc = None
    if not args.skip_redis and args.redis_url is None:
        proc, args.redis_url = start_redis()
    base_memory = base_redis = None
    if args.baseline:
        base_memory, base_redis = load_baseline(args.baseline)
    try:
        payloads, n_blocks = make_payloads(args.events, args.blocks_per_event, args.block_size)
        rows: dict[str, dict[str, float]] = {}
        rows["memory"] = await bench_ingest(MemoryIndex(), payloads, n_blocks, args.block_size)
        if base_memory is not None:
            rows[f"memory@{args.baseline}"] = await bench_ingest(base_memory(), payloads, n_blocks, args.block_size)
        redis_index = None
        if not args.skip_redis:
            # long heartbeat TTL: no agent keeps these workers alive while the benchmark populates
            redis_index = RedisIndex(args.redis_url, namespace="bench", socket_timeout_s=30, heartbeat_ttl_s=3600)
            await redis_index._redis.flushdb()
            rows["redis"] = await bench_ingest(redis_index, payloads, n_blocks, args.block_size)
        print(f"ingest: {n_blocks} blocks in {len(payloads)} batches ({args.blocks_per_event} blocks/event, "
              f"block size {args.block_size}); aim >= 200000 blocks/s in-memory")
        print(f"  {'backend':16} {'decode+translate+apply':>24} {'translate+apply':>16} {'translate only':>15}")
        for name, r in rows.items():
            print(f"  {name:16} {r['blocks_per_s']:>18,.0f} b/s {r['no_decode_blocks_per_s']:>12,.0f} b/s "
                  f"{r['translate_only_blocks_per_s']:>11,.0f} b/s")
        add_table(fig, "ingest", [{"backend": name, "blocks": n_blocks, "batches": len(payloads), **r}
                                  for name, r in rows.items()])

        n_prompt_blocks = args.prompt_tokens // args.block_size
        prompt_keys = block_keys([random.Random(2).randrange(32000) for _ in range(args.prompt_tokens)],
                                 args.block_size, MODEL)
        memory_variants = {"memory": MemoryIndex}
        if base_memory is not None:
            memory_variants[f"memory@{args.baseline}"] = base_memory
        mems, pop_s, rss_per_entry = {}, {}, {}
        n_entries = args.workers * args.blocks_per_worker
        for name, cls in memory_variants.items():
            before = rss_bytes()
            t0 = time.perf_counter()
            mems[name] = cls()
            await populate(mems[name], prompt_keys, args.workers, args.blocks_per_worker)
            pop_s[name] = time.perf_counter() - t0
            rss_per_entry[name] = (rss_bytes() - before) / n_entries
        look = await bench_lookups(mems, prompt_keys, args.rounds)
        mems.clear()
        gc.collect()
        redis_bytes = None
        if redis_index is not None:
            await redis_index._redis.flushdb()
            before = await used_memory(redis_index)
            t0 = time.perf_counter()
            await populate(redis_index, prompt_keys, args.workers, args.blocks_per_worker)
            pop_s["redis"] = time.perf_counter() - t0
            redis_bytes = (await used_memory(redis_index) - before) / n_entries
            readers = {}
            classes = {"redis": RedisIndex}
            if base_redis is not None:
                classes[f"redis@{args.baseline} (Lua)"] = base_redis
            for name, cls in classes.items():
                readers[f"{name}, hiredis"] = redis_variant(cls, args.redis_url, hiredis=True)
                readers[f"{name}, py parser"] = redis_variant(cls, args.redis_url, hiredis=False)
            look.update(await bench_lookups(readers, prompt_keys, args.rounds, stats_client=redis_index._redis))
            for r in readers.values():
                await r.close()
            await redis_index._redis.flushdb()
            await redis_index.close()
        print(f"lookup: {args.prompt_tokens}-token prompt ({n_prompt_blocks} blocks) against {args.workers} "
              f"workers x {args.blocks_per_worker} blocks, {args.rounds} rounds; aims p99 < 1 ms in-memory, "
              f"< 3 ms Redis (hiredis installed: {HIREDIS_AVAILABLE})")
        print(f"  {'variant':34} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'cpu p50':>8} {'cpu p99':>8} "
              f"{'redis ms':>8} {'matched':>7}")
        for name, r in look.items():
            server = f"{r['server_ms']:>8.3f}" if r["server_ms"] is not None else f"{'-':>8}"
            print(f"  {name:34} {r['p50_ms']:>7.3f} {r['p99_ms']:>7.3f} {r['max_ms']:>7.3f} {r['cpu_p50_ms']:>8.3f} "
                  f"{r['cpu_p99_ms']:>8.3f} {server} {r['workers_matched']:>7}")
        print("  (cpu: this process's CPU time per lookup; redis ms: Redis's own time per lookup)")
        add_table(fig, "lookup", [{"variant": name, "prompt_tokens": args.prompt_tokens, "workers": args.workers,
                                   "blocks_per_worker": args.blocks_per_worker, "rounds": args.rounds,
                                   **{("redis_ms" if k == "server_ms" else k): v for k, v in r.items()}}
                                  for name, r in look.items()])
        add_table(fig, "populate", [{"index": k, "populate_s": v} for k, v in pop_s.items()])
        add_table(fig, "memory", [{"index": k, "bytes_per_entry": v, "source": "RSS"} for k, v in rss_per_entry.items()]
                  + ([{"index": "redis", "bytes_per_entry": redis_bytes, "source": "INFO used_memory"}]
                     if redis_bytes is not None else []))
        print(f"populate (s): " + ", ".join(f"{k} {v:.1f}" for k, v in pop_s.items()))
        print("memory per (block, worker) entry (distinct blocks, one worker each, gpu tier): " + ", ".join(
            f"{k} {v:.0f} B (RSS)" for k, v in rss_per_entry.items())
            + (f", redis {redis_bytes:.0f} B (INFO used_memory)" if redis_bytes is not None else ""))
    finally:
        if proc is not None:
            stop_group(proc)
    add_chart(fig, "bars", "ingest.png", table="ingest", group_by="backend",
              values=["blocks_per_s", "no_decode_blocks_per_s", "translate_only_blocks_per_s"], ylabel="blocks/s",
              title=f"KV-event ingest, {args.blocks_per_event} blocks per event (aim >= 200000 blocks/s in-memory)")
    add_chart(fig, "bars", "lookup.png", table="lookup", group_by="variant", values=["p50_ms", "p99_ms", "cpu_p50_ms"],
              ylabel="ms", horizontal=True,
              title=f"lookup of a {args.prompt_tokens}-token prompt, {args.workers} workers x "
                    f"{args.blocks_per_worker} blocks (aims p99 < 1 ms in-memory, < 3 ms Redis)")
    add_chart(fig, "bars", "memory.png", table="memory", group_by="index", values=["bytes_per_entry"],
              ylabel="bytes per (block, worker) entry", title="index memory per entry")
    emit(fig, args)


if __name__ == "__main__":
    asyncio.run(main())
