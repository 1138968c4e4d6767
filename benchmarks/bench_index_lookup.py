"""Index lookups with Redis as the shared truth: plain Redis, Redis + local mirror, in-memory.

A ``--prompt-tokens`` prompt (32k tokens = 2048 blocks of 16) against ``--workers`` workers x
``--blocks-per-worker`` blocks (worker i holds the first (i+1)/workers of the prompt plus filler,
as in ``bench_agent.py``), in one redis-server this script starts (or ``--redis-url``):

1. quiet: ``--repeats`` x ``--rounds`` interleaved rounds, one lookup of each variant per round in
   a shuffled order, each with the prompt's keys as fresh int objects as a gateway has them
   (``index.match`` wall time; all three must agree);
2. under write load: a writer process appends agent-shaped batches (``--load-rate`` per second,
   each storing 16 new blocks and removing 16 old ones of one worker, plus ``--spec-rate``
   speculative entries of a 2048-block prompt per second, as other gateway replicas would) while
   lookups of plain Redis, of the mirror and of the memory index (windows in turn; memory has no
   log to apply: it shows what the machine's contention alone costs) are started on a fixed
   schedule (every ``--interval-ms``); latency counts from the scheduled start, so time a lookup
   waits behind the mirror applying the log on the same event loop is in it. Also the mirror's apply
   lag (entry appended in Redis -> applied here; from the entry id, ms resolution) and
   write -> visible here (a write through the mirror until its local copy has it);
3. catch-up: the mirror's reader is held while the writer appends ``--backlog`` batches, then
   released: entries and keys per second it applies;
4. bootstrap time of a new mirror, and RSS per (block, worker) entry of mirror and memory.

    .venv/bin/python benchmarks/bench_index_lookup.py            # full size (~5 GB RAM, a few minutes)
    .venv/bin/python benchmarks/bench_index_lookup.py --quick    # small, seconds
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_agent import MODEL, populate, rss_bytes, start_redis, stop_group  # noqa: E402

from kvcore.block_keys import block_keys  # noqa: E402
from kvcore.index.memory import MemoryIndex  # noqa: E402
from kvcore.index.redis import RedisIndex  # noqa: E402
from kvcore.index.redis_mirror import RedisMirrorIndex  # noqa: E402
from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402

NS = "benchlookup"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(len(s) * q) - 1))] if s else float("nan")


def fresh(packed: bytes) -> list[int]:
    """The prompt's keys as new int objects, as a gateway computes them per request (a dict
    lookup with the very objects stored in it skips the key comparison)."""
    return list(struct.unpack(f">{len(packed) // 8}Q", packed))


async def closed_loop(variants: dict, packed: bytes, rounds: int,
                      rnd: random.Random) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``rounds`` rounds, one lookup of each variant per round in a shuffled order. Returns wall
    ms and this process's CPU ms per lookup, per variant (CPU time is less disturbed by other
    processes on a shared machine; Redis's own time is not in it). The loop runs its other tasks
    between lookups, untimed: a lookup that never suspends would otherwise starve them."""
    lat: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    for _ in range(rounds):
        rnd.shuffle(names)
        for name in names:
            keys = fresh(packed)
            c0, t0 = time.process_time(), time.perf_counter()
            await variants[name].match(keys)
            lat[name].append((time.perf_counter() - t0) * 1000)
            cpu[name].append((time.process_time() - c0) * 1000)
            await asyncio.sleep(0)  # the loop's other tasks run between lookups, as in a gateway (a mirror's polls)
    return lat, cpu


async def open_loop(variants: dict, packed: bytes, n: int, interval_s: float) -> dict[str, list[float]]:
    """``n`` lookups started every ``interval_s`` on a fixed schedule, cycling through the
    variants; latency from each one's scheduled start to its answer."""
    lat: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    tasks = []

    async def one(name: str, keys: list[int], due: float) -> None:
        await variants[name].match(keys)
        lat[name].append((loop.time() - due) * 1000)
    for i in range(n):
        due = start + i * interval_s
        keys = fresh(packed)  # computed before the request's lookup is due, as a gateway does
        # asyncio wakes a sleeper up to ~1 ms late (epoll's ms timeouts): sleep until just before,
        # then yield until due, so that only real waiting (behind other work) is counted
        await asyncio.sleep(max(0.0, due - loop.time() - 0.002))
        while loop.time() < due:
            await asyncio.sleep(0)
        tasks.append(asyncio.create_task(one(names[i % len(names)], keys, due)))
    await asyncio.gather(*tasks)
    return lat


def writer_main(url: str, workers: int, rate: float, seconds: float, spec_rate: float, prompt_blocks: int,
                backlog: int) -> None:
    """The load process: agent-shaped batches (and speculative entries) at ``rate`` per second
    for ``seconds``, or ``backlog`` batches as fast as it can (``backlog`` > 0)."""
    async def run() -> None:
        idx = RedisIndex(url, namespace=NS, heartbeat_ttl_s=3600, socket_timeout_s=30)
        rnd = random.Random(7)
        held: list[list[int]] = [[] for _ in range(workers)]
        prompt = [rnd.getrandbits(64) for _ in range(prompt_blocks)]
        t0 = time.perf_counter()
        i = spec_i = 0
        total = backlog if backlog else int(rate * seconds)
        while i < total:
            if not backlog:
                due = t0 + i / rate
                now = time.perf_counter()
                if due > now:
                    await asyncio.sleep(due - now)
                if spec_rate and time.perf_counter() - t0 >= spec_i / spec_rate:
                    await idx.publish_speculative([(f"worker-{spec_i % workers:03d}", 5.0, prompt)])
                    spec_i += 1
            w = i % workers
            new = [rnd.getrandbits(64) for _ in range(16)]
            ops = [("store", "gpu", new)]
            held[w].extend(new)
            if len(held[w]) > 512:
                ops.append(("remove", "gpu", held[w][:16]))
                del held[w][:16]
            await idx.apply_ops(f"worker-{w:03d}", ops)
            i += 1
        # the writer's own blocks go again, so the state is as before
        for w in range(workers):
            if held[w]:
                await idx.remove(f"worker-{w:03d}", "gpu", held[w])
        await idx.close()
        print(json.dumps({"batches": i, "spec": spec_i, "seconds": time.perf_counter() - t0}))
    asyncio.run(run())


