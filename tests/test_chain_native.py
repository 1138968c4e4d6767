"""The optional C passes of index lookups (kvcore/index/_chain_native.c): built wherever a C
compiler is, and answering as the numpy passes of kvcore.index.chain_rows and the host index's
numpy probe do, worker for worker and id for id."""
from __future__ import annotations

import random
import shutil
import sysconfig

import numpy as np
import pytest

from kvcore.index import chain_rows
from kvcore.index.base import TierMatch
from kvcore.index.chain_rows import _matches_from_runs, run_lengths
from kvcore.index.host import HostIndex
from kvcore.index.memory import MemoryIndex, run_chains, tier_matches
from test_chain_rows import random_rows
from test_index_host import Clock, store_tier_ladder

native = chain_rows.native


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def test_the_extension_is_built_where_a_c_compiler_is():
    # `pip install` builds it as optional: a broken build would silently fall back to numpy
    if _compiler() is None:
        pytest.skip("no C compiler here: the numpy passes serve")
    assert native is not None, "kvcore/index/_chain_native.c was not built: run `pip install -e .` again"
    assert chain_rows.NATIVE


needs_native = pytest.mark.skipif(native is None, reason="the C extension is not built")


@pytest.fixture
def numpy_path():
    was = chain_rows.NATIVE
    chain_rows.use_native(False)
    yield
    chain_rows.use_native(was)


def _random_rows(rng: random.Random, slots: int, n: int) -> tuple[list[int], list[int], int]:
    return random_rows(rng, slots, n, tier_sets=(1, 1, 1, 2, 4, 8, 3, 6, 9, 15))  # 15: every tier


def _as_rows(masks: list[int], words: int) -> np.ndarray:
    raw = b"".join(m.to_bytes(words * 8, "little") for m in masks)
    return np.frombuffer(raw, np.uint64).reshape(len(masks), words)


def _walk(masks: list[int], starts: list[int], end: int, names: dict[int, str]) -> dict[str, TierMatch]:
    sel = sum(1 << (4 * s) for s in names)
    drops, alive, end = run_chains(masks[0], zip(starts[1:], masks[1:]), end, sel)
    return tier_matches(drops, alive, end, names, 4)


