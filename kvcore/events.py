"""vLLM KV cache events: the wire types, one decoder for every shape we meet, and the encoder the
simulator uses.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``): each ZMQ PUB message is three frames
``[topic, seq as 8-byte big-endian, payload]``; the payload is msgpack ``[ts, [event, ...],
data_parallel_rank]``. In vLLM 0.32 an event is a msgpack map with a ``type`` field (the class
name); vLLM <= 0.11 sent an array ``["BlockStored", field, ...]`` in declaration order. Engine block
hashes are uint64 ints by default, or raw digest bytes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``. Fields still at their default are omitted on the wire.

The replay socket (ROUTER, bound by vLLM) answers a DEALER's ``[b"", start_seq (8B)]`` with one
``[b"", topic, seq (8B), payload]`` per buffered batch with seq >= start_seq, then
``[b"", b"", (-1 as signed 8B), b""]``.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

EngineHash = Union[int, bytes]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks became full and cacheable. ``token_ids`` has ``len(block_hashes) * block_size`` ids
    (empty for vLLM's CPU-offload placeholder events, where ``block_size`` is 0);
    ``parent_block_hash`` is the engine hash of the block before the first one, None from block 0."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks left the cache (vLLM sends these lazily, when a freed block is reused)."""

    block_hashes: list[EngineHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The whole prefix cache was reset (``POST /reset_prefix_cache``)."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: ``ts`` (unix seconds), ``events``, ``data_parallel_rank``."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


# The pre-0.12 shape: tagged arrays with the fields in declaration order.
class _OldBlockStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _OldBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class _OldAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _OldEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[_OldBlockStored, _OldBlockRemoved, _OldAllBlocksCleared]]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)
_old_decoder = msgspec.msgpack.Decoder(_OldEventBatch)
_encoder = msgspec.msgpack.Encoder()


class EventDecodeError(ValueError):
    """A payload that is neither vLLM 0.32's map-shaped batch nor the older array-shaped one."""


def _from_old(ev: _OldBlockStored | _OldBlockRemoved | _OldAllBlocksCleared) -> KVCacheEvent:
    if isinstance(ev, _OldBlockStored):
        return BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                           ev.lora_id, ev.medium, ev.lora_name, ev.extra_keys, ev.group_idx)
    if isinstance(ev, _OldBlockRemoved):
        return BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload frame into an :class:`EventBatch` of typed events.

    Accepts vLLM 0.32's map-shaped events and the older array-shaped ones; both come out as the
    same types. Raises :class:`EventDecodeError` on anything else.
    """
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as first:
        try:
            old = _old_decoder.decode(payload)
        except msgspec.DecodeError:
            raise EventDecodeError(f"undecodable KV event batch: {first}") from None
        return EventBatch(old.ts, [_from_old(e) for e in old.events], old.data_parallel_rank)


def encode_batch(batch: EventBatch) -> bytes:
    """Encode a batch exactly as vLLM 0.32's publisher does (msgspec msgpack, defaults omitted)."""
    return _encoder.encode(batch)


def seq_bytes(seq: int) -> bytes:
    """A sequence number as the 8-byte big-endian (signed) frame vLLM sends."""
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(raw: bytes) -> int:
    """Inverse of :func:`seq_bytes`; -1 marks the end of a replay."""
    return int.from_bytes(raw, "big", signed=True)


REPLAY_END_SEQ = -1
