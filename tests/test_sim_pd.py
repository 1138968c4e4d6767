"""The simulator's P/D disaggregation (vLLM's ``kv_transfer_params`` protocol): a prefill leg
answers the params, a decode leg loads the prompt's uncached tokens over the simulated link instead
of computing them (the whole prompt, as vLLM's NixlConnector, or full blocks only, as kvroute's
tiers connector), caches the full blocks (KV events) and reports the loaded tokens as cached.

Engine tests drive the steps by hand with a hand-set clock, so the transfer time is checked in the
sim's own clock; the HTTP tests run two real sims (prefill and decode) with the openai SDK."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import zmq

from conftest import free_ports, kvroute_argv, wait_http, wait_until
from kvcore.kv_events.wire import BlockStored, decode_batch
from simulator.block_pool import BlockPool, engine_block_hashes
from simulator.engine import Engine, SimRequest
from simulator.timing import TimingModel

BS = 4
SEED = 3
# 1,000 bytes per token over 0.008 Gb/s: 1 ms per token, simulated; speedup 1
TIMING = TimingModel(kv_bytes_per_token=1000, kv_link_gbps=0.008)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_engine(num_blocks: int = 64, kv_load: str = "full_blocks"):
    published: list[list] = []
    engine = Engine(BlockPool(num_blocks, BS), TIMING, 8, SEED, publish=published.append, kv_load=kv_load)
    engine.clock = Clock()
    return engine, published


def request(prompt: list[int], outputs: list[int], rid: str, **kw) -> SimRequest:
    return SimRequest(request_id=rid, prompt_token_ids=prompt, output_token_ids=outputs, finish_reason="length", **kw)


def stored(published: list[list]) -> list[int]:
    return [h for batch in published for e in batch if isinstance(e, BlockStored) for h in e.block_hashes]


def test_transfer_time_is_1_ms_per_token_at_these_flags():
    assert TIMING.transfer_sim_s(1000) == pytest.approx(1.0)
    assert TimingModel(kv_bytes_per_token=1000, kv_link_gbps=0.008, speedup=4).transfer_s(1000) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        TimingModel(kv_link_gbps=0)


def test_decode_leg_waits_for_the_load_then_computes_only_the_last_partial_block():
    engine, published = make_engine()
    prompt = list(range(100, 142))  # 42 tokens: 10 full blocks + 2
    req = request(prompt, [7, 8], "d", remote_prefill=True)
    engine.add(req)
    s = engine.schedule()
    # admitted, its blocks taken, nothing computed: it waits on the link, outside the step
    assert (s.scheduled, s.worked, engine.num_running, engine.num_waiting) == ([], False, 0, 1)
    assert engine.receiving == [req] and len(req.blocks) == 11
    assert (req.transferred_tokens, req.num_cached_tokens) == (40, 40)
    assert req.kv_ready_s == pytest.approx(100.0 + 0.040)  # 40 tokens x 1 ms
    engine.complete(s)
    engine.clock.t = req.kv_ready_s - 1e-6
    assert engine.schedule().scheduled == [] and engine.receiving == [req]
    engine.clock.t = req.kv_ready_s
    s = engine.schedule()
    assert s.scheduled == [req] and engine.receiving == []
    # the step computes the 2 uncached tokens only (a 2-token prefill), not the 42-token prompt
    assert s.duration_s == pytest.approx(TIMING.step_s(2, 1, 0, 2 * 42))
    assert s.duration_s < TIMING.step_s(42, 1, 0, 42 * 42)
    engine.complete(s)
    # the loaded blocks are held as if computed: announced with the engine's own hashes
    assert stored(published) == engine_block_hashes(prompt, BS, SEED)[:10]
    assert req.sink.get_nowait() == (0, 7)
    st = engine.stats
    assert (st.prefix_cache_hits_tokens, st.external_queries_tokens, st.external_hits_tokens) == (0, 42, 40)
    assert (st.kv_transfers, st.kv_transfer_bytes) == (1, 40_000)
    assert st.kv_transfer_sim_s == pytest.approx(0.040)
    engine.complete(engine.schedule())
    assert req.finished
    # afterwards a plain request with the same prompt hits them in the local cache
    again = request(prompt, [9], "again")
    engine.add(again)
    engine.complete(engine.schedule())
    assert again.num_cached_tokens == 40 and again.finished


def test_vllm_connectors_load_the_whole_prompt_and_its_last_token_is_priced_as_a_decode():
    engine, published = make_engine(kv_load="prompt")
    running = request(list(range(900, 906)), [1, 2, 3, 4], "running")  # a decode already in the batch
    engine.add(running)
    engine.complete(engine.schedule())
    prompt = list(range(100, 142))  # 42 tokens: 10 full blocks + 2
    req = request(prompt, [7, 8], "d", remote_prefill=True)
    engine.add(req)
    engine.complete(engine.schedule())
    # all 42 tokens cross the link, the partial block included, and count as cached
    assert (req.transferred_tokens, req.num_cached_tokens, req.kv_ready_s) == (42, 42, pytest.approx(100.042))
    engine.clock.t = req.kv_ready_s
    s = engine.schedule()
    assert s.scheduled == [running, req]
    # the last prompt token, computed again for its logits, rides with the decode as a second
    # sequence: no prefill fixed cost
    assert s.duration_s == pytest.approx(TIMING.step_s(0, 0, 2))
    assert s.duration_s < TIMING.step_s(1, 1, 1, 42)
    engine.complete(s)
    assert req.sink.get_nowait() == (0, 7)
    assert set(engine_block_hashes(prompt, BS, SEED)[:10]) <= set(stored(published))
    assert (engine.stats.external_hits_tokens, engine.stats.kv_transfer_bytes) == (42, 42_000)
    with pytest.raises(ValueError, match="kv_load"):
        Engine(BlockPool(8, BS), TIMING, 8, SEED, kv_load="all")


def test_a_plain_prompt_one_token_past_its_cached_blocks_costs_a_decode_slot():
    engine, _ = make_engine(kv_load="prompt")
    prompt = list(range(300, 308))  # 2 full blocks
    engine.add(request(prompt, [1], "warm"))
    engine.complete(engine.schedule())
    again = request(prompt + [5], [1], "again")  # 2 cached blocks + 1 token to compute
    engine.add(again)
    s = engine.schedule()
    assert s.scheduled == [again] and again.num_cached_tokens == 8
    assert s.duration_s == pytest.approx(TIMING.step_s(0, 0, 1))
    two = request(prompt + [5, 6], [1], "two")  # 2 tokens to compute: a prefill, fixed cost included
    engine.complete(s)
    engine.add(two)
    assert engine.schedule().duration_s == pytest.approx(TIMING.step_s(2, 1, 0, 2 * 10))


def test_only_the_uncached_blocks_cross_the_link_and_loads_queue_on_it():
    engine, published = make_engine()
    prefix = list(range(200, 216))  # 4 blocks computed locally first
    warm = request(prefix + [1, 2, 3, 4, 5], [6], "warm")
    engine.add(warm)
    engine.complete(engine.schedule())
    assert warm.finished
    a = request(prefix + list(range(300, 325)), [1, 2], "a", remote_prefill=True)  # 41 tokens
    b = request(list(range(400, 433)), [1], "b", remote_prefill=True)  # 33 tokens, 8 full blocks
    engine.add(a)
    engine.add(b)
    engine.schedule()
    # a: 10 full blocks, 4 local hits, 6 over the link; b waits for a's load to clear the link
    assert (a.local_hit_tokens, a.transferred_tokens, a.num_cached_tokens) == (16, 24, 40)
    assert b.transferred_tokens == 32
    assert a.kv_ready_s == pytest.approx(100.024) and b.kv_ready_s == pytest.approx(100.024 + 0.032)
    engine.clock.t = a.kv_ready_s
    s = engine.schedule()
    assert s.scheduled == [a] and engine.receiving == [b]
    engine.complete(s)
    assert stored(published)[-6:] == engine_block_hashes(a.prompt_token_ids, BS, SEED)[4:10]


def test_a_prompt_fully_cached_here_loads_nothing_and_an_abort_frees_a_loading_request():
    engine, _ = make_engine()
    prompt = list(range(500, 513))  # 3 full blocks + 1
    engine.add(request(prompt, [1], "first"))
    engine.complete(engine.schedule())
    local = request(prompt, [1], "local", remote_prefill=True)
    engine.add(local)
    s = engine.schedule()
    assert s.scheduled == [local] and local.transferred_tokens == 0 and local.num_cached_tokens == 12
    engine.complete(s)
    loading = request(list(range(600, 640)), [1], "loading", remote_prefill=True)
    engine.add(loading)
    engine.schedule()
    assert engine.receiving == [loading]
    free = engine.pool.num_free_blocks
    engine.abort(loading)
    assert engine.receiving == [] and engine.pool.num_free_blocks == free + 10
    assert loading.sink.get_nowait() == (0, None)


def test_prefill_leg_keeps_its_prompt_block_ids():
    engine, _ = make_engine()
    req = request(list(range(700, 710)), [1], "p", remote_decode=True)  # 3 blocks hold the prompt
    engine.add(req)
    engine.complete(engine.schedule())
    assert req.finished and req.final_block_ids is not None and len(req.final_block_ids) == 3
    assert all(isinstance(i, int) and i > 0 for i in req.final_block_ids)


# ---- over HTTP: two real sims ---------------------------------------------------------------
def start(procs, tiny_model, name: str, seed: int, extra: tuple[str, ...] = ()):
    port, ev, rp = free_ports(3)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
           "replay_endpoint": f"tcp://*:{rp}", "topic": "kv"}
    argv = kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny", "--host", "127.0.0.1",
                        "--port", str(port), "--block-size", "32", "--num-gpu-blocks-override", "256",
                        "--max-model-len", "2048", "--enable-prompt-tokens-details", "--seed", str(seed),
                        "--kv-events-config", json.dumps(cfg), "--kv-load", "full-blocks", *extra)
    proc = procs(name, argv)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return url, port, f"tcp://127.0.0.1:{ev}"


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` samples by name, with any label besides model_name and engine as ``{k="v"}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for smp in fam.samples:
            rest = ",".join(f'{k}="{v}"' for k, v in smp.labels.items() if k not in ("model_name", "engine"))
            out[smp.name + (f"{{{rest}}}" if rest else "")] = smp.value
    return out


def test_prefill_then_decode_over_http(procs, tiny_model):
    p_url, p_port, _ = start(procs, tiny_model, "prefill", 1, ("--speedup", "100"))
    # the decode sim: 131072 bytes per token (the default, an 8B model) over 0.5 Gb/s, 2.097 ms per token
    d_url, d_port, d_events = start(procs, tiny_model, "decode", 2, ("--kv-link-gbps", "0.5", "--speedup", "1"))
    prompt = [(7 * i) % 400 + 50 for i in range(300)]  # 9 full blocks of 32 + 12 tokens
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(d_events)
    try:
        with openai.OpenAI(base_url=p_url + "/v1", api_key="x", max_retries=0) as p, \
                openai.OpenAI(base_url=d_url + "/v1", api_key="x", max_retries=0) as d:
            first = p.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}},
                extra_headers={"x-request-id": "r1-prefill"})
            params = first.model_extra["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert params["remote_engine_id"].startswith("kvroute-sim-")
            assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p_port)
            assert params["remote_request_id"] == "cmpl-r1-prefill-0" and params["kvroute_sim_tokens"] == 300
            assert len(params["remote_block_ids"]) == 10 and len(set(params["remote_block_ids"])) == 10
            assert first.usage.completion_tokens == 1 and first.usage.prompt_tokens_details.cached_tokens == 0
            # a plain request gets null params, as vLLM's
            plain = p.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2)
            assert plain.model_extra["kv_transfer_params"] is None
            # the SUB socket has connected once a probe request's events arrive (a new prompt each time)
            probes = iter(range(450, 500))

            def probe():
                d.completions.create(model="tiny", prompt=[next(probes)] + list(range(1, 40)), max_tokens=1)
                return sub.poll(300)

            wait_until(probe, 20, "the decode sim's events")
            while sub.poll(200):
                sub.recv_multipart()
            before = metrics(d_url)
            t0 = time.monotonic()
            out = d.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={"kv_transfer_params": params})
            elapsed = time.monotonic() - t0
    finally:
        events = []
        while sub.poll(2000) and len(events) < 9:
            events += [e for e in decode_batch(sub.recv_multipart()[2]).events if isinstance(e, BlockStored)]
        sub.close(0)
    assert out.usage.prompt_tokens_details.cached_tokens == 288  # 9 full blocks: the 10th is partial
    assert out.usage.completion_tokens == 4 and out.model_extra["kv_transfer_params"] is None
    transfer_s = 288 * 131072 * 8 / 0.5e9
    assert elapsed >= transfer_s  # the load ran before the first token (a lower bound on a busy machine)
    after = metrics(d_url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:external_prefix_cache_hits_total"] == 288
    assert delta["vllm:external_prefix_cache_queries_total"] == 300
    assert delta['vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'] == 288
    assert delta['vllm:prompt_tokens_by_source_total{source="local_compute"}'] == 12
    assert delta['vllm:prompt_tokens_cached_by_source_total{source="p2p"}'] == 288
    assert delta["vllm:nixl_xfer_time_seconds_count"] == 1
    assert delta["vllm:nixl_xfer_time_seconds_sum"] == pytest.approx(transfer_s)
    assert delta["vllm:nixl_bytes_transferred_sum"] == 288 * 131072
    # the decode sim announced the 9 loaded blocks with its own engine hashes
    assert [h for e in events for h in e.block_hashes] == engine_block_hashes(prompt, 32, 2)[:9]
    # and holds them: the same prompt again is a local prefix hit, nothing crosses the link
    again = httpx.post(d_url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                      "kv_transfer_params": params}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
    assert metrics(d_url)["vllm:external_prefix_cache_hits_total"] == after["vllm:external_prefix_cache_hits_total"]
    bad = httpx.post(d_url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "kv_transfer_params": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
