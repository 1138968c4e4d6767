"""Request bodies for the parity tests: varied chat and completions bodies (OpenAI shape plus
vLLM's extra fields), each ``(name, kind, body)`` with ``kind`` "chat" or "completion".

Covers system/user/assistant turns, multi-part text content, tool definitions, assistant tool
calls and tool results, ``add_generation_prompt`` false, ``continue_final_message``, the
developer role, names, unicode and emoji, special-token text, ~1k-token prompts, and completions
with a string, a list of strings, token ids and lists of token ids.
"""
from __future__ import annotations

import random
from typing import Any

MODEL = "tiny"
_WORDS = ("cache block token prefix route worker server request model prompt weather city search "
          "answer question data file order price customer account the of and to in is").split()

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the docs",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "k": {"type": "integer"}}}}}


def words(n: int, seed: int) -> str:
    """``n`` pseudo-random words (deterministic for ``seed``)."""
    rnd = random.Random(seed)
    return " ".join(rnd.choice(_WORDS) for _ in range(n))


def _call(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    body.update(extra)
    if "tools" in body:
        body.setdefault("tool_choice", "none")  # vLLM refuses "auto" without a tool parser
    return body


def parity_bodies() -> list[tuple[str, str, dict[str, Any]]]:
    """At least 30 ``(name, kind, body)`` triples."""
    sys_long = "You are a support agent. " + words(525, 1)  # ~1k tokens with the tiny tokenizer
    user = {"role": "user", "content": "What is the weather in Paris?"}
    calls = [_call("call_1", "get_weather", '{"city": "Paris", "unit": "c"}')]
    chat = [
        ("user only", _chat([{"role": "user", "content": "hello there"}])),
        ("system + user", _chat([{"role": "system", "content": "Be terse."}, user])),
        ("multi-turn", _chat([{"role": "system", "content": "Be terse."}, user,
                              {"role": "assistant", "content": "Sunny, 21 C."},
                              {"role": "user", "content": "And tomorrow?"}])),
        ("multi-part user", _chat([{"role": "user", "content": [{"type": "text", "text": "first part"},
                                                                {"type": "text", "text": "second part"}]}])),
        ("multi-part system", _chat([{"role": "system", "content": [{"type": "text", "text": "Rule one."},
                                                                    {"type": "text", "text": "Rule two."}]},
                                     user])),
        ("tools", _chat([user], tools=[WEATHER_TOOL])),
        ("tools + system", _chat([{"role": "system", "content": "Use tools."}, user],
                                 tools=[WEATHER_TOOL, SEARCH_TOOL])),
        ("tool call + result", _chat([user, {"role": "assistant", "content": None, "tool_calls": calls},
                                      {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
                                     tools=[WEATHER_TOOL])),
        ("parallel tool calls", _chat([
            {"role": "user", "content": "Weather in Oslo and Rome, and search for umbrellas"},
            {"role": "assistant", "content": "", "tool_calls": [
                _call("a", "get_weather", '{"city": "Oslo"}'), _call("b", "get_weather", '{"city": "Rome"}'),
                _call("c", "search", '{"q": "umbrella", "k": 3}')]},
            {"role": "tool", "tool_call_id": "a", "content": "rain"},
            {"role": "tool", "tool_call_id": "b", "content": "sun"},
            {"role": "tool", "tool_call_id": "c", "content": "3 results"}], tools=[WEATHER_TOOL, SEARCH_TOOL])),
        ("tool call unicode args", _chat([
            {"role": "user", "content": "Wetter in Zürich?"},
            {"role": "assistant", "content": "Ich schaue nach.", "tool_calls": [
                _call("z", "get_weather", '{"city": "Zürich 🇨🇭", "unit": "c"}')]},
            {"role": "tool", "tool_call_id": "z", "content": "☀️ 25°"}], tools=[WEATHER_TOOL])),
        ("tool call empty args", _chat([user, {"role": "assistant", "content": None,
                                               "tool_calls": [_call("e", "search", "")]}],
                                       tools=[SEARCH_TOOL], add_generation_prompt=False)),
        ("no generation prompt", _chat([{"role": "user", "content": "complete me"}], add_generation_prompt=False)),
        ("ends with assistant", _chat([user, {"role": "assistant", "content": "It is"}], add_generation_prompt=False)),
        ("continue final message", _chat([user, {"role": "assistant", "content": "The weather in Paris is"}],
                                         add_generation_prompt=False, continue_final_message=True)),
        ("emoji", _chat([{"role": "user", "content": "🚀✨ launch 👍🏽 🇫🇷 ok? 😀😀"}])),
        ("scripts", _chat([{"role": "user", "content": "日本語 中文 한국어 русский Ελληνικά العربية עברית"}])),
        ("accents", _chat([{"role": "system", "content": "Réponds en français, s'il te plaît."},
                           {"role": "user", "content": "Où est le café? Ça va, señor naïve façade…"}])),
        ("developer role", _chat([{"role": "developer", "content": "Only answer in JSON."}, user])),
        ("developer + tools", _chat([{"role": "developer", "content": "Call tools."}, user], tools=[WEATHER_TOOL])),
        ("names", _chat([{"role": "user", "name": "alice", "content": "hi"},
                         {"role": "assistant", "content": "hello alice"},
                         {"role": "user", "name": "bob", "content": "and me?"}])),
        ("whitespace", _chat([{"role": "user", "content": "  leading\n\n\ttabs\t and   spaces  \n trailing   "}])),
        ("json content", _chat([{"role": "user", "content": '{"order": 1234, "items": [{"sku": "A-1", "qty": 2}]}'}])),
        ("code content", _chat([{"role": "user", "content": "def f(x):\n    return x * 2  # double\n\nprint(f(21))"}])),
        ("special-token text", _chat([{"role": "user", "content": "literal <|im_start|> and </s> inside"}])),
        ("template kwargs", _chat([user], chat_template_kwargs={"unused_flag": True})),
        ("1k-token system", _chat([{"role": "system", "content": sys_long}, {"role": "user", "content": "ok?"}])),
        ("1k-token history", _chat([{"role": "user", "content": words(225, 2)},
                                    {"role": "assistant", "content": words(170, 3)},
                                    {"role": "user", "content": words(135, 4)}])),
    ]
    completion = [
        ("completion string", {"model": MODEL, "prompt": "Once upon a time"}),
        ("completion unicode", {"model": MODEL, "prompt": "naïve café 🚀 日本語"}),
        ("completion list of strings", {"model": MODEL, "prompt": ["first prompt here", "second one 😀"]}),
        ("completion token ids", {"model": MODEL, "prompt": list(range(6, 6 + 70))}),
        ("completion list of token ids", {"model": MODEL, "prompt": [[7, 8, 9, 10] * 10, [11, 12] * 20]}),
        ("completion no special tokens", {"model": MODEL, "prompt": "plain text", "add_special_tokens": False}),
        ("completion 1k tokens", {"model": MODEL, "prompt": "Summary: " + words(530, 5)}),
    ]
    return [(n, "chat", b) for n, b in chat] + [(n, "completion", b) for n, b in completion]
