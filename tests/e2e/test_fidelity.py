"""The gateway answers as the real vLLM worker behind it would: the same request sent straight to
the worker and through the gateway, compared.

- Streams, for every combination of ``stream_options`` (absent, null, ``{}``, ``include_usage``
  and ``continuous_usage_stats`` each absent, true or false) and ``n`` 1 and 2, chat and
  completions: the client gets vLLM's bytes (ids and timestamps masked), although the gateway asks
  the worker for usage whenever the client did not.
- A table of odd requests (bodies, methods, content types, CORS preflights, token-id prompts,
  batches, a body without ``model``): the same status, the same JSON shape, the same CORS headers.
"""
from __future__ import annotations

import itertools
import re

import httpx
import orjson
import pytest

from conftest import wait_until
from router.workers.calls import filtered_path

from .bodies import MODEL

_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')
SHORT_CHAT = [{"role": "user", "content": "Say a few words."}]  # under one block: never a prefix hit
OPTION_VALUES = (None, True, False)  # None: the key is absent


def _masked_events(stream: bytes) -> list[bytes]:
    """The SSE events of ``stream``, ``id`` and ``created`` blanked."""
    return [e for e in _VOLATILE.sub(rb'"\1":0', stream).split(b"\n\n") if e]


def _normalized(stream: bytes, ordered: bool) -> tuple:
    """What a stream says, free of vLLM's own chunking: vLLM merges the tokens of several engine
    steps into one chunk when its writer falls behind, so two runs of one request can cut the
    text differently, down to no middle chunk at all (every token in the last one). Returns
    ``(text per choice, event skeletons, final usage)``: a skeleton is an event other than a
    middle content chunk, with its text emptied and per-chunk usage figures zeroed (keys and their order
    kept: where ``system_fingerprint`` and ``usage`` sit shows), listed once each in order of
    first appearance (``ordered`` False, for n > 1: sorted); the final usage-only chunk's usage
    is kept whole. Byte-exact framing is checked on captured vLLM streams in
    tests/test_stream_usage.py."""
    text: dict[int, str] = {}
    skeletons: list[bytes] = []
    final_usage = None
    for event in _masked_events(stream):
        if event == b"data: [DONE]":
            skeleton = event
        else:
            assert event.startswith(b"data: "), event
            obj = orjson.loads(event[6:])
            for choice in obj.get("choices", []):
                holder = choice.get("delta", choice)
                key = "content" if "content" in holder else "text"
                if isinstance(holder.get(key), str):
                    text[choice["index"]] = text.get(choice["index"], "") + holder[key]
                    holder[key] = ""
            if isinstance(obj.get("usage"), dict):
                if obj.get("choices") == []:
                    final_usage = dict(obj["usage"])
                obj["usage"] = {k: 0 for k in obj["usage"]}
            skeleton = orjson.dumps(obj)
            choices = obj.get("choices") or []
            if choices and all(c.get("finish_reason") is None and "role" not in c.get("delta", {}) for c in choices):
                continue  # a middle content chunk: whether any exists depends on vLLM's merging
        if skeleton not in skeletons:
            skeletons.append(skeleton)
    return text, skeletons if ordered else sorted(skeletons), final_usage


def _stream_options() -> list:
    combos: list = ["absent", None, {}]
    for inc, cont in itertools.product(OPTION_VALUES, OPTION_VALUES):
        opts = {k: v for k, v in (("include_usage", inc), ("continuous_usage_stats", cont)) if v is not None}
        if opts:
            combos.append(opts)
    return combos


STREAM_CASES = [(kind, n, opts) for kind in ("chat", "completion") for n in (1, 2) for opts in _stream_options()]


def _stream_body(kind: str, n: int, opts) -> dict:
    body: dict = {"model": MODEL, "max_tokens": 4, "stream": True, "ignore_eos": True, "n": n, "seed": 11}
    body.update({"messages": SHORT_CHAT} if kind == "chat" else {"prompt": "Count with me: one two"})
    body["temperature"] = 0.0 if n == 1 else 0.8  # vLLM refuses n > 1 with greedy sampling
    if opts != "absent":
        body["stream_options"] = opts
    return body


