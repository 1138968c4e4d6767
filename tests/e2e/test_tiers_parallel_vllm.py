"""The tiers under tensor and pipeline parallelism on real vLLM (CPU build) with offload agents.

Every rank of an engine is a KV *shard*: its own fingerprint, its own CPU tier file in the agent
(shard (pp 0, tp 0) at the agent's ``--tier-shm`` path, the others at ``<path>-pp<P>-tp<T>``),
and a peer pull brings each rank its own KV heads. Ranks writing one file, or a pull handing
rank 0's heads to every rank, would load wrong KV and change the output silently; these tests
compare greedy tokens and logprobs with the first computation, and the shard files byte for byte.

The generated "small" model (4 layers, 2 KV heads of 64 dims; one block of the engine is
4 x (K, V) x 32 tokens x 2 heads x 64 x 2 bytes = 64 KiB, each shard holds half of it). Each
vLLM server runs our KV connector with ``agent_socket``; its ``kvroute agent`` owns the tiers
(CPU tier only) and writes the worker's KV events into a real Redis, which is also how an agent
finds the peer holding a prefix. No gateway: prompts go to a server's own URL.

``TestTensorParallel``: servers A and B, ``--tensor-parallel-size 2`` each (ranks bound to cores
0 and 1), each with its agent, serving peers:

1. A computes a prompt, ``/reset_prefix_cache``, the prompt again: vLLM loads it from A's CPU
   tier (cached tokens, source ``host``), greedy tokens and logprobs identical;
2. A's agent made two shard files (``<path>`` and ``<path>-pp0-tp1``) with different fingerprint
   digests (those the agent publishes), each holding every block of that prompt in the same slot,
   with different bytes (each rank's own KV head);
3. A computes another prompt, B gets it and pulls it from A (both B's ranks log the pull, vLLM
   counts source ``p2p``), identical output; B saved the pulled blocks to its own two shard
   files, each byte-identical to the same rank's file in A (rank 1 got rank 1's heads).
   Marked ``xfail`` (only) when the stall in :data:`PULL_STALLS` happens, in most runs here: a
   rank's pull, or the peer lookup before it (then no rank logs a pull), misses its deadline and
   vLLM recomputes the prompt (the output is still A's: checked before). The cause is this
   2-vCPU machine, not the pull: while B's request waits for its blocks, B's engine core and both
   TP workers poll without pause, and every sleeping process on the machine is then woken late.
   Measured: both agents' event loops slept 1-11 s past a 250 ms timer (one voluntary context
   switch, no CPU used, no request in progress), and a separate process sleeping 50 ms at a
   time, started beside the test, woke up to 2.1 s late in the same seconds.

``TestPipelineParallel``: one server, ``--pipeline-parallel-size 2`` (two stages of 2 layers),
with its agent: the reset round trip as in 1, and shard files ``<path>`` and ``<path>-pp1-tp0``
as in 2 (different layers). This server runs without ``--enforce-eager``: vLLM 0.32's CPU worker
skips its warm-up forward pass in eager mode with an explicit KV cache size
(``VLLM_CPU_KVCACHE_SPACE``), and that pass is what allocates the buffer a later pipeline stage
receives its input in: the first request then kills stage 1 (``assert self.intermediate_tensors
is not None`` in ``sync_and_gather_intermediate_tensors``), with or without our connector.
Compiled mode runs the warm-up (about 30 s more at start, less with torch's compile cache).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from e2e.conftest import REDIS_TIMEOUT_S, redis_match, vllm_python
from e2e.tier_checks import cached_by_source, random_tokens, same_output
from conftest import ENGINE_START_FAILED, Proc, ServerExited, free_ports, kvroute_argv, wait_http, wait_until
from kvcore.block_keys import block_keys
from kvcore.index.redis import RedisIndex
from offload_agent.connector.config import kv_transfer_config, vllm_env
from offload_agent.tiers import tier_block_keys, tier_root
from offload_agent.tiers.shm_slab import ShmSlab

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

MODEL = "small"
BLOCK = 32
GPU_BLOCKS = 64
ENGINE_BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * 2    # all layers and heads: 64 KiB
SHARD_BLOCK_BYTES = ENGINE_BLOCK_BYTES // 2        # one of two ranks: half the heads, or half the layers
CPU_BYTES = 200 * ENGINE_BLOCK_BYTES
# vLLM's CPU workers spin between steps (and the engine steps without pause while a request waits
# for its pull), so a TP=2 server keeps both cores busy and the agents, which answer on 1 s link
# timeouts, wait for a core; the workers run below everything else (as on a host with cores to spare)
WORKER_NICE = 10
# what these tests check is which bytes a pull brings, not how fast: on two shared cores the lookup
# of a peer can take longer than the default 100 ms (vLLM then computes the prompt), so the lookup
# and the pull get generous limits
PEER_LIMITS = {"peer_locate_timeout_ms": 5000.0, "peer_pull_deadline_ms": 10000.0, "peer_connect_timeout_ms": 5000.0}
PROMPT_TOKENS = 900
N = (PROMPT_TOKENS - 1) // BLOCK                   # 28 blocks from the tiers; 4 tokens left to compute
START_TIMEOUT_S = 300


def _tokens(seed: int) -> list[int]:
    return random_tokens(seed, PROMPT_TOKENS)


def _cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _agent_states(redis_url: str) -> dict[str, dict]:
    """What every live agent published in Redis (its ``tiers`` and ``peer`` state)."""
    async def go() -> dict[str, dict]:
        index = RedisIndex(redis_url, socket_timeout_s=REDIS_TIMEOUT_S)
        try:
            return await index.worker_states()
        finally:
            await index.close()
    return asyncio.run(go())


class Server:
    """One vLLM server and its agent."""

    def __init__(self, wid: str, url: str, vllm: Proc, agent: Proc, shm: Path, redis_url: str) -> None:
        self.wid, self.url, self.vllm, self.agent, self.shm, self.redis_url = wid, url, vllm, agent, shm, redis_url

    def complete(self, tokens: list[int]) -> dict:
        r = httpx.post(self.url + "/v1/completions", timeout=180,
                       json={"model": MODEL, "prompt": tokens, "max_tokens": 8, "temperature": 0, "logprobs": 3})
        assert r.status_code == 200, r.text
        return r.json()

    def reset(self) -> None:
        assert httpx.post(self.url + "/reset_prefix_cache", timeout=60).status_code == 200

    def cached_by_source(self) -> dict[str, float]:
        return cached_by_source(self.url)

    def log(self) -> str:
        return self.vllm.log_path.read_text(errors="replace")

    def state(self) -> dict:
        return _agent_states(self.redis_url).get(self.wid) or {}

    def shard_path(self, pp: int, tp: int) -> Path:
        return self.shm if (pp, tp) == (0, 0) else self.shm.with_name(f"{self.shm.name}-pp{pp}-tp{tp}")

    def tier_keys(self, tokens: list[int]) -> list[bytes]:
        """The tier keys of ``tokens``' full blocks, rooted in the engine digest the agent publishes."""
        engine = self.state()["peer"]["engine_fingerprint"]
        return tier_block_keys(tokens, BLOCK, tier_root(bytes.fromhex(engine)))

    def slots_of(self, pp: int, tp: int, keys: list[bytes]) -> dict[bytes, tuple[int, bytes]] | None:
        """``key -> (slot, the slot's bytes)`` for every one of ``keys`` in shard (pp, tp)'s file,
        None while one is missing."""
        shm = ShmSlab.attach(self.shard_path(pp, tp))
        try:
            where = {key: slot for slot, key in shm.stable_slots()}
            if not all(k in where for k in keys):
                return None
            return {k: (where[k], bytes(shm.slot_view(where[k]))) for k in keys}
        finally:
            shm.close()


