"""kvcore.responses_input: an OpenAI Responses body as the chat body vLLM 0.32 renders
(tests/e2e/test_parity_responses.py checks the token ids against a real server's render)."""
from __future__ import annotations

import pytest

from kvcore.prompt_errors import BadPrompt, UnsupportedPrompt
from kvcore.responses_input import responses_to_chat

CALL = {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"}


def test_items_merge_into_the_assistant_message_before_them():
    chat = responses_to_chat({"instructions": "S.", "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "id": "m", "status": "completed",
         "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "why"}]},
        CALL, {**CALL, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "a"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "next"}]}],
        "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}]})
    call = {"id": "c1", "function": {"name": "ls", "arguments": "{}"}, "type": "function"}
    assert chat["messages"] == [
        {"role": "system", "content": "S."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning": "why",
         "tool_calls": [call, {**call, "id": "c2"}]},
        {"role": "tool", "content": "a", "tool_call_id": "c1"},
        {"role": "assistant", "reasoning": "next"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    assert (chat["add_generation_prompt"], chat["continue_final_message"], chat["add_special_tokens"]) == (
        True, False, True)


def test_a_partial_last_message_is_continued_and_the_effort_passes_on():
    chat = responses_to_chat({"input": [{"type": "message", "role": "assistant", "status": "in_progress",
                                         "content": [{"type": "output_text", "text": "One,"}]}],
                              "reasoning": {"effort": "low"}})
    assert (chat["add_generation_prompt"], chat["continue_final_message"], chat["reasoning_effort"]) == (
        False, True, "low")
    own = responses_to_chat({"input": "x", "reasoning": {"effort": "high"},
                             "chat_template_kwargs": {"enable_thinking": False}})
    assert (own["reasoning_effort"], own["chat_template_kwargs"]) == ("high", {"enable_thinking": False})


@pytest.mark.parametrize("body,error", [
    ({"input": []}, BadPrompt),
    ({"input": 5}, BadPrompt),
    ({"input": ["x"]}, BadPrompt),
    ({"input": "x", "tools": [{"type": "function"}]}, BadPrompt),
    ({"input": "x", "previous_response_id": "resp_1"}, UnsupportedPrompt),
    ({"input": "x", "tools": [{"type": "web_search"}]}, UnsupportedPrompt),
    ({"input": [{"type": "reasoning", "encrypted_content": "zz", "summary": []}]}, UnsupportedPrompt),
    ({"input": [{**CALL, "namespace": "fs"}]}, UnsupportedPrompt),
    ({"input": [{"type": "item_reference", "id": "x"}]}, UnsupportedPrompt),
])
def test_malformed_and_unsupported_bodies(body, error):
    with pytest.raises(error):
        responses_to_chat(body)
