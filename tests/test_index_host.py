"""The host index (kvcore.index.host): the same answers as the in-process index for the same
writes, readers in other processes, a writer that dies (mid-change too), eviction, bounds."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcore.index.base import TierMatch
from kvcore.index.host import HostIndex, layout_bytes
from kvcore.index.memory import MemoryIndex

TIERS = ("gpu", "cpu", "ssd")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _writer(path, **kw) -> HostIndex:
    idx = HostIndex(path, **kw)
    assert idx.try_become_writer()
    return idx


def store_tier_ladder(host: HostIndex, mem: MemoryIndex, clock: Clock, prompt: list[int], workers: int) -> None:
    """Worker ``w`` holds ``prompt``'s first 2w + 3 blocks in gpu, the next w % 7 in cpu and the
    next w % 3 in ssd; every tenth worker lost block 10 (a hole). The same writes to both indexes
    (the clock moves a second per worker: freed holder sets come back after their quarantine)."""
    for w in range(workers):
        clock.now += 1.0
        g, c, s = 2 * w + 3, w % 7, w % 3
        for tier, keys in (("gpu", prompt[:g]), ("cpu", prompt[g:g + c]), ("ssd", prompt[g + c:g + c + s])):
            host.store_sync(f"w{w}", tier, keys)
            mem.store_sync(f"w{w}", tier, keys)
        if w % 10 == 9:  # a hole: the block after the tenth is gone
            assert host.remove_sync(f"w{w}", "gpu", [prompt[10]]) == mem.remove_sync(f"w{w}", "gpu", [prompt[10]])


def _same(host: HostIndex, mem: MemoryIndex, prompts) -> None:
    for p in prompts:
        assert host.match_sync(p) == mem.match_sync(p), p
        assert host.gpu_holders_sync(p) == mem.gpu_holders_sync(p), p
    h = {w: (s.blocks, s.speculative_blocks) for w, s in host.stats_sync().items()
         if any(s.blocks.values()) or s.speculative_blocks}
    m = {w: (s.blocks, s.speculative_blocks) for w, s in mem.stats_sync().items()
         if any(s.blocks.values()) or s.speculative_blocks}
    assert h == m


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_writes_answer_as_the_memory_index(tmp_path, seed):
    rng = random.Random(seed)
    clock = Clock()
    host = _writer(tmp_path / "index", max_keys=5_000, max_workers=16, max_holder_sets=4_096, clock=clock)
    mem = MemoryIndex(clock=clock)
    workers = [f"w{i}" for i in range(6)]
    universe = [rng.getrandbits(64) for _ in range(300)]
    chains = [universe[i:i + 40] for i in range(0, 300, 20)]
    for step in range(600):
        op = rng.random()
        w = rng.choice(workers)
        tier = rng.choice(TIERS)
        chain = rng.choice(chains)
        keys = chain[:rng.randint(1, len(chain))]
        if op < 0.45:
            host.store_sync(w, tier, keys)
            mem.store_sync(w, tier, keys)
        elif op < 0.8:
            assert host.remove_sync(w, tier, keys) == mem.remove_sync(w, tier, keys)
        elif op < 0.86:
            t = rng.choice((None, tier))
            host.clear_worker_sync(w, t)
            mem.clear_worker_sync(w, t)
        elif op < 0.95:
            host.store_speculative_sync(w, keys, 5.0)
            mem.store_speculative_sync(w, keys, 5.0)
        else:
            clock.now += 3.0
        if step % 25 == 0:
            _same(host, mem, chains + [universe[:2], [universe[5]]])
    _same(host, mem, chains)
    assert len(host) == len(set().union(*(set(mem.owned_keys(w, t)) for w in workers for t in TIERS)))


def test_a_block_held_by_many_workers_costs_one_entry(tmp_path):
    host = _writer(tmp_path / "index", max_keys=10_000, max_workers=64, max_holder_sets=4096)
    prompt = list(range(1, 2049))
    for w in range(48):
        host.store_sync(f"w{w}", "gpu", prompt[:(w + 1) * 40])
    assert len(host) == 48 * 40
    got = host.match_sync(prompt)
    assert got == {f"w{w}": TierMatch(gpu=(w + 1) * 40) for w in range(48)}
    assert host.counters()["holder_sets"] == 48  # one set per prefix length, not per key


def test_dropping_speculative_entries_leaves_the_shared_entries(tmp_path):
    host = _writer(tmp_path / "index", max_keys=1000, max_workers=8, max_holder_sets=64)
    prompt = list(range(1, 9))
    host.store_sync("a", "gpu", prompt[:2])
    host.store_speculative_sync("a", prompt[:6], 5.0)
    host.store_speculative_sync("b", prompt[:4], 5.0)
    assert host.match_sync(prompt) == {"a": TierMatch(gpu=6), "b": TierMatch(gpu=4)}
    asyncio.run(host.drop_speculative("a", prompt[:6]))
    assert host.match_sync(prompt) == {"a": TierMatch(gpu=2), "b": TierMatch(gpu=4)}


def test_a_prompt_that_changes_holders_at_every_block_answers_as_the_memory_index(tmp_path):
    # 100 workers, each a different prefix (gpu, then cpu, then ssd), a few with a hole: the
    # lookup reads the holder sets as one matrix (kvcore.index.chain_rows); with a speculative
    # entry of this process it walks them one int at a time: the same answers either way
    clock = Clock()  # freed holder sets come back after their quarantine
    host = _writer(tmp_path / "index", max_keys=20_000, max_workers=128, max_holder_sets=8192, clock=clock)
    mem = MemoryIndex(clock=clock)
    prompt = list(range(1, 301))
    store_tier_ladder(host, mem, clock, prompt, 100)
    assert host.counters()["dropped_keys"] == 0
    got = host.match_sync(prompt)
    assert got == mem.match_sync(prompt)
    assert got["w5"] == TierMatch(gpu=13, cpu=5, ssd=2)
    assert got["w19"] == TierMatch(gpu=10)
    assert host.match_sync(prompt[:150]) == mem.match_sync(prompt[:150])
    host.store_speculative_sync("w0", prompt[:50], 60.0)
    mem.store_speculative_sync("w0", prompt[:50], 60.0)
    spec = host.match_sync(prompt)
    assert spec == mem.match_sync(prompt)
    assert spec["w0"] == TierMatch(gpu=50) and {w: m for w, m in spec.items() if w != "w0"} == {
        w: m for w, m in got.items() if w != "w0"}


def test_many_workers_on_a_few_prefixes_answer_as_the_memory_index(tmp_path):
    # 140 workers (9 words of slots: the matrix path) and three holder changes
    clock = Clock()
    host = _writer(tmp_path / "index", max_keys=1_000, max_workers=160, max_holder_sets=64, clock=clock)
    mem = MemoryIndex(clock=clock)
    prompt = list(range(1, 101))
    for w in range(140):
        clock.now += 1.0  # the sets this worker's stores free are reusable for the next
        for index in (host, mem):
            index.store_sync(f"w{w}", "gpu", prompt[:50])
            if w % 7 == 0:
                index.store_sync(f"w{w}", "cpu", prompt[50:60])
            if w == 139:
                index.store_sync(f"w{w}", "ssd", prompt[50:90])
    assert host.counters()["dropped_keys"] == 0
    got = host.match_sync(prompt)
    assert got == mem.match_sync(prompt)
    assert len(got) == 140 and got["w1"] == TierMatch(gpu=50)
    assert got["w7"] == TierMatch(gpu=50, cpu=10) and got["w139"] == TierMatch(gpu=50, ssd=40)


def test_a_prompt_in_cpu_or_ssd_only_past_112_slots(tmp_path):
    # 8 words of named slots take the matrix path even for one block; no row holds gpu
    host = _writer(tmp_path / "index", max_keys=1_000, max_workers=160, max_holder_sets=256)
    for w in range(120):
        host.store_sync(f"w{w}", "gpu", [10_000 + w])
    host.store_sync("w119", "cpu", [1])
    host.store_sync("w5", "ssd", [1, 2])
    assert host.match_sync([1]) == {"w119": TierMatch(cpu=1), "w5": TierMatch(ssd=1)}
    assert host.match_sync([1, 2]) == {"w119": TierMatch(cpu=1), "w5": TierMatch(ssd=2)}
    assert host.match_sync([2]) == {"w5": TierMatch(ssd=1)}


def test_duplicate_copies_stay_until_the_last_removal(tmp_path):
    host = _writer(tmp_path / "index", max_keys=100, max_workers=4, max_holder_sets=16)
    host.store_sync("a", "gpu", [7, 8])
    host.store_sync("a", "gpu", [7])
    assert host.remove_sync("a", "gpu", [7, 8]) == 0
    assert host.match_sync([7]) == {"a": TierMatch(gpu=1)}
    assert host.remove_sync("a", "gpu", [7, 8]) == 1
    assert host.match_sync([7]) == {}
    assert len(host) == 0


def test_eviction_keeps_the_bound_spares_new_keys_and_takes_ssd_keys_first(tmp_path):
    host = _writer(tmp_path / "index", max_keys=100, max_workers=4, max_holder_sets=16)
    host.store_sync("a", "gpu", list(range(1, 21)))
    host.store_sync("a", "ssd", list(range(1000, 1080)))
    assert len(host) == 100
    host.store_sync("b", "gpu", list(range(5000, 5030)))
    assert (len(host), host.counters()["evicted_keys"]) == (100, 30)
    assert host.match_sync(list(range(1, 21))) == {"a": TierMatch(gpu=20)}  # gpu keys kept
    assert host.match_sync(list(range(5000, 5030))) == {"b": TierMatch(gpu=30)}
    assert host.stats_sync()["a"].blocks == {"gpu": 20, "cpu": 0, "ssd": 50}
    host.store_sync("c", "gpu", list(range(9000, 9050)))
    assert len(host) == 100 and host.counters()["evicted_keys"] == 80
    assert host.match_sync(list(range(9000, 9050))) == {"c": TierMatch(gpu=50)}  # just stored: kept
    blocks = {w: s.blocks for w, s in host.stats_sync().items()}
    assert sum(sum(b.values()) for b in blocks.values()) == 100
    assert blocks["a"]["ssd"] <= 10  # of the 50 evicted, 40 or more were ssd keys
    host.store_sync("d", "gpu", list(range(7000, 7100)))  # a whole table of new keys
    assert len(host) == 100 and host.counters()["evicted_keys"] == 180


def test_no_free_holder_set_drops_the_key_and_a_freed_set_waits_out_its_quarantine(tmp_path):
    clock = Clock()
    host = _writer(tmp_path / "index", max_keys=100, max_workers=8, max_holder_sets=4, clock=clock)  # sets 2, 3
    host.store_sync("a", "gpu", [1, 2])
    host.store_sync("b", "gpu", [3])
    host.store_sync("c", "gpu", [4])  # a third set: none free
    assert host.counters()["dropped_keys"] == 1
    assert host.match_sync([4]) == {}
    host.remove_sync("b", "gpu", [3])  # frees b's set: a reader may still be reading it
    host.store_sync("c", "gpu", [4])
    assert host.match_sync([4]) == {} and host.counters()["dropped_keys"] == 2
    clock.now += 0.6
    host.store_sync("c", "gpu", [4])
    assert host.match_sync([4]) == {"c": TierMatch(gpu=1)}


def test_other_bounds_or_another_file_are_refused(tmp_path):
    HostIndex(tmp_path / "index", max_keys=100, max_workers=4, max_holder_sets=16).close_sync()
    with pytest.raises(ValueError, match="max_keys=100, max_workers=4"):
        HostIndex(tmp_path / "index", max_keys=200, max_workers=4, max_holder_sets=16)
    (tmp_path / "junk").write_bytes(b"x" * 8192)
    with pytest.raises(ValueError, match="not a layout"):
        HostIndex(tmp_path / "junk", max_keys=100, max_workers=4, max_holder_sets=16)
    host = _writer(tmp_path / "small", max_keys=100, max_workers=2, max_holder_sets=16)
    host.store_sync("a", "gpu", [1])
    host.store_sync("b", "gpu", [1])
    with pytest.raises(ValueError, match="all 2 worker slots"):
        host.store_sync("c", "gpu", [1])
    assert layout_bytes(100, 2, 16)["total"] == os.path.getsize(tmp_path / "small")


# ---- processes ---------------------------------------------------------------------------------
KW = dict(max_keys=50_000, max_workers=8, max_holder_sets=1024)


def _writer_proc(path, ready, progress, stop_after):
    """Store prompts of 50 keys in turn ('w<i % 4>', gpu), writing how many calls completed."""
    idx = HostIndex(path, **KW)
    assert idx.try_become_writer()
    ready.set()
    i = 0
    while stop_after is None or i < stop_after:
        idx.store_sync(f"w{i % 4}", "gpu", list(range(i * 50 + 1, i * 50 + 51)))
        i += 1
        progress.value = i
    time.sleep(60)


def _wait(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_reader_process_sees_the_writer_and_a_restarted_reader_too(tmp_path):
    ctx = mp.get_context("spawn")
    ready, progress = ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=_writer_proc, args=(tmp_path / "index", ready, progress, 20), daemon=True)
    proc.start()
    try:
        assert ready.wait(30)
        _wait(lambda: progress.value == 20)
        reader = HostIndex(tmp_path / "index", **KW)
        assert not reader.try_become_writer()  # the live writer holds it
        assert reader.match_sync(list(range(51, 101))) == {"w1": TierMatch(gpu=50)}
        assert len(reader) == 1000
        reader.close_sync()
        again = HostIndex(tmp_path / "index", **KW)  # a restarted reader: nothing to rebuild
        assert again.match_sync(list(range(951, 1001))) == {"w3": TierMatch(gpu=50)}
        assert again.stats_sync()["w0"].blocks["gpu"] == 250
        again.close_sync()
    finally:
        proc.kill()
        proc.join(10)


def test_a_writer_killed_mid_change_is_taken_over_and_repaired(tmp_path):
    ctx = mp.get_context("spawn")
    ready, progress = ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=_writer_proc, args=(tmp_path / "index", ready, progress, None), daemon=True)
    proc.start()
    reader = HostIndex(tmp_path / "index", **KW)
    try:
        assert ready.wait(30)
        _wait(lambda: progress.value >= 300)
        os.kill(proc.pid, signal.SIGKILL)  # most likely inside a store (the loop does nothing else)
        proc.join(10)
        done = progress.value
        # lookups go on from what the dead writer left, without waiting on it
        assert reader.match_sync(list(range(51, 101))) == {"w1": TierMatch(gpu=50)}
        assert reader.try_become_writer()
        c = reader.counters()
        assert c["takeovers"] == 2
        whole = done * 50
        assert whole <= len(reader) <= whole + 50  # the call in flight may have stored part of its keys
        for i in range(done):
            assert reader.match_sync(list(range(i * 50 + 1, i * 50 + 51))) == {f"w{i % 4}": TierMatch(gpu=50)}
        # the new writer goes on: stores, removals, clears all apply to the taken-over state
        reader.store_sync("w9", "cpu", list(range(1, 51)))
        assert reader.match_sync(list(range(1, 51))) == {"w0": TierMatch(gpu=50), "w9": TierMatch(cpu=50)}
        reader.clear_worker_sync("w0")
        assert reader.match_sync(list(range(1, 51))) == {"w9": TierMatch(cpu=50)}
        assert reader.remove_sync("w1", "gpu", list(range(51, 101))) == 0
        assert reader.match_sync(list(range(51, 101))) == {}
        left = sum(sum(s.blocks.values()) for s in reader.stats_sync().values())
        assert left == len(reader) - 0  # one holder per key here: counts rebuilt from the table
    finally:
        if proc.is_alive():
            proc.kill()
        reader.close_sync()


def test_a_deletion_cut_short_mid_shift_is_repaired_by_the_next_writer(tmp_path):
    """A writer that died after a deletion's shift copied a key back but before it cleared the
    old slot leaves the key twice and the sequence number odd; the next writer keeps one copy."""
    path = tmp_path / "index"
    old = _writer(path, max_keys=8, max_workers=4, max_holder_sets=16)
    home = old._home
    keys, seen = [], {}
    for k in range(1, 10_000):  # two keys with the same home slot, then a third after them
        h = home(k)
        if h in seen and not keys:
            keys = [seen[h], k]
        seen.setdefault(h, k)
        if keys:
            break
    old.store_sync("a", "gpu", keys)
    first = old._find(keys[0])
    second = old._find(keys[1])
    assert second == (first + 1) % old.capacity
    old._begin()  # the dead writer's deletion of keys[0]: the shift's copy, then nothing
    old._keys[first] = old._keys[second]
    old._ids[first] = old._ids[second]
    old.close_sync()
    new = HostIndex(path, max_keys=8, max_workers=4, max_holder_sets=16)
    assert new.match_sync([keys[1]]) == {"a": TierMatch(gpu=1)}  # the state left: still answers
    assert new.try_become_writer()
    assert len(new) == 1 and new.stats_sync()["a"].blocks["gpu"] == 1
    assert new.match_sync([keys[0]]) == {}
    assert new.remove_sync("a", "gpu", [keys[1]]) == 0
    assert new.match_sync([keys[1]]) == {} and len(new) == 0


def test_no_room_for_the_file_refuses_at_start(tmp_path):
    """Pages are reserved at creation: a filesystem without room (here a 1 MiB file-size limit)
    refuses with a clear error instead of a SIGBUS when the table fills later."""
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "from kvcore.index.host import HostIndex\n"
        "try:\n"
        "    HostIndex(sys.argv[1], max_keys=1_000_000, max_workers=64, max_holder_sets=1024)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "index")], capture_output=True,
                         text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert "cannot reserve 18 MiB there" in run.stdout and "--shm-size" in run.stdout, run.stdout + run.stderr
    assert os.path.getsize(tmp_path / "index") == 0  # nothing half-made for the next process
