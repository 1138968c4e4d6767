#!/usr/bin/env python3
"""GPU check of the tiers connector's byte path, with torch alone (no vLLM).

Specification: ``/work/shared/research/gpu_readiness.md`` §5. It drives the connector's own byte
path (the "Option B" seam): :class:`offload_agent.connector.kv_copy.PagedKV` and ``BlockCopier``
through :class:`offload_agent.connector.worker_ops.TierWorker`, with operation lists from the real
:class:`offload_agent.tiers.planner.TierPlanner`, over KV caches laid out as vLLM 0.32 lays them
out (``tools/kv_views.py``, checked against vLLM by ``tests/torch/test_kv_views_fidelity.py``).

Usage::

    python3 tools/gpu_check_connector.py [--device cuda|cpu] [--out DIR] [--budget-s 240] [--tiny]

``--out DIR`` gets ``gpu_check.json`` (a JSON list of rows, rewritten after every row, so a timeout
leaves what was measured). Each row: ``{section, layout, dtype, n, bytes, host_ms, gpu_ms, gbps,
baseline_gbps, ratio, ok, note}``; the first is the environment (``section: "env"``). Sections:

- A: round trip per layout x dtype (save blocks S, zero D, load into D: bytes equal per layer);
- B: the stored bytes are the same from every layout and equal a reference built on the CPU
  (per block: each layer's logical ``[H, N, K|V]`` bytes, layers in order); cross-layout load;
- C (CUDA): stream ordering: a save waits for the main stream's writes, a load for its zeroing,
  and the main stream's next kernel for the load (``torch.cuda._sleep`` delays main);
- D: the SSD path (spill, promote, ``load_ssd``) round-trips; one corrupted file is exactly one
  invalid block, reported to the planner;
- E (CUDA): host registration of a ``/dev/shm`` slab (``is_pinned``, time); a copy across two
  registrations against one across a single registration; registering it again
  (CUDA error 712) and whether torch's next kernel raises for it (the unchecked-error hazard);
- F: a TP pair: each rank stores its own head slice, fingerprints and SSD folders differ, a file
  of rank 0 is refused under rank 1's fingerprint;
- G: kernel-block split views (``[B * r, H, N / r, C]``) round-trip;
- H (CUDA): ``torch.empty(pin_memory=True)`` rounding (``host_memory_stats``);
- perf: save and load GB/s through ``TierWorker.run_saves``/``run_loads`` for each n, the host
  time of ``run_saves`` (from call to return) with and without a busy forward pass enqueued first
  (CUDA), against a plain pinned copy of the same bytes in the same run (``ratio``) and a pageable
  one. On CPU the "pinned" baseline is a plain host copy (there is no DMA).

Exit status 1 when a correctness check failed (every row is still written), 0 otherwise.
The helpers (:func:`build_kv`, :func:`fill`, :func:`reference_rows`, ...) are also the byte
path tests' (``tests/torch/test_byte_path.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import kv_views  # noqa: E402
from offload_agent.connector import host_memory  # noqa: E402
from offload_agent.connector.kv_copy import PagedKV  # noqa: E402
from offload_agent.connector.worker_ops import TierWorker  # noqa: E402
from offload_agent.tiers.keys import TierFingerprint, layer_names_digest, tier_block_keys, tier_root  # noqa: E402
from offload_agent.tiers.ops import LoadCpu, LoadSsd, Promote, Save, Spill, TierOp  # noqa: E402
from offload_agent.tiers.planner import TierPlanner  # noqa: E402
from offload_agent.tiers.shm_slab import ShmSlab  # noqa: E402
from offload_agent.tiers.ssd_file import CorruptBlockError, block_path, read_block_file  # noqa: E402

LEGACY = {"2BNHD": "(2, B, N, H, D)", "B2NHD": "(B, 2, N, H, D)"}
"""Views of vLLM before its layout rework, per layer (separate from :data:`kv_views.LAYOUTS`)."""
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "uint8": torch.uint8, "fp8e4m3": torch.float8_e4m3fn}


# ---- KV caches as vLLM 0.32 hands them over -----------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A model's KV cache of one group: ``layers`` x ``blocks`` blocks of ``block_size`` tokens,
    ``heads`` KV heads of ``head_size`` elements (K and V each)."""

    layers: int
    blocks: int
    heads: int
    head_size: int
    block_size: int

    def content_bytes(self, dtype: torch.dtype) -> int:
        """K and V of one token and head, in bytes."""
        return 2 * self.head_size * dtype.itemsize

    def buffer_bytes(self, dtype: torch.dtype) -> int:
        return kv_views.buffer_bytes(self.layers, self.blocks, self.heads, self.block_size, self.content_bytes(dtype))

    def block_bytes(self, dtype: torch.dtype) -> int:
        return self.layers * self.heads * self.block_size * self.content_bytes(dtype)


def build_kv(shape: Shape, layout: str, dtype: torch.dtype, device: str | torch.device = "cpu",
             raw: torch.Tensor | None = None, kernel_block_size: int | None = None,
             separate: bool = False) -> list[torch.Tensor]:
    """Per-layer KV views as vLLM hands them to ``register_kv_caches``.

    ``layout``: a :data:`kv_views.LAYOUTS` name (vLLM 0.32: one ``int8`` buffer, ``raw`` when given
    (at least :meth:`Shape.buffer_bytes`), re-viewed), or a :data:`LEGACY` name (one buffer, each
    layer a contiguous ``(2, B, N, H, D)`` or ``(B, 2, N, H, D)`` slice of it). ``separate``: legacy
    only, each layer its own allocation (no common layer stride)."""
    nbytes = shape.buffer_bytes(dtype)
    if layout in kv_views.LAYOUTS:
        if raw is None:
            raw = torch.zeros(nbytes, dtype=torch.int8, device=device)
        return kv_views.kv_cache_views(raw, layout, shape.layers, shape.blocks, shape.heads, shape.block_size,
                                       shape.content_bytes(dtype), dtype, kernel_block_size)
    dims = {"2BNHD": (2, shape.blocks), "B2NHD": (shape.blocks, 2)}[layout]
    full = dims + (shape.block_size, shape.heads, shape.head_size)
    per_layer = nbytes // shape.layers
    if separate:
        return [torch.zeros(per_layer, dtype=torch.int8, device=device).view(dtype).view(full)
                for _ in range(shape.layers)]
    if raw is None:
        raw = torch.zeros(nbytes, dtype=torch.int8, device=device)
    return [raw[i * per_layer:(i + 1) * per_layer].view(dtype).view(full) for i in range(shape.layers)]


