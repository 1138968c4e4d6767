"""An OpenAI Responses API body (``POST /v1/responses``) as the chat body vLLM renders it.

vLLM 0.32 renders a Responses request (without a Harmony model) by turning its input into chat
messages (``vllm/entrypoints/openai/responses/utils.py``, ``construct_input_messages``) and its
function tools into chat tools (``construct_tool_dicts``), then applying the chat template with
the request's ``build_chat_params`` (``responses/protocol.py``); this module makes the same chat
body, for the parts that reach the prompt:

- ``instructions`` becomes a leading system message; a string ``input`` a user message;
- input items: a message with a role passes through as a chat message (``input_text`` parts are
  text), except an assistant's, whose first content part's text becomes its content; a
  ``function_call`` becomes a tool call and a ``reasoning`` item (its first content text, else its
  first summary text) the ``reasoning`` of an assistant message, both joining the assistant
  message before them when it has none yet; a ``function_call_output`` becomes a ``tool``
  message;
- ``add_generation_prompt`` is off and ``continue_final_message`` on when the last item is a
  message or reasoning item with status ``in_progress`` or ``incomplete``;
- the rendered text is encoded with the tokenizer's special tokens (``build_tok_params``' default,
  unlike chat's: a template that writes BOS itself gets a second one);
- ``reasoning.effort`` sets ``reasoning_effort`` (and ``enable_thinking`` unless the request's
  ``chat_template_kwargs`` set it); function tools ``{"type": "function", "name", ...}`` become
  chat tools.

A request that continues a stored response (``previous_response_id``: its history lives on the
worker that made it), non-function tools, namespaced or custom tool calls and encrypted reasoning
raise :class:`UnsupportedPrompt` (the gateway routes such a request by load); a malformed body
raises :class:`BadPrompt`. Pure: no I/O.
"""
from __future__ import annotations

from typing import Any

from kvcore.prompt_errors import BadPrompt, UnsupportedPrompt, object_list

_PARTIAL = ("in_progress", "incomplete")


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body (``messages``, ``tools``, ``add_generation_prompt``,
    ``continue_final_message``, ``add_special_tokens``, ``reasoning_effort``,
    ``chat_template_kwargs``) vLLM renders for
    Responses ``body``. Raises BadPrompt / UnsupportedPrompt (module docstring)."""
    if body.get("previous_response_id") is not None:
        raise UnsupportedPrompt("previous_response_id: the history is stored on a worker")
    items = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    continue_final = False
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise BadPrompt(f"input[{i}] must be an object")
            _add_item(item, messages)
        last = items[-1]
        continue_final = last.get("type", "message") in ("message", "reasoning") and last.get("status") in _PARTIAL
    else:
        raise BadPrompt("'input' must be a string or a non-empty list of items")
    chat: dict[str, Any] = {"messages": messages, "add_generation_prompt": not continue_final,
                            "continue_final_message": continue_final, "add_special_tokens": True}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadPrompt("'chat_template_kwargs' must be an object")
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    return chat


def _add_item(item: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    """vLLM's ``_construct_message_from_response_item``: appends a message or merges into the
    assistant message before it."""
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        if item.get("namespace"):
            raise UnsupportedPrompt("a namespaced function call")
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
            raise BadPrompt("a function_call item needs a string 'call_id' and 'name'")
        call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item.get("arguments", "")},
                "type": "function"}
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "custom_tool_call":
        raise UnsupportedPrompt("a custom tool call")
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise UnsupportedPrompt("encrypted reasoning")
        texts = item.get("content") or item.get("summary") or []
        text = texts[0].get("text", "") if texts and isinstance(texts[0], dict) else ""
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            messages.append({"role": "assistant", "reasoning": text})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    elif item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else (
            content[0].get("text") if isinstance(content, list) and content and isinstance(content[0], dict) else None)
        if text is None:
            raise UnsupportedPrompt("an assistant item without text")
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
    elif "role" in item:
        messages.append({k: v for k, v in item.items() if k not in ("type", "status", "id")})
    else:
        raise UnsupportedPrompt(f"an input item of type {kind!r}")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(object_list(tools, "tools") or []):
        if tool.get("type") != "function":
            raise UnsupportedPrompt(f"a tool of type {tool.get('type')!r}")
        if not isinstance(tool.get("name"), str):
            raise BadPrompt(f"tools[{i}].name must be a string")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out
