"""The admin routes an offload agent uses when the gateway holds the index (``kvroute agent
--index http://GATEWAY``, :mod:`kvcore.index.gateway`): where a prompt's blocks are, and each
agent's published peer-pull state (:mod:`router.workers.peer_states`). Behind the admin bearer token as
every ``/admin`` route (401 without it); errors in the OpenAI shape.

| method path | answer |
|---|---|
| POST /admin/index/match | body ``{"keys": [u64, ...]}`` (block keys from block 0, :mod:`kvcore.block_keys`) or ``{"model": NAME, "token_ids": [u32, ...], "cache_salt"?: str}`` (the gateway makes the keys with the model's block size; only full blocks count) -> ``{"matches": {worker id: {"gpu", "cpu", "ssd"}}, "blocks", "block_key_encoding"}``: per worker holding block 0, the longest run of consecutive keys it holds, split by tier (:meth:`kvcore.index.base.KVIndex.match`; speculative entries count as gpu); ``blocks``: keys looked up. 400 bad body (not an object, neither or both of ``keys``/``token_ids``, a key outside 0..2^64-1, more than :data:`MAX_LOOKUP_KEYS` keys); 404 unknown model; 503 index unavailable |
| GET /admin/peers | ``{"workers": {worker id: state}, "block_key_encoding"}``: every live agent state the gateway routes on (published here, and a shared index's agents'), each the agent's JSON plus ``published_age_s`` |
| PUT /admin/workers/{id}/peer[?ttl_s=S] | body: the agent's state, a JSON object with a ``"peer"`` object (:mod:`router.estimates.peer_credit` has its fields) and optionally ``"tiers"``; kept for S s (default 10, at most 3600) -> ``{"worker", "ttl_s", "registered", "block_key_encoding"}`` (``registered``: the id is a worker here; a state for an id not (yet) registered is kept too). 400 bad body or ttl; 413 over 64 KiB; 409 when 4096 other workers' states are kept |
| DELETE /admin/workers/{id}/peer | ``{"worker", "removed"}``: the state is dropped at once (``removed``: there was a live one) |

With ``--processes N`` a ``PUT``/``DELETE`` is sent on to every sibling process.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request, Response

from kvcore.block_keys import ENCODING_VERSION, BlockExtras, block_keys
from kvcore.index.errors import IndexUnavailable
from router.edge.endpoints import parse_json_object
from router.errors import GatewayError, bad_request, body_too_large, unknown_model
from router.gateway import Gateway
from router.workers.peer_states import DEFAULT_TTL_S, MAX_STATE_BYTES, TooManyStates

MAX_LOOKUP_KEYS = 1 << 20
_U64 = 1 << 64
_U32 = 1 << 32


def lookup_keys(body: dict[str, Any], gateway: Gateway) -> list[int]:
    """The block keys a ``POST /admin/index/match`` body names (module docstring). Raises
    GatewayError 400 (bad body) or 404 (unknown model)."""
    if ("keys" in body) == ("token_ids" in body):
        raise bad_request('expected one of "keys" (block keys) or "token_ids" (with "model")', "keys")
    if "keys" in body:
        keys = body["keys"]
        if not isinstance(keys, list):
            raise bad_request('"keys" must be a list of block keys (integers 0..2^64-1)', "keys")
        _check_ints(keys, _U64, "keys", MAX_LOOKUP_KEYS)
        return keys
    ids, name, salt = body["token_ids"], body.get("model"), body.get("cache_salt")
    if not isinstance(name, str):
        raise bad_request('"model" (a configured model name) is required with "token_ids"', "model")
    model = next((m for m in gateway.cfg.models if m.name == name), None)
    if model is None:
        raise unknown_model(name)
    if not isinstance(ids, list):
        raise bad_request('"token_ids" must be a list of token ids (integers 0..2^32-1)', "token_ids")
    if salt is not None and not isinstance(salt, str):
        raise bad_request('"cache_salt" must be a string', "cache_salt")
    _check_ints(ids, _U32, "token_ids", MAX_LOOKUP_KEYS * model.block_size)
    return block_keys(ids, model.block_size, model.name, BlockExtras(cache_salt=salt) if salt else BlockExtras())


def _check_ints(values: list[Any], bound: int, param: str, most: int) -> None:
    if len(values) > most:
        raise bad_request(f'"{param}" has {len(values)} entries; at most {most}', param)
    if values and not (all(type(v) is int for v in values) and min(values) >= 0 and max(values) < bound):
        raise bad_request(f'"{param}" must hold integers in 0..{bound - 1}', param)


def add_peer_routes(api: APIRouter, gateway: Gateway,
                    to_siblings: Callable[[Request, str, str, Any], Awaitable[None]]) -> None:
    """Add the routes of the module docstring to ``api`` (the token-checked ``/admin`` router);
    ``to_siblings(request, method, path, body)`` sends a change on to the sibling processes."""

    def answer(data: Any, status: int = 200) -> Response:
        import orjson

        return Response(orjson.dumps(data), status_code=status, media_type="application/json")

    @api.post("/index/match")
    async def match_index(request: Request) -> Response:
        keys = lookup_keys(parse_json_object(await request.body()), gateway)
        try:
            matches = await gateway.index.match(keys)
        except IndexUnavailable as exc:
            raise GatewayError(503, str(exc), "service_unavailable", "index_unavailable") from None
        return answer({"matches": {wid: m.as_dict() for wid, m in sorted(matches.items())}, "blocks": len(keys),
                       "block_key_encoding": ENCODING_VERSION})

    @api.get("/peers")
    async def list_peers() -> Response:
        try:
            states = await gateway.peer_source.worker_states()
        except IndexUnavailable:  # a shared index that is down: what was published here still counts
            states = gateway.published_peers.live()
        return answer({"workers": states, "block_key_encoding": ENCODING_VERSION})

    @api.put("/workers/{worker_id}/peer")
    async def publish_peer(worker_id: str, request: Request, ttl_s: float = DEFAULT_TTL_S) -> Response:
        raw = await request.body()
        if len(raw) > MAX_STATE_BYTES:
            raise body_too_large(MAX_STATE_BYTES)
        body = parse_json_object(raw)
        try:
            gateway.published_peers.put(worker_id, body, ttl_s)
        except TooManyStates as exc:
            raise GatewayError(409, str(exc), "invalid_request_error", "too_many_peer_states") from None
        except ValueError as exc:
            raise bad_request(str(exc), "ttl_s" if "ttl_s" in str(exc) else "peer") from None
        await gateway.refresh_peers()
        await to_siblings(request, "PUT", f"/admin/workers/{quote(worker_id, safe='')}/peer?ttl_s={ttl_s!r}", body)
        return answer({"worker": worker_id, "ttl_s": ttl_s, "registered": worker_id in gateway.registry,
                       "block_key_encoding": ENCODING_VERSION})

    @api.delete("/workers/{worker_id}/peer")
    async def withdraw_peer(worker_id: str, request: Request) -> Response:
        removed = gateway.published_peers.remove(worker_id)
        await gateway.refresh_peers()
        await to_siblings(request, "DELETE", f"/admin/workers/{quote(worker_id, safe='')}/peer", None)
        return answer({"worker": worker_id, "removed": removed})
