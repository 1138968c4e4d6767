"""Agent APIs through the gateway over two real ``kvroute sim`` workers: Anthropic's Messages API
(``POST /v1/messages``, the ``anthropic`` SDK) and OpenAI's Responses API (the ``openai`` SDK).
An agent's first call and its next turn (system prompt, tools, tool use and result), streamed and
not: the second goes to the worker holding the first's prefix, the worker reports the credited
tokens as cached, and the gateway learns that report from Anthropic's usage (the decision log's
``actual_cached_tokens``). A stored response is continued on the worker that made it."""
from __future__ import annotations

import json

import anthropic
import openai
import httpx
import pytest

from conftest import ADMIN_TOKEN, wait_until
from kvcore.tokenization import PromptTokenizer
from test_gateway_e2e import BLOCK, running_two_sim_gateway, system_prompt

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_model):
    with running_two_sim_gateway(tmp_path_factory, tiny_model, "messages", policy={"name": "ttft"}) as (base, _, _):
        yield base


def explain(base: str, body: dict) -> dict:
    r = httpx.post(base + "/admin/explain?path=/v1/messages", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_agent_turn_and_the_next_go_to_the_prefix_holder(gateway, tiny_model):
    tok = PromptTokenizer(tiny_model)
    client = anthropic.Anthropic(base_url=gateway, api_key="x", max_retries=0)
    first = {"model": "tiny", "max_tokens": 3, "system": system_prompt("agent", 300), "tools": TOOLS,
             "messages": [{"role": "user", "content": "What is in README.md?"},
                          {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                                             "input": {"path": "README.md"}}]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                        "content": "# demo"}]}]}
    first_ids = tok.encode_messages(first)
    planned = explain(gateway, first)
    assert (planned["prompt_tokens"], planned["predicted_cached_tokens"]) == (len(first_ids), 0)
    raw = client.messages.with_raw_response.create(**first)
    worker = raw.headers["x-kvroute-worker"]
    answer = raw.parse()
    assert worker == planned["chosen"] and answer.type == "message" and answer.content[0].type == "text"
    # vLLM's split: the prompt's full blocks were written to the prefix cache, the rest is input
    written = len(first_ids) // BLOCK * BLOCK
    assert (answer.usage.input_tokens, answer.usage.cache_read_input_tokens,
            answer.usage.cache_creation_input_tokens) == (len(first_ids) - written, 0, written)

    follow = {**first, "messages": first["messages"] + [{"role": "assistant", "content": "A demo."},
                                                        {"role": "user", "content": "Thanks, and the tests?"}]}
    follow_ids = tok.encode_messages(follow)
    common = next((i for i, (a, b) in enumerate(zip(first_ids, follow_ids)) if a != b), len(first_ids))
    shared = common // BLOCK * BLOCK
    assert shared >= 8 * BLOCK
    planned = explain(gateway, follow)
    assert (planned["chosen"], planned["predicted_cached_tokens"]) == (worker, shared)
    with client.messages.with_streaming_response.create(**follow, stream=True,
                                                        extra_headers={"x-request-id": "agent-turn-2"}) as r:
        assert r.headers["x-kvroute-worker"] == worker
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert all(k == "content_block_delta" for k in kinds[2:-3]) and len(kinds) == 5 + 3  # 3 tokens
    # as vLLM 0.32 streams it: the whole prompt as input at the start, the split at the end
    assert events[0]["message"]["usage"] == {"input_tokens": len(follow_ids), "output_tokens": 0}
    usage = events[-2]["usage"]
    written = len(follow_ids) // BLOCK * BLOCK - shared
    assert (usage["input_tokens"], usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (
        len(follow_ids) - shared - written, shared, written)

    def logged() -> dict | None:
        entries = httpx.get(gateway + "/admin/decisions", headers=AUTH, timeout=30).json()["decisions"]
        entry = next((e for e in entries if e["request_id"] == "agent-turn-2"), None)
        return entry if entry is not None and entry["actual_cached_tokens"] is not None else None
    entry = wait_until(logged, 20, "the streamed turn's usage in the decision log")
    assert (entry["worker"], entry["predicted_cached_tokens"], entry["actual_cached_tokens"]) == (worker, shared, shared)


def test_a_bad_messages_body_gets_the_workers_answer(gateway):
    r = httpx.post(gateway + "/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                   timeout=30)  # no max_tokens: the worker refuses it
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert r.headers["x-kvroute-worker"] in ("w0", "w1")


def test_a_stored_response_is_continued_on_the_worker_that_made_it(gateway, tiny_model):
    """A Responses request with ``previous_response_id`` goes to the worker holding that response
    (any other answers 404), whatever the policy would choose; the id is learnt from the answer."""
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x", max_retries=0)
    first = client.responses.with_raw_response.create(model="tiny", input="Name three colours.", max_output_tokens=3,
                                                      instructions=system_prompt("responses", 200))
    holder, response_id = first.headers["x-kvroute-worker"], first.parse().id
    assert response_id.startswith("resp_")
    other = "w1" if holder == "w0" else "w0"
    # the other worker has never seen it: straight there, it is not found
    sims = {w["id"]: w["url"] for w in httpx.get(gateway + "/admin/workers", headers=AUTH).json()["workers"]}
    lost = httpx.post(sims[other] + "/v1/responses", json={"model": "tiny", "input": "More.",
                                                           "previous_response_id": response_id}, timeout=30)
    assert lost.status_code == 404
    ids = []
    for i in range(4):  # each continuation goes to the holder, which knows the history
        rid = f"continue-{i}"
        r = client.responses.with_raw_response.create(model="tiny", input=f"And {i} more?", max_output_tokens=2,
                                                      previous_response_id=response_id,
                                                      extra_headers={"x-request-id": rid})
        assert r.headers["x-kvroute-worker"] == holder
        ids.append(rid)
    entries = httpx.get(gateway + "/admin/decisions", headers=AUTH, timeout=30).json()["decisions"]
    assert {e["request_id"]: e["reason"] for e in entries if e["request_id"] in ids} == dict.fromkeys(ids, "stored_response")
    # an id no worker made: routed as any request, and the worker's 404 reaches the client
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_unknown")


def test_a_streamed_response_and_its_streamed_continuation(gateway, tiny_model):
    """Responses streamed through the gateway (the ``openai`` SDK's event parser): the sim's event
    sequence, the usage's cached tokens equal to the gateway's prediction, and a streamed answer's
    id (read from ``response.created``) pins its continuation to the worker that made it."""
    tok = PromptTokenizer(tiny_model)
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x", max_retries=0)
    body = {"model": "tiny", "instructions": system_prompt("streamed-responses", 300), "max_output_tokens": 3,
            "input": [{"role": "user", "content": "List the files."},
                      {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py"}]}
    ids = tok.encode_responses(body)
    r = httpx.post(gateway + "/admin/explain?path=/v1/responses", json=body, headers=AUTH, timeout=30)
    planned = r.json()
    with client.responses.with_streaming_response.create(**body, stream=True) as raw:
        worker = raw.headers["x-kvroute-worker"]
        events = [e for e in raw.parse()]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:7] == ["response.output_text.delta"] * 3 and kinds[7:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert worker == planned["chosen"] and done.usage.input_tokens == len(ids) == planned["prompt_tokens"]
    assert done.usage.input_tokens_details.cached_tokens == planned["predicted_cached_tokens"]
    assert done.output[0].content[0].text == "".join(e.delta for e in events if e.type == "response.output_text.delta")

    # the id was read from the stream's first bytes as they passed through
    with client.responses.with_streaming_response.create(model="tiny", input="And?", max_output_tokens=2,
                                                          previous_response_id=done.id, stream=True,
                                                          extra_headers={"x-request-id": "streamed-next"}) as raw:
        assert raw.headers["x-kvroute-worker"] == worker
        last = [e for e in raw.parse()][-1]
    alone = len(tok.encode_responses({"model": "tiny", "input": "And?"}))
    assert last.type == "response.completed" and last.response.usage.input_tokens > alone + 10  # the stored history
    entries = httpx.get(gateway + "/admin/decisions", headers=AUTH, timeout=30).json()["decisions"]
    assert [e["reason"] for e in entries if e["request_id"] == "streamed-next"] == ["stored_response"]
