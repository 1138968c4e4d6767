"""vLLM KV events -> index operations under our block keys, for one worker.

:class:`EventTranslator` keeps the worker's state as the agent knows it: engine hash -> [block key,
block index, copies in gpu, cpu, ssd]. It is the source of truth the index is written from, so the
index can be republished from it after an outage (:meth:`EventTranslator.snapshot`).

Rules (vLLM 0.32 semantics, see ``kvcore/kv_events/wire.py``):

- ``BlockStored`` with ``token_ids``: keys from :func:`kvcore.block_keys.block_keys` with the
  gateway's extras, ``BlockExtras(lora_name=event.lora_name, cache_salt=<block 0's extra key>)``;
  vLLM publishes extra keys untagged per block, LoRA name first, so block 0's item after the LoRA
  name is the cache salt. Multimodal items, ``(identifier, offset)`` pairs per block, are mixed in
  as the gateway mixes a rendered prompt's items (:mod:`kvcore.block_keys`). A chain continues from
  ``parent_block_hash`` through the map (the parent's key and index + 1); an unknown parent is
  counted (``unknown_parents``) and the event skipped (the index under-reports). Blocks whose extra
  keys hold anything else (prompt embeds digests) get keys tagged with that item, which the gateway
  never produces: they never match (under-report, never over-report), yet chains through them stay
  consistent.
- ``medium``: ``GPU``/None -> gpu, ``CPU`` -> cpu, ``STORAGE`` -> ssd; others are skipped.
- ``locality`` (vLLM 0.32's secondary offloading tiers; ``vllm/distributed/kv_events.py``: "LOCAL
  or REMOTE relative to the publisher; None means unspecified", values of
  ``vllm/v1/kv_offload/base.py``'s ``Locality``): a ``REMOTE`` copy lives outside the worker (a
  network file system or object store tier), so it is not this worker's cpu or ssd tier: its
  ``BlockStored`` and ``BlockRemoved`` change nothing here (counted, ``remote_events``); in
  particular a remote removal leaves the worker's local copy of the same medium alone. ``LOCAL``
  and None (unspecified: what vLLM's GPU prefix cache, kvroute's own tiers connector and vLLMs
  without the field send) are applied by ``medium``; another value is skipped
  (``skipped_events``). ``ownership`` (the secondary tier that published the event) needs
  nothing: vLLM stores and removes each (medium, ownership) residency with its own events, and
  copies are counted (below).
- Tokenless ``BlockStored`` (vLLM's CPU-offload placeholders: ``token_ids`` empty, ``block_size``
  0) are resolved through the map; unknown hashes are counted (``unresolved_tokenless``).
- ``BlockRemoved``: through the map; a hash not held in that tier is counted (``unknown_removals``)
  and skipped, never aborting the batch.
- Copies are counted per (engine hash, tier): vLLM stores the same block twice (e.g. the recomputed
  last block of a fully cached prompt, or two concurrent misses) and later removes it twice, so each
  counted copy is one index reference.
- ``kv_cache_report_mode=full`` re-announcements: vLLM re-sends a cache hit's blocks as a
  ``BlockStored`` with ``parent_block_hash`` None, for the same physical blocks, and will remove
  them only once. Counting them would leave a reference behind forever (over-report). Choice: in the
  gpu tier, a block of a parent-None ``BlockStored`` that this worker already holds is taken as a
  re-announcement and adds no copy (``reannounced_blocks``). The cost: two concurrent misses of the
  same prefix from block 0 count one copy, so after the first removal the block looks gone while
  vLLM still has the second copy (an under-report, which only loses a routing opportunity).
  Duplicates with a parent (the common kind) are counted.
- ``AllBlocksCleared``: the worker's entries in every tier are dropped (an op ``("clear", None,
  [])``); vLLM's prefix cache reset carries no medium, and clearing all tiers can only under-report.
- Multi-group (hybrid) models: the block keys come from one KV cache group, the first whose
  ``kv_cache_spec_kind`` is a full-attention kind (or unset). Sliding-window groups are indexed
  under :func:`kvcore.sliding_window.window_key` of each block's key
  (:mod:`kvcore.kv_events.window_groups`); their events in a batch are applied after the batch's
  other events (up to an ``AllBlocksCleared``), since vLLM publishes a step's window-group stores
  before the full-attention stores their blocks are found through. Other groups (Mamba, chunked
  local attention) are skipped.
- A ``block_size`` other than the configured one is skipped and counted (``skipped_events``).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvcore.block_keys import NO_EXTRAS, BlockExtras, block_keys
from kvcore.index.base import TIERS
from kvcore.kv_events.window_groups import WINDOW_KIND, WindowGroups
from kvcore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, EventBatch

log = logging.getLogger("kvroute.kv_events")

TIER_OF_MEDIUM: dict[str | None, str] = {None: "gpu", "GPU": "gpu", "CPU": "cpu", "STORAGE": "ssd"}
FULL_ATTENTION_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})

IndexOp = tuple[str, "str | None", list[int]]
"""``("store" | "remove", tier, block keys)`` or ``("clear", None, [])``; applied in order."""

_KEY, _INDEX = 0, 1  # positions in a map entry; copies per tier follow at 2 + tier index


@dataclass
class TranslatorCounters:
    """Counts since start, by what happened to each event or block."""

    events_applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    duplicate_blocks: int = 0
    reannounced_blocks: int = 0
    unknown_removals: int = 0
    unknown_parents: int = 0
    unresolved_tokenless: int = 0
    skipped_events: int = 0
    remote_events: int = 0
    clears: int = 0


class EventTranslator:
    """Turns one worker's :class:`kvcore.kv_events.wire.EventBatch` stream into :data:`IndexOp` lists.

    ``model``: served model name (the block keys' root); ``block_size``: the engine's
    ``--block-size`` in tokens. Not thread-safe; one instance per worker.
    """

    def __init__(self, model: str, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.counters = TranslatorCounters()
        self._entries: dict[EngineHash, list[int]] = {}  # [key, index, copies per tier...]
        self._held = [0] * len(TIERS)  # distinct engine blocks with a copy in each tier
        self._group: int | None = None
        self._warned: set[str] = set()
        self.windows = WindowGroups(self.lookup)

    # ---- state --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every block (the caller clears the index for this worker)."""
        self._entries.clear()
        self._held = [0] * len(TIERS)
        self.windows.reset()

    def held_blocks(self) -> dict[str, int]:
        """Distinct engine blocks held per tier (kept up to date as events apply: O(1))."""
        return dict(zip(TIERS, self._held))

    def lookup(self, engine_hash: EngineHash) -> tuple[int, int] | None:
        """``(block key, block index)`` of a held engine hash, or None."""
        entry = self._entries.get(engine_hash)
        return None if entry is None else (entry[_KEY], entry[_INDEX])

    def snapshot(self) -> list[IndexOp]:
        """Store ops that rebuild this worker's index entries from nothing (a key repeated once
        per counted copy)."""
        per_tier: list[list[int]] = [[] for _ in TIERS]
        for entry in self._entries.values():
            for i in range(len(TIERS)):
                if entry[2 + i]:
                    per_tier[i].extend([entry[_KEY]] * entry[2 + i])
        per_tier[0].extend(self.windows.snapshot_keys())
        return [("store", t, keys) for t, keys in zip(TIERS, per_tier) if keys]

    def counters_dict(self) -> dict[str, int]:
        out = asdict(self.counters)
        out.update(self.windows.counters())
        return out

    # ---- translation --------------------------------------------------------------------------
    def translate(self, batch: EventBatch) -> list[IndexOp]:
        """Update the state with ``batch``'s events and return the index ops, in order."""
        ops: list[IndexOp] = []
        later: list[BlockStored | BlockRemoved] = []  # window-group events, after the others
        events = batch.events
        i, n = 0, len(events)
        while i < n:
            ev = events[i]
            if isinstance(ev, BlockStored):
                if ev.locality is not None and not self._local(ev.locality):
                    pass
                elif ev.kv_cache_spec_kind == WINDOW_KIND:
                    later.append(ev)
                else:
                    self._stored(ev, ops)
            elif isinstance(ev, BlockRemoved):
                if ev.locality is not None and not self._local(ev.locality):
                    pass
                elif self.windows.owns(ev.group_idx):
                    later.append(ev)
                else:
                    end = _removal_run_end(events, i)
                    self._removed(events[i:end], ops)
                    self.counters.events_applied += end - i
                    i = end
                    continue
            elif isinstance(ev, AllBlocksCleared):
                self._window_events(later, ops)
                self.reset()
                self.counters.clears += 1
                ops.append(("clear", None, []))
            self.counters.events_applied += 1
            i += 1
        self._window_events(later, ops)
        return ops

    def _window_events(self, events: list[BlockStored | BlockRemoved], ops: list[IndexOp]) -> None:
        def emit(op: str, keys: list[int]) -> None:
            self._emit(ops, op, "gpu", keys, count=False)

        for ev in events:
            if self._tier(ev.medium) != 0:  # window groups live in the engine's own cache
                continue
            if isinstance(ev, BlockRemoved):  # only a learned group's (never None) are deferred
                self.windows.removed(int(ev.group_idx or 0), ev.block_hashes, emit)
                continue
            group = -1 if ev.group_idx is None else ev.group_idx
            why = self.windows.learn(group, ev.kv_cache_spec_sliding_window, emit)
            if why is not None:
                self._skip(why)
                continue
            self.windows.stored(group, ev.block_hashes, emit)
        events.clear()

    def _skip(self, why: str) -> None:
        self.counters.skipped_events += 1
        if why not in self._warned:
            self._warned.add(why)
            log.warning("skipping KV events: %s", why)

    def _local(self, locality: str) -> bool:
        """Whether an event with this (not None) ``locality`` is about the worker's own copy;
        counts the others."""
        if locality == "LOCAL":
            return True
        if locality == "REMOTE":
            self.counters.remote_events += 1
            if "remote" not in self._warned:
                self._warned.add("remote")
                log.info("not indexing KV blocks with locality REMOTE (stored outside the worker, "
                         "not its own cpu/ssd tier)")
        else:
            self._skip(f"unknown locality {locality!r}")
        return False

    def _tier(self, medium: str | None) -> int | None:
        tier = TIER_OF_MEDIUM.get(medium)
        if tier is None:
            self._skip(f"unknown medium {medium!r}")
            return None
        return TIERS.index(tier)

    def _group_ok(self, group_idx: int | None, kind: str | None, stored: bool) -> bool:
        if group_idx is None or group_idx == self._group:
            return True
        if self._group is None and stored and kind in FULL_ATTENTION_KINDS:
            self._group = group_idx
            return True
        self._skip(f"KV cache group {group_idx} ({kind or 'kind unknown'}) is not the indexed group")
        return False

    def _stored(self, ev: BlockStored, ops: list[IndexOp]) -> None:
        t = self._tier(ev.medium)
        if t is None or not self._group_ok(ev.group_idx, ev.kv_cache_spec_kind, True):
            return
        entries = self._entries
        if not ev.token_ids:
            keys = []
            for h in ev.block_hashes:
                entry = entries.get(h)
                if entry is None:
                    self.counters.unresolved_tokenless += 1
                    continue
                if not entry[2 + t]:
                    self._held[t] += 1
                entry[2 + t] += 1
                keys.append(entry[_KEY])
            self._emit(ops, "store", TIERS[t], keys)
            return
        if ev.block_size != self.block_size or len(ev.token_ids) != len(ev.block_hashes) * self.block_size:
            self._skip(f"BlockStored with block_size {ev.block_size} and {len(ev.token_ids)} tokens for "
                       f"{len(ev.block_hashes)} blocks (configured block size {self.block_size})")
            return
        if ev.parent_block_hash is None:
            parent_key, first = None, 0
        else:
            parent = entries.get(ev.parent_block_hash)
            if parent is None:
                self.counters.unknown_parents += 1
                return
            parent_key, first = parent[_KEY], parent[_INDEX] + 1
        new_keys = self._block_keys(ev, parent_key, first)
        reannounce = ev.parent_block_hash is None and t == 0
        keys = []
        fresh = 0
        for i, h in enumerate(ev.block_hashes):
            entry = entries.get(h)
            if entry is None:
                entry = entries[h] = [new_keys[i], first + i, 0, 0, 0]
                fresh += 1
            elif entry[2 + t]:
                if reannounce:
                    self.counters.reannounced_blocks += 1
                    continue
                self.counters.duplicate_blocks += 1
            else:
                fresh += 1
            entry[2 + t] += 1
            keys.append(entry[_KEY])
        self._held[t] += fresh
        self._emit(ops, "store", TIERS[t], keys)

    def _removed(self, run: Sequence[BlockRemoved], ops: list[IndexOp]) -> None:
        """Apply a run of removals that share medium, group and locality
        (:func:`_removal_run_end`): vLLM sends one ``BlockRemoved`` per evicted block, so a step
        that evicts many blocks is one loop here. An unknown medium or another group skips (and
        counts) each event of the run."""
        first = run[0]
        t = TIER_OF_MEDIUM.get(first.medium)
        if t is None:
            for ev in run:
                self._tier(ev.medium)
            return
        t = TIERS.index(t)
        if not self._group_ok(first.group_idx, None, False):
            for _ in run[1:]:
                self._group_ok(first.group_idx, None, False)
            return
        entries = self._entries
        keys: list[int] = []
        unknown = released = 0
        for ev in run:
            for h in ev.block_hashes:
                entry = entries.get(h)
                if entry is None or not entry[2 + t]:
                    unknown += 1
                    continue
                entry[2 + t] -= 1
                if not entry[2 + t]:
                    released += 1
                keys.append(entry[_KEY])
                if not (entry[2] or entry[3] or entry[4]):
                    del entries[h]
        self.counters.unknown_removals += unknown
        self._held[t] -= released
        self._emit(ops, "remove", TIERS[t], keys)

    def _emit(self, ops: list[IndexOp], op: str, tier: str, keys: list[int], count: bool = True) -> None:
        if not keys:
            return
        if count:  # window keys are counted by WindowGroups
            if op == "store":
                self.counters.blocks_stored += len(keys)
            else:
                self.counters.blocks_removed += len(keys)
        if ops and ops[-1][0] == op and ops[-1][1] == tier:
            ops[-1][2].extend(keys)
        else:
            ops.append((op, tier, keys))

    # ---- keys ---------------------------------------------------------------------------------
    def _block_keys(self, ev: BlockStored, parent_key: int | None, first: int) -> list[int]:
        lora = ev.lora_name
        salt, media, opaque = _split_extra_keys(ev.extra_keys, lora, first, len(ev.block_hashes))
        if not media and not opaque:
            extras = NO_EXTRAS if lora is None and salt is None else BlockExtras(lora_name=lora, cache_salt=salt)
            return block_keys(ev.token_ids, self.block_size, self.model, extras, parent_key, first)
        # Key block by block: multimodal items as the gateway keys them (their offset from the
        # block's start); any other item tags its block so it never equals a gateway key.
        bs = self.block_size
        keys: list[int] = []
        key = parent_key
        for i in range(len(ev.block_hashes)):
            index = first + i
            lo = index * bs
            mm = tuple((ident, lo + offset, bs - offset) for ident, offset in media.get(i, ()))
            if opaque.get(i):
                mm += ((opaque[i], lo, bs),)
            extras = BlockExtras(lora_name=lora, cache_salt=salt if index == 0 else None, mm_hashes=mm)
            key = block_keys(ev.token_ids[i * bs:(i + 1) * bs], bs, self.model, extras, key, index)[0]
            keys.append(key)
        return keys


def _split_extra_keys(extra_keys: Sequence[Any] | None, lora: str | None, first: int, n_blocks: int
                      ) -> tuple[str | None, dict[int, list[tuple[str, int]]], dict[int, str]]:
    """From vLLM's untagged per-block extra keys (LoRA name, ``(mm identifier, offset)`` pairs,
    cache salt, prompt-embeds digests, in that order): the cache salt (block 0's string after the
    LoRA name), per block position its multimodal items, and a text form of anything else."""
    salt: str | None = None
    media: dict[int, list[tuple[str, int]]] = {}
    opaque: dict[int, str] = {}
    if not extra_keys:
        return salt, media, opaque
    for i, items in enumerate(extra_keys[:n_blocks]):
        if not items:
            continue
        rest = list(items)
        if lora is not None and rest and rest[0] == lora:
            rest = rest[1:]
        while rest and isinstance(rest[0], (list, tuple)) and len(rest[0]) == 2 \
                and isinstance(rest[0][0], str) and isinstance(rest[0][1], int):
            media.setdefault(i, []).append((rest[0][0], rest[0][1]))
            rest = rest[1:]
        if first + i == 0 and rest and isinstance(rest[0], str):
            salt = rest.pop(0)
        if rest:
            opaque[i] = repr(rest)
    return salt, media, opaque


def _removal_run_end(events: Sequence[Any], start: int) -> int:
    """The end (exclusive) of the run of ``BlockRemoved`` events from ``start`` whose medium,
    group and locality equal ``events[start]``'s."""
    ev = events[start]
    medium, group, locality = ev.medium, ev.group_idx, ev.locality
    end, n = start + 1, len(events)
    while end < n:
        nxt = events[end]
        if type(nxt) is not BlockRemoved or nxt.medium != medium or nxt.group_idx != group \
                or nxt.locality != locality:
            break
        end += 1
    return end
