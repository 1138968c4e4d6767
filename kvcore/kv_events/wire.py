"""vLLM KV cache events: the wire types, one decoder for every shape we meet, and the encoder the
simulator uses.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``): each ZMQ PUB message is three frames
``[topic, seq as 8-byte big-endian, payload]``; the payload is msgpack ``[ts, [event, ...],
data_parallel_rank]``. In vLLM 0.32 an event is a msgpack map with a ``type`` field (the class
name); vLLM <= 0.11 sent an array ``["BlockStored", field, ...]`` in declaration order. Engine block
hashes are uint64 ints by default, or raw digest bytes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``. Fields still at their default are omitted on the wire.

Decoding is per event where it must be: an event of a type we do not know (vLLM adds kinds every
few releases, and a cluster's workers are upgraded one at a time), or a known one that does not
decode (a required field missing, a field of another type), is left out of the batch and reported
as a :class:`SkippedEvent`; the batch's other events still apply. Unknown keys of a known event
(map-shaped) and extra trailing fields (array-shaped) are ignored. Map- and array-shaped events may
be mixed in one batch.

The replay socket (ROUTER, bound by vLLM) answers a DEALER's ``[b"", start_seq (8B)]`` with one
``[b"", topic, seq (8B), payload]`` per buffered batch with seq >= start_seq, then
``[b"", b"", (-1 as signed 8B), b""]``.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Union

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
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _OldBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _OldAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _OldEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[_OldBlockStored, _OldBlockRemoved, _OldAllBlocksCleared]]
    data_parallel_rank: int | None = None


_OldEvent = Union[_OldBlockStored, _OldBlockRemoved, _OldAllBlocksCleared]


class _RawEventBatch(msgspec.Struct, array_like=True):
    """A batch whose events are left undecoded (the per-event path)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)
_old_decoder = msgspec.msgpack.Decoder(_OldEventBatch)
_raw_decoder = msgspec.msgpack.Decoder(_RawEventBatch)
_event_decoder = msgspec.msgpack.Decoder(KVCacheEvent)
_old_event_decoder = msgspec.msgpack.Decoder(_OldEvent)
_any_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()

KNOWN_EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
UNKNOWN_TYPE = "unknown_type"
MALFORMED = "malformed"
_NO_TYPE = "?"
_TYPE_NAME_MAX = 64


class EventDecodeError(ValueError):
    """A payload that is not a batch ``[ts, [event, ...], data_parallel_rank]`` at all."""


class SkippedEvent(NamedTuple):
    """An event :func:`decode_batch` left out of its batch.

    ``type``: the event's type name (the map's ``type`` value, or an array's first item), cut to
    64 characters; ``"?"`` when it has none. ``reason``: ``"unknown_type"`` (a type other than
    BlockStored, BlockRemoved, AllBlocksCleared) or ``"malformed"`` (a known type that does not
    decode, or no type at all). ``error``: msgspec's message for a malformed one, else ``""``."""

    type: str
    reason: str
    error: str


def _from_old(ev: _OldEvent) -> KVCacheEvent:
    if isinstance(ev, _OldBlockStored):
        return BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                           ev.lora_id, ev.medium, ev.lora_name, ev.extra_keys, ev.group_idx,
                           ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.locality,
                           ev.ownership, ev.session_id)
    if isinstance(ev, _OldBlockRemoved):
        return BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx, ev.locality, ev.ownership)
    return AllBlocksCleared()


def decode_event(raw: bytes | msgspec.Raw) -> KVCacheEvent | SkippedEvent:
    """One msgpack-encoded event, map-shaped (vLLM 0.32) or array-shaped (vLLM <= 0.11), as a
    typed event, or a :class:`SkippedEvent` saying why it cannot be one."""
    try:
        return _event_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        error = str(exc)
    try:
        return _from_old(_old_event_decoder.decode(raw))
    except msgspec.DecodeError as exc:
        old_error = str(exc)
    try:
        obj = _any_decoder.decode(raw)
    except msgspec.DecodeError:
        obj = None
    if isinstance(obj, dict):
        name = obj.get("type")
    elif isinstance(obj, list) and obj:
        name, error = obj[0], old_error
    else:
        name = None
    if not isinstance(name, str):
        return SkippedEvent(_NO_TYPE, MALFORMED, error)
    name = name[:_TYPE_NAME_MAX]
    if name in KNOWN_EVENT_TYPES:
        return SkippedEvent(name, MALFORMED, error)
    return SkippedEvent(name, UNKNOWN_TYPE, "")


def decode_batch(payload: bytes, skipped: list[SkippedEvent] | None = None) -> EventBatch:
    """Decode one payload frame into an :class:`EventBatch` of typed events.

    Accepts vLLM 0.32's map-shaped events and the older array-shaped ones, also mixed in one
    batch; both come out as the same types. A batch whose events all decode is one msgspec decode
    (two for an array-shaped one); otherwise each event is decoded on its own
    (:func:`decode_event`) and those that cannot be are left out, in order, and appended to
    ``skipped`` when given. Raises :class:`EventDecodeError` when the payload is not a batch.
    """
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as first:
        try:
            old = _old_decoder.decode(payload)
        except msgspec.DecodeError:
            pass
        else:
            return EventBatch(old.ts, [_from_old(e) for e in old.events], old.data_parallel_rank)
        try:
            raw = _raw_decoder.decode(payload)
        except msgspec.DecodeError:
            raise EventDecodeError(f"undecodable KV event batch: {first}") from None
    events: list[KVCacheEvent] = []
    for item in raw.events:
        ev = decode_event(item)
        if isinstance(ev, SkippedEvent):
            if skipped is not None:
                skipped.append(ev)
        else:
            events.append(ev)
    return EventBatch(raw.ts, events, raw.data_parallel_rank)


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
