"""Gateway building blocks without processes: config validation, index factory, error shape, stream
usage handling, engine-load parsing, the registry's health hysteresis and in-flight accounting."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import orjson
import pytest

from kvcore.index import MemoryIndex, make_index
from router.config.schema import WorkerConfig, parse_config
from router.errors import body_too_large, no_healthy_worker, unknown_model
from router.relay.stream_usage import UsageStrip, UsageTap, cached_tokens_of_body, request_stream_usage
from router.workers.calls import parse_engine_load
from router.workers.event_watch import EventStreamWatch
from router.workers.registry import WorkerRegistry


def _cfg(**over):
    base = {"models": [{"name": "tiny", "tokenizer": None, "block_size": 32}],
            "workers": [{"id": "w0", "url": "http://127.0.0.1:9001", "model": "tiny"}]}
    base.update(over)
    return base


# ---- config -------------------------------------------------------------------------------------
def test_config_defaults_and_worker_id():
    cfg = parse_config(_cfg(workers=[{"url": "http://127.0.0.1:9001/", "model": "tiny"}]))
    assert cfg.workers[0].id == "127.0.0.1:9001" and cfg.workers[0].url == "http://127.0.0.1:9001"
    assert cfg.max_body_bytes >= 32 * 1024 * 1024
    assert cfg.timeouts.total_s is None and cfg.policy == {"name": "ttft"}
    assert cfg.index.backend == "memory"


@pytest.mark.parametrize("over,needle", [
    ({"workers": [{"id": "w0", "url": "http://h:1", "model": "other"}]}, "unknown model"),
    ({"workers": [{"id": "a", "url": "http://h:1", "model": "tiny"},
                  {"id": "a", "url": "http://h:2", "model": "tiny"}]}, "repeated"),
    ({"workers": [{"id": "a", "url": "ftp://h:1", "model": "tiny"}]}, "http"),
    ({"max_body_bytes": 1024}, "max_body_bytes"),
    ({"policy": {"name": "no_such_policy"}}, "no_such_policy"),
    ({"policy": {"name": "kv_aware", "load_weight": -1}}, "load_weight"),
    ({"listen": {"port": 99999}}, "port"),
    ({"surprise": 1}, "surprise"),
])
def test_config_rejects(over, needle):
    with pytest.raises(ValueError, match=needle):
        parse_config(_cfg(**over))


def test_make_index():
    assert isinstance(make_index({"backend": "memory"}), MemoryIndex)
    assert make_index({"backend": "memory", "max_keys": 10}).max_keys == 10
    with pytest.raises(ValueError, match="unknown index backend"):
        make_index({"backend": "cassandra"})
    with pytest.raises(ValueError, match="takes"):
        make_index({"backend": "memory", "url": "redis://x"})
    with pytest.raises(ValueError, match="max_workers must be a positive integer, got 0"):
        make_index({"backend": "memory", "max_workers": 0})


def test_make_index_with_a_host_path_shares_one_file(tmp_path):
    """--processes N: the memory backend becomes the host index, sized by the same config."""
    from kvcore.index.host import HostIndex
    cfg = {"backend": "memory", "max_keys": 1000, "max_workers": 8, "max_holder_sets": 64}
    assert type(make_index(cfg)) is MemoryIndex  # alone: the host sizes are not used
    one, two = make_index(cfg, host_path=tmp_path / "index"), make_index(cfg, host_path=tmp_path / "index")
    assert isinstance(one, HostIndex) and (one.max_keys, one.max_workers, one.max_holder_sets) == (1000, 8, 64)
    assert one.try_become_writer()
    one.store_sync("w", "gpu", [5, 6])
    assert two.match_sync([5, 6])["w"].gpu == 2


def test_error_shape():
    for err, status, code in [(unknown_model("m"), 404, "model_not_found"),
                              (body_too_large(10), 413, "request_too_large"),
                              (no_healthy_worker("m"), 503, "no_healthy_worker")]:
        body = orjson.loads(err.body())
        assert err.status == status
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code


# ---- stream usage ---------------------------------------------------------------------------------
def test_request_stream_usage_appends_without_reserializing():
    raw = b'{"model": "tiny",  "stream": true, "x_unknown": [1, 2]}\n'
    out, strip = request_stream_usage(raw, orjson.loads(raw))
    assert strip
    assert out == b'{"model": "tiny",  "stream": true, "x_unknown": [1, 2],"stream_options":{"include_usage":true}}\n'
    assert orjson.loads(out)["stream_options"] == {"include_usage": True}


def test_request_stream_usage_respects_client_choice():
    raw = b'{"model":"tiny","stream":true,"stream_options":{"include_usage":true}}'
    assert request_stream_usage(raw, orjson.loads(raw)) == (raw, False)
    raw = b'{"model":"tiny","stream":true,"stream_options":{"continuous_usage_stats":false}}'
    out, strip = request_stream_usage(raw, orjson.loads(raw))
    assert strip and orjson.loads(out)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _stream_bytes() -> tuple[bytes, bytes]:
    """(what the worker sent, what the client must get): chunks with a 4-byte UTF-8 char, then the
    usage-only chunk, then [DONE]."""
    chunks = [_sse({"id": "c1", "choices": [{"index": 0, "delta": {"content": t}}]})
              for t in ["he", "llo 😀", " wörld"]]
    usage = _sse({"id": "c1", "choices": [], "usage": {"prompt_tokens": 70, "completion_tokens": 3,
                                                        "prompt_tokens_details": {"cached_tokens": 64}}})
    done = b"data: [DONE]\n\n"
    return b"".join(chunks) + usage + done, b"".join(chunks) + done


@pytest.mark.parametrize("cut", [1, 7, 13, 64])
def test_usage_strip_removes_only_the_usage_chunk(cut):
    sent, want = _stream_bytes()
    strip = UsageStrip()
    got = b"".join(strip.feed(sent[i:i + cut]) for i in range(0, len(sent), cut)) + strip.finish()
    assert got == want
    assert strip.cached_tokens == 64


def test_usage_strip_tolerates_spaced_json():
    sent = (b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
            b'data: {"id": "c", "choices": [ ], "usage": {"prompt_tokens_details": {"cached_tokens": 96}}}\n\n'
            b"data: [DONE]\n\n")
    strip = UsageStrip()
    got = strip.feed(sent) + strip.finish()
    assert got == sent.split(b"\n\n")[0] + b"\n\ndata: [DONE]\n\n" and strip.cached_tokens == 96


def test_usage_tap_passes_bytes_and_reads_usage():
    sent, _ = _stream_bytes()
    tap = UsageTap()
    got = b"".join(tap.feed(sent[i:i + 5]) for i in range(0, len(sent), 5)) + tap.finish()
    assert got == sent and tap.cached_tokens == 64


def test_cached_tokens_of_body():
    body = orjson.dumps({"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 32}}})
    assert cached_tokens_of_body(body) == 32
    assert cached_tokens_of_body(b'{"usage": {"prompt_tokens_details": null}}') is None
    assert cached_tokens_of_body(b"not json") is None


# ---- engine load ----------------------------------------------------------------------------------
def test_parse_engine_load_sums_engines():
    text = "\n".join([
        "# HELP vllm:num_requests_running x", "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="tiny"} 2.0',
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5',
        "vllm:prefix_cache_hits_total 100.0"])
    assert parse_engine_load(text) == (5, 4, 0.5)
    assert parse_engine_load("other_metric 1\n") == (None, None, None)


def test_parse_engine_load_reads_each_run_of_samples_past_longer_names():
    """A metric's samples are read as one run of lines; a longer name sharing the prefix, before
    the run or inside it, is passed over, and the run still ends where its lines end."""
    text = "\n".join([
        "vllm:num_requests_running_x 9",
        'vllm:num_requests_running{engine="0"} 2',
        'vllm:num_requests_running{engine="1"} 3',
        "vllm:num_requests_running_y 7",
        'vllm:num_requests_running{engine="2"} 4',
        "vllm:other 1",
        "vllm:num_requests_waiting 5"])
    assert parse_engine_load(text) == (9, 5, None)
    assert parse_engine_load(text, 1) == (3, None, None)


# ---- registry -------------------------------------------------------------------------------------
def test_health_hysteresis():
    async def go():
        reg = WorkerRegistry().add(WorkerConfig(id="w", url="http://h:1", model="m"))
        seen = []
        for ok in [True, False, False, True, False, False, False, True, True]:
            reg.record_probe(ok, fail_threshold=3, rise_threshold=2)
            seen.append(reg.healthy)
        return seen

    assert asyncio.run(go()) == [True, True, True, True, True, True, False, False, True]


def test_event_stream_counts_while_connected_or_in_grace_and_says_why_when_not(caplog):
    sub = SimpleNamespace(connected=False, batches_received=7, last_received_monotonic_s=None)
    watch = EventStreamWatch("w", "tcp://10.0.0.5:5557")
    assert watch.judge(None, age_s=100.0) is None and watch.problem is None
    assert watch.judge(sub, age_s=1.0, grace_s=5.0) is True  # still connecting
    with caplog.at_level(logging.WARNING, logger="kvroute.registry"):
        assert watch.judge(sub, age_s=6.0, grace_s=5.0) is False
    assert watch.problem == "not connected to the KV-event publisher at tcp://10.0.0.5:5557 (7 batches received)"
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    sub.connected = True
    assert watch.judge(sub, age_s=60.0) is True and watch.problem is None


def test_a_stream_whose_batches_arrive_counts_before_its_monitor_says_connected(caplog):
    """A busy loop may read a subscriber's first batches before the ZMQ monitor's CONNECTED
    event: batches read within the grace count as a live stream; once they stop for longer, and
    the monitor still says nothing, the stream stops counting."""
    sub = SimpleNamespace(connected=False, batches_received=120, last_received_monotonic_s=1000.0)
    watch = EventStreamWatch("w", "tcp://10.0.0.5:5557")
    with caplog.at_level(logging.WARNING, logger="kvroute.registry"):
        assert watch.judge(sub, age_s=30.0, grace_s=5.0, now_s=1004.9) is True
        assert caplog.records == [] and watch.problem is None
        assert watch.judge(sub, age_s=36.0, grace_s=5.0, now_s=1005.1) is False
    assert watch.problem == "not connected to the KV-event publisher at tcp://10.0.0.5:5557 (120 batches received)"


def test_a_worker_whose_events_stopped_is_not_credited():
    async def go():
        reg = WorkerRegistry().add(WorkerConfig(id="w", url="http://h:1", model="m", events="tcp://h:2"))
        reg.ingest = SimpleNamespace(subscriber=SimpleNamespace(
            connected=False, batches_received=0, last_received_monotonic_s=None))
        credited_at_start = reg.evidence_credited
        live = reg.check_events(reg.added_monotonic + 10.0, grace_s=5.0)
        return credited_at_start, live, reg.evidence_credited, reg.events.problem

    credited_at_start, live, credited, problem = asyncio.run(go())
    assert (credited_at_start, live, credited) == (True, False, False)
    assert problem.startswith("not connected to the KV-event publisher at tcp://h:2")


def test_in_flight_never_leaks_across_re_registration():
    async def go():
        registry = WorkerRegistry()
        old = registry.add(WorkerConfig(id="w", url="http://h:1", model="m"))
        a = old.begin(prefill_tokens=100)
        b = old.begin(prefill_tokens=50)
        a.first_byte()
        assert (old.in_flight, old.prefill_tokens, old.decoding) == (2, 50, 1)
        await registry.remove("w")
        new = registry.add(WorkerConfig(id="w", url="http://h:1", model="m"))
        c = new.begin(prefill_tokens=10)
        for h in (a, b, a, b):  # late finishes of old requests, twice each
            h.finish()
        assert (old.in_flight, old.prefill_tokens, old.decoding) == (0, 0, 0)
        assert (new.in_flight, new.prefill_tokens) == (1, 10)
        c.first_byte()
        c.finish()
        c.finish()
        return new.in_flight, new.prefill_tokens, new.decoding

    assert asyncio.run(go()) == (0, 0, 0)


def test_registry_tasks_start_and_stop_with_the_worker():
    async def go():
        started, stopped = [], []

        async def task(reg):
            started.append(reg.id)
            try:
                await asyncio.sleep(3600)
            finally:
                stopped.append(reg.id)

        registry = WorkerRegistry([task])
        registry.add(WorkerConfig(id="a", url="http://h:1", model="m"))
        await asyncio.sleep(0)
        late = []

        async def late_task(reg):
            late.append(reg.id)

        registry.add_task_factory(late_task)
        registry.add(WorkerConfig(id="b", url="http://h:2", model="m"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError):
            registry.add(WorkerConfig(id="a", url="http://h:3", model="m"))
        await registry.remove("a")
        return list(started), list(stopped), list(late), [r.id for r in registry.all()]

    started, stopped, late, left = asyncio.run(go())
    assert started == ["a", "b"] and stopped == ["a"] and sorted(late) == ["a", "b"] and left == ["b"]


# ---- routing draw ---------------------------------------------------------------------------------
def test_cold_requests_alternate_and_explain_peeks():
    """Equal cold workers share sequential traffic evenly; explain sees the decision the next real
    request gets."""
    from router.gateway import Gateway

    cfg = parse_config(_cfg(workers=[{"id": "w0", "url": "http://127.0.0.1:9001", "model": "tiny"},
                                     {"id": "w1", "url": "http://127.0.0.1:9002", "model": "tiny"}]))

    async def go():
        gw = Gateway(cfg)
        try:
            for w in cfg.workers:
                gw.registry.add(w).healthy = True
            body = {"model": "tiny", "prompt": "no tokenizer configured: routed by load"}
            raw = orjson.dumps(body)
            chosen = []
            for _ in range(20):
                peek = await gw.router.plan("completion", body, [], raw, explain=True)
                real = await gw.router.plan("completion", body, [], raw)
                assert peek.decision.worker_id == real.decision.worker_id
                assert real.decision.reason == "no_tokens"
                chosen.append(real.decision.worker_id)
            return chosen
        finally:
            gw.tokenizers.close()

    chosen = asyncio.run(go())
    assert abs(chosen.count("w0") - chosen.count("w1")) <= 2, chosen
