"""`kvroute sim` over HTTP with the `openai` SDK as the client: streaming and not, n, usage,
cached_tokens, /tokenize parity with real vLLM, metrics, errors, recorded requests, disconnects."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import openai
import pytest

from conftest import Proc, free_port, kvroute_argv, wait_http
from router.config.schema import LoadScrapeConfig, WorkerConfig
from router.workers.calls import filtered_path, parse_engine_load, scrape_once
from router.workers.registry import WorkerRegistration
from test_shared_probes import lean_client


@pytest.fixture(scope="module")
def sim(tmp_path_factory, tiny_model):
    """One sim for the module (tests use distinct prompts, so shared cache state does not matter)."""
    port = free_port()
    argv = kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny", "--host", "127.0.0.1",
                        "--port", str(port), "--block-size", "32", "--num-gpu-blocks-override", "256",
                        "--max-model-len", "1024", "--enable-prompt-tokens-details", "--speedup", "200",
                        "--seed", "5")
    proc = Proc("sim", argv, tmp_path_factory.mktemp("sim-http"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc)
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(sim):
    with openai.OpenAI(base_url=sim + "/v1", api_key="sk-test", max_retries=0) as c:
        yield c


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            assert 'model_name="tiny"' in line and 'engine="0"' in line
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_tokenize_matches_real_vllm(sim, capture):
    checked = 0
    for step in capture["steps"]:
        if step.get("tokenize_request"):
            r = httpx.post(sim + "/tokenize", json=step["tokenize_request"])
            assert r.status_code == 200
            want = step["tokenize_response"]
            got = r.json()
            assert got["tokens"] == want["tokens"], step["name"]
            assert (got["count"], got["max_model_len"], got["token_strs"]) == (want["count"], 1024, None)
            checked += 1
    assert checked == 4
    text = httpx.post(sim + "/detokenize", json={"tokens": want["tokens"][:10]}).json()["prompt"]
    assert httpx.post(sim + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] \
        == want["tokens"][:10]


def test_repeated_chat_gets_cached_tokens_and_metrics(sim, client, capture):
    messages = next(s for s in capture["steps"] if s["name"] == "chat_1")["request"]["messages"]
    hits0 = metric(sim, "vllm:prefix_cache_hits_total")
    queries0 = metric(sim, "vllm:prefix_cache_queries_total")
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 192
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 160  # vLLM recomputes the last block
    assert first.choices[0].message.content == second.choices[0].message.content  # deterministic output
    assert first.usage.completion_tokens == 4 and first.choices[0].finish_reason == "length"
    assert metric(sim, "vllm:prefix_cache_hits_total") - hits0 == 160
    assert metric(sim, "vllm:prefix_cache_queries_total") - queries0 == 384
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        metric(sim, name)
    info = [l for l in httpx.get(sim + "/metrics").text.splitlines() if l.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="32"' in info[0] and 'num_gpu_blocks="256"' in info[0]
    # the raw usage as vLLM 0.32 answers an unstreamed chat (seen side by side): the prompt's 6 full
    # blocks are written, less the 5 found cached
    raw = httpx.post(sim + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4})
    assert raw.json()["usage"] == {"prompt_tokens": 192, "total_tokens": 196, "completion_tokens": 4,
                                   "prompt_tokens_details": {"cached_tokens": 160, "created_cache_tokens": 32,
                                                             "multimodal_tokens": None},
                                   "completion_tokens_details": None}


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model="tiny", prompt="streaming equals plain", max_tokens=6, seed=11)
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * 5 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    messages = [{"role": "user", "content": "chat stream"}]
    chat_plain = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5)
    chat_chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, stream=True))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_plain.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chat_chunks)  # no include_usage: no usage chunk


def test_identical_requests_stream_identical_bytes(sim):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "same bytes"}], "max_tokens": 5,
            "stream": True, "unknown_field": True}
    got = []
    for _ in range(2):
        with httpx.stream("POST", sim + "/v1/chat/completions", json=body, headers={"x-request-id": "fixed"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            got.append(r.read())
    assert got[0] == got[1]
    events = got[0].split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and len(events) == 2 + 1 + 5  # role chunk + 5 tokens
    first = json.loads(events[0].removeprefix(b"data: "))
    assert first["id"] == "chatcmpl-fixed" and first["object"] == "chat.completion.chunk"


def test_n_choices_and_prompt_lists(client):
    r = client.completions.create(model="tiny", prompt=["first prompt", "second prompt"], n=2, max_tokens=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 4
    assert r.usage.completion_tokens == 12
    ids = client.completions.create(model="tiny", prompt=[260, 325, 328], max_tokens=2)
    assert ids.usage.prompt_tokens == 3
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "n"}], n=3,
                                          max_tokens=2, stream=True)
    seen: dict[int, str] = {}
    for c in chat:
        for ch in c.choices:
            seen[ch.index] = seen.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(seen) == [0, 1, 2] and all(seen.values())


def test_without_max_tokens_the_output_stops_naturally(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "no limit"}])
    assert r.choices[0].finish_reason == "stop" and 16 <= r.usage.completion_tokens <= 96
    c = client.completions.create(model="tiny", prompt="default sixteen")
    assert c.usage.completion_tokens == 16 and c.choices[0].finish_reason == "length"  # OpenAI default


def test_errors_in_openai_shape(sim, client):
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert nf.value.body["type"] == "NotFoundError" and nf.value.body["code"] == 404
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt=list(range(2, 300)) * 4, max_tokens=1)
    assert "maximum context length is 1024" in long.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1024)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    r = httpx.post(sim + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == 400
    r = httpx.post(sim + "/v1/chat/completions", json={"model": "tiny", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.post(sim + "/v1/completions", json={"model": "tiny", "prompt": "x", "cache_salt": ""})
    assert r.status_code == 400


def test_unknown_fields_accepted_and_recorded_with_headers(sim, client):
    httpx.delete(sim + "/sim/requests")
    r = client.with_options(default_headers={"x-request-id": "req-42"}).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "record me"}], max_tokens=2,
        extra_body={"my_custom_field": {"a": [1, 2]}, "priority": 3})
    assert r.id == "chatcmpl-req-42"
    httpx.post(sim + "/tokenize", json={"prompt": "tok", "extra": 1})
    rec, tok = httpx.get(sim + "/sim/requests").json()["requests"]
    assert tok["path"] == "/tokenize" and tok["body"] == {"prompt": "tok", "extra": 1}
    assert rec["path"] == "/v1/chat/completions" and rec["method"] == "POST"
    assert rec["body"]["my_custom_field"] == {"a": [1, 2]} and rec["body"]["priority"] == 3
    assert rec["headers"]["authorization"] == "Bearer sk-test" and rec["headers"]["x-request-id"] == "req-42"


def test_models_and_health(sim):
    assert httpx.get(sim + "/health").status_code == 200
    data = httpx.get(sim + "/v1/models").json()["data"]
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data] == [("tiny", "model", 1024)]


def test_client_disconnect_aborts_and_frees_blocks(tmp_path, tiny_model):
    port = free_port()
    proc = Proc("slow-sim", kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny",
                                         "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
                                         "--max-model-len", "1024", "--speedup", "1"), tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc)
        body = {"model": "tiny", "prompt": "a long answer " * 10, "max_tokens": 900, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # kept referenced: a closed iterator closes the response
            assert next(lines).startswith("data: ")
            assert metric(url, "vllm:num_requests_running") == 1
            assert metric(url, "vllm:kv_cache_usage_perc") > 0
        # the stream is closed: the request must be aborted long before its ~11 s of decoding end
        deadline = time.monotonic() + 8
        while metric(url, "vllm:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(url, "vllm:num_requests_running") == 0
        assert metric(url, "vllm:kv_cache_usage_perc") == 0
        assert metric(url, "vllm:request_success_total") == 0
        # a non-streaming request whose client gives up is aborted too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=dict(body, stream=False), timeout=1)
        deadline = time.monotonic() + 8
        while metric(url, "vllm:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(url, "vllm:num_requests_running") == 0
        assert metric(url, "vllm:request_success_total") == 0  # aborted, not finished (~11 s of decode)
    finally:
        proc.stop()


def test_reset_prefix_cache_and_bad_flags(sim, client, tiny_model):
    client.completions.create(model="tiny", prompt="reset me " * 20, max_tokens=1)
    assert httpx.post(sim + "/reset_prefix_cache").json() == {"success": True}
    again = client.completions.create(model="tiny", prompt="reset me " * 20, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    bad = subprocess.run(kvroute_argv("sim", "--model", str(tiny_model), "--kv-events-config", "{nope"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--kv-events-config" in bad.stderr
    cfg = json.dumps({"enable_kv_cache_events": True, "unknown_field": 1})
    bad = subprocess.run(kvroute_argv("sim", "--model", str(tiny_model), "--kv-events-config", cfg),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown_field" in bad.stderr


def test_the_gateways_load_scrape_reads_the_filtered_page_as_vllm_serves_it(sim):
    """``/metrics/?name[]=...`` answers the three gauges alone (vLLM mounts prometheus_client's
    app there; router/workers/calls.py), and the gateway's scrape takes that form here."""
    whole = httpx.get(sim + "/metrics", timeout=10).text
    filtered = httpx.get(sim + filtered_path("/metrics"), timeout=10)
    names = {line.split("{")[0] for line in filtered.text.splitlines() if line and not line.startswith("#")}
    assert filtered.status_code == 200
    assert names == {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}

    async def scrape():
        async with lean_client() as client:
            reg = WorkerRegistration(WorkerConfig(id="s", url=sim, model="tiny"))
            return await scrape_once(client, reg, LoadScrapeConfig()), reg

    ok, reg = asyncio.run(scrape())
    assert ok and reg.scrape_filtered is True
    assert (reg.engine_running, reg.engine_waiting, reg.kv_usage) == parse_engine_load(whole)
