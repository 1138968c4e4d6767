"""The gateway renders chat templates with vLLM 0.32's own transformers range (``>=5.16.1,<5.20``,
vLLM's package metadata): newer releases change what a template sees. 5.25 aliases a message's
reasoning as ``thinking`` (``_alias_reasoning_fields``) and drops None-valued keys, so a template
reading ``message.thinking`` rendered reasoning into the gateway's prompt that vLLM 0.32 leaves
out: other token ids, other block keys, a prefix hit predicted that the worker never has."""
from __future__ import annotations

from pathlib import Path

from kvcore.tokenization import PromptTokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-model"
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
