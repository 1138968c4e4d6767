"""Checks for policy config values (the ``policy:`` mapping of the YAML config and of
``PUT /admin/policy``). Every failure raises ValueError naming the key path, the bad value and what
is allowed, so the admin API can return it as a 400 message unchanged.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def check_keys(cfg: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """Raise ValueError if ``cfg`` has a key outside ``allowed`` (``where`` names the mapping,
    e.g. ``"policy 'kv_aware'"``)."""
    allowed = sorted(allowed)
    unknown = sorted(str(k) for k in cfg if k not in allowed)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} in {where}; "
                         f"allowed keys: {', '.join(allowed)}")


def mapping(value: Any, where: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping with string keys, else ValueError."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{where} must be a mapping of names to values, got {value!r}")
    return value


def number(cfg: Mapping[str, Any], key: str, default: float, where: str, *, lo: float = 0.0,
           hi: float = math.inf) -> float:
    """``cfg[key]`` (``default`` when absent) as a float within ``[lo, hi]``. Booleans, strings,
    NaN and infinities are rejected with ValueError."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}.{key} must be a finite number, got {value!r}")
    if not lo <= value <= hi:
        bounds = f">= {lo:g}" if hi == math.inf else f"between {lo:g} and {hi:g}"
        raise ValueError(f"{where}.{key} must be {bounds}, got {value!r}")
    return float(value)


def boolean(cfg: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """``cfg[key]`` (``default`` when absent), which must be a real bool."""
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be true or false, got {value!r}")
    return value
