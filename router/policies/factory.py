"""Policy config -> policy object, and back (for ``GET /admin/policy``).

The config is the ``policy:`` mapping of DESIGN.md, the same for the YAML file and for
``PUT /admin/policy``::

    {name: ttft, tier_credit: {gpu: 1.0, cpu: 0.75, ssd: 0.25}, prefill_overhead_ms: 25,
     prefill_ms_per_token: 0.1, learn_prefill_rate: true, engine_waiting_prefill_tokens: 1024,
     spread_margin: 1.0, recompute_weight: 1.0, private_recompute_weight: 3.0,
     private_affinity_wait_s: 5.0}
    {name: kv_aware, tier_credit: {gpu: 1.0, cpu: 0.75, ssd: 0.25}, load_weight: 1.0,
     temperature: 0.0, overload_guard: {enabled: true, excess_tokens: 32768, ratio: 1.5},
     decode_tokens_per_request: 128, engine_waiting_prefill_tokens: 1024}
    {name: session, session_header: x-session-id, ...load keys}
    {name: round_robin | least_load, ...load keys}

Every policy also takes ``queue`` (:mod:`router.policies.queue`: the gateway's dispatch queue,
on by default for ``ttft`` only) and ``pd`` (:mod:`router.policies.pd`: prefill-decode
disaggregation per model, off by default). Each policy accepts only its own keys besides (listed in the error message); ``name`` defaults to
``ttft`` (lowest predicted TTFT, with the dispatch queue on; runs against other routers:
docs/tuning/ttft_policy.md); ``kv_aware`` stays for comparison. Adding a policy: one module with
a ``Policy`` subclass that has ``from_config`` and ``config``, and one line in :data:`_POLICIES`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.policies._config import mapping
from router.policies.base import Policy
from router.policies.pd import PDSettings
from router.policies.kv_aware import KVAwarePolicy
from router.policies.least_load import LeastLoadPolicy
from router.policies.queue import QueueSettings
from router.policies.round_robin import RoundRobinPolicy
from router.policies.session import SessionPolicy
from router.policies.ttft import TTFTPolicy

_POLICIES = {cls.name: cls for cls in (TTFTPolicy, KVAwarePolicy, RoundRobinPolicy, LeastLoadPolicy,
                                       SessionPolicy)}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = TTFTPolicy.name


def make_policy(cfg: Mapping[str, Any] | None) -> Policy:
    """A fresh policy from its config (None or {} -> ``kv_aware`` with defaults).

    Raises ValueError with a message fit for an HTTP 400 body: not a mapping, an unknown ``name``,
    a key the named policy does not take, or a value out of range. Nothing is shared between two
    calls, so a swap never disturbs the policy in use until the caller replaces it.
    """
    cfg = mapping({} if cfg is None else cfg, "policy")
    name = cfg.get("name", DEFAULT_POLICY)
    cls = _POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown policy name {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    policy = cls.from_config({k: v for k, v in cfg.items() if k not in ("name", "queue", "pd")})
    policy.queue = QueueSettings.from_config(cfg.get("queue"), cls.default_queue)
    policy.pd = PDSettings.from_config(cfg.get("pd"))
    return policy


def describe(policy: Policy) -> dict[str, Any]:
    """The policy's effective config, defaults filled in: ``{"name": ..., **keys}``.
    ``make_policy(describe(p))`` builds an equal policy."""
    config = getattr(policy, "config", None)
    return {"name": policy.name, **(config() if callable(config) else {}), "queue": policy.queue.config(),
            "pd": policy.pd.config()}
