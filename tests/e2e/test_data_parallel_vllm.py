"""Data parallel ranks on real vLLM (CPU build): ``kvroute up --engine vllm --workers 1
--data-parallel-size 2`` starts one vLLM server with two engine cores, each with its own KV cache
and its own KV-event endpoint, and the gateway routes to each rank as a worker (``w0-dp0``,
``w0-dp1``). A prompt sent to a rank and repeated goes back to that rank, and vLLM reports exactly
the predicted tokens as cached; the other rank holds none of it (its KV events say so, and its
``engine`` label of ``vllm:prefix_cache_hits_total`` stays 0)."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from e2e.conftest import vllm_up
from conftest import ADMIN_TOKEN, wait_until

from .bodies import words

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BLOCK = 32


@pytest.fixture(scope="module")
def dp_cluster(e2e_model, tmp_path_factory):
    with vllm_up("up-dp", e2e_model, "tiny", tmp_path_factory.mktemp("dp-vllm"), "--workers", "1",
                 "--data-parallel-size", "2", "--num-gpu-blocks-override", "128") as base:
        yield base


def _hits_per_engine(url: str) -> dict[str, float]:
    return {s.labels["engine"]: s.value
            for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
            for s in family.samples if s.name == "vllm:prefix_cache_hits_total"}


def test_each_rank_is_routed_on_its_own_cache(dp_cluster):
    base = dp_cluster
    workers = httpx.get(base + "/admin/workers", headers=AUTH, timeout=30).json()["workers"]
    assert sorted(w["id"] for w in workers) == ["w0-dp0", "w0-dp1"]
    url = workers[0]["url"]
    assert {w["url"] for w in workers} == {url}
    before = _hits_per_engine(url)
    assert sorted(before) == ["0", "1"]  # one label set per engine core
    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "system", "content": "DP check. " + words(300, 8800)}, {"role": "user", "content": words(6, 8801)}]}

    def explain() -> dict:
        r = httpx.post(base + "/admin/explain", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    first = client.chat.completions.with_raw_response.create(**body)
    holder, prompt = first.headers["x-kvroute-worker"], first.parse().usage.prompt_tokens
    rank = holder.removeprefix("w0-dp")
    hit = (prompt - 1) // BLOCK * BLOCK
    planned = wait_until(lambda: (p := explain())["predicted_cached_tokens"] and p, 60, "the rank's KV events")
    assert (planned["chosen"], planned["predicted_cached_tokens"]) == (holder, hit)
    other = [c for c in planned["candidates"] if c["worker"] != holder]
    assert [sum(c["matched_blocks"].values()) for c in other] == [0]
    again = client.chat.completions.with_raw_response.create(**body)
    assert again.headers["x-kvroute-worker"] == holder
    assert again.parse().usage.prompt_tokens_details.cached_tokens == hit
    after = _hits_per_engine(url)
    assert {e: after[e] - before[e] for e in after} == {rank: hit, str(1 - int(rank)): 0}
