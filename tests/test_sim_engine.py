"""The simulator's engine: continuous batching, queueing, prefix hits, preemption, aborts, timing.

Steps are driven by hand (``schedule`` / ``complete``) so the outcomes do not depend on the clock.
"""
from __future__ import annotations

import asyncio

import pytest

from kvcore.kv_events.wire import BlockRemoved, BlockStored
from simulator.block_pool import BlockPool, engine_block_hashes
from simulator.engine import Engine, RequestTooLong, SimRequest
from simulator.outputs import OutputSampler
from simulator.timing import TimingModel

BS = 4
SEED = 3


def make_engine(num_blocks: int = 32, max_num_seqs: int = 8):
    published: list[list] = []
    engine = Engine(BlockPool(num_blocks, BS), TimingModel(speedup=1e6), max_num_seqs, SEED,
                    publish=published.append)
    return engine, published


def make_request(prompt: list[int], outputs: list[int], rid: str = "r", salt: str | None = None) -> SimRequest:
    return SimRequest(request_id=rid, prompt_token_ids=prompt, output_token_ids=outputs,
                      finish_reason="length", extra_keys=[[salt]] if salt else None)


def drain(req: SimRequest) -> list:
    out = []
    while not req.sink.empty():
        out.append(req.sink.get_nowait()[1])
    return out


def step(engine: Engine) -> list[SimRequest]:
    s = engine.schedule()
    engine.complete(s)
    return s.scheduled


def test_max_num_seqs_queues_the_rest_fcfs():
    engine, _ = make_engine(max_num_seqs=1)
    r1 = make_request(list(range(6)), [40, 41], "r1")
    r2 = make_request(list(range(10, 16)), [42], "r2")
    engine.add(r1)
    engine.add(r2)
    assert (engine.num_running, engine.num_waiting) == (0, 2)
    assert step(engine) == [r1]
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert step(engine) == [r1]  # r1's decode; r2 still waits for a free seat
    assert r1.finished and drain(r1) == [40, 41, None]
    assert step(engine) == [r2]
    assert r2.finished and drain(r2) == [42, None]
    assert (engine.num_running, engine.num_waiting) == (0, 0)
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    assert engine.stats.request_success == 2 and engine.stats.generation_tokens == 3


def test_repeated_prompt_hits_prefix_and_counts_metrics():
    engine, published = make_engine()
    prompt = list(range(12))  # 3 full blocks
    first = make_request(prompt, [7])
    engine.add(first)
    step(engine)
    again = make_request(prompt + [99], [8])
    engine.add(again)
    step(engine)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 12
    assert engine.stats.prefix_cache_queries_tokens == 25 and engine.stats.prefix_cache_hits_tokens == 12
    hashes = engine_block_hashes(prompt, BS, SEED)
    assert [e.block_hashes for batch in published for e in batch] == [hashes]
    # a cache salt gives block 0 (and so every block) another identity: no hit
    salted = make_request(prompt, [9], salt="tenant-1")
    engine.add(salted)
    step(engine)
    assert salted.num_cached_tokens == 0
    (ev,) = published[-1]
    assert ev.extra_keys == [["tenant-1"], None, None] and ev.block_hashes[0] != hashes[0]


def test_decode_tokens_fill_blocks_and_are_stored():
    engine, published = make_engine()
    req = make_request([1, 2, 3, 4, 5, 6], [70, 71, 72, 73])
    engine.add(req)
    step(engine)  # prefill 6 tokens: block 0 full
    step(engine)  # computes token 70 (7 tokens)
    step(engine)  # computes token 71: block 1 = [5, 6, 70, 71] is full
    stored = [e for batch in published for e in batch]
    assert [e.token_ids for e in stored] == [[1, 2, 3, 4], [5, 6, 70, 71]]
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]


def test_eviction_emits_block_removed_when_blocks_are_reused():
    engine, published = make_engine(num_blocks=5)  # 4 usable blocks
    a = make_request(list(range(8)), [1])
    engine.add(a)
    step(engine)
    b = make_request(list(range(100, 116)), [1])  # needs all 4 blocks: a's two are evicted
    engine.add(b)
    step(engine)
    removed = [e for e in published[-1] if isinstance(e, BlockRemoved)]
    stored = [e for e in published[-1] if isinstance(e, BlockStored)]
    a_hashes = engine_block_hashes(list(range(8)), BS, SEED)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(a_hashes)
    assert published[-1].index(stored[0]) > published[-1].index(removed[-1])  # removals first, as vLLM


