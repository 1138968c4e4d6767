"""An Anthropic Messages API body (``POST /v1/messages``) as the OpenAI chat body vLLM renders it.

vLLM 0.32 serves ``/v1/messages`` by converting the request to a chat-completions request and
rendering that (``vllm/entrypoints/anthropic/serving.py``, ``to_chat_completion_request``); this
module makes the same conversion, for the parts that reach the prompt, so the gateway tokenizes a
Messages request exactly as the worker will:

- ``system`` (a string, or text blocks joined with no separator) becomes the leading system
  message; a text block starting with ``x-anthropic-billing-header`` (Claude Code's per-request
  attribution) is dropped, wherever a system text appears. When the chat template rejects a system
  message after the first turn (``merge_inline_system``: vLLM renders ``[system, user, system,
  user]`` to find out), a message of role ``system`` is merged into that leading one; otherwise it
  stays in place.
- a message's blocks: ``text`` (non-empty) becomes a text part (a lone text part becomes plain
  content), ``thinking`` joins the message's ``reasoning``, ``tool_use`` becomes a tool call
  (``arguments`` the JSON of ``input``), a user's ``tool_result`` becomes a ``tool`` message
  (text items joined with ``\\n``) placed before the user message itself, an assistant's becomes a
  text part ``Tool result: ...``; ``redacted_thinking`` and ``tool_reference`` add nothing. A user
  message left with no content is dropped.
- ``tools`` become function tools (``input_schema`` as ``parameters``, with ``"type": "object"``
  added last when it has no type; ``strict`` and
  ``defer_loading`` kept when set), ``tool_choice`` maps ``any`` to ``required`` and ``tool`` to a
  named function; ``thinking: {type: disabled}`` sets ``reasoning_effort`` to
  ``disabled_thinking_effort`` (``none``, or ``low`` for a template that ignores ``none``; vLLM
  probes its renderer for this), ``output_config.effort`` sets ``reasoning_effort``;
  ``chat_template_kwargs`` pass through.

Images (in a message or a tool result), tool-set changes (``tool_addition`` / ``tool_removal``
blocks) and a tool result's ``tool_reference`` items raise :class:`UnsupportedPrompt` (the gateway
routes such a request by load); a malformed body raises :class:`BadPrompt`. Pure: no I/O.
"""
from __future__ import annotations

import json
import time
from typing import Any

from kvcore.prompt_errors import BadPrompt, MultimodalPrompt, UnsupportedPrompt, object_list

BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = ("user", "assistant", "system")


def messages_to_chat(body: dict[str, Any], merge_inline_system: bool = False,
                     disabled_thinking_effort: str = "none") -> dict[str, Any]:
    """The chat-completions body (``messages``, ``tools``, ``tool_choice``, ``reasoning_effort``,
    ``chat_template_kwargs``; only what the prompt depends on) vLLM renders for Messages ``body``.
    Raises BadPrompt / UnsupportedPrompt (module docstring)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadPrompt("'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise BadPrompt(f"messages[{i}] must be an object with role user, assistant or system")
        content = msg.get("content")
        if not isinstance(content, (str, list)):
            raise BadPrompt(f"messages[{i}].content must be a string or a list of blocks")
        if isinstance(content, list):
            for j, block in enumerate(content):
                if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                    raise BadPrompt(f"messages[{i}].content[{j}] must be an object with a 'type'")
                if block["type"] in ("tool_addition", "tool_removal"):
                    raise UnsupportedPrompt(f"a {block['type']} block")
    out: list[dict[str, Any]] = []
    system = _system_parts(body.get("system"))
    if merge_inline_system:
        system += [t for t in (_system_text(m["content"]) for m in messages if m["role"] == "system") if t]
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for msg in messages:
        if msg["role"] == "system":
            text = None if merge_inline_system else _system_text(msg["content"])
            if text:
                out.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": msg["role"]}
        if isinstance(msg["content"], str):
            converted["content"] = msg["content"]
        else:
            _convert_blocks(msg["content"], msg["role"], converted, out)
        if not (msg["role"] == "user" and "content" not in converted):
            out.append(converted)
    chat: dict[str, Any] = {"messages": out}
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    effort = _reasoning_effort(body, disabled_thinking_effort)
    if effort is not None:
        chat["reasoning_effort"] = effort
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    return chat


def _system_parts(system: Any) -> list[str]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [system]
    if not isinstance(system, list):
        raise BadPrompt("'system' must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict):
            raise BadPrompt(f"system[{i}] must be an object")
        text = block.get("text")
        if block.get("type") == "text" and text and not str(text).startswith(BILLING_HEADER):
            parts.append(str(text))
    return parts


def _system_text(content: str | list[dict[str, Any]]) -> str | None:
    """A system message's text, billing headers dropped (vLLM's ``_extract_system_text``)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [str(b["text"]) for b in content
             if b.get("type") == "text" and b.get("text") and not str(b["text"]).startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _convert_blocks(blocks: list[dict[str, Any]], role: str, converted: dict[str, Any],
                    out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            if block.get("text"):
                parts.append({"type": "text", "text": str(block["text"])})
        elif kind == "image":
            if block.get("source"):
                raise MultimodalPrompt("an image block")
        elif kind == "thinking":
            if block.get("thinking") is not None:
                reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": block.get("name") or "",
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            if role == "user":
                out.append(_tool_message(block))
            else:
                text = str(block["content"]) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        converted["content"] = parts[0]["text"] if len(parts) == 1 else parts


def _tool_message(block: dict[str, Any]) -> dict[str, Any]:
    """A user's ``tool_result`` block as the ``tool`` message vLLM makes of it."""
    content = block.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image":
                raise MultimodalPrompt("an image in a tool result")
            elif item.get("type") == "tool_reference" and (item.get("tool_name") or item.get("name")):
                raise UnsupportedPrompt("a tool_reference in a tool result")
        text = "\n".join(texts)
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text}


def _reasoning_effort(body: dict[str, Any], disabled_thinking_effort: str) -> str | None:
    effort = None
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and output_config.get("effort") is not None:
        effort = output_config["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = disabled_thinking_effort
    return effort


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if object_list(tools, "tools") is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise BadPrompt(f"tools[{i}] must be an object with a string 'name' and an 'input_schema' object")
        schema = dict(tool["input_schema"])
        schema.setdefault("type", "object")  # vLLM's AnthropicTool.validate_input_schema, at the end
        fn: dict[str, Any] = {"name": tool["name"], "description": tool.get("description"), "parameters": schema}
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out
