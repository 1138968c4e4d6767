"""Errors the gateway makes itself, in OpenAI's shape.

Body: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}``
(the OpenAI API's error object; vLLM's own errors use the same keys). A worker's own errors are
never rewritten: they pass through with the worker's status and body.
"""
from __future__ import annotations

import orjson


class GatewayError(Exception):
    """An error the gateway answers itself: ``status`` (HTTP), ``message``, ``type``, ``code``
    and ``param`` fill the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or []  # extra response headers (lower-case names), e.g. Retry-After

    def body(self) -> bytes:
        """The JSON body bytes."""
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> bytes:
    """``{"error": {...}}`` as JSON bytes."""
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def bad_request(message: str, param: str | None = None) -> GatewayError:
    """400: malformed body or a missing/ill-typed field."""
    return GatewayError(400, message, "invalid_request_error", "bad_request", param)


def unknown_model(model: str) -> GatewayError:
    """404: no configured model or adapter of that name."""
    return GatewayError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                        "model_not_found", "model")


def body_too_large(limit_bytes: int) -> GatewayError:
    """413: request body over ``max_body_bytes``."""
    return GatewayError(413, f"Request body exceeds the limit of {limit_bytes} bytes.",
                        "invalid_request_error", "request_too_large")


def no_healthy_worker(model: str) -> GatewayError:
    """503: no healthy, non-draining worker serves ``model``."""
    return GatewayError(503, f"No healthy worker serves model `{model}`.", "service_unavailable",
                        "no_healthy_worker")


def upstream_failed(worker_id: str, detail: str) -> GatewayError:
    """502: the worker could not be reached or broke the connection before answering."""
    return GatewayError(502, f"Upstream worker {worker_id} failed: {detail}", "upstream_error",
                        "upstream_failure")


def upstream_timeout(worker_id: str, timeout_s: float) -> GatewayError:
    """504: no first byte from the worker within ``timeout_s``."""
    return GatewayError(504, f"Upstream worker {worker_id} sent no response within {timeout_s} s.",
                        "upstream_error", "upstream_timeout")


class WorkerExists(ValueError):
    """A worker of that id, or at that address, is already registered."""
