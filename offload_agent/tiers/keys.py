"""Tier keys: the content address of a KV block in the CPU and SSD tiers.

A tier key names the KV of one full block *and everything before it*, for one KV layout:

    root    = blake2b-128(b"kvroute-tier-v1" | engine digest (16 B) | salt)
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


FORMAT = "kvroute-kv-v2"
"""Version of the stored byte format, part of every fingerprint. A block is its layers' pages in
the model's layer order, each page in vLLM's *logical* order (``[H, N, K|V]`` in vLLM 0.32, however
the cache is laid out in GPU memory); the page shape in bytes is in ``layout``. Blocks written under
another format (or none: kvroute before it) have another digest, so they are never read as this
one; the connector deletes such SSD folders of its own model at start."""


@dataclass(frozen=True)
class TierFingerprint:
    """What a stored block's bytes depend on besides its tokens: one *shard* of an engine's KV.

    ``model``: model identity (path or name, as vLLM was given it); ``num_layers``: attention layers
    saved per block (this shard's); ``dtype``: the KV cache dtype as vLLM names it (``"bfloat16"``,
    or the cache dtype such as ``"fp8_e4m3"`` when it is not ``auto``: fp8 caches are ``uint8``
    tensors); ``block_size``: tokens per block; ``block_bytes``: bytes of one block over this
    shard's layers; ``layout``: the logical page shape in bytes as the worker's KV cache views show
    it (e.g. ``"8x16x512"`` for ``[H, N, K|V]``; kernel-block splitting adds a dimension);
    ``heads``: KV heads x head size of the model's spec; ``tp_rank``/``tp_size`` and
    ``pp_rank``/``pp_size``: the tensor- and pipeline-parallel shard; ``layers``: digest of this shard's layer names (pipeline stages with
    equal layer counts differ); ``format``: :data:`FORMAT`.

    :meth:`digest` names the shard (its SSD folder, its CPU tier file, what a peer must match);
    :meth:`engine_digest` leaves the shard out: every rank and the scheduler of one engine share
    it, and it roots the tier keys, so one key names the same block in every shard.
    """

    model: str
    num_layers: int
    dtype: str
    block_size: int
    block_bytes: int
    layout: str = ""
    heads: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layers: str = ""
    format: str = FORMAT

    def digest(self) -> bytes:
        """16-byte blake2b digest of the canonical JSON form."""
        return _digest(asdict(self))

    def engine_digest(self) -> bytes:
        """16-byte digest of what every shard of the engine, and its scheduler, share (model, dtype,
        block size, heads, parallel sizes, format)."""
        shared = {k: v for k, v in asdict(self).items()
                  if k not in ("num_layers", "block_bytes", "layout", "tp_rank", "pp_rank", "layers")}
        return _digest({"engine": shared})

    def dir_name(self) -> str:
        """Folder name of this fingerprint's SSD files: ``fp-<first 16 hex digits of digest>``."""
        return "fp-" + self.digest().hex()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)


def _digest(fields: dict) -> bytes:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(text, digest_size=KEY_BYTES).digest()


def layer_names_digest(layer_names: Sequence[str]) -> str:
    """Short hex digest of a shard's layer names, in order (:attr:`TierFingerprint.layers`)."""
    return hashlib.blake2b("\n".join(layer_names).encode(), digest_size=8).hexdigest()


def tier_root(engine_digest: bytes, cache_salt: str | None = None) -> bytes:
    """The chain's root for one engine (:meth:`TierFingerprint.engine_digest`) and salt (16 bytes)."""
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    return hashlib.blake2b(_DOMAIN + engine_digest + salt, digest_size=KEY_BYTES).digest()


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
