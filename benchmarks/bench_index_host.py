"""The host index (one shared-memory copy per host) against the in-process index: bytes per
(block, worker) entry, store rate, and lookups of a 2,048-block prompt at 64, 256 and 1,024 workers.

Each worker holds ``--blocks-per-worker`` blocks: a prefix of the prompt (in gpu) and filler
blocks of its own (a quarter of them in cpu, the rest gpu). Two prompt shapes:

- ``groups``: the workers in 8 groups; group ``g`` holds the first ``(g + 1) / 8`` of the prompt
  (a few system prompts and documents shared by many workers);
- ``ladder``: worker ``i`` holds the first ``(i + 1) / workers`` of it (every block drops a
  worker: the lookup's worst case).

Lookups are timed in a reader: a second process that maps the file while the writer process is
idle (``quiet``) or applies ``--write-rate`` store/remove batches per second of 16 blocks each
(``writes``). The in-process index is timed in the writer (``--memory-max-workers`` caps the
worker counts it is built for: at 1,024 workers it needs several GB).

``--paths native,numpy`` (the default where the C extension is built) times every lookup both
ways, one after the other on the same index: the C passes of ``kvcore/index/_chain_native.c``
and the numpy passes of :mod:`kvcore.index.chain_rows` they stand in for.

    .venv/bin/python benchmarks/bench_index_host.py            # 64, 256, 1,024 workers
    .venv/bin/python benchmarks/bench_index_host.py --quick    # seconds
"""
from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcore.index import chain_rows  # noqa: E402
from kvcore.index.host import HostIndex  # noqa: E402
from kvcore.index.memory import MemoryIndex  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(len(s) * q) - 1))] if s else float("nan")


