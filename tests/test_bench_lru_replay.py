"""lab.lru_replay: vLLM's eviction order (least recently used, a request's tail first),
replays under a placement, the static placement search; and benchmarks/bench_lru_placement.py
as a script."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.block_keys import block_keys
from lab.lru_replay import LRUPrefixCache, best_static_placement, longest_prefix_replay, replay

BS = 4
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lru_placement.py"


def _prompt(tag: int, blocks: int) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * BS)] + [7]  # full blocks and one more token


def test_eviction_takes_the_least_recent_request_and_its_tail_first():
    a, b = block_keys(_prompt(1, 3), BS, "bench"), block_keys(_prompt(2, 3), BS, "bench")
    cache = LRUPrefixCache(4)
    cache.run(a)
    assert cache.cached_blocks(a, 3) == 3 and cache.cached_blocks(a, 2) == 2
    cache.run(b)  # 6 blocks for 4 places: a's last two go, its first block stays
    assert len(cache) == 4
    assert cache.cached_blocks(a, 3) == 1 and a[0] in cache and a[2] not in cache
    assert cache.cached_blocks(b, 3) == 3
    with pytest.raises(ValueError):
        LRUPrefixCache(-1)


def test_replay_counts_vllms_capped_hits_per_worker():
    first, again = _prompt(1, 3), _prompt(1, 3)
    exact = [i for i in range(3 * BS)]  # a prompt of whole blocks: its last block is computed again
    r = replay([first, again, exact, exact], BS, 10, [0, 0, 1, 1])
    assert r.cached_tokens == [0, 3 * BS, 0, 2 * BS]
    assert r.uncached_tokens == [len(first), 1, 3 * BS, BS]
    assert r.hit_rate == pytest.approx(5 * BS / (2 * len(first) + 6 * BS))
    assert replay([first, again], BS, 10, [0, 1]).cached_tokens == [0, 0]  # another worker's cache
    # longest prefix: misses alternate, a repeat goes back to its holder
    other = _prompt(2, 3)
    lp = longest_prefix_replay([first, other, again, other], BS, 10, 2)
    assert lp.cached_tokens == [0, 0, 3 * BS, 3 * BS]
    assert lp.cached_tokens == replay([first, other, again, other], BS, 10, [0, 1, 0, 1]).cached_tokens
    with pytest.raises(ValueError):
        longest_prefix_replay([first], BS, 10, 0)
    assert r.median_uncached_tokens == pytest.approx((BS + 3 * BS) / 2)
    with pytest.raises(ValueError):
        replay([first], BS, 10, [0, 1])
    with pytest.raises(ValueError):
        replay([first], 0, 10, [0])


def test_generated_blocks_take_room_no_prompt_matches():
    a, b = _prompt(1, 2), _prompt(2, 2)  # 2 full blocks + 1 token each
    # 4 places: without output both prompts fit and a hits again; 8 generated tokens fill 2 more
    # blocks per request, so a's blocks are gone by its second turn
    assert replay([a, b, a], BS, 4, [0, 0, 0]).cached_tokens == [0, 0, 2 * BS]
    assert replay([a, b, a], BS, 4, [0, 0, 0], output_tokens=8).cached_tokens == [0, 0, 0]


def test_a_protected_split_beats_alternating_when_conversations_cycle():
    """Four conversations of 3 blocks, sent round by round, 2 workers of 3 blocks: two
    conversations per worker thrash (each evicts the other before it comes back), while one
    conversation alone on a worker keeps all of its blocks: the search finds that split."""
    convs = [_prompt(c, 3) for c in range(4)]
    prompts = [convs[c] for _ in range(3) for c in range(4)]
    groups = [f"c{c}" for _ in range(3) for c in range(4)]
    alternating = replay(prompts, BS, 3, [int(g[1]) % 2 for g in groups])
    best, assignment = best_static_placement(prompts, groups, BS, 3, 2, tries=50)
    assert alternating.cached_tokens == [0] * 12
    assert sorted(best.cached_tokens) == [0] * 10 + [3 * BS] * 2  # the lone one's two later turns
    assert sorted(sum(1 for w in assignment.values() if w == k) for k in range(2)) == [1, 3]
    with pytest.raises(ValueError):
        best_static_placement(prompts, groups, BS, 3, 0)
    with pytest.raises(ValueError):
        best_static_placement(prompts, groups[:-1], BS, 3, 2)
    empty, nothing = best_static_placement([], [], BS, 3, 2, tries=3)
    assert (empty.hit_rate, empty.cached_tokens, nothing) == (0.0, [], {})


def test_the_script_prints_every_placement_and_the_bounds(tiny_model, tmp_path):
    out = tmp_path / "lru.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--tokenizer", str(tiny_model), "--conversations", "6",
                        "--turns", "3", "--system-tokens", "200", "--blocks-per-worker", "20", "--tries", "20",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("18 requests, 2 workers x 20 blocks of 32 tokens")
    names = [line[:22].strip() for line in lines[2:]]
    assert names[:2] == ["round robin", "longest prefix"] and names[2].startswith("best static ")
    assert names[3:] == ["ideal (no eviction)", "Belady, all blocks"]
    assert float(lines[2].split()[-1]) == 1.0  # round robin against itself
    rates = {name: float(line[22:].split()[0]) for name, line in zip(names, lines[2:])}
    assert rates["round robin"] <= rates[names[2]] <= rates["ideal (no eviction)"]
    saved = json.loads(out.read_text())
    assert [row["placement"] for row in saved["tables"]["placements"]] == names[:3]
    assert saved["tables"]["placements"][0]["hit_rate"] == pytest.approx(rates["round robin"], abs=1e-3)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--tokenizer", str(tiny_model), "--workers", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--workers" in bad.stderr
