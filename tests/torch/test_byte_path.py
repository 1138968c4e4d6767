"""The connector's byte path on CPU: ``PagedKV``/``BlockCopier`` (kv_copy.py), ``TierWorker``
(worker_ops.py) executing real ``TierPlanner`` operations, and ``host_memory.register``.

KV caches are built as vLLM 0.32 builds them (``tools/kv_views.py``; the same views as vLLM's own
``create_kv_cache_views``, ``test_kv_views_fidelity.py``) plus the legacy ``(2, B, N, H, D)`` and
``(B, 2, N, H, D)`` per-layer tensors; helpers from ``tools/gpu_check_connector.py``. Every check
compares bytes: a round trip saves blocks S, zeroes blocks D, loads into D and compares the
``uint8`` logical views per layer; stored rows are compared with a reference built by hand (per
block: each layer's logical page, layers in order).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import gpu_check_connector as gc
import kv_views
from offload_agent.connector import host_memory
from offload_agent.connector.kv_copy import BlockCopier, LayoutError, PagedKV
from offload_agent.connector import worker_ops
from offload_agent.connector.worker_ops import TierWorker
from offload_agent.tiers.ops import DropSsd, LoadCpu, LoadPeer, LoadSsd, Promote, Save, Spill, TierOp
from offload_agent.tiers.planner import TierPlanner
from offload_agent.tiers.shm_slab import ShmSlab
from offload_agent.tiers.ssd_file import CorruptBlockError, block_path, read_block_file

SHAPE = gc.Shape(layers=3, blocks=40, heads=2, head_size=16, block_size=8)
LAYOUTS = [*kv_views.LAYOUTS, *gc.LEGACY]
DTYPES = {"bf16": torch.bfloat16, "uint8": torch.uint8, "fp8e4m3": torch.float8_e4m3fn, "f16": torch.float16}
DEADLINE_S = 20.0
torch.set_num_threads(1)  # as vLLM's workers run; the copies are small, and the CI VM has 2 cores


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def _worker(views, dtype, shape=SHAPE, slots=16, ssd=None, tp_rank=0, tp_size=1, **kw) -> TierWorker:
    kv = PagedKV(views, shape.blocks, [f"layers.{i}" for i in range(len(views))])
    return TierWorker(kv, slots, gc.fingerprint(kv, dtype, shape.block_size, tp_rank, tp_size), ssd_dir=ssd, **kw)


def _save(worker: TierWorker, planner: TierPlanner, blocks: list[int], seed: int) -> tuple[list[bytes], list[TierOp]]:
    keys = gc.chain_keys(worker.store.fingerprint, len(blocks), SHAPE.block_size, seed)
    ops = gc.plan_saves(planner, keys, blocks)
    worker.run_saves(ops)
    worker.flush()
    return keys, ops


def _load(worker: TierWorker, planner: TierPlanner, keys: list[bytes], blocks: list[int]) -> list[TierOp]:
    ops, _ = planner.plan_load(keys, blocks)
    worker.run_loads(ops)
    worker.flush()
    return ops


def _round_trip(views, layout: str, w: TierWorker, S: list[int], D: list[int], seed: int, gen):
    """Fill S, save it through the planner's operations (rows checked against the reference), zero
    D, load into D (bytes checked); returns ``(content, keys, save ops, load ops)``."""
    planner = TierPlanner(16)
    content = gc.fill(views, layout, SHAPE.blocks, S, gen)
    keys, ops = _save(w, planner, S, seed)
    assert torch.equal(w.slab[[op.slot for op in ops]], gc.reference_rows(content))
    gc.zero_blocks(views, layout, SHAPE.blocks, D)
    lops = _load(w, planner, keys, D)
    assert w.take_invalid_blocks() == set() and w.take_failures() == []
    assert torch.equal(gc.read_blocks(views, layout, SHAPE.blocks, D), content)
    return content, keys, ops, lops


def _wait_finished(worker: TierWorker, req_id: str) -> tuple[set[str], set[int]]:
    """Poll ``finished_loads`` until ``req_id`` is reported (deadline): ``(done, invalid)`` of that call."""
    end = time.monotonic() + DEADLINE_S
    cond = threading.Event()
    while time.monotonic() < end:
        done = worker.finished_loads()
        if req_id in done:
            return done, worker.take_invalid_blocks()
        cond.wait(0.002)
    raise AssertionError(f"{req_id} not finished within {DEADLINE_S} s")


# ---- the layout x dtype matrix ---------------------------------------------------------------------------
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copier_round_trip(layout, dname, gen):
    """PagedKV + BlockCopier alone: blocks S to scattered host rows (runs of consecutive rows and
    single ones), rows equal to the reference, back into D byte-identical; other blocks untouched."""
    dtype = DTYPES[dname]
    views = gc.build_kv(SHAPE, layout, dtype)
    kv = PagedKV(views, SHAPE.blocks)
    content_bytes = SHAPE.content_bytes(dtype)
    assert kv.block_bytes == SHAPE.layers * SHAPE.heads * SHAPE.block_size * content_bytes
    assert kv.all_layers
    if layout in kv_views.LAYOUTS:
        assert kv.page_shape == (SHAPE.heads, SHAPE.block_size, content_bytes)
    else:
        assert kv.page_shape == (2, SHAPE.block_size, SHAPE.heads, SHAPE.head_size * dtype.itemsize)
    S, rows, D = [5, 9, 2, 30, 31, 7], [4, 5, 6, 0, 9, 2], [11, 12, 13, 20, 21, 39]
    content = gc.fill(views, layout, SHAPE.blocks, S, gen)
    others = [b for b in range(SHAPE.blocks) if b not in D]
    before = gc.read_blocks(views, layout, SHAPE.blocks, others)
    host = torch.zeros((10, kv.block_bytes), dtype=torch.uint8)
    copier = BlockCopier(kv)
    assert copier.save(S, rows, host) is None  # CPU: done
    assert torch.equal(host[rows], gc.reference_rows(content))
    assert not host[[1, 3, 8]].any()
    gc.zero_blocks(views, layout, SHAPE.blocks, D)
    assert copier.load(rows, D, host) is None
    assert torch.equal(gc.read_blocks(views, layout, SHAPE.blocks, D), content)
    assert torch.equal(gc.read_blocks(views, layout, SHAPE.blocks, others), before)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_worker_round_trip(layout, dname, gen):
    """TierWorker running the planner's save and load_cpu operations."""
    dtype = DTYPES[dname]
    views = gc.build_kv(SHAPE, layout, dtype)
    w = _worker(views, dtype)
    S, D = [0, 1, 2, 3, 8, 9], [16, 17, 18, 19, 24, 25]
    _, keys, ops, lops = _round_trip(views, layout, w, S, D, 1, gen)
    assert [type(op) for op in ops] == [Save] * 6 and [op.gpu_block for op in ops] == S
    slots = [op.slot for op in ops]
    assert all(w.store.holds(s, k) for s, k in zip(slots, keys))
    assert [(type(op), op.slot, op.gpu_block) for op in lops] == [(LoadCpu, s, d) for s, d in zip(slots, D)]
    w.close()


