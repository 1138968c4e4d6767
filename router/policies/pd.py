"""The ``pd`` key of the policy config: prefill-decode disaggregation per model (issue 31)::

    pd: {enabled: false, models: [], min_prefill_tokens: 256, prefill_timeout_s: null}

``enabled``: disaggregation on; ``models``: the model names it applies to (base model names as
configured; an empty list: every model); ``min_prefill_tokens``: a request whose chosen decode
worker would prefill fewer uncached prompt tokens than this is served whole by that worker (the
prefill leg is skipped); ``prefill_timeout_s``: seconds the gateway waits for the prefill
worker's whole answer before it gives the leg up and the decode worker serves the request whole
(outcome ``prefill_failed``; the leg's connection is closed, so vLLM aborts it); null: the
gateway's ``timeouts.first_byte_s``. Which workers serve which leg is the workers' ``role``
(:class:`router.config.schema.WorkerConfig`); the legs are chosen by :mod:`router.route.pd`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.policies._config import boolean, check_keys, mapping, number

DEFAULT_MIN_PREFILL_TOKENS = 256
_KEYS = ("enabled", "models", "min_prefill_tokens", "prefill_timeout_s")


@dataclass(frozen=True)
class PDSettings:
    """Validated ``policy.pd``; :meth:`applies_to` tells whether a model's requests are split."""

    enabled: bool = False
    models: tuple[str, ...] = ()
    min_prefill_tokens: int = DEFAULT_MIN_PREFILL_TOKENS
    prefill_timeout_s: float | None = None  # None: timeouts.first_byte_s

    @classmethod
    def from_config(cls, value: Any) -> PDSettings:
        """From the ``pd`` mapping (None: the defaults, off). Raises ValueError naming the key:
        not a mapping, an unknown key, ``enabled`` not a bool, ``models`` not a list of non-empty
        strings, ``min_prefill_tokens`` not a whole number >= 0, ``prefill_timeout_s`` neither
        null nor a number > 0."""
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
        timeout = cfg.get("prefill_timeout_s")
        if timeout is not None:
            timeout = number(cfg, "prefill_timeout_s", 0.0, where, lo=-math.inf)
            if timeout <= 0:
                raise ValueError(f"{where}.prefill_timeout_s must be > 0 seconds (null: timeouts.first_byte_s), "
                                 f"got {cfg['prefill_timeout_s']!r}")
        return cls(boolean(cfg, "enabled", False, where), tuple(models), int(minimum), timeout)

    def config(self) -> dict[str, Any]:
        """The effective mapping (``GET /admin/policy``); ``from_config`` of it gives an equal one."""
        return {"enabled": self.enabled, "models": list(self.models), "min_prefill_tokens": self.min_prefill_tokens,
                "prefill_timeout_s": self.prefill_timeout_s}

    def applies_to(self, model: str) -> bool:
        """Whether requests for base model ``model`` are disaggregated (when both pools exist)."""
        return self.enabled and (not self.models or model in self.models)
