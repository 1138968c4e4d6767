"""Anthropic Messages (``POST /v1/messages``) and OpenAI Responses (``POST /v1/responses``)
bodies an agent sends, for the parity tests: each kind of block, item and option vLLM 0.32's
conversions treat on their own (``vllm/entrypoints/anthropic/serving.py``,
``vllm/entrypoints/openai/responses/utils.py``), kept short for the tiny model's 1,024-token
context."""
from __future__ import annotations

MODEL = "tiny"


def shared_full_blocks(first_ids: list[int], follow_ids: list[int], block_size: int) -> int:
    """Tokens of the full blocks ``follow_ids`` starts with that ``first_ids`` holds."""
    common = next((i for i, (a, b) in enumerate(zip(first_ids, follow_ids)) if a != b), len(first_ids))
    return common // block_size * block_size

TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "run", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}, "strict": True},
    {"name": "now", "description": "The time.", "input_schema": {}},  # no "type": vLLM adds "object"
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


RESPONSE_TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file of the repository.",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]


def responses_bodies() -> list[tuple[str, dict]]:
    """``(name, body)`` pairs for ``POST /v1/responses`` (OpenAI's Responses API)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "README.md"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "# demo"}

    def body(items, **extra) -> dict:
        if "tools" in extra:  # vLLM refuses "auto" (the default) without a tool-call parser
            extra.setdefault("tool_choice", "none")
        return {"model": MODEL, "input": items, "max_output_tokens": 4, **extra}
    return [
        ("string input", body("List the files.")),
        ("instructions", body("List the files.", instructions=SYSTEM)),
        ("input_text parts", body([{"role": "user", "content": [
            {"type": "input_text", "text": "First part."}, {"type": "input_text", "text": "Second part."}]}])),
        ("multi-turn", body([
            {"role": "user", "content": "List the files."},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "src and tests.", "annotations": []}]},
            {"role": "user", "content": "And docs?"}], instructions=SYSTEM)),
        ("function call and output", body([{"role": "user", "content": "What is in README.md?"}, call, output],
                                          tools=RESPONSE_TOOLS, instructions=SYSTEM)),
        ("reasoning then call", body([
            {"role": "user", "content": "Read it."},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "I should read it."}]},
            call, output], tools=RESPONSE_TOOLS)),
        ("reasoning effort", body("Think.", reasoning={"effort": "low"})),
        ("partial assistant", body([
            {"role": "user", "content": "Count to three."},
            {"type": "message", "role": "assistant", "id": "msg_2", "status": "incomplete",
             "content": [{"type": "output_text", "text": "One, two,", "annotations": []}]}])),
    ]
