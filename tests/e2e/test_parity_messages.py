"""Anthropic Messages (``POST /v1/messages``) token parity with real vLLM, one body at a time.

For each body of :mod:`anthropic_bodies`: the token ids kvroute makes (kvcore.anthropic_messages,
then the chat template, the code the gateway runs) equal vLLM's: vLLM's own conversion
(``AnthropicServingMessages.to_chat_completion_request``, run in vLLM's interpreter with the
template probes vLLM makes) rendered by the worker's ``/v1/chat/completions/render``, and the
count the worker's ``/v1/messages/count_tokens`` gives; then the body sent through the gateway
with the ``anthropic`` SDK goes to the worker ``/admin/explain?path=/v1/messages`` names and
reports the same number of input tokens; and a second turn that repeats the first is credited
with the first's cached blocks, as vLLM reports them.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from conftest import wait_until
from kvcore.tokenization import PromptTokenizer

from .anthropic_bodies import messages_bodies, shared_full_blocks
from .conftest import BLOCK_SIZE

BODIES = messages_bodies()
SDK_ARGS = ("model", "max_tokens", "messages", "system", "tools", "tool_choice", "thinking", "output_config")


def send(client: anthropic.Anthropic, body: dict):
    """``body`` through the ``anthropic`` SDK (vLLM's own fields as ``extra_body``); the raw response."""
    extra = {k: v for k, v in body.items() if k not in SDK_ARGS}
    return client.messages.with_raw_response.create(**{k: v for k, v in body.items() if k in SDK_ARGS},
                                                    extra_body=extra or None)

# run in vLLM's interpreter: each body converted by vLLM's own code, as its server converts it
_CONVERT = """
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as S
args = json.load(sys.stdin)
merge = S._detect_merge_inline_system(args["template"])
out = []
for body in args["bodies"]:
    req = S.to_chat_completion_request(AnthropicMessagesRequest.model_validate(body), merge_inline_system=merge,
                                       disabled_thinking_effort=args["effort"])
    d = req.model_dump(mode="json", exclude_none=True)
    out.append({k: d[k] for k in ("messages", "tools", "tool_choice", "reasoning_effort", "chat_template_kwargs")
                if k in d})
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def prompt_tokenizer(e2e_model) -> PromptTokenizer:
    return PromptTokenizer(e2e_model)


@pytest.fixture(scope="module")
def vllm_chat_bodies(prompt_tokenizer, vllm_snippets) -> list[dict]:
    """vLLM's chat body for each of BODIES; the disabled-thinking effort is checked separately
    against the server (count_tokens), since vLLM probes its running renderer for it."""
    args = {"bodies": [b for _, b in BODIES], "template": prompt_tokenizer._template,
            "effort": prompt_tokenizer.disabled_thinking_effort}
    done = vllm_snippets.run(_CONVERT, stdin=json.dumps(args), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("index", range(len(BODIES)), ids=[name for name, _ in BODIES])
def test_messages_token_ids_match_vllm(cluster, prompt_tokenizer, vllm_chat_bodies, index):
    name, body = BODIES[index]
    url = cluster.workers["w0"].url
    ours = prompt_tokenizer.encode_messages(body)
    rendered = httpx.post(url + "/v1/chat/completions/render", json={"model": body["model"], **vllm_chat_bodies[index]},
                          timeout=60)
    assert rendered.status_code == 200, rendered.text
    assert ours == rendered.json()["token_ids"], f"{name}: ours vs vLLM's conversion rendered"
    counted = httpx.post(url + "/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"},
                         timeout=60)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == len(ours), f"{name}: ours vs vLLM's count_tokens"

    cluster.wait_idle()
    explained = cluster.explain(body, "/v1/messages")
    assert (explained["prompt_tokens"], explained["blocks"]) == (len(ours), len(ours) // BLOCK_SIZE)
    client = anthropic.Anthropic(base_url=cluster.base, api_key="x", max_retries=0)
    raw = send(client, body)
    assert raw.headers["x-kvroute-worker"] == explained["chosen"]
    usage = raw.parse().usage
    # Anthropic's usage splits the prompt: input + cache_read + cache_creation (vLLM's prompt_tokens)
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) \
        == len(ours)


def test_a_repeated_agent_turn_goes_to_the_worker_holding_its_prefix(cluster, prompt_tokenizer):
    """The second call of an agent loop re-sends the first's system prompt, tools and turns: the
    gateway sends it where the first went, credits the cached blocks, and vLLM reports them."""
    name, body = next(b for b in BODIES if b[0] == "tool use and result")
    body = {**body, "system": body["system"] + " Session 7f3a."}  # a prefix no other test sent
    client = anthropic.Anthropic(base_url=cluster.base, api_key="x", max_retries=0)
    first = send(client, body)
    worker = first.headers["x-kvroute-worker"]
    follow = {**body, "messages": body["messages"] + [
        {"role": "assistant", "content": "It is a demo repository."},
        {"role": "user", "content": "Which files does it have?"}]}
    first_ids, follow_ids = prompt_tokenizer.encode_messages(body), prompt_tokenizer.encode_messages(follow)
    shared = shared_full_blocks(first_ids, follow_ids, BLOCK_SIZE)
    assert shared >= 4 * BLOCK_SIZE, (shared, len(first_ids))

    def credited() -> dict | None:
        out = cluster.explain(follow, "/v1/messages")
        return out if (out["chosen"], out["predicted_cached_tokens"]) == (worker, shared) else None
    wait_until(credited, 20, f"the first turn's {shared} tokens credited on {worker}")
    second = send(client, follow)
    assert second.headers["x-kvroute-worker"] == worker
    assert second.parse().usage.cache_read_input_tokens == shared


def test_a_body_we_cannot_convert_gets_vllms_own_anthropic_error(cluster):
    """A malformed Messages body is not refused by the gateway: a worker answers it, with the error
    vLLM gives; explain refuses a path it does not route."""
    r = httpx.post(cluster.base + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.messages", r.text  # vLLM's validation
    assert r.headers["x-kvroute-worker"] in cluster.workers
    bad = cluster.admin("POST", "/admin/explain?path=/v1/embeddings", {"model": "tiny", "input": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "path"
