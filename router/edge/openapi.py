"""The gateway's OpenAPI 3.1 schema, served at ``GET /openapi.json`` (where vLLM serves its own).

The FastAPI app is built with ``openapi_url=None`` and the proxied POST paths are raw ASGI routes
(:mod:`router.edge.endpoints`), which FastAPI's generator cannot see; so the schema is assembled here:

- the FastAPI routes (``GET /health``, ``/ping``, ``/version``, ``/metrics``, ``/v1/models`` and
  ``/admin/*``) from FastAPI's own generator, with the bodies the admin handlers read by hand
  (:class:`router.config.schema.WorkerConfig`, a policy mapping, a chat or completions body) and the
  admin bearer token as the ``AdminBearer`` security scheme;
- the proxied paths' request bodies: a subset of OpenAI's chat and completions request schemas
  plus vLLM's extra fields (``cache_salt``, ``ignore_eos``, ``add_generation_prompt``, ...), and
  small schemas for the forwarded paths (tokenize, detokenize, embeddings, responses, Anthropic
  messages, render). Unknown fields are allowed everywhere, as vLLM accepts (and ignores) them.

Every error the gateway makes itself has the OpenAI shape (``ErrorResponse``). The schema is built
once, on the first request, from the app's routes and the configured model names.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from starlette.routing import Route

from router.config.schema import WORKER_ROLES, WorkerConfig
from router.policies.factory import POLICY_NAMES

_REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_INT = {"type": "integer"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def _request_schemas(models: list[str]) -> dict[str, Any]:
    """The request body schemas (components) of the proxied paths."""
    model = {"type": "string", "description": "a served model or LoRA adapter name; absent, null or \"\": "
                                              "the one served model when there is only one"}
    if models:
        model["examples"] = models
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _STR}}
    content = {"anyOf": [_STR, {"type": "array", "items": _ref("TextContentPart")}, {"type": "null"}]}
    tool_call = {"type": "object", "required": ["id", "type", "function"],
                 "properties": {"id": _STR, "type": {"type": "string", "enum": ["function"]},
                                "function": {"type": "object", "required": ["name", "arguments"],
                                             "properties": {"name": _STR, "arguments": _STR}}}}
    message = {"type": "object", "required": ["role"],
               "properties": {"role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
                              "content": content, "name": _STR, "tool_call_id": _STR,
                              "tool_calls": {"type": "array", "items": _ref("ToolCall")}}}
    tool = {"type": "object", "required": ["type", "function"],
            "properties": {"type": {"type": "string", "enum": ["function"]},
                           "function": {"type": "object", "required": ["name"],
                                        "properties": {"name": _STR, "description": _STR,
                                                       "parameters": {"type": "object"}}}}}
    stream_options = {"type": "object", "properties": {"include_usage": _BOOL, "continuous_usage_stats": _BOOL}}
    stop = {"anyOf": [_STR, {"type": "array", "items": _STR, "maxItems": 4}, {"type": "null"}]}
    sampling = {  # the fields chat and completions share (OpenAI's, then vLLM's extras)
        "model": model,
        "max_tokens": _nullable({"type": "integer", "minimum": 1}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": 128}),
        "stream": _nullable(_BOOL),
        "stream_options": _nullable(_ref("StreamOptions")),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "seed": _nullable(_INT),
        "stop": stop,
        "user": _STR,
        "ignore_eos": _BOOL,
        "cache_salt": {"type": "string", "minLength": 1},
        "add_special_tokens": _BOOL,
    }
    chat = {"type": "object", "required": ["messages"],
            "properties": {"messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
                           **sampling,
                           "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
                           "logprobs": _nullable(_BOOL),
                           "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
                           "tools": {"type": "array", "items": _ref("Tool")},
                           "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                                     {"type": "object"}]},
                           "add_generation_prompt": _BOOL, "continue_final_message": _BOOL,
                           "chat_template_kwargs": {"type": "object"}}}
    completion = {"type": "object", "required": ["prompt"],
                  "properties": {"prompt": {"anyOf": [_STR, {"type": "array", "items": _STR, "minItems": 1},
                                                      _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS,
                                                                   "minItems": 1}]},
                                 **sampling,
                                 "echo": _nullable(_BOOL),
                                 "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 5}),
                                 "suffix": _nullable(_STR)}}
    return {
        "TextContentPart": text_part,
        "ToolCall": tool_call,
        "ChatMessage": message,
        "Tool": tool,
        "StreamOptions": stream_options,
        "ChatCompletionRequest": chat,
        "CompletionRequest": completion,
        "TokenizeRequest": {"anyOf": [
            {"type": "object", "required": ["prompt"], "properties": {
                "model": model, "prompt": _STR, "add_special_tokens": _BOOL, "return_token_strs": _BOOL}},
            {"type": "object", "required": ["messages"], "properties": {
                "model": model, "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
                "add_generation_prompt": _BOOL, "return_token_strs": _BOOL}}]},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"],
                              "properties": {"model": model, "tokens": {"type": "array", "items": {
                                  "type": "integer", "minimum": 0}}}},
        "EmbeddingRequest": {"type": "object", "required": ["input"],
                             "properties": {"model": model, "input": {"anyOf": [
                                 _STR, {"type": "array", "items": _STR, "minItems": 1}, _TOKEN_IDS]},
                                 "encoding_format": {"type": "string", "enum": ["float", "base64"]}}},
        "ResponsesRequest": {"type": "object", "required": ["input"],
                             "properties": {"model": model, "input": {"anyOf": [
                                 _STR, {"type": "array", "items": {"type": "object"}}]},
                                 "instructions": _nullable(_STR), "max_output_tokens": _nullable(
                                     {"type": "integer", "minimum": 1}), "stream": _nullable(_BOOL)}},
        "ForwardedRequest": {"type": "object", "properties": {"model": model}},
        "AnthropicMessagesRequest": {"type": "object", "required": ["messages"],
                                     "properties": {"model": model, "max_tokens": {"type": "integer", "minimum": 1},
                                                    "messages": {"type": "array", "minItems": 1, "items": {
                                                        "type": "object", "required": ["role", "content"],
                                                        "properties": {"role": {"type": "string", "enum": [
                                                            "user", "assistant"]}, "content": content}}},
                                                    "system": _STR, "stream": _BOOL}},
    }


def _error_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": _STR, "type": _STR, "param": _nullable(_STR),
                       "code": {"anyOf": [_STR, _INT, {"type": "null"}]}}}}}


_ERROR = {"content": {"application/json": {"schema": _ref("ErrorResponse")}}}
_CLIENT_SECURITY: list[dict[str, list[str]]] = [{}, {"ClientApiKey": []}]  # optional: only with client_auth keys
_PROXY_ERRORS = {
    "400": {"description": "malformed body, ill-typed field or prompt (the gateway's or the worker's)", **_ERROR},
    "401": {"description": "client API keys configured and none valid given", **_ERROR},
    "404": {"description": "unknown model", **_ERROR},
    "413": {"description": "body over max_body_bytes", **_ERROR},
    "429": {"description": "admission queue full or timed out (Retry-After), or the worker's own", **_ERROR},
    "502": {"description": "the worker failed before answering (x-kvroute-worker names it)", **_ERROR},
    "503": {"description": "no healthy worker serves the model", **_ERROR},
    "504": {"description": "no first byte from the worker within timeouts.first_byte_s", **_ERROR},
}

# proxied path -> (request schema, summary); chat, completions, messages and responses are routed by the policy; a
# proxied path missing here gets ForwardedRequest
PROXIED: dict[str, tuple[str, str]] = {
    "/v1/chat/completions": ("ChatCompletionRequest", "Chat completion, routed by the policy"),
    "/v1/completions": ("CompletionRequest", "Completion, routed by the policy"),
    "/v1/responses": ("ResponsesRequest", "OpenAI responses, routed by the policy"),
    "/v1/embeddings": ("EmbeddingRequest", "Forwarded to the least-loaded worker of the model"),
    "/tokenize": ("TokenizeRequest", "Forwarded to the least-loaded worker of the model"),
    "/detokenize": ("DetokenizeRequest", "Forwarded to the least-loaded worker of the model"),
    "/v1/messages": ("AnthropicMessagesRequest", "Anthropic messages, routed by the policy"),
    "/v1/messages/count_tokens": ("AnthropicMessagesRequest", "Anthropic count_tokens, forwarded"),
    "/v1/chat/completions/render": ("ChatCompletionRequest", "Rendered chat prompt, forwarded"),
    "/v1/completions/render": ("CompletionRequest", "Rendered completions prompt, forwarded"),
    "/v1/responses/render": ("ResponsesRequest", "Rendered responses prompt, forwarded"),
}

# admin handlers that read their JSON body by hand: (method, path) -> request schema
_ADMIN_BODIES = {
    ("post", "/admin/workers"): "WorkerConfig",
    ("put", "/admin/policy"): "PolicyConfig",
    ("post", "/admin/explain"): "ExplainRequest",
    ("post", "/admin/index/match"): "IndexMatchRequest",
    ("put", "/admin/workers/{worker_id}/peer"): "PeerState",
    ("put", "/admin/workers/{worker_id}/role"): "WorkerRole",
}


def _agent_schemas() -> dict[str, Any]:
    """The bodies of the routes agents use with the gateway's index (:mod:`router.edge.admin_peers`)."""
    u64 = {"type": "integer", "minimum": 0, "maximum": (1 << 64) - 1}
    u32 = {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1}
    opt_num = {"type": ["number", "null"], "minimum": 0}
    opt_int = {"type": ["integer", "null"], "minimum": 0}
    peer = {"type": "object", "properties": {
        "serve": {"type": ["string", "null"], "description": "host:port its agent serves blocks on"},
        "pull": _BOOL, "block_bytes": opt_int, "block_size": opt_int,
        "fingerprint": {"type": ["string", "null"], "description": "hex digest of the KV layout"},
        "link_bytes_per_s": opt_num, "pull_overhead_ms": opt_num,
        "pulls": {"type": "integer", "minimum": 0}, "pulled_blocks": {"type": "integer", "minimum": 0},
        "failed_pulls": {"type": "integer", "minimum": 0},
        "skipping": {"type": "array", "items": {"type": "string"},
                     "description": "peers its agent skips now after failed pulls (no credit from them)"}}}
    return {
        "IndexMatchRequest": {"anyOf": [
            {"type": "object", "required": ["keys"], "properties": {
                "keys": {"type": "array", "items": u64, "description": "block keys from block 0"}}},
            {"type": "object", "required": ["model", "token_ids"], "properties": {
                "model": _STR, "token_ids": {"type": "array", "items": u32}, "cache_salt": _STR}}]},
        "PeerState": {"type": "object", "required": ["peer"], "properties": {
            "peer": peer, "tiers": {"type": "object", "description": "the agent's tier counters"}}},
    }


