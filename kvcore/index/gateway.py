"""The gateway as an offload agent's index, for clusters without Redis: the gateway's embedded
index already holds every worker's blocks (it subscribes to their KV events), so an agent that owns
its worker's tiers asks it where a prompt's blocks are and which peers serve them, and publishes
its own peer-pull state there (``kvroute agent --index http://GATEWAY``).

:class:`GatewayIndex` speaks to the admin routes of :mod:`router.edge.admin_peers` with the admin
bearer token, over one keep-alive connection pool:

- :meth:`GatewayIndex.match` -> ``POST /admin/index/match`` ``{"keys": [...]}``: per worker the
  longest run of the keys from block 0, by tier (:meth:`kvcore.index.base.KVIndex.match`'s answer);
- :meth:`GatewayIndex.worker_states` -> ``GET /admin/peers``: worker id -> the state its agent
  published (``"peer"``, ``"tiers"``, ``published_age_s``), as
  :class:`~kvcore.index.base.SupportsWorkerStates` answers, so
  :class:`offload_agent.tier_service.TierService` takes it as its ``index``;
- :meth:`GatewayIndex.publish_state` -> ``PUT /admin/workers/{id}/peer?ttl_s=S``,
  :meth:`GatewayIndex.withdraw_state` -> ``DELETE`` of the same.

It is read-only as an index (no ``store``/``remove``: the gateway ingests the KV events itself).
Every call raises :class:`kvcore.index.errors.IndexUnavailable` when the gateway cannot be reached,
times out or answers other than 200 (:class:`GatewayRefused` for 401/403: a wrong admin token);
after one that the gateway refused or failed, the next call tries again at once.
``encoding_error`` is set (a message) when a publish's answer names another block-key encoding
version than this process computes (:data:`kvcore.block_keys.ENCODING_VERSION`): none of its keys
could match ours, and the agent stops.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from kvcore.block_keys import ENCODING_VERSION
from kvcore.index.base import TierMatch
from kvcore.index.errors import IndexUnavailable

MATCH_TIMEOUT_S = 1.0  # a lookup serves a connector waiting ~100 ms (peer_locate_timeout_ms): fail fast
CALL_TIMEOUT_S = 3.0


class GatewayRefused(IndexUnavailable):
    """The gateway answered 401 or 403: the admin token is missing or wrong."""


def is_gateway_url(url: str) -> bool:
    """Whether ``url`` names a gateway (``http://`` or ``https://``) rather than a Redis index."""
    return url.startswith(("http://", "https://"))


class GatewayIndex:
    """The gateway at ``url`` (``http://host:port``, its base URL) as an index; ``token``: its
    admin token (None: no Authorization header, every call then fails with GatewayRefused).
    ``match_timeout_s``/``timeout_s``: bounds of a lookup and of the other calls, in seconds."""

    def __init__(self, url: str, token: str | None, match_timeout_s: float = MATCH_TIMEOUT_S,
                 timeout_s: float = CALL_TIMEOUT_S) -> None:
        if not is_gateway_url(url):
            raise ValueError(f"{url!r}: expected the gateway's http(s)://host:port")
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.match_timeout_s = match_timeout_s
        self.timeout_s = timeout_s
        self.encoding_error: str | None = None
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        data = orjson.dumps(body) if body is not None else None
        headers = {"content-type": "application/json"} if data is not None else None
        try:
            async with self._client().request(method, self.url + path, data=data, headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise IndexUnavailable(f"gateway {self.url}: {method} {path} failed: {exc!r}") from None
        if status in (401, 403):
            raise GatewayRefused(f"gateway {self.url} refused the admin token ({status}) on {method} {path}; "
                                 "give the agent the gateway's token (--admin-token-env)")
        if status != 200:
            raise IndexUnavailable(f"gateway {self.url}: {method} {path} answered {status}: "
                                   f"{raw[:300].decode('utf-8', 'replace')}")
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise IndexUnavailable(f"gateway {self.url}: {method} {path}: not JSON: {exc}") from None

    async def open(self) -> None:
        """Nothing to check before the first call (the gateway may start later)."""

    async def match(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        """Per worker holding ``keys[0]``, the longest run of consecutive ``keys`` from block 0,
        split by tier. Raises IndexUnavailable."""
        if not keys:
            return {}
        got = await self._call("POST", "/admin/index/match", {"keys": list(keys)}, self.match_timeout_s)
        try:
            return {str(wid): TierMatch(int(m["gpu"]), int(m["cpu"]), int(m["ssd"]))
                    for wid, m in got["matches"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IndexUnavailable(f"gateway {self.url}: unexpected lookup answer: {exc!r}") from None

    async def worker_states(self) -> dict[str, dict[str, Any]]:
        """Worker id -> its agent's live published state. Raises IndexUnavailable."""
        got = await self._call("GET", "/admin/peers")
        workers = got.get("workers") if isinstance(got, dict) else None
        if not isinstance(workers, dict):
            raise IndexUnavailable(f"gateway {self.url}: unexpected peers answer")
        return {str(wid): st for wid, st in workers.items() if isinstance(st, dict)}

    async def publish_state(self, worker: str, state: Mapping[str, Any], ttl_s: float) -> dict[str, Any]:
        """Publish ``worker``'s state (a mapping with a ``"peer"`` mapping), live for ``ttl_s``
        seconds at the gateway; returns the gateway's answer (``worker``, ``ttl_s``,
        ``registered``, ``block_key_encoding``). Sets ``encoding_error`` on a version mismatch.
        Raises IndexUnavailable."""
        got = await self._call("PUT", f"/admin/workers/{quote(worker, safe='')}/peer?ttl_s={ttl_s!r}", dict(state))
        version = got.get("block_key_encoding") if isinstance(got, dict) else None
        if version is not None and version != ENCODING_VERSION:
            self.encoding_error = (f"gateway {self.url} computes block keys of encoding version {version}, this "
                                   f"agent version {ENCODING_VERSION}: no key would ever match; run the same "
                                   "kvroute release on the gateway and its agents")
        return got if isinstance(got, dict) else {}

    async def withdraw_state(self, worker: str) -> bool:
        """Drop ``worker``'s published state at the gateway at once; whether it had a live one.
        Raises IndexUnavailable."""
        got = await self._call("DELETE", f"/admin/workers/{quote(worker, safe='')}/peer")
        return bool(got.get("removed")) if isinstance(got, dict) else False

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None
