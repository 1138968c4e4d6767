"""Index backend from config: ``make_index({"backend": "memory" | "redis", ...})``.

One constructor per backend; a new backend is one file beside ``memory.py`` and one branch here.
"""
from __future__ import annotations

import importlib
from typing import Any

from kvcore.index.base import KVIndex
from kvcore.index.memory import MemoryIndex

# backend name -> (module, class); modules other than memory are imported only when chosen
_BACKENDS: dict[str, tuple[str, str]] = {
    "redis": ("kvcore.index.redis", "RedisIndex"),
}


def make_index(cfg: dict[str, Any] | None) -> KVIndex:
    """An index backend for ``cfg``.

    ``{"backend": "memory", "max_keys": N?}`` -> :class:`MemoryIndex`; other backends get the
    remaining keys as keyword arguments (e.g. ``{"backend": "redis", "url": "redis://..."}``).
    Raises ValueError for an unknown backend or arguments it does not take.
    """
    cfg = dict(cfg or {})
    backend = cfg.pop("backend", "memory")
    if backend == "memory":
        return MemoryIndex(**_only(cfg, {"max_keys"}, backend))
    if backend not in _BACKENDS:
        raise ValueError(f"unknown index backend {backend!r}; expected memory or {sorted(_BACKENDS)}")
    module, name = _BACKENDS[backend]
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"index backend {backend!r} is not available: {exc}") from None
    try:
        return cls(**cfg)
    except TypeError as exc:
        raise ValueError(f"bad arguments for index backend {backend!r}: {exc}") from None


def _only(cfg: dict[str, Any], allowed: set[str], backend: str) -> dict[str, Any]:
    extra = set(cfg) - allowed
    if extra:
        raise ValueError(f"index backend {backend!r} takes {sorted(allowed)}, got {sorted(extra)}")
    return cfg
