"""Prefix hits on hybrid models: full attention plus sliding-window attention layers.

vLLM 0.32 gives such a model (Gemma 2/3, gpt-oss, Llama configs with ``layer_types``) one KV cache
group per attention kind. A block is cached per group, and a prefix hit of ``e`` blocks needs
(``vllm/v1/core/kv_cache_coordinator.py``, ``HybridKVCacheCoordinator.find_longest_cache_hit``, and
``single_type_kv_cache_manager.py``, ``SlidingWindowManager``):

- every block ``0 .. e-1`` in the full-attention group (the usual prefix run ``F``), and
- in the sliding-window group, the ``need = ceil((window_tokens - 1) / block_size)`` blocks just
  before ``e`` (``e-need .. e-1``), or, for ``e < need``, all of ``0 .. e-1``.

vLLM takes the largest such ``e <= F``. The sliding-window group frees blocks that fall out of the
window while a request runs, so it caches only the tail of most prompts: a prompt that shares the
first half of an earlier one has its full-attention blocks cached and still hits nothing, unless
the window before the shared point was kept (vLLM keeps it when a later request shares that
prefix). Crediting ``F`` there over-reports.

The index therefore holds a second key per block for the sliding-window group, :func:`window_key`
of the block's key (the agent writes it from that group's KV events), and :func:`window_hits`
finds ``e`` per worker from one lookup of which window keys each worker holds.
"""
from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence

import xxhash

_WINDOW_PREFIX = b"kvroute/window\x00"
_h = xxhash.xxh3_64_intdigest
Holders = Callable[[Sequence[int]], Awaitable[Mapping[str, int]]]
LOOKBACK_WINDOWS = 4
"""How far below the shortest full-attention run :func:`window_hits` looks up first, in windows."""


def window_key(key: int) -> int:
    """The sliding-window group's key for the block whose (full-attention) block key is ``key``:
    an unsigned 64-bit int, ``xxh3_64(b"kvroute/window\\x00" + u64le(key))``."""
    return _h(_WINDOW_PREFIX + struct.pack("<Q", key))


def window_keys(keys: Sequence[int]) -> list[int]:
    """:func:`window_key` of each of ``keys``."""
    pack = struct.Struct("<Q").pack
    return [_h(_WINDOW_PREFIX + pack(k)) for k in keys]


def window_blocks(window_tokens: int, block_size: int) -> int:
    """Blocks of the window group a hit must end on: ``ceil((window_tokens - 1) / block_size)``
    (vLLM's ``SlidingWindowManager._contiguous_blocks_for_hit`` without EAGLE). Raises
    ValueError on a value below 1."""
    if window_tokens < 1 or block_size < 1:
        raise ValueError(f"window_tokens and block_size must be >= 1, got {window_tokens}, {block_size}")
    return -(-(window_tokens - 1) // block_size)


def declared_window_tokens(hf_config: Mapping[str, object]) -> int | None:
    """The sliding window of a hybrid model as its Hugging Face ``config.json`` (a dict) declares
    it: ``sliding_window`` when ``layer_types`` mixes ``"sliding_attention"`` with other layers
    (Llama, gpt-oss, Qwen, Gemma 3 in recent transformers) or ``sliding_window_pattern`` is above 1
    (Gemma 3's older files); None otherwise, models whose every layer slides included (they have
    no full-attention group to key blocks by, so the index holds nothing for them)."""
    window = hf_config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    kinds = hf_config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        return window if "sliding_attention" in kinds and len(set(kinds)) > 1 else None
    pattern = hf_config.get("sliding_window_pattern")
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 1:
        return window
    return None


def window_hit(full_run: int, held_mask: int, need: int) -> int:
    """vLLM's rule on one worker: the largest ``e <= full_run`` whose window ``max(0, e - need) ..
    e-1`` the window group holds (``held_mask``: bit ``i`` set when it holds block ``i``), in
    ``O(full_run)``. From ``e = full_run`` down: ``r`` blocks held just before ``e``; ``r >= need``
    (or ``r == e``) makes ``e`` the hit, else block ``e-1-r`` is missing and every end above it
    fails, so the search goes on from there."""
    e = full_run
    while e > 0:
        r = 0
        while r < need and r < e and held_mask >> (e - 1 - r) & 1:
            r += 1
        if r >= need or r == e:
            return e
        e -= 1 + r
    return 0


async def window_hits(full_runs: Mapping[str, int], wkeys: Sequence[int], need: int, holders: Holders) -> dict[str, int]:
    """Per worker, the hit vLLM gets (:func:`window_hit`): ``full_runs`` are the workers'
    full-attention runs in blocks, ``wkeys`` the prompt's :func:`window_keys`, ``holders`` the
    index's :meth:`kvcore.index.base.KVIndex.gpu_holders`. One lookup of the window keys from
    :data:`LOOKBACK_WINDOWS` windows below the shortest run up to the longest (a hit is almost
    always at or just below a run's end); a worker whose hit could lie below that stretch is
    looked up again from block 0. Workers with a run of 0 are left out. Raises what ``holders``
    raises."""
    runs = {w: min(f, len(wkeys)) for w, f in full_runs.items() if f > 0}
    if not runs or need <= 0:
        return runs
    lo = max(0, min(runs.values()) - LOOKBACK_WINDOWS * need)
    masks = await holders(wkeys[lo:max(runs.values())])
    out: dict[str, int] = {}
    low: Mapping[str, int] | None = None
    for w, f in runs.items():
        e = window_hit(f, masks.get(w, 0) << lo, need)
        if lo and e < lo + need:  # the search read blocks below the stretch looked up
            if low is None:
                low = await holders(wkeys[:lo + need])
            e = window_hit(f, (masks.get(w, 0) << lo) | low.get(w, 0), need)
        out[w] = e
    return out
