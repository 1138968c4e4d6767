"""The ``queue`` key of any policy config: the gateway's dispatch queue (late binding,
shortest prefill first), which :mod:`router.route.dispatch_queue` runs.

    policy: {name: ttft, queue: {enabled: true, worker_prefills: 1, holder_prefills: 2,
                                 worker_queue_ms: 50, settle_ms: 50, affinity: policy,
                                 affinity_wait_s: 5, max_wait_s: 10}}

- ``enabled`` (default true for ``ttft``, false for the other policies: each policy's
  ``default_queue``): requests wait in the gateway, not in the engines' queues, until a worker is
  *open*, then the shortest waiting prefill goes first.
- ``worker_prefills`` (2; 1 for ``ttft``): a worker is open while fewer than this many requests
  are before their first byte there (sent or on their way, through any gateway process). 2 keeps
  one request waiting in the engine behind the one in prefill, so the engine never idles between
  them while the next one crosses the network and its API server; the rest wait here, shortest
  first, and go to whichever worker opens (late binding). 1 sends the next request only once
  the last one's first byte came, or, with ``worker_queue_ms``, once the last prefill is
  predicted to end within that many ms.
- ``holder_prefills`` (2): the same limit for a request whose longest cached prefix the worker
  holds, beyond what every routable worker holds (a conversation's history, a group's shared
  document; not a system prompt all workers hold); the larger of the two applies. With
  ``worker_prefills: 1`` it sends a follow-up to its holder while one request is in prefill
  there, where it waits in the engine, instead of in the gateway, where past
  ``affinity_wait_s`` it would go elsewhere and compute its prefix again.

  Where a prefill takes seconds (long prompts on a busy GPU), holding requests in the gateway
  keeps late binding and shortest-first order: there ``worker_prefills: 1, holder_prefills: 2``
  is the better setting. Where it takes ~150 ms (a mid-size prompt on a GPU), the engine idling
  while the next request crosses the gateway, the network and the API server costs more: there
  ``worker_prefills: 2`` is. ``worker_queue_ms`` (below) joins the two.
- ``worker_queue_ms`` (0; 50 for ``ttft``): a worker is also open while the prefill its requests
  are predicted to have left (the policy's TTFT predictions at dispatch, counted from then) is at
  most this. A request past its predicted first byte counts as prefill left until that byte
  comes. ``ttft``'s default pair, ``worker_prefills: 1, worker_queue_ms: 50``, joins the two
  settings above: where a prefill takes seconds the next request is held (late binding, shortest
  first) until the last one is nearly done; where it takes ~100 ms it leaves almost at once, as
  with 2, and waits in the engine.
- ``settle_ms`` (50, every policy): whatever the limits above allow, a worker takes no request
  within this long of the last one sent there (or reserved for it) that has not had its first
  byte. Until then that request may not have reached the engine: the next could arrive first,
  and the engine, which serves its running prefills first and in order, would make the earlier
  one wait out the newcomer's whole prefill; or both arrive before the engine's next step and
  the earlier one waits out the newcomer's first chunk (the step's token budget). Gateway
  processes take a worker under one lock, so two of them woken by the same event never both
  send it a request (:meth:`~router.shared.load_table.SharedLoadTable.claim`).
- ``affinity`` (``policy``): which workers a request waits for. ``holder``: those holding its
  longest cached prefix (within one block); ``policy``: the one the policy would choose among all
  routable workers, busy ones included (a busy holder is waited for only while that beats
  recomputing the prefix elsewhere, by the policy's own cost).
- ``affinity_wait_s`` (2; 5 for ``ttft``): how long a request waits so before any open worker
  may take it. A policy may set a request's own wait (``Decision.affinity_wait_s``): ``ttft``
  waits ``private_affinity_wait_s`` (5 s, as the queue) for a conversation's follow-up.
- ``max_wait_s`` (10): a request that has waited this long goes before shorter ones (arrival
  order among such), so a long prompt is never starved by a stream of short ones.
- ``rematch_ms`` (200; 0: never; else at least 20): a waiting request looks its prompt up in the
  index again this often, so what it waits for is what the workers hold now, not what they held
  when it arrived: a holder whose copy was evicted (its KV events removed the blocks) is no longer waited for,
  and a prefix that a request dispatched meanwhile is computing (its speculative entries, then
  its events) is credited where it lands, so requests sharing a prefix that arrive together
  follow the first of them instead of each computing it on whichever worker opens first.

Tuning runs behind these defaults (``worker_prefills``, ``holder_prefills``, ``worker_queue_ms``,
``settle_ms``): docs/tuning/dispatch_queue.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from router.policies._config import boolean, check_keys, mapping, number

QUEUE_KEYS = ("enabled", "worker_prefills", "holder_prefills", "worker_queue_ms", "settle_ms", "affinity",
              "affinity_wait_s", "max_wait_s", "rematch_ms")
AFFINITY_RULES = ("holder", "policy")
MIN_REMATCH_MS = 20.0  # below this, every waiting request's lookups would load the index and the event loop


@dataclass(frozen=True)
class QueueSettings:
    """The dispatch queue's settings (module docstring); durations in ms or s as named."""

    enabled: bool = False
    worker_prefills: int = 2
    holder_prefills: int = 2
    worker_queue_ms: float = 0.0
    settle_ms: float = 50.0
    affinity: str = "policy"
    affinity_wait_s: float = 2.0
    max_wait_s: float = 10.0
    rematch_ms: float = 200.0

    @classmethod
    def from_config(cls, value: Any, defaults: QueueSettings | None = None) -> QueueSettings:
        """Build from the ``queue`` mapping, missing keys (or all, for None) taken from
        ``defaults`` (the policy's :attr:`~router.policies.base.Policy.default_queue`). Raises
        ValueError on unknown keys, a non-boolean ``enabled``, an unknown ``affinity``, a negative
        duration, a ``rematch_ms`` between 0 and ``MIN_REMATCH_MS``, or a ``worker_prefills`` or
        ``holder_prefills`` that is not a whole number >= 1."""
        base = defaults or cls()
        if value is None:
            return base
        cfg: Mapping[str, Any] = mapping(value, "policy.queue")
        where = "policy.queue"
        check_keys(cfg, QUEUE_KEYS, where)
        affinity = cfg.get("affinity", base.affinity)
        if affinity not in AFFINITY_RULES:
            raise ValueError(f"{where}.affinity must be one of {', '.join(AFFINITY_RULES)}, got {affinity!r}")
        prefills = number(cfg, "worker_prefills", base.worker_prefills, where, lo=1)
        if prefills != int(prefills):
            raise ValueError(f"{where}.worker_prefills must be a whole number, got {cfg['worker_prefills']!r}")
        holder = number(cfg, "holder_prefills", base.holder_prefills, where, lo=1)
        if holder != int(holder):
            raise ValueError(f"{where}.holder_prefills must be a whole number, got {cfg['holder_prefills']!r}")
        rematch_ms = number(cfg, "rematch_ms", base.rematch_ms, where)
        if 0 < rematch_ms < MIN_REMATCH_MS:
            raise ValueError(f"{where}.rematch_ms must be 0 (off) or at least {MIN_REMATCH_MS:g}, got {rematch_ms!r}")
        return cls(enabled=boolean(cfg, "enabled", base.enabled, where), affinity=affinity,
                   worker_prefills=int(prefills), holder_prefills=int(holder),
                   worker_queue_ms=number(cfg, "worker_queue_ms", base.worker_queue_ms, where),
                   settle_ms=number(cfg, "settle_ms", base.settle_ms, where),
                   affinity_wait_s=number(cfg, "affinity_wait_s", base.affinity_wait_s, where),
                   max_wait_s=number(cfg, "max_wait_s", base.max_wait_s, where),
                   rematch_ms=rematch_ms)

    def config(self) -> dict[str, Any]:
        """The effective values, keyed as in the config."""
        return asdict(self)
