"""vLLM 0.32's KV cache views, built with torch alone (no vLLM): what a KV connector's
``register_kv_caches`` receives on CUDA, for the layout byte path's tests and the GPU check.

vLLM allocates one ``int8`` buffer per KV cache group and views each layer as a logical
``[B, H, N, C]`` tensor (blocks, KV heads, tokens per kernel block, K and V concatenated in bytes),
with byte strides from a physical order of ``[L, B, H, N, C]`` assigned innermost first
(``vllm/v1/kv_cache_interface.py``: ``compute_layout_strides``, ``create_kv_cache_views``;
the orders are ``vllm/v1/kv_cache_layout.py``'s ``KVCacheLayout``). With kernel-block splitting a
manager block of ``block_size`` tokens is ``block_size // kernel_block_size`` kernel blocks, so
the view has that many times more rows. ``tests/torch/test_kv_views_fidelity.py`` checks these
against vLLM's own function (shape, strides, data pointer) in vLLM's interpreter.
"""
from __future__ import annotations

import math

import torch

LAYOUTS = {  # physical order of the logical axes (L, B, H, N, C) = (0, 1, 2, 3, 4)
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_strides(layout: str, shape: tuple[int, int, int, int, int]) -> tuple[int, ...]:
    """Byte strides of the logical axes ``(L, B, H, N, C)`` of ``shape`` for ``layout``."""
    strides = [0] * 5
    step = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def kv_cache_views(raw: torch.Tensor, layout: str, num_layers: int, num_blocks: int, num_heads: int,
                   block_size: int, content_bytes: int, dtype: torch.dtype,
                   kernel_block_size: int | None = None) -> list[torch.Tensor]:
    """Per-layer views of ``raw`` (``int8``, at least :func:`buffer_bytes`) as vLLM 0.32 makes
    them: ``[num_blocks * r, num_heads, kernel_block_size, content_bytes / itemsize]`` of
    ``dtype``, with ``r = block_size // kernel_block_size`` (1 without splitting).
    ``content_bytes``: K and V of one token and head, in bytes (``2 * head_size * itemsize``;
    MLA: the latent's bytes). Raises ValueError, as vLLM does, for a kernel block size that does
    not divide ``block_size`` or splitting in a layout whose blocks are not dense pages."""
    kbs = kernel_block_size or block_size
    if block_size % kbs:
        raise ValueError(f"kernel block size {kbs} does not divide block size {block_size}")
    page = num_heads * block_size * content_bytes
    if kbs != block_size and layout_strides(layout, (num_layers, num_blocks, num_heads, block_size,
                                                     content_bytes))[1] != page:
        # vLLM splits a block into kernel blocks only when it is one dense page
        # (create_kv_cache_views): not in block-outermost layouts, nor LHBNC
        raise ValueError(f"layout {layout} does not store blocks as dense pages: "
                         f"no kernel-block splitting ({block_size} into {kbs})")
    shape = (num_layers, num_blocks * (block_size // kbs), num_heads, kbs, content_bytes)
    whole = torch.as_strided(raw, size=shape, stride=layout_strides(layout, shape),
                             storage_offset=raw.storage_offset())
    return [whole[layer].view(dtype) for layer in range(num_layers)]


def buffer_bytes(num_layers: int, num_blocks: int, num_heads: int, block_size: int, content_bytes: int) -> int:
    """Bytes of the buffer behind :func:`kv_cache_views`."""
    return math.prod((num_layers, num_blocks, num_heads, block_size, content_bytes))