def _start(wid: str, parallel: list[str], model: Path, log_dir: Path, redis_url: str, tag: str, procs: list[Proc],
           eager: bool, ports: list[int]) -> Server:
    py = vllm_python()
    http, ev, rp, serve = ports
    sock = log_dir / f"{wid}.sock"
    shm = Path(f"/dev/shm/kvroute-e2e-par-{tag}-{wid}")
    agent = Proc(f"agent-{wid}", kvroute_argv(
        "agent", "--worker-id", wid, "--events", f"tcp://127.0.0.1:{ev}", "--replay", f"tcp://127.0.0.1:{rp}",
        "--index", redis_url, "--model", MODEL, "--block-size", str(BLOCK), "--tier-socket", str(sock),
        "--tier-shm", str(shm), "--cpu-tier-bytes", str(CPU_BYTES), "--serve-peers", f"127.0.0.1:{serve}",
        "--remove-tiers-on-exit"), log_dir)
    procs.append(agent)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"}
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(http), "--max-model-len", "1024", "--block-size", str(BLOCK),
            "--enable-prefix-caching", "--dtype", "bfloat16", "--num-gpu-blocks-override", str(GPU_BLOCKS),
            *(["--enforce-eager"] if eager else []), *parallel,
            "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
            "--kv-transfer-config", json.dumps(kv_transfer_config(CPU_BYTES, agent_socket=sock, **PEER_LIMITS))]
    cores = "0|1" if (os.cpu_count() or 1) > 1 else "0|0"
    vllm = Proc(wid, argv, log_dir, env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                                         "VLLM_CPU_OMP_THREADS_BIND": cores, **vllm_env()})
    procs.append(vllm)
    return Server(wid, f"http://127.0.0.1:{http}", vllm, agent, shm, redis_url)


