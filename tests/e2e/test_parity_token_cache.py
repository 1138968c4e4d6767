"""Tokenization parity with real vLLM through the prefix token cache (kvcore/token_cache.py).

Multi-turn conversations are tokenized turn after turn, each re-sending its history as clients do,
so every turn after the first reuses cached prefixes; each turn's ids must equal vLLM's own
(``/v1/chat/completions/render`` on the exact body). Message texts sit on the junctions the cache
cuts at: partial special tokens, partial words, spaces, unicode. The gateway (cache on by default)
counts the same prompt tokens in ``/admin/explain`` and reports its cache hits in ``/metrics``.
"""
from __future__ import annotations

import pytest

from kvcore.tokenization import PromptTokenizer

from conftest import metric
from .bodies import MODEL, words
from .test_parity import _post, vllm_chat_ids, vllm_completion_ids

TURNS = [
    ("user", "Hello <|im_sta"),
    ("assistant", "rt|> is not a marker here; naïve café 🚀 "),
    ("user", "  spaces  \n\n at both ends  "),
    ("assistant", "<|im_end|> inside content, then 日本語 and 👍🏽"),
    ("user", "partial wor"),
    ("assistant", "ds continue: " + words(60, 11)),
    ("user", "'s 't 'll <s> </s"),
]


def _conversation_bodies(system: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    out = []
    for role, content in TURNS:
        msgs.append({"role": role, "content": content})
        out.append({"model": MODEL, "messages": list(msgs), "add_generation_prompt": role == "user"})
    return out


@pytest.fixture(scope="module")
def cached_tokenizer(e2e_model) -> PromptTokenizer:
    tok = PromptTokenizer(e2e_model)
    assert tok.token_cache is not None
    return tok


@pytest.mark.parametrize("system", ["Be terse. " + words(80, 7), "Réponds en français. " + words(90, 8)])
def test_multi_turn_cached_ids_match_vllm(cluster, cached_tokenizer, system):
    ref_url = cluster.workers["w0"].url
    before = cached_tokenizer.cache_stats()
    for body in _conversation_bodies(system):
        ours = cached_tokenizer.encode_chat(body)
        rendered, tokenized = vllm_chat_ids(ref_url, body)
        assert ours == rendered, f"turn {len(body['messages'])}: ours vs vLLM render"
        assert ours == tokenized, f"turn {len(body['messages'])}: ours vs vLLM /tokenize"
        assert cluster.explain(body)["prompt_tokens"] == len(ours)
    after = cached_tokenizer.cache_stats()
    assert after.hits - before.hits >= len(TURNS) - 1
    assert after.fallbacks == before.fallbacks
    assert metric(cluster.base, "kvroute_tokenize_cache_total", result="hit") >= len(TURNS) - 1


def test_growing_completion_with_special_tokens_matches_vllm(cluster, cached_tokenizer):
    """A completions prompt that carries chat markers goes through the same cache (with and without
    the post-processor's special tokens)."""
    ref_url = cluster.workers["w0"].url
    prompt = ""
    for i, (role, content) in enumerate(TURNS):
        prompt += f"<|im_start|>{role}\n{content}<|im_end|>\n" + (words(40, 20 + i) if i == 0 else "")
        for special in (True, False):
            body = {"model": MODEL, "prompt": prompt, "add_special_tokens": special}
            assert cached_tokenizer.encode_completion(body) == vllm_completion_ids(ref_url, body)
    assert _post(ref_url + "/tokenize", {"model": MODEL, "prompt": prompt})["count"] == \
        len(cached_tokenizer.encode_completion({"prompt": prompt})[0])
