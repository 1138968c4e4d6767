"""The cluster index interface: which worker holds which block keys, in which tier.

Contract (every backend):

- Keys are our block keys (:mod:`kvcore.block_keys`), unsigned 64-bit ints; a worker is its id
  string; a tier is one of :data:`TIERS` (``gpu`` = vLLM's prefix cache, ``cpu``/``ssd`` = the
  offload agent's tiers).
- Stores are reference-counted per (key, worker, tier): vLLM may store the same block twice and
  later remove it twice; a block stays present until its last copy is removed. Removing a key that
  is not present is a no-op (counted by the caller if it cares).
- :meth:`KVIndex.match` returns, for every worker that holds block 0 of the prompt, the longest
  run of consecutive keys from block 0 that the worker holds in some tier, split by the best tier
  (gpu > cpu > ssd) as :class:`TierMatch`: ``gpu`` = length of the consecutive gpu run from block
  0 (what vLLM's own prefix cache can hit), ``cpu`` = blocks after that run that are in gpu or cpu,
  ``ssd`` = the rest of the run. Workers holding nothing are absent from the result.
- Speculative entries (:meth:`KVIndex.store_speculative`) count as ``gpu`` until their TTL passes
  or they are withdrawn (:meth:`KVIndex.drop_speculative`). The gateway writes them for the prompt
  it just routed: the only knowledge in approximate mode (workers without KV events) and a bridge
  until the worker's events confirm the blocks.
- All methods are coroutines; the in-memory backend never suspends. Safe for one event loop.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

TIERS: tuple[str, ...] = ("gpu", "cpu", "ssd")


def check_tier(tier: str) -> int:
    """Index of ``tier`` in :data:`TIERS`. Raises ValueError for an unknown tier name."""
    try:
        return TIERS.index(tier)
    except ValueError:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}") from None


@dataclass(frozen=True)
class TierMatch:
    """One worker's match for a prompt, in blocks: consecutive from block 0, split by tier.
    Frozen: a lookup may hand the same object to every worker with the same split."""

    gpu: int = 0
    cpu: int = 0
    ssd: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.ssd

    def as_dict(self) -> dict[str, int]:
        return {"gpu": self.gpu, "cpu": self.cpu, "ssd": self.ssd}


NO_MATCH = TierMatch()  # the match of a worker holding none of a prompt (frozen: shared by all)


@dataclass
class WorkerIndexStats:
    """Blocks a worker holds per tier (confirmed entries) plus live speculative entries."""

    blocks: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    speculative_blocks: int = 0


class KVIndex(abc.ABC):
    """Abstract index backend; see the module docstring for the contract."""

    @abc.abstractmethod
    async def store(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        """Add one reference to each (key, worker, tier). Raises ValueError on an unknown tier."""

    @abc.abstractmethod
    async def remove(self, worker: str, tier: str, keys: Sequence[int]) -> int:
        """Drop one reference to each (key, worker, tier); returns how many keys were not present.
        A gpu-tier removal also drops the worker's speculative entry for the key: the engine has
        just said the block is gone, so the gateway's guess that it is there is stale."""

    @abc.abstractmethod
    async def clear_worker(self, worker: str, tier: str | None = None) -> None:
        """Forget everything ``worker`` holds (in ``tier`` only, when given), speculative included."""

    @abc.abstractmethod
    async def store_speculative(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        """Mark ``keys`` as held on ``worker``'s gpu tier for ``ttl_s`` seconds (refreshes TTL)."""

    @abc.abstractmethod
    async def drop_speculative(self, worker: str, keys: Sequence[int]) -> None:
        """Withdraw ``worker``'s speculative entries for ``keys`` (the worker refused the request
        they were stored for, so it computed none of its prompt); its confirmed entries stay.
        Local to this process where the backend keeps them so; the Redis mirror
        (:mod:`kvcore.index.redis_mirror`) also appends the withdrawal to its change log, for
        every replica that holds them."""

    @abc.abstractmethod
    async def match(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        """Per worker, the longest consecutive run of ``keys`` from block 0, split by tier."""

    async def gpu_holders(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker holding any of ``keys`` in gpu (speculative entries included), a bit mask
        over positions: bit ``i`` set when it holds ``keys[i]``. This default asks :meth:`match`
        once per key; backends override it with one lookup."""
        out: dict[str, int] = {}
        for i, key in enumerate(keys):
            for worker, m in (await self.match([key])).items():
                if m.gpu:
                    out[worker] = out.get(worker, 0) | 1 << i
        return out

    @abc.abstractmethod
    async def stats(self) -> dict[str, WorkerIndexStats]:
        """Per worker block counts by tier."""

    async def open(self) -> None:
        """Check at start-up that this process can use the index (no-op for in-memory). A shared
        backend raises :class:`kvcore.index.errors.IndexEncodingMismatch` when it holds block keys
        of another encoding version (refuse to start), :class:`kvcore.index.errors.IndexUnavailable`
        when it cannot be reached (going on is fine: it is checked again when it answers)."""

    def agent_fed(self, worker: str) -> bool:
        """Whether an agent has been seen writing ``worker``'s KV events into this index (a
        shared backend), so the gateway's speculative entries for it need to last only until
        events confirm them. False for the in-memory index (the gateway ingests itself)."""
        return False

    async def close(self) -> None:
        """Release connections (no-op for in-memory)."""


@runtime_checkable
class SupportsWorkerStates(Protocol):
    """An index written by agents in other processes (Redis) that also keeps each agent's
    published KV-event ingest state: worker id -> the dict of
    :meth:`kvcore.kv_events.EventIngestor.state` (last seq, event age, gaps, replays, resyncs,
    blocks by tier), for workers whose agent is alive. The gateway's admin API shows it as the
    worker's ``kv_events``. Raises :class:`kvcore.index.errors.IndexUnavailable`."""

    async def worker_states(self) -> dict[str, dict[str, Any]]: ...
