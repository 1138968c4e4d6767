"""Preemption around the connector's in-flight work, on vLLM's own scheduler (``Scheduler`` of
vLLM 0.32, its KV cache manager and ``Request`` objects, a KV cache of 20 blocks of 4 tokens) with
our connector's two sides (scheduler and worker, the real classes) and a stand-in for the model:
its "forward pass" writes each scheduled position's KV as a function of the tokens up to it, and it
"samples" a token from the KV it reads back from the cache, so a block loaded wrong changes the
output. The SSD tier is slow at will (its writes and reads wait on a gate).

Checked through sequences where requests are preempted and re-admitted while saves (SSD writes of
spilled blocks) and asynchronous loads (SSD reads) are in flight, and one request is aborted while
its load is in flight:

- no exception; every request completes with the tokens the stand-in gives without the connector;
- the worker writes GPU blocks (loads) only while they belong to a live request (allocated to a
  request the scheduler still holds: a request preempted meanwhile no longer owns its old blocks);
- the KV of every computed position of a running request is what the stand-in computes for it.

Runs in vLLM's interpreter (the connector imports vLLM)."""
from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from offload_agent.connector import vllm_connector as vc

pytest.importorskip("vllm")

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from model_cache import ensure_model  # noqa: E402

BS = 4
GPU_BLOCKS = 20
HEADS, DIM = 1, 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
GATE_S = 60.0        # a gated SSD operation waits at most this long
VOCAB = 400


def _kv_value(tokens: list[int], p: int) -> int:
    """The stand-in model's KV at position ``p``: a function of tokens 0..p (0..250, exact in bf16)."""
    v = 7
    for t in tokens[:p + 1]:
        v = (v * 31 + t) % 251
    return v


