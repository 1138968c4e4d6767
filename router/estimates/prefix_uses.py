"""How many of this gateway's recent requests passed through each block key: tells a hot prefix
(a system prompt, a shared document: many requests in flight or arriving with it) from a private
one (a conversation's history, used by one turn at a time).

The ``ttft`` policy charges recomputing a private prefix elsewhere more than a hot one
(``private_recompute_weight`` against ``recompute_weight``): moving a conversation costs its
whole history again and keeps nothing another request will use, while a second copy of a hot
prefix serves everyone queued behind the first.

Pure bookkeeping on the gateway's clock, no I/O. Bounded: at most ``max_keys`` keys, the least
recently used dropped first, and a key unused for ``window_s`` counts 0 again.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_KEYS = 65536


class PrefixUses:
    """Per block key, the requests that passed through it since it was last idle for
    ``window_s`` seconds. ``record`` takes a dispatched request's block keys (one prompt's chain,
    block 0 first); ``uses(key)`` answers for one key."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_keys: int = DEFAULT_MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0 or max_keys <= 0:
            raise ValueError("window_s and max_keys must be positive")
        self.window_s = window_s
        self.max_keys = max_keys
        self.clock = clock
        self._keys: OrderedDict[int, tuple[int, float]] = OrderedDict()  # key -> (uses, last use s)

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, keys: Sequence[int]) -> None:
        """Count one request through every key of ``keys`` (a key repeated in one chain counts
        once)."""
        now = self.clock()
        entries = self._keys
        for key in dict.fromkeys(keys):
            old = entries.pop(key, None)
            uses = old[0] if old is not None and now - old[1] <= self.window_s else 0
            entries[key] = (uses + 1, now)
        horizon = now - self.window_s
        while entries:
            key, (_, last_s) = next(iter(entries.items()))
            if len(entries) <= self.max_keys and last_s >= horizon:
                break
            del entries[key]

    def uses(self, key: int) -> int:
        """Requests recorded through ``key`` (0 when unknown or idle for ``window_s``)."""
        entry = self._keys.get(key)
        if entry is None or self.clock() - entry[1] > self.window_s:
            return 0
        return entry[0]