def _proxied_operation(path: str, schema: str, summary: str) -> dict[str, Any]:
    op_id = "proxy_" + path.strip("/").replace("/", "_")
    return {"post": {
        "operationId": op_id, "summary": summary, "tags": ["openai"],
        "security": _CLIENT_SECURITY,
        "parameters": [{"name": "x-request-id", "in": "header", "required": False, "schema": _STR,
                        "description": "echoed back; a new one when absent"}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(schema)}}},
        "responses": {"200": {"description": "the worker's answer (JSON, or text/event-stream when "
                                             "streaming), with x-kvroute-worker",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": _STR}}},
                      **_PROXY_ERRORS}}}


def build_openapi(app: FastAPI, models: list[str] | None = None) -> dict[str, Any]:
    """The whole schema for ``app`` (the gateway's FastAPI app); ``models``: served model names
    (given as examples of the ``model`` field)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="kvroute: a KV-cache-aware OpenAI-compatible gateway in front of vLLM")
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = _error_schema()
    schemas.update(_request_schemas(models or []))
    worker = WorkerConfig.model_json_schema()
    worker.pop("description", None)
    schemas["WorkerConfig"] = worker
    number = {"type": "number", "minimum": 0}
    schemas["PolicyConfig"] = {  # the union of the policies' keys; each policy takes only its own
        "type": "object", "properties": {
            "name": {"type": "string", "enum": list(POLICY_NAMES)},
            "tier_credit": {"type": "object", "properties": {t: {"type": "number", "minimum": 0, "maximum": 1}
                                                             for t in ("gpu", "cpu", "ssd")}},
            "load_weight": number, "temperature": number, "decode_tokens_per_request": number,
            "engine_waiting_prefill_tokens": number, "prefill_overhead_ms": number, "prefill_ms_per_token": number,
            "spread_margin": number, "recompute_weight": number, "private_recompute_weight": number,
            "private_affinity_wait_s": number,
            "learn_prefill_rate": _BOOL,
            "overload_guard": {"anyOf": [{"type": "object", "properties": {
                "enabled": _BOOL, "excess_tokens": number, "ratio": {"type": "number", "minimum": 1}}},
                {"type": "boolean"}, {"type": "null"}]},
            "session_header": _STR}}
    schemas["WorkerRole"] = {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
        "role": {"type": "string", "enum": list(WORKER_ROLES),
                 "description": "both: whole requests; prefill / decode: one leg of a disaggregated request"}}}
    schemas["ExplainRequest"] = {"anyOf": [_ref("ChatCompletionRequest"), _ref("CompletionRequest")]}
    schemas.update(_agent_schemas())
    components["securitySchemes"] = {
        "AdminBearer": {"type": "http", "scheme": "bearer",
                        "description": "the admin token (admin.token_env / admin.token)"},
        "ClientApiKey": {"type": "http", "scheme": "bearer",
                         "description": "a client API key; needed only when the client_auth section configures keys"}}
    paths = schema.setdefault("paths", {})
    for path, item in paths.items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path == "/health/ready":
                responses["503"] = {"description": "no worker is routable"}
            if path == "/v1/models":
                op["security"] = _CLIENT_SECURITY
                responses["401"] = {"description": "client API keys configured and none valid given", **_ERROR}
            if not path.startswith("/admin"):
                continue
            op["security"] = [{"AdminBearer": []}]
            responses["401"] = {"description": "missing or wrong admin token", **_ERROR}
            body = _ADMIN_BODIES.get((method, path))
            if body is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
                responses["400"] = {"description": "malformed body", **_ERROR}
            if "{worker_id}" in path and not path.endswith("/peer"):  # a peer state may precede its worker
                responses["404"] = {"description": "no such worker", **_ERROR}
            if path == "/admin/index/match":
                responses["404"] = {"description": "unknown model", **_ERROR}
                responses["503"] = {"description": "index unavailable (Redis down)", **_ERROR}
            if path == "/admin/workers/{worker_id}/peer" and method == "put":
                responses["400"] = {"description": "malformed state or ttl_s", **_ERROR}
                responses["409"] = {"description": "too many workers' states kept", **_ERROR}
                responses["413"] = {"description": "state over 64 KiB", **_ERROR}
            if path == "/admin/workers/{worker_id}/role":
                responses["400"] = {"description": "role not both, prefill or decode", **_ERROR}
            if path == "/admin/workers" and method == "post":
                responses["409"] = {"description": "worker id taken", **_ERROR}
            if path in ("/admin/workers", "/admin/index"):
                responses["503"] = {"description": "index unavailable (Redis down)", **_ERROR}
    for route in app.routes:  # the raw ASGI routes of the proxied paths
        if isinstance(route, Route) and not isinstance(route, APIRoute) and "POST" in (route.methods or ()):
            body, summary = PROXIED.get(route.path, ("ForwardedRequest", "Forwarded to a worker of the model"))
            paths[route.path] = _proxied_operation(route.path, body, summary)
    return schema


def serve_openapi(app: FastAPI, models: list[str] | None = None) -> None:
    """Add ``GET /openapi.json`` to ``app`` (left out of the schema itself); the schema is built on
    the first request, when every route is in place, and kept."""
    built: list[bytes] = []

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> Response:
        if not built:
            import orjson

            built.append(orjson.dumps(build_openapi(app, models)))
        return Response(built[0], media_type="application/json")
