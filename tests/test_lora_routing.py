"""LoRA adapters, routed on their own cached blocks: ``kvroute up --engine sim --lora-modules`` with
two adapters. A repeated prompt on one adapter goes to its holder and is credited exactly what the
worker reports cached; the same prompt on the other adapter or the base model gets no credit from
it (vLLM mixes the adapter into every block's hash, so those blocks are no hit there), and the
explain's prediction equals the worker's report in every case. Also ``up``'s flag checks."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from conftest import free_port, kvroute_argv, running_up, wait_until

AUTH = {"Authorization": "Bearer lora-token"}
BLOCK = 32


@pytest.fixture(scope="module")
def lora_up(tmp_path_factory, tiny_model):
    log_dir = tmp_path_factory.mktemp("lora-up")
    with running_up("up", ["--workers", "2", "--model", str(tiny_model), "--served-model-name", "tiny",
                           "--port", str(free_port()), "--speedup", "50", "--lora-modules",
                           f"sql={log_dir / 'sql-adapter'}", '{"name": "chat", "path": "/adapters/chat"}'],
                    log_dir, {"KVROUTE_ADMIN_TOKEN": "lora-token"}) as base:
        yield base


def explain(base: str, body: dict) -> dict:
    r = httpx.post(base + "/admin/explain", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def chat(base: str, model: str, content: str):
    body = {"model": model, "max_tokens": 2,
            "messages": [{"role": "system", "content": content}, {"role": "user", "content": "go"}]}
    planned = explain(base, body)
    raw = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0).chat.completions.with_raw_response.create(**body)
    answer = raw.parse()
    return planned, raw.headers["x-kvroute-worker"], answer


def test_models_lists_each_adapter_under_the_base(lora_up):
    cards = {c["id"]: c for c in httpx.get(lora_up + "/v1/models", timeout=30).json()["data"]}
    assert sorted(cards) == ["chat", "sql", "tiny"]
    assert cards["sql"]["parent"] == cards["chat"]["parent"] == "tiny" and cards["tiny"]["parent"] is None
    assert cards["chat"]["root"] == "/adapters/chat"


def test_an_adapter_is_credited_only_its_own_blocks(lora_up):
    prompt = "Translate questions to SQL over the orders table. " * 30
    planned, worker, first = chat(lora_up, "sql", prompt)
    assert first.model == "sql" and planned["chosen"] == worker
    assert planned["predicted_cached_tokens"] == 0 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens >= 8 * BLOCK

    def again_credited() -> dict | None:  # the worker's KV events reached the index
        p = explain(lora_up, {"model": "sql", "max_tokens": 2, "messages": [
            {"role": "system", "content": prompt}, {"role": "user", "content": "go"}]})
        return p if p["predicted_cached_tokens"] > 0 else None
    wait_until(again_credited, 20, "the adapter's blocks in the index")
    planned, again_worker, again = chat(lora_up, "sql", prompt)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again_worker == worker and cached == (first.usage.prompt_tokens - 1) // BLOCK * BLOCK  # last token computed
    assert planned["predicted_cached_tokens"] == cached

    for other in ("chat", "tiny"):  # same tokens, another adapter or none: nothing to reuse
        planned, _, answer = chat(lora_up, other, prompt)
        assert answer.model == other and answer.usage.prompt_tokens == first.usage.prompt_tokens
        assert planned["predicted_cached_tokens"] == 0, (other, planned)
        assert [sum(c["matched_blocks"].values()) for c in planned["candidates"]] == [0, 0], (other, planned)
        assert answer.usage.prompt_tokens_details.cached_tokens == 0, other


def test_an_unknown_adapter_is_a_404(lora_up):
    r = httpx.post(lora_up + "/v1/chat/completions", timeout=30,
                   json={"model": "sq1", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and "sq1" in r.json()["error"]["message"]


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "sql"], "neither NAME=PATH nor JSON"),
    (["--lora-modules", "a=/x", "a=/y"], "given twice"),
    (["--engine", "vllm", "--vllm-python", "/bin/true", "--lora-modules", "a=/nonexistent"], "no adapter_config.json"),
    (["--prefill-workers", "1", "--decode-workers", "1", "--lora-modules", "a=/x"], "not supported"),
])
def test_up_refuses_bad_lora_flags_at_start(tiny_model, flags, message):
    import subprocess

    done = subprocess.run(kvroute_argv("up", "--model", str(tiny_model), *flags), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_vllm_lora_flags_fit_the_largest_adapter(tmp_path):
    import json

    from kvroute.engines import lora_argv

    adapters = {}
    for name, rank in (("a", 8), ("b", 40)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": rank}))
        adapters[name] = tmp_path / name
    assert lora_argv({"a": adapters["a"]}) == ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "16",
                                               "--lora-modules", f"a={adapters['a']}"]
    assert lora_argv(adapters)[:5] == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "64"]
