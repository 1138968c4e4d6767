"""The connector's worker side without vLLM: runs the planner's operations
(:mod:`offload_agent.tiers.ops`) on vLLM's KV cache, the CPU tier's slab and the SSD folder.

Torch and the standard library only, so it is tested without vLLM (``tests/torch/``) and driven on
a GPU by ``tools/gpu_check_connector.py``; the vLLM connector
(:mod:`offload_agent.connector.vllm_connector`) is a thin adapter over it.

Per engine step (vLLM calls, in this order: ``start_load_kv``, the forward pass, ``wait_for_save``,
``get_finished``):

- :meth:`TierWorker.run_loads`: the step's load operations, in order. CPU-tier hits are copied from
  their slots (:class:`~offload_agent.connector.kv_copy.BlockCopier`: on CUDA enqueued on a side
  stream that the forward pass waits for on the GPU, the host is not blocked); SSD files and peer
  pulls of *asynchronous* loads (:meth:`start_async`) are read in a background thread while the
  engine keeps stepping;
- :meth:`TierWorker.run_saves`: the step's saves, enqueued after the forward pass on the side
  stream (on CUDA the host does not wait for them). A slot is marked as holding its block
  (:meth:`TierStore.mark`, which publishes it to the agent through the slot's seqlock) only once
  its copy has completed (:meth:`poll`); until then it holds nothing a reader would take;
- :meth:`TierWorker.finished_loads`: asynchronous loads whose bytes have arrived are copied into
  their GPU blocks (enqueued; the forward pass that uses them waits on the GPU) and reported.

SSD writes leave the step too: a spill copies its slot's bytes to host memory (the slot is reused
at once, often by the same step's save) and a writer thread writes the file; a file's deletion
goes through the same thread, so a key's operations keep their order. What reads a file waits for
that key's write in flight: an asynchronous load in its background thread, the in-step paths
(:class:`LoadSsd`, :class:`Promote`) in the step. At most ``MAX_SSD_WRITE_BYTES`` of spilled bytes wait for
the disk; beyond that a spill waits for the oldest writes (a disk slower than the evictions).

Hazards the asynchronous copies bring, and the rule for each: a host operation on a slot (the copy
out of a spill, promote or put from SSD) first waits for every copy touching that slot; a CPU-tier
load from a slot whose save is still in flight is ordered after it by the stream; a staging buffer
stays referenced until its copy's event completes; blocks of a step in which a load failed are not
saved (their KV may depend on the failed block).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

import torch

from offload_agent.connector.host_memory import Registration, host_buffer, register
from offload_agent.connector.kv_copy import DEFAULT_STAGING_BYTES, BlockCopier, PagedKV
from offload_agent.tiers.keys import TierFingerprint
from offload_agent.tiers.ops import DropSsd, FailBlock, LoadCpu, LoadPeer, LoadSsd, Promote, Save, Spill, TierOp
from offload_agent.tiers.planner import CPU
from offload_agent.tiers.shm_slab import ShmSlab
from offload_agent.tiers.store import TierStore

log = logging.getLogger("vllm.kvroute_tiers.worker")
MAX_SSD_WRITE_BYTES = 256 << 20  # spilled bytes waiting for the disk before a spill waits
SSD_FREE_BUFFERS = 64  # spill buffers kept for reuse (fresh ones fault their pages in on the copy)

ShortPull = tuple[str, bytes]
"""A pull that fell short: ``(peer, key of the first block that did not come)``."""

PullFn = Callable[..., tuple[int, "str | None"]]
"""``pull(peer, keys, into) -> (blocks, error)``: the first ``blocks`` of ``keys`` pulled from
``peer`` into ``into`` (``len(keys) * block_bytes``), each verified; never raises. Called with
``wait=True`` for a :class:`LoadPeer` whose ``pd`` is True (P/D: blocks the peer does not hold yet
are asked for again until the pull's deadline)."""


class _AsyncLoad:
    """One request's asynchronous load: ``ops`` (:class:`LoadSsd`, :class:`LoadPeer`,
    :class:`FailBlock`) read in the background into ``staging`` rows, then copied into ``blocks``."""

    __slots__ = ("req_id", "ops", "staging", "rows", "blocks", "failed", "future", "event", "after")

    def __init__(self, req_id: str, ops: list[TierOp]) -> None:
        self.req_id = req_id
        self.ops = ops
        self.staging: torch.Tensor | None = None
        self.rows: list[int] = []      # staging rows that arrived, in order
        self.blocks: list[int] = []    # their GPU blocks
        self.failed: list[int] = []    # GPU blocks that did not arrive
        self.future: Future | None = None
        self.event = None              # the copy into the GPU blocks (CUDA)
        self.after: list[Future] = []  # SSD writes of its keys to wait for before reading


class TierWorker:
    """Executor of the planner's operations for one vLLM worker (one TP/PP shard).

    ``kv``: the worker's KV cache (:class:`PagedKV`); ``num_slots``: CPU tier slots;
    ``fingerprint``: this shard's; ``ssd_dir``: the SSD tier's root (its files go in the
    fingerprint's folder) or None; ``shm``: the agent's CPU tier file (its slab is then the CPU
    tier, registered for DMA on CUDA) or None for a slab of our own; ``pull``: how to pull from a
    peer (:data:`PullFn`) or None. Raises ValueError when ``shm`` has another size.
    """

    def __init__(self, kv: PagedKV, num_slots: int, fingerprint: TierFingerprint, ssd_dir: Path | None = None,
                 shm: ShmSlab | None = None, pull: PullFn | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.kv = kv
        self.cuda = kv.device.type == "cuda"
        self.copier = BlockCopier(kv, staging_bytes)
        self.registration: Registration | None = None
        if shm is not None:
            if (shm.block_bytes, shm.num_slots) != (kv.block_bytes, num_slots):
                raise ValueError(f"the CPU tier file has {shm.num_slots} slots of {shm.block_bytes} bytes, "
                                 f"expected {num_slots} of {kv.block_bytes}")
            flat = torch.frombuffer(shm.slab, dtype=torch.uint8)
            if self.cuda:
                self.registration = register(flat)
        else:
            flat, self.registration = host_buffer(num_slots * kv.block_bytes, self.cuda)
        self.slab = flat.view(num_slots, kv.block_bytes)
        self.store = TierStore(self.slab.numpy(), num_slots, kv.block_bytes, fingerprint, ssd_dir, shm=shm)
        self._pull = pull
        self._sync_staging = torch.empty((1, kv.block_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        self._invalid: set[int] = set()
        self._failed_step = False
        # copies in flight (CUDA): saves to mark once done, and the last copy touching each slot
        self._saving: deque[tuple[object, list[tuple[int, bytes]]]] = deque()
        self._writer: dict[int, object] = {}     # slot -> the event of its pending save
        self._pending_key: dict[int, bytes] = {} # slot -> the key its pending save writes
        self._slot_event: dict[int, object] = {}
        self._touching: deque[tuple[object, list[int]]] = deque()  # copies in flight, in order
        self._loads: dict[str, _AsyncLoad] = {}
        self._copying: list[_AsyncLoad] = []     # arrived, copy to GPU enqueued, event pending
        self._pool: ThreadPoolExecutor | None = None
        self._pull_buf: torch.Tensor | None = None
        self._short_pulls: list[ShortPull] = []
        # SSD writes and deletions in flight, in order: (future, key, spilled bytes or None)
        self._ssd_writer: ThreadPoolExecutor | None = None
        self._ssd_ops: deque[tuple[Future, bytes, bytearray | None]] = deque()
        self._ssd_free: list[bytearray] = []  # spill buffers whose write is done, to reuse
        self._ssd_last: dict[bytes, Future] = {}  # key -> its newest SSD operation in flight
        self._ssd_held_bytes = 0

    @property
    def pinned(self) -> bool:
        """Whether the CPU tier is pinned or registered (DMA runs asynchronously)."""
        return self.registration is not None and self.registration.ok

    # ---- completion of copies --------------------------------------------------------------------
    def poll(self) -> None:
        """Mark the slots of completed saves and forget completed copies, in order (never blocks)."""
        while self._saving and self._saving[0][0].query():
            event, written = self._saving.popleft()
            for slot, key in written:
                if self._writer.get(slot) is event:
                    del self._writer[slot]
                    del self._pending_key[slot]
                    self.store.mark(slot, key)
        while self._touching and self._touching[0][0].query():
            event, slots = self._touching.popleft()
            for slot in slots:
                if self._slot_event.get(slot) is event:
                    del self._slot_event[slot]
        while self._ssd_ops and self._ssd_ops[0][0].done():
            self._reap_ssd_op()

    # ---- SSD writes ------------------------------------------------------------------------------
    def _reap_ssd_op(self) -> None:
        """Forget the oldest SSD operation (waiting for it if it is still running)."""
        fut, key, data = self._ssd_ops.popleft()
        error = fut.exception()
        if error is not None:
            log.warning("kvroute tiers: SSD operation on block %s failed: %r", key.hex(), error)
            self.store.fail(key, "ssd")
        if data is not None:
            self._ssd_held_bytes -= len(data)
            if len(self._ssd_free) < SSD_FREE_BUFFERS:
                self._ssd_free.append(data)
        if self._ssd_last.get(key) is fut:
            del self._ssd_last[key]

    def _queue_ssd(self, key: bytes, data: bytearray | None, fn, *args) -> None:
        """Run ``fn(*args)`` (an SSD write or deletion of ``key``) on the writer thread, after the
        ones queued before it; ``data``: the spilled bytes it holds until done (then reused)."""
        if self._ssd_writer is None:
            self._ssd_writer = ThreadPoolExecutor(1, thread_name_prefix="kvroute-ssd-write")
        fut = self._ssd_writer.submit(fn, *args)
        self._ssd_ops.append((fut, key, data))
        self._ssd_last[key] = fut
        self._ssd_held_bytes += len(data) if data is not None else 0
        while self._ssd_held_bytes > MAX_SSD_WRITE_BYTES and self._ssd_ops:
            self._reap_ssd_op()

    def _wait_ssd(self, key: bytes) -> None:
        """Wait until ``key``'s SSD operations in flight are done (before a read of its file)."""
        fut = self._ssd_last.get(key)
        if fut is not None:
            wait_futures([fut])

    def _settle(self, slot: int) -> None:
        """Wait until no copy touches ``slot`` (before the host reads or writes it)."""
        event = self._slot_event.get(slot)
        if event is not None:
            event.synchronize()
            self.poll()

    def settle_saves(self) -> None:
        """Wait for the saves in flight and mark their slots (a P/D prefill's last step: its reader
        pulls them at once). Nothing to wait for on CPU."""
        for event, _ in list(self._saving):
            event.synchronize()
        self.poll()

    def flush(self) -> None:
        """Wait for every copy and SSD write in flight and mark its slots (shutdown, tests)."""
        for event, _ in list(self._saving) + list(self._touching):
            event.synchronize()
        while self._ssd_ops:
            self._reap_ssd_op()
        self.poll()
        for job in list(self._copying):
            job.event.synchronize()

    def holds(self, slot: int, key: bytes) -> bool:
        """Whether ``slot`` holds ``key`` or a save of it is in flight (ordered before any copy
        out of the slot)."""
        return self._pending_key.get(slot) == key or self.store.holds(slot, key)

    # ---- loads -----------------------------------------------------------------------------------
    def run_loads(self, ops: list[TierOp]) -> None:
        """Execute a step's load-side operations in order (module docstring)."""
        self.poll()
        batch: list[LoadCpu] = []  # consecutive LoadCpu ops

        def flush_loads() -> None:
            if batch:
                slots = [op.slot for op in batch]
                self._record(slots, self.copier.load(slots, [op.gpu_block for op in batch], self.slab))
                batch.clear()

        for op in ops:
            if isinstance(op, LoadCpu):
                if self.holds(op.slot, op.key):
                    batch.append(op)
                else:
                    self._load_failed(op.gpu_block)
                    self.store.fail(op.key, CPU, op.slot)
                continue
            flush_loads()
            match op:
                case LoadSsd():
                    self._wait_ssd(op.key)
                    row = self._sync_staging
                    if self.store.read_ssd(op.key, row[0].numpy()):
                        event = self.copier.load([0], [op.gpu_block], row)
                        if event is not None:
                            event.synchronize()  # the one staging row is reused next
                    else:
                        self._load_failed(op.gpu_block)
                case LoadPeer():
                    got = self._pull_sync(op.peer, op.keys, op.gpu_blocks)
                    if got:
                        event = self.copier.load(list(range(got)), op.gpu_blocks[:got], self._pull_buf)
                        if event is not None:
                            event.synchronize()
                case _:
                    self._host_op(op)
        flush_loads()

    def _record(self, slots: list[int], event) -> None:
        """``event`` (None on CPU: the copy is done) is the last copy touching ``slots``."""
        if event is not None:
            for s in slots:
                self._slot_event[s] = event
            self._touching.append((event, slots))

    def _host_op(self, op: TierOp) -> None:
        """A :class:`Spill`, :class:`DropSsd`, :class:`Promote` or :class:`FailBlock`, in either
        list; raises ValueError for any other operation."""
        match op:
            case Spill():
                self._settle(op.slot)
                data = self.store.spill_bytes(op.slot, op.key, self._ssd_free.pop() if self._ssd_free else None)
                if data is not None:
                    self._queue_ssd(op.key, data, self.store.write_ssd, op.key, data)
            case DropSsd():
                self._queue_ssd(op.key, None, self.store.drop_ssd, op.key)
            case Promote():
                self._wait_ssd(op.key)
                self._settle(op.slot)
                self.store.promote(op.key, op.slot)
            case FailBlock():
                self._load_failed(op.gpu_block)
            case _:
                raise ValueError(f"unknown tier operation {op!r}")

    def _load_failed(self, gpu_block: int) -> None:
        self._invalid.add(gpu_block)
        self._failed_step = True

    def take_invalid_blocks(self) -> set[int]:
        """GPU blocks whose load failed since the last call (vLLM recomputes them)."""
        out, self._invalid = self._invalid, set()
        return out

    def take_failures(self) -> list[tuple[bytes, str, int | None]]:
        """Tier copies found unusable since the last call, for the planner to forget."""
        return self.store.take_failures()

    def take_short_pulls(self) -> list[ShortPull]:
        """Pulls that fell short since the last call (:data:`ShortPull`), so the scheduler does not
        offer the same blocks from the same peer again at once."""
        out, self._short_pulls = self._short_pulls, []
        return out

    # ---- saves -----------------------------------------------------------------------------------
    def run_saves(self, ops: list[TierOp]) -> None:
        """Execute a step's save-side operations in order; saves are enqueued (CUDA) or done (CPU).
        When a load of this step failed, its saves are dropped (reported to the planner)."""
        batch: list[Save] = []

        def flush_saves() -> None:
            if not batch:
                return
            slots = [op.slot for op in batch]
            for slot in slots:
                self.store.begin(slot)
            event = self.copier.save([op.gpu_block for op in batch], slots, self.slab)
            if event is None:
                for op in batch:
                    self.store.mark(op.slot, op.key)
            else:
                self._saving.append((event, [(op.slot, op.key) for op in batch]))
                for op in batch:
                    self._writer[op.slot] = event
                    self._pending_key[op.slot] = op.key
                self._record(slots, event)
            batch.clear()

        try:
            for op in ops:
                if isinstance(op, Save):
                    if self._failed_step:
                        self._writer.pop(op.slot, None)  # an older save in flight no longer marks the slot
                        self._pending_key.pop(op.slot, None)
                        self.store.mark(op.slot, None)
                        self.store.fail(op.key, CPU, op.slot)
                    else:
                        batch.append(op)  # a DMA into the slot is ordered after earlier copies
                    continue
                flush_saves()
                self._host_op(op)
            flush_saves()
        finally:
            self._failed_step = False

    # ---- asynchronous loads ----------------------------------------------------------------------
    def start_async(self, req_id: str, ops: list[TierOp]) -> None:
        """Start reading one request's :class:`LoadSsd`, :class:`LoadPeer` and :class:`FailBlock`
        operations in the background; :meth:`finished_loads` reports it."""
        job = _AsyncLoad(req_id, ops)
        job.after = [self._ssd_last[op.key] for op in ops if isinstance(op, LoadSsd) and op.key in self._ssd_last]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvroute-tier-load")
        job.future = self._pool.submit(self._read_job, job)
        self._loads[req_id] = job

    def _read_job(self, job: _AsyncLoad) -> None:
        """Background thread: read the job's blocks into its staging rows (host memory only),
        once the SSD writes of its keys that were in flight when it started are done."""
        wait_futures(job.after)
        ssd = [op for op in job.ops if isinstance(op, LoadSsd)]
        n = len(ssd) + sum(len(op.keys) for op in job.ops if isinstance(op, LoadPeer))
        job.staging = torch.empty((max(1, n), self.kv.block_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        row = 0
        if ssd:
            oks = self.store.read_ssd_many([op.key for op in ssd], [job.staging[i].numpy() for i in range(len(ssd))])
            for i, (op, ok) in enumerate(zip(ssd, oks)):
                if ok:
                    job.rows.append(i)
                    job.blocks.append(op.gpu_block)
                else:
                    job.failed.append(op.gpu_block)
            row = len(ssd)
        for op in job.ops:
            match op:
                case LoadPeer(peer=peer, keys=keys, gpu_blocks=blocks):
                    into = memoryview(job.staging[row:row + len(keys)].numpy()).cast("B")
                    t0 = time.monotonic()
                    wait = {"wait": True} if op.pd else {}
                    got, error = self._pull(peer, keys, into, **wait) if self._pull is not None else (0, "no agent")
                    pull_ms = (time.monotonic() - t0) * 1000
                    job.rows += range(row, row + got)
                    job.blocks += blocks[:got]
                    job.failed += blocks[got:]
                    if got < len(keys):
                        self._short_pulls.append((peer, keys[got]))  # list.append: safe across threads
                    row += len(keys)
                    log.info("kvroute tiers: request %s: pulled %d of %d blocks from %s in %.1f ms%s", job.req_id,
                             got, len(keys), peer, pull_ms,
                             f" ({error}; the rest is recomputed)" if got < len(keys) else "")
                case FailBlock():
                    job.failed.append(op.gpu_block)

    def _pull_sync(self, peer: str, keys: list[bytes], blocks: list[int]) -> int:
        """A pull inside the step (a :class:`LoadPeer` among the synchronous loads): the blocks that
        did not come are reported failed; returns how many came (in ``_pull_buf``)."""
        n = len(keys)
        if self._pull_buf is None or self._pull_buf.shape[0] < n:
            self._pull_buf = torch.empty((n, self.kv.block_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        t0 = time.monotonic()
        if self._pull is None:
            got, error = 0, "no agent"
        else:
            got, error = self._pull(peer, keys, memoryview(self._pull_buf[:n].numpy()).cast("B"))
        for g in blocks[got:]:
            self._load_failed(g)
        if got < n:
            self._short_pulls.append((peer, keys[got]))
        log.info("kvroute tiers: pulled %d of %d blocks from %s in %.1f ms%s", got, n, peer,
                 (time.monotonic() - t0) * 1000, f" ({error}; the rest is recomputed)" if got < n else "")
        return got

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load is complete: their arrived blocks are copied (enqueued
        before the next forward pass, which waits for them) and the rest are reported failed
        (:meth:`take_invalid_blocks`, in this same call's step). Never blocks."""
        self.poll()
        self._copying = [j for j in self._copying if not j.event.query()]
        done: set[str] = set()
        for req_id, job in list(self._loads.items()):
            if not job.future.done():
                continue
            del self._loads[req_id]
            error = job.future.exception()
            if error is not None:
                log.warning("kvroute tiers: asynchronous load of %s failed: %s", req_id, error)
                job.failed, job.rows, job.blocks = _op_blocks(job.ops), [], []
            if job.rows:
                job.event = self.copier.load(job.rows, job.blocks, job.staging)
                if job.event is not None:
                    self._copying.append(job)
            self._invalid.update(job.failed)
            done.add(req_id)
        return done

    def close(self) -> None:
        """Wait for copies, background reads and SSD writes; unregister host memory."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.cuda:
            torch.cuda.synchronize(self.kv.device)
        self.flush()
        if self._ssd_writer is not None:
            self._ssd_writer.shutdown(wait=True)
        if self.registration is not None:
            self.registration.release()


def _op_blocks(ops: list[TierOp]) -> list[int]:
    """The GPU blocks an asynchronous load's operations target."""
    out: list[int] = []
    for op in ops:
        match op:
            case LoadSsd() | FailBlock():
                out.append(op.gpu_block)
            case LoadPeer():
                out += op.gpu_blocks
    return out
