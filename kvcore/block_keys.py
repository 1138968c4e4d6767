"""Block keys: our chained hash over full blocks of prompt tokens.

This is a wire format (keys are stored in Redis and compared across processes), so the encoding is
fixed and versioned here. Both the gateway (from a prompt's token ids) and the offload agent (from a
vLLM ``BlockStored`` event's ``token_ids``) call :func:`block_keys`, so keys never depend on vLLM's
own hash algorithm, its seed or ``PYTHONHASHSEED``.

Encoding (version 1), all integers little-endian, hash = ``xxhash.xxh3_64_intdigest``:

- root = H(b"kvroute/v1\\x00" + utf8(model))                       (the model identity)
- key_i = H(u64(key_{i-1}) + u32[block_size](tokens of block i) + extras_i)
  where key_{-1} = root and ``extras_i`` is the concatenation of tagged items:
    - LoRA adapter name, on every block (vLLM puts ``("lora", name, path)`` on every block):
      b"L" + u32(len) + utf8(name)
    - cache salt, on block 0 only (vLLM puts ``("cache_salt", salt)`` in block 0's extra keys):
      b"S" + u32(len) + utf8(salt)
    - each multimodal item overlapping the block, in prompt order: b"M" + u32(len) + utf8(hash)
      + i32(item start - block start), the item's offset vLLM mixes into the block's hash
      (``("mm", identifier, offset)`` in ``vllm/v1/core/kv_cache_utils.py``; negative when the
      item began in an earlier block)
  The one-byte tag keeps a LoRA named "x" distinct from a salt "x".
- Only full blocks are keyed: a prompt of n tokens has ``n // block_size`` keys.

Keys are unsigned 64-bit ints (0 <= key < 2**64).
"""
from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

try:  # the loop below in C (kvcore/_block_keys_native.c), where it was built
    from kvcore._block_keys_native import chain as _native_chain
except ImportError:  # pragma: no cover - built wherever xxhash.h is found
    _native_chain = None

NATIVE = _native_chain is not None
"""Whether keys of blocks without extras come from the C chain (the same keys as the Python
loop; ``tests/test_block_keys.py`` compares them)."""

ENCODING_VERSION = 1
"""Version of the encoding above. Bump it with any change that alters a key (and the root prefix
with it). The Redis index stores it per namespace and refuses a process on another version
(:class:`kvcore.index.errors.IndexEncodingMismatch`)."""
_ROOT_PREFIX = b"kvroute/v1\x00"
_h = xxhash.xxh3_64_intdigest
_U32 = next(c for c in "IL" if array.array(c).itemsize == 4)
_SWAP = sys.byteorder == "big"


@dataclass(frozen=True)
class BlockExtras:
    """What besides token ids makes a block distinct (vLLM's block "extra keys").

    ``lora_name``: LoRA adapter name or None; ``cache_salt``: the request's ``cache_salt`` or None;
    ``mm_hashes``: ``(identifier, start_token, length_tokens)`` of the prompt's multimodal items,
    sorted by start: vLLM's multimodal hash of each item and its placeholder range in the prompt.
    """

    lora_name: str | None = None
    cache_salt: str | None = None
    mm_hashes: tuple[tuple[str, int, int], ...] = field(default_factory=tuple)

    def is_empty(self) -> bool:
        return self.lora_name is None and self.cache_salt is None and not self.mm_hashes


NO_EXTRAS = BlockExtras()


def _tagged(tag: bytes, text: str) -> bytes:
    raw = text.encode("utf-8")
    return tag + struct.pack("<I", len(raw)) + raw


def root_key(model: str) -> int:
    """The chain's root for ``model`` (the served model name): an unsigned 64-bit int."""
    return _h(_ROOT_PREFIX + model.encode("utf-8"))


def _extras_for_block(extras: BlockExtras, index: int, block_size: int) -> bytes:
    if extras.is_empty():
        return b""
    out = b""
    if extras.lora_name is not None:
        out += _tagged(b"L", extras.lora_name)
    if index == 0 and extras.cache_salt is not None:
        out += _tagged(b"S", extras.cache_salt)
    lo, hi = index * block_size, (index + 1) * block_size
    for mm_hash, start, length in extras.mm_hashes:
        if start < hi and start + length > lo:
            out += _tagged(b"M", mm_hash) + struct.pack("<i", start - lo)
    return out


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    model: str,
    extras: BlockExtras = NO_EXTRAS,
    parent: int | None = None,
    first_block_index: int = 0,
) -> list[int]:
    """Keys of the full blocks of ``token_ids``.

    ``token_ids``: prompt token ids (each 0 <= id < 2**32). ``block_size``: tokens per block, the
    engine's ``--block-size``. ``model``: the served model name (mixed into the root).
    ``parent``/``first_block_index``: continue a chain, as the agent does for a ``BlockStored``
    whose ``parent_block_hash`` names an earlier block; ``parent`` is that block's key and
    ``first_block_index`` its index + 1 (it decides where the salt goes).
    Returns ``len(token_ids) // block_size`` keys. Raises ValueError on block_size < 1 or a token
    id out of the u32 range.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    key = root_key(model) if parent is None else parent
    try:
        packed = array.array(_U32, token_ids if len(token_ids) == n_blocks * block_size
                             else token_ids[:n_blocks * block_size])
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token id out of range for block keys: {exc}") from None
    if _SWAP:
        packed.byteswap()
    step = 4 * block_size
    if _native_chain is not None and extras.is_empty():  # the common case, in C
        return _native_chain(packed, step, key)
    raw = packed.tobytes()  # u32 little-endian, block after block
    keys: list[int] = []
    h, append = _h, keys.append
    if extras.is_empty():  # the common case, without the per-block extras call
        for lo in range(0, n_blocks * step, step):
            key = h(key.to_bytes(8, "little") + raw[lo:lo + step])
            append(key)
        return keys
    for i, lo in enumerate(range(0, n_blocks * step, step)):
        key = h(key.to_bytes(8, "little") + raw[lo:lo + step] + _extras_for_block(extras, first_block_index + i, block_size))
        append(key)
    return keys
