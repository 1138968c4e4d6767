"""OpenAI Responses (``POST /v1/responses``) token parity with real vLLM, one body at a time: the
token ids kvroute makes (kvcore.responses_input, then the chat template, the code the gateway
runs) equal the worker's own ``/v1/responses/render`` of the exact body; the body sent through the
gateway with the ``openai`` SDK goes to the worker ``/admin/explain?path=/v1/responses`` names and
reports the same number of input tokens; and a next turn that repeats the first is credited with
the first's cached blocks, as vLLM reports them."""
from __future__ import annotations

import httpx
import pytest

from conftest import wait_until
from kvcore.tokenization import PromptTokenizer

from .anthropic_bodies import responses_bodies, shared_full_blocks
from .conftest import BLOCK_SIZE

BODIES = responses_bodies()


@pytest.fixture(scope="module")
def prompt_tokenizer(e2e_model) -> PromptTokenizer:
    return PromptTokenizer(e2e_model)


def send(cluster, body: dict, **kw):
    """``body`` through the gateway with the ``openai`` SDK; the raw response."""
    extra = {k: v for k, v in body.items() if k not in ("model", "input", "instructions", "tools", "tool_choice",
                                                        "reasoning", "max_output_tokens")}
    args = {k: v for k, v in body.items() if k not in extra}
    return cluster.openai().responses.with_raw_response.create(**args, extra_body=extra or None, **kw)


@pytest.mark.parametrize("index", range(len(BODIES)), ids=[name for name, _ in BODIES])
def test_responses_token_ids_match_vllm(cluster, prompt_tokenizer, index):
    name, body = BODIES[index]
    ours = prompt_tokenizer.encode_responses(body)
    rendered = httpx.post(cluster.workers["w0"].url + "/v1/responses/render", json=body, timeout=60)
    assert rendered.status_code == 200, rendered.text
    assert ours == rendered.json()["token_ids"], f"{name}: ours vs vLLM's render"
    cluster.wait_idle()
    explained = cluster.explain(body, "/v1/responses")
    assert (explained["prompt_tokens"], explained["blocks"]) == (len(ours), len(ours) // BLOCK_SIZE)
    raw = send(cluster, body)
    assert raw.headers["x-kvroute-worker"] == explained["chosen"]
    assert raw.parse().usage.input_tokens == len(ours)


def test_a_next_turn_goes_to_the_worker_holding_its_prefix(cluster, prompt_tokenizer):
    name, body = next(b for b in BODIES if b[0] == "function call and output")
    body = {**body, "instructions": body["instructions"] + " Session 5c1d."}  # a prefix no other test sent
    worker = send(cluster, body).headers["x-kvroute-worker"]
    follow = {**body, "input": body["input"] + [
        {"type": "message", "role": "assistant", "id": "msg_9", "status": "completed",
         "content": [{"type": "output_text", "text": "A demo.", "annotations": []}]},
        {"role": "user", "content": "Thanks."}]}
    first_ids, follow_ids = prompt_tokenizer.encode_responses(body), prompt_tokenizer.encode_responses(follow)
    shared = shared_full_blocks(first_ids, follow_ids, BLOCK_SIZE)
    assert shared >= 2 * BLOCK_SIZE, (shared, len(first_ids))

    def credited() -> dict | None:
        out = cluster.explain(follow, "/v1/responses")
        return out if (out["chosen"], out["predicted_cached_tokens"]) == (worker, shared) else None
    wait_until(credited, 20, f"the first turn's {shared} tokens credited on {worker}")
    second = send(cluster, follow)
    assert second.headers["x-kvroute-worker"] == worker
    assert second.parse().usage.input_tokens_details.cached_tokens == shared