def _ready(servers: list[Server]) -> None:
    """Each server answers and its agent has published its shards (both ranks said hello)."""
    for s in servers:
        wait_http(s.url + "/health", s.vllm, timeout_s=START_TIMEOUT_S)
        workers = [p for p in psutil.Process(s.vllm.popen.pid).children(recursive=True)
                   if p.name().startswith("VLLM::Worker")]
        assert len(workers) == 2, [p.name() for p in workers]
        for p in workers:
            p.nice(WORKER_NICE)
    for s in servers:
        assert wait_until(lambda: len((s.state().get("tiers") or {}).get("shards") or []) == 2, 30,
                          f"{s.wid}'s agent publishing two shards"), s.agent.log_tail()


def _stop(procs: list[Proc], tag: str) -> None:
    for p in reversed(procs):
        p.stop()
    for leftover in Path("/dev/shm").glob(f"kvroute-e2e-par-{tag}-*"):  # an agent that did not stop cleanly
        leftover.unlink(missing_ok=True)


def _round_trip(s: Server, tokens: list[int]) -> dict:
    """``tokens`` computed, ``/reset_prefix_cache``, then computed again from the CPU tier: the
    same greedy tokens and logprobs. Returns the first completion."""
    first = s.complete(tokens)
    assert _cached(first) == 0
    keys = s.tier_keys(tokens)[:N]
    for pp, tp in _shards(s):  # every rank saved its share of every block in the step that computed it
        wait_until(lambda: s.slots_of(pp, tp, keys), 30, f"shard pp{pp} tp{tp} holding the prompt")
    before = s.cached_by_source()
    s.reset()
    again = s.complete(tokens)
    assert _cached(again) == N * BLOCK
    same_output(first, again)
    after = s.cached_by_source()
    assert after.get("host", 0) - before.get("host", 0) == N * BLOCK
    assert f"{N * BLOCK} tokens from the tiers (blocks: cpu {N}, ssd 0, peer 0, gone 0) after 0 on GPU, in the step" \
        in s.log()
    return first


def _shards(s: Server) -> list[tuple[int, int]]:
    return sorted((sh["pp_rank"], sh["tp_rank"]) for sh in s.state()["tiers"]["shards"])


