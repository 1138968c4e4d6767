"""Why a request's prompt token ids cannot be made: the client's fault, or not exactly possible."""
from __future__ import annotations

from typing import Any


class UnsupportedPrompt(Exception):
    """The request's token ids cannot be made exactly (e.g. it carries an image)."""


class MultimodalPrompt(UnsupportedPrompt):
    """The prompt carries media (image, audio, video parts): its token ids and multimodal hashes
    come from the engine's processor (the gateway asks a vLLM render endpoint)."""


class BadPrompt(ValueError):
    """The request body is malformed (missing or ill-typed prompt/messages): a client error."""


def object_list(value: Any, field: str) -> list[dict[str, Any]] | None:
    """``value`` checked to be a list of objects (None stays None). Raises BadPrompt naming
    ``field``."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadPrompt(f"'{field}' must be a list")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadPrompt(f"{field}[{i}] must be an object")
    return value
