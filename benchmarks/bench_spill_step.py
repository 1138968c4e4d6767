#!/usr/bin/env python3
"""Host time of an engine step that evicts CPU-tier blocks to SSD: the connector's worker side
(:class:`offload_agent.connector.worker_ops.TierWorker`) running one step's saves, each of which
evicts an older block from a full CPU tier (a ``spill`` then a ``save`` into the same slot), with
the SSD files written by the writer thread (the default) against written in the step (each spill
waiting for its own write, as before the writer thread: ``MAX_SSD_WRITE_BYTES`` 0). Torch only, on
CPU; run it in vLLM's interpreter (it has torch):

    .venv-vllm/bin/python benchmarks/bench_spill_step.py [--blocks 8 64] [--repeats 5] [--ssd-dir DIR]

Blocks are a Llama-3-8B block of 16 tokens (32 layers x 8 KV heads x 128 x K,V, bf16: 2 MiB). Per
block count, each repeat runs both modes one after the other (order alternating) on a fresh worker
and SSD folder: ``step_ms`` is ``run_saves`` of the evicting step (what the engine's step waits
for), ``drain_ms`` the wait for the files after it. Medians over ``--repeats``. ``--ssd-dir``: a
folder on the disk to measure (default: a temporary folder under /var/tmp); the files are removed.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import torch  # noqa: E402

import gpu_check_connector as gc  # noqa: E402
from offload_agent.connector import worker_ops  # noqa: E402
from offload_agent.connector.kv_copy import PagedKV  # noqa: E402
from offload_agent.tiers.ops import Spill  # noqa: E402
from offload_agent.tiers.planner import TierPlanner  # noqa: E402

DTYPE = torch.bfloat16


def one_run(blocks: int, ssd_root: Path, in_step: bool) -> tuple[float, float]:
    """``(step_ms, drain_ms)`` of one evicting step of ``blocks`` saves."""
    shape = gc.Shape(layers=32, blocks=2 * blocks, heads=8, head_size=128, block_size=16)
    views = gc.build_kv(shape, "LBNHC", DTYPE)
    kv = PagedKV(views, shape.blocks, [f"layers.{i}" for i in range(len(views))])
    fp = gc.fingerprint(kv, DTYPE, shape.block_size)
    worker = worker_ops.TierWorker(kv, blocks, fp, ssd_dir=ssd_root)
    planner = TierPlanner(blocks, 4 * blocks)
    first, second = list(range(blocks)), list(range(blocks, 2 * blocks))
    gc.fill(views, "LBNHC", shape.blocks, first + second, torch.Generator().manual_seed(blocks))
    worker.run_saves(gc.plan_saves(planner, gc.chain_keys(fp, blocks, shape.block_size, 1), first))
    worker.flush()
    ops = gc.plan_saves(planner, gc.chain_keys(fp, blocks, shape.block_size, 2), second)
    assert sum(isinstance(op, Spill) for op in ops) == blocks, "every save must evict a block"
    saved = worker_ops.MAX_SSD_WRITE_BYTES
    worker_ops.MAX_SSD_WRITE_BYTES = 0 if in_step else saved
    try:
        t0 = time.perf_counter()
        worker.run_saves(ops)
        t1 = time.perf_counter()
        worker.flush()
        t2 = time.perf_counter()
    finally:
        worker_ops.MAX_SSD_WRITE_BYTES = saved
    assert worker.take_failures() == [], "a spill failed"
    worker.close()
    return (t1 - t0) * 1000, (t2 - t1) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 64], help="evictions in the step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ssd-dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = args.ssd_dir or Path("/var/tmp")
    print(f"host time of a step evicting N blocks of 2 MiB to SSD (median of {args.repeats}), ms")
    print(f"{'N':>5} {'in the step':>12} {'writer thread':>14} {'ratio':>6} {'drain after':>12}")
    for n in args.blocks:
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for r in range(args.repeats):
            for in_step in ((True, False) if r % 2 == 0 else (False, True)):
                root = Path(tempfile.mkdtemp(prefix="kvroute-spill-", dir=base))
                try:
                    runs[in_step].append(one_run(n, root, in_step))
                finally:
                    shutil.rmtree(root, ignore_errors=True)
        old = statistics.median(s for s, _ in runs[True])
        new = statistics.median(s for s, _ in runs[False])
        drain = statistics.median(d for _, d in runs[False])
        print(f"{n:>5} {old:>12.1f} {new:>14.1f} {new / old:>6.2f} {drain:>12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
