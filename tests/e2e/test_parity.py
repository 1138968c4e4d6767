"""Tokenization and block-key parity with real vLLM, one request body at a time (34 bodies).

For each body: the token ids kvroute makes (kvcore.tokenization, the code the gateway runs, on the
same model directory) equal vLLM's own: ``/v1/chat/completions/render`` on the exact body and
``/tokenize`` (chat), or ``/tokenize`` per prompt (completions); the gateway's ``/admin/explain``
counts the same prompt tokens; the request sent through the gateway reports the same
``usage.prompt_tokens``. Then the block keys the agent made from that worker's real KV events
(read back from Redis) cover every full block of the gateway's keys for the prompt.
"""
from __future__ import annotations

import time

import httpx
import pytest

from kvcore.block_keys import block_keys
from kvcore.tokenization import PromptTokenizer

from .bodies import MODEL, parity_bodies
from .conftest import BLOCK_SIZE, redis_match

BODIES = parity_bodies()
KEY_WAIT_S = 20.0


@pytest.fixture(scope="module")
def prompt_tokenizer(e2e_model) -> PromptTokenizer:
    return PromptTokenizer(e2e_model)


def _post(url: str, body: dict) -> dict:
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text}"
    return r.json()


def vllm_chat_ids(worker_url: str, body: dict) -> tuple[list[int], list[int]]:
    """vLLM's prompt ids for a chat body: (render of the exact body, /tokenize of its messages)."""
    rendered = _post(worker_url + "/v1/chat/completions/render", body)
    tok_body = {k: body[k] for k in ("model", "messages", "tools", "add_generation_prompt",
                                     "continue_final_message", "chat_template_kwargs") if k in body}
    tokenized = _post(worker_url + "/tokenize", tok_body)
    return list(rendered["token_ids"]), list(tokenized["tokens"])


def vllm_completion_ids(worker_url: str, body: dict) -> list[list[int]]:
    """vLLM's prompt ids for each prompt of a completions body (token-id prompts are taken as-is)."""
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    if all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    out = []
    for p in prompts:
        if isinstance(p, list):
            out.append(list(p))
        else:
            out.append(list(_post(worker_url + "/tokenize", {"model": MODEL, "prompt": p,
                                                             "add_special_tokens": body.get("add_special_tokens", True)})["tokens"]))
    return out


def _send(cluster, kind: str, body: dict):
    """The body through the gateway with the openai SDK (max_tokens 1): (worker id, usage)."""
    cli = cluster.openai()
    extra = {k: v for k, v in body.items() if k not in ("model", "messages", "prompt", "tools", "tool_choice")}
    if kind == "chat":
        kw = {"tools": body["tools"], "tool_choice": body["tool_choice"]} if "tools" in body else {}
        raw = cli.chat.completions.with_raw_response.create(
            model=body["model"], messages=body["messages"], max_tokens=1, extra_body=extra, **kw)
    else:
        raw = cli.completions.with_raw_response.create(model=body["model"], prompt=body["prompt"],
                                                       max_tokens=1, extra_body=extra)
    return raw.headers["x-kvroute-worker"], raw.parse().usage


@pytest.mark.parametrize("name,kind,body", BODIES, ids=[b[0] for b in BODIES])
def test_token_ids_and_block_keys_match_vllm(cluster, prompt_tokenizer, name, kind, body):
    ref_url = cluster.workers["w0"].url
    if kind == "chat":
        ours = [prompt_tokenizer.encode_chat(body)]
        rendered, tokenized = vllm_chat_ids(ref_url, body)
        assert ours[0] == rendered, f"{name}: ours vs vLLM render"
        assert ours[0] == tokenized, f"{name}: ours vs vLLM /tokenize"
    else:
        ours = prompt_tokenizer.encode_completion(body)
        assert ours == vllm_completion_ids(ref_url, body), f"{name}: ours vs vLLM /tokenize"
    total = sum(len(ids) for ids in ours)

    cluster.wait_idle()
    explained = cluster.explain(body)
    assert explained["prompt_tokens"] == total
    assert explained["blocks"] == len(ours[0]) // BLOCK_SIZE
    worker, usage = _send(cluster, kind, body)
    assert worker == explained["chosen"]
    assert usage.prompt_tokens == total  # vLLM's count of what it tokenized from the same body

    # Key parity: the agent of the worker that ran it published, from vLLM's BlockStored events,
    # exactly our keys for every full block of each prompt.
    for ids in ours:
        keys = block_keys(ids, BLOCK_SIZE, MODEL)
        if not keys:
            continue
        end = time.monotonic() + KEY_WAIT_S
        held = 0
        while time.monotonic() < end:
            match = redis_match(cluster.redis_url, keys).get(worker)
            held = match.gpu if match else 0
            if held == len(keys):
                break
            time.sleep(0.2)
        assert held == len(keys), f"{name}: agent of {worker} holds {held} of {len(keys)} full blocks"
        # The same prompt with its last full block's last token changed: held up to that block only.
        other = list(ids[:len(keys) * BLOCK_SIZE])
        other[-1] = (other[-1] + 1) % prompt_tokenizer.vocab_size
        partial = redis_match(cluster.redis_url, block_keys(other, BLOCK_SIZE, MODEL)).get(worker)
        assert (partial.gpu if partial else 0) == len(keys) - 1
