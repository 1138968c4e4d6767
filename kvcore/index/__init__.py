"""Cluster index: one interface (:mod:`kvcore.index.base`), backends beside it."""
from kvcore.index.base import TIERS, KVIndex, TierMatch, WorkerIndexStats, check_tier
from kvcore.index.factory import make_index
from kvcore.index.memory import MemoryIndex

__all__ = ["TIERS", "KVIndex", "MemoryIndex", "TierMatch", "WorkerIndexStats", "check_tier", "make_index"]