def test_preemption_recomputes_and_keeps_output_order():
    engine, _ = make_engine(num_blocks=4)  # 3 usable blocks
    r1 = make_request([1, 2, 3], [10, 11, 12, 13, 14], "r1")
    r2 = make_request([5, 6, 7], [20, 21, 22, 23, 24], "r2")
    engine.add(r1)
    engine.add(r2)
    for _ in range(30):
        if r1.finished and r2.finished:
            break
        step(engine)
    assert engine.stats.preemptions >= 1
    assert drain(r1) == [10, 11, 12, 13, 14, None]
    assert drain(r2) == [20, 21, 22, 23, 24, None]
    assert engine.pool.num_free_blocks == 3


def test_abort_frees_blocks_and_ends_the_stream():
    engine, _ = make_engine()
    req = make_request(list(range(10)), [1, 2, 3])
    engine.add(req)
    step(engine)
    assert engine.num_running == 1 and engine.pool.num_free_blocks < engine.pool.num_usable_blocks
    engine.abort(req)
    assert engine.num_running == 0 and engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    assert drain(req) == [1, None] and req.aborted
    queued = make_request([1, 2], [3])
    engine.add(queued)
    engine.abort(queued)
    assert engine.num_waiting == 0


def test_request_that_can_never_fit_is_refused():
    engine, _ = make_engine(num_blocks=3)  # 2 usable blocks = 8 tokens
    with pytest.raises(RequestTooLong):
        engine.add(make_request(list(range(8)), [1, 2]))
    engine.add(make_request(list(range(7)), [1, 2]))  # 8 tokens of KV: fits


async def test_run_loop_paces_and_delivers_tokens():
    engine, published = make_engine()
    task = asyncio.create_task(engine.run())
    try:
        req = make_request(list(range(9)), [5, 6, 7])
        engine.add(req)
        got = []
        while True:
            _, tok = await asyncio.wait_for(req.sink.get(), 10)
            if tok is None:
                break
            got.append(tok)
        assert got == [5, 6, 7] and engine.num_running == 0
        assert len(published) == 1 and published[0][0].token_ids == list(range(8))
    finally:
        task.cancel()


def test_timing_model_formula():
    t = TimingModel()
    assert t.step_ms(100, 1, 0) == pytest.approx(25 + 0.2 * 100)
    assert t.step_ms(0, 0, 1) == pytest.approx(12)
    assert t.step_ms(0, 0, 65) == pytest.approx(24)  # decode cost grows with the batch
    assert t.step_ms(10, 1, 3) == pytest.approx(25 + 2 + 12 * (1 + 2 / 64))
    assert TimingModel(speedup=1000).step_s(100, 1, 0) == pytest.approx(45e-6)
    with pytest.raises(ValueError):
        TimingModel(speedup=0)


def test_output_sampler_is_deterministic_per_seed():
    pieces = {i: chr(97 + i) for i in range(20)}
    s = OutputSampler(pieces, seed=1)
    a, reason_a = s.sample([1, 2, 3], 0, 5)
    assert s.sample([1, 2, 3], 0, 5) == (a, reason_a) and reason_a == "length" and len(a) == 5
    assert s.sample([1, 2, 3], 1, 5)[0] != a  # another choice index
    assert OutputSampler(pieces, seed=2).sample([1, 2, 3], 0, 5)[0] != a
    natural, reason = s.sample([1, 2, 3], 0, None)
    assert reason == "stop" and 16 <= len(natural) <= 96 and natural[:5] == a
    assert s.text(a) == "".join(pieces[t] for t in a)


def test_a_prefill_over_the_step_budget_is_chunked_and_decodes_keep_going():
    published: list[list] = []
    timing = TimingModel(prefill_overhead_ms=0, prefill_ms_per_token=1.0, decode_ms_per_token=10.0,
                         decode_ms_per_seq=0.0)
    engine = Engine(BlockPool(64, BS), timing, 8, SEED, publish=published.append, max_num_batched_tokens=8)
    short = make_request(list(range(100, 105)), [50, 51, 52, 53, 54], "short")
    engine.add(short)
    s = engine.schedule()
    assert s.scheduled == [short] and s.duration_s * 1e3 == pytest.approx(5.0)  # 5 prefill tokens
    engine.complete(s)
    long = make_request(list(range(200, 218)), [60], "long")  # 18 tokens: budget 8 - 1 decode = 7 a step
    engine.add(long)
    durations, emitted = [], []
    for _ in range(3):
        s = engine.schedule()
        durations.append(s.duration_s * 1e3)
        emitted.append([r.request_id for r in s.scheduled])
        engine.complete(s)
    # chunks of 7, 7, 4 prompt tokens beside short's decode; long's token only after its last chunk
    assert emitted == [["short"], ["short"], ["short", "long"]]
    assert durations == pytest.approx([7 + 10, 7 + 10, 4 + 10])
    assert drain(long) == [60, None] and long.num_cached_tokens == 0
    stored = [ev for batch in published for ev in batch if isinstance(ev, BlockStored)]
    assert sum(len(ev.block_hashes) for ev in stored if ev.token_ids[0] >= 200) == 18 // BS  # all full blocks cached