def test_stored_bytes_do_not_depend_on_the_layout(gen):
    """Same logical content in all six layouts: identical slab rows, equal to the hand-built
    reference (per block: layer pages in order, each the logical [H, N, C] bytes)."""
    S = [3, 4, 5, 10]
    content = torch.randint(0, 256, (SHAPE.layers, len(S), SHAPE.heads, SHAPE.block_size,
                                     SHAPE.content_bytes(torch.bfloat16)), dtype=torch.uint8, generator=gen)
    by_hand = torch.stack([torch.cat([content[layer, i].flatten() for layer in range(SHAPE.layers)])
                           for i in range(len(S))])
    assert torch.equal(gc.reference_rows(content), by_hand)
    for layout in kv_views.LAYOUTS:
        views = gc.build_kv(SHAPE, layout, torch.bfloat16)
        gc.fill(views, layout, SHAPE.blocks, S, gen, content=content)
        w = _worker(views, torch.bfloat16)
        _, ops = _save(w, TierPlanner(16), S, 2)
        assert torch.equal(w.slab[[op.slot for op in ops]], by_hand), layout
        w.close()


def test_cross_layout_load(gen):
    """Saved from an LBNHC cache (Hopper), loaded into LBHNC and BLHNC caches: same fingerprint,
    same logical bytes."""
    S, D = [0, 1, 2, 3], [30, 31, 32, 33]
    src = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    content = gc.fill(src, "LBNHC", SHAPE.blocks, S, gen)
    ws = _worker(src, torch.bfloat16)
    planner = TierPlanner(16)
    keys, ops = _save(ws, planner, S, 3)
    for layout in ("LBHNC", "BLHNC"):
        dst = gc.build_kv(SHAPE, layout, torch.bfloat16)
        wd = _worker(dst, torch.bfloat16)
        assert wd.store.fingerprint == ws.store.fingerprint
        wd.slab.copy_(ws.slab)
        for op in ops:
            wd.store.mark(op.slot, op.key)
        _load(wd, planner, keys, D)
        assert wd.take_invalid_blocks() == set()
        assert torch.equal(gc.read_blocks(dst, layout, SHAPE.blocks, D), content), layout


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_block_split_round_trip(layout, gen):
    """A 8-token manager block split into two 4-token kernel blocks: views of B * 2 rows, pages
    ``[2, H, 4, C]``, round trip through the worker."""
    views = gc.build_kv(SHAPE, layout, torch.bfloat16, kernel_block_size=4)
    assert views[0].shape == (SHAPE.blocks * 2, SHAPE.heads, 4, 2 * SHAPE.head_size)
    w = _worker(views, torch.bfloat16)
    assert w.kv.page_shape == (2, SHAPE.heads, 4, SHAPE.content_bytes(torch.bfloat16))
    assert w.kv.block_bytes == SHAPE.block_bytes(torch.bfloat16)
    _round_trip(views, layout, w, [1, 3, 5], [2, 4, 6], 4, gen)
    assert torch.equal(gc.read_blocks(views, layout, SHAPE.blocks, [0, 7]),
                       torch.zeros_like(gc.read_blocks(views, layout, SHAPE.blocks, [0, 7])))


