"""Generated workloads: shared-prefix groups and multi-turn chat, from one-token words so every
length below is exact in tokens.

- ``shared-prefix`` (after SGLang's ``bench_serving --dataset-name generated-shared-prefix``):
  ``groups`` prefixes of ``shared_tokens``; each group has ``prompts_per_group`` completions
  prompts = its prefix + ``own_tokens`` of its own; all prompts sent in one seeded shuffle.
- ``multiturn``: ``conversations`` chats of ``turns`` turns. Conversation c starts with system
  prompt ``c mod system_prompts`` (``system_tokens``; ``system_prompts`` = ``conversations`` gives
  each its own), then user turns of ``user_tokens``; after each turn the history gets a fixed
  assistant reply of ``reply_tokens`` (the same for every target, so bodies never depend on a
  router), and the next turn re-sends the whole history. Turns go round by round (turn t of every
  conversation, in a seeded shuffle, before turn t+1) and a turn waits for the previous one.

:func:`scale_for_kv_pressure` makes the KV-pressure variant of either: more groups or
conversations, until the live prefixes need ``ratio`` times the cluster's KV blocks.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable

from kvbench.words import OneTokenWords
from kvbench.workload import BenchRequest, Workload


def shared_prefix(words: OneTokenWords, block_size: int, groups: int, prompts_per_group: int,
                  shared_tokens: int, own_tokens: int, output_tokens: int, seed: int = 0) -> Workload:
    """The shared-prefix workload (module docstring). Raises ValueError on counts < 1."""
    if min(groups, prompts_per_group, shared_tokens + own_tokens, output_tokens) < 1:
        raise ValueError("groups, prompts per group, prompt length and output tokens must be >= 1")
    items = []
    for g in range(groups):
        prefix = words.block(g, shared_tokens, salt=f"gsp-shared-{seed}")
        for p in range(prompts_per_group):
            own = words.filler(f"gsp-own-{seed}-{g}-{p}", own_tokens)
            items.append((g, words.text(prefix + own)))
    random.Random(seed).shuffle(items)
    requests = [BenchRequest(index=i, endpoint="completions", body={"prompt": text},
                             prompt_token_ids=words.tokenizer.encode_text(text, True),
                             output_tokens=output_tokens, group=f"g{g}")
                for i, (g, text) in enumerate(items)]
    return Workload("shared-prefix", requests, block_size, {
        "groups": groups, "prompts_per_group": prompts_per_group, "shared_tokens": shared_tokens,
        "own_tokens": own_tokens, "output_tokens": output_tokens, "seed": seed})


def multiturn(words: OneTokenWords, block_size: int, conversations: int, turns: int, system_prompts: int,
              system_tokens: int, user_tokens: int, reply_tokens: int, output_tokens: int,
              seed: int = 0) -> Workload:
    """The multi-turn chat workload (module docstring). Raises ValueError on counts < 1."""
    if min(conversations, turns, system_prompts, user_tokens, output_tokens) < 1:
        raise ValueError("conversations, turns, system prompts, user tokens and output tokens must be >= 1")
    systems = [words.text(words.block(s, system_tokens, salt=f"mt-system-{seed}")).strip()
               for s in range(system_prompts)]
    bodies: list[list[dict]] = []
    for c in range(conversations):
        messages = [{"role": "system", "content": systems[c % system_prompts]}]
        turns_of_c = []
        for t in range(turns):
            user = words.text(words.filler(f"mt-user-{seed}-{c}-{t}", user_tokens)).strip()
            messages.append({"role": "user", "content": user})
            turns_of_c.append([dict(m) for m in messages])
            reply = words.text(words.filler(f"mt-reply-{seed}-{c}-{t}", reply_tokens)).strip()
            messages.append({"role": "assistant", "content": reply})
        bodies.append(turns_of_c)
    requests: list[BenchRequest] = []
    last_turn: dict[int, int] = {}
    for t in range(turns):
        order = list(range(conversations))
        random.Random(seed * 1000 + t).shuffle(order)
        for c in order:
            body = {"messages": bodies[c][t]}
            requests.append(BenchRequest(
                index=len(requests), endpoint="chat", body=body,
                prompt_token_ids=words.tokenizer.encode_chat(body), output_tokens=output_tokens,
                after=last_turn.get(c), group=f"c{c}"))
            last_turn[c] = len(requests) - 1
    return Workload("multiturn", requests, block_size, {
        "conversations": conversations, "turns": turns, "system_prompts": system_prompts,
        "system_tokens": system_tokens, "user_tokens": user_tokens, "reply_tokens": reply_tokens,
        "output_tokens": output_tokens, "seed": seed})


def scale_for_kv_pressure(make: Callable[[int], Workload], base_count: int, cluster_kv_blocks: int,
                          ratio: float) -> Workload:
    """The KV-pressure variant: ``make(count)`` with ``count`` (groups or conversations) grown
    from ``base_count`` until the workload's distinct blocks are at least ``ratio`` x
    ``cluster_kv_blocks`` (all workers' KV blocks together). Raises ValueError when ``ratio`` or
    ``cluster_kv_blocks`` is not positive."""
    if ratio <= 0 or cluster_kv_blocks <= 0:
        raise ValueError("--kv-pressure and --cluster-kv-blocks must be > 0")
    count = base_count
    workload = make(count)
    need = ratio * cluster_kv_blocks
    while (have := workload.distinct_blocks()) < need:  # shared prefixes grow slower than the count
        count = max(count + 1, math.ceil(count * need / max(1, have)))
        workload = make(count)
    workload.params["kv_pressure"] = {"ratio": ratio, "cluster_kv_blocks": cluster_kv_blocks,
                                      "distinct_blocks": workload.distinct_blocks()}
    return workload