@needs_native
@pytest.mark.parametrize("seed", range(12))
def test_row_matches_answer_as_the_numpy_passes_and_the_python_walk(seed):
    rng = random.Random(seed)
    slots = rng.choice((1, 3, 16, 17, 70, 300, 1024))
    n = rng.randint(1, 150)
    masks, starts, end = _random_rows(rng, slots, n)
    names = {s: f"w{s}" for s in range(slots) if rng.random() < 0.9}  # some slots without a worker
    rows = _as_rows(masks, -(-4 * slots // 64))
    start_arr = np.array(starts, np.int64)
    got = native.row_matches(rows, start_arr, end, names, chain_rows._splits, chain_rows._split)
    assert got == _matches_from_runs(run_lengths(rows, start_arr, end), names)
    assert got == _walk(masks, starts, end, names)
    assert list(got) == [names[s] for s in sorted(names) if names[s] in got]  # slot order, as numpy's
    runs = run_lengths(rows, start_arr, end)
    assert native.runs_matches(runs, names, chain_rows._splits, chain_rows._split) == got


@needs_native
def test_row_matches_reads_a_view_of_the_first_words_of_wider_rows():
    # the host index reads only as many words as its highest named slot needs: a strided view
    rng = random.Random(7)
    masks, starts, end = _random_rows(rng, 40, 60)
    wide = _as_rows(masks, 8)
    view = wide[:, :3]
    assert not view.flags.c_contiguous
    names = {s: f"w{s}" for s in range(40)}
    got = native.row_matches(view, np.array(starts, np.int64), end, names, chain_rows._splits, chain_rows._split)
    assert got == _walk(masks, starts, end, names)
    assert len(got) > 10


@needs_native
def test_one_tiermatch_object_per_split_and_a_ladder_of_1024_workers():
    # worker s holds blocks [0, 2s + 2) in gpu then 1 block in cpu: every split is its own
    slots, end = 1024, 2050
    starts = list(range(0, 2 * slots + 1, 2))
    masks = []
    for r, b in enumerate(starts):
        m = 0
        for s in range(slots):
            if b < 2 * s + 2:
                m |= 1 << (4 * s)
            elif b < 2 * s + 3:
                m |= 2 << (4 * s)
        masks.append(m)
    names = {s: f"w{s:04d}" for s in range(slots)}
    got = native.row_matches(_as_rows(masks, 64), np.array(starts, np.int64), end, names,
                             chain_rows._splits, chain_rows._split)
    assert got == {f"w{s:04d}": TierMatch(2 * s + 2, 2 if s < slots - 1 else end - 2 * s - 2, 0)
                   for s in range(slots)}
    again = native.row_matches(_as_rows(masks, 64), np.array(starts, np.int64), end, names,
                               chain_rows._splits, chain_rows._split)
    assert all(again[w] is got[w] for w in got)  # frozen TierMatch objects come from the cache


@needs_native
def test_bad_buffers_and_a_failing_factory_raise():
    rows = np.zeros((2, 1), np.uint64)
    rows[0, 0] = 1
    starts = np.array([0, 3], np.int64)
    names = {0: "w0"}
    with pytest.raises(ValueError, match="wrong item size"):
        native.row_matches(rows.view(np.uint32), starts, 5, names, {}, chain_rows._split)
    with pytest.raises(ValueError, match="one offset per row"):
        native.row_matches(rows, starts[:1], 5, names, {}, chain_rows._split)
    with pytest.raises(ValueError, match="end out of range"):
        native.row_matches(rows, starts, 1 << 21, names, {}, chain_rows._split)
    with pytest.raises(TypeError, match="must be dicts"):
        native.row_matches(rows, starts, 5, [None], {}, chain_rows._split)

    def broken(code: int) -> TierMatch:
        raise RuntimeError(f"no match for {code}")

    with pytest.raises(RuntimeError, match="no match for"):
        native.row_matches(rows, starts, 5, names, {}, broken)
    assert native.row_matches(rows, starts, 5, names, {}, chain_rows._split) == {"w0": TierMatch(3, 0, 0)}


def _host(tmp_path, capacity_keys: int, workers: int = 64, clock: Clock | None = None) -> HostIndex:
    idx = HostIndex(tmp_path / "index", max_keys=capacity_keys, max_workers=workers, max_holder_sets=4096,
                    clock=clock)
    assert idx.try_become_writer()
    return idx


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_probe_ids_finds_what_the_numpy_probe_finds(tmp_path, seed):
    # a nearly full table (long probe runs, wrap-around at its end), keys stored, removed, absent
    rng = random.Random(seed)
    idx = _host(tmp_path, 700)
    stored = [rng.getrandbits(64) for _ in range(690)]
    for i in range(0, len(stored), 30):
        idx.store_sync(f"w{i % 7}", ("gpu", "cpu", "ssd")[i % 3], stored[i:i + 30])
    gone = stored[::5]
    for i in range(0, len(gone), 10):
        idx.remove_sync(f"w{(i * 5) % 7}", ("gpu", "cpu", "ssd")[(i * 5) % 3], gone[i:i + 10])
    absent = [rng.getrandbits(64) for _ in range(200)] + [0, (1 << 64) - 1]
    keys = stored + absent
    rng.shuffle(keys)
    out = np.empty(len(keys), np.uint32)
    native.probe_ids(keys, idx._keys_np, idx._ids_np, 0x9E3779B97F4A7C15, out)
    want = idx._find_many(np.array(keys, np.uint64))
    assert out.tolist() == want.tolist()
    hits = int((out > 1).sum())
    assert hits == len(stored) - len(set(gone) & set(stored)) + sum(1 for k in gone if idx._find(k) >= 0)
    assert hits > 500
    with pytest.raises(OverflowError):
        native.probe_ids([-1], idx._keys_np, idx._ids_np, 0x9E3779B97F4A7C15, np.empty(1, np.uint32))
    with pytest.raises(ValueError, match="one entry per key"):
        native.probe_ids([1, 2], idx._keys_np, idx._ids_np, 0x9E3779B97F4A7C15, np.empty(1, np.uint32))
    idx.close_sync()


@needs_native
def test_host_and_memory_lookups_answer_alike_on_both_paths(tmp_path, numpy_path):
    # 300 workers, each its own prefix (gpu, then cpu, then ssd), a few with holes: the matrix
    # path of both indexes, first on numpy (the fixture), then in C
    clock = Clock()
    host = _host(tmp_path, 20_000, workers=320, clock=clock)
    mem = MemoryIndex(clock=clock)
    prompt = list(range(1, 701))
    store_tier_ladder(host, mem, clock, prompt, 300)
    assert host.counters()["dropped_keys"] == 0
    queries = [prompt, prompt[:150], prompt[5:], [999_999] + prompt]
    on_numpy = [(host.match_sync(q), mem.match_sync(q), host.gpu_holders_sync(q)) for q in queries]
    assert chain_rows.use_native(True)
    in_c = [(host.match_sync(q), mem.match_sync(q), host.gpu_holders_sync(q)) for q in queries]
    assert in_c == on_numpy
    full = in_c[0][0]
    assert full == in_c[0][1] and len(full) == 300
    assert full["w5"] == TierMatch(gpu=13, cpu=5, ssd=2) and full["w19"] == TierMatch(gpu=10)
    assert in_c[3][:2] == ({}, {}) and in_c[3][2]["w0"] == 0b1110  # positions 1-3 hold gpu blocks 1-3
    host.close_sync()


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_int_rows_walk_as_the_memory_index_python_path(seed, numpy_path, monkeypatch):
    # random int masks along a prompt, shared objects and equal copies, a hidden worker set, a
    # block with no entry: the same rows, then the same lookup on both paths
    rng = random.Random(seed)
    slots = rng.choice((130, 300))  # past slot 127 and 64 blocks: the index's wide path
    words = -(-4 * slots // 64)
    masks, starts, end = _random_rows(rng, slots, rng.randint(40, 80))
    keys, table = [], {}
    for r, m in enumerate(masks):
        stop = starts[r + 1] if r + 1 < len(starts) else end
        for _ in range(starts[r], stop):
            k = rng.getrandbits(64)
            keys.append(k)
            table[k] = m if rng.random() < 0.5 else m + 0  # the same object or an equal int
    if rng.random() < 0.5:
        keys.insert(rng.randrange(1, len(keys)), rng.getrandbits(64))  # no entry: the run ends
    hidden = sum(1 << (4 * s + t) for s in rng.sample(range(slots), slots // 4) for t in range(4)) if seed % 2 else 0
    rows, at, got_end = chain_rows.int_rows(table, keys, hidden, words)
    keep = ~hidden
    held = []
    for k in keys:
        v = table.get(k)
        if v is None or not v & keep:
            break
        held.append(v & keep)
    want_starts = [i for i in range(len(held)) if i == 0 or held[i] != held[i - 1]]
    assert at.tolist() == want_starts and got_end == (len(held) if held else 0)
    assert [int.from_bytes(r.tobytes(), "little") for r in rows] == [held[i] for i in want_starts]

    mem = MemoryIndex()
    stores: dict[tuple[int, int], list[int]] = {}
    for s in range(slots):
        assert mem._slot(f"w{s}") == s  # slots in order, so that `hidden` names the same workers
    for k, m in table.items():
        for s in range(slots):
            for t in range(4):
                if m >> (4 * s + t) & 1:
                    stores.setdefault((s, t), []).append(k)
    for (s, t), ks in sorted(stores.items()):
        if t == 3:
            mem.store_speculative_sync(f"w{s}", ks, 600.0)
        else:
            mem.store_sync(f"w{s}", ("gpu", "cpu", "ssd")[t], ks)
    on_numpy = mem.match_sync(keys, hidden=hidden)
    assert chain_rows.use_native(True)
    walks = []
    real = chain_rows.int_rows
    monkeypatch.setattr(chain_rows, "int_rows", lambda *a: walks.append(1) or real(*a))
    assert mem.match_sync(keys, hidden=hidden) == on_numpy
    assert walks == [1] and len(on_numpy) > 0


@needs_native
def test_int_rows_refuses_a_mask_wider_than_a_row_and_empty_starts():
    rows = np.zeros((2, 1), np.uint64)
    starts = np.zeros(2, np.int64)
    with pytest.raises(OverflowError):
        native.int_rows({1: 1 << 64, 2: 1}, [1, 2], 0, rows, starts)
    with pytest.raises(TypeError):
        native.int_rows({1: "x"}, [1], 0, rows, starts)
    with pytest.raises(ValueError, match="one entry per key"):
        native.int_rows({1: 1}, [1, 1, 1], 0, rows, starts)
    assert native.int_rows({1: 0b11, 2: 0b11}, [1, 2], 0b11, rows, starts) == (0, 0)  # all hidden
    assert native.int_rows({1: 0b1}, [5, 1], 0, rows, starts) == (0, 0)  # block 0 has no entry
    rows4, starts4 = np.zeros((4, 1), np.uint64), np.zeros(4, np.int64)
    assert native.int_rows({1: 0b1, 2: 0b101, 3: 0b101}, [1, 2, 3, 1], 0, rows4, starts4) == (3, 4)
    assert starts4[:3].tolist() == [0, 1, 3] and rows4[:3, 0].tolist() == [0b1, 0b101, 0b1]


@needs_native
def test_int_rows_packs_every_bit_position_of_ints_of_every_width():
    # the packing of CPython's 30-bit digits into 64-bit words: a single bit and a run of ones
    # ending at every position of a 3-word row (digit and word boundaries, the row's top bit),
    # one bit past the row, a negative int
    rows, starts = np.zeros((2, 3), np.uint64), np.zeros(2, np.int64)
    for bit in range(192):
        for v in (1 << bit, (1 << (bit + 1)) - 1, (1 << bit) | 1):
            assert native.int_rows({1: v}, [1], 0, rows, starts) == (1, 1)
            assert int.from_bytes(rows[0].tobytes(), "little") == v, (bit, hex(v))
            hidden = (1 << bit) | (1 << 191)
            want = v & ~hidden
            got = native.int_rows({1: v, 2: 1 << 191}, [1, 2], hidden, rows, starts)
            assert got == ((1, 1) if want else (0, 0)), bit
            if want:
                assert int.from_bytes(rows[0].tobytes(), "little") == want
    for v in (1 << 192, (1 << 200) - 1, -1, -(1 << 70)):
        with pytest.raises(OverflowError):
            native.int_rows({1: v}, [1], 0, rows, starts)


@needs_native
def test_a_key_list_emptied_under_the_walk_is_not_read_and_bad_views_are_refused():
    # review findings: Python code run during the walk (a hidden object's truth, a key's hash)
    # emptied the caller's list, which the walk still read; a view whose rows are 12 bytes apart
    # was read as if 8; float items passed as integers; numpy ints were refused by the probe
    keys = [10**6 + i for i in range(1000)]
    masks = {k: 1 for k in keys}

    class Hidden:
        def __bool__(self) -> bool:
            keys.clear()
            return False

    rows, starts = np.zeros((1000, 1), np.uint64), np.zeros(1000, np.int64)
    with pytest.raises(TypeError, match="hidden must be an int"):
        native.int_rows(masks, keys, Hidden(), rows, starts)
    armed = []

    class Key(int):
        def __hash__(self) -> int:
            if armed:
                del keys[1:]
            return int.__hash__(self)

        __eq__ = int.__eq__

    keys[:] = [Key(1)] + [10**6 + i for i in range(999)]
    masks = {k: 1 for k in keys}
    armed.append(True)
    assert native.int_rows(masks, keys, 0, rows, starts) == (1, 1000)  # its own copy: all 1,000 keys
    assert len(keys) == 1

    rec = np.zeros(3, dtype=[("a", "<u8", (1,)), ("pad", "<u4")])
    rec["a"][:, 0] = [0x11, 1, 1]
    with pytest.raises(ValueError, match="wrong strides"):
        native.row_matches(rec["a"], np.array([0, 4, 8], np.int64), 10, {0: "a"}, {}, chain_rows._split)
    with pytest.raises(ValueError, match="wrong item type"):
        native.row_matches(np.ones((1, 1), np.float64), np.zeros(1, np.int64), 3, {0: "a"}, {}, chain_rows._split)
    with pytest.raises(ValueError, match="out of range"):
        native.runs_matches(np.array([[0], [0], [-3]], np.int64), {0: "a"}, {}, chain_rows._split)
    with pytest.raises(TypeError, match="not subclasses"):
        native.runs_matches(np.array([[1], [1], [1]], np.int64), type("Names", (dict,), {})({0: "a"}), {},
                            chain_rows._split)

    table_keys, table_ids = np.zeros(8, np.uint64), np.zeros(8, np.uint32)
    home = (11 * 0x9E3779B97F4A7C15 % 2**64) % 8
    table_keys[home], table_ids[home] = 11, 5
    out = np.zeros(2, np.uint32)
    native.probe_ids([np.uint64(11), np.int64(12)], table_keys, table_ids, 0x9E3779B97F4A7C15, out)
    assert out.tolist() == [5, 0]
    with pytest.raises(ValueError, match="wrong alignment"):
        raw = np.zeros(8 * 8 + 4, np.uint8)
        native.probe_ids([11], raw[4:].view(np.uint64), table_ids, 0x9E3779B97F4A7C15, np.zeros(1, np.uint32))