@pytest.mark.parametrize("kernel", [None, 4])
def test_mla_like_round_trip(kernel, gen):
    """MLA: one latent "head" of 576 bf16 per token (``[B, 1, N, 1152 bytes]``), also with
    kernel-block splitting (as FlashMLA's 64-token kernel blocks under a larger block)."""
    mla = gc.Shape(layers=2, blocks=SHAPE.blocks, heads=1, head_size=288, block_size=SHAPE.block_size)
    views = gc.build_kv(mla, "LBNHC", torch.bfloat16, kernel_block_size=kernel)
    assert views[0].shape[1:] == (1, kernel or mla.block_size, 576)
    w = _worker(views, torch.bfloat16, mla)
    assert w.kv.block_bytes == 2 * mla.block_size * 1152
    _round_trip(views, "LBNHC", w, [1, 2, 3], [10, 11, 12], 17, gen)


@pytest.mark.parametrize("layout", ["2BNHD", "LBNHC"])
def test_layers_in_separate_allocations(layout, gen):
    """Layers that do not share one allocation: no all-layer view (per-layer copies), same rows."""
    if layout == "2BNHD":
        views = gc.build_kv(SHAPE, layout, torch.bfloat16, separate=True)
    else:
        one = gc.Shape(1, SHAPE.blocks, SHAPE.heads, SHAPE.head_size, SHAPE.block_size)
        views = [gc.build_kv(one, layout, torch.bfloat16)[0] for _ in range(SHAPE.layers)]
    w = _worker(views, torch.bfloat16)
    assert w.kv.all_layers is False
    _round_trip(views, layout, w, [2, 3, 4, 9], [12, 13, 14, 19], 5, gen)


def test_refused_views():
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    with pytest.raises(LayoutError, match="does not hold 7 blocks"):
        PagedKV(views, 7)
    other = gc.build_kv(gc.Shape(1, SHAPE.blocks, SHAPE.heads + 1, SHAPE.head_size, SHAPE.block_size),
                        "LBNHC", torch.bfloat16)
    with pytest.raises(LayoutError, match="page shape"):
        PagedKV([views[0], other[0]], SHAPE.blocks)


# ---- TP ------------------------------------------------------------------------------------------------
def test_tp_pair_each_rank_its_own_heads(tmp_path, gen):
    """Two ranks, each half the heads of one logical KV: same plan, each slab and SSD file holds
    its own head slice, fingerprints and folders differ, cross-rank reads are refused."""
    full_heads = 4
    half = gc.Shape(SHAPE.layers, SHAPE.blocks, full_heads // 2, SHAPE.head_size, SHAPE.block_size)
    S, D = [0, 1, 2, 3, 4], [20, 21, 22, 23, 24]
    content = torch.randint(0, 256, (half.layers, len(S), full_heads, half.block_size,
                                     half.content_bytes(torch.bfloat16)), dtype=torch.uint8, generator=gen)
    ranks = []
    for r in range(2):
        views = gc.build_kv(half, "LBNHC", torch.bfloat16)
        heads = slice(2 * r, 2 * r + 2)
        gc.fill(views, "LBNHC", half.blocks, S, gen, heads=heads, content=content)
        ranks.append((views, heads, _worker(views, torch.bfloat16, half, slots=2, ssd=tmp_path, tp_rank=r, tp_size=2)))
    fp0, fp1 = (w.store.fingerprint for _, _, w in ranks)
    assert fp0.digest() != fp1.digest() and fp0.engine_digest() == fp1.engine_digest()
    planner = TierPlanner(2, 8)
    keys = gc.chain_keys(fp0, len(S), half.block_size, 6)
    assert keys == gc.chain_keys(fp1, len(S), half.block_size, 6)  # one key names the block in every shard
    ops = gc.plan_saves(planner, keys, S)
    spilled = [op.key for op in ops if isinstance(op, Spill)]
    assert len(spilled) == 3
    for _, _, w in ranks:
        w.run_saves(ops)
        w.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fp0.dir_name(), fp1.dir_name()])
    for r, (views, heads, w) in enumerate(ranks):
        for op in ops:
            if isinstance(op, Save) and w.store.holds(op.slot, op.key):
                i = keys.index(op.key)
                assert torch.equal(w.slab[op.slot], gc.reference_rows(content[:, i:i + 1, heads])[0])
        for key in spilled:  # the SSD file holds this rank's heads
            i = keys.index(key)
            out = bytearray(w.kv.block_bytes)
            read_block_file(w.store.fp_dir, key, w.store.fingerprint.digest(), out)
            assert bytes(out) == gc.reference_rows(content[:, i:i + 1, heads])[0].numpy().tobytes()
    with pytest.raises(CorruptBlockError, match="fingerprint differs"):
        read_block_file(ranks[0][2].store.fp_dir, spilled[0], fp1.digest(), bytearray(ranks[1][2].kv.block_bytes))
    lops, tiers = planner.plan_load(keys, D)
    assert "ssd" in tiers and "cpu" in tiers
    for views, heads, w in ranks:
        gc.zero_blocks(views, "LBNHC", half.blocks, D)
        w.run_loads(lops)
        w.flush()
        assert w.take_invalid_blocks() == set()
        assert torch.equal(gc.read_blocks(views, "LBNHC", half.blocks, D), content[:, :, heads])


