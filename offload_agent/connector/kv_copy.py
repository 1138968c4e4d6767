"""vLLM's paged KV cache seen as rows of block bytes, and the copies between it and host memory.

Torch and the standard library only (no vLLM), so the byte path is tested on its own: on CPU in
``make test``, on a GPU by ``tools/gpu_check_connector.py``.

**The stored format.** A block's row is ``block_bytes`` = its pages of every layer of the group, in
layer order; each page is in vLLM's *logical* order, whatever the physical layout. In vLLM 0.32 every
attention backend's per-layer view is ``[B, H, N, C]`` (blocks, KV heads, tokens, K and V
concatenated; ``vllm/v1/kv_cache_interface.py`` ``create_kv_cache_views``), while the physical order
is a model-wide permutation of ``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``: LBNHC on
Hopper by default, LBHNC, BLHNC and BLNHC with FlashInfer on Blackwell). Gathering through the
logical view makes the stored bytes the same for every layout, so a block written by a Hopper
worker loads into a Blackwell worker, and into the CPU build. Bytes are copied as ``uint8`` (fp8
caches are ``uint8`` tensors already; a ``float8`` view is copied as its bytes).

Views handed to a connector, and how they are normalised (:class:`PagedKV`):

- ``[B, ...]`` with ``B`` = the manager's ``num_blocks``: as is;
- ``[B * r, ...]``: kernel-block splitting (an MLA backend that needs 64- or 128-token kernel
  blocks under a larger manager block): regrouped as ``[B, r, ...]``, as vLLM's own
  ``group_kernel_blocks`` does; the page then has ``r`` kernel blocks;
- ``[2, B, ...]`` (vLLM before its layout rework): blocks moved to dim 0.

When every layer is a view of one allocation at a constant layer stride (vLLM 0.32 allocates one
buffer per group, ``vllm/v1/worker/utils.py``), one strided view ``[B, L, *page]`` spans all layers,
so a step's blocks move in **one gather or scatter kernel over all layers**; otherwise one per layer.

**Copies** (:class:`BlockCopier`). On CUDA a save gathers the blocks into a preallocated device
staging buffer (one kernel) and copies each run of consecutive host rows with one asynchronous DMA
into pinned or registered host memory; a load is the mirror image (DMA per run into staging, one
scatter kernel). Both run on a side stream ordered after the main stream's work so far (the
forward pass a save reads, the zeroing of newly allocated blocks a load overwrites), and the main
stream waits for them on the GPU (``wait_event``): later kernels, which may overwrite a saved block
or read a loaded one, run after the copy, and the host is never blocked. The returned event says
when the host memory is written. On CPU the same gather and scatter write the host rows directly,
one run at a time, with no temporaries.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_STAGING_BYTES = 128 << 20
MAX_STAGING_BLOCKS = 4096


class LayoutError(ValueError):
    """vLLM handed the connector KV cache views it cannot store (the message says which layer and
    why)."""


def _page_view(t: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """One layer's cache as ``uint8 [num_blocks, *page]``, page in logical order."""
    if t.shape[0] != num_blocks and t.dim() > 1 and t.shape[1] == num_blocks:
        t = t.transpose(0, 1)  # (2, B, ...): blocks first
    elif t.shape[0] != num_blocks and t.shape[0] % num_blocks == 0:
        t = t.unflatten(0, (num_blocks, t.shape[0] // num_blocks))  # kernel-block split
    if t.shape[0] != num_blocks:
        raise LayoutError(f"layer {name}: KV cache of shape {tuple(t.shape)} does not hold {num_blocks} blocks")
    if t.stride(-1) != 1:
        raise LayoutError(f"layer {name}: innermost dimension not contiguous (strides {t.stride()})")
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _stacked(pages: list[torch.Tensor]) -> torch.Tensor | None:
    """One ``[B, L, *page]`` view over every layer when they share an allocation at a constant
    layer stride with equal strides; None otherwise."""
    first = pages[0]
    if any(p.device != first.device or p.stride() != first.stride() or
           p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for p in pages):
        return None
    if len(pages) == 1:
        layer_stride = first[0].numel()
    else:
        layer_stride = pages[1].storage_offset() - first.storage_offset()
        if any(p.storage_offset() - first.storage_offset() != i * layer_stride for i, p in enumerate(pages)):
            return None
    size = (first.shape[0], len(pages), *first.shape[1:])
    stride = (first.stride(0), layer_stride, *first.stride()[1:])
    whole = first.as_strided(size, stride)
    for i, p in enumerate(pages):  # the view must be exactly the layers (never reached if the checks hold)
        if whole[:, i].data_ptr() != p.data_ptr() or whole[:, i].stride() != p.stride():
            return None
    return whole


class PagedKV:
    """One KV cache group of vLLM as ``num_blocks`` rows of ``block_bytes`` (module docstring).

    ``views``: the group's per-layer caches, in layer order, as vLLM hands them to
    ``register_kv_caches``; ``num_blocks``: the KV cache manager's block count. Raises
    :class:`LayoutError` when a view cannot be read as blocks or the layers' pages differ.

    ``page_shape``: a page's logical shape in bytes (e.g. ``(8, 16, 512)`` for ``[H, N, K|V]``);
    ``page_bytes``: its size; ``block_bytes`` = ``num_layers * page_bytes``; ``all_layers``: whether
    one kernel spans all layers.
    """

    def __init__(self, views: Sequence[torch.Tensor], num_blocks: int, names: Sequence[str] | None = None) -> None:
        if not views:
            raise LayoutError("no KV cache views")
        names = list(names) if names is not None else [str(i) for i in range(len(views))]
        pages = [_page_view(t, num_blocks, n) for t, n in zip(views, names)]
        self.page_shape = tuple(pages[0].shape[1:])
        for p, n in zip(pages, names):
            if tuple(p.shape[1:]) != self.page_shape:
                raise LayoutError(f"layer {n}: page shape {tuple(p.shape[1:])} differs from {self.page_shape}")
        self.device = pages[0].device
        self.num_blocks = num_blocks
        self.num_layers = len(pages)
        self.page_bytes = pages[0][0].numel()
        self.block_bytes = self.page_bytes * self.num_layers
        self._pages = pages
        self._whole = _stacked(pages)
        self.all_layers = self._whole is not None

    @property
    def layout(self) -> str:
        """The page shape as text, for the fingerprint (e.g. ``"8x16x512"``)."""
        return "x".join(str(d) for d in self.page_shape)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], self.num_layers, *self.page_shape)

    def gather(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks ``blocks`` (int64, on the cache's device) into ``out`` (contiguous ``uint8
        [n, block_bytes]``, same device, or host memory on CPU)."""
        rows = self._rows(out)
        if self._whole is not None:
            torch.index_select(self._whole, 0, blocks, out=rows)
            return
        for layer, page in enumerate(self._pages):
            rows[:, layer].copy_(page.index_select(0, blocks))

    def scatter(self, blocks: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (``uint8 [n, block_bytes]``) into blocks ``blocks`` (int64, the cache's device).
        On CUDA one ``index_copy_`` kernel; on CPU one strided copy per block, which runs several
        times faster there than ``index_copy_`` into a strided view."""
        rows = self._rows(src)
        if self.device.type == "cpu":
            for i, b in enumerate(blocks.tolist()):
                if self._whole is not None:
                    self._whole[b].copy_(rows[i])
                else:
                    for layer, page in enumerate(self._pages):
                        page[b].copy_(rows[i, layer])
            return
        if self._whole is not None:
            self._whole.index_copy_(0, blocks, rows)
            return
        for layer, page in enumerate(self._pages):
            page.index_copy_(0, blocks, rows[:, layer])


def runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first row, length)`` of each run of consecutive rows, in order."""
    out: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == r:
            pos, first, n = out[-1]
            out[-1] = (pos, first, n + 1)
        else:
            out.append((i, r, 1))
    return out


class BlockCopier:
    """Copies between a :class:`PagedKV` and host rows (``uint8 [R, block_bytes]`` tensors: the
    CPU tier's slab, a staging buffer) (module docstring).

    ``staging_bytes``: the CUDA staging buffer (whole blocks, at least one, at most
    ``MAX_STAGING_BLOCKS``); allocated once, here. Host rows should be pinned or registered: a
    copy from or to pageable memory is synchronous (correct, but the host waits for the stream).
    Not thread-safe: one caller (vLLM's worker thread).
    """

    def __init__(self, kv: PagedKV, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.kv = kv
        self.cuda = kv.device.type == "cuda"
        self.stream: torch.cuda.Stream | None = None
        self.staging_blocks = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(device=kv.device)
            self.staging_blocks = max(1, min(MAX_STAGING_BLOCKS, staging_bytes // kv.block_bytes))
            self._staging = torch.empty((self.staging_blocks, kv.block_bytes), dtype=torch.uint8, device=kv.device)

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        if not self.cuda:
            return torch.tensor(list(blocks), dtype=torch.long)
        # through pinned memory: a pageable copy would wait for the side stream (the forward pass)
        idx = torch.tensor(list(blocks), dtype=torch.long, pin_memory=True)
        return idx.to(self.kv.device, non_blocking=True)

    def save(self, blocks: Sequence[int], rows: Sequence[int], host: torch.Tensor) -> torch.cuda.Event | None:
        """Copy KV blocks ``blocks`` into ``host[rows]`` (same length). On CUDA: enqueued, returns
        the event after which ``host`` holds them; on CPU: done, returns None."""
        if not blocks:
            return None
        if not self.cuda:
            for pos, first, n in runs(rows):
                self.kv.gather(self._index(blocks[pos:pos + n]), host[first:first + n])
            return None
        main = torch.cuda.current_stream(self.kv.device)
        self.stream.wait_stream(main)  # after the forward pass that wrote the blocks
        with torch.cuda.stream(self.stream):
            index = self._index(blocks)  # one pinned copy for every round
            for lo in range(0, len(blocks), self.staging_blocks):
                part_rows = rows[lo:lo + self.staging_blocks]
                n = len(part_rows)
                self.kv.gather(index[lo:lo + n], self._staging[:n])
                for pos, first, k in runs(part_rows):
                    host[first:first + k].copy_(self._staging[pos:pos + k], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        main.wait_event(done)  # later writes to these blocks wait for the copy (on the GPU)
        return done

    def load(self, rows: Sequence[int], blocks: Sequence[int], host: torch.Tensor) -> torch.cuda.Event | None:
        """Copy ``host[rows]`` into KV blocks ``blocks`` (same length). On CUDA: enqueued after the
        main stream's work so far, and the main stream waits for it; returns the event after which
        ``host`` may be reused. On CPU: done, returns None."""
        if not blocks:
            return None
        if not self.cuda:
            for pos, first, n in runs(rows):
                self.kv.scatter(self._index(blocks[pos:pos + n]), host[first:first + n])
            return None
        main = torch.cuda.current_stream(self.kv.device)
        self.stream.wait_stream(main)  # after vLLM zeroed the newly allocated blocks
        with torch.cuda.stream(self.stream):
            index = self._index(blocks)  # one pinned copy for every round
            for lo in range(0, len(blocks), self.staging_blocks):
                part_rows = rows[lo:lo + self.staging_blocks]
                n = len(part_rows)
                for pos, first, k in runs(part_rows):
                    self._staging[pos:pos + k].copy_(host[first:first + k], non_blocking=True)
                self.kv.scatter(index[lo:lo + n], self._staging[:n])
            done = torch.cuda.Event()
            done.record(self.stream)
        main.wait_event(done)  # the forward pass reads the loaded blocks
        return done
