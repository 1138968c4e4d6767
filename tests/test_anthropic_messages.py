"""kvcore.anthropic_messages: an Anthropic Messages body as the chat body vLLM 0.32 renders, and
the tokenizer's Messages path on the tiny model (tests/e2e/test_parity_messages.py checks both
against real vLLM)."""
from __future__ import annotations

import json

import pytest

from kvcore.anthropic_messages import messages_to_chat
from kvcore.prompt_errors import BadPrompt, UnsupportedPrompt
from kvcore.tokenization import PromptTokenizer

USER = {"role": "user", "content": "hi"}


def test_system_blocks_join_without_separator_and_drop_the_billing_header():
    body = {"messages": [USER], "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "A."},
        {"type": "text", "text": ""}, {"type": "text", "text": " B."}]}
    assert messages_to_chat(body)["messages"] == [{"role": "system", "content": "A. B."}, USER]


def test_inline_system_stays_in_place_or_merges_into_the_leading_one():
    body = {"system": "S.", "messages": [USER, {"role": "system", "content": [{"type": "text", "text": "R."}]},
                                         {"role": "user", "content": "more"}]}
    assert messages_to_chat(body)["messages"] == [
        {"role": "system", "content": "S."}, USER, {"role": "system", "content": "R."},
        {"role": "user", "content": "more"}]
    assert messages_to_chat(body, merge_inline_system=True)["messages"] == [
        {"role": "system", "content": "S.R."}, USER, {"role": "user", "content": "more"}]


def test_tool_use_and_results_become_tool_calls_and_tool_messages_before_the_user_text():
    body = {"messages": [
        USER,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t1"}, {"type": "thinking", "thinking": "t2"},
                                          {"type": "tool_use", "id": "tu1", "name": "ls", "input": {"d": "."}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                      "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                     {"type": "text", "text": "go on"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": "only"}]},
        {"role": "assistant", "content": [{"type": "tool_result", "content": "x"}, {"type": "text", "text": "y"}]}],
        "tools": [{"name": "ls", "input_schema": {"type": "object"}, "strict": True},
                  {"name": "now", "input_schema": {"properties": {}}}]}
    chat = messages_to_chat(body)
    assert chat["messages"] == [
        USER,
        {"role": "assistant", "reasoning": "t1t2", "tool_calls": [
            {"id": "tu1", "type": "function", "function": {"name": "ls", "arguments": json.dumps({"d": "."})}}]},
        {"role": "tool", "tool_call_id": "tu1", "content": "a\nb"},
        {"role": "user", "content": "go on"},
        {"role": "tool", "tool_call_id": "tu1", "content": "only"},  # the user message left empty is dropped
        {"role": "assistant", "content": [{"type": "text", "text": "Tool result: x"}, {"type": "text", "text": "y"}]}]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "ls", "description": None, "parameters": {"type": "object"},
                                          "strict": True}},
        {"type": "function", "function": {"name": "now", "description": None,
                                          "parameters": {"properties": {}, "type": "object"}}}]
    assert list(chat["tools"][1]["function"]["parameters"]) == ["properties", "type"]  # added last, as vLLM


def test_thinking_disabled_and_output_effort_set_the_reasoning_effort():
    assert "reasoning_effort" not in messages_to_chat({"messages": [USER], "thinking": {"type": "enabled",
                                                                                        "budget_tokens": 2048}})
    assert messages_to_chat({"messages": [USER], "output_config": {"effort": "high"}})["reasoning_effort"] == "high"
    disabled = {"messages": [USER], "thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}
    assert messages_to_chat(disabled, disabled_thinking_effort="low")["reasoning_effort"] == "low"


@pytest.mark.parametrize("body,error", [
    ({"messages": []}, BadPrompt),
    ({"messages": [{"role": "tool", "content": "x"}]}, BadPrompt),
    ({"messages": [{"role": "user", "content": 3}]}, BadPrompt),
    ({"messages": [{"role": "user", "content": ["x"]}]}, BadPrompt),
    ({"messages": [USER], "tools": [{"name": "t"}]}, BadPrompt),
    ({"messages": [USER], "system": 5}, BadPrompt),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]},
     UnsupportedPrompt),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AA"}}]}]}]}, UnsupportedPrompt),
    ({"messages": [{"role": "user", "content": [{"type": "tool_addition", "tool": {"type": "tool_reference",
                                                                                  "name": "t"}}]}]}, UnsupportedPrompt),
])
def test_malformed_and_unsupported_bodies(body, error):
    with pytest.raises(error):
        messages_to_chat(body)


def test_the_tokenizer_renders_a_messages_body_as_its_chat_body(tiny_model):
    tok = PromptTokenizer(tiny_model)
    body = {"model": "tiny", "max_tokens": 3, "system": "Be brief.",
            "messages": [USER, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                         {"role": "user", "content": "bye"}]}
    chat = {"messages": [{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "bye"}]}
    ids = tok.encode_messages(body)
    assert ids == tok.encode_chat(chat) and len(ids) > 10
    # the tiny template takes a system message anywhere, and renders reasoning_effort none like the others
    assert (tok.merge_inline_system, tok.disabled_thinking_effort) == (False, "low")
