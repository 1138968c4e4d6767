"""The ``pd`` key of the policy config: prefill-decode disaggregation per model (issue 31)::

    pd: {enabled: false, models: [], min_prefill_tokens: 256}

``enabled``: disaggregation on; ``models``: the model names it applies to (base model names as
configured; an empty list: every model); ``min_prefill_tokens``: a request whose chosen decode
worker would prefill fewer uncached prompt tokens than this is served whole by that worker (the
prefill leg is skipped). Which workers serve which leg is the workers' ``role``
(:class:`router.config.WorkerConfig`); the legs are chosen by :mod:`router.pd`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.policies._config import boolean, check_keys, mapping, number

DEFAULT_MIN_PREFILL_TOKENS = 256
_KEYS = ("enabled", "models", "min_prefill_tokens")


@dataclass(frozen=True)
class PDSettings:
    """Validated ``policy.pd``; :meth:`applies_to` tells whether a model's requests are split."""

    enabled: bool = False
    models: tuple[str, ...] = ()
    min_prefill_tokens: int = DEFAULT_MIN_PREFILL_TOKENS

    @classmethod
    def from_config(cls, value: Any) -> PDSettings:
        """From the ``pd`` mapping (None: the defaults, off). Raises ValueError naming the key:
        not a mapping, an unknown key, ``enabled`` not a bool, ``models`` not a list of non-empty
        strings, ``min_prefill_tokens`` not a whole number >= 0."""
        if value is None:
            return cls()
        where = "policy.pd"
        cfg: Mapping[str, Any] = mapping(value, where)
        check_keys(cfg, _KEYS, where)
        models = cfg.get("models", [])
        if not isinstance(models, (list, tuple)) or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"{where}.models must be a list of model names, got {models!r}")
        minimum = number(cfg, "min_prefill_tokens", DEFAULT_MIN_PREFILL_TOKENS, where)
        if minimum != int(minimum):
            raise ValueError(f"{where}.min_prefill_tokens must be a whole number of tokens, got {minimum!r}")
        return cls(boolean(cfg, "enabled", False, where), tuple(models), int(minimum))

    def config(self) -> dict[str, Any]:
        """The effective mapping (``GET /admin/policy``); ``from_config`` of it gives an equal one."""
        return {"enabled": self.enabled, "models": list(self.models), "min_prefill_tokens": self.min_prefill_tokens}

    def applies_to(self, model: str) -> bool:
        """Whether requests for base model ``model`` are disaggregated (when both pools exist)."""
        return self.enabled and (not self.models or model in self.models)
