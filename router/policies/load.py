"""The load figure every policy uses: a worker's outstanding work in prompt blocks.

    requests      = max(in_flight, engine_running + engine_waiting)     # scrape, when present
    unseen_wait   = max(0, engine_waiting - (in_flight - decoding))     # queued, not sent by us
    load_tokens   = prefill_tokens
                  + unseen_wait x engine_waiting_prefill_tokens
                  + requests x decode_tokens_per_request
    load (blocks) = load_tokens / block_size

- ``prefill_tokens`` is the gateway's own prediction of the uncached prompt tokens still to be
  prefilled (see :class:`~router.policies.base.WorkerLoad`).
- Decode work counts every in-flight request, not only those past their first byte: a request
  whose prompt is fully cached has no prefill tokens, yet it takes a decode slot at once, so a
  burst of such requests must still show up as load on the worker they go to.
- The engine's scrape (vLLM ``num_requests_running`` / ``num_requests_waiting``) sees requests
  from other gateways and clients; the gateway's counts are fresher. Taking the larger of the two
  request counts uses whichever knows more. Engine-waiting requests beyond our own unstarted ones
  have prompts of unknown size; each counts ``engine_waiting_prefill_tokens``.
- Weights are in tokens so that a decision does not change with the block size: prefill cost and
  load both scale by ``1 / block_size``.

Defaults: ``decode_tokens_per_request`` 128 (a decoding request weighs as much as 128 prompt
tokens still to prefill, so 32 extra decoding requests equal one 4k-token prefill);
``engine_waiting_prefill_tokens`` 1024 (the mean prefill SMG's ``least_load`` assumes).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.policies._config import check_keys, number
from router.policies.base import Policy, WorkerLoad

LOAD_KEYS = ("decode_tokens_per_request", "engine_waiting_prefill_tokens")


@dataclass(frozen=True)
class LoadModel:
    """Turns a :class:`WorkerLoad` into blocks of outstanding work (module docstring)."""

    decode_tokens_per_request: float = 128.0
    engine_waiting_prefill_tokens: float = 1024.0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], where: str) -> LoadModel:
        """Read :data:`LOAD_KEYS` from a policy config (missing keys take the defaults).
        Raises ValueError on a negative or non-numeric weight."""
        return cls(
            decode_tokens_per_request=number(cfg, "decode_tokens_per_request",
                                             cls.decode_tokens_per_request, where),
            engine_waiting_prefill_tokens=number(cfg, "engine_waiting_prefill_tokens",
                                                 cls.engine_waiting_prefill_tokens, where))

    def config(self) -> dict[str, float]:
        """The effective values, keyed as in the config."""
        return {"decode_tokens_per_request": self.decode_tokens_per_request,
                "engine_waiting_prefill_tokens": self.engine_waiting_prefill_tokens}

    def load_blocks(self, load: WorkerLoad, block_size: int) -> float:
        """Outstanding work of one worker in blocks of ``block_size`` tokens (>= 0)."""
        requests = load.in_flight
        waiting = load.engine_waiting or 0
        if load.engine_running is not None or load.engine_waiting is not None:
            requests = max(requests, (load.engine_running or 0) + waiting)
        unseen_waiting = max(0, waiting - max(0, load.in_flight - load.decoding))
        tokens = (max(0, load.prefill_tokens)
                  + unseen_waiting * self.engine_waiting_prefill_tokens
                  + max(0, requests) * self.decode_tokens_per_request)
        return tokens / max(1, block_size)


class LoadModelPolicy(Policy):
    """Base of the policies whose only settings are the load model's (:data:`LOAD_KEYS`)."""

    CONFIG_KEYS: tuple[str, ...] = LOAD_KEYS

    def __init__(self, load_model: LoadModel | None = None) -> None:
        self.load_model = load_model or LoadModel()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> LoadModelPolicy:
        """Build from the policy config without ``name``; ValueError on unknown keys or bad values."""
        check_keys(cfg, cls.CONFIG_KEYS, f"policy {cls.name!r}")
        return cls(LoadModel.from_config(cfg, "policy"))

    def config(self) -> dict[str, Any]:
        """The effective config without ``name``."""
        return self.load_model.config()