def logical_pages(view: torch.Tensor, layout: str, num_blocks: int) -> torch.Tensor:
    """One layer's view as ``uint8 [num_blocks, *page]`` in logical order, built independently of
    ``PagedKV``: ``[B, H, N, C]`` (``[B, r, H, N / r, C]`` when kernel blocks split a block) for
    vLLM 0.32's layouts, ``[B, 2, N, H, D * itemsize]`` for the legacy ones."""
    u = view.view(torch.uint8)
    if layout == "2BNHD":
        return u.transpose(0, 1)
    if layout == "B2NHD":
        return u
    return u if u.shape[0] == num_blocks else u.unflatten(0, (num_blocks, u.shape[0] // num_blocks))


def fill(views: list[torch.Tensor], layout: str, num_blocks: int, blocks: list[int],
         gen: torch.Generator, heads: slice | None = None, content: torch.Tensor | None = None) -> torch.Tensor:
    """Write random bytes (or ``content``) into ``blocks`` of every layer; returns what was written,
    ``uint8 [L, n, *page]`` on the views' device. ``heads``: write ``content[:, :, heads]``
    (a TP rank's head slice of the whole model's content; 0.32 layouts only)."""
    pages = [logical_pages(v, layout, num_blocks) for v in views]
    if content is None:
        content = torch.randint(0, 256, (len(views), len(blocks), *pages[0].shape[1:]), dtype=torch.uint8,
                                generator=gen).to(views[0].device)
    if heads is not None:
        content = content[:, :, heads]
    idx = torch.tensor(blocks, dtype=torch.long, device=views[0].device)
    for layer, p in enumerate(pages):
        p[idx] = content[layer]
    return content.contiguous()


def read_blocks(views: list[torch.Tensor], layout: str, num_blocks: int, blocks: list[int]) -> torch.Tensor:
    """``uint8 [L, n, *page]``: the logical bytes of ``blocks`` in every layer (a copy)."""
    idx = torch.tensor(blocks, dtype=torch.long, device=views[0].device)
    return torch.stack([logical_pages(v, layout, num_blocks)[idx] for v in views])


def zero_blocks(views: list[torch.Tensor], layout: str, num_blocks: int, blocks: list[int]) -> None:
    """Zero ``blocks`` in every layer (as vLLM zeroes newly allocated blocks), on the current stream."""
    idx = torch.tensor(blocks, dtype=torch.long, device=views[0].device)
    for v in views:
        logical_pages(v, layout, num_blocks)[idx] = 0


def reference_rows(content: torch.Tensor) -> torch.Tensor:
    """The stored rows of ``content`` (``uint8 [L, n, *page]``), built by hand: ``uint8
    [n, L * page_bytes]``, each row the block's pages of every layer in layer order."""
    n = content.shape[1]
    return content.transpose(0, 1).reshape(n, -1).cpu()


# ---- the connector's worker side ----------------------------------------------------------------------
def fingerprint(kv: PagedKV, dtype: torch.dtype, block_size: int, tp_rank: int = 0, tp_size: int = 1,
                model: str = "gpu-check") -> TierFingerprint:
    """A shard's fingerprint as the connector makes it (layer names ``layers.<i>``)."""
    return TierFingerprint(model=model, num_layers=kv.num_layers, dtype=str(dtype).replace("torch.", ""),
                           block_size=block_size, block_bytes=kv.block_bytes, layout=kv.layout,
                           tp_rank=tp_rank, tp_size=tp_size,
                           layers=layer_names_digest([f"layers.{i}" for i in range(kv.num_layers)]))


def chain_keys(fp: TierFingerprint, n: int, block_size: int, seed: int) -> list[bytes]:
    """Tier keys of a prompt of ``n`` full blocks (token ids from ``seed``)."""
    tokens = [(seed * 7919 + i * 31) % 50000 for i in range(n * block_size)]
    return tier_block_keys(tokens, block_size, tier_root(fp.engine_digest()))


def plan_saves(planner: TierPlanner, keys: list[bytes], blocks: list[int]) -> list[TierOp]:
    """The planner's operations saving ``blocks`` as ``keys``, in order."""
    ops: list[TierOp] = []
    for k, b in zip(keys, blocks):
        ops += planner.plan_save(k, b)
    return ops


def forget_failures(worker: TierWorker, planner: TierPlanner) -> list[tuple[bytes, str, int | None]]:
    """Tell the planner what the worker found unusable (as the connector does); returns it."""
    failures = worker.take_failures()
    for key, tier, slot in failures:
        planner.forget(key, tier, slot)
    return failures


# ---- the check --------------------------------------------------------------------------------------------
FIELDS = ("section", "layout", "dtype", "n", "bytes", "host_ms", "gpu_ms", "gbps", "baseline_gbps", "ratio", "ok", "note")


class Report:
    """Rows of ``gpu_check.json``, written after each row; correctness failures counted."""

    def __init__(self, out: Path | None, budget_s: float) -> None:
        self.rows: list[dict] = []
        self.path = out / "gpu_check.json" if out is not None else None
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.failed = 0

    def over_budget(self) -> bool:
        return time.monotonic() - self.start > self.budget_s

    def add(self, section: str, **fields) -> dict:
        row = {k: fields.get(k) for k in FIELDS}
        row["section"] = section
        row.update({k: v for k, v in fields.items() if k not in FIELDS})
        self.rows.append(row)
        if row.get("ok") is False and section != "perf":
            self.failed += 1
        if self.path is not None:
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.rows, indent=1, default=str))
            os.replace(tmp, self.path)
        flag = {True: "ok", False: "FAIL", None: "--"}[row.get("ok")]
        print(f"[{time.monotonic() - self.start:6.1f}s] {section:5} {row.get('layout') or '':7} "
              f"{row.get('dtype') or '':7} n={row.get('n') if row.get('n') is not None else '':<5} {flag:4} "
              f"{row.get('note') or ''}", flush=True)
        return row

    def check(self, section: str, fn, **fields) -> dict:
        """Run ``fn()`` (returns a note or None; raises on failure) and record ok/failure."""
        if self.over_budget():
            return self.add(section, ok=None, note="skipped: time budget spent", **fields)
        t0 = time.monotonic()
        try:
            note = fn()
            ok = True
        except Exception as exc:  # a failed check is a row, not the end of the run
            ok, note = False, f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc(limit=3)
        return self.add(section, ok=ok, note=note, host_ms=round((time.monotonic() - t0) * 1e3, 2), **fields)


