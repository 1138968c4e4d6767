"""A GPU KV block pool that behaves like vLLM v1's ``BlockPool`` with prefix caching.

Shape of vLLM 0.32 (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``) kept here:

- ``num_blocks`` blocks of ``block_size`` tokens; block 0 is the null block and never handed out,
  so ``num_blocks - 1`` are usable.
- Blocks held by running requests have ``ref_cnt > 0``. When a request finishes, its blocks are
  freed tail first (``reversed``) onto the end of an LRU free queue; new blocks are taken from the
  front. A freed block keeps its engine hash and stays a prefix hit until it is taken again: only
  then is it evicted and a ``BlockRemoved`` (one per hash) is emitted -- removals are lazy.
- A full block gets an engine hash chained over (parent hash, its token ids, its extra keys) and is
  announced in one ``BlockStored`` per call covering consecutive blocks. Identical blocks are not
  deduplicated: two requests that compute the same block both announce it.
- A prefix hit is the longest run of cached hashes from block 0, capped so at least the prompt's
  last token is recomputed (a fully cached prompt recomputes its last block).

Engine hashes are the simulator's own unsigned 64-bit ints (xxh3_64 with the simulator's seed),
unrelated to vLLM's sha256 and to kvroute's block keys.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from kvcore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, MEDIUM_GPU

KV_CACHE_SPEC_KIND = "full_attention"


class Block:
    """One KV block: ``block_id``, reference count, and its engine hash while it is cached."""

    __slots__ = ("block_id", "ref_cnt", "engine_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.engine_hash: int | None = None


def engine_block_hashes(token_ids: Sequence[int], block_size: int, seed: int,
                        extra_keys: Sequence[Any] | None = None, start: int = 0,
                        parent: int | None = None, lora_name: str | None = None) -> list[int]:
    """Engine hashes (uint64) of the full blocks of ``token_ids`` from block ``start`` on.

    ``parent`` is the hash of block ``start - 1`` (None from block 0); ``extra_keys[i]`` is block
    i's extra key list or None; ``lora_name`` (a LoRA adapter's name) goes first in every block's
    extra keys, as vLLM's ``generate_block_hash_extra_keys`` puts the adapter first. Encoding:
    xxh3_64(seed) over parent as 8 bytes big-endian (all zero for block 0), the block's token ids
    as 4-byte little-endian, then ``repr`` of its extra key list (:func:`block_extra_keys`).
    """
    out: list[int] = []
    for i in range(start, len(token_ids) // block_size):
        h = xxhash.xxh3_64(seed=seed)
        h.update((parent or 0).to_bytes(8, "big"))
        h.update(b"".join(t.to_bytes(4, "little") for t in token_ids[i * block_size:(i + 1) * block_size]))
        extra = block_extra_keys(extra_keys, i, lora_name)
        if extra is not None:
            h.update(repr(extra).encode())
        parent = h.intdigest()
        out.append(parent)
    return out


def block_extra_keys(extra_keys: Sequence[Any] | None, i: int, lora_name: str | None) -> list[Any] | None:
    """Block ``i``'s extra keys as vLLM's KV events publish them (``to_event_extra_keys``, untagged):
    the LoRA name first, then the request's own keys for the block (a cache salt on block 0);
    None when there are none."""
    own = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
    if lora_name is None:
        return own
    return [lora_name, *(own or [])]


class BlockPool:
    """vLLM-like block pool with prefix caching; collects the KV events it causes.

    ``num_blocks``: total blocks including the null block (vLLM's ``--num-gpu-blocks-override``).
    Events accumulate in :meth:`take_events` order, as vLLM's ``BlockPool.take_events``.
    Not thread-safe: the simulator's engine owns it on one event loop.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_events: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_events = enable_events
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[int, dict[int, Block]] = {}  # engine hash -> block_id -> block
        self._events: list[KVCacheEvent] = []

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can get (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by a running request (cached-but-free ones included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding an engine hash (held or free)."""
        return sum(len(v) for v in self._cached.values())

    def usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1 (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    # ---- prefix cache -------------------------------------------------------------------------
    def longest_hit(self, block_hashes: Sequence[int], num_prompt_tokens: int) -> list[Block]:
        """Cached blocks for the longest run of ``block_hashes`` from block 0, capped at
        ``(num_prompt_tokens - 1) // block_size`` blocks as in vLLM."""
        limit = max(0, (num_prompt_tokens - 1) // self.block_size)
        hit: list[Block] = []
        for h in block_hashes[:limit]:
            holders = self._cached.get(h)
            if not holders:
                break
            hit.append(next(iter(holders.values())))
        return hit

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take references on hit blocks (a free cached block leaves the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self._free.pop(b.block_id, None)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the front of the free queue, evicting cached ones
        (``BlockRemoved`` each). Raises ValueError if fewer than ``n`` are free."""
        if n > len(self._free):
            raise ValueError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            b = self.blocks[block_id]
            if b.engine_hash is not None:
                holders = self._cached.get(b.engine_hash)
                if holders is not None:
                    holders.pop(block_id, None)
                    if not holders:
                        del self._cached[b.engine_hash]
                if self.enable_events:
                    self._events.append(BlockRemoved(block_hashes=[b.engine_hash], medium=MEDIUM_GPU,
                                                     group_idx=0))
                b.engine_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each of a request's blocks (given in block order); blocks that
        reach zero join the free queue tail first, as vLLM frees them."""
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and b.block_id != 0:
                self._free[b.block_id] = None

    def cache_full_blocks(self, blocks: Sequence[Block], block_hashes: Sequence[int],
                          token_ids: Sequence[int], start: int, end: int,
                          extra_keys: Sequence[Any] | None = None, lora_name: str | None = None) -> None:
        """Give blocks ``start..end-1`` of a request their engine hashes and announce them in one
        ``BlockStored`` (vLLM's ``cache_full_blocks``). ``token_ids``: the request's tokens;
        ``lora_name``: its LoRA adapter, if any."""
        if end <= start:
            return
        for i in range(start, end):
            b = blocks[i]
            b.engine_hash = block_hashes[i]
            self._cached.setdefault(b.engine_hash, {})[b.block_id] = b
        if self.enable_events:
            self._events.append(self._stored(block_hashes, token_ids, start, end, extra_keys, lora_name))

    def announce(self, block_hashes: Sequence[int], token_ids: Sequence[int], end: int,
                 extra_keys: Sequence[Any] | None = None, lora_name: str | None = None) -> None:
        """Re-announce a hit prefix (blocks ``0..end-1``) in one ``BlockStored`` with no parent,
        as vLLM does for ``vllm_xargs.kv_cache_report_mode == "full"``."""
        if self.enable_events and end > 0:
            self._events.append(self._stored(block_hashes, token_ids, 0, end, extra_keys, lora_name))

    def _stored(self, block_hashes: Sequence[int], token_ids: Sequence[int], start: int, end: int,
                extra_keys: Sequence[Any] | None, lora_name: str | None) -> BlockStored:
        bs = self.block_size
        extras = [block_extra_keys(extra_keys, i, lora_name) for i in range(start, end)]
        return BlockStored(
            block_hashes=list(block_hashes[start:end]),
            parent_block_hash=block_hashes[start - 1] if start > 0 else None,
            token_ids=list(token_ids[start * bs:end * bs]), block_size=bs, lora_id=None,
            medium=MEDIUM_GPU, lora_name=lora_name, extra_keys=extras, group_idx=0,
            kv_cache_spec_kind=KV_CACHE_SPEC_KIND)

    def reset(self) -> bool:
        """Forget every engine hash (``POST /reset_prefix_cache``); emits ``AllBlocksCleared``.
        Returns False, changing nothing, while any request holds blocks (as vLLM does)."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for b in self.blocks:
            b.engine_hash = None
        self._cached.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call, in the order they happened."""
        ev, self._events = self._events, []
        return ev
