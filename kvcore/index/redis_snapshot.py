"""Reading the Redis index into a mirror's local copy, shared by the standalone
(:mod:`kvcore.index.redis_mirror`) and cluster (:mod:`kvcore.index.redis_cluster_mirror`) mirrors:
the commands that read one worker's snapshot (under one key prefix: the namespace, or a cluster
partition's hash tag), their replies taken into a bootstrap, the bootstrap loaded into a
:class:`kvcore.index.memory.MemoryIndex`, and a heartbeat's expiry from its ``PTTL``. The keys read
are those of the schema in :mod:`kvcore.index.redis`.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from kvcore.index.base import TIERS
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import _command, _unpack

BOOTSTRAP_CHUNK = 16384  # keys stored per step while loading a snapshot


def hb_expiry(pttl: int, now: float) -> float:
    """When a heartbeat whose ``PTTL`` is ``pttl`` ms (-1: no TTL, -2: no key) expires, in the
    clock of ``now`` (``time.monotonic()`` s): inf without a TTL, 0.0 when gone."""
    return math.inf if pttl == -1 else (now + pttl / 1000.0 if pttl > 0 else 0.0)


def snapshot_commands(p: bytes, slot: int) -> list[bytes]:
    """The bootstrap's read of one worker under key prefix ``p``, to run in one ``MULTI``: the
    change-log seq, then the owned set (``SMEMBERS``) and the duplicate counters (``HGETALL``) of
    slot ``slot``, each for every tier in :data:`TIERS` order."""
    s = b"%d" % slot
    cmds = [_command(b"GET", p + b"seq")]
    cmds += [_command(b"SMEMBERS", p + b"o:" + s + b":%d" % t) for t in range(len(TIERS))]
    cmds += [_command(b"HGETALL", p + b"rc:" + s + b":%d" % t) for t in range(len(TIERS))]
    return cmds


def take_snapshot(name: str, r: Sequence[Any], since: int, floors: dict[str, int],
                  parts: list[tuple[str, str, bytes]], copies: list[tuple[str, str, list[bytes]]]) -> None:
    """Add worker ``name``'s replies ``r`` to :func:`snapshot_commands` (more may follow them) to
    a bootstrap: its seq to ``floors`` when past ``since`` (the log position tailing starts from),
    its packed keys per tier to ``parts`` and its duplicate counters (flat key, count, ...) per
    tier to ``copies``, as :func:`load_snapshot` takes them."""
    seq_w = int(r[0] or 0)
    if seq_w > since:
        floors[name] = seq_w
    for t, tier in enumerate(TIERS):
        if r[1 + t]:
            parts.append((name, tier, b"".join(r[1 + t])))
        if r[1 + len(TIERS) + t]:
            copies.append((name, tier, r[1 + len(TIERS) + t]))


async def load_snapshot(new: MemoryIndex, parts: list[tuple[str, str, bytes]],
                        copies: list[tuple[str, str, list[bytes]]]) -> None:
    """Load a bootstrap's ``parts`` (worker, tier, packed 8-byte keys), in steps that let lookups
    in, then its ``copies`` (worker, tier, flat [key, extra copies, ...]) of the keys ``new``
    took (not past its ``max_keys``). Empties ``parts``, freeing the keys' bytes early."""
    for _ in new.load_steps(parts, BOOTSTRAP_CHUNK):
        await asyncio.sleep(0)  # lookups go on (on the old copy, during a resync)
    parts.clear()
    for name, tier, flat in copies:
        for i in range(0, len(flat), 2):
            key = _unpack(flat[i])[0]
            if key in new.owned_keys(name, tier):  # not past max_keys
                new.add_copies_sync(name, tier, key, int(flat[i + 1]))
