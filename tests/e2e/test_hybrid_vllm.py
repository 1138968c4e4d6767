"""A hybrid model on real vLLM (CPU build): a generated Llama whose layers alternate a 64-token
sliding window and full attention (``tools/make_model.py --sliding-window 64``), served by
``kvroute up`` (which reads the window from the model's ``config.json``).

vLLM keeps one KV cache group per attention kind and hits a prefix only where the window group
still holds the blocks just before it. The window group caches little more than each prompt's tail,
so a prompt that shares the first half of an earlier one hits nothing though every one of its
full-attention blocks is cached; vLLM then keeps the window at that shared point, and the next
prompt sharing it hits. Each prompt below is explained before it is sent: the gateway's prediction
is what vLLM then reports as cached, at every step."""
from __future__ import annotations

import random

import httpx
import pytest

from e2e.conftest import vllm_python, vllm_up
from conftest import ADMIN_TOKEN, wait_until
from model_cache import ensure_model  # tools/, on the path from e2e.conftest

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BLOCK = 32
WINDOW = 64  # tokens: 2 window blocks before a hit's end


@pytest.fixture(scope="module")
def hybrid_cluster(tmp_path_factory):
    model = ensure_model("tiny", vllm_python(), sliding_window=WINDOW)
    with vllm_up("up-hybrid", model, "tiny-hybrid", tmp_path_factory.mktemp("hybrid-vllm"), "--workers", "1",
                 "--num-gpu-blocks-override", "160") as base:
        yield base


def test_prefix_hits_follow_the_window_group(hybrid_cluster):
    base = hybrid_cluster
    rnd = random.Random(7)
    fresh = lambda n: [rnd.randrange(10, 500) for _ in range(n)]  # noqa: E731
    a = fresh(645)  # 20 full blocks

    def explain(prompt: list[int]) -> dict:
        r = httpx.post(base + "/admin/explain", json={"model": "tiny-hybrid", "prompt": prompt}, headers=AUTH,
                       timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def send(prompt: list[int]) -> int:
        r = httpx.post(base + "/v1/completions", json={"model": "tiny-hybrid", "prompt": prompt, "max_tokens": 1},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def window_blocks_stored() -> int:
        states = httpx.get(base + "/admin/index", headers=AUTH, timeout=30).json()["workers"]
        return sum((w.get("kv_events") or {}).get("window_blocks_stored", 0) for w in states.values())

    def settle(stored_before: int) -> int:
        """Wait until the window group's KV events of the last prompt reached the index."""
        return wait_until(lambda: (n := window_blocks_stored()) > stored_before and n, 60, "window-group KV events")

    assert explain(a)["predicted_cached_tokens"] == 0
    assert send(a) == 0
    stored = settle(0)
    # the full 20 blocks are indexed; the window group holds blocks 18 and 19 only
    assert explain(a[:640] + [7, 8, 9, 10, 11])["predicted_cached_tokens"] == 640
    b = a[:320] + fresh(160)  # shares 10 full-attention blocks, but not the window before them
    assert explain(b)["predicted_cached_tokens"] == 0
    assert send(b) == 0
    stored = settle(stored)  # vLLM kept the window at the shared point (blocks 8 and 9)
    c = a[:320] + fresh(160)
    assert explain(c)["predicted_cached_tokens"] == 320
    assert send(c) == 320
    d = a[:640] + [7, 8, 9, 10, 11]
    assert explain(d)["predicted_cached_tokens"] == 640
    assert send(d) == 640
    e = a[:608] + [7, 8, 9, 10, 11] * 10  # 19 shared blocks: block 17 left the window group, so 10
    assert explain(e)["predicted_cached_tokens"] == 320
    assert send(e) == 320
