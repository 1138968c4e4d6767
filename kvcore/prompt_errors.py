"""Why a request's prompt token ids cannot be made: the client's fault, or not exactly possible."""
from __future__ import annotations


class UnsupportedPrompt(Exception):
    """The request's token ids cannot be made exactly (e.g. it carries an image)."""


class BadPrompt(ValueError):
    """The request body is malformed (missing or ill-typed prompt/messages): a client error."""