# ---- SSD and staging ---------------------------------------------------------------------------------
def _ssd_setup(tmp_path, gen, slots=3, extra=True):
    """A chain of 6 blocks (and, with ``extra``, one unrelated block after it) saved with ``slots``
    CPU slots: the chain's head spills to SSD."""
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    w = _worker(views, torch.bfloat16, slots=slots, ssd=tmp_path)
    planner = TierPlanner(slots, 16)
    chain = [0, 1, 2, 3, 4, 5]
    content = gc.fill(views, "LBNHC", SHAPE.blocks, chain, gen)
    keys, ops = _save(w, planner, chain, 7)
    if extra:
        gc.fill(views, "LBNHC", SHAPE.blocks, [6], gen)
        _save(w, planner, [6], 8)
    return views, w, planner, keys, ops, content


def test_ssd_spill_promote_load_ssd_round_trip(tmp_path, gen):
    views, w, planner, keys, ops, content = _ssd_setup(tmp_path, gen)
    assert [type(op) for op in ops].count(Spill) == 3
    assert [planner.tier_of(k) for k in keys] == ["ssd"] * 4 + ["cpu"] * 2
    D = [30, 31, 32, 33, 34, 35]
    gc.zero_blocks(views, "LBNHC", SHAPE.blocks, D)
    lops = _load(w, planner, keys, D)
    kinds = [type(op) for op in lops]
    assert kinds[:3] == [Spill, Promote, LoadCpu] and LoadSsd in kinds and kinds[-1] == LoadCpu
    assert w.take_invalid_blocks() == set() and w.take_failures() == []
    assert torch.equal(gc.read_blocks(views, "LBNHC", SHAPE.blocks, D), content)


def _corrupt(w: TierWorker, key: bytes):
    path = block_path(w.store.fp_dir, key)
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x5A
    path.write_bytes(bytes(raw))
    return path


def test_corrupted_promoted_file_is_exactly_one_invalid_block(tmp_path, gen):
    """The corrupted file is the one promoted into a CPU slot: that block is invalid, its SSD and
    CPU copies are reported, the planner forgets both; the rest loads."""
    views, w, planner, keys, _, content = _ssd_setup(tmp_path, gen)
    path = _corrupt(w, keys[0])
    D = [30, 31, 32, 33, 34, 35]
    gc.zero_blocks(views, "LBNHC", SHAPE.blocks, D)
    lops = _load(w, planner, keys, D)
    promote = next(op for op in lops if isinstance(op, Promote))
    assert promote.key == keys[0]
    assert w.take_invalid_blocks() == {D[0]}
    failures = w.take_failures()
    assert {(k, t) for k, t, _ in failures} == {(keys[0], "ssd"), (keys[0], "cpu")}
    assert {s for _, t, s in failures if t == "cpu"} == {promote.slot}
    for key, tier, slot in failures:
        planner.forget(key, tier, slot)
    assert planner.tier_of(keys[0]) is None and not path.exists()
    assert torch.equal(gc.read_blocks(views, "LBNHC", SHAPE.blocks, D[1:]), content[:, 1:])


def test_corrupted_ssd_file_is_exactly_one_invalid_block(tmp_path, gen):
    views, w, planner, keys, _, content = _ssd_setup(tmp_path, gen)
    bad = 2  # on SSD only, read by load_ssd
    path = _corrupt(w, keys[bad])
    D = [30, 31, 32, 33, 34, 35]
    gc.zero_blocks(views, "LBNHC", SHAPE.blocks, D)
    lops = _load(w, planner, keys, D)
    assert LoadSsd(keys[bad], D[bad]) in lops
    assert w.take_invalid_blocks() == {D[bad]}
    failures = w.take_failures()
    assert failures == [(keys[bad], "ssd", None)]
    for key, tier, slot in failures:
        planner.forget(key, tier, slot)
    assert planner.tier_of(keys[bad]) is None and not path.exists()
    good = [i for i in range(6) if i != bad]
    assert torch.equal(gc.read_blocks(views, "LBNHC", SHAPE.blocks, [D[i] for i in good]), content[:, good])
    assert not gc.read_blocks(views, "LBNHC", SHAPE.blocks, [D[bad]]).any()