def _check_shard_files(s: Server, tokens: list[int], want: list[tuple[int, int]]) -> None:
    """Shard files ``want`` (the agent's list), each with its own fingerprint, hold every block of
    ``tokens`` in the same slot, with different bytes in each."""
    assert _shards(s) == want
    peer = s.state()["peer"]
    digests = []
    for pp, tp in want:
        path = s.shard_path(pp, tp)
        shm = ShmSlab.attach(path)
        try:
            assert shm.block_bytes == SHARD_BLOCK_BYTES
            assert shm.num_slots == CPU_BYTES // ENGINE_BLOCK_BYTES   # the engine's slot count in every shard
            digests.append(shm.fingerprint_digest.hex())
        finally:
            shm.close()
    assert len(set(digests)) == len(want)
    assert sorted(digests) == sorted(peer["fingerprints"]) and peer["fingerprint"] == digests[0]
    keys = s.tier_keys(tokens)[:N]
    held = [s.slots_of(pp, tp, keys) for pp, tp in want]
    assert all(h is not None for h in held)
    for k in keys:
        slots = {h[k][0] for h in held}
        assert len(slots) == 1, f"block {k.hex()} in slots {slots}"   # one slot number, every shard
        data = [h[k][1] for h in held]
        assert all(any(d) for d in data)                          # written, not an empty slot
        assert len(set(data)) == len(data)                        # each rank its own heads / layers


@contextmanager
def _servers(tmp_path_factory, redis_url: str, what: str, specs: list[tuple[str, list[str], bool]]):
    """Servers ``(worker id, parallel flags, eager)``, each with its agent, ready; stopped after.
    A server whose vLLM engine fails to start (``ENGINE_START_FAILED``) is started again once,
    with new ports, after a warning that ends with its log's root cause (a second failure fails
    the tests with it): a CI machine once errored three tests on that message, the engine core's
    own traceback cut from the log."""
    model = ensure_model(MODEL, vllm_python())
    tag = str(os.getpid())
    shm_before = set(Path("/dev/shm").glob("vllm_dist_*"))
    for attempt in (1, 2):
        log_dir = tmp_path_factory.mktemp(f"{what}-{attempt}")
        procs: list[Proc] = []
        try:
            ports = free_ports(4 * len(specs))  # all at once: separate calls may hand out a port twice
            servers = [_start(wid, flags, model, log_dir, redis_url, tag, procs, eager, ports[4 * i:4 * i + 4])
                       for i, (wid, flags, eager) in enumerate(specs)]
            try:
                _ready(servers)
            except ServerExited as exc:
                if attempt == 2 or ENGINE_START_FAILED not in str(exc):
                    raise
                warnings.warn(f"{what}: a server exited while starting; starting again once:\n{exc}")
                continue
            yield servers
            return
        finally:
            _stop(procs, tag)
            for left in set(Path("/dev/shm").glob("vllm_dist_*")) - shm_before:  # vLLM's TP/PP shared memory,
                left.unlink(missing_ok=True)                                      # which a stopped CPU server leaves


@pytest.fixture(scope="class")
def tp_pair(tmp_path_factory, redis_url):
    tp2 = ["--tensor-parallel-size", "2"]
    with _servers(tmp_path_factory, redis_url, "tiers-tp", [("tp-a", tp2, True), ("tp-b", tp2, True)]) as (a, b):
        yield a, b


@pytest.fixture(scope="class")
def pp_server(tmp_path_factory, redis_url):
    with _servers(tmp_path_factory, redis_url, "tiers-pp", [("pp", ["--pipeline-parallel-size", "2"], False)]) as [s]:
        yield s


P1, P2, P3 = _tokens(11), _tokens(12), _tokens(13)

