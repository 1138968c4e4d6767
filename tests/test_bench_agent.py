"""The ``agent`` benchmark workload: coding-agent sessions through ``/v1/messages`` and
``/v1/responses``. The bodies' token ids are the gateway's conversion; every session shares the
system prompt and tools; and ``bench rig`` over two sims streams both APIs end to end, with the
gateway's predicted cached tokens equal to what the workers report, at the ideal hit rate on a
roomy cache."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import kvroute_argv

from kvcore.tokenization import PromptTokenizer
from kvbench.agent import agent
from kvbench.words import OneTokenWords

RIG_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def words(tiny_model):
    return OneTokenWords(PromptTokenizer(tiny_model))


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_agent_sessions_share_the_system_prompt_and_grow_their_history(words, api):
    w = agent(words, 32, sessions=3, turns=3, system_tokens=300, user_tokens=20, reply_tokens=10,
              result_tokens=50, output_tokens=4, api=api)
    assert [r.endpoint for r in w.requests] == [api] * 9
    encode = words.tokenizer.encode_messages if api == "messages" else words.tokenizer.encode_responses
    assert all(r.prompt_token_ids == encode(r.body) for r in w.requests)
    by_session: dict[str, list] = {}
    for r in w.requests:
        by_session.setdefault(r.group, []).append(r)
    assert sorted(by_session) == ["s0", "s1", "s2"]
    firsts = [turns[0].prompt_token_ids for turns in by_session.values()]
    assert all(ids[:300] == firsts[0][:300] for ids in firsts)  # one system prompt and tool set
    for turns in by_session.values():
        assert [t.after for t in turns[1:]] == [turns[0].index, turns[1].index]  # a turn waits for the last
        for a, b in zip(turns, turns[1:]):  # the history is re-sent: each turn extends the last
            common = next((i for i, (x, y) in enumerate(zip(a.prompt_token_ids, b.prompt_token_ids)) if x != y),
                          len(a.prompt_token_ids))
            assert common >= len(a.prompt_token_ids) - 8 and len(b.prompt_token_ids) > len(a.prompt_token_ids) + 50
    body = by_session["s0"][1].body
    if api == "messages":
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        assert body["messages"][1]["content"][1]["type"] == "tool_use" and len(body["tools"]) == 3
    else:
        assert [i.get("type", "message") for i in body["input"]] == [
            "message", "message", "function_call", "function_call_output"]


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_rig_streams_the_agent_apis_with_exact_predictions(tiny_model, tmp_path, api):
    out = tmp_path / "rig.json"
    argv = kvroute_argv("bench", "rig", "--workers", "2", "--engine", "sim", "--speedup", "10",
                        "--routers", "kvroute:ttft", "--workload", "agent", "--api", api,
                        "--model", "tiny", "--tokenizer", str(tiny_model), "--conversations", "4", "--turns", "3",
                        "--system-tokens", "400", "--output-tokens", "4", "--concurrency", "2", "--no-progress",
                        "--json", str(out), "--log-dir", str(tmp_path / "logs"))
    r = subprocess.run(["timeout", "-s", "INT", "-k", "20", str(RIG_TIMEOUT_S), *argv], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    workload = agent(OneTokenWords(PromptTokenizer(tiny_model)), 32, 4, 3, 400, 60, 40, 120, 4, api)
    (t,) = report["targets"]
    assert (t["requests"], t["errors"]) == (12, 0)
    lengths = {q.index: len(q.prompt_token_ids) for q in workload.requests}
    assert {rec["index"]: rec["prompt_tokens"] for rec in t["records"]} == lengths
    assert all(rec["completion_tokens"] == 4 and rec["ttft_ms"] > 0 for rec in t["records"])
    gw = t["gateway"]
    assert gw["reported_requests"] == 12 and gw["predicted_cached_tokens"] == gw["reported_cached_tokens"] == t["cached_tokens"]
    assert t["cached_tokens"] > 0 and t["hit_rate"] == pytest.approx(report["workload"]["ideal_hit_rate"])