# ---- asynchronous loads ------------------------------------------------------------------------------
def test_async_load_ssd(tmp_path, gen):
    views, w, planner, keys, _, content = _ssd_setup(tmp_path, gen, slots=2, extra=False)
    D = [30, 31, 32, 33, 34, 35]
    gc.zero_blocks(views, "LBNHC", SHAPE.blocks, D)
    lops, tiers = planner.plan_load(keys, D)
    assert tiers == ["ssd"] * 4 + ["cpu"] * 2
    ssd_ops = [op for op in lops if isinstance(op, LoadSsd)]
    assert [op.gpu_block for op in ssd_ops] == D[:4]
    w.start_async("req-1", ssd_ops)
    w.run_loads([op for op in lops if not isinstance(op, LoadSsd)])
    done, invalid = _wait_finished(w, "req-1")
    assert done == {"req-1"} and invalid == set()
    w.flush()
    assert torch.equal(gc.read_blocks(views, "LBNHC", SHAPE.blocks, D), content)
    assert w.finished_loads() == set()
    w.close()


class ShortPeer:
    """A fake ``pull``: hands back the first ``got`` of the asked blocks (their stored ``rows``) and
    says ``"deadline"`` for the rest; waits for ``release`` first; records each call."""

    def __init__(self, rows: torch.Tensor, got: int) -> None:
        self.rows, self.got = rows, got
        self.release = threading.Event()
        self.asked: list[tuple[str, list[bytes], int]] = []

    def __call__(self, peer: str, keys: list[bytes], into: memoryview) -> tuple[int, str]:
        self.asked.append((peer, list(keys), len(into)))
        self.release.wait(DEADLINE_S)
        bb = self.rows.shape[1]
        for i in range(self.got):
            into[i * bb:(i + 1) * bb] = self.rows[i].numpy().tobytes()
        return self.got, "deadline"


def _peer_case(gen, seed: int):
    views = gc.build_kv(SHAPE, "LBHNC", torch.bfloat16)
    content = gc.fill(views, "LBHNC", SHAPE.blocks, [1, 2, 3, 4, 5], gen)
    peer = ShortPeer(gc.reference_rows(content), 3)
    w = _worker(views, torch.bfloat16, pull=peer)
    keys = gc.chain_keys(w.store.fingerprint, 5, SHAPE.block_size, seed)
    return views, content, peer, w, keys


def _assert_short_load(views, content, D) -> None:
    assert torch.equal(gc.read_blocks(views, "LBHNC", SHAPE.blocks, D[:3]), content[:, :3])
    assert not gc.read_blocks(views, "LBHNC", SHAPE.blocks, D[3:]).any()


def test_async_peer_pull_short(gen):
    """A peer hands back 3 of 5 blocks: those 3 are loaded, the other 2 reported invalid in the
    same ``finished_loads`` call's step; nothing is reported before the pull returns."""
    views, content, peer, w, keys = _peer_case(gen, 9)
    D = [10, 11, 12, 13, 14]
    w.start_async("req-p", [LoadPeer("10.0.0.2:7000", keys, D)])
    assert w.finished_loads() == set() and w.take_invalid_blocks() == set()
    peer.release.set()
    done, invalid = _wait_finished(w, "req-p")
    assert done == {"req-p"} and invalid == {13, 14}
    assert peer.asked == [("10.0.0.2:7000", keys, 5 * w.kv.block_bytes)]
    assert w.take_short_pulls() == [("10.0.0.2:7000", keys[3])] and w.take_short_pulls() == []
    w.flush()
    _assert_short_load(views, content, D)
    w.close()


def test_a_pull_in_flight_holds_up_no_other_request(gen):
    """While one request's pull hangs, another request's CPU-tier load and a save run to the end
    in the step, and the hanging request is not reported until its pull returns."""
    views, content, peer, w, keys = _peer_case(gen, 11)
    planner = TierPlanner(8)
    other = gc.chain_keys(w.store.fingerprint, 2, SHAPE.block_size, 12)
    w.start_async("req-slow", [LoadPeer("p", keys, [10, 11, 12, 13, 14])])
    w.run_saves(gc.plan_saves(planner, other, [1, 2]))
    loads, _ = planner.plan_load(other, [20, 21])
    w.run_loads(loads)
    w.flush()
    assert torch.equal(gc.read_blocks(views, "LBHNC", SHAPE.blocks, [20, 21]), content[:, :2])
    assert w.finished_loads() == set() and w.take_invalid_blocks() == set()
    peer.release.set()
    assert _wait_finished(w, "req-slow")[0] == {"req-slow"}
    w.close()