# With the default 1 s for the agents' connect and handshake, one rank's pull stalled in every run
# here (vLLM 0.32 CPU build, 2 cores): B's two ranks ask B's agent for their shards at the same
# moment; one pull brings 28 of 28 blocks within milliseconds, the other logged "pull of 28 blocks
# from tp-a: 0 came (connection: handshake timed out after 1.0 s (127.0.0.1:PORT))" or "4 came
# (deadline: ...)", and vLLM recomputed. With PEER_LIMITS' 5 s both ranks pull all 28 (seen
# 2026-12-07). Under the parallel suite's load the lookup before it then missed, silently: B's agent
# counted the locate (28 blocks) but the connector's link to it gave up after a fixed 1 s; that link
# now waits peer_locate_timeout_ms. A machine loaded past these still gets the xfail below.
PULL_STALLS = ("a rank's pull, or the peer lookup before it, missed its deadline: this machine woke the agents "
               "seconds late while B's engine and TP workers polled (module docstring), vLLM recomputes")


class TestTensorParallel:
    def test_cpu_tier_serves_after_reset_with_identical_logprobs(self, tp_pair):
        a, _ = tp_pair
        _round_trip(a, P1)

    def test_each_rank_has_its_own_shard_file(self, tp_pair):
        a, _ = tp_pair
        if not a.slots_of(0, 0, a.tier_keys(P1)[:N]):   # run alone (-k): compute P1 here
            a.complete(P1)
        wait_until(lambda: a.slots_of(0, 1, a.tier_keys(P1)[:N]), 30, "rank 1's shard holding P1")
        _check_shard_files(a, P1, [(0, 0), (0, 1)])
        assert not list(a.shm.parent.glob(f"{a.shm.name}-pp1-*"))

    def test_b_pulls_each_ranks_own_heads_from_a(self, tp_pair):
        a, b = tp_pair
        first = a.complete(P2)
        assert _cached(first) == 0
        index_keys = block_keys(P2, BLOCK, MODEL)
        wait_until(lambda: (m := redis_match(a.redis_url, index_keys).get(a.wid)) is not None and m.total >= N, 30,
                   "P2 in the index as A's")
        before = b.cached_by_source().get("p2p", 0.0)
        body = b.complete(P2)
        same_output(first, body)                 # never a wrong result, pulled or recomputed
        log = b.log()
        pulled = sorted(int(n) for n in re.findall(rf"pulled (\d+) of {N} blocks from {a.wid}", log))
        if _cached(body) == 0 and (len(pulled) < 2 or pulled[0] < N):  # a rank pulled less, or never got to
            pytest.xfail(f"{PULL_STALLS} (blocks pulled per rank: {pulled})")
        assert _cached(body) == N * BLOCK
        assert b.cached_by_source().get("p2p", 0.0) - before == N * BLOCK
        assert re.search(rf"{N * BLOCK} tokens from the tiers \(blocks: cpu 0, ssd 0, peer {N} from {a.wid}, gone 0\) "
                         r"after 0 on GPU, asynchronously", log)
        assert log.count(f"pulled {N} of {N} blocks from {a.wid}") == 2              # each rank pulled its shard
        # B saved the pulled blocks to its own shard files: rank r's bytes are A's rank r's
        keys = a.tier_keys(P2)[:N]
        assert b.tier_keys(P2)[:N] == keys
        for tp in (0, 1):
            mine = wait_until(lambda: b.slots_of(0, tp, keys), 30, f"B's rank {tp} holding P2")
            theirs = a.slots_of(0, tp, keys)
            assert theirs is not None
            assert all(mine[k][1] == theirs[k][1] for k in keys), f"rank {tp}: B's blocks are not A's rank {tp}'s"
        _check_shard_files(b, P2, [(0, 0), (0, 1)])


class TestPipelineParallel:
    def test_cpu_tier_serves_after_reset_with_identical_logprobs(self, pp_server):
        _round_trip(pp_server, P3)

    def test_each_stage_has_its_own_shard_file(self, pp_server):
        s = pp_server
        if not s.slots_of(0, 0, s.tier_keys(P3)[:N]):
            s.complete(P3)
        wait_until(lambda: s.slots_of(1, 0, s.tier_keys(P3)[:N]), 30, "stage 1's shard holding P3")
        _check_shard_files(s, P3, [(0, 0), (1, 0)])
        assert not list(s.shm.parent.glob(f"{s.shm.name}-pp0-tp1*"))
