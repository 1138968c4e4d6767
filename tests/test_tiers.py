"""Unit tests of the CPU/SSD tiers: tier keys, the SSD file format, the planner's LRU and limits,
and the worker-side store (real files in a temp folder; no vLLM)."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from offload_agent.connector.config import TierSettings, kv_transfer_config, vllm_env
from offload_agent.tiers import (HEADER_BYTES, CorruptBlockError, TierFingerprint, TierPlanner, TierStore,
                                 read_block_file, scan_fingerprint_dir, tier_block_keys, tier_root,
                                 write_block_file)
from offload_agent.tiers.ops import DropSsd, FailBlock, LoadCpu, LoadPeer, LoadSsd, Promote, Save, Spill
from offload_agent.tiers.ssd_file import CHECKSUM_CRC32, block_path

FP = TierFingerprint(model="m", num_layers=2, dtype="bfloat16", block_size=4, block_bytes=64, layout="1x8")
FPD = FP.digest()


def keys_of(tokens, salt=None, fp=FP):
    return tier_block_keys(tokens, 4, tier_root(fp.digest(), salt))


# ---- keys -------------------------------------------------------------------------------------------
def test_keys_chain_and_partial_block():
    toks = list(range(10))
    k = keys_of(toks)
    assert len(k) == 2 and all(len(x) == 16 for x in k)      # the partial third block has no key
    assert keys_of(toks[:8]) == k
    assert tier_block_keys(toks, 4, tier_root(FPD), start=1, parent=k[0]) == k[1:]
    other = keys_of([0, 1, 2, 3, 9, 9, 9, 9])
    assert other[0] == k[0] and other[1] != k[1]             # a key covers its whole prefix


def test_keys_depend_on_salt_and_fingerprint():
    toks = list(range(8))
    assert keys_of(toks, "s")[0] != keys_of(toks)[0]
    fp2 = TierFingerprint(model="m", num_layers=3, dtype="bfloat16", block_size=4, block_bytes=96, layout="1x8")
    assert keys_of(toks, fp=fp2)[0] != keys_of(toks)[0]
    assert fp2.dir_name() != FP.dir_name()
    with pytest.raises(ValueError):
        tier_block_keys(toks, 4, tier_root(FPD), start=1)
    with pytest.raises(ValueError):
        tier_block_keys([-1, 0, 0, 0], 4, tier_root(FPD))


# ---- SSD file format --------------------------------------------------------------------------------
def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(64))


def test_ssd_file_roundtrip_and_atomic_names(tmp_path):
    key = keys_of(range(4))[0]
    n = write_block_file(tmp_path, key, FPD, payload(1))
    assert n == HEADER_BYTES + 64
    path = block_path(tmp_path, key)
    assert path.stat().st_size == n
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    out = bytearray(64)
    read_block_file(tmp_path, key, FPD, out)
    assert bytes(out) == payload(1)


@pytest.mark.parametrize("damage, message", [
    ("flip", "checksum mismatch"), ("truncate", r"truncated \(30 of 64 payload bytes\)"),
    ("extend", "longer than its header says"), ("header", "not a kvroute block file"),
    ("version", "version 7"), ("short_header", r"truncated header \(10 of 64 bytes\)"),
    ("empty", r"truncated header \(0 of 64 bytes\)"), ("size_field", "payload of 65 bytes, expected 64"),
    ("checksum_field", "checksum mismatch")])
def test_ssd_file_damage_is_detected(tmp_path, damage, message):
    key = keys_of(range(4))[0]
    write_block_file(tmp_path, key, FPD, payload(2), algo=CHECKSUM_CRC32)
    path = block_path(tmp_path, key)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[HEADER_BYTES + 10] ^= 0x01
    elif damage == "truncate":
        raw = raw[:HEADER_BYTES + 30]
    elif damage == "extend":
        raw += b"x"
    elif damage == "header":
        raw[0:4] = b"XXXX"
    elif damage == "version":
        raw[4:6] = (7).to_bytes(2, "little")
    elif damage == "short_header":
        raw = raw[:10]
    elif damage == "empty":
        raw = bytearray()
    elif damage == "size_field":
        raw[40:48] = (65).to_bytes(8, "little")          # the header claims one more payload byte
    else:
        raw[48] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlockError, match=message):
        read_block_file(tmp_path, key, FPD, bytearray(64))


def test_ssd_file_read_checks_the_expected_size_and_checksum_algorithm(tmp_path, monkeypatch):
    from offload_agent.tiers import ssd_file
    k0, k1 = keys_of(range(8))
    write_block_file(tmp_path, k0, FPD, payload(4), algo=CHECKSUM_CRC32)
    with pytest.raises(CorruptBlockError, match="payload of 64 bytes, expected 32"):
        read_block_file(tmp_path, k0, FPD, bytearray(32))   # a caller expecting another block size
    with pytest.raises(FileNotFoundError):
        read_block_file(tmp_path, k1, FPD, bytearray(64))
    write_block_file(tmp_path, k1, FPD, payload(5), algo=ssd_file.CHECKSUM_XXH3_64 if ssd_file._xxhash else 99)
    monkeypatch.setattr(ssd_file, "_xxhash", None)          # vLLM's interpreter without xxhash
    with pytest.raises(CorruptBlockError, match="not available here"):
        read_block_file(tmp_path, k1, FPD, bytearray(64))
    out = bytearray(64)
    read_block_file(tmp_path, k0, FPD, out)                 # crc32 files need only zlib
    assert bytes(out) == payload(4) and ssd_file.default_checksum_algo() == CHECKSUM_CRC32


def test_ssd_file_read_goes_on_after_short_reads_into_a_slot_view(tmp_path, monkeypatch):
    key = keys_of(range(4))[0]
    write_block_file(tmp_path, key, FPD, payload(6))
    real_readv, calls = os.readv, []

    def readv_7_bytes(fd, bufs):                            # at most 7 bytes a call, like a slow pipe
        calls.append(sum(memoryview(b).nbytes for b in bufs))
        rest, out = 7, []
        for b in bufs:
            b = memoryview(b)[:rest]
            rest -= b.nbytes
            if b.nbytes:
                out.append(b)
        return real_readv(fd, out)

    monkeypatch.setattr(os, "readv", readv_7_bytes)
    slab = bytearray(3 * 64)
    read_block_file(tmp_path, key, FPD, memoryview(slab)[64:128])
    assert bytes(slab[64:128]) == payload(6) and slab[:64] == bytes(64) and slab[128:] == bytes(64)
    assert len(calls) == -(-(HEADER_BYTES + 64) // 7) and calls[0] == HEADER_BYTES + 64
    path = block_path(tmp_path, key)
    path.write_bytes(path.read_bytes()[:HEADER_BYTES + 20])
    with pytest.raises(CorruptBlockError, match=r"truncated \(20 of 64 payload bytes\)"):
        read_block_file(tmp_path, key, FPD, bytearray(64))


def test_ssd_file_large_payload_is_read_after_its_header(tmp_path, monkeypatch):
    from offload_agent.tiers import ssd_file
    key = keys_of(range(4))[0]
    write_block_file(tmp_path, key, FPD, payload(7))
    real_readv, calls = os.readv, []

    def readv(fd, bufs):
        calls.append([memoryview(b).nbytes for b in bufs])
        return real_readv(fd, bufs)

    monkeypatch.setattr(os, "readv", readv)
    out = bytearray(64)
    read_block_file(tmp_path, key, FPD, out)                # small: header and payload in one call
    assert calls == [[HEADER_BYTES, 64]] and bytes(out) == payload(7)
    monkeypatch.setattr(ssd_file, "SPLIT_READ_BYTES", 64)   # large: the header, then the payload
    calls.clear()
    out = bytearray(64)
    read_block_file(tmp_path, key, FPD, out)
    assert calls == [[HEADER_BYTES], [64]] and bytes(out) == payload(7)
    path = block_path(tmp_path, key)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        read_block_file(tmp_path, key, FPD, bytearray(64))


def test_prefetch_block_files_skips_missing_files(tmp_path, monkeypatch):
    from offload_agent.tiers import ssd_file
    k0, k1 = keys_of(range(8))
    write_block_file(tmp_path, k0, FPD, payload(1))
    advised = []
    monkeypatch.setattr(ssd_file, "_fadvise", lambda fd, off, n, advice: advised.append((os.fstat(fd).st_size, advice)))
    ssd_file.prefetch_block_files(tmp_path, [k1, k0, k1])   # k1 has no file
    assert advised == [(HEADER_BYTES + 64, os.POSIX_FADV_WILLNEED)]
    monkeypatch.setattr(ssd_file, "_fadvise", None)         # no posix_fadvise (macOS): nothing to do
    ssd_file.prefetch_block_files(tmp_path, [k0])
    assert len(advised) == 1


def test_ssd_file_wrong_fingerprint_or_key_is_refused(tmp_path):
    k0, k1 = keys_of(range(8))
    write_block_file(tmp_path, k0, FPD, payload(3))
    fp2 = TierFingerprint(model="other", num_layers=2, dtype="bfloat16", block_size=4, block_bytes=64)
    with pytest.raises(CorruptBlockError, match="fingerprint"):
        read_block_file(tmp_path, k0, fp2.digest(), bytearray(64))
    block_path(tmp_path, k1).parent.mkdir(parents=True, exist_ok=True)
    os.replace(block_path(tmp_path, k0), block_path(tmp_path, k1))    # a file under another key's name
    with pytest.raises(CorruptBlockError, match="holds key"):
        read_block_file(tmp_path, k1, FPD, bytearray(64))


def test_scan_rebuilds_index_and_ignores_foreign_and_broken_files(tmp_path):
    keys = keys_of(range(16))
    for i, k in enumerate(keys):
        write_block_file(tmp_path, k, FPD, payload(i))
    fp2 = TierFingerprint(model="other", num_layers=2, dtype="bfloat16", block_size=4, block_bytes=64)
    foreign = keys_of(range(4), fp=fp2)[0]
    write_block_file(tmp_path, foreign, fp2.digest(), payload(9))       # same folder, other fingerprint
    write_block_file(tmp_path, b"\x01" * 16, FPD, bytes(32))           # wrong payload size
    trunc = block_path(tmp_path, keys[3])
    trunc.write_bytes(trunc.read_bytes()[:100])                        # truncated
    (trunc.parent / ".dead.123.tmp").write_bytes(b"half")              # crash leftover
    found = {i.key for i in scan_fingerprint_dir(tmp_path, FPD, 64)}
    assert found == {keys[0], keys[1], keys[2]}
    assert not (trunc.parent / ".dead.123.tmp").exists()
    assert block_path(tmp_path, foreign).exists()                      # never deleted


# ---- planner ----------------------------------------------------------------------------------------
def test_planner_saves_then_serves_from_cpu_with_events():
    pl = TierPlanner(cpu_slots=4, ssd_slots=0)
    ks = keys_of(range(12))
    ops = []
    for b, k in enumerate(ks):
        ops += pl.plan_save(k, gpu_block=10 + b, engine_hash=100 + b)
    assert ops == [Save(0, ks[0], 10), Save(1, ks[1], 11), Save(2, ks[2], 12)]
    assert pl.plan_save(ks[0], 99, 100) == []                          # already held
    assert pl.lookup(ks) == ["cpu"] * 3
    load, tiers = pl.plan_load(ks, [20, 21, 22])
    assert tiers == ["cpu"] * 3 and load == [LoadCpu(0, ks[0], 20), LoadCpu(1, ks[1], 21), LoadCpu(2, ks[2], 22)]
    ch = pl.take_changes()
    assert [(c.op, c.tier, c.engine_hash) for c in ch] == [("stored", "cpu", 100), ("stored", "cpu", 101),
                                                          ("stored", "cpu", 102)]


def test_planner_cpu_limit_and_lru_evicts_chain_tail_first():
    pl = TierPlanner(cpu_slots=3, ssd_slots=0)
    a = keys_of(range(12))                       # chain of 3
    b = keys_of(range(100, 108))                 # chain of 2
    for i, k in enumerate(a):
        pl.plan_save(k, i, 10 + i)
    pl.touch_chain(a)
    pl.take_changes()
    ops = []
    for i, k in enumerate(b):
        ops += pl.plan_save(k, 50 + i, 20 + i)
    assert pl.counts() == {"cpu": 3, "ssd": 0}
    assert pl.lookup(a) == ["cpu"]               # a's tail (blocks 2, 1) went first
    ch = [(c.op, c.engine_hash) for c in pl.take_changes()]
    assert ch == [("removed", 12), ("stored", 20), ("removed", 11), ("stored", 21)]
    assert [type(o) for o in ops] == [Save, Save] and sorted(o.slot for o in ops) == [1, 2]


def test_planner_spills_to_ssd_and_promotes_on_hit():
    pl = TierPlanner(cpu_slots=2, ssd_slots=3)
    ks = keys_of(range(16))                      # 4 blocks
    ops = []
    for i, k in enumerate(ks):
        ops += pl.plan_save(k, i, 100 + i)
        pl.touch_chain(ks[:i + 1])
    # each save past the 2 slots spills the chain's tail (the head is touched last: most recent)
    assert ops == [Save(0, ks[0], 0), Save(1, ks[1], 1), Spill(1, ks[1]), Save(1, ks[2], 2),
                   Spill(1, ks[2]), Save(1, ks[3], 3)]
    assert pl.counts() == {"cpu": 2, "ssd": 2}
    assert pl.lookup(ks) == ["cpu", "ssd", "ssd", "cpu"]
    assert [(c.op, c.tier, c.engine_hash) for c in pl.take_changes()] == [
        ("stored", "cpu", 100), ("stored", "cpu", 101), ("stored", "ssd", 101), ("removed", "cpu", 101),
        ("stored", "cpu", 102), ("stored", "ssd", 102), ("removed", "cpu", 102), ("stored", "cpu", 103)]
    # the whole chain: both slots hold blocks of this load, so the SSD blocks are read straight
    load, tiers = pl.plan_load(ks, [40, 41, 42, 43])
    assert tiers == ["cpu", "ssd", "ssd", "cpu"]
    assert load == [LoadCpu(0, ks[0], 40), LoadSsd(ks[1], 41), LoadSsd(ks[2], 42), LoadCpu(1, ks[3], 43)]
    assert pl.take_changes() == [] and pl.counts() == {"cpu": 2, "ssd": 2}
    # the first two only: the LRU slot (ks[3], not in this load) is spilled and ks[1] promoted into it
    load, tiers = pl.plan_load(ks[:2], [50, 51])
    assert tiers == ["cpu", "ssd"]
    assert load == [LoadCpu(0, ks[0], 50), Spill(1, ks[3]), Promote(ks[1], 1), LoadCpu(1, ks[1], 51)]
    assert [(c.op, c.tier, c.engine_hash) for c in pl.take_changes()] == [
        ("stored", "ssd", 103), ("removed", "cpu", 103), ("stored", "cpu", 101)]
    assert [pl.tier_of(k) for k in ks] == ["cpu", "cpu", "ssd", "ssd"] and pl.cpu_slot_of(ks[1]) == 1
    assert pl.counts() == {"cpu": 2, "ssd": 3}   # ks[1] keeps its SSD copy


def test_planner_ssd_limit_deletes_lru_files():
    pl = TierPlanner(cpu_slots=1, ssd_slots=2)
    ks = keys_of(range(20))                      # 5 blocks through 1 slot and 2 files
    ops = []
    for i, k in enumerate(ks):
        ops += pl.plan_save(k, i, i)
    assert pl.counts() == {"cpu": 1, "ssd": 2}
    assert [type(o) for o in ops].count(DropSsd) == 2
    files = set()
    for o in ops:                                # replaying the ops never holds more than 2 files
        if isinstance(o, Spill):
            files.add(o.key)
        elif isinstance(o, DropSsd):
            files.discard(o.key)
        assert len(files) <= 2


def test_planner_load_never_evicts_its_own_blocks():
    pl = TierPlanner(cpu_slots=1, ssd_slots=4)
    ks = keys_of(range(12))
    for i, k in enumerate(ks):
        pl.plan_save(k, i, i)
    assert [pl.tier_of(k) for k in ks] == ["ssd", "ssd", "cpu"]
    load, tiers = pl.plan_load(ks, [7, 8, 9])
    assert tiers == ["ssd", "ssd", "cpu"]
    assert [type(o) for o in load] == [LoadSsd, LoadSsd, LoadCpu]   # the only slot is pinned
    assert pl.lookup(ks) == ["ssd", "ssd", "cpu"]


def test_planner_rebuild_forget_and_late_engine_hash():
    pl = TierPlanner(cpu_slots=2, ssd_slots=2)
    ks = keys_of(range(12))
    assert pl.add_ssd_blocks(ks) == [ks[0]]      # oldest beyond capacity
    assert pl.lookup(ks[1:]) == ["ssd", "ssd"]
    assert pl.take_changes() == []               # engine hashes unknown: nothing announced
    load, _ = pl.plan_load(ks[1:], [5, 6], engine_hashes=[71, 72])
    ch = [(c.op, c.tier, c.engine_hash) for c in pl.take_changes()]
    assert ("stored", "ssd", 71) in ch and ("stored", "cpu", 71) in ch
    pl.forget(ks[1], "ssd")
    pl.forget(ks[1], "cpu", slot=999)            # stale report: another slot, ignored
    assert pl.tier_of(ks[1]) == "cpu"
    pl.forget(ks[1], "cpu")
    assert pl.tier_of(ks[1]) is None
    load, tiers = pl.plan_load([ks[1]], [3])
    assert load == [FailBlock(3)] and tiers == ["miss"]
    with pytest.raises(ValueError):
        TierPlanner(cpu_slots=0)


def test_planner_ops_round_trip_through_pickle():
    """The operations reach vLLM's workers pickled in the connector metadata: every kind comes back
    equal and of the same class."""
    k0, k1 = keys_of(range(8))
    ops = [Save(0, k0, 10), LoadCpu(1, k1, 11), LoadSsd(k0, 12), Promote(k1, 2), Spill(3, k0), DropSsd(k1),
           FailBlock(13), LoadPeer("10.0.0.2:7000", [k0, k1], [14, 15]), LoadPeer("p", [k1], [16], pd=True)]
    back = pickle.loads(pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == ops and [type(op) for op in back] == [type(op) for op in ops]
    assert back[-1].pd is True and back[-2].pd is False
    assert Save(0, k0, 10) != LoadCpu(0, k0, 10)  # the kind is part of the value


# ---- store ------------------------------------------------------------------------------------------
def test_store_spill_promote_and_corruption_never_served(tmp_path):
    slab = bytearray(2 * 64)
    st = TierStore(slab, 2, 64, FP, tmp_path)
    assert (tmp_path / FP.dir_name() / "fingerprint.json").exists()
    k0, k1 = keys_of(range(8))
    st.slot(0)[:] = payload(5)
    st.mark(0, k0)
    assert st.write_ssd(k0, st.spill_bytes(0, k0))
    assert st.spill_bytes(1, k1) is None         # slot 1 does not hold k1
    assert st.take_failures() == [(k1, "ssd", None)]
    assert st.promote(k0, 1) and bytes(st.slot(1)) == payload(5) and st.holds(1, k0)
    path = block_path(tmp_path / FP.dir_name(), k0)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert not st.promote(k0, 1)
    assert not st.holds(1, k0) and not path.exists()            # deleted: never served again
    assert st.take_failures() == [(k0, "ssd", None), (k0, "cpu", 1)]
    assert not st.read_ssd(k0, bytearray(64))                   # gone


def test_store_rejects_wrong_slab():
    with pytest.raises(ValueError):
        TierStore(bytearray(10), 2, 64, FP)


# ---- connector config ------------------------------------------------------------------------------
def test_kv_transfer_config_and_env(tmp_path):
    cfg = kv_transfer_config(1 << 20, tmp_path, 2 << 20)
    assert cfg["kv_connector"] == "KVRouteTierConnector"
    assert cfg["kv_connector_module_path"] == "offload_agent.connector.vllm_connector"
    assert cfg["kv_role"] == "kv_both" and cfg["kv_load_failure_policy"] == "recompute"
    assert TierSettings.from_extra(cfg["kv_connector_extra_config"]) == TierSettings(1 << 20, str(tmp_path), 2 << 20)
    with pytest.raises(ValueError):
        kv_transfer_config(0)
    with pytest.raises(ValueError):
        kv_transfer_config(1 << 20, tmp_path, 0)
    env = vllm_env({"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(Path(__file__).resolve().parents[1]), "/x"]


def test_planner_reannounces_after_prefix_cache_reset():
    pl = TierPlanner(cpu_slots=4, ssd_slots=0)
    ks = keys_of(range(8))
    for i, k in enumerate(ks):
        pl.plan_save(k, i, 50 + i)
    pl.take_changes()
    pl.unannounce_all()                          # consumers cleared every tier
    pl.plan_save(ks[0], 9, 99)                   # a fresh save would not change anything ...
    pl.plan_load([ks[0], ks[1]], [3, 4], engine_hashes=[50, 51])
    assert [(c.op, c.tier, c.engine_hash) for c in pl.take_changes()] == [("stored", "cpu", 99),
                                                                         ("stored", "cpu", 51)]
    pl.forget(ks[1], "cpu")
    assert [(c.op, c.engine_hash) for c in pl.take_changes()] == [("removed", 51)]


def test_store_read_ssd_many_in_parallel_checks_each_block(tmp_path):
    st = TierStore(bytearray(64), 1, 64, FP, tmp_path, io_threads=3)
    ks = keys_of(range(24))
    for i, k in enumerate(ks):
        write_block_file(st.fp_dir, k, FPD, payload(i))
    bad = block_path(st.fp_dir, ks[4])
    bad.write_bytes(bad.read_bytes()[:-1])
    outs = [bytearray(64) for _ in ks]
    oks = st.read_ssd_many(ks, outs)
    assert oks == [i != 4 for i in range(6)]
    assert [bytes(o) for i, o in enumerate(outs) if i != 4] == [payload(i) for i in range(6) if i != 4]
    assert st.take_failures() == [(ks[4], "ssd", None)] and not bad.exists()


@pytest.mark.parametrize("io_threads", [1, 3])
def test_store_read_ssd_many_prefetches_each_window_before_reading_it(tmp_path, monkeypatch, io_threads):
    from offload_agent.tiers import store as store_mod
    monkeypatch.setattr(store_mod, "READ_AHEAD_BYTES", 4 * 64)   # windows of 4 blocks (at least a task per thread)
    monkeypatch.setattr(store_mod, "READ_TASK_BYTES", 2 * 64)    # 2 blocks per task
    st = TierStore(bytearray(64), 1, 64, FP, tmp_path, io_threads=io_threads)
    ks = keys_of(range(4 * 15))
    for i, k in enumerate(ks):
        if i != 9:                                               # ks[9] has no file
            write_block_file(st.fp_dir, k, FPD, payload(i))
    bad = block_path(st.fp_dir, ks[5])
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0x01
    bad.write_bytes(bytes(raw))
    prefetched, reads = [], []                                   # reads: (block, blocks announced by then)
    real_prefetch, real_read = store_mod.prefetch_block_files, store_mod.read_block_file

    def prefetch(fp_dir, keys):
        prefetched.extend(keys)
        real_prefetch(fp_dir, keys)

    def read(fp_dir, key, fp, out):
        reads.append((ks.index(key), len(prefetched)))
        real_read(fp_dir, key, fp, out)

    monkeypatch.setattr(store_mod, "prefetch_block_files", prefetch)
    monkeypatch.setattr(store_mod, "read_block_file", read)
    outs = [bytearray(64) for _ in ks]
    oks = st.read_ssd_many(ks, outs)
    assert oks == [i not in (5, 9) for i in range(15)]
    assert [bytes(o) for i, o in enumerate(outs) if oks[i]] == [payload(i) for i in range(15) if oks[i]]
    step = max(4, 2 * io_threads)                                # blocks per window
    assert prefetched == ks                                      # each file announced once, in order,
    assert sorted(i for i, _ in reads) == list(range(15))
    for i, n in reads:                                           # with its window before it is read,
        assert (i // step + 1) * step <= n or n == 15            # and never more than one window ahead
        assert n <= (i // step + 2) * step
    if io_threads == 1:                                          # the next window goes first when reading alone
        assert all(n == min(15, (i // step + 2) * step) for i, n in reads)
    assert sorted(st.take_failures()) == sorted([(ks[5], "ssd", None), (ks[9], "ssd", None)])
    assert not bad.exists()


def test_store_read_ssd_many_leaves_large_blocks_to_its_threads(tmp_path, monkeypatch):
    from offload_agent.tiers import store as store_mod
    monkeypatch.setattr(store_mod, "READ_AHEAD_BYTES", 4 * 64)   # 4 threads x 64 bytes in flight: enough
    prefetched = []
    monkeypatch.setattr(store_mod, "prefetch_block_files", lambda fp_dir, keys: prefetched.extend(keys))
    st = TierStore(bytearray(64), 1, 64, FP, tmp_path, io_threads=4)
    ks = keys_of(range(4 * 9))
    for i, k in enumerate(ks):
        write_block_file(st.fp_dir, k, FPD, payload(i))
    outs = [bytearray(64) for _ in ks]
    assert st.read_ssd_many(ks, outs) == [True] * 9
    assert [bytes(o) for o in outs] == [payload(i) for i in range(9)] and prefetched == []
