"""``session``: requests with the same session key go to the same worker; without a key, least
load.

The key (``RouteRequest.session_key``) is filled by the gateway from the header named by
``session_header`` (default ``x-session-id``), else from the OpenAI body's ``user`` field.
Placement is rendezvous (highest-random-weight) hashing: each candidate's weight is
``xxh3_64(key + "\\0" + worker_id)`` and the highest wins. A key moves only when its own worker
leaves (or a newly added worker outranks it, about 1 key in N+1), so stickiness survives other
workers coming and going; no ring state is kept. Reason label ``session`` (``load`` when there is
no key); with a key, ``cost`` is None and the scores are in rendezvous order, so a retry goes to
the key's second choice, which is the same on every gateway.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import xxhash

from router.policies._config import check_keys
from router.policies.base import Candidate, CandidateScore, Decision, Policy, RouteRequest
from router.policies.least_load import LeastLoadPolicy
from router.policies.load import LOAD_KEYS, LoadModel

DEFAULT_SESSION_HEADER = "x-session-id"
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")  # RFC 9110 token, lower case


def rendezvous_weight(key: str, worker_id: str) -> int:
    """The unsigned 64-bit weight of ``worker_id`` for ``key`` (xxh3_64 of UTF-8 ``key\\0worker``)."""
    return xxhash.xxh3_64_intdigest(f"{key}\0{worker_id}".encode("utf-8", "surrogatepass"))


class SessionPolicy(Policy):
    """Sticky by session key (rendezvous hashing), least load without one."""

    name = "session"
    uses_index = False
    CONFIG_KEYS: tuple[str, ...] = LOAD_KEYS + ("session_header",)

    def __init__(self, load_model: LoadModel | None = None,
                 session_header: str = DEFAULT_SESSION_HEADER) -> None:
        self.session_header = session_header
        self._fallback = LeastLoadPolicy(load_model)

    @property
    def load_model(self) -> LoadModel:
        return self._fallback.load_model

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> SessionPolicy:
        """Build from the policy config without ``name``; ValueError on unknown keys, a bad weight
        or a ``session_header`` that is not an HTTP header name (it is lower-cased)."""
        check_keys(cfg, cls.CONFIG_KEYS, f"policy {cls.name!r}")
        header = cfg.get("session_header", DEFAULT_SESSION_HEADER)
        if not isinstance(header, str) or not _HEADER_NAME.match(header.lower()):
            raise ValueError(f"policy.session_header must be an HTTP header name such as "
                             f"{DEFAULT_SESSION_HEADER!r}, got {header!r}")
        return cls(LoadModel.from_config(cfg, "policy"), header.lower())

    def config(self) -> dict[str, Any]:
        """The effective config without ``name``."""
        return {**self.load_model.config(), "session_header": self.session_header}

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        key = request.session_key
        if key is None or key == "":
            return self._fallback.choose(request, candidates)
        ranked = sorted(candidates, key=lambda c: (-rendezvous_weight(key, c.worker_id), c.worker_id))
        scores = [CandidateScore(c.worker_id, c.matched,
                                 self.load_model.load_blocks(c.load, request.block_size), None)
                  for c in ranked]
        return Decision(ranked[0].worker_id, "session", scores)
