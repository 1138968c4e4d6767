"""The ``agent`` workload: coding-agent sessions through Anthropic's Messages API
(``/v1/messages``) or OpenAI's Responses API (``/v1/responses``), from one-token words so every
length is exact in tokens.

Every session shares one system prompt (``system_tokens``) and one set of ``AGENT_TOOLS`` tool
definitions, as the sessions of one coding agent do. Session s starts with a task of
``user_tokens``; after each turn its history gets a fixed assistant step, a note of
``reply_tokens`` and a call to one of the tools, then the tool's result (``result_tokens``); the
next turn re-sends the whole history. Bodies never depend on a router's answers, so every target
gets the same requests. Turns go round by round (turn t of every session, in a seeded shuffle,
before turn t+1) and a turn waits for the session's previous one.

``api="messages"``: ``system``, ``tools`` (``input_schema``), ``tool_use`` and ``tool_result``
blocks. ``api="responses"``: ``instructions``, function ``tools`` (``parameters``) and
``function_call`` / ``function_call_output`` input items. ``tool_choice`` is none: the tools are
still rendered into the prompt, and a vLLM server started without ``--enable-auto-tool-choice``
and a tool parser accepts the body (it refuses "auto" then). The prompt token ids are the gateway's
conversion of the body (:meth:`kvcore.tokenization.PromptTokenizer.encode_messages` /
``encode_responses``), which the e2e suite checks against vLLM's own.
"""
from __future__ import annotations

import json
import random

from kvbench.words import OneTokenWords
from kvbench.workload import BenchRequest, Workload

APIS = ("messages", "responses")
AGENT_TOOLS = (("read_file", "path"), ("run_tests", "target"), ("search_code", "query"))


def _tools(words: OneTokenWords, api: str, seed: int) -> list[dict]:
    out = []
    for name, arg in AGENT_TOOLS:
        description = words.text(words.filler(f"agent-tool-{seed}-{name}", 40)).strip()
        schema = {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}
        if api == "messages":
            out.append({"name": name, "description": description, "input_schema": schema})
        else:
            out.append({"type": "function", "name": name, "description": description, "parameters": schema})
    return out


def agent(words: OneTokenWords, block_size: int, sessions: int, turns: int, system_tokens: int,
          user_tokens: int, reply_tokens: int, result_tokens: int, output_tokens: int,
          api: str = "messages", seed: int = 0) -> Workload:
    """The agent workload (module docstring). Raises ValueError on counts < 1 or an unknown ``api``."""
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    if min(sessions, turns, system_tokens, user_tokens, output_tokens) < 1:
        raise ValueError("sessions, turns, system, user and output tokens must be >= 1")
    system = words.text(words.block(0, system_tokens, salt=f"agent-system-{seed}")).strip()
    tools = _tools(words, api, seed)
    bodies: list[list[dict]] = []
    for s in range(sessions):
        task = words.text(words.filler(f"agent-task-{seed}-{s}", user_tokens)).strip()
        history: list[dict] = [{"role": "user", "content": task}]
        turns_of_s = []
        for t in range(turns):
            if api == "messages":
                turns_of_s.append({"system": system, "tools": tools, "tool_choice": {"type": "none"},
                                   "messages": [dict(m) for m in history]})
            else:
                turns_of_s.append({"instructions": system, "tools": tools, "tool_choice": "none",
                                   "input": [dict(m) for m in history]})
            history += _step(words, api, seed, s, t, reply_tokens, result_tokens)
        bodies.append(turns_of_s)
    requests: list[BenchRequest] = []
    last_turn: dict[int, int] = {}
    for t in range(turns):
        order = list(range(sessions))
        random.Random(seed * 1000 + t).shuffle(order)
        for s in order:
            body = bodies[s][t]
            ids = (words.tokenizer.encode_messages if api == "messages" else words.tokenizer.encode_responses)(body)
            requests.append(BenchRequest(index=len(requests), endpoint=api, body=body, prompt_token_ids=ids,
                                         output_tokens=output_tokens, after=last_turn.get(s), group=f"s{s}"))
            last_turn[s] = len(requests) - 1
    return Workload("agent", requests, block_size, {
        "api": api, "sessions": sessions, "turns": turns, "system_tokens": system_tokens,
        "user_tokens": user_tokens, "reply_tokens": reply_tokens, "result_tokens": result_tokens,
        "tools": len(tools), "output_tokens": output_tokens, "seed": seed})


def _step(words: OneTokenWords, api: str, seed: int, s: int, t: int, reply_tokens: int,
          result_tokens: int) -> list[dict]:
    """The history a turn adds: the agent's note and tool call, then the tool's result."""
    name, arg = AGENT_TOOLS[(s + t) % len(AGENT_TOOLS)]
    note = words.text(words.filler(f"agent-note-{seed}-{s}-{t}", max(1, reply_tokens))).strip()
    value = words.text(words.filler(f"agent-arg-{seed}-{s}-{t}", 4)).strip()
    result = words.text(words.filler(f"agent-result-{seed}-{s}-{t}", max(1, result_tokens))).strip()
    call_id = f"call_{s}_{t}"
    if api == "messages":
        return [{"role": "assistant", "content": [{"type": "text", "text": note},
                                                  {"type": "tool_use", "id": call_id, "name": name,
                                                   "input": {arg: value}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]}]
    return [{"role": "assistant", "content": note},
            {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps({arg: value})},
            {"type": "function_call_output", "call_id": call_id, "output": result}]
