"""Routing on real vLLM: 20 interleaved multi-turn conversations, ``kv_aware`` then
``round_robin`` on the same requests (policy swapped with ``PUT /admin/policy``, both workers'
prefix caches reset in between).

Each conversation has its own system prompt (~7 blocks, so a turn's prefix credit outweighs the
load one request that just finished on its worker still shows in the gateway's last metrics
scrape); the assistant turns are fixed text, so both phases send identical bodies. The conversations' final prompts need more KV blocks than one worker has,
and fit in the two together. Before each request ``/admin/explain`` gives the gateway's choice and
predicted prefix-hit tokens; the response's ``x-kvroute-worker`` and vLLM's ``cached_tokens`` are
checked against them. The ideal hit rate is computed from the token ids: every block of a prompt
shared with the conversation's earlier prompts is a hit (infinite cache, perfect stickiness),
capped as vLLM caps a hit at prompt length - 1.
"""
from __future__ import annotations

import random

from kvcore.block_keys import block_keys
from kvcore.tokenization import PromptTokenizer

from .bodies import MODEL, words
from .conftest import BLOCK_SIZE, GPU_BLOCKS

N_CONVERSATIONS = 20
N_TURNS = 4
MAX_TOKENS = 2


def conversation_bodies() -> list[list[dict]]:
    """Per conversation, the chat body of each turn (history grows by the fixed assistant reply)."""
    out = []
    for c in range(N_CONVERSATIONS):
        messages = [{"role": "system", "content": f"Conversation {c}. " + words(110, 1000 + c)}]
        turns = []
        for t in range(N_TURNS):
            messages.append({"role": "user", "content": words(11, 100 * c + t)})
            turns.append({"model": MODEL, "messages": [dict(m) for m in messages], "max_tokens": MAX_TOKENS})
            messages.append({"role": "assistant", "content": words(6, 5000 + 100 * c + t)})
        out.append(turns)
    return out


def schedule() -> list[tuple[int, int]]:
    """(conversation, turn) in send order: round by round, conversations shuffled in each round
    (so round robin does not keep a conversation on one worker by parity)."""
    order = []
    for t in range(N_TURNS):
        convs = list(range(N_CONVERSATIONS))
        random.Random(t).shuffle(convs)
        order += [(c, t) for c in convs]
    return order


def ideal_cached_tokens(ids_by_turn: list[list[int]]) -> list[int]:
    """Per turn: tokens of full blocks shared with an earlier turn's prompt, at most (n-1)//bs blocks."""
    out = []
    for t, ids in enumerate(ids_by_turn):
        best = 0
        for prev in ids_by_turn[:t]:
            lcp = next((i for i, (a, b) in enumerate(zip(ids, prev)) if a != b), min(len(ids), len(prev)))
            best = max(best, lcp)
        out.append(min(best // BLOCK_SIZE, (len(ids) - 1) // BLOCK_SIZE) * BLOCK_SIZE)
    return out


def run_phase(cluster, bodies, check_predictions: bool) -> dict:
    """Send every turn in :func:`schedule` order; returns per-request records and totals. With
    ``check_predictions`` each request is first explained (``/admin/explain``) and the gateway's
    choice and predicted hit are checked against what happened."""
    cli = cluster.openai()
    records = []
    for c, t in schedule():
        body = bodies[c][t]
        plan = (cluster.explain(body) if check_predictions
                else {"chosen": None, "predicted_cached_tokens": None, "candidates": []})
        raw = cli.chat.completions.with_raw_response.create(
            model=MODEL, messages=body["messages"], max_tokens=MAX_TOKENS)
        usage = raw.parse().usage
        worker = raw.headers["x-kvroute-worker"]
        cached = usage.prompt_tokens_details.cached_tokens or 0
        held = {cand["worker"]: sum(cand["matched_blocks"].values()) for cand in plan["candidates"]}
        rec = {"conv": c, "turn": t, "worker": worker, "chosen": plan["chosen"], "prompt": usage.prompt_tokens,
               "cached": cached, "predicted": plan["predicted_cached_tokens"], "held_blocks": held}
        records.append(rec)
        if check_predictions:
            assert worker == plan["chosen"], rec
            # vLLM hits at least what the gateway predicted, less one block (a fully cached prompt
            # recomputes its last block; a block's events may trail the request by a moment).
            assert cached >= plan["predicted_cached_tokens"] - BLOCK_SIZE, rec
    return {"records": records, "cached": sum(r["cached"] for r in records),
            "prompt": sum(r["prompt"] for r in records)}


def test_kv_aware_keeps_conversations_on_their_worker_and_beats_round_robin(cluster, e2e_model):
    bodies = conversation_bodies()
    tok = PromptTokenizer(e2e_model)
    ids = [[tok.encode_chat(b) for b in turns] for turns in bodies]
    final_blocks = {k for conv in ids for k in block_keys(conv[-1], BLOCK_SIZE, MODEL)}
    # The premise: one worker cannot hold every conversation; the two together can.
    assert GPU_BLOCKS < len(final_blocks) < 2 * GPU_BLOCKS - 2 * N_CONVERSATIONS, len(final_blocks)
    ideal = {(c, t): v for c, conv in enumerate(ids) for t, v in enumerate(ideal_cached_tokens(conv))}

    original = cluster.admin("GET", "/admin/policy").json()
    try:
        cluster.set_policy({"name": "kv_aware"})
        cluster.reset_prefix_caches()
        kv = run_phase(cluster, bodies, check_predictions=True)
        cluster.set_policy({"name": "round_robin"})
        cluster.reset_prefix_caches()
        rr = run_phase(cluster, bodies, check_predictions=False)
    finally:
        cluster.set_policy(original)

    home = {r["conv"]: r["worker"] for r in kv["records"] if r["turn"] == 0}
    # A turn whose history its home still holds (by the index, which vLLM's events keep exact)
    # stays there. One whose history was evicted everywhere (the homes' split is decided by load,
    # and a worker given more conversations than it holds evicts the oldest) goes by load: no
    # worker holds anything of it, and vLLM confirms it computed the whole prompt.
    moved = [r for r in kv["records"] if r["worker"] != home[r["conv"]]]
    strays = [r for r in moved if r["held_blocks"].get(home[r["conv"]], 0) > 0]
    assert strays == [], f"turns routed away from the worker holding their conversation: {strays}"
    lost = [r for r in moved if r not in strays]
    assert all(not any(r["held_blocks"].values()) and r["cached"] == 0 for r in lost), lost
    assert 0 < sum(w == "w0" for w in home.values()) < N_CONVERSATIONS  # both workers used

    prompt_total = sum(len(x) for conv in ids for x in conv)
    assert kv["prompt"] == rr["prompt"] == prompt_total
    ideal_rate = sum(ideal.values()) / prompt_total
    kv_rate, rr_rate = kv["cached"] / prompt_total, rr["cached"] / prompt_total
    print(f"\n[e2e routing] prefix-hit rate: ideal {ideal_rate:.3f}  kv_aware {kv_rate:.3f}  "
          f"round_robin {rr_rate:.3f}  ({len(final_blocks)} blocks of final prompts, {GPU_BLOCKS} per worker; "
          f"{len(lost)} turns' history evicted everywhere)")
    assert kv_rate >= 0.9 * ideal_rate
    assert kv_rate > rr_rate
    rr_split = {w: sum(r["worker"] == w for r in rr["records"]) for w in ("w0", "w1")}
    assert abs(rr_split["w0"] - rr_split["w1"]) <= 1  # round robin did alternate
