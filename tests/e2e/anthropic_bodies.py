"""Anthropic Messages bodies (``POST /v1/messages``) an agent sends, for the parity tests: each
kind of block and option vLLM 0.32's conversion treats on its own (``vllm/entrypoints/anthropic/
serving.py``), kept short for the tiny model's 1,024-token context."""
from __future__ import annotations

MODEL = "tiny"

TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "run", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}, "strict": True},
]
SYSTEM = "You are a coding agent working in a small repository. Keep answers short."


def _body(messages: list, **extra) -> dict:
    if "tools" in extra:  # vLLM refuses "auto" (the default with tools) without a tool-call parser
        extra.setdefault("tool_choice", {"type": "none"})
    return {"model": MODEL, "max_tokens": 4, "messages": messages, **extra}


def messages_bodies() -> list[tuple[str, dict]]:
    """``(name, body)`` pairs."""
    user = {"role": "user", "content": "List the files."}
    tool_turns = [
        user,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look at the tree.", "signature": "sig"},
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "README.md"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "# demo"}, {"type": "text", "text": "A demo repo."}]},
            {"type": "text", "text": "Now summarise it."}]},
    ]
    return [
        ("plain string", _body([user])),
        ("system string", _body([user], system=SYSTEM)),
        ("system blocks, billing header dropped", _body([user], system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc123"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Be precise."}])),
        ("text blocks", _body([{"role": "user", "content": [
            {"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}])),
        ("tools", _body([user], system=SYSTEM, tools=TOOLS)),
        ("tool use and result", _body(tool_turns, system=SYSTEM, tools=TOOLS)),
        ("tool result as a string, error", _body([
            user, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_02", "name": "run",
                                                     "input": {"cmd": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02", "content": "no such dir",
                                          "is_error": True}]}], tools=TOOLS)),
        ("inline system message", _body([user, {"role": "assistant", "content": "src and tests."},
                                         {"role": "system", "content": "Reminder: be brief."},
                                         {"role": "user", "content": "And docs?"}], system=SYSTEM)),
        ("thinking disabled", _body([user], thinking={"type": "disabled"})),
        ("output effort", _body([user], output_config={"effort": "high"})),
        ("redacted thinking, empty text", _body([
            user, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "abc"},
                                                    {"type": "text", "text": ""}, {"type": "text", "text": "Done."}]},
            {"role": "user", "content": "Thanks."}])),
        ("chat template kwargs", _body([user], chat_template_kwargs={"unused_flag": True})),
    ]
