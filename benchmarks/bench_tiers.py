#!/usr/bin/env python3
"""TTFT of a repeated 2k-token prompt from vLLM's GPU cache, our CPU tier, our SSD tier and by
recompute (one real vLLM server, the "small" generated model), and the SSD tier's read throughput
against ``dd`` on the same disk. Prints the figures side by side.

    KVR_VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python benchmarks/bench_tiers.py [--repeats 3]

The tiers are sized in blocks of the model's real KV block (layers x K,V x block x KV heads x head
size x 2 bytes, from its ``config.json``; checked against the connector's start-up log line): a CPU
tier of one prompt and 4 blocks, so that two other prompts push a prompt wholly out to SSD.

TTFT is measured on a streaming completion (time to the first SSE chunk; the stream is then read
to its end, so the request has finished before the next step), median of ``--repeats``. Each
prefix cache reset must report success. The connector's log line of every measured request is
checked: a case whose blocks came from the wrong place fails the run.
- recompute: a prompt never seen before;
- gpu: the same prompt again (vLLM's own prefix cache);
- cpu: after ``/reset_prefix_cache`` (GPU cache empty), the prompt that ran last: every block
  from the CPU tier;
- ssd: a prompt pushed out of the CPU tier by two other prompts, after a reset, with the SSD
  files' pages dropped from the page cache: every block from SSD (each promoted into a CPU slot,
  which spills an older CPU block to SSD; the connector counts promoted blocks as ``ssd``).
SSD read (per block size: the model's, and 2 MiB, a Llama-3-8B block of 16 tokens): ``--ssd-mib``
of block files written by the tier's own writer, read back with checks by ``read_ssd_many`` as the
connector reads a load (1 and 4 I/O threads), against ``dd bs=1M`` reading one file of the same
total size (dd's own timing, without its process start: the disk's sequential ceiling, the aim's
yardstick) and ``cat`` reading the same files (a plain reader of the same layout). Every read
starts with the pages of its files dropped (``posix_fadvise DONTNEED``); each runs ``--repeats``
times, alternating.
Aims: cpu TTFT <= 0.3 x recompute, SSD read >= 0.8 x dd (median).

``--json FILE`` writes the figures (:mod:`lab.figures`): table ``ssd_read`` (per checksum,
block size and I/O threads: medians ``tier_read_bytes_per_s``, ``raw_read_bytes_per_s`` (one plain
read per file, no checks), ``cat_read_bytes_per_s``, ``dd_read_bytes_per_s``, ``ratio_to_dd``, and
``ratios_to_dd`` of each run), table ``ttft`` (per case: ``ttft_ms``, the median,
``ratio_to_recompute``, ``runs_ms``) and table ``ssd_load`` (blocks of each SSD-case load from CPU
and from SSD). ``--plot DIR`` draws ``ttft.png`` (TTFT per case) and ``ssd_read.png`` (GB/s: tier,
raw, cat, dd). ``--skip-ttft``: the SSD read part alone (no vLLM server; the model's config is still
read for its block size).
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

from lab.figures import add_chart, add_output_args, add_table, emit, new_figures  # noqa: E402
from kvbench.workers import LogTail, stop_groups  # noqa: E402
from kvroute.up import free_ports  # noqa: E402
from offload_agent.connector.config import kv_transfer_config, vllm_env  # noqa: E402
from offload_agent.tiers import TierFingerprint, TierStore, write_block_file  # noqa: E402
from offload_agent.tiers.ssd_file import CHECKSUM_CRC32, CHECKSUM_XXH3_64, HEADER_BYTES, block_path  # noqa: E402

BLOCK = 32
PROMPT_TOKENS = 2048
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK          # blocks saved per prompt
LOADED_BLOCKS = (PROMPT_TOKENS - 1) // BLOCK    # blocks a repeat can load (the last token is computed)
LLAMA8B_BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # 32 layers x (K, V) x 16 tokens x 8 KV heads x 128 x bf16
TIER_LINE = re.compile(r"^.*kvroute tiers: request .* tokens from the tiers \(blocks: cpu (\d+), ssd (\d+).*$",
                       re.MULTILINE)


def model_block_bytes(model_dir: Path) -> int:
    """Bytes of one KV block of ``BLOCK`` tokens of a bf16 model, from its ``config.json``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * kv_heads * head * 2


