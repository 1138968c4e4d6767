"""Index backend from config: ``make_index({"backend": "memory" | "redis", ...})``.

One constructor per backend; a new backend is one file beside ``memory.py`` and one branch here.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from kvcore.index.base import KVIndex
from kvcore.index.memory import MemoryIndex

# backend name -> (module, class); modules other than memory are imported only when chosen
_BACKENDS: dict[str, tuple[str, str]] = {
    "redis": ("kvcore.index.redis", "RedisIndex"),
}
# with ``mirror: true`` (the default for redis): lookups from a local copy fed by Redis's change log
_MIRRORED: dict[str, tuple[str, str]] = {
    "redis": ("kvcore.index.redis_mirror", "RedisMirrorIndex"),
}
# with ``cluster: true``: the index sharded over a Redis Cluster (kvcore.index.redis_cluster)
_CLUSTER: dict[tuple[str, bool], tuple[str, str]] = {
    ("redis", False): ("kvcore.index.redis_cluster", "RedisClusterIndex"),
    ("redis", True): ("kvcore.index.redis_cluster_mirror", "RedisClusterMirrorIndex"),
}
REDIS_MIRROR_DEFAULT = True


HOST_KEYS = {"max_workers", "max_holder_sets"}  # sizes of the host index (kvcore.index.host)


def make_index(cfg: dict[str, Any] | None, host_path: str | Path | None = None) -> KVIndex:
    """An index backend for ``cfg``.

    ``{"backend": "memory", "max_keys": N?, "max_workers": N?, "max_holder_sets": N?}`` ->
    :class:`MemoryIndex` (``max_keys`` only), or with ``host_path`` (the gateway processes of
    one host, ``kvroute serve --processes N``) :class:`kvcore.index.host.HostIndex` in that file,
    shared by them (``max_keys`` defaults to its own, smaller bound there); other backends get the
    remaining keys as keyword arguments (e.g. ``{"backend": "redis", "url": "redis://..."}``).
    ``{"backend": "redis", "mirror": true}`` (the default) -> :class:`kvcore.index.redis_mirror.
    RedisMirrorIndex` (lookups from a local copy that Redis's change log keeps in step; its extra
    arguments such as ``poll_interval_s`` are accepted only with it); ``mirror: false`` -> the
    plain :class:`kvcore.index.redis.RedisIndex` (one Redis round trip per lookup).
    ``{"backend": "redis", "cluster": true}``: the index sharded over a Redis Cluster (``url``: any
    node), :class:`kvcore.index.redis_cluster_mirror.RedisClusterMirrorIndex` with the mirror,
    :class:`kvcore.index.redis_cluster.RedisClusterIndex` without (default false: one standalone
    Redis).
    Raises ValueError for an unknown backend or arguments it does not take.
    """
    cfg = dict(cfg or {})
    backend = cfg.pop("backend", "memory")
    cluster = cfg.pop("cluster", False)
    if not isinstance(cluster, bool):
        raise ValueError(f"index backend {backend!r}: cluster must be true or false, got {cluster!r}")
    if cluster and backend not in {b for b, _ in _CLUSTER}:
        raise ValueError(f"index backend {backend!r} has no cluster mode")
    if backend == "memory":
        sizes = _only(cfg, {"max_keys"} | HOST_KEYS, backend)
        for key, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"index backend 'memory': {key} must be a positive integer, got {value!r}")
        if host_path is not None:
            from kvcore.index.host import HostIndex
            return HostIndex(host_path, **sizes)
        return MemoryIndex(**{k: v for k, v in sizes.items() if k not in HOST_KEYS})
    if backend not in _BACKENDS:
        raise ValueError(f"unknown index backend {backend!r}; expected memory or {sorted(_BACKENDS)}")
    mirror = cfg.pop("mirror", REDIS_MIRROR_DEFAULT if backend in _MIRRORED else False)
    if not isinstance(mirror, bool):
        raise ValueError(f"index backend {backend!r}: mirror must be true or false, got {mirror!r}")
    if mirror and backend not in _MIRRORED:
        raise ValueError(f"index backend {backend!r} has no mirror")
    module, name = _CLUSTER[(backend, mirror)] if cluster else (_MIRRORED if mirror else _BACKENDS)[backend]
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