def test_sync_peer_pull_short(gen):
    """The same short pull among the synchronous loads: 3 loaded, 2 invalid."""
    views, content, peer, w, keys = _peer_case(gen, 10)
    peer.release.set()
    D = [10, 11, 12, 13, 14]
    w.run_loads([LoadPeer("p", keys, D)])
    assert w.take_invalid_blocks() == {13, 14}
    assert w.take_short_pulls() == [("p", keys[3])]
    _assert_short_load(views, content, D)


# ---- host registration -------------------------------------------------------------------------------
class FakeRuntime:
    """host_register/host_unregister/clear_error recording their calls; registration ``fail_at``
    (1-based) returns CUDA error 2."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.cleared = 0

    def host_register(self, ptr: int, nbytes: int) -> int:
        self.registered.append((ptr, nbytes))
        return 2 if len(self.registered) == self.fail_at else 0

    def host_unregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def clear_error(self) -> None:
        self.cleared += 1


def test_register_whole_buffer_once_and_release():
    """One call for the whole buffer (a copy may not span two registrations), released through the
    same runtime."""
    t = torch.empty(3 << 20, dtype=torch.uint8)
    rt = FakeRuntime()
    reg = host_memory.register(t, rt=rt)
    base = t.data_ptr()
    assert reg.ok and reg.chunks == [(base, 3 << 20)]
    assert rt.registered == [(base, 3 << 20)] and rt.cleared == 0
    reg.release()
    assert rt.unregistered == [base] and reg.chunks == []


def test_register_failure_clears_the_error():
    """CUDA refuses: the error is cleared, nothing is left to unregister, ``ok`` is False."""
    t = torch.empty(5 * 4096, dtype=torch.uint8)
    rt = FakeRuntime(fail_at=1)
    reg = host_memory.register(t, rt=rt)
    assert rt.registered == [(t.data_ptr(), 5 * 4096)]
    assert rt.cleared == 1 and rt.unregistered == []
    assert reg.ok is False and reg.chunks == []
    reg.release()
    assert rt.unregistered == []


# ---- asynchronous copies: the hazards (gpu_readiness.md §6.5) ----------------------------------------
class FakeStream:
    """A CUDA side stream on CPU: copies run in order, only when an event is synchronized (or
    :meth:`run_all`); ``pending`` lists ``(event, host tensor, rows)`` of copies not yet run."""

    def __init__(self) -> None:
        self.queue: list[tuple["FakeEvent", object]] = []
        self.pending: list[tuple["FakeEvent", torch.Tensor, list[int]]] = []

    def enqueue(self, fn, host: torch.Tensor, rows: list[int]) -> "FakeEvent":
        ev = FakeEvent(self)
        self.queue.append((ev, fn))
        self.pending.append((ev, host, list(rows)))
        return ev

    def run_until(self, ev: "FakeEvent | None") -> None:
        while self.queue and (ev is None or not ev.done):
            e, fn = self.queue.pop(0)
            fn()
            e.done = True
            self.pending = [p for p in self.pending if p[0] is not e]

    def run_all(self) -> None:
        self.run_until(None)

    def busy_rows(self, host: torch.Tensor) -> set[int]:
        return {r for _, h, rows in self.pending if h.data_ptr() == host.data_ptr() for r in rows}


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.stream.run_until(self)


def _deferred_worker(views, slots, ssd=None, shm=None):
    """A TierWorker whose copies are deferred on a :class:`FakeStream`, and whose store checks that
    no host operation touches a slot with a pending copy (violations collected)."""
    w = _worker(views, torch.bfloat16, slots=slots, ssd=ssd, shm=shm)
    stream = FakeStream()
    real_save, real_load = w.copier.save, w.copier.load
    w.copier.save = lambda blocks, rows, host: stream.enqueue(
        lambda b=list(blocks), r=list(rows): real_save(b, r, host), host, rows)
    w.copier.load = lambda rows, blocks, host: stream.enqueue(
        lambda b=list(blocks), r=list(rows): real_load(r, b, host), host, rows)
    violations: list[str] = []
    store = w.store

    def guard(name, slot_of):
        real = getattr(store, name)

        def wrapped(*args):
            slot = slot_of(args)
            if slot in stream.busy_rows(w.slab):
                violations.append(f"{name}{args[:2]} with a copy pending on slot {slot}")
            return real(*args)
        setattr(store, name, wrapped)

    guard("spill_bytes", lambda a: a[0])
    guard("promote", lambda a: a[1])
    guard("put", lambda a: a[0])
    guard("mark", lambda a: a[0] if a[1] is not None else None)
    real_read = store.read_ssd

    def read_ssd(key, out):  # the one synchronous staging row must not be read by a pending copy
        if stream.busy_rows(w._sync_staging):
            violations.append("staging row reused while a copy reads it")
        return real_read(key, out)
    store.read_ssd = read_ssd
    return w, stream, violations


def test_resaved_slot_is_marked_with_the_newer_key_only(gen):
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    w, stream, violations = _deferred_worker(views, slots=1)
    planner = TierPlanner(1)
    a = gc.fill(views, "LBNHC", SHAPE.blocks, [1], gen)
    b = gc.fill(views, "LBNHC", SHAPE.blocks, [2], gen)
    ka = gc.chain_keys(w.store.fingerprint, 1, SHAPE.block_size, 11)
    kb = gc.chain_keys(w.store.fingerprint, 1, SHAPE.block_size, 12)
    w.run_saves(gc.plan_saves(planner, ka, [1]))
    assert w.holds(0, ka[0]) and not w.store.holds(0, ka[0])  # in flight: not marked
    ops = gc.plan_saves(planner, kb, [2])
    assert ops == [Save(0, kb[0], 2)]  # the same slot, A evicted (no SSD)
    w.run_saves(ops)
    assert w.holds(0, kb[0]) and not w.holds(0, ka[0])
    first = stream.pending[0][0]
    first.synchronize()  # A's copy completes: the slot must not be marked A
    w.poll()
    assert not w.store.holds(0, ka[0]) and not w.store.holds(0, kb[0])
    stream.run_all()
    w.poll()
    assert w.store.holds(0, kb[0]) and not w.store.holds(0, ka[0])
    assert torch.equal(w.slab[0], gc.reference_rows(b)[0]) and not torch.equal(w.slab[0], gc.reference_rows(a)[0])
    assert violations == []


def _evicting_save(w: TierWorker, views, gen, seed: int):
    """Blocks 1 and 2 filled, block 1 saved as A into ``w``'s one CPU slot; returns ``(a, b, ka,
    kb, ops)``: their contents, keys, and the operations saving block 2 as B (A's spill, B's save)."""
    planner = TierPlanner(1, 4)
    a = gc.fill(views, "LBNHC", SHAPE.blocks, [1], gen)
    b = gc.fill(views, "LBNHC", SHAPE.blocks, [2], gen)
    ka = gc.chain_keys(w.store.fingerprint, 1, SHAPE.block_size, seed)
    kb = gc.chain_keys(w.store.fingerprint, 1, SHAPE.block_size, seed + 1)
    w.run_saves(gc.plan_saves(planner, ka, [1]))
    ops = gc.plan_saves(planner, kb, [2])
    assert [type(op) for op in ops] == [Spill, Save]
    return a, b, ka, kb, ops


def test_spill_waits_for_the_pending_save(tmp_path, gen):
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    w, stream, violations = _deferred_worker(views, slots=1, ssd=tmp_path)
    a, _, ka, kb, ops = _evicting_save(w, views, gen, 13)
    w.run_saves(ops)
    assert violations == []
    w.flush()                                       # the file is written off the step
    out = bytearray(w.kv.block_bytes)
    read_block_file(w.store.fp_dir, ka[0], w.store.fingerprint.digest(), out)
    assert bytes(out) == gc.reference_rows(a)[0].numpy().tobytes()
    assert w.store.holds(0, kb[0])


def _gated_ssd_writes(w: TierWorker) -> threading.Event:
    """Hold every SSD write and deletion of ``w``'s writer thread until the returned event is set."""
    gate = threading.Event()
    store = w.store
    for name in ("write_ssd", "drop_ssd"):
        real = getattr(store, name)
        setattr(store, name, lambda *a, real=real: (gate.wait(30), real(*a))[1])
    return gate