def start_writer(args, url: str, rate: float, seconds: float, spec_rate: float, backlog: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--writer", url, str(args.workers), str(rate), str(seconds),
                             str(spec_rate), str(args.prompt_tokens // args.block_size), str(backlog)],
                            stdout=subprocess.PIPE, text=True)


async def wait_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait for ``proc`` without holding the event loop (the mirror keeps reading meanwhile)."""
    end = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > end:
            proc.kill()
            raise RuntimeError("writer process timed out")
        await asyncio.sleep(0.05)


async def seq_of(idx: RedisIndex) -> int:
    return int(await idx._redis.get(f"{NS}:seq") or 0)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks-per-worker", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=32_768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load-rate", default="250,1000",
                    help="agent batches per second during phase 2 (comma-separated: one run per rate)")
    ap.add_argument("--spec-rate", type=float, default=10.0,
                    help="speculative entries (whole prompt) per second from other replicas during phase 2")
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--load-lookups", type=int, default=300, help="scheduled lookups per variant and repeat in phase 2")
    ap.add_argument("--backlog", type=int, default=50_000)
    add_output_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.workers, args.blocks_per_worker, args.rounds, args.load_lookups, args.backlog = 8, 5_000, 100, 200, 5_000

    proc = None
    if args.redis_url is None:
        proc, args.redis_url = start_redis()
    url = args.redis_url
    out: dict = {"config": vars(args).copy()}
    try:
        prompt = block_keys([random.Random(2).randrange(32000) for _ in range(args.prompt_tokens)],
                            args.block_size, MODEL)
        packed = struct.pack(f">{len(prompt)}Q", *prompt)
        rnd = random.Random(5)
        n_entries = args.workers * args.blocks_per_worker
        writer = RedisIndex(url, namespace=NS, socket_timeout_s=60, heartbeat_ttl_s=3600,
                            stream_maxlen=max(100_000, 2 * args.backlog))
        await writer._redis.flushdb()
        t0 = time.perf_counter()
        await populate(writer, prompt, args.workers, args.blocks_per_worker)
        out["populate_redis_s"] = time.perf_counter() - t0
        plain = RedisIndex(url, namespace=NS, socket_timeout_s=30, heartbeat_ttl_s=3600)
        before = rss_bytes()  # the memory index first: populating it holds the event loop for a while
        mem = MemoryIndex()
        await populate(mem, prompt, args.workers, args.blocks_per_worker)
        out["memory_rss_b_per_entry"] = (rss_bytes() - before) / n_entries
        before = rss_bytes()
        mirror = RedisMirrorIndex(url, namespace=NS, socket_timeout_s=5, heartbeat_ttl_s=3600,
                                  bootstrap_timeout_s=120, stream_maxlen=max(100_000, 2 * args.backlog))
        t0 = time.perf_counter()
        await mirror.open()
        out["bootstrap_s"] = time.perf_counter() - t0
        out["mirror_rss_b_per_entry"] = (rss_bytes() - before) / n_entries
        variants = {"redis (plain)": plain, "redis + mirror": mirror, "memory": mem}
        results = {v: await idx.match(prompt) for v, idx in variants.items()}
        assert all(r == results["memory"] for r in results.values()), "variants disagree"
        print(f"{args.prompt_tokens}-token prompt ({len(prompt)} blocks), {args.workers} workers x "
              f"{args.blocks_per_worker} blocks ({len(results['memory'])} match); Redis populated in "
              f"{out['populate_redis_s']:.1f} s; mirror bootstrap {out['bootstrap_s']:.1f} s; RSS per entry: mirror "
              f"{out['mirror_rss_b_per_entry']:.0f} B, memory {out['memory_rss_b_per_entry']:.0f} B")

        # 1. quiet
        quiet = {v: [] for v in variants}
        quiet_cpu = {v: [] for v in variants}
        print(f"\n1. quiet, {args.rounds} interleaved rounds per repeat (ms; cpu: this process's CPU time)")
        print(f"  {'variant':16} " + " ".join(f"{'rep' + str(r + 1) + ' p50/p99':>16}" for r in range(args.repeats))
              + f" {'all p50':>8} {'all p99':>8} {'cpu p50':>8} {'cpu p99':>8}")
        reps: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            lat, cpu = await closed_loop(variants, packed, args.rounds, rnd)
            for v, ls in lat.items():
                quiet[v] += ls
                quiet_cpu[v] += cpu[v]
                reps[v].append((statistics.median(ls), pct(ls, 0.99)))
        for v in variants:
            print(f"  {v:16} " + " ".join(f"{a:>7.3f}/{b:<8.3f}" for a, b in reps[v])
                  + f" {statistics.median(quiet[v]):>8.3f} {pct(quiet[v], 0.99):>8.3f}"
                  + f" {statistics.median(quiet_cpu[v]):>8.3f} {pct(quiet_cpu[v], 0.99):>8.3f}")
        out["quiet"] = {v: {"p50_ms": statistics.median(ls), "p99_ms": pct(ls, 0.99), "repeats": reps[v],
                            "cpu_p50_ms": statistics.median(quiet_cpu[v]), "cpu_p99_ms": pct(quiet_cpu[v], 0.99)}
                        for v, ls in quiet.items()}

        # 2. under load
        # memory: nothing to apply, the same machine: the noise floor of the other two
        loaded = {"redis (plain)": plain, "redis + mirror": mirror, "memory (floor)": mem}
        window_s = args.load_lookups * args.interval_ms / 1000
        out["load"] = {}
        for rate in [float(x) for x in str(args.load_rate).split(",")]:
            print(f"\n2. under write load: {rate:.0f} agent batches/s (16 stores + 16 removes each) + "
                  f"{args.spec_rate:.0f} speculative prompts/s of {len(prompt)} keys from other replicas; "
                  f"{args.load_lookups} lookups every {args.interval_ms} ms per variant and repeat (windows in "
                  f"turn; the mirror applies the log throughout), latency from the scheduled start (ms)")
            under: dict[str, list[float]] = {v: [] for v in loaded}
            lags: list[float] = []
            visible: list[float] = []
            applied0, keys0 = mirror.entries_applied, mirror.keys_applied
            t_load = time.perf_counter()
            for r in range(args.repeats):
                w = start_writer(args, url, rate, len(loaded) * window_s + 3.0, args.spec_rate, 0)
                await asyncio.sleep(0.5)
                mirror._lag_ms.clear()
                order = list(loaded)[r % len(loaded):] + list(loaded)[:r % len(loaded)]
                line = []
                for v in order:
                    lat = (await open_loop({v: loaded[v]}, packed, args.load_lookups, args.interval_ms / 1000))[v]
                    under[v] += lat
                    line.append(f"{v} p50 {statistics.median(lat):.3f} p99 {pct(lat, 0.99):.3f}")
                lags += list(mirror._lag_ms)
                for _ in range(50):  # write -> visible in this replica's copy, under the same load
                    t0 = time.perf_counter()
                    await mirror.apply_ops("probe", [("store", "gpu", [random.getrandbits(64)])])
                    visible.append((time.perf_counter() - t0) * 1000)
                    await asyncio.sleep(0.01)
                await wait_process(w, 120)
                print(f"  rep {r + 1}: " + ", ".join(line))
            load_s = time.perf_counter() - t_load
            await mirror.clear_worker("probe")
            for v, ls in under.items():
                print(f"  {v:16} all: p50 {statistics.median(ls):.3f}  p99 {pct(ls, 0.99):.3f}  max {max(ls):.3f}")
            print(f"  mirror apply lag (append in Redis -> applied here, ms): p50 {statistics.median(lags):.1f} "
                  f"p99 {pct(lags, 0.99):.1f} max {max(lags):.1f}; write -> visible here (ms): p50 "
                  f"{statistics.median(visible):.2f} p99 {pct(visible, 0.99):.2f}; applied "
                  f"{(mirror.entries_applied - applied0) / load_s:.0f} entries/s, "
                  f"{(mirror.keys_applied - keys0) / load_s:.0f} keys/s on average")
            out["load"][str(rate)] = {
                "lookups": {v: {"p50_ms": statistics.median(ls), "p99_ms": pct(ls, 0.99), "max_ms": max(ls)}
                            for v, ls in under.items()},
                "lag_ms": {"p50": statistics.median(lags), "p99": pct(lags, 0.99), "max": max(lags)},
                "write_visible_ms": {"p50": statistics.median(visible), "p99": pct(visible, 0.99)}}

        # 3. catch-up
        gate, parked = asyncio.Event(), asyncio.Event()
        reading = mirror._reader_call

        async def held(request, replies, timeout_s):
            if b"XREAD" in request[0]:
                parked.set()
                await gate.wait()
            return await reading(request, replies, timeout_s)
        mirror._reader_call = held
        await asyncio.wait_for(parked.wait(), 10)  # the read in flight before has returned; the next one waits
        w = start_writer(args, url, 0, 0, 0, args.backlog)
        await wait_process(w, 600)
        target = await seq_of(writer)
        behind = target - mirror.applied_seq
        e0, k0 = mirror.entries_applied, mirror.keys_applied
        t0 = time.perf_counter()
        gate.set()
        while mirror.applied_seq < target:
            await asyncio.sleep(0.001)
        dt = time.perf_counter() - t0
        mirror._reader_call = reading
        out["catch_up"] = {"entries": behind, "s": dt, "entries_per_s": (mirror.entries_applied - e0) / dt,
                           "keys_per_s": (mirror.keys_applied - k0) / dt, "resyncs": mirror.resyncs}
        print(f"\n3. catch-up: {behind} entries behind ({args.backlog} agent batches); applied in {dt:.2f} s: "
              f"{out['catch_up']['entries_per_s']:.0f} entries/s, {out['catch_up']['keys_per_s']:.0f} keys/s "
              f"(resyncs {mirror.resyncs - 1})")
        await mirror.clear_worker("probe")
        assert await mirror.match(prompt) == await plain.match(prompt) == await mem.match(prompt)
        print(f"   mirror state: {json.dumps(mirror.mirror_state())}")
        figures = new_figures("bench_index_lookup", args)
        figures.update(out)  # the raw figures keep their keys; the tables below are what --plot draws
        add_table(figures, "quiet", [{"variant": v, "p50_ms": f["p50_ms"], "p99_ms": f["p99_ms"]}
                                     for v, f in out["quiet"].items()])
        add_table(figures, "under_load", [{"agent_batches_per_s": float(rate), "variant": v, "p50_ms": f["p50_ms"],
                                           "p99_ms": f["p99_ms"]}
                                          for rate, load in out["load"].items() for v, f in load["lookups"].items()])
        add_chart(figures, "bars", "lookup_quiet.png", table="quiet", group_by="variant", values=["p50_ms", "p99_ms"],
                  ylabel="ms", title=f"lookup of a {args.prompt_tokens}-token prompt, {args.workers} workers, quiet")
        add_chart(figures, "bars", "lookup_under_load.png", table="under_load",
                  group_by=["agent_batches_per_s", "variant"], values=["p50_ms", "p99_ms"], ylabel="ms",
                  title="lookups under agent write load")
        emit(figures, args)
        for idx in (mirror, plain, writer):
            await idx.close()
        del mem
        gc.collect()
    finally:
        if proc is not None:
            stop_group(proc)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        url, workers, rate, seconds, spec_rate, blocks, backlog = sys.argv[2:9]
        writer_main(url, int(workers), float(rate), float(seconds), float(spec_rate), int(blocks), int(backlog))
    else:
        asyncio.run(main())
