"""Prompts with media (images, audio, video): token ids and multimodal items from vLLM's renderer.

A multimodal prompt's token ids depend on the model's processor (how many placeholder tokens each
image becomes, which can depend on its size) and vLLM mixes each item's content hash into the
block hashes of the blocks its placeholders cover. Rather than reimplement every processor, the
gateway asks a vLLM server's render endpoint, the same code path the server runs before it
schedules a request (``vllm/entrypoints/scale_out/render/``, 0.32: ``POST
/v1/chat/completions/render``, ``/v1/messages/render``, ``/v1/responses/render``; enabled by
``vllm serve --enable-scale-out``, always on a dedicated ``render`` server). The body is sent as
the client sent it, with ``mm_payload: "none"`` so only token ids, hashes and placeholder ranges
come back (no processed tensors). The answer (``GenerateRequest``):
``{"token_ids": [...], "features": {"mm_hashes": {modality: [hash, ...]},
"mm_placeholders": {modality: [{"offset", "length"}, ...]}}}``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

RENDER_PATHS: dict[str, str] = {"chat": "/v1/chat/completions/render", "messages": "/v1/messages/render",
                                "responses": "/v1/responses/render"}
"""Render endpoint per routed body kind (completions bodies carry no media)."""


ENDPOINT_DOWN_STATUSES = frozenset({403, 404, 405, 501})
"""Statuses that say the endpoint is off (vLLM answers 403 without ``--enable-scale-out``), not
that this body is bad; with 5xx and no answer at all they make the gateway leave it alone."""


class RenderFailed(Exception):
    """The render endpoint could not be reached or gave no usable answer; ``reason`` is a metric
    label (``unreachable``, ``refused``: an HTTP error status, ``bad_answer``); ``endpoint_down``:
    whether the endpoint itself failed (rather than this body)."""

    def __init__(self, reason: str, detail: str, endpoint_down: bool = True) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.endpoint_down = endpoint_down


@dataclass(frozen=True)
class RenderedPrompt:
    """``token_ids``: the prompt as the engine runs it; ``media``: ``(identifier, start_token,
    length_tokens)`` per multimodal item, sorted by start (the ``mm_hashes`` of
    :class:`kvcore.block_keys.BlockExtras`)."""

    token_ids: list[int]
    media: tuple[tuple[str, int, int], ...]


def parse_rendered(answer: Any) -> RenderedPrompt:
    """The render endpoint's JSON answer as a :class:`RenderedPrompt`. Raises ValueError when it
    has no token ids, or hashes and placeholders that do not pair up."""
    if not isinstance(answer, Mapping):
        raise ValueError("not an object")
    ids = answer.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < 2 ** 32 for t in ids):
        raise ValueError("no token_ids")
    features = answer.get("features") or {}
    hashes = features.get("mm_hashes") or {}
    ranges = features.get("mm_placeholders") or {}
    if not isinstance(hashes, Mapping) or not isinstance(ranges, Mapping) or set(hashes) != set(ranges):
        raise ValueError("mm_hashes and mm_placeholders name different modalities")
    media: list[tuple[str, int, int]] = []
    for modality, items in hashes.items():
        places = ranges[modality]
        if not isinstance(items, list) or not isinstance(places, list) or len(items) != len(places):
            raise ValueError(f"{modality}: {len(items)} hashes for {len(places)} placeholders")
        for ident, place in zip(items, places):
            start, length = place.get("offset"), place.get("length")
            if not isinstance(ident, str) or not isinstance(start, int) or not isinstance(length, int) \
                    or start < 0 or length < 1 or start + length > len(ids):
                raise ValueError(f"{modality}: bad item {ident!r} at {place!r}")
            media.append((ident, start, length))
    media.sort(key=lambda m: m[1])
    return RenderedPrompt(ids, tuple(media))


async def render_prompt(session: aiohttp.ClientSession, base_url: str, kind: str, body: Mapping[str, Any],
                        timeout_s: float, authorization: str | None = None) -> RenderedPrompt:
    """``body`` (a routed ``kind`` body, see :data:`RENDER_PATHS`) rendered by the vLLM server at
    ``base_url``. ``authorization``: the client's header, for a server started with ``--api-key``.
    Raises RenderFailed; KeyError for a kind without a render endpoint."""
    url = base_url.rstrip("/") + RENDER_PATHS[kind]
    payload = json.dumps({**body, "mm_payload": "none", "stream": False}).encode()
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    try:
        async with session.post(url, data=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                down = resp.status in ENDPOINT_DOWN_STATUSES or resp.status >= 500
                raise RenderFailed("refused", f"{url} answered {resp.status}: {raw[:300]!r}", down)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise RenderFailed("unreachable", f"{url}: {exc!r}") from None
    try:
        return parse_rendered(json.loads(raw))
    except ValueError as exc:
        raise RenderFailed("bad_answer", f"{url}: {exc}") from None
