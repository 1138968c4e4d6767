"""The tiers connector's hard cases on a real vLLM server (CPU build): two servers of the generated
"tiny" model with a KV cache of 20 blocks of 32 tokens, one with our connector (CPU tier 16 blocks,
SSD tier 400 blocks), one without (the reference):

1. a full-prompt hit never claims the last token: a prompt whose every block (the one holding its
   last token included, the length an exact multiple of the block size) was saved to the CPU
   tier, after ``/reset_prefix_cache``, loads exactly the blocks before the last one (vLLM's own
   prefix cache does the same: block-granular, at most ``prompt_len - 1`` tokens), and the
   answer's tokens and logprobs equal the first run's; a prompt one token longer loads all its
   full blocks (``prompt_len - 1`` tokens);
2. preemption: concurrent long requests overflow the KV cache, so vLLM preempts and re-admits
   them (the re-admitted ones matched again against the tiers, some loading asynchronously from
   SSD while others are preempted around them); every request completes with the tokens the
   server without the connector gives.
"""
from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from e2e.conftest import vllm_python
from e2e.tier_checks import TINY_BLOCK_BYTES, cached_by_source, random_tokens, same_output
from conftest import Proc, free_ports, wait_http, wait_until
from offload_agent.connector.config import kv_transfer_config, vllm_env
from offload_agent.tiers import HEADER_BYTES

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from model_cache import ensure_model  # noqa: E402

BLOCK = 32
GPU_BLOCKS = 20
CPU_BYTES = 16 * TINY_BLOCK_BYTES
SSD_BYTES = 400 * (HEADER_BYTES + TINY_BLOCK_BYTES)


class Servers:
    def __init__(self, with_connector: str, without: str, proc: Proc, ref_proc: Proc) -> None:
        self.url, self.ref_url, self.proc, self.ref_proc = with_connector, without, proc, ref_proc

    def complete(self, tokens: list[int], url: str | None = None, max_tokens: int = 8) -> dict:
        r = httpx.post((url or self.url) + "/v1/completions", timeout=600,
                       json={"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                             "logprobs": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    def reset(self) -> None:
        assert httpx.post(self.url + "/reset_prefix_cache", timeout=60).status_code == 200

    def metric(self, name: str, url: str | None = None) -> float:
        text = httpx.get((url or self.url) + "/metrics", timeout=30).text
        return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    py = vllm_python()
    model = ensure_model("tiny", py)
    log_dir = tmp_path_factory.mktemp("hard")
    procs: list[Proc] = []
    try:
        port, ref_port = free_ports(2)

        def start(name: str, port: int, connector: bool) -> Proc:
            argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                    "--max-model-len", "512", "--block-size", str(BLOCK), "--enable-prefix-caching",
                    "--dtype", "bfloat16", "--enforce-eager", "--num-gpu-blocks-override", str(GPU_BLOCKS),
                    "--enable-prompt-tokens-details", "--enable-log-requests"]
            if connector:
                argv += ["--kv-transfer-config",
                         json.dumps(kv_transfer_config(CPU_BYTES, log_dir / "ssd", SSD_BYTES))]
            return Proc(name, argv, log_dir, env={
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"), **vllm_env()})

        procs.append(start("vllm-tiers", port, True))
        procs.append(start("vllm-plain", ref_port, False))
        wait_http(f"http://127.0.0.1:{port}/health", procs[0], timeout_s=600)
        wait_http(f"http://127.0.0.1:{ref_port}/health", procs[1], timeout_s=600)
        yield Servers(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ref_port}", procs[0], procs[1])
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.mark.parametrize("length, loaded", [
    (8 * BLOCK, 7 * BLOCK),          # every block in the tiers, the last holds the last token: 7 load
    (8 * BLOCK + 1, 8 * BLOCK),      # the last token in a partial block: all 8 full blocks, len - 1 tokens
    (8 * BLOCK - 1, 7 * BLOCK),      # the last block partial (never saved): 7
])
def test_a_full_prompt_hit_never_claims_the_last_token(servers, length, loaded):
    s = servers
    tokens = random_tokens(1000 + length, length)
    first = s.complete(tokens)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    before = cached_by_source(s.url)
    line = (f": {loaded} tokens from the tiers (blocks: cpu {loaded // BLOCK}, ssd 0, peer 0, gone 0) after 0 on GPU, "
            "in the step")
    logged = s.log().count(line)
    s.reset()
    again = s.complete(tokens)
    after = cached_by_source(s.url)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
    assert after.get("host", 0) - before.get("host", 0) == loaded      # all from the CPU tier, in the step
    assert after.get("disk", 0) == before.get("disk", 0)
    assert wait_until(lambda: s.log().count(line) == logged + 1)   # the connector's own count of what it loaded
    same_output(first, again)
    ref = s.complete(tokens, s.ref_url)
    assert again["choices"][0]["text"] == ref["choices"][0]["text"]


def test_preempted_requests_are_readmitted_and_complete_as_without_the_connector(servers):
    s = servers
    # 4-5 blocks each, growing to 10-12 as they decode: 3-4 are admitted together into the 19 usable
    # blocks, then the decodes outgrow the cache and vLLM preempts the last admitted
    prompts = [random_tokens(2000 + i, 120 + 5 * i) for i in range(8)]
    max_tokens = 200

    def run(url: str, proc: Proc) -> list[dict]:
        """All prompts at once: the engine paused (``/pause?mode=keep``) until its log says every
        one was handed to it, so they are admitted together whatever the machine's pace."""
        def added() -> int:
            return proc.log_path.read_text(errors="replace").count("Added request ")

        before = added()
        assert httpx.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=60).status_code == 200
        pool = ThreadPoolExecutor(len(prompts))
        try:
            answers = [pool.submit(s.complete, p, url, max_tokens) for p in prompts]
            wait_until(lambda: added() - before >= len(prompts), timeout_s=120, what="every request queued")
        finally:
            assert httpx.post(url + "/resume", timeout=60).status_code == 200
            pool.shutdown(wait=False)
        return [a.result(timeout=600) for a in answers]

    ref = run(s.ref_url, s.ref_proc)
    for round_ in range(2):          # the second after a reset: re-admissions load from the tiers (SSD: async)
        preempted = s.metric("vllm:num_preemptions_total")
        got = run(s.url, s.proc)
        # (the counter follows the engine's stats, which may come just after the last answer)
        assert wait_until(lambda: s.metric("vllm:num_preemptions_total") > preempted, timeout_s=10,
                          what=f"a preemption (the reference server had "
                               f"{s.metric('vllm:num_preemptions_total', s.ref_url)}); without one the test shows nothing")
        for a, b in zip(got, ref):
            assert a["usage"]["completion_tokens"] == max_tokens
            assert a["choices"][0]["logprobs"]["tokens"] == b["choices"][0]["logprobs"]["tokens"]
        s.reset()
    log = s.log()
    assert "Traceback" not in log
    assert re.search(r"tokens from the tiers \(blocks: cpu \d+, ssd [1-9]", log), "no SSD (asynchronous) load"
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