def assert_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shapes {tuple(a.shape)} != {tuple(b.shape)}")
    if not torch.equal(a.cpu(), b.cpu()):
        diff = (a.cpu() != b.cpu()).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}")


class Check:
    """The sections of the check (module docstring) on one device."""

    def __init__(self, device: str, report: Report, tiny: bool, workdir: Path) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.r = report
        self.gen = torch.Generator().manual_seed(1234)
        self.workdir = workdir
        if self.cuda:  # Llama-3-8B-like: 32 layers x 8 heads x 128, block 16, bf16 = 2 MiB per block
            self.shape = Shape(layers=32, blocks=2100, heads=8, head_size=128, block_size=16)
            self.perf_n = [1, 64, 1024]
        elif tiny:
            self.shape = Shape(layers=4, blocks=72, heads=2, head_size=32, block_size=16)
            self.perf_n = [1, 8, 32]
        else:
            self.shape = Shape(layers=8, blocks=300, heads=8, head_size=64, block_size=16)
            self.perf_n = [1, 32, 128]
        self.small = Shape(layers=self.shape.layers if self.cuda else min(self.shape.layers, 8), blocks=64, heads=self.shape.heads,
                           head_size=self.shape.head_size, block_size=self.shape.block_size)
        self.raw = torch.zeros(self.shape.buffer_bytes(torch.bfloat16), dtype=torch.int8, device=self.device)
        self.pinned_slab: bool | None = None
        self.slab_kind = "local"
        self._cycles_per_ms: float | None = None
        self._seq = 0

    # ---- helpers ----
    def views(self, layout: str, dtype: torch.dtype, shape: Shape | None = None, **kw) -> list[torch.Tensor]:
        shape = shape or self.shape
        raw = self.raw if shape.buffer_bytes(dtype) <= self.raw.numel() else None
        return build_kv(shape, layout, dtype, self.device, raw=raw, **kw)

    def worker(self, views, shape: Shape, dtype, slots: int, ssd: Path | None = None, tp_rank: int = 0,
               tp_size: int = 1, shm: ShmSlab | None = None, **kw) -> TierWorker:
        kv = PagedKV(views, shape.blocks, [f"layers.{i}" for i in range(len(views))])
        fp = fingerprint(kv, dtype, shape.block_size, tp_rank, tp_size)
        return TierWorker(kv, slots, fp, ssd_dir=ssd, shm=shm, **kw)

    def keys(self, worker: TierWorker, n: int) -> list[bytes]:
        self._seq += 1
        return chain_keys(worker.store.fingerprint, n, self.shape.block_size, self._seq)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def round_trip(self, layout: str, dtype: torch.dtype, shape: Shape, n: int = 8, **kw) -> str:
        """Save blocks S via planner ops, zero D, load into D; assert equal bytes and that the slab
        rows equal the hand-built reference. Returns a note."""
        views = self.views(layout, dtype, shape, **kw)
        S, D = list(range(1, 2 * n, 2)), list(range(2 * n + 2, 3 * n + 2))
        content = fill(views, layout, shape.blocks, S, self.gen)
        w = self.worker(views, shape, dtype, slots=2 * n)
        try:
            planner = TierPlanner(2 * n)
            keys = self.keys(w, n)
            ops = plan_saves(planner, keys, S)
            w.run_saves(ops)
            w.flush()
            slots = [op.slot for op in ops]
            assert_equal(w.slab[slots], reference_rows(content), "slab rows vs reference")
            zero_blocks(views, layout, shape.blocks, D)
            lops, tiers = planner.plan_load(keys, D)
            w.run_loads(lops)
            w.flush()
            self.sync()
            assert tiers == ["cpu"] * n, tiers
            assert not w.take_invalid_blocks()
            assert_equal(read_blocks(views, layout, shape.blocks, D), content, "loaded blocks")
            return f"all_layers={w.kv.all_layers} block_bytes={w.kv.block_bytes}"
        finally:
            w.close()

    # ---- A ----
    def section_a(self) -> None:
        for layout in [*kv_views.LAYOUTS, *LEGACY]:
            for dname in ("bf16", "uint8", "fp8e4m3"):
                self.r.check("A", lambda: self.round_trip(layout, DTYPES[dname], self.small), layout=layout,
                             dtype=dname, n=8)

    # ---- B ----
    def section_b(self) -> None:
        def same_bytes() -> str:
            n, shape = 8, self.small
            S = list(range(3, 3 + n))
            content = torch.randint(0, 256, (shape.layers, n, shape.heads, shape.block_size,
                                             shape.content_bytes(torch.bfloat16)), dtype=torch.uint8,
                                    generator=self.gen).to(self.device)
            ref = reference_rows(content)
            for layout in ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "LHBNC", "BHLNC"):
                views = self.views(layout, torch.bfloat16, shape)
                fill(views, layout, shape.blocks, S, self.gen, content=content)
                w = self.worker(views, shape, torch.bfloat16, slots=n)
                try:
                    ops = plan_saves(TierPlanner(n), self.keys(w, n), S)
                    w.run_saves(ops)
                    w.flush()
                    assert_equal(w.slab[[op.slot for op in ops]], ref, f"{layout} slab rows")
                finally:
                    w.close()
            return "6 layouts: identical rows, equal to the CPU reference"

        def cross_layout() -> str:
            n, shape = 8, self.small
            S, D = list(range(n)), list(range(20, 20 + n))
            src = build_kv(shape, "LBNHC", torch.bfloat16, self.device)
            content = fill(src, "LBNHC", shape.blocks, S, self.gen)
            ws = self.worker(src, shape, torch.bfloat16, slots=n)
            planner = TierPlanner(n)
            keys = self.keys(ws, n)
            try:
                ops = plan_saves(planner, keys, S)
                ws.run_saves(ops)
                ws.flush()
                for layout in ("LBHNC", "BLHNC"):
                    dst = build_kv(shape, layout, torch.bfloat16, self.device)
                    wd = self.worker(dst, shape, torch.bfloat16, slots=n)
                    try:
                        assert wd.store.fingerprint.digest() == ws.store.fingerprint.digest()
                        wd.slab.copy_(ws.slab)  # the same CPU tier (a peer or the SSD would hand these bytes)
                        for op in ops:
                            wd.store.mark(op.slot, op.key)
                        lops, _ = planner.plan_load(keys, D)
                        wd.run_loads(lops)
                        wd.flush()
                        self.sync()
                        assert not wd.take_invalid_blocks()
                        assert_equal(read_blocks(dst, layout, shape.blocks, D), content, f"LBNHC -> {layout}")
                    finally:
                        wd.close()
            finally:
                ws.close()
            return "LBNHC -> LBHNC, BLHNC: logical bytes equal, same fingerprint"

        self.r.check("B", same_bytes, layout="all", dtype="bf16", n=8)
        self.r.check("B", cross_layout, layout="LBNHC->", dtype="bf16", n=8)

    # ---- C ----
    def cycles_per_ms(self) -> float:
        if self._cycles_per_ms is None:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)
            s.record()
            torch.cuda._sleep(20_000_000)
            e.record()
            e.synchronize()
            self._cycles_per_ms = 20_000_000 / max(1e-3, s.elapsed_time(e))
        return self._cycles_per_ms

    def busy(self, ms: float) -> None:
        """Enqueue ``ms`` of GPU work on the current stream (a stand-in for a forward pass)."""
        torch.cuda._sleep(int(self.cycles_per_ms() * ms))

    def section_c(self) -> None:
        if not self.cuda:
            self.r.add("C", ok=None, note="CUDA only: skipped")
            return
        n, shape, layout = 8, self.small, "LBNHC"

        def save_waits() -> str:
            views = self.views(layout, torch.bfloat16, shape)
            S = list(range(n))
            fill(views, layout, shape.blocks, S, self.gen)
            self.sync()
            w = self.worker(views, shape, torch.bfloat16, slots=n)
            try:
                pages = [logical_pages(v, layout, shape.blocks) for v in views]
                fresh = torch.randint(0, 256, (shape.layers, n, *pages[0].shape[1:]), dtype=torch.uint8,
                                      generator=self.gen).to(self.device)
                idx = torch.tensor(S, dtype=torch.long, device=self.device)
                self.sync()
                self.busy(50)
                for layer, p in enumerate(pages):  # on main, after the sleep (no host sync on the way)
                    p[idx] = fresh[layer]
                ops = plan_saves(TierPlanner(n), self.keys(w, n), S)
                t0 = time.monotonic()
                w.run_saves(ops)
                host_ms = (time.monotonic() - t0) * 1e3
                w.flush()
                assert_equal(w.slab[[op.slot for op in ops]], reference_rows(fresh), "slab after delayed write")
                return f"run_saves returned in {host_ms:.1f} ms with 50 ms queued on main"
            finally:
                w.close()

        def load_waits() -> str:
            views = self.views(layout, torch.bfloat16, shape)
            S, D = list(range(n)), list(range(n, 2 * n))
            content = fill(views, layout, shape.blocks, S, self.gen)
            w = self.worker(views, shape, torch.bfloat16, slots=n)
            try:
                planner = TierPlanner(n)
                keys = self.keys(w, n)
                w.run_saves(plan_saves(planner, keys, S))
                w.flush()
                fill(views, layout, shape.blocks, D, self.gen)  # stale bytes in D
                pages = [logical_pages(v, layout, shape.blocks) for v in views]
                idx = torch.tensor(D, dtype=torch.long, device=self.device)
                lops, _ = planner.plan_load(keys, D)
                self.sync()
                self.busy(50)
                for p in pages:  # on main, after the sleep
                    p[idx] = 0
                w.run_loads(lops)
                probe = torch.stack([p[idx] for p in pages])  # on main, right after
                self.sync()
                assert_equal(probe, content, "probe after delayed zeroing")
                return "load after zeroing, main after load"
            finally:
                w.close()

        self.r.check("C", save_waits, layout=layout, dtype="bf16", n=n)
        self.r.check("C", load_waits, layout=layout, dtype="bf16", n=n)

    # ---- D ----
    def section_d(self) -> None:
        shape, layout = self.small, "LBNHC"

        def ssd_path() -> str:
            views = self.views(layout, torch.bfloat16, shape)
            chain, extra = list(range(0, 6)), [6]
            D = list(range(10, 16))
            ssd = Path(tempfile.mkdtemp(dir=self.workdir, prefix="ssd-"))
            content = fill(views, layout, shape.blocks, chain, self.gen)
            fill(views, layout, shape.blocks, extra, self.gen)
            w = self.worker(views, shape, torch.bfloat16, slots=3, ssd=ssd)
            try:
                planner = TierPlanner(3, 16)
                keys, other = self.keys(w, 6), self.keys(w, 1)
                ops = plan_saves(planner, keys, chain) + plan_saves(planner, other, extra)
                w.run_saves(ops)
                w.flush()
                spills = sum(isinstance(op, Spill) for op in ops)
                zero_blocks(views, layout, shape.blocks, D)
                lops, tiers = planner.plan_load(keys, D)
                kinds = {type(op).__name__ for op in lops}
                assert {LoadCpu.__name__, Promote.__name__, LoadSsd.__name__} <= kinds, kinds
                w.run_loads(lops)
                w.flush()
                self.sync()
                assert not w.take_invalid_blocks()
                assert not forget_failures(w, planner)
                assert_equal(read_blocks(views, layout, shape.blocks, D), content, "SSD/staging path")
                # corrupt one block that is on SSD only
                victim = next(i for i, k in enumerate(keys) if planner.tier_of(k) == "ssd")
                path = block_path(w.store.fp_dir, keys[victim])
                raw = bytearray(path.read_bytes())
                raw[-1] ^= 0xFF
                path.write_bytes(bytes(raw))
                zero_blocks(views, layout, shape.blocks, D)
                lops, _ = planner.plan_load(keys, D)
                w.run_loads(lops)
                w.flush()
                invalid = w.take_invalid_blocks()
                assert invalid == {D[victim]}, (invalid, D[victim])
                failures = forget_failures(w, planner)
                assert failures and {f[0] for f in failures} == {keys[victim]}, failures
                assert planner.tier_of(keys[victim]) is None
                assert not path.exists()
                good = [i for i in range(6) if i != victim]
                assert_equal(read_blocks(views, layout, shape.blocks, [D[i] for i in good]), content[:, good],
                             "the other blocks")
                return f"{spills} spills; ops {sorted(kinds)}; corrupted block {victim} -> invalid {sorted(invalid)}"
            finally:
                w.close()
                shutil.rmtree(ssd, ignore_errors=True)

        self.r.check("D", ssd_path, layout=layout, dtype="bf16", n=6)

    # ---- E ----
    def section_e(self) -> None:
        if not self.cuda:
            self.r.add("E", ok=None, note="CUDA only: skipped (tests/torch covers register's calls)")
            return
        shape, layout, slots = self.small, "LBNHC", 64
        views = self.views(layout, torch.bfloat16, shape)
        kv = PagedKV(views, shape.blocks)
        fp = fingerprint(kv, torch.bfloat16, shape.block_size)
        path = Path("/dev/shm") / f"kvroute-gpu-check-{os.getpid()}"
        holder: dict = {}

        def register() -> str:
            slab = ShmSlab.create(path, fp.digest(), kv.block_bytes, slots)
            t0 = time.monotonic()
            w = TierWorker(kv, slots, fp, shm=slab)
            ms = (time.monotonic() - t0) * 1e3
            holder["w"], holder["slab"] = w, slab
            assert w.pinned, "cudaHostRegister failed"
            pinned = w.slab.is_pinned()
            assert pinned, "the registered slab is not seen as pinned by torch"
            return f"registered {slots * kv.block_bytes} bytes in {ms:.1f} ms; is_pinned={pinned}"

        def double_register() -> str:
            w = holder["w"]
            code = host_memory._code(torch.cuda.cudart().cudaHostRegister(w.slab.data_ptr(), w.slab.numel(), 0))
            raised = None
            try:
                (torch.ones(4, device=self.device) + 1).sum().item()
            except RuntimeError as exc:
                raised = str(exc).splitlines()[0][:120]
            host_memory.cudart().clear_error()
            after = None
            try:
                torch.ones(1, device=self.device).sum().item()
            except RuntimeError as exc:  # left behind: the hazard itself
                after = str(exc).splitlines()[0][:80]
                torch.ones(1, device=self.device).sum().item()
            return (f"second cudaHostRegister -> {code} (712: already registered); next kernel raised: {raised}; "
                    f"after clear_error: {after}")

        def span_copy() -> str:
            """A copy into host memory across the boundary of two registrations, then the same
            copy into a fresh buffer registered whole (what :func:`host_memory.register` does)."""
            nbytes = 4 << 20
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=self.gen).to(self.device)
            results = []
            for split in (True, False):
                mm = mmap.mmap(-1, 2 * nbytes)
                host = torch.frombuffer(mm, dtype=torch.uint8)
                host.zero_()  # pages present before registration, as host_buffer's populate does
                parts = (host[:nbytes], host[nbytes:]) if split else (host,)
                regs = [host_memory.register(p) for p in parts]
                assert all(r.ok for r in regs), "cudaHostRegister failed"
                dst = host[nbytes // 2:nbytes // 2 + nbytes]
                try:
                    dst.copy_(src, non_blocking=True)
                    torch.cuda.synchronize(self.device)
                    results.append("equal bytes" if torch.equal(dst, src.cpu()) else "WRONG BYTES")
                except RuntimeError as exc:
                    host_memory.cudart().clear_error()
                    results.append("raised " + str(exc).splitlines()[0][:60])
                for r in regs:
                    r.release()
                del dst, parts, host
            assert results[1] == "equal bytes", f"one registration: {results[1]}"
            return f"copy across two registrations: {results[0]}; one registration: {results[1]}"

        self.r.check("E", register, layout=layout, dtype="bf16", n=slots)
        self.r.check("E", span_copy, dtype="uint8", n=1)
        if "w" in holder:
            self.r.check("E", double_register, layout=layout, dtype="bf16", n=slots)
            holder["w"].close()
            holder["slab"].unlink()
            holder["slab"].close()

    # ---- F ----
    def section_f(self) -> None:
        def tp_pair() -> str:
            n, layout = 6, "LBNHC"
            full = self.small
            half = Shape(full.layers, full.blocks, full.heads // 2, full.head_size, full.block_size)
            S, D = list(range(n)), list(range(30, 30 + n))
            content = torch.randint(0, 256, (half.layers, n, full.heads, full.block_size,
                                             full.content_bytes(torch.bfloat16)), dtype=torch.uint8,
                                    generator=self.gen).to(self.device)
            ssd = Path(tempfile.mkdtemp(dir=self.workdir, prefix="ssd-tp-"))
            ranks = []
            try:
                for r in range(2):
                    views = build_kv(half, layout, torch.bfloat16, self.device)
                    heads = slice(r * half.heads, (r + 1) * half.heads)
                    fill(views, layout, half.blocks, S, self.gen, heads=heads, content=content)
                    ranks.append((views, heads, self.worker(views, half, torch.bfloat16, slots=3, ssd=ssd,
                                                            tp_rank=r, tp_size=2)))
                fps = [w.store.fingerprint for _, _, w in ranks]
                assert fps[0].digest() != fps[1].digest() and fps[0].engine_digest() == fps[1].engine_digest()
                planner = TierPlanner(3, 16)  # the scheduler's: one plan for both ranks
                keys = chain_keys(fps[0], n, half.block_size, 99)
                ops = plan_saves(planner, keys, S)
                for _, _, w in ranks:
                    w.run_saves(ops)
                    w.flush()
                for r, (views, heads, w) in enumerate(ranks):
                    held = [(op.slot, op.key) for op in ops if isinstance(op, Save) and w.store.holds(op.slot, op.key)]
                    for slot, key in held:
                        i = keys.index(key)
                        assert_equal(w.slab[slot], reference_rows(content[:, i:i + 1, heads])[0], f"rank {r} slot {slot}")
                dirs = sorted(p.name for p in ssd.iterdir())
                assert dirs == sorted(w.store.fp_dir.name for _, _, w in ranks) and len(dirs) == 2, dirs
                on_ssd = next(k for k in keys if planner.tier_of(k) == "ssd")
                out = bytearray(ranks[1][2].kv.block_bytes)
                try:
                    read_block_file(ranks[0][2].store.fp_dir, on_ssd, fps[1].digest(), out)
                    raise AssertionError("rank 0's file was read under rank 1's fingerprint")
                except CorruptBlockError:
                    pass
                lops, _ = planner.plan_load(keys, D)
                for r, (views, heads, w) in enumerate(ranks):
                    zero_blocks(views, layout, half.blocks, D)
                    w.run_loads(lops)
                    w.flush()
                    self.sync()
                    assert not w.take_invalid_blocks()
                    assert_equal(read_blocks(views, layout, half.blocks, D), content[:, :, heads], f"rank {r} load")
                return f"2 ranks x {half.heads} heads; SSD folders {dirs}; cross-fingerprint read refused"
            finally:
                for _, _, w in ranks:
                    w.close()
                shutil.rmtree(ssd, ignore_errors=True)

        self.r.check("F", tp_pair, layout="LBNHC", dtype="bf16", n=6)

    # ---- G ----
    def section_g(self) -> None:
        half = self.small.block_size // 2
        for layout in ("LBNHC", "LBHNC"):
            self.r.check("G", lambda: self.round_trip(layout, torch.bfloat16, self.small, kernel_block_size=half),
                         layout=layout, dtype="bf16", n=8, note_kernel=half)

    # ---- H ----
    def section_h(self) -> None:
        if not self.cuda:
            self.r.add("H", ok=None, note="CUDA only: skipped")
            return

        def rounding() -> str:
            stats = getattr(torch.cuda, "host_memory_stats", None)
            before = stats() if stats else {}
            t = torch.empty(3 << 29, dtype=torch.uint8, pin_memory=True)
            after = stats() if stats else {}
            grew = {k: after[k] - before.get(k, 0) for k in after if k.endswith(".current") and "bytes" in k}
            del t
            rounded = any(v == 2 << 30 for v in grew.values())
            return f"1.5 GiB pinned request: {grew}" + (" (rounded up to 2 GiB)" if rounded else "")

        self.r.check("H", rounding, layout="", dtype="uint8", n=1)

    # ---- perf ----
    def _timed(self, fn) -> tuple[float, float | None, float]:
        """``(host_ms, gpu_ms, total_ms)``: the call's wall time, the main stream's time from before
        the call to after it (CUDA), and the wall time until everything completed."""
        self.sync()
        e0 = e1 = None
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.monotonic()
        fn()
        host = (time.monotonic() - t0) * 1e3
        if self.cuda:
            e1.record()
        self.sync()
        total = (time.monotonic() - t0) * 1e3
        return host, (e0.elapsed_time(e1) if self.cuda else None), total

    def best_gbps(self, nbytes: int, fn, wall: bool = False) -> float:
        """GB/s of ``fn`` moving ``nbytes``: best of 3 after a warm-up, timed by events on the main
        stream (CUDA) or by the wall clock (CPU, or ``wall``: a copy that blocks the host)."""
        best = float("inf")
        for _ in range(4):
            _, g, tot = self._timed(fn)
            best = min(best, tot if wall or g is None else g)
        return nbytes / (best * 1e-3) / 1e9

    def baseline(self, nbytes: int, pinned: bool, src_dev: torch.Tensor, host: torch.Tensor) -> tuple[float, float]:
        """GB/s of one device -> host and one host -> device copy of ``nbytes``."""
        d, h = src_dev[:nbytes], host[:nbytes]
        wall = self.cuda and not pinned
        return (self.best_gbps(nbytes, lambda: h.copy_(d, non_blocking=pinned), wall),
                self.best_gbps(nbytes, lambda: d.copy_(h, non_blocking=pinned), wall))

    def pieces_gbps(self, nbytes: int, piece: int, src_dev: torch.Tensor, host: torch.Tensor) -> float:
        """GB/s of device -> host in separate ``piece``-byte copies (one per block and layer):
        the per-copy overhead."""
        def run() -> None:
            for at in range(0, nbytes, piece):
                host[at:at + piece].copy_(src_dev[at:at + piece], non_blocking=self.cuda)
        return self.best_gbps(nbytes, run)

    def proto_blhnc(self, n: int, host: torch.Tensor) -> float:
        """The target pattern for BLHNC (gpu_readiness.md §4 item 3): a block's layers are one
        contiguous run in logical order, so a save is one DMA per block, no kernel. GB/s."""
        bb = self.shape.block_bytes(torch.bfloat16)
        raw = self.raw.view(torch.uint8)

        def run() -> None:
            for i in range(n):
                b = 2 * i  # every other block: no run merging
                host[i * bb:(i + 1) * bb].copy_(raw[b * bb:(b + 1) * bb], non_blocking=self.cuda)
        return self.best_gbps(n * bb, run)

    def section_perf(self) -> None:
        shape = self.shape
        max_n = max(self.perf_n)
        bb = shape.block_bytes(torch.bfloat16)
        src_dev = torch.empty(max_n * bb, dtype=torch.uint8, device=self.device)
        pinned_host = torch.empty(max_n * bb, dtype=torch.uint8, pin_memory=self.cuda)
        pageable = torch.empty(max_n * bb, dtype=torch.uint8)
        base: dict[int, tuple[float, float]] = {}
        for n in self.perf_n:
            if self.r.over_budget():
                self.r.add("perf", n=n, ok=None, note="skipped: time budget spent")
                continue
            pin = self.baseline(n * bb, self.cuda, src_dev, pinned_host)
            page = self.baseline(n * bb, False, src_dev, pageable)
            base[n] = pin
            for direction, i in (("d2h", 0), ("h2d", 1)):
                self.r.add("perf", layout="baseline-" + ("pinned" if self.cuda else "host"), dtype="uint8", n=n,
                           bytes=n * bb, gbps=round(pin[i], 3), baseline_gbps=round(pin[i], 3), ratio=1.0,
                           ok=None, note=f"{direction}: one copy; pageable {page[i]:.2f} GB/s")
            piece = bb // shape.layers
            g = self.pieces_gbps(n * bb, piece, src_dev, pinned_host)
            self.r.add("perf", layout=f"copies-{piece >> 10}k", dtype="uint8", n=n, bytes=n * bb, gbps=round(g, 3),
                       baseline_gbps=round(pin[0], 3), ratio=round(g / pin[0], 3), ok=None,
                       note=f"d2h: {n * shape.layers} copies of {piece} bytes")
            if 2 * n <= shape.blocks:
                g = self.proto_blhnc(n, pinned_host)
                self.r.add("perf", layout="proto-BL", dtype="bf16", n=n, bytes=n * bb, gbps=round(g, 3),
                           baseline_gbps=round(pin[0], 3), ratio=round(g / pin[0], 3), ok=None,
                           note="d2h: BLHNC target, one copy per block, no kernel")
        del src_dev, pinned_host, pageable
        for layout in ("LBNHC", "BLHNC"):
            if self.r.over_budget():
                self.r.add("perf", layout=layout, ok=None, note="skipped: time budget spent")
                continue
            self.perf_layout(layout, base)

    def _slab(self, fp: TierFingerprint, block_bytes: int, slots: int) -> ShmSlab | None:
        """The agent's ``/dev/shm`` file when it has room (CUDA), else None (a local slab)."""
        if not self.cuda:
            return None
        need = slots * block_bytes
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return None
        if st.f_bavail * st.f_frsize < need * 1.25:
            return None
        return ShmSlab.create(Path("/dev/shm") / f"kvroute-gpu-check-perf-{os.getpid()}", fp.digest(), block_bytes, slots)

    def perf_layout(self, layout: str, base: dict[int, tuple[float, float]]) -> None:
        shape = self.shape
        max_n = max(self.perf_n)
        views = self.views(layout, torch.bfloat16, shape)
        kv = PagedKV(views, shape.blocks, [f"layers.{i}" for i in range(shape.layers)])
        fp = fingerprint(kv, torch.bfloat16, shape.block_size)
        slab = self._slab(fp, kv.block_bytes, max_n)
        t0 = time.monotonic()
        w = TierWorker(kv, max_n, fp, shm=slab)
        reg_ms = (time.monotonic() - t0) * 1e3
        self.pinned_slab = w.pinned
        self.slab_kind = "shm" if slab is not None else "local"
        self.r.add("perf", layout=layout, dtype="bf16", n=max_n, bytes=max_n * kv.block_bytes, host_ms=round(reg_ms, 2),
                   ok=None, note=f"TierWorker setup ({self.slab_kind} slab, pinned={w.pinned}, all_layers={kv.all_layers})")
        planner = TierPlanner(max_n)
        try:
            for n in self.perf_n:
                if self.r.over_budget():
                    self.r.add("perf", layout=layout, n=n, ok=None, note="skipped: time budget spent")
                    continue
                S, D = list(range(n)), list(range(max_n, max_n + n))
                nbytes = n * kv.block_bytes
                saves, loads, blocked = [], [], []
                for rep in range(4):  # 1 warm-up + 3
                    keys = self.keys(w, n)
                    ops = plan_saves(planner, keys, S)
                    host, gpu, tot = self._timed(lambda: w.run_saves(ops))
                    w.flush()
                    lops, _ = planner.plan_load(keys, D)
                    lhost, lgpu, ltot = self._timed(lambda: w.run_loads(lops))
                    w.flush()
                    if rep:
                        saves.append((host, gpu, tot))
                        loads.append((lhost, lgpu, ltot))
                    if self.cuda and rep:
                        keys2 = self.keys(w, n)
                        ops2 = plan_saves(planner, keys2, S)
                        self.sync()
                        self.busy(20)
                        t1 = time.monotonic()
                        w.run_saves(ops2)
                        blocked.append((time.monotonic() - t1) * 1e3)
                        self.sync()
                        w.flush()
                old_save, old_load = self.old_pattern(kv, w.slab, S, D)
                for what, g in (("save", old_save), ("load", old_load)):
                    b = base.get(n, (None, None))[0 if what == "save" else 1]
                    self.r.add("perf", layout=f"old-{layout}", dtype="bf16", n=n, bytes=nbytes, gbps=round(g, 3),
                               baseline_gbps=round(b, 3) if b else None, ratio=round(g / b, 3) if b else None,
                               ok=None, note=f"{what}: the copy pattern before the byte path, wall clock")
                for what, rows, bi in (("save", saves, 0), ("load", loads, 1)):
                    host = min(r[0] for r in rows)
                    gpu = min(r[1] for r in rows) if self.cuda else None
                    eff = gpu if gpu is not None else min(r[2] for r in rows)
                    gbps = nbytes / (eff * 1e-3) / 1e9
                    b = base.get(n, (None, None))[bi]
                    self.r.add("perf", layout=layout, dtype="bf16", n=n, bytes=nbytes, host_ms=round(host, 3),
                               gpu_ms=round(gpu, 3) if gpu is not None else None, gbps=round(gbps, 3),
                               baseline_gbps=round(b, 3) if b else None, ratio=round(gbps / b, 3) if b else None,
                               ok=None, note=f"{what}: run_{what}s, best of 3")
                if blocked:
                    self.r.add("perf", layout=layout, dtype="bf16", n=n, bytes=nbytes, host_ms=round(min(blocked), 3),
                               ok=None, note="save host-blocked time with a 20 ms forward queued on main "
                                             f"(without: {min(r[0] for r in saves):.3f} ms)")
        finally:
            w.close()
            if slab is not None:
                slab.unlink()
                slab.close()

    def old_pattern(self, kv: PagedKV, slab: torch.Tensor, S: list[int], D: list[int]) -> tuple[float, float]:
        """GB/s of the connector's copies before the byte path (commit 83737a8's
        ``_copy_to_slab``/``_copy_from``), on the same blocks and slab: per layer an
        ``index_select``, a synchronous copy into pageable memory and a host scatter into the slab;
        loads a host gather, a copy from pageable memory and an ``index_copy_``. Wall clock: the
        pattern blocks the host. ``(save, load)``."""
        n = len(S)
        pages = kv._pages
        slab_kv = slab[:n].view(n, kv.num_layers, -1)
        rows = torch.arange(n)
        src = torch.tensor(S, device=self.device)
        dst = torch.tensor(D, device=self.device)

        def save() -> None:
            for layer, page in enumerate(pages):
                slab_kv[rows, layer] = page.index_select(0, src).reshape(n, -1).to("cpu")

        def load() -> None:
            for layer, page in enumerate(pages):
                data = slab_kv[rows, layer].reshape(n, *page.shape[1:])
                page.index_copy_(0, dst, data.to(self.device, non_blocking=True))

        nbytes = n * kv.block_bytes
        return self.best_gbps(nbytes, save, wall=True), self.best_gbps(nbytes, load, wall=True)

    # ---- env ----
    def env(self) -> dict:
        st = None
        with contextlib.suppress(OSError):
            s = os.statvfs("/dev/shm")
            st = s.f_bavail * s.f_frsize
        return {"torch": torch.__version__, "device_name": torch.cuda.get_device_name(self.device) if self.cuda
                else platform.processor() or platform.machine(), "uname_r": platform.release(),
                "slab": self.slab_kind, "slab_pinned": self.pinned_slab, "dev_shm_free": st,
                "threads": torch.get_num_threads(), "model": self.shape.__dict__}

    def run(self) -> None:
        for name in ("a", "b", "c", "d", "e", "f", "g", "h", "perf"):
            if self.r.over_budget():
                self.r.add(name.upper(), ok=None, note="skipped: time budget spent")
                continue
            try:
                getattr(self, "section_" + name)()
            except Exception as exc:  # a section that could not even set up
                traceback.print_exc(limit=5)
                self.r.add(name.upper(), ok=False, note=f"section failed: {type(exc).__name__}: {exc}"[:400])


def print_table(rows: list[dict]) -> None:
    cols = ("section", "layout", "dtype", "n", "bytes", "host_ms", "gpu_ms", "gbps", "baseline_gbps", "ratio", "ok")
    print()
    print(" | ".join(f"{c:>9}" for c in cols) + " | note")
    for r in rows:
        if r["section"] == "env":
            continue
        cells = ["" if r.get(c) is None else str(r.get(c)) for c in cols]
        print(" | ".join(f"{c[:9]:>9}" for c in cells) + " | " + str(r.get("note") or "")[:90])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip the remaining sections after this")
    ap.add_argument("--tiny", action="store_true", help="CPU only: the smallest sizes (the test's run)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        torch.set_num_threads(1)  # as vLLM's worker runs (and steadier timings on a small VM)
    report = Report(args.out, args.budget_s)
    work = Path(tempfile.mkdtemp(prefix="kvroute-gpu-check-"))
    check = Check(args.device, report, args.tiny and args.device == "cpu", work)
    env = report.add("env", ok=None, note="environment", **check.env())  # again at the end, with the slab
    try:
        check.run()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        env.update(check.env())
        report.rows[0] = env
        report.add("done", ok=None, note=f"{report.failed} correctness failures; "
                                         f"{time.monotonic() - report.start:.1f} s")
    print_table(report.rows)
    print(f"\nenv: {json.dumps(check.env(), default=str)}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