def prefix_lengths(shape: str, workers: int, prompt_blocks: int) -> list[int]:
    """Blocks of the prompt each worker holds from block 0."""
    if shape == "ladder":
        return [max(1, (i + 1) * prompt_blocks // workers) for i in range(workers)]
    return [((i * 8 // workers) + 1) * prompt_blocks // 8 for i in range(workers)]


def populate(index, prompt: list[int], lengths: list[int], blocks_per_worker: int, seed: int) -> tuple[int, float]:
    """Store each worker's prefix and filler in batches of 64 keys (an event frame's worth).
    Returns (entries, seconds spent storing)."""
    rnd = random.Random(seed)
    entries = 0
    spent = 0.0
    for w, n in enumerate(lengths):
        worker = f"worker-{w:04d}"
        filler = [rnd.getrandbits(64) for _ in range(max(0, blocks_per_worker - n))]
        cpu_cut = len(filler) // 4
        batches = [("gpu", prompt[i:min(i + 64, n)]) for i in range(0, n, 64)]
        batches += [("cpu", filler[i:min(i + 64, cpu_cut)]) for i in range(0, cpu_cut, 64)]
        batches += [("gpu", filler[i:i + 64]) for i in range(cpu_cut, len(filler), 64)]
        t0 = time.perf_counter()
        for tier, keys in batches:
            index.store_sync(worker, tier, keys)
        spent += time.perf_counter() - t0
        entries += n + len(filler)
    return entries, spent


def fresh(prompt: list[int]) -> list[int]:
    return list(struct.unpack(f"<{len(prompt)}Q", struct.pack(f"<{len(prompt)}Q", *prompt)))


def time_lookups(index, prompt: list[int], n: int) -> list[float]:
    out = []
    for _ in range(n):
        keys = fresh(prompt)
        t0 = time.perf_counter()
        index.match_sync(keys)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def run_reader(path: str, kw: dict, workers: int, prompt_blocks: int, n: int, lookup_path: str,
               writer: HostIndex | None = None, write_rate: float = 0.0) -> dict:
    """Time ``n`` lookups in a new process that maps the file (this script with ``--reader``);
    meanwhile, with ``writer``, apply ``write_rate`` batches per second (each stores 16 new gpu
    blocks on one worker and removes the 16 it stored before). Adds ``writes_applied``."""
    argv = [sys.executable, __file__, "--reader", path, "--reader-bounds", json.dumps(kw),
            "--workers", str(workers), "--prompt-blocks", str(prompt_blocks), "--lookups", str(n),
            "--paths", lookup_path]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    applied = 0
    if writer is not None and write_rate > 0:
        rnd = random.Random(5)
        previous: dict[str, list[int]] = {}
        start = time.perf_counter()
        deadline = start + 600
        while proc.poll() is None and time.perf_counter() < deadline:
            due = start + applied / write_rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(min(wait, 0.05))
                continue
            worker = f"worker-{rnd.randrange(workers):04d}"
            keys = [rnd.getrandbits(64) for _ in range(16)]
            writer.store_sync(worker, "gpu", keys)
            old = previous.get(worker)
            if old:
                writer.remove_sync(worker, "gpu", old)
            previous[worker] = keys
            applied += 1
    out, _ = proc.communicate(timeout=600)
    result = json.loads(out)
    result["writes_applied"] = applied
    return result


def reader_main(args: argparse.Namespace) -> None:
    chain_rows.use_native(args.paths == ["native"])
    idx = HostIndex(args.reader, **json.loads(args.reader_bounds))
    prompt = make_prompt(args.workers[0], args.prompt_blocks)
    got = idx.match_sync(prompt)
    lat = time_lookups(idx, prompt, args.lookups)
    print(json.dumps({"lat": lat, "workers_matched": len(got)}))
    idx.close_sync()


def make_prompt(workers: int, prompt_blocks: int) -> list[int]:
    rnd = random.Random(workers)
    return [rnd.getrandbits(64) for _ in range(prompt_blocks)]


def one_size(workers: int, args: argparse.Namespace, tmp: str) -> dict:
    prompt = make_prompt(workers, args.prompt_blocks)
    lengths = prefix_lengths(args.shape, workers, args.prompt_blocks)
    distinct = args.prompt_blocks + sum(max(0, args.blocks_per_worker - n) for n in lengths)
    kw = dict(max_keys=distinct, max_workers=workers, max_holder_sets=args.max_holder_sets)
    path = os.path.join(tmp, f"index-{workers}")
    host = HostIndex(path, **kw)
    assert host.try_become_writer()
    entries, spent = populate(host, prompt, lengths, args.blocks_per_worker, seed=1)
    if host.dropped_keys:
        raise SystemExit(f"{workers} workers: the load dropped {host.dropped_keys} keys for want of a holder set; "
                         f"raise --max-holder-sets")
    files = host.file_bytes()
    row = {"workers": workers, "entries": entries, "distinct_blocks": len(host),
           "holder_sets": host.counters()["holder_sets"], "dropped_keys": host.dropped_keys,
           "file_mapped_bytes": files["mapped"], "file_resident_bytes": files["resident"],
           "bytes_per_entry": round(files["resident"] / entries, 2),
           "mapped_bytes_per_entry": round(files["mapped"] / entries, 2),
           "store_keys_per_s": round(entries / spent)}
    expect = {f"worker-{w:04d}" for w in range(workers)}
    got = host.match_sync(prompt)
    assert set(got) == expect and all(got[f"worker-{w:04d}"].gpu == n for w, n in enumerate(lengths)), "wrong match"
    row["paths"] = {}
    for lookup_path in args.paths:  # the first path's figures are also the row's own
        chain_rows.use_native(lookup_path == "native")
        fig = row["paths"][lookup_path] = {}
        quiet = run_reader(path, kw, workers, args.prompt_blocks, args.lookups, lookup_path)
        assert quiet.get("workers_matched") == workers, quiet
        fig["host_lookup_ms"] = {"p50": round(pct(quiet["lat"], 0.5), 3), "p99": round(pct(quiet["lat"], 0.99), 3)}
        if args.write_rate > 0:
            busy = run_reader(path, kw, workers, args.prompt_blocks, args.lookups, lookup_path, host, args.write_rate)
            fig["host_lookup_under_writes_ms"] = {"p50": round(pct(busy["lat"], 0.5), 3),
                                                  "p99": round(pct(busy["lat"], 0.99), 3),
                                                  "writes_applied": busy["writes_applied"]}
        fig["host_writer_lookup_ms"] = {"p50": round(pct(time_lookups(host, prompt, args.lookups), 0.5), 3)}
    host.close_sync()
    os.unlink(path)
    if workers <= args.memory_max_workers:
        mem = MemoryIndex(max_keys=distinct + 1)
        _, spent_m = populate(mem, prompt, lengths, args.blocks_per_worker, seed=1)
        for lookup_path in args.paths:
            chain_rows.use_native(lookup_path == "native")
            lat = time_lookups(mem, prompt, args.lookups)
            row["paths"][lookup_path]["memory_lookup_ms"] = {"p50": round(pct(lat, 0.5), 3),
                                                             "p99": round(pct(lat, 0.99), 3)}
        row["memory_store_keys_per_s"] = round(entries / spent_m)
        del mem
    row.update(row["paths"][args.paths[0]])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--blocks-per-worker", type=int, default=8192)
    ap.add_argument("--prompt-blocks", type=int, default=2048)
    ap.add_argument("--shape", choices=("groups", "ladder"), default="groups")
    ap.add_argument("--lookups", type=int, default=300)
    ap.add_argument("--memory-max-workers", type=int, default=256)
    ap.add_argument("--max-holder-sets", type=int, default=65_536,
                    help="the host index's holder-set bound (the gateway's default; the load must drop no key)")
    ap.add_argument("--write-rate", type=float, default=2000.0,
                    help="store+remove batches of 16 blocks per second during the second reader run (0: none)")
    ap.add_argument("--quick", action="store_true", help="16 and 64 workers, 512 blocks each, 50 lookups")
    ap.add_argument("--paths", type=lambda v: v.split(","), default=chain_rows.lookup_paths(),
                    help="lookup passes to time, comma-separated: native (the C extension), numpy")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--reader", help=argparse.SUPPRESS)
    ap.add_argument("--reader-bounds", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if bad := [p for p in args.paths if p not in chain_rows.lookup_paths()]:
        ap.error(f"--paths: {bad}: not available (this install has {', '.join(chain_rows.lookup_paths())})")
    if args.reader:
        reader_main(args)
        return
    if args.quick:
        args.workers, args.blocks_per_worker, args.lookups, args.prompt_blocks = [16, 64], 512, 50, 256
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        for w in args.workers:
            row = one_size(w, args, tmp)
            rows.append(row)
            print(f"{w:>5} workers  {row['entries']:>10,} entries  {row['bytes_per_entry']:6.2f} B/entry "
                  f"({row['mapped_bytes_per_entry']:.1f} mapped) "
                  f"({row['file_resident_bytes'] / 2**20:7.1f} MiB)  store {row['store_keys_per_s']:>9,} keys/s"
                  + (f"  in-process store {row['memory_store_keys_per_s']:,} keys/s"
                     if "memory_store_keys_per_s" in row else ""), flush=True)
            for lookup_path, fig in row["paths"].items():
                mem = fig.get("memory_lookup_ms", {})
                print(f"      {lookup_path:>6}: lookup p50/p99 {fig['host_lookup_ms']['p50']:.3f}/"
                      f"{fig['host_lookup_ms']['p99']:.3f} ms"
                      + (f" (under {args.write_rate:.0f} writes/s: {busy['p50']:.3f}/{busy['p99']:.3f})"
                         if (busy := fig.get("host_lookup_under_writes_ms")) else "")
                      + f"  in the writer p50 {fig['host_writer_lookup_ms']['p50']:.3f}"
                      + (f"  | in-process p50/p99 {mem['p50']:.3f}/{mem['p99']:.3f} ms" if mem else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "prompt_blocks": args.prompt_blocks,
                                              "blocks_per_worker": args.blocks_per_worker, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
