"""Shared by the tier tests on real vLLM (test_tiers_vllm.py, test_peer_pull_vllm.py,
test_bench_rig_tiers.py): the tiny model's block size in bytes, comparing two greedy completions
with logprobs, vLLM's cached tokens by source, and prompts of random tokens."""
from __future__ import annotations

import random

from kvbench.workers import samples_by_source

# one KV block of the generated "tiny" model served in bfloat16, block size 32:
# 2 layers x (K, V) x 32 tokens x 1 KV head x 64 dims x 2 bytes
TINY_BLOCK_BYTES = 2 * 2 * 32 * 1 * 64 * 2


def same_output(a: dict, b: dict) -> None:
    """Assert two completions (``logprobs`` requested) have the same text, tokens and logprobs."""
    ca, cb = a["choices"][0], b["choices"][0]
    assert ca["text"] == cb["text"]
    assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
    assert ca["logprobs"]["token_logprobs"] == cb["logprobs"]["token_logprobs"]
    assert ca["logprobs"]["top_logprobs"] == cb["logprobs"]["top_logprobs"]


def cached_by_source(vllm_url: str) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_cached_by_source_total`` per ``source`` label (device, host,
    p2p, disk, ...), summed over its other labels."""
    return samples_by_source(vllm_url, "vllm:prompt_tokens_cached_by_source_total")


def random_tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids in 10..489 (inside the tiny model's vocabulary), the same for a seed."""
    rnd = random.Random(seed)
    return [10 + rnd.randrange(480) for _ in range(n)]
