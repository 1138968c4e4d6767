#!/usr/bin/env python3
"""TTFT of a repeated 2k-token prompt from vLLM's GPU cache, our CPU tier, our SSD tier and by
recompute (one real vLLM server, the "small" generated model), and the SSD tier's read throughput
against ``dd`` reading a file of the same size on the same disk. Prints the figures side by side.

    KVR_VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python benchmarks/bench_tiers.py [--repeats 3]

TTFT is measured on a streaming completion (time to the first SSE chunk), median of ``--repeats``.
- recompute: a prompt never seen before;
- gpu: the same prompt again (vLLM's own prefix cache);
- cpu: after ``/reset_prefix_cache`` (GPU cache empty; the CPU tier holds every block);
- ssd: a prompt whose blocks were pushed out of the CPU tier by another prompt, after a reset
  (all but its first blocks come from SSD; the log line says how many).
SSD read: ``--ssd-blocks`` block files written by the tier's own writer, their pages dropped from
the page cache (``posix_fadvise DONTNEED``), read back with checksum checks; ``dd bs=1M`` reads one
file of the same total size, its pages dropped the same way. Aims: cpu TTFT <= 0.3 x recompute,
SSD read >= 0.8 x dd.

``--json FILE`` writes the figures (:mod:`kvroute.bench.figures`): table ``ssd_read`` (per checksum
and I/O threads: ``tier_read_bytes_per_s``, ``raw_read_bytes_per_s``, ``dd_read_bytes_per_s``,
``ratio_to_dd``), table ``ttft`` (per case: ``ttft_ms``, the median, ``ratio_to_recompute``,
``runs_ms``) and table ``ssd_load`` (blocks of the last SSD-case load from CPU and from SSD).
``--plot DIR`` draws ``ttft.png`` (TTFT per case) and ``ssd_read.png`` (GB/s, tier vs dd).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

from kvroute.bench.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402
from kvroute.up import free_ports  # noqa: E402
from offload_agent.connector.config import kv_transfer_config, vllm_env  # noqa: E402
from offload_agent.tiers import TierFingerprint, TierStore, write_block_file  # noqa: E402
from offload_agent.tiers.ssd_file import CHECKSUM_CRC32, CHECKSUM_XXH3_64, block_path  # noqa: E402

BLOCK = 32
PROMPT_TOKENS = 2048
SMALL_BLOCK_BYTES = 8 * 2 * BLOCK * 4 * 64 * 2   # 8 layers x (K, V) x 32 tokens x 4 KV heads x 64 x bf16


def tokens(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [10 + rnd.randrange(2000) for _ in range(PROMPT_TOKENS)]


def ttft_s(base: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", timeout=300,
                      json={"model": "small", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                            "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ssd_read_vs_dd(root: Path, n_blocks: int, algo: int, io_threads: int) -> tuple[float, float, float]:
    """(tier read GB/s with checks, as the connector reads a load's blocks: ``read_ssd_many`` with
    ``io_threads``; one-at-a-time read GB/s without checks; dd GB/s) over n_blocks of the small model."""
    fp = TierFingerprint(model="bench", num_layers=8, dtype="bfloat16", block_size=BLOCK,
                         block_bytes=SMALL_BLOCK_BYTES)
    folder = root / f"ssd-{algo}"
    store = TierStore(bytearray(SMALL_BLOCK_BYTES), 1, SMALL_BLOCK_BYTES, fp, folder, io_threads=io_threads)
    payload = os.urandom(SMALL_BLOCK_BYTES)
    keys = [i.to_bytes(16, "big") for i in range(n_blocks)]
    for k in keys:
        write_block_file(store.fp_dir, k, fp.digest(), payload, algo=algo)
    paths = [block_path(store.fp_dir, k) for k in keys]
    total = n_blocks * SMALL_BLOCK_BYTES
    bufs = [bytearray(SMALL_BLOCK_BYTES) for _ in keys]
    for p in paths:
        drop_pages(p)
    t0 = time.perf_counter()
    assert all(store.read_ssd_many(keys, bufs))
    checked = total / (time.perf_counter() - t0) / 1e9
    buf = bufs[0]
    for p in paths:
        drop_pages(p)
    t0 = time.perf_counter()
    mv = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            f.seek(64)
            f.readinto(mv)
    raw = total / (time.perf_counter() - t0) / 1e9
    big = root / "dd.bin"
    with open(big, "wb") as f:
        for _ in range(n_blocks):
            f.write(payload)
    drop_pages(big)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={big}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    dd = total / (time.perf_counter() - t0) / 1e9
    return checked, raw, dd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ssd-blocks", type=int, default=256, help="blocks read in the SSD throughput test")
    ap.add_argument("--vllm-python", default=os.environ.get("KVR_VLLM_PYTHON", ""))
    ap.add_argument("--ssd-dir", default=None, help="folder on the disk to test (default: a temp dir)")
    add_output_args(ap)
    args = ap.parse_args()
    if not args.vllm_python:
        ap.error("set KVR_VLLM_PYTHON or --vllm-python")
    fig = new_figures("bench_tiers", args)
    work = Path(tempfile.mkdtemp(prefix="kvr-bench-tiers-", dir=args.ssd_dir))
    try:
        print(f"SSD tier read of {args.ssd_blocks} blocks of {SMALL_BLOCK_BYTES} bytes vs dd "
              "(page cache dropped before each read)")
        for name, algo in (("crc32 (vLLM venv without xxhash)", CHECKSUM_CRC32), ("xxh3_64", CHECKSUM_XXH3_64)):
            for threads in (1, 4):
                try:
                    checked, raw, dd = ssd_read_vs_dd(work, args.ssd_blocks, algo, threads)
                except ValueError:
                    break
                print(f"  {name:34s} {threads} thread(s): tier {checked:5.2f} GB/s (one-at-a-time raw read "
                      f"{raw:5.2f})  dd {dd:5.2f} GB/s  ratio {checked / dd:5.2f}x  (aim >= 0.8x)", flush=True)
                add_table(fig, "ssd_read", [{"checksum": name.split()[0], "threads": threads, "blocks": args.ssd_blocks,
                                             "block_bytes": SMALL_BLOCK_BYTES, "tier_read_bytes_per_s": checked * 1e9,
                                             "raw_read_bytes_per_s": raw * 1e9, "dd_read_bytes_per_s": dd * 1e9,
                                             "ratio_to_dd": checked / dd}])
        model = ensure_model("small", args.vllm_python)
        port, = free_ports(1)
        cpu_blocks = PROMPT_TOKENS // BLOCK + 4       # one prompt and a little: the next one spills it
        cfg = kv_transfer_config(cpu_blocks * SMALL_BLOCK_BYTES, work / "ssd", 1 << 30)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND":
               os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"), "VLLM_SERVER_DEV_MODE": "1", **vllm_env()}
        argv = ["timeout", "-s", "KILL", "1500", args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model), "--served-model-name", "small", "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", "4096", "--block-size", str(BLOCK), "--enable-prefix-caching", "--dtype",
                "bfloat16", "--enforce-eager", "--num-gpu-blocks-override", "400",
                "--kv-transfer-config", json.dumps(cfg)]
        log_path = work / "vllm.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            end = time.monotonic() + 900
            while True:
                if proc.poll() is not None or time.monotonic() > end:
                    print(log_path.read_text()[-3000:])
                    return 1
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            reset = lambda: httpx.post(base + "/reset_prefix_cache", timeout=60).raise_for_status()  # noqa: E731
            ttft_s(base, tokens(999))                # warm-up
            seeds = iter(range(1000, 2000))
            res: dict[str, list[float]] = {"recompute": [], "gpu": [], "cpu": [], "ssd": []}
            hot = tokens(1)
            ttft_s(base, hot)
            for _ in range(args.repeats):
                res["recompute"].append(ttft_s(base, tokens(next(seeds))))
                res["gpu"].append(ttft_s(base, hot))
            for _ in range(args.repeats):
                reset()
                ttft_s(base, tokens(next(seeds)))     # keep the CPU tier warm with another prompt
                reset()
                ttft_s(base, hot)                     # hot comes back from CPU ...
                reset()
                res["cpu"].append(ttft_s(base, hot))  # ... and again, now fully on CPU
            for _ in range(args.repeats):
                cold = tokens(next(seeds))
                ttft_s(base, cold)
                ttft_s(base, tokens(next(seeds)))     # pushes cold out of the CPU tier to SSD
                reset()
                res["ssd"].append(ttft_s(base, cold))
            med = {k: statistics.median(v) * 1000 for k, v in res.items()}
            hits = re.findall(r"tokens from the tiers \(blocks: cpu (\d+), ssd (\d+)", log_path.read_text())
            print(f"\nTTFT of a {PROMPT_TOKENS}-token prompt, small model, median of {args.repeats} (ms)")
            for k in ("recompute", "gpu", "cpu", "ssd"):
                print(f"  {k:10s} {med[k]:8.1f}  {med[k] / med['recompute']:5.2f}x recompute   "
                      f"runs {', '.join(f'{x * 1000:.0f}' for x in res[k])}")
                add_table(fig, "ttft", [{"case": k, "prompt_tokens": PROMPT_TOKENS, "ttft_ms": med[k],
                                         "ratio_to_recompute": med[k] / med["recompute"],
                                         "runs_ms": [x * 1000 for x in res[k]]}])
            if hits:
                print(f"  last SSD-case load: {hits[-1][0]} blocks from CPU, {hits[-1][1]} from SSD")
                add_table(fig, "ssd_load", [{"cpu_blocks": int(hits[-1][0]), "ssd_blocks": int(hits[-1][1])}])
            print(f"  aim: cpu <= 0.3x recompute -> {'met' if med['cpu'] <= 0.3 * med['recompute'] else 'NOT met'}")
        finally:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    add_chart(fig, "bars", "ttft.png", table="ttft", group_by="case", values=["ttft_ms"], ylabel="TTFT (ms)",
              title=f"TTFT of a {PROMPT_TOKENS}-token prompt by where its KV comes from, median of {args.repeats}")
    add_chart(fig, "bars", "ssd_read.png", table="ssd_read", group_by=["checksum", "threads"],
              values=["tier_read_bytes_per_s", "raw_read_bytes_per_s", "dd_read_bytes_per_s"], scale=1e-9,
              ylabel="GB/s", title=f"SSD tier read of {args.ssd_blocks} blocks vs dd (page cache dropped)")
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
