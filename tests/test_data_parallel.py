"""Data parallel ranks as routing targets: one server (``kvroute sim --data-parallel-size 2``, as
vLLM's flag) holds two KV caches, and ``kvroute up --data-parallel-size 2`` lists each rank as a
worker of its own (``w0-dp0``, ``w0-dp1``), fed by that rank's KV events and load. A repeated
prompt goes to the rank holding it (named in ``X-data-parallel-rank``) and is credited exactly
what that rank reports cached; the other rank holds nothing of it. Also the pure parts: vLLM's
endpoint offsets, the config's expansion and checks, the per-rank load scrape."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port, running_up, wait_until
from kvcore.data_parallel import rank_endpoint
from router.config.schema import GatewayConfig, repeated_targets
from router.workers.calls import parse_engine_load

AUTH = {"Authorization": "Bearer dp-token"}
BLOCK = 32


def test_rank_endpoints_follow_vllm():
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert rank_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"  # the OS picks
    assert rank_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    with pytest.raises(ValueError, match="only tcp and inproc"):
        rank_endpoint("ipc:///tmp/ev", 1)


def _config(workers: list[dict]) -> GatewayConfig:
    return GatewayConfig.model_validate({"models": [{"name": "m", "tokenizer": "/x", "block_size": 32}], "workers": workers})


def test_a_data_parallel_worker_becomes_one_worker_per_rank():
    cfg = _config([{"id": "a", "url": "http://h:8000", "model": "m", "events": "tcp://h:5557",
                    "replay": "tcp://h:5600", "data_parallel_size": 3},
                   {"url": "http://h:8001", "model": "m"}])
    assert [(w.id, w.data_parallel_rank, w.events, w.replay) for w in cfg.workers] == [
        ("a-dp0", 0, "tcp://h:5557", "tcp://h:5600"), ("a-dp1", 1, "tcp://h:5558", "tcp://h:5601"),
        ("a-dp2", 2, "tcp://h:5559", "tcp://h:5602"), ("h:8001", None, None, None)]
    assert {w.url for w in cfg.workers[:3]} == {"http://h:8000"}
    with pytest.raises(ValueError, match="not both"):
        _config([{"url": "http://h:8000", "model": "m", "data_parallel_size": 2, "data_parallel_rank": 0}])
    with pytest.raises(ValueError, match="only tcp and inproc"):
        _config([{"url": "http://h:8000", "model": "m", "data_parallel_size": 2, "events": "ipc:///tmp/e"}])
    with pytest.raises(ValueError, match="urls repeated"):
        _config([{"id": "a", "url": "http://h:8000", "model": "m", "data_parallel_rank": 1},
                 {"id": "b", "url": "http://h:8000", "model": "m", "data_parallel_rank": 1}])


def test_repeated_targets_tell_ranks_from_repeats():
    cfg = _config([{"id": "a", "url": "http://h:1", "model": "m", "data_parallel_rank": 0},
                   {"id": "b", "url": "http://h:1", "model": "m", "data_parallel_rank": 1}])
    assert repeated_targets(cfg.workers) == []
    whole = cfg.workers[0].model_copy(update={"id": "c", "data_parallel_rank": None})
    assert repeated_targets([*cfg.workers, whole]) == ["http://h:1"]


def test_the_load_scrape_reads_one_ranks_label_sets():
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 5.0\n'
            'vllm:num_requests_running{engine="11",model_name="m"} 7.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n')
    assert parse_engine_load(text) == (15, 2, 0.5)
    assert parse_engine_load(text, 1) == (5, 2, 0.25)
    assert parse_engine_load(text, 0) == (3, None, 0.5)
    assert parse_engine_load(text, 2) == (None, None, None)


@pytest.fixture(scope="module")
def dp_up(tmp_path_factory, tiny_model):
    with running_up("up", ["--workers", "1", "--data-parallel-size", "2", "--model", str(tiny_model),
                           "--served-model-name", "tiny", "--port", str(free_port()), "--speedup", "50",
                           "--policy", "kv_aware"],
                    tmp_path_factory.mktemp("dp-up"), {"KVROUTE_ADMIN_TOKEN": "dp-token"}) as base:
        yield base


def test_each_rank_is_routed_on_its_own_cache(dp_up):
    workers = httpx.get(dp_up + "/admin/workers", headers=AUTH, timeout=30).json()["workers"]
    assert sorted(w["id"] for w in workers) == ["w0-dp0", "w0-dp1"]
    assert len({w["url"] for w in workers}) == 1
    url = workers[0]["url"]
    assert wait_until(lambda: all(w["events_live"] for w in httpx.get(
        dp_up + "/admin/workers", headers=AUTH, timeout=30).json()["workers"]), 30, "both ranks' KV events")
    httpx.delete(url + "/sim/requests", timeout=10)
    client = OpenAI(base_url=dp_up + "/v1", api_key="x", max_retries=0)
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": "Rank check. " * 60}, {"role": "user", "content": "go"}]}

    def explain() -> dict:
        r = httpx.post(dp_up + "/admin/explain", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    first = client.chat.completions.with_raw_response.create(**body)
    holder = first.headers["x-kvroute-worker"]
    prompt = first.parse().usage.prompt_tokens
    rank = holder.removeprefix("w0-dp")
    seen = httpx.get(url + "/sim/requests", timeout=10).json()["requests"]
    assert [r["headers"].get("x-data-parallel-rank") for r in seen] == [rank]
    planned = wait_until(lambda: (p := explain())["predicted_cached_tokens"] and p, 20, "the rank's blocks in the index")
    hit = (prompt - 1) // BLOCK * BLOCK
    assert (planned["chosen"], planned["predicted_cached_tokens"]) == (holder, hit)
    other = [c for c in planned["candidates"] if c["worker"] != holder]
    assert [sum(c["matched_blocks"].values()) for c in other] == [0]  # the other rank holds none of it
    again = client.chat.completions.with_raw_response.create(**body)
    assert again.headers["x-kvroute-worker"] == holder
    assert again.parse().usage.prompt_tokens_details.cached_tokens == hit
    per_engine = {s.labels["engine"]: s.value  # the sim's per-rank counters: the hit landed on the holder's engine
                  for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
                  for s in family.samples if s.name == "vllm:prefix_cache_hits_total"}
    assert per_engine == {rank: hit, str(1 - int(rank)): 0}


def test_admin_adds_ranks_one_at_a_time(dp_up):
    r = httpx.post(dp_up + "/admin/workers", headers=AUTH, timeout=30,
                   json={"url": "http://127.0.0.1:9", "model": "tiny", "data_parallel_size": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_size"
    workers = httpx.get(dp_up + "/admin/workers", headers=AUTH, timeout=30).json()["workers"]
    r = httpx.post(dp_up + "/admin/workers", headers=AUTH, timeout=30,
                   json={"id": "again", "url": workers[0]["url"], "model": "tiny", "data_parallel_rank": 1})
    assert r.status_code == 409 and "rank 1" in r.json()["error"]["message"]