def test_a_spill_leaves_the_step_and_a_load_of_its_block_waits_for_the_file(tmp_path, gen):
    """The disk holds the spill's write: the step still returns with the slot already reused by
    the save after it, and an asynchronous load of the spilled block, started meanwhile, reads the
    file once it is written: the right bytes."""
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    w = _worker(views, torch.bfloat16, slots=1, ssd=tmp_path)
    a, b, ka, kb, ops = _evicting_save(w, views, gen, 21)
    gate = _gated_ssd_writes(w)
    w.run_saves(ops)                                 # returns with the write held
    assert not block_path(w.store.fp_dir, ka[0]).exists()
    assert w.store.holds(0, kb[0]) and torch.equal(w.slab[0], gc.reference_rows(b)[0])
    gc.zero_blocks(views, "LBNHC", SHAPE.blocks, [30])
    w.start_async("r1", [LoadSsd(ka[0], 30)])
    assert w.finished_loads() == set()               # its read waits for the write
    gate.set()
    _, invalid = _wait_finished(w, "r1")
    w.flush()
    assert invalid == set() and w.take_failures() == []
    assert torch.equal(gc.read_blocks(views, "LBNHC", SHAPE.blocks, [30]), a)
    w.close()


def test_a_deletion_after_a_spill_of_the_same_block_runs_after_its_write(tmp_path, gen):
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    w = _worker(views, torch.bfloat16, slots=1, ssd=tmp_path)
    planner = TierPlanner(1, 4)
    gc.fill(views, "LBNHC", SHAPE.blocks, [1], gen)
    ka = gc.chain_keys(w.store.fingerprint, 1, SHAPE.block_size, 23)
    w.run_saves(gc.plan_saves(planner, ka, [1]))
    gate = _gated_ssd_writes(w)
    w.run_saves([Spill(0, ka[0]), DropSsd(ka[0])])
    gate.set()
    w.flush()
    assert not block_path(w.store.fp_dir, ka[0]).exists()   # deleted after it was written, not before
    assert w.take_failures() == []
    w.close()


