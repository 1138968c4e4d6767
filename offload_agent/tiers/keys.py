"""Tier keys: the content address of a KV block in the CPU and SSD tiers.

A tier key names the KV of one full block *and everything before it*, for one KV layout:

    root    = blake2b-128(b"kvroute-tier-v1" | fingerprint digest (16 B) | salt)
    key_0   = blake2b-128(root  | token ids of block 0 as little-endian uint32)
    key_i   = blake2b-128(key_{i-1} | token ids of block i as little-endian uint32)

``salt`` is ``cache_salt`` (UTF-8) tagged ``b"salt:"``, or empty. Keys are 16 bytes. They never
depend on vLLM's block hash (whose seed changes at each vLLM start unless PYTHONHASHSEED is set),
so blocks written to SSD by one vLLM run are found by the next one. Only stdlib is used: this
module runs inside vLLM's interpreter, which may lack xxhash.

Requests whose KV depends on more than tokens and salt (LoRA adapters, multimodal inputs, prompt
embeddings) get no tier keys; the connector skips them.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

KEY_BYTES = 16
_DOMAIN = b"kvroute-tier-v1"


@dataclass(frozen=True)
class TierFingerprint:
    """What a stored block's bytes depend on besides its tokens.

    ``model``: model identity (path or name, as vLLM was given it); ``num_layers``: attention layers
    saved per block; ``dtype``: KV cache dtype name (e.g. ``"bfloat16"``); ``block_size``: tokens
    per block; ``block_bytes``: bytes of one block over all layers; ``layout``: per-layer block
    shape as text (e.g. ``"1x32x128"``); ``tp_rank``/``tp_size``: tensor-parallel shard.
    """

    model: str
    num_layers: int
    dtype: str
    block_size: int
    block_bytes: int
    layout: str = ""
    tp_rank: int = 0
    tp_size: int = 1

    def digest(self) -> bytes:
        """16-byte blake2b digest of the canonical JSON form."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(text, digest_size=KEY_BYTES).digest()

    def dir_name(self) -> str:
        """Folder name of this fingerprint's SSD files: ``fp-<first 16 hex digits of digest>``."""
        return "fp-" + self.digest().hex()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)


def tier_root(fingerprint_digest: bytes, cache_salt: str | None = None) -> bytes:
    """The chain's root for one fingerprint and salt (16 bytes)."""
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    return hashlib.blake2b(_DOMAIN + fingerprint_digest + salt, digest_size=KEY_BYTES).digest()


def tier_block_keys(token_ids: Sequence[int], block_size: int, root: bytes,
                    start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` from block ``start`` on (a partial tail is ignored).

    ``parent`` is the key of block ``start - 1`` (required when ``start > 0``). Raises ValueError
    for a bad block size, a missing parent or a token id outside uint32.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start > 0 and parent is None:
        raise ValueError("parent key required when start > 0")
    prev = root if start == 0 else parent
    n_full = len(token_ids) // block_size
    fmt = f"<{block_size}I"
    keys: list[bytes] = []
    for b in range(start, n_full):
        try:
            data = struct.pack(fmt, *token_ids[b * block_size:(b + 1) * block_size])
        except struct.error as exc:
            raise ValueError(f"token id out of uint32 range in block {b}") from exc
        prev = hashlib.blake2b(prev + data, digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys
