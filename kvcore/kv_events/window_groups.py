"""The sliding-window KV cache groups of a hybrid model, as one worker's events tell them.

vLLM 0.32 publishes each KV cache group's stores with ``group_idx``, ``kv_cache_spec_kind``
(``"sliding_window"`` here) and ``kv_cache_spec_sliding_window`` (tokens); removals carry only
``group_idx``. A window group's ``BlockStored`` lists the blocks it kept, which are usually the
prompt's last few (the rest fell out of the window and were freed before being cached): its
``parent_block_hash`` and ``token_ids`` do not line up with ``block_hashes``. The engine hash of a
block is the same in every group, so each block is found through the full-attention group's entry
(:meth:`kvcore.kv_events.translate.EventTranslator.lookup`), and its index entry is
:func:`kvcore.sliding_window.window_key` of that block's key, in the gpu tier.

Layers with the same window may be split over several groups; vLLM hits a block only when every
one of them holds it (``BlockPool.get_cached_block`` over the attention group's ids), so the window
key is in the index while all window groups seen so far hold the block, one reference. A second
window size (no model we know of has one) is not indexed: its events are skipped, and the gateway
then finds no window keys and credits nothing (under-report).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcore.kv_events.wire import EngineHash
from kvcore.sliding_window import window_key

WINDOW_KIND = "sliding_window"

Emit = Callable[[str, list[int]], None]
"""``emit(op, keys)``: ``op`` is ``"store"`` or ``"remove"``, on the gpu tier."""


class WindowGroups:
    """Window-group residency per engine hash; see the module docstring.

    ``lookup``: engine hash -> ``(block key, block index)`` from the full-attention group, or None.
    Counters: ``window_blocks_stored`` / ``window_blocks_removed`` (index writes),
    ``unresolved_window_blocks`` (a stored hash the full-attention group never announced: skipped).
    """

    def __init__(self, lookup: Callable[[EngineHash], tuple[int, int] | None]) -> None:
        self._lookup = lookup
        self.window_tokens: int | None = None
        self._groups: list[int] = []  # group_idx of each window group seen, in order seen
        # engine hash -> [window key, copies in each group of self._groups]
        self._held: dict[EngineHash, list[int]] = {}
        self.window_blocks_stored = 0
        self.window_blocks_removed = 0
        self.unresolved_window_blocks = 0

    def reset(self) -> None:
        """Forget every block (the worker's cache was cleared); the groups stay known."""
        self._held.clear()

    def owns(self, group_idx: int | None) -> bool:
        """Whether ``group_idx`` is a window group seen in a store."""
        return group_idx is not None and group_idx in self._groups

    def learn(self, group_idx: int, window_tokens: int | None, emit: Emit) -> str | None:
        """None when a store of group ``group_idx`` with this window can be tracked, else why not.
        A group seen for the first time holds nothing yet, so window keys complete until then are
        removed."""
        if window_tokens is None or window_tokens < 1:
            return f"sliding-window group {group_idx} without a window size"
        if self.window_tokens is None:
            self.window_tokens = window_tokens
        elif window_tokens != self.window_tokens:
            return (f"sliding-window group {group_idx} has a {window_tokens}-token window; only "
                    f"{self.window_tokens}-token windows are indexed")
        if group_idx not in self._groups:
            dropped = [e[0] for e in self._held.values() if self._complete(e)]
            self._groups.append(group_idx)
            for entry in self._held.values():
                entry.append(0)
            if dropped:
                self.window_blocks_removed += len(dropped)
                emit("remove", dropped)
        return None

    def _complete(self, entry: list[int]) -> bool:
        return all(c > 0 for c in entry[1:])

    def stored(self, group_idx: int, hashes: Sequence[EngineHash], emit: Emit) -> None:
        """Blocks ``hashes`` now cached in window group ``group_idx`` (learned by :meth:`learn`)."""
        g = 1 + self._groups.index(group_idx)
        keys = []
        for h in hashes:
            entry = self._held.get(h)
            if entry is None:
                found = self._lookup(h)
                if found is None:
                    self.unresolved_window_blocks += 1
                    continue
                entry = self._held[h] = [window_key(found[0])] + [0] * len(self._groups)
            was = self._complete(entry)
            entry[g] += 1
            if not was and self._complete(entry):
                keys.append(entry[0])
        if keys:
            self.window_blocks_stored += len(keys)
            emit("store", keys)

    def removed(self, group_idx: int, hashes: Sequence[EngineHash], emit: Emit) -> None:
        """Blocks ``hashes`` left window group ``group_idx``; unknown ones are ignored."""
        g = 1 + self._groups.index(group_idx)
        keys = []
        for h in hashes:
            entry = self._held.get(h)
            if entry is None or not entry[g]:
                continue
            was = self._complete(entry)
            entry[g] -= 1
            if was and not self._complete(entry):
                keys.append(entry[0])
            if not any(entry[1:]):
                del self._held[h]
        if keys:
            self.window_blocks_removed += len(keys)
            emit("remove", keys)

    def snapshot_keys(self) -> list[int]:
        """Window keys in the index now (one reference each)."""
        return [e[0] for e in self._held.values() if self._complete(e)]

    def counters(self) -> dict[str, int]:
        return {"window_blocks_stored": self.window_blocks_stored,
                "window_blocks_removed": self.window_blocks_removed,
                "unresolved_window_blocks": self.unresolved_window_blocks}
