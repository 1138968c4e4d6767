"""tools/kv_views.py builds the per-layer KV views vLLM 0.32 builds: compared with vLLM's own
``vllm.v1.kv_cache_interface.create_kv_cache_views`` (shape, strides, dtype, data pointer and
storage offset of every layer) for every ``KVCacheLayout``, bf16 and uint8 (fp8) caches, with and
without kernel-block splitting, and an MLA spec. The only test here that imports vLLM.

The ``KVCacheTensor`` is made as ``vllm/v1/core/kv_cache_utils.py``
(``get_kv_cache_config_from_groups``) makes it for one group: ``compute_layout_strides`` over the
manager block, the block stride fixed to the whole block of all layers when the layout is
block-outermost.
"""
from __future__ import annotations

import pytest
import torch

kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

import gpu_check_connector as gc  # noqa: E402
import kv_views  # noqa: E402
from offload_agent.connector.kv_copy import PagedKV  # noqa: E402
from offload_agent.connector.worker_ops import TierWorker  # noqa: E402
from offload_agent.tiers.planner import TierPlanner  # noqa: E402

LAYERS, BLOCKS = 3, 5
CASES = [  # (spec kind, block size, kernel block size or None)
    ("full", 16, None),
    ("full", 32, 16),
    ("mla", 16, None),
    ("mla", 128, 64),  # FlashMLA: 64-token kernel blocks
]


def _spec(kind: str, block_size: int, dtype: torch.dtype):
    if kind == "mla":
        return kv_iface.MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=dtype)
    return kv_iface.FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=64, dtype=dtype)


def _vllm_views(layout: KVCacheLayout, spec, kernel: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM's views over a fresh buffer (the buffer is returned too, for our builder)."""
    page = spec.page_size_bytes
    fixed_block = LAYERS * page if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = kv_iface.compute_layout_strides(
        spec, BLOCKS, LAYERS, layout, fixed_strides=(None, fixed_block, None, None, None))
    size = LAYERS * BLOCKS * page
    tensor = kv_iface.KVCacheTensor(size=size, layers=[f"l{i}" for i in range(LAYERS)],
                                    layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return raw, kv_iface.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=kernel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "uint8"])
@pytest.mark.parametrize("kind,block_size,kernel", CASES, ids=[f"{k}-b{b}-k{kb}" for k, b, kb in CASES])
@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
def test_views_match_vllm(layout, kind, block_size, kernel, dtype):
    vl = KVCacheLayout[layout]
    assert kv_views.LAYOUTS[layout] == vl.value
    spec = _spec(kind, block_size, dtype)
    try:
        raw, theirs = _vllm_views(vl, spec, kernel)
    except ValueError as exc:  # vLLM refuses kernel-block splitting of non-dense pages
        assert kernel is not None and (not vl.is_layer_compact or vl is KVCacheLayout.LHBNC), exc
        with pytest.raises(ValueError):
            kv_views.kv_cache_views(torch.zeros(1, dtype=torch.int8), layout, LAYERS, BLOCKS, spec.num_heads,
                                    block_size, spec.state_content_size_bytes, dtype, kernel_block_size=kernel)
        return
    assert len(raw) >= kv_views.buffer_bytes(LAYERS, BLOCKS, spec.num_heads, block_size,
                                             spec.state_content_size_bytes)
    ours = kv_views.kv_cache_views(raw, layout, LAYERS, BLOCKS, spec.num_heads, block_size,
                                   spec.state_content_size_bytes, dtype, kernel_block_size=kernel)
    assert len(ours) == len(theirs) == LAYERS
    ratio = block_size // (kernel or block_size)
    for mine, vllm_view in zip(ours, theirs):
        assert vllm_view.shape[0] == BLOCKS * ratio
        assert mine.shape == vllm_view.shape
        assert mine.stride() == vllm_view.stride()
        assert mine.dtype == vllm_view.dtype == dtype
        assert mine.data_ptr() == vllm_view.data_ptr()
        assert mine.storage_offset() == vllm_view.storage_offset()


def test_kernel_split_refusals_are_the_layouts_vllm_refuses():
    """Which layouts vLLM refuses to split (so the byte path never sees them): the block-outermost
    ones and LHBNC, whose blocks are not dense pages."""
    spec = _spec("full", 32, torch.bfloat16)
    refused = []
    for vl in KVCacheLayout:
        try:
            _vllm_views(vl, spec, 16)
        except ValueError:
            refused.append(vl.name)
    assert sorted(refused) == ["BHLNC", "BLHNC", "BLNHC", "LHBNC"]


BYTE_CASES = [("LBNHC", None), ("LBHNC", None), ("BLHNC", None), ("BLNHC", None), ("LBNHC", 16), ("LBHNC", 16)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "uint8"])
def test_byte_path_on_vllms_own_views(dtype):
    """The byte path (TierWorker with planner operations) on views made by vLLM itself: every
    layout stores the same rows for the same logical content (equal to the hand-built reference)
    and round-trips them; with kernel-block splitting the rows are the kernel blocks in order."""
    gen = torch.Generator().manual_seed(3)
    spec = _spec("full", 32, dtype)
    S, D = [0, 3], [4, 1]
    content = torch.randint(0, 256, (LAYERS, len(S), spec.num_heads, 32, spec.state_content_size_bytes),
                            dtype=torch.uint8, generator=gen)
    rows = {}
    for layout, kernel in BYTE_CASES:
        _, views = _vllm_views(KVCacheLayout[layout], spec, kernel)
        kv = PagedKV(views, BLOCKS)
        pages = [gc.logical_pages(v, layout, BLOCKS) for v in views]
        written = content if kernel is None else content.unflatten(3, (2, 16)).transpose(2, 3)
        idx = torch.tensor(S)
        for layer, p in enumerate(pages):
            p[idx] = written[layer]
        w = TierWorker(kv, 4, gc.fingerprint(kv, dtype, 32))
        planner = TierPlanner(4)
        keys = gc.chain_keys(w.store.fingerprint, len(S), 32, 1)
        ops = gc.plan_saves(planner, keys, S)
        w.run_saves(ops)
        w.flush()
        got = w.slab[[op.slot for op in ops]].clone()
        assert torch.equal(got, gc.reference_rows(written)), (layout, kernel)
        rows[(layout, kernel)] = got
        gc.zero_blocks(views, layout, BLOCKS, D)
        lops, _ = planner.plan_load(keys, D)
        w.run_loads(lops)
        w.flush()
        assert w.take_invalid_blocks() == set()
        assert torch.equal(gc.read_blocks(views, layout, BLOCKS, D), written), (layout, kernel)
    unsplit = [r for (lay, k), r in rows.items() if k is None]
    assert all(torch.equal(r, unsplit[0]) for r in unsplit)
    assert torch.equal(rows[("LBNHC", 16)], rows[("LBHNC", 16)])
