"""Chat rendering. The gateway renders a request with the model's compiled template directly
when transformers' ``apply_chat_template`` would add nothing else (no ``continue_final_message``,
the model's own template, no kwarg that is one of its parameters): the same text, checked here on
every chat body of the e2e parity corpus and more, for two generated models.

The gateway renders chat templates with vLLM 0.32's own transformers range (``>=5.16.1,<5.20``,
vLLM's package metadata): newer releases change what a template sees. 5.25 aliases a message's
reasoning as ``thinking`` (``_alias_reasoning_fields``) and drops None-valued keys, so a template
reading ``message.thinking`` rendered reasoning into the gateway's prompt that vLLM 0.32 leaves
out: other token ids, other block keys, a prefix hit predicted that the worker never has."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest

from e2e.bodies import WEATHER_TOOL, parity_bodies, words
from kvcore.prompt_errors import BadPrompt, UnsupportedPrompt
from kvcore.tokenization import PromptTokenizer

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "tiny-model"
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402
# reads `thinking` the way gpt-oss-style templates do
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.thinking is defined %}[think:{{ m.thinking }}]{% endif %}"
            "{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_reasoning_is_rendered_as_vllm_0_32_renders_it():
    tok = PromptTokenizer(FIXTURE)
    body = {"chat_template": TEMPLATE, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "r1"},
        {"role": "user", "content": "more"}]}
    # vLLM 0.32's interpreter (transformers 5.19.0) renders this body's conversation so:
    assert tok.render_chat(body) == "<|user|>hi<|assistant|>hello<|user|>more<|assistant|>"


def _bodies() -> list[dict]:
    bodies = [b for _, kind, b in parity_bodies() if kind == "chat"]
    user = {"role": "user", "content": "hi " + words(20, 7)}
    bodies += [
        {"messages": [user], "reasoning_effort": "high"},
        {"messages": [user], "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
        {"messages": [user, {"role": "assistant", "content": "ok", "reasoning_content": "thought"}, user]},
        {"messages": [user], "documents": [{"title": "a", "text": "b"}]},
        {"messages": [user], "documents": ["not a dict"]},                       # an error, either way
        {"messages": [user], "chat_template_kwargs": {"tokenize": True}},       # a parameter of apply_chat_template
        {"messages": [user], "chat_template_kwargs": {"messages": []}},         # a variable render gets twice
        {"messages": [user], "chat_template_kwargs": {"eos_token": "<override>", "bos_token": None}},
        {"messages": [user], "tools": [WEATHER_TOOL], "tool_choice": "none", "add_generation_prompt": False},
    ]
    return bodies


def _render(tok: PromptTokenizer, body: dict) -> str:
    try:
        return tok.render_chat(copy.deepcopy(body))
    except (BadPrompt, UnsupportedPrompt) as exc:
        return f"{type(exc).__name__}"


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_direct_render_equals_apply_chat_template(model):
    path = FIXTURE if model == "tiny" else ensure_model(
        "small", os.environ.get("KVR_VLLM_PYTHON") or str(REPO / ".venv-vllm/bin/python"))
    direct = PromptTokenizer(path, cache_max_tokens=0)
    via_transformers = PromptTokenizer(path, cache_max_tokens=0)
    via_transformers._compiled = None  # every request through apply_chat_template
    assert direct._compiled is not None
    calls = []
    apply = direct._tok.apply_chat_template
    direct._tok.apply_chat_template = lambda *a, **k: calls.append(1) or apply(*a, **k)
    bodies = _bodies()
    got = [_render(direct, b) for b in bodies]
    want = [_render(via_transformers, b) for b in bodies]
    assert got == want
    assert sum(w == "BadPrompt" for w in want) >= 2 and len(set(want)) > 20
    # through transformers: continue_final_message and documents that are not dicts (a kwarg named
    # like one of its parameters is refused at the call); every other body rendered directly
    assert len(calls) == 2, len(calls)
