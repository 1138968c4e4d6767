"""The CPU tier in the agent's shared memory file: layout, the seqlock between the connector (the
writer) and the agent (a reader), reuse across restarts, and the store and planner over it."""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from offload_agent.tiers import TierFingerprint, TierPlanner, TierStore
from offload_agent.tiers.shm_slab import PAGE_BYTES, ShmSlab, SlabMismatch, file_bytes

FP = TierFingerprint(model="m", num_layers=2, dtype="bfloat16", block_size=4, block_bytes=256)
DIGEST = FP.digest()


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def shm_path(tmp_path: Path) -> Path:
    return tmp_path / "tier.shm"


def test_create_lays_out_header_table_and_slab(shm_path: Path) -> None:
    slab = ShmSlab.create(shm_path, DIGEST, 256, 10)
    assert shm_path.stat().st_size == file_bytes(10, 256) == 2 * PAGE_BYTES + 10 * 256
    assert (slab.num_slots, slab.block_bytes, slab.fingerprint_digest) == (10, 256, DIGEST)
    assert slab.slab.nbytes == 2560
    assert slab.stable_slots() == [] and slab.table_version() == 0
    with open(shm_path, "rb") as f:
        assert f.read(4) == b"KVRS"
    slab.close()


def test_create_reserves_every_page(shm_path: Path) -> None:
    """The file is not sparse: a tier that does not fit fails at creation, never with SIGBUS
    when a slot is first written or the connector registers the file for DMA."""
    slab = ShmSlab.create(shm_path, DIGEST, 1 << 20, 8)
    size = file_bytes(8, 1 << 20)
    assert shm_path.stat().st_blocks * 512 >= size
    slab.close()


def test_writer_and_reader_in_two_mappings(shm_path: Path) -> None:
    owner = ShmSlab.create(shm_path, DIGEST, 256, 4)          # the agent
    conn = ShmSlab.attach(shm_path)                            # the connector
    conn.begin_write(2)
    conn.slot_view(2)[:] = bytes(range(256))
    assert owner.key_of(2) is None                             # mid-write: nothing to serve
    out = bytearray(256)
    assert not owner.read_consistent(2, key(7), out)
    conn.end_write(2, key(7))
    assert owner.key_of(2) == key(7)
    assert owner.read_consistent(2, key(7), out) and bytes(out) == bytes(range(256))
    assert not owner.read_consistent(2, key(8), out)          # another key: not served
    assert owner.stable_slots() == [(2, key(7))]
    assert owner.table_version() == 1
    conn.begin_write(2)
    conn.end_write(2, None)                                    # emptied
    assert owner.stable_slots() == [] and owner.table_version() == 2
    conn.close()
    owner.close()


def test_reader_refuses_a_copy_torn_by_a_write(shm_path: Path, monkeypatch) -> None:
    owner = ShmSlab.create(shm_path, DIGEST, 256, 2)
    conn = ShmSlab.attach(shm_path)
    conn.begin_write(0)
    conn.slot_view(0)[:] = b"a" * 256
    conn.end_write(0, key(1))
    real = owner.slot_view

    def view_then_overwrite(slot: int) -> memoryview:      # the writer strikes during the copy
        v = real(slot)
        conn.begin_write(0)
        conn.slot_view(0)[:] = b"b" * 256
        conn.end_write(0, key(1))                            # same key, new bytes, new seq
        return v

    monkeypatch.setattr(owner, "slot_view", view_then_overwrite)
    assert not owner.read_consistent(0, key(1), bytearray(256))
    monkeypatch.undo()
    out = bytearray(256)
    assert owner.read_consistent(0, key(1), out) and bytes(out) == b"b" * 256
    conn.close()
    owner.close()


def test_create_reuses_a_matching_file_and_clears_another_layout(shm_path: Path) -> None:
    first = ShmSlab.create(shm_path, DIGEST, 256, 4)
    first.begin_write(1)
    first.slot_view(1)[:] = b"x" * 256
    first.end_write(1, key(5))
    first.close()
    again = ShmSlab.create(shm_path, DIGEST, 256, 4)           # an agent restarted: blocks stay
    assert again.stable_slots() == [(1, key(5))]
    again.close()
    other = ShmSlab.create(shm_path, DIGEST, 512, 4)           # another layout: a fresh file
    assert (other.block_bytes, other.stable_slots()) == (512, [])
    other.close()


def test_attach_rejects_what_is_not_a_tier(shm_path: Path) -> None:
    shm_path.write_bytes(b"nope" * 2000)
    with pytest.raises(SlabMismatch):
        ShmSlab.attach(shm_path)
    with pytest.raises(FileNotFoundError):
        ShmSlab.attach(shm_path.with_name("absent"))
    with pytest.raises(ValueError):
        ShmSlab.create(shm_path, DIGEST, 0, 4)


def _child_writes(path: str) -> None:
    slab = ShmSlab.attach(path)
    for slot in range(3):
        slab.begin_write(slot)
        slab.slot_view(slot)[:] = bytes([slot + 1]) * 256
        slab.end_write(slot, key(100 + slot))
    slab.close()


def test_another_process_writes_what_the_owner_reads(shm_path: Path) -> None:
    owner = ShmSlab.create(shm_path, DIGEST, 256, 3)
    proc = multiprocessing.get_context("spawn").Process(target=_child_writes, args=(str(shm_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    out = bytearray(256)
    assert owner.stable_slots() == [(0, key(100)), (1, key(101)), (2, key(102))]
    assert owner.read_consistent(1, key(101), out) and bytes(out) == b"\x02" * 256
    owner.close()


def test_store_over_shm_writes_rows_and_the_planner_rebuilds_from_them(shm_path: Path, tmp_path: Path) -> None:
    owner = ShmSlab.create(shm_path, DIGEST, 256, 4)
    conn = ShmSlab.attach(shm_path)
    store = TierStore(None, 4, 256, FP, tmp_path / "ssd", shm=conn)
    store.put(3, key(9), b"z" * 256)
    assert store.holds(3, key(9)) and owner.key_of(3) == key(9)
    assert store.write_ssd(key(9), store.spill_bytes(3, key(9)))  # slot -> SSD file still works
    store.begin(3)
    assert not store.holds(3, key(9)) and owner.key_of(3) is None
    store.mark(3, key(9))
    # a restarted connector: the planner takes the surviving slots and never hands them out again
    planner = TierPlanner(4, 0)
    assert planner.add_cpu_blocks(owner.stable_slots() + [(3, key(10)), (7, key(11))]) == 1
    assert planner.tier_of(key(9)) == "cpu" and planner.cpu_slot_of(key(9)) == 3
    taken = {planner.plan_save(key(20 + i), i)[0].slot for i in range(3)}
    assert taken == {0, 1, 2}
    conn.close()
    owner.close()
    os.unlink(shm_path)
