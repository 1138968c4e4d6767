"""The operations the tier planner hands the connector's worker side, one record per kind.

The scheduler side (:class:`~offload_agent.tiers.planner.TierPlanner`, and the connector for peer
pulls) builds them; they cross to vLLM's worker processes pickled inside the connector metadata, and
:class:`~offload_agent.connector.worker_ops.TierWorker` executes each step's list *in order*.
``slot`` is a row of the CPU tier's slab (``0 <= slot < cpu_slots``), ``key`` a block's tier key
(16 bytes, also its SSD file's name), ``gpu_block`` an index into vLLM's KV cache (one block of
``block_size`` tokens in every layer). What each kind guarantees:

- :class:`Save`: vLLM's ``gpu_block`` -> ``slot``, after the forward pass; the slot holds ``key`` once
  the copy has completed. Dropped, and reported as failed, when a load of the same step failed;
- :class:`LoadCpu`: ``slot`` -> vLLM's ``gpu_block``, before the forward pass, if the slot holds
  ``key`` (or a save of it is in flight); else the block is reported not loaded;
- :class:`LoadSsd`: ``key``'s SSD file -> vLLM's ``gpu_block`` through a staging buffer, once the
  key's SSD write in flight is done: before the forward pass, or in the background as part of an
  asynchronous load; a missing or damaged file reports the block not loaded;
- :class:`Promote`: ``key``'s SSD file -> ``slot``, before the forward pass (a :class:`LoadCpu` of
  the slot follows), once the key's SSD write and every copy touching the slot are done;
- :class:`Spill`: ``slot`` -> ``key``'s SSD file, if the slot holds ``key``; the slot's bytes are
  copied out at once (after every copy touching it; the slot may be reused by the next operation)
  and the file is written by a writer thread, in order with the key's other SSD operations;
- :class:`DropSsd`: delete ``key``'s SSD file, on the same writer thread (after its pending write);
- :class:`FailBlock`: report vLLM's ``gpu_block`` as not loaded (the planner holds its key in no
  tier; vLLM recomputes it);
- :class:`LoadPeer`: pull ``keys`` from the agent at ``peer`` (``host:port``) into vLLM's
  ``gpu_blocks`` (same length, in order), before the forward pass or in the background; the blocks
  from the first one that did not come on are reported not loaded. ``pd``: a P/D pull; in the
  background it asks again for blocks the peer does not hold yet (the prefill's saves may land after
  its answer) until the pull's deadline.

Loads run before the forward pass of their step (or start in the background), saves after it;
:class:`Spill`, :class:`DropSsd` and :class:`Promote` run where the planner placed them, among
either. Each record pickles to an equal record. They are plain slotted dataclasses, not frozen
ones: the scheduler builds one per block per step, and a frozen dataclass's ``__init__`` costs a
multiple of a plain one's; nothing changes a record once built.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Save:
    """vLLM's KV block ``gpu_block`` -> CPU ``slot``, as ``key`` (after the forward pass)."""

    slot: int
    key: bytes
    gpu_block: int


@dataclass(slots=True)
class LoadCpu:
    """CPU ``slot`` -> vLLM's ``gpu_block``, if the slot holds ``key`` (before the forward pass)."""

    slot: int
    key: bytes
    gpu_block: int


@dataclass(slots=True)
class LoadSsd:
    """``key``'s SSD file -> vLLM's ``gpu_block`` (through a staging buffer)."""

    key: bytes
    gpu_block: int


@dataclass(slots=True)
class Promote:
    """``key``'s SSD file -> CPU ``slot`` (the SSD copy stays)."""

    key: bytes
    slot: int


@dataclass(slots=True)
class Spill:
    """CPU ``slot`` -> ``key``'s SSD file, if the slot holds ``key`` (the slot is free after it)."""

    slot: int
    key: bytes


@dataclass(slots=True)
class DropSsd:
    """Delete ``key``'s SSD file."""

    key: bytes


@dataclass(slots=True)
class FailBlock:
    """Report vLLM's ``gpu_block`` as not loaded (vLLM recomputes it)."""

    gpu_block: int


@dataclass(slots=True)
class LoadPeer:
    """Pull ``keys`` (a prefix chain's run, in order) from the agent at ``peer`` (``host:port``) into
    vLLM's ``gpu_blocks`` (one per key); ``pd``: wait for blocks the peer does not hold yet (P/D)."""

    peer: str
    keys: list[bytes]
    gpu_blocks: list[int]
    pd: bool = False


TierOp = Save | LoadCpu | LoadSsd | Promote | Spill | DropSsd | FailBlock | LoadPeer
"""Any operation of a step's lists (module docstring)."""