def test_spilled_bytes_waiting_for_the_disk_are_bounded(tmp_path, gen, monkeypatch):
    """Beyond ``MAX_SSD_WRITE_BYTES`` held, a spill waits for the oldest writes."""
    monkeypatch.setattr(worker_ops, "MAX_SSD_WRITE_BYTES", 0)
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    w = _worker(views, torch.bfloat16, slots=1, ssd=tmp_path)
    a, _, ka, _, ops = _evicting_save(w, views, gen, 24)
    w.run_saves(ops)
    out = bytearray(w.kv.block_bytes)                # written within the step, no flush
    read_block_file(w.store.fp_dir, ka[0], w.store.fingerprint.digest(), out)
    assert bytes(out) == gc.reference_rows(a)[0].numpy().tobytes()
    w.close()


def test_promote_and_loads_wait_for_pending_copies(tmp_path, gen):
    """Saves still in flight when the next step's loads promote into their slots and load from
    them: every host operation on a slot waits for its copies, the staging row is not reused under
    a pending copy, and the bytes arrive whole."""
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    w, stream, violations = _deferred_worker(views, slots=2, ssd=tmp_path)
    planner = TierPlanner(2, 16)
    chain = [0, 1, 2, 3, 4]
    content = gc.fill(views, "LBNHC", SHAPE.blocks, chain, gen)
    keys = gc.chain_keys(w.store.fingerprint, 5, SHAPE.block_size, 15)
    w.run_saves(gc.plan_saves(planner, keys, chain))  # spills wait for the earlier saves
    other = gc.chain_keys(w.store.fingerprint, 2, SHAPE.block_size, 16)
    gc.fill(views, "LBNHC", SHAPE.blocks, [6, 7], gen)
    w.run_saves(gc.plan_saves(planner, other, [6, 7]))  # in flight
    assert stream.pending
    D = [30, 31, 32, 33, 34]
    gc.zero_blocks(views, "LBNHC", SHAPE.blocks, D)
    lops, _ = planner.plan_load(keys, D)
    kinds = [type(op) for op in lops]
    assert Promote in kinds and LoadSsd in kinds
    w.run_loads(lops)
    stream.run_all()
    w.poll()
    assert violations == []
    assert w.take_invalid_blocks() == set()
    assert torch.equal(gc.read_blocks(views, "LBNHC", SHAPE.blocks, D), content)


def test_agent_slab_publishes_a_slot_only_after_its_copy(tmp_path, gen):
    """With the agent's CPU tier file, a slot being written has no key in the slot table (the
    agent cannot serve it) until its copy completes; then the row holds the key and the slab the
    block's reference bytes, and the agent's consistent read returns them."""
    views = gc.build_kv(SHAPE, "LBNHC", torch.bfloat16)
    kv = PagedKV(views, SHAPE.blocks)
    fp = gc.fingerprint(kv, torch.bfloat16, SHAPE.block_size)
    slab = ShmSlab.create(tmp_path / "tier", fp.digest(), kv.block_bytes, 4)
    with pytest.raises(ValueError, match="4 slots"):
        TierWorker(kv, 5, fp, shm=slab)
    w, stream, violations = _deferred_worker(views, slots=4, shm=slab)
    content = gc.fill(views, "LBNHC", SHAPE.blocks, [3, 4], gen)
    keys = gc.chain_keys(fp, 2, SHAPE.block_size, 18)
    ops = gc.plan_saves(TierPlanner(4), keys, [3, 4])
    w.run_saves(ops)
    slots = [op.slot for op in ops]
    assert [slab.key_of(s) for s in slots] == [None, None] and slab.stable_slots() == []
    stream.run_all()
    w.poll()
    assert slab.stable_slots() == sorted(zip(slots, keys))
    out = bytearray(kv.block_bytes)
    for i, s in enumerate(slots):
        assert slab.read_consistent(s, keys[i], out)
        assert bytes(out) == gc.reference_rows(content)[i].numpy().tobytes()
    assert violations == []
    w.close()
    slab.close()