def _post_raw(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize("kind,n,opts", STREAM_CASES, ids=[f"{k}-n{n}-{o}" for k, n, o in STREAM_CASES])
def test_stream_is_what_vllm_sends_for_the_clients_options(cluster, kind, n, opts):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = _stream_body(kind, n, opts)
    via = _post_raw(cluster.base + path, body)
    assert via.status_code == 200, via.text
    worker = via.headers["x-kvroute-worker"]
    direct = _post_raw(cluster.workers[worker].url + path, body)
    assert direct.status_code == 200, direct.text
    want, got = _normalized(direct.content, n == 1), _normalized(via.content, n == 1)
    assert got == want
    asked = isinstance(opts, dict) and opts.get("include_usage") is True
    assert (b'"usage":{' in via.content) is asked  # usage exactly when the client asked for it
    assert via.content.endswith(b"data: [DONE]\n\n")


# (name, method, path, headers, body bytes); the gateway and the worker must agree on each
_CT = {"content-type": "application/json"}
_HI = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
ODD_REQUESTS = [
    ("empty body", "POST", "/v1/chat/completions", _CT, b""),
    ("not JSON", "POST", "/v1/chat/completions", _CT, b"not json"),
    ("JSON array", "POST", "/v1/chat/completions", _CT, b"[1,2]"),
    ("empty object", "POST", "/v1/chat/completions", _CT, b"{}"),
    ("no messages", "POST", "/v1/chat/completions", _CT, b'{"model":"tiny"}'),
    ("messages empty", "POST", "/v1/chat/completions", _CT, b'{"model":"tiny","messages":[]}'),
    ("messages a string", "POST", "/v1/chat/completions", _CT, b'{"model":"tiny","messages":"hi"}'),
    ("no model", "POST", "/v1/chat/completions", _CT, b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'),
    ("model null", "POST", "/v1/chat/completions", _CT, b'{"model":null,"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'),
    ("model empty", "POST", "/v1/chat/completions", _CT, b'{"model":"","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'),
    ("model unknown", "POST", "/v1/chat/completions", _CT, b'{"model":"nope","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'),
    ("model a number", "POST", "/v1/chat/completions", _CT, b'{"model":5,"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'),
    ("text/plain", "POST", "/v1/chat/completions", {"content-type": "text/plain"}, _HI),
    ("no content type", "POST", "/v1/chat/completions", {}, _HI),
    ("stream_options without stream", "POST", "/v1/chat/completions", _CT,
     b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream_options":{"include_usage":true}}'),
    ("stream_options a string", "POST", "/v1/chat/completions", _CT,
     b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":true,"stream_options":"x"}'),
    ("negative max_tokens", "POST", "/v1/chat/completions", _CT,
     b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":-1}'),
    ("token ids", "POST", "/v1/completions", _CT, b'{"model":"tiny","prompt":[1,2,3],"max_tokens":1}'),
    ("batch of token ids", "POST", "/v1/completions", _CT, b'{"model":"tiny","prompt":[[1,2,3],[4,5]],"max_tokens":1}'),
    ("batch of strings", "POST", "/v1/completions", _CT, b'{"model":"tiny","prompt":["a","b"],"max_tokens":1}'),
    ("no model, completions", "POST", "/v1/completions", _CT, b'{"prompt":"hi","max_tokens":1}'),
    ("prompt empty list", "POST", "/v1/completions", _CT, b'{"model":"tiny","prompt":[],"max_tokens":1}'),
    ("prompt empty string", "POST", "/v1/completions", _CT, b'{"model":"tiny","prompt":"","max_tokens":1}'),
    ("no prompt", "POST", "/v1/completions", _CT, b'{"model":"tiny","max_tokens":1}'),
    ("token id negative", "POST", "/v1/completions", _CT, b'{"model":"tiny","prompt":[-1],"max_tokens":1}'),
    ("token id out of vocab", "POST", "/v1/completions", _CT, b'{"model":"tiny","prompt":[999999],"max_tokens":1}'),
    ("GET a POST path", "GET", "/v1/chat/completions", {}, b""),
    ("PUT a POST path", "PUT", "/v1/completions", {}, b""),
    ("CORS preflight", "OPTIONS", "/v1/chat/completions",
     {"origin": "http://example.com", "access-control-request-method": "POST",
      "access-control-request-headers": "content-type,authorization"}, b""),
    ("POST with Origin", "POST", "/v1/chat/completions", {**_CT, "origin": "http://example.com"}, _HI),
    ("models with Origin", "GET", "/v1/models", {"origin": "http://example.com"}, b""),
    ("unknown path", "GET", "/nope", {}, b""),
    ("tokenize without model", "POST", "/tokenize", _CT, b'{"prompt":"hi"}'),
    ("trailing slash", "POST", "/v1/chat/completions/", _CT, _HI),
    ("render", "POST", "/v1/chat/completions/render", _CT, _HI),
    ("completions render", "POST", "/v1/completions/render", _CT, b'{"model":"tiny","prompt":"hi"}'),
    ("anthropic messages", "POST", "/v1/messages", _CT,
     b'{"model":"tiny","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}'),
    ("anthropic count tokens", "POST", "/v1/messages/count_tokens", _CT,
     b'{"model":"tiny","messages":[{"role":"user","content":"hi"}]}'),
    ("version", "GET", "/version", {}, b""),
    ("ping", "GET", "/ping", {}, b""),
]


def _answer(r: httpx.Response) -> tuple:
    try:
        data = r.json()
        shape = sorted(data) if isinstance(data, dict) else type(data).__name__
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            shape = ("error", sorted(data["error"]))
    except ValueError:
        shape = "not JSON"
    cors = {k: v for k, v in r.headers.items() if k.startswith("access-control-")}
    return r.status_code, shape, cors, r.headers.get("allow")


@pytest.mark.parametrize("name,method,path,headers,body", ODD_REQUESTS, ids=[c[0] for c in ODD_REQUESTS])
def test_odd_requests_get_the_answer_vllm_gives(cluster, name, method, path, headers, body):
    via = httpx.request(method, cluster.base + path, headers=headers, content=body, timeout=60,
                        follow_redirects=False)
    worker = via.headers.get("x-kvroute-worker", "w0")
    direct = httpx.request(method, cluster.workers[worker].url + path, headers=headers, content=body,
                           timeout=60, follow_redirects=False)
    assert _answer(via) == _answer(direct), f"gateway {via.text[:300]!r} vs vLLM {direct.text[:300]!r}"


def test_the_gateway_reads_each_workers_engine_load_from_its_metrics_page(cluster):
    """vLLM's ``/metrics`` (prometheus_client's ASGI app) gzips its page for a client that
    accepts gzip: the gateway's scrape must still read the three gauges, so every worker's
    ``engine`` figures in ``GET /admin/workers`` are numbers, not None. vLLM answers the
    filtered form of the page (``/metrics/?name[]=...``, router/workers/calls.py) with those three
    metrics alone, and the gateway scrapes every worker in that form."""
    def loads():
        ws = cluster.admin("GET", "/admin/workers").json()["workers"]
        return {w["id"]: w["engine"] for w in ws}

    wait_until(lambda: all(isinstance(e["running"], int) and isinstance(e["waiting"], int)
                           and isinstance(e["kv_cache_usage"], float) for e in loads().values()), 30,
               "every worker's engine load read from its /metrics")
    direct = httpx.get(next(iter(cluster.workers.values())).url + "/metrics", timeout=30)
    assert "vllm:num_requests_running" in direct.text  # the whole page
    assert {e["scrape_filtered"] for e in loads().values()} == {True}
    filtered = httpx.get(next(iter(cluster.workers.values())).url + filtered_path("/metrics"), timeout=30)
    names = {line.split("{")[0] for line in filtered.text.splitlines() if line and not line.startswith("#")}
    assert filtered.status_code == 200 and names == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    assert len(filtered.content) < len(direct.content) / 20  # ~0.5 kB of vLLM 0.32's ~48 kB