def _sample(values: list[int]) -> int:
    return 10 + sum((i + 1) * v for i, v in enumerate(values)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    """The tokens the stand-in gives without any cache."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(_sample([_kv_value(toks, p) for p in range(len(toks))]))
    return toks[len(prompt):]


class Gate:
    """Holds the SSD tier's writes and reads while closed (each waits at most ``GATE_S``)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.waiting = 0

    def wrap(self, fn):
        def gated(*args, **kwargs):
            self.waiting += 1
            try:
                assert self.open.wait(GATE_S), "the test never opened the gate"
            finally:
                self.waiting -= 1
            return fn(*args, **kwargs)
        return gated


class Engine:
    """vLLM's scheduler with our connector, and a worker step around our worker-side connector."""

    def __init__(self, model_dir, tmp_path, monkeypatch) -> None:
        monkeypatch.setattr(vc, "_parallel_rank", lambda name: 0)
        model = ModelConfig(model=str(model_dir), dtype="bfloat16", max_model_len=256, seed=0)
        block_bytes = 2 * BS * HEADS * DIM * 2 * len(LAYERS)
        extra = {"cpu_tier_bytes": 2 * block_bytes, "ssd_tier_dir": str(tmp_path / "ssd"),
                 "ssd_tier_bytes": 200 * (block_bytes + 4096)}
        cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
        cache.num_gpu_blocks = GPU_BLOCKS
        self.config = VllmConfig(
            model_config=model, cache_config=cache,
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                                             is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(kv_connector="KVRouteTierConnector",
                                                kv_connector_module_path="offload_agent.connector.vllm_connector",
                                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                                kv_connector_extra_config=extra))
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
        kv_config = KVCacheConfig(num_blocks=GPU_BLOCKS, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
        self.sched = Scheduler(vllm_config=self.config, kv_cache_config=kv_config, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.config), block_size=BS)
        assert isinstance(self.sched.connector, vc.KVRouteTierConnector)
        self.conn = self.sched.connector
        self.kv = {name: torch.zeros((2, GPU_BLOCKS, BS, HEADS, DIM), dtype=torch.bfloat16) for name in LAYERS}
        self.wconn = vc.KVRouteTierConnector(self.config, KVConnectorRole.WORKER, kv_config)
        self.wconn.register_kv_caches(self.kv)
        self.worker = self.wconn.worker
        self.gate = Gate()
        store = self.worker.store
        store.write_ssd = self.gate.wrap(store.write_ssd)
        store.read_ssd_many = self.gate.wrap(store.read_ssd_many)
        self.loads_into: list[int] = []
        load = self.worker.copier.load

        def checked_load(rows, blocks, host):
            live = self.live_blocks()
            bad = [b for b in blocks if b not in live]
            assert not bad, f"a load writes GPU blocks {bad} that no live request holds"
            self.loads_into += list(blocks)
            return load(rows, blocks, host)
        self.worker.copier.load = checked_load
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        self.requests: dict[str, Request] = {}
        self.preemptions = 0

    def close(self) -> None:
        self.gate.open.set()
        self.wconn.shutdown()
        self.conn.shutdown() if hasattr(self.conn, "shutdown") else None

    def live_blocks(self) -> set[int]:
        held = self.sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        return {b.block_id for rid, blocks in held.items() if rid in self.sched.requests for b in blocks
                if b.ref_cnt > 0}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                      None, block_hasher=self.hasher)
        self.sched.add_request(req)
        self.requests[rid] = req
        return req

    def _forward(self, out) -> dict[str, list[int]]:
        """Write the KV of the scheduled positions; sample where the prompt (or a decode) ends."""
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens              # already advanced by schedule()
            tokens = req.all_token_ids
            blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            for p in range(end - n, end):
                b, off = blocks[p // BS], p % BS
                for t in self.kv.values():
                    t[:, b, off] = float(_kv_value(tokens, p))
            if end >= req.num_tokens:              # the prompt's last token computed: sample from the cache
                values = [int(self.kv[LAYERS[0]][0, blocks[p // BS], p % BS, 0, 0].item()) for p in range(end)]
                assert values == [_kv_value(tokens, p) for p in range(end)], f"{rid}: its KV differs"
                sampled[rid] = [_sample(values)]
            else:
                sampled[rid] = []
        return sampled

    def step(self) -> int:
        """One engine step; returns the tokens it scheduled."""
        out = self.sched.schedule()
        self.preemptions += len(out.preempted_req_ids or ())
        w = self.wconn
        w.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        sampled = self._forward(out)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        kvo = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                invalid_block_ids=w.get_block_ids_with_load_errors(),
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=[], kv_connector_output=kvo))
        return out.total_num_scheduled_tokens

    def run_until(self, cond, max_steps: int = 100_000, timeout_s: float = 60.0) -> None:
        """Step until ``cond()``; a step that scheduled nothing (only loads in flight) pauses 1 ms."""
        end = time.monotonic() + timeout_s
        for _ in range(max_steps):
            if cond():
                return
            assert time.monotonic() < end, f"the engine did not get there in time: {self.states()}"
            if not self.step():
                time.sleep(0.001)
        assert cond(), f"the engine did not get there within its steps: {self.states()}"

    def states(self) -> dict:
        return {rid: (r.status.name, r.num_computed_tokens, len(r.output_token_ids)) for rid, r in self.requests.items()
                if not r.is_finished()} | {"loads": list(self.worker._loads), "gate": self.gate.waiting}


def _wait_for(cond, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def _prompt(seed: int, n: int) -> list[int]:
    return [10 + (seed * 97 + i * 13 + i * i) % 380 for i in range(n)]


@pytest.fixture(scope="module")
def model_dir():
    """The generated "tiny" model (tools/make_model.py, made with this interpreter when missing):
    vLLM's ModelConfig reads its config.json and tokenizer."""
    return ensure_model("tiny", sys.executable)


@pytest.fixture
def engine(model_dir, tmp_path, monkeypatch):
    e = Engine(model_dir, tmp_path, monkeypatch)
    yield e
    e.close()


def _done(e: Engine) -> bool:
    return all(r.is_finished() for r in e.requests.values()) and not e.sched.has_requests()


@pytest.mark.parametrize("abort", [False, True])
def test_preempted_requests_around_inflight_saves_and_loads_complete_as_without_the_connector(engine, abort):
    e = engine
    prompts = {f"p{i}": _prompt(i, 26) for i in range(3)}          # 6 full blocks each, 7 on the GPU
    for rid, p in prompts.items():                                  # computed once: saved, then spilled to SSD
        e.add(f"warm-{rid}", p, 1)
        e.run_until(lambda: _done(e))
    e.worker.flush()
    assert e.conn.stats["saved_blocks"] == 18
    assert e.sched.reset_prefix_cache()                             # the prompts now live only in our tiers

    e.gate.open.clear()                                             # the SSD tier stops answering
    news = [e.add(f"n{i}", _prompt(10 + i, 22), 24) for i in range(2)]   # 6 blocks each, growing as they decode
    e.run_until(lambda: all(len(r.output_token_ids) >= 2 for r in news))
    hit = e.add("p0", prompts["p0"], 20)                            # all on SSD: an asynchronous load, held
    e.run_until(lambda: hit.status == RequestStatus.WAITING_FOR_REMOTE_KVS and "p0" in e.worker._loads)
    e.run_until(lambda: e.preemptions >= 1)                         # the decodes outgrow the cache meanwhile
    victim = next(r for r in news if r.num_preemptions)
    assert hit.status == RequestStatus.WAITING_FOR_REMOTE_KVS and "p0" in e.worker._loads
    _wait_for(lambda: e.gate.waiting >= 1)                          # the slow tier holds its work
    # the victim's prompt blocks went to the tiers as it computed them; the spills' SSD writes are still
    # held: re-admitted, it is matched again (the planner counts them on SSD), its load waits for them
    e.run_until(lambda: victim.status == RequestStatus.WAITING_FOR_REMOTE_KVS, max_steps=200)
    job = e.worker._loads[victim.request_id]
    assert job.after and not all(f.done() for f in job.after)     # it waits for those writes, then reads
    if abort:                                                       # gone while its load is in flight
        held = set(e.sched.kv_cache_manager.get_block_ids("p0")[0])
        e.sched.finish_requests("p0", RequestStatus.FINISHED_ABORTED)
        assert held and held <= e.live_blocks()                     # vLLM holds them until the load reports
        e.step()
        assert held <= e.live_blocks() and "p0" in e.worker._loads
    for rid in ("p1", "p2"):
        e.add(rid, prompts[rid], 20)
    e.step()
    e.gate.open.set()
    e.run_until(lambda: _done(e))

    assert e.conn.stats["loaded_blocks_ssd"] >= 1 and e.loads_into
    for rid, req in e.requests.items():
        if rid.startswith("warm-") or req.status == RequestStatus.FINISHED_ABORTED:
            continue
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert list(req.output_token_ids) == reference(list(req.prompt_token_ids), req.max_tokens), rid
    assert not e.worker._loads and e.sched.get_num_unfinished_requests() == 0
