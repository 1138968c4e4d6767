"""The CPU/SSD tiers on a real vLLM server (CPU build) through our KV connector.

One vLLM server (the generated "tiny" model, whose output depends on its context; 64 GPU blocks;
CPU tier 100 blocks; SSD tier 200 blocks) plus one simulated worker, behind a gateway with the
embedded index. The tests run in order on that one server (their state builds up):

1. long prompts computed once; after ``/reset_prefix_cache`` they come back from the CPU tier
   (vLLM counts the tokens as cached, source ``host``) with identical greedy tokens and logprobs;
2. the router prefers the worker holding a prefix in its CPU tier over one holding nothing, and
   one holding it on GPU over both;
3. once the CPU tier is full, blocks spill to SSD and are served from there (source ``disk``);
4. a corrupted and a truncated SSD block are detected, recomputed (identical output) and deleted;
5. under a stream of distinct prompts both tiers stay within their byte limits;
6. after a restart of vLLM the SSD tier is rebuilt from its files and serves a prompt computed
   before the restart, with identical output.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import httpx
import pytest

from e2e.conftest import vllm_python
from e2e.tier_checks import TINY_BLOCK_BYTES, cached_by_source, random_tokens, same_output
from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, wait_http, wait_until
from offload_agent.connector.config import kv_transfer_config, vllm_env
from offload_agent.tiers import HEADER_BYTES, TierFingerprint, tier_block_keys, tier_root
from offload_agent.tiers.ssd_file import block_path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

BLOCK = 32
GPU_BLOCKS = 64
BLOCK_BYTES = TINY_BLOCK_BYTES
CPU_BLOCKS, SSD_BLOCKS = 100, 200
CPU_BYTES = CPU_BLOCKS * BLOCK_BYTES
SSD_BYTES = SSD_BLOCKS * (HEADER_BYTES + BLOCK_BYTES)
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPT_TOKENS = 1000                            # 31 full blocks


def _tokens(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    return random_tokens(seed, n)


class Tiers:
    """Handles on the running server, the sim worker, the gateway and the SSD folder."""

    def __init__(self, vllm_url, sim_url, gateway, ssd_dir, vllm_proc, start_vllm):
        self.vllm_url, self.sim_url, self.gateway, self.ssd_dir, self.vllm_proc = \
            vllm_url, sim_url, gateway, ssd_dir, vllm_proc
        self.start_vllm = start_vllm      # () -> Proc: the same server again (same port and folders)
        self.first: dict[int, dict] = {}

    def complete(self, tokens: list[int], url: str | None = None) -> dict:
        r = httpx.post((url or self.vllm_url) + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": tokens, "max_tokens": 8, "temperature": 0, "logprobs": 3})
        assert r.status_code == 200, r.text
        return r.json()

    def reset(self) -> None:
        assert httpx.post(self.vllm_url + "/reset_prefix_cache", timeout=60).status_code == 200

    def cached_by_source(self) -> dict[str, float]:
        return cached_by_source(self.vllm_url)

    def fp_dir(self) -> Path:
        dirs = [d for d in self.ssd_dir.iterdir() if d.name.startswith("fp-")]
        assert len(dirs) == 1, dirs
        return dirs[0]

    def ssd_files(self) -> list[Path]:
        return list(self.fp_dir().rglob("*.kvb"))

    def tier_keys(self, tokens: list[int]) -> list[bytes]:
        fp = TierFingerprint(**json.loads((self.fp_dir() / "fingerprint.json").read_text()))
        return tier_block_keys(tokens, BLOCK, tier_root(fp.engine_digest()))

    def index(self) -> dict:
        r = httpx.get(self.gateway + "/admin/index", headers=AUTH, timeout=30)
        assert r.status_code == 200
        return r.json()["workers"]

    def explain(self, tokens: list[int]) -> dict:
        r = httpx.post(self.gateway + "/admin/explain", headers=AUTH, timeout=30,
                       json={"model": "tiny", "prompt": tokens, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()

    def log(self) -> str:
        return self.vllm_proc.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    py = vllm_python()
    model = ensure_model("tiny", py)
    log_dir = tmp_path_factory.mktemp("tiers")
    ssd_dir = log_dir / "ssd"
    procs: list[Proc] = []
    try:
        port, ev, rp, sim_port, sev, srp, gw_port = free_ports(7)  # vLLM, sim (HTTP, events, replay), gateway
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                  "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"}

        def start_vllm(name: str = "vllm") -> Proc:
            argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                    "--max-model-len", "1024", "--block-size", str(BLOCK), "--enable-prefix-caching",
                    "--dtype", "bfloat16", "--enforce-eager", "--num-gpu-blocks-override", str(GPU_BLOCKS),
                    "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
                    "--kv-transfer-config", json.dumps(kv_transfer_config(CPU_BYTES, ssd_dir, SSD_BYTES))]
            return Proc(name, argv, log_dir, env={
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"), **vllm_env()})

        vllm = start_vllm()
        procs.append(vllm)
        sim_events = {**events, "endpoint": f"tcp://*:{sev}", "replay_endpoint": f"tcp://*:{srp}"}
        sim = Proc("sim", kvroute_argv("sim", "--model", str(model), "--served-model-name", "tiny",
                                       "--host", "127.0.0.1", "--port", str(sim_port), "--block-size", str(BLOCK),
                                       "--num-gpu-blocks-override", "512", "--enable-prompt-tokens-details",
                                       "--speedup", "50", "--kv-events-config", json.dumps(sim_events)), log_dir)
        procs.append(sim)
        vllm_url, sim_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{sim_port}"
        wait_http(sim_url + "/health", sim)
        wait_http(vllm_url + "/health", vllm, timeout_s=480)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
               "models": [{"name": "tiny", "tokenizer": str(model), "block_size": BLOCK}],
               "index": {"backend": "memory"},
               "workers": [{"id": "vllm", "url": vllm_url, "model": "tiny", "events": f"tcp://127.0.0.1:{ev}",
                            "replay": f"tcp://127.0.0.1:{rp}"},
                           {"id": "sim", "url": sim_url, "model": "tiny", "events": f"tcp://127.0.0.1:{sev}",
                            "replay": f"tcp://127.0.0.1:{srp}"}],
               "policy": {"name": "kv_aware", "tier_credit": {"gpu": 1.0, "cpu": 0.75, "ssd": 0.25},
                          "load_weight": 0.0}}
        cfg_path = log_dir / "gw.yaml"
        cfg_path.write_text(json.dumps(cfg))
        gw = Proc("gateway", kvroute_argv("serve", "--config", str(cfg_path)), log_dir)
        procs.append(gw)
        gateway = f"http://127.0.0.1:{gw_port}"
        wait_http(gateway + "/health", gw)

        def restart() -> Proc:
            p = start_vllm("vllm-restarted")
            procs.append(p)
            wait_http(vllm_url + "/health", p, timeout_s=480)
            return p

        t = Tiers(vllm_url, sim_url, gateway, ssd_dir, vllm, restart)
        assert wait_until(lambda: all((w.get("kv_events") or {}).get("connected") for w in t.index().values()))
        yield t
    finally:
        for p in reversed(procs):
            p.stop()


P1, P2 = _tokens(1), _tokens(2, 700)
FILLERS = iter(range(100, 200))


def _fill(t: Tiers, n: int) -> None:
    for _ in range(n):
        seed = next(FILLERS)
        t.first[seed] = t.complete(_tokens(seed))


def test_cpu_tier_serves_after_reset_with_identical_logprobs(tiers):
    t = tiers
    for p in (P1, P2):
        t.first[id(p)] = out = t.complete(p)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    before = t.cached_by_source()
    t.reset()
    for p in (P1, P2):
        again = t.complete(p)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(p) - 1) // BLOCK * BLOCK
        same_output(t.first[id(p)], again)
    after = t.cached_by_source()
    assert after["host"] - before.get("host", 0) == (31 + 21) * BLOCK
    assert after.get("disk", 0) == 0
    # CPU-tier hits load in the step that computes the request
    assert re.search(r"kvroute tiers: request \S+: 992 tokens from the tiers \(blocks: cpu 31, ssd 0, peer 0, "
                     r"gone 0\) after 0 on GPU, in the step", t.log())


def test_router_prefers_cpu_tier_over_nothing_and_gpu_over_cpu(tiers):
    t = tiers
    _fill(t, 2)      # 62 blocks more: P1 leaves vLLM's 64-block GPU cache; the CPU tier (100) spills its tail

    def vllm_holds_p1_in_tiers():
        c = {c["worker"]: c for c in t.explain(P1)["candidates"]}
        m = c["vllm"]["matched_blocks"]
        return c if m["gpu"] == 0 and m["cpu"] > 0 and m["cpu"] + m["ssd"] == 31 else None

    cands = wait_until(vllm_holds_p1_in_tiers)
    assert cands, t.explain(P1)
    assert cands["vllm"]["matched_blocks"]["cpu"] >= 17
    assert sum(cands["sim"]["matched_blocks"].values()) == 0
    assert t.explain(P1)["chosen"] == "vllm"
    idx = t.index()["vllm"]["blocks"]
    assert idx["cpu"] * BLOCK_BYTES <= CPU_BYTES and idx["ssd"] >= 14
    t.complete(P1, url=t.sim_url)         # now the sim holds P1 on its GPU
    assert wait_until(lambda: {c["worker"]: c for c in t.explain(P1)["candidates"]}["sim"]["matched_blocks"]["gpu"] == 31)
    assert t.explain(P1)["chosen"] == "sim"


def test_full_cpu_tier_spills_to_ssd_and_ssd_serves(tiers):
    t = tiers
    _fill(t, 3)                           # 93 blocks more: the CPU tier (100) spills P1's tail to SSD
    keys = t.tier_keys(P1)
    on_ssd = [i for i, k in enumerate(keys) if block_path(t.fp_dir(), k).exists()]
    assert len(on_ssd) >= 10, on_ssd
    before = t.cached_by_source()
    t.reset()
    again = t.complete(P1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 992
    same_output(t.first[id(P1)], again)
    after = t.cached_by_source()
    assert after["disk"] - before.get("disk", 0) >= len(on_ssd) * BLOCK
    assert after["host"] + after["disk"] - before["host"] - before.get("disk", 0) == 992
    # a hit with SSD blocks loads asynchronously: the request waited in WAITING_FOR_REMOTE_KVS
    # while a background thread read the files, the engine stepping meanwhile
    ssd_hit = re.findall(r"kvroute tiers: request \S+: 992 tokens from the tiers \(blocks: cpu (\d+), ssd (\d+), "
                         r"peer 0, gone 0\) after 0 on GPU, (asynchronously|in the step)", t.log())
    assert ssd_hit and int(ssd_hit[-1][1]) >= len(on_ssd) and ssd_hit[-1][2] == "asynchronously", ssd_hit


def test_corrupt_and_truncated_ssd_blocks_are_recomputed_never_served(tiers):
    t = tiers
    _fill(t, 4)                           # push P1 out of the CPU tier again (its tail stays on SSD)
    keys = t.tier_keys(P1)
    on_ssd = [i for i, k in enumerate(keys) if block_path(t.fp_dir(), k).exists()]
    assert len(on_ssd) >= 4, on_ssd
    bad_flip, bad_trunc = on_ssd[len(on_ssd) // 2], on_ssd[-1]
    flip = block_path(t.fp_dir(), keys[bad_flip])
    raw = bytearray(flip.read_bytes())
    raw[HEADER_BYTES + 1234] ^= 0x40
    flip.write_bytes(bytes(raw))
    trunc = block_path(t.fp_dir(), keys[bad_trunc])
    trunc.write_bytes(trunc.read_bytes()[:HEADER_BYTES + 100])
    t.reset()
    again = t.complete(P1)
    same_output(t.first[id(P1)], again)
    assert not flip.exists() and not trunc.exists()          # detected and deleted
    assert "checksum mismatch" in t.log() and "truncated" in t.log()
    assert "Recovered from KV load failure" in t.log()
    # recomputed, saved again, and served from the tiers once more
    t.reset()
    same_output(t.first[id(P1)], t.complete(P1))


def test_byte_limits_hold_under_a_stream_of_prompts(tiers):
    t = tiers
    _fill(t, 10)                          # 310 blocks through a 100-block CPU and 200-block SSD tier
    files = t.ssd_files()
    assert len(files) <= SSD_BLOCKS
    assert sum(f.stat().st_size for f in files) <= SSD_BYTES
    assert len(files) >= SSD_BLOCKS - 31  # and the SSD tier is in use, not empty
    # what the index learned (blocks unannounced since the last reset are missing: an under-report)
    idx = t.index()["vllm"]["blocks"]
    assert 0 < idx["cpu"] <= CPU_BLOCKS and 0 < idx["ssd"] <= SSD_BLOCKS
    assert "Traceback" not in t.log()


def test_restart_rebuilds_the_ssd_tier_from_disk(tiers):
    t = tiers
    keys = {seed: t.tier_keys(_tokens(seed)) for seed in t.first if isinstance(seed, int) and seed >= 100}
    whole = [s for s, ks in keys.items() if all(block_path(t.fp_dir(), k).exists() for k in ks)]
    assert whole, "no prompt entirely on SSD"
    seed = whole[-1]
    t.vllm_proc.stop()
    t.vllm_proc = t.start_vllm()
    again = t.complete(_tokens(seed))     # the CPU tier died with the process; SSD files remain
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 992
    same_output(t.first[seed], again)
    assert t.cached_by_source().get("disk", 0) == 992
    assert re.search(r"SSD tier \S+: \d+ blocks \(\d*[1-9]\d* found on disk\)", t.log())