def tokens(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [10 + rnd.randrange(2000) for _ in range(PROMPT_TOKENS)]


def ttft_s(base: str, prompt: list[int]) -> float:
    """Seconds to the first streamed chunk; the stream is read to its end before returning."""
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", base + "/v1/completions", timeout=300,
                      json={"model": "small", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                            "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def reset_prefix_cache(base: str, deadline_s: float = 30) -> None:
    """``/reset_prefix_cache``, retried while vLLM says a block is still held; RuntimeError when
    it never succeeds (a failed reset leaves the GPU cache warm, and the next case would measure it)."""
    end = time.monotonic() + deadline_s
    while True:
        r = httpx.post(base + "/reset_prefix_cache", timeout=60)
        r.raise_for_status()
        if r.json().get("success"):
            return
        if time.monotonic() > end:
            raise RuntimeError("vLLM refused to reset its prefix cache")
        time.sleep(0.05)


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_read_s(path: Path) -> float:
    """Seconds ``dd bs=1M`` says it took to read ``path`` (its own timing: no process start)."""
    out = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True, text=True)
    m = re.search(r"copied, ([0-9.]+) s", out.stderr)
    if m is None:
        raise RuntimeError(f"unexpected dd output: {out.stderr!r}")
    return float(m.group(1))


def ssd_read_vs_dd(root: Path, block_bytes: int, n_blocks: int, algo: int, io_threads: int,
                   repeats: int) -> dict[str, list[float]]:
    """GB/s of each of ``repeats`` runs: ``tier`` (``read_ssd_many`` with ``io_threads``, checked, as
    the connector reads a load's blocks), ``raw`` (one plain read per file, no checks), ``dd`` (one
    file of the same total size) and ``cat`` (the same files, one process, its start included),
    each with its files' pages dropped first."""
    fp = TierFingerprint(model="bench", num_layers=1, dtype="uint8", block_size=BLOCK, block_bytes=block_bytes)
    folder = root / f"ssd-{algo}-{block_bytes}"
    store = TierStore(bytearray(block_bytes), 1, block_bytes, fp, folder, io_threads=io_threads)
    payload = os.urandom(block_bytes)
    keys = [os.urandom(16) for _ in range(n_blocks)]   # spread over the key folders, like real keys
    for k in keys:
        write_block_file(store.fp_dir, k, fp.digest(), payload, algo=algo)
    paths = [block_path(store.fp_dir, k) for k in keys]
    big = root / "dd.bin"
    with open(big, "wb") as f:
        for _ in range(n_blocks):
            f.write(payload)
    total = n_blocks * block_bytes
    bufs = [bytearray(block_bytes) for _ in keys]
    out: dict[str, list[float]] = {"tier": [], "raw": [], "dd": [], "cat": []}
    for _ in range(repeats):
        for p in paths:
            drop_pages(p)
        t0 = time.perf_counter()
        oks = store.read_ssd_many(keys, bufs)
        out["tier"].append(total / (time.perf_counter() - t0) / 1e9)
        assert all(oks) and bytes(bufs[-1]) == payload
        drop_pages(big)
        out["dd"].append(total / dd_read_s(big) / 1e9)
        for p in paths:
            drop_pages(p)
        mv = memoryview(bufs[0])
        t0 = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                f.seek(HEADER_BYTES)
                f.readinto(mv)
        out["raw"].append(total / (time.perf_counter() - t0) / 1e9)
        for p in paths:
            drop_pages(p)
        t0 = time.perf_counter()
        subprocess.run(["cat", *map(str, paths)], check=True, stdout=subprocess.DEVNULL)
        out["cat"].append((total + n_blocks * HEADER_BYTES) / (time.perf_counter() - t0) / 1e9)
    shutil.rmtree(folder)
    big.unlink()
    return out


def ssd_read_table(fig: dict, work: Path, block_sizes: list[int], total_mib: int, repeats: int) -> None:
    print(f"SSD tier read of {total_mib} MiB of block files vs dd reading one {total_mib} MiB file and cat "
          f"reading the same files (page cache dropped before each read; median of {repeats}, GB/s)")
    for block_bytes in block_sizes:
        n_blocks = max(1, (total_mib << 20) // block_bytes)
        for name, algo in (("crc32 (vLLM venv without xxhash)", CHECKSUM_CRC32), ("xxh3_64", CHECKSUM_XXH3_64)):
            for threads in (1, 4):
                try:
                    r = ssd_read_vs_dd(work, block_bytes, n_blocks, algo, threads, repeats)
                except ValueError:  # no xxhash here
                    break
                ratios = [t / d for t, d in zip(r["tier"], r["dd"])]
                med = {k: statistics.median(v) for k, v in r.items()}
                print(f"  {n_blocks:5d} x {block_bytes >> 10:5d} KiB  {name:34s} {threads} thread(s): tier "
                      f"{med['tier']:5.2f} (raw one-at-a-time {med['raw']:5.2f}, cat {med['cat']:5.2f})  dd "
                      f"{med['dd']:5.2f}  ratio {statistics.median(ratios):4.2f}x  runs "
                      f"{', '.join(f'{x:.2f}' for x in ratios)}  (aim >= 0.8x)", flush=True)
                add_table(fig, "ssd_read", [{
                    "checksum": name.split()[0], "threads": threads, "blocks": n_blocks, "block_bytes": block_bytes,
                    "tier_read_bytes_per_s": med["tier"] * 1e9, "raw_read_bytes_per_s": med["raw"] * 1e9,
                    "cat_read_bytes_per_s": med["cat"] * 1e9, "dd_read_bytes_per_s": med["dd"] * 1e9,
                    "ratio_to_dd": statistics.median(ratios), "ratios_to_dd": ratios}])


class TierLog(LogTail):
    """The connector's per-request tier lines in vLLM's log, read from where the last call stopped."""

    def loads(self) -> list[tuple[int, int, str]]:
        """``(cpu blocks, ssd blocks, log line)`` of each load logged since the last call."""
        return [(int(m[1]), int(m[2]), m[0].strip()) for m in TIER_LINE.finditer(self.text())]


def expect_load(tlog: TierLog, case: str, want: tuple[int, int] | None) -> tuple[int, int, str] | None:
    """Check the measured request's load: ``want`` = (cpu, ssd) blocks, or None for no tier load;
    returns ``(cpu, ssd, the connector's log line)``."""
    loads = tlog.loads()
    if [x[:2] for x in loads] != ([] if want is None else [want]):
        raise RuntimeError(f"{case} case: expected {'no tier load' if want is None else f'cpu {want[0]}, ssd {want[1]}'}, "
                           f"the connector logged {[x[2] for x in loads] or 'none'}")
    return loads[0] if loads else None


def ssd_files(folder: Path) -> list[Path]:
    return list(folder.rglob("*.kvb"))


def ttft_table(fig: dict, work: Path, model: Path, block_bytes: int, args: argparse.Namespace) -> int:
    port, = free_ports(1)
    cpu_blocks = PROMPT_BLOCKS + 4       # one prompt and a little: two more push it wholly out to SSD
    ssd_dir = work / "ssd"
    cfg = kv_transfer_config(cpu_blocks * block_bytes, ssd_dir, 1 << 30)
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
        m = re.search(r"CPU tier (\d+) blocks of (\d+) bytes", log_path.read_text())
        if m is None or (int(m.group(1)), int(m.group(2))) != (cpu_blocks, block_bytes):
            print(f"the connector's CPU tier is not {cpu_blocks} blocks of {block_bytes} bytes: "
                  f"{m.group(0) if m else 'no start-up line'}")
            return 1
        print(f"\n{m.group(0)} (one prompt is {PROMPT_BLOCKS} blocks)")
        tlog = TierLog(log_path)
        reset = lambda: reset_prefix_cache(base)  # noqa: E731
        ttft_s(base, tokens(999))                # warm-up
        seeds = iter(range(1000, 2000))
        res: dict[str, list[float]] = {"recompute": [], "gpu": [], "cpu": [], "ssd": []}
        ssd_loads: list[tuple[int, int, str]] = []
        hot = tokens(1)
        ttft_s(base, hot)
        for _ in range(args.repeats):
            tlog.text()
            res["recompute"].append(ttft_s(base, tokens(next(seeds))))
            expect_load(tlog, "recompute", None)
            res["gpu"].append(ttft_s(base, hot))
            expect_load(tlog, "gpu", None)
        for _ in range(args.repeats):
            reset()
            ttft_s(base, hot)                     # hot's blocks are now the newest in the CPU tier ...
            reset()
            tlog.text()
            res["cpu"].append(ttft_s(base, hot))  # ... and all of them come from there
            expect_load(tlog, "cpu", (LOADED_BLOCKS, 0))
        for _ in range(args.repeats):
            cold = tokens(next(seeds))
            ttft_s(base, cold)
            ttft_s(base, tokens(next(seeds)))     # two other prompts push cold wholly out of the CPU tier
            ttft_s(base, tokens(next(seeds)))
            reset()
            for p in ssd_files(ssd_dir):          # a real read from the disk, not from the page cache
                drop_pages(p)
            tlog.text()
            res["ssd"].append(ttft_s(base, cold))
            ssd_loads.append(expect_load(tlog, "ssd", (0, LOADED_BLOCKS)))
        med = {k: statistics.median(v) * 1000 for k, v in res.items()}
        print(f"\nTTFT of a {PROMPT_TOKENS}-token prompt, small model, median of {args.repeats} (ms)")
        for k in ("recompute", "gpu", "cpu", "ssd"):
            print(f"  {k:10s} {med[k]:8.1f}  {med[k] / med['recompute']:5.2f}x recompute   "
                  f"runs {', '.join(f'{x * 1000:.0f}' for x in res[k])}")
            add_table(fig, "ttft", [{"case": k, "prompt_tokens": PROMPT_TOKENS, "ttft_ms": med[k],
                                     "ratio_to_recompute": med[k] / med["recompute"],
                                     "runs_ms": [x * 1000 for x in res[k]]}])
        print("  SSD-case loads (blocks from CPU, from SSD): "
              + ", ".join(f"cpu {c}, ssd {s}" for c, s, _ in ssd_loads))
        print(f"  the last one's log line: {ssd_loads[-1][2]}")
        add_table(fig, "ssd_load", [{"cpu_blocks": c, "ssd_blocks": s, "log_line": line} for c, s, line in ssd_loads])
        print(f"  aim: cpu <= 0.3x recompute -> {'met' if med['cpu'] <= 0.3 * med['recompute'] else 'NOT met'}")
        return 0
    except Exception:
        print(f"vLLM's log, last lines:\n{log_path.read_text()[-3000:]}")
        raise
    finally:
        stop_groups([proc], grace_s=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ssd-mib", type=int, default=64, help="MiB of block files read in the SSD throughput test")
    ap.add_argument("--vllm-python", default=os.environ.get("KVR_VLLM_PYTHON", ""))
    ap.add_argument("--ssd-dir", default=None, help="folder on the disk to test (default: a temp dir)")
    ap.add_argument("--skip-ttft", action="store_true", help="only the SSD read test (no vLLM server)")
    add_output_args(ap)
    args = ap.parse_args()
    if not args.vllm_python:
        ap.error("set KVR_VLLM_PYTHON or --vllm-python")
    fig = new_figures("bench_tiers", args)
    model = ensure_model("small", args.vllm_python)
    block_bytes = model_block_bytes(model)
    work = Path(tempfile.mkdtemp(prefix="kvr-bench-tiers-", dir=args.ssd_dir))
    try:
        ssd_read_table(fig, work, [block_bytes, LLAMA8B_BLOCK_BYTES], args.ssd_mib, args.repeats)
        if not args.skip_ttft and ttft_table(fig, work, model, block_bytes, args):
            return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.skip_ttft:
        add_chart(fig, "bars", "ttft.png", table="ttft", group_by="case", values=["ttft_ms"], ylabel="TTFT (ms)",
                  title=f"TTFT of a {PROMPT_TOKENS}-token prompt by where its KV comes from, median of {args.repeats}")
    add_chart(fig, "bars", "ssd_read.png", table="ssd_read", group_by=["checksum", "block_bytes", "threads"],
              values=["tier_read_bytes_per_s", "raw_read_bytes_per_s", "cat_read_bytes_per_s", "dd_read_bytes_per_s"],
              scale=1e-9,
              ylabel="GB/s", title=f"SSD tier read of {args.ssd_mib} MiB of blocks vs dd (page cache dropped)")
    emit(fig, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
