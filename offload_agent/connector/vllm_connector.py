"""``KVRouteTierConnector``: vLLM's KV connector (``KVConnectorBase_V1``) in front of our CPU and
SSD tiers. Loaded by vLLM with::

    --kv-transfer-config '{"kv_connector": "KVRouteTierConnector",
        "kv_connector_module_path": "offload_agent.connector.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_tier_bytes": N, "ssd_tier_dir": DIR, "ssd_tier_bytes": N}}'

(:func:`offload_agent.connector.config.kv_transfer_config` builds it; the repository root must be
on vLLM's ``PYTHONPATH``.) Imports only vLLM, torch and the standard library. This module adapts
vLLM's API; the bytes move in :mod:`offload_agent.connector.worker_ops` (torch only).

What it does, per engine step (vLLM 0.32 connector API):

- scheduler side, ``get_num_new_matched_tokens``: the request's prompt blocks past vLLM's own
  prefix hit that the tiers hold, as a consecutive run (never the whole prompt: the last token is
  always computed). CPU-tier hits load in the step (before the forward pass, which waits for them
  on the GPU); a hit with SSD or peer blocks loads **asynchronously**: the request waits in
  ``WAITING_FOR_REMOTE_KVS`` while its files are read or its blocks pulled in a background thread,
  and the batch keeps running; ``get_finished`` reports it;
- ``update_state_after_alloc``: plans the copies of those blocks into the GPU blocks vLLM just
  allocated (:meth:`TierPlanner.plan_load`);
- ``build_connector_meta``: plans saves. **A full prompt block is saved in the step whose forward
  pass computes it** (read after that pass, in ``wait_for_save``), not when the request finishes:
  the block is surely resident then, no block has to be held back from vLLM's allocator after the
  request ends, a long chunked prefill is saved chunk by chunk, and an identical prompt arriving
  while the first is still decoding already finds it. Only prompt blocks are saved (decode blocks
  are rarely shared);
- worker side: ``start_load_kv`` runs the loads, ``wait_for_save`` enqueues the saves (one gather
  over all layers into a staging buffer, DMA into the pinned slab, on a side stream; the host does
  not wait, and a slot counts as written once its copy completes);
- failures (a slot or file that does not hold what it should, a corrupt file, a pull that fell
  short): the GPU blocks are reported to vLLM (``get_block_ids_with_load_errors``), which
  recomputes them; nothing of that step is saved (its KV may depend on the bad block); the planner
  forgets the bad copies (worker -> scheduler metadata);
- residency: ``take_events`` hands vLLM ``BlockStored``/``BlockRemoved`` with medium ``CPU`` /
  ``STORAGE`` and no tokens (vLLM's placeholder form: the block's hash only), published on vLLM's
  own KV event stream after the step's GPU events. Consumers map the hash through the GPU event
  that preceded it.

Parallelism: each tensor- or pipeline-parallel rank is a *shard* with its own fingerprint
(:class:`TierFingerprint`: its ranks, its layers, the page shape it sees), its own slots (a CPU
tier file per shard with an agent) and SSD folder; the scheduler's planner places one block in the
same slot of every shard, and the tier keys are rooted in the engine's digest, which every shard
shares. ``cpu_tier_bytes`` and ``ssd_tier_bytes`` are for the whole engine. Set-ups the tiers
cannot serve correctly are refused at start (:func:`unsupported_setup`).

With the worker's offload agent on ``agent_socket`` (:mod:`offload_agent.agent_link`; both sides
say hello at start, waiting up to ``agent_wait_s``; without an answer, local tiers as above):

- the CPU slab is the agent's shared memory file for this shard
  (:mod:`offload_agent.tiers.shm_slab`), each slot written between ``begin_write`` and
  ``end_write`` so the agent can serve it to peers; the SSD folder is the agent's; the planner
  starts with the blocks shard (0, 0)'s file still holds;
- peer pull: when the local tiers end before the prompt's creditable blocks (at least
  ``peer_pull_min_blocks`` short), the scheduler side asks the agent in the background
  (``locate``, waiting at most ``peer_locate_timeout_ms`` over the steps it takes; a prefix no peer
  holds is not asked about again for ``NO_PEER_TTL_S``) which peer holds the next blocks, and
  offers them to vLLM as external tokens (source ``p2p``); each rank's worker side asks its agent
  to pull them for its own shard (deadline ``peer_pull_deadline_ms``), copies what came (each
  block verified by the agent) into vLLM's blocks and reports the rest failed, so vLLM recomputes
  it. Pulled blocks are then saved to the CPU tier like computed ones.

Prefill-decode disaggregation (vLLM's protocol: ``kv_transfer_params``), over the agents' peer
protocol, so it needs the agent on both sides:

- prefill side: a request with ``do_remote_decode`` is computed as any other (its full prompt
  blocks saved to the agent's CPU tier in the step that computes them; that step waits for its
  saves on CUDA) and ``request_finished`` answers :func:`prefill_answer`'s params: this worker's
  agent (``kvroute_peer``, the hello answer's ``worker_id``), the full prompt blocks the tiers hold
  from the first (``kvroute_blocks``) and the engine digest (``kvroute_engine``, hex). No GPU block
  is held for the reader. Where that cannot work (no agent, an agent that does not serve peers, a
  request the tiers do not store) the refusal is logged and the answer carries no params, so the
  gateway sends the request whole to the decode worker;
- decode side: a request with ``do_remote_prefill`` and ``kvroute_peer`` (same engine digest) skips
  the peer lookup and loads the prompt blocks its local tiers lack, up to ``kvroute_blocks``, from
  that peer asynchronously; the pull retries the missing tail until ``peer_pull_deadline_ms`` (the
  prefill side's saves may land just after its answer) and what has not come is recomputed. Other
  connectors' params (no ``kvroute_peer``) are ignored: the request is served as any other.

Requests with a LoRA adapter, multimodal inputs or prompt embeddings are neither saved nor loaded
(their KV depends on more than the tokens). Models with more than one KV cache group (hybrid
attention) disable the connector with a warning.
"""
from __future__ import annotations

import array
import os
import shutil
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, KVConnectorWorkerMetadata)
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from offload_agent.agent_link import AgentLink, AgentLinkError
from offload_agent.connector.config import TierSettings, unsupported_setup
from offload_agent.connector.kv_copy import LayoutError, PagedKV
from offload_agent.connector.worker_ops import TierWorker
from offload_agent.tiers.keys import TierFingerprint, layer_names_digest, tier_block_keys, tier_root
from offload_agent.tiers.ops import LoadCpu, LoadPeer, TierOp
from offload_agent.tiers.planner import CPU, SSD, EngineHash, TierPlanner
from offload_agent.tiers.shm_slab import ShmSlab, SlabMismatch
from offload_agent.tiers.ssd_file import HEADER_BYTES, engine_shard_dir, scan_fingerprint_dir

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.kvroute_tiers")  # under "vllm": shown by vLLM's log setup
_MEDIUM = {CPU: "CPU", SSD: "STORAGE"}
PEER = "peer"


def _request_amx_permission() -> None:
    """Ask Linux for the AMX tile state for this process (x86-64 only; a no-op elsewhere or when
    refused). vLLM 0.32's CPU attention kernel runs AMX instructions on a step that prefills a few
    tokens after a long cached prefix without asking for that state first; Linux then kills the
    worker with SIGILL. The step that would ask is a large matrix product, so it only goes wrong
    when such a step is the first: exactly a request whose prefix came from the tiers or a peer on a
    fresh worker (seen with a 900-token prompt pulled whole, 4 tokens left to compute)."""
    if os.uname().machine != "x86_64":
        return
    import ctypes

    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # asm/prctl.h, fpu/types.h
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata)
    except (OSError, AttributeError):
        pass


class TierConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: ``pre_ops`` run before the forward pass (loads),
    ``post_ops`` after it (saves), ``async_loads`` (request id -> its SSD and peer loads) start in
    the background; the operations are records of :mod:`offload_agent.tiers.ops`, pickled with this.
    ``wait_saves``: the step completes the prompt of a P/D prefill request, whose reader pulls the
    blocks right after the answer: the worker waits for the step's saves (CUDA) instead of marking
    them at a later step."""

    def __init__(self, pre_ops: list[TierOp], post_ops: list[TierOp], async_loads: dict[str, list[TierOp]],
                 wait_saves: bool = False) -> None:
        self.pre_ops = pre_ops
        self.post_ops = post_ops
        self.async_loads = async_loads
        self.wait_saves = wait_saves


class TierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: ``failures`` as ``(key, tier, slot)`` to forget;
    ``short_pulls`` as ``(peer, first key that did not come)`` (:data:`worker_ops.ShortPull`)."""

    def __init__(self, failures: list, short_pulls: list | None = None) -> None:
        self.failures = failures
        self.short_pulls = short_pulls or []

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        return TierWorkerMetadata(self.failures + list(getattr(other, "failures", [])),
                                  self.short_pulls + list(getattr(other, "short_pulls", [])))


class _Layout:
    """What the tiers store of one engine, from vLLM's configuration: the single KV cache group's
    layers and block size, the shard this process holds, and the engine-wide sizes.

    ``engine_block_bytes``: one block over every shard (``page_size_bytes`` x the model's attention
    layers x TP size), the same number for the scheduler and every rank, so that each derives the
    same slot count from the CPU tier's bytes."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", tp_rank: int, pp_rank: int) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.ok = len(groups) == 1
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        if not self.ok:
            self.layer_names = []
            return
        spec = groups[0].kv_cache_spec
        par = vllm_config.parallel_config
        self.layer_names = list(groups[0].layer_names)
        self.page_bytes = int(spec.page_size_bytes)
        self.block_bytes = self.page_bytes * len(self.layer_names)
        self.tp_size, self.tp_rank = par.tensor_parallel_size, tp_rank
        self.pp_size, self.pp_rank = par.pipeline_parallel_size, pp_rank
        layers = len(self.layer_names)
        if self.pp_size > 1:
            layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.engine_block_bytes = self.page_bytes * layers * self.tp_size
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self.dtype = cache_dtype if cache_dtype != "auto" else str(spec.dtype).replace("torch.", "")
        self.heads = "x".join(str(getattr(spec, a, "?")) for a in ("num_kv_heads", "head_size"))
        self.model = str(vllm_config.model_config.model)

    def fingerprint(self, model_id: str | None, layout: str = "", block_bytes: int | None = None) -> TierFingerprint:
        """This shard's fingerprint; ``layout`` (the page shape in bytes) and ``block_bytes`` as the
        worker's KV cache views show them (the scheduler has neither: it uses the engine digest)."""
        return TierFingerprint(model=model_id or self.model, num_layers=len(self.layer_names), dtype=self.dtype,
                               block_size=self.block_size, block_bytes=block_bytes or self.block_bytes,
                               layout=layout, heads=self.heads, tp_rank=self.tp_rank, tp_size=self.tp_size,
                               pp_rank=self.pp_rank, pp_size=self.pp_size,
                               layers=layer_names_digest(self.layer_names))


class _ReqState:
    __slots__ = ("request", "keys", "root", "saved_upto", "skip", "locating", "pd_pulled")

    def __init__(self, request: "Request", root: bytes | None) -> None:
        self.request = request
        self.root = root
        self.keys: list[bytes] = []
        self.saved_upto = 0
        self.skip = root is None
        self.locating: _Locate | None = None
        self.pd_pulled = False  # its P/D pull was planned once (asked again after a failure: not again)


def remote_prefill_source(params: Any, engine_hex: str) -> tuple[str, int] | None | str:
    """The decode side's reading of a request's ``kv_transfer_params``: ``(peer, blocks)`` for our
    connector's params (``do_remote_prefill`` with ``kvroute_peer``), None for params that are not
    ours or no P/D (the request is served as any other), or a str saying why ours are unusable
    (another engine's digest, a bad field; logged, then served as any other)."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill") or params.get("kvroute_peer") is None:
        return None
    peer, blocks, engine = params.get("kvroute_peer"), params.get("kvroute_blocks"), params.get("kvroute_engine")
    if not isinstance(peer, str) or not peer:
        return f"kvroute_peer must be a worker id, got {peer!r}"
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
        return f"kvroute_blocks must be an integer >= 0, got {blocks!r}"
    if engine != engine_hex:
        return f"kvroute_engine {engine!r} is another engine's (this one is {engine_hex[:16]}...)"
    return peer, blocks


def prefill_answer(worker_id: str, blocks: int, engine_hex: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` a P/D prefill request finishes with (vLLM's protocol keys, plus
    where and how many of its full prompt blocks the decode side pulls)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
            "kvroute_peer": worker_id, "kvroute_blocks": int(blocks), "kvroute_engine": engine_hex}


class _Locate:
    """One peer lookup, asked in the background: blocks ``first..upto-1``; ``answer`` is
    ``(peer or None, blocks)`` once known; ``give_up_at``: when the request stops waiting."""

    __slots__ = ("first", "upto", "future", "give_up_at", "t0")

    def __init__(self, first: int, upto: int, future: Future, give_up_at: float) -> None:
        self.first, self.upto, self.future, self.give_up_at = first, upto, future, give_up_at
        self.t0 = time.monotonic()

    def peer_answer(self) -> tuple[str | None, int]:
        return self.future.result() if self.future.done() else (None, 0)


def _parallel_rank(name: str) -> int:
    from vllm.distributed import parallel_state
    return getattr(parallel_state, name)()


class KVRouteTierConnector(KVConnectorBase_V1):
    """vLLM KV connector for kvroute's CPU and SSD tiers (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return False  # no per-layer hooks: loads run before the forward pass, saves after it

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = TierSettings.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        worker = role == KVConnectorRole.WORKER
        tp_rank = _parallel_rank("get_tensor_model_parallel_rank") if worker else 0
        pp_rank = _parallel_rank("get_pipeline_model_parallel_rank") if worker else 0
        self.layout = _Layout(vllm_config, kv_cache_config, tp_rank, pp_rank)
        if not self.layout.ok:
            logger.warning("kvroute tiers disabled: %d KV cache groups (only single-group models are "
                           "supported)", len(kv_cache_config.kv_cache_groups))
            return
        problem = unsupported_setup(vllm_config, self.settings)
        if problem:
            raise ValueError(f"kvroute tiers: {problem}")
        self.fingerprint = self.layout.fingerprint(self.settings.model_id)
        self.engine_digest = self.fingerprint.engine_digest()
        self.agent: AgentLink | None = None
        self.agent_info: dict[str, Any] | None = None
        self.peer_pull = False
        self.ssd_dir = self.settings.ssd_tier_dir
        self._ssd_bytes = self.settings.ssd_tier_bytes
        self.num_slots = self.settings.cpu_tier_bytes // self.layout.engine_block_bytes
        if worker:
            self._init_worker()  # the rest once vLLM hands over its KV cache (register_kv_caches)
            return
        if self.settings.agent_socket:
            self._hello_agent("scheduler", self.fingerprint)
        self._size_tiers()
        self._init_scheduler()

    def _size_tiers(self) -> None:
        """Refuse a CPU tier too small for one block (all shards); size the SSD tier in blocks."""
        if self.num_slots < 1:
            raise ValueError(f"kvroute tiers: the CPU tier ({self.settings.cpu_tier_bytes} bytes) holds no block of "
                             f"{self.layout.engine_block_bytes} bytes (all ranks)")
        shards = self.layout.tp_size * self.layout.pp_size
        self.ssd_slots = self._ssd_bytes // (shards * HEADER_BYTES + self.layout.engine_block_bytes)

    def _hello_agent(self, role: str, fingerprint: TierFingerprint) -> None:
        """Find the agent that owns the tiers (waiting up to ``agent_wait_s`` for its socket) and
        say which shard this is; without an answer, local tiers as configured (a warning says so)."""
        link = AgentLink(self.settings.agent_socket, timeout_s=5.0)
        answer = _hello(link, self._hello_header(role, fingerprint), self.settings.agent_wait_s)
        if answer is None:
            logger.warning("kvroute tiers (%s): no offload agent at %s; running local tiers only", role,
                           self.settings.agent_socket)
            link.close()
            return
        self.agent, self.agent_info = link, answer
        self.num_slots = int(answer["num_slots"])
        self.ssd_dir = answer.get("ssd_dir") or None
        self._ssd_bytes = int(answer.get("ssd_tier_bytes") or 0) if self.ssd_dir else 0
        self.peer_pull = bool(answer.get("peer_pull"))
        logger.info("kvroute tiers (%s, tp %d/%d, pp %d/%d): the agent of worker %s owns the tiers: CPU tier %s "
                    "(%d slots), SSD tier %s, peer pull %s", role, fingerprint.tp_rank, fingerprint.tp_size,
                    fingerprint.pp_rank, fingerprint.pp_size, answer.get("worker_id"), answer["shm_path"],
                    answer["num_slots"], answer.get("ssd_dir") or "off", "on" if answer.get("peer_pull") else "off")

    def _hello_header(self, role: str, fingerprint: TierFingerprint) -> dict[str, Any]:
        L = self.layout
        return {"op": "hello", "role": role, "pid": os.getpid(), "block_bytes": fingerprint.block_bytes,
                "fingerprint": asdict(fingerprint), "fingerprint_digest": fingerprint.digest().hex(),
                "shard": {"tp_rank": fingerprint.tp_rank, "tp_size": L.tp_size, "pp_rank": fingerprint.pp_rank,
                          "pp_size": L.pp_size},
                "engine_digest": self.engine_digest.hex(), "engine_block_bytes": L.engine_block_bytes}

    def _attach_slab(self, digest: bytes | None, block_bytes: int | None) -> ShmSlab | None:
        """Map the agent's CPU tier file for this shard; None (and local tiers) when it is not the
        expected one (``digest``/``block_bytes`` None: not checked, the scheduler's view)."""
        try:
            shm = ShmSlab.attach(self.agent_info["shm_path"])
        except (OSError, SlabMismatch) as exc:
            logger.warning("kvroute tiers: cannot map the agent's CPU tier: %s", exc)
            return None
        if shm.num_slots != self.num_slots or digest not in (None, shm.fingerprint_digest) or \
                block_bytes not in (None, shm.block_bytes):
            logger.warning("kvroute tiers: the agent's CPU tier %s has another layout", shm.path)
            shm.close()
            return None
        return shm

    # =========================================== scheduler side ====================================
    def _init_scheduler(self) -> None:
        self.planner = TierPlanner(self.num_slots, self.ssd_slots)
        self._reqs: dict[str, _ReqState] = {}
        self._pending_load: dict[str, tuple[int, int, str | None, int, bool]] = {}
        self._hit_tiers: dict[str, list[str]] = {}
        self._pre_ops: list[TierOp] = []
        self._async_loads: dict[str, list[TierOp]] = {}
        self._no_peer: dict[bytes, float] = {}  # first missing block's key -> until when no peer is assumed
        self._locator: ThreadPoolExecutor | None = None
        self._locate_link: AgentLink | None = None
        self.stats: Counter = Counter()
        found = kept = 0
        if self.ssd_dir:
            found = self._rescan_ssd(Path(self.ssd_dir))
        if self.agent_info is not None:
            shm = self._attach_slab(None, None)
            if shm is None:
                self.agent_info, self.peer_pull = None, False
            else:
                kept = self.planner.add_cpu_blocks(shm.stable_slots())  # the tier outlived a restart
                shm.close()
        if self.peer_pull:  # the lookup thread and its connection ready before the first request
            self._locate_pool().submit(self._connect_locate_link)
        logger.info("kvroute tiers: CPU tier %d blocks of %d bytes over %d shard(s) (%d kept from before), SSD tier "
                    "%s: %d blocks (%d found on disk), engine %s", self.num_slots, self.layout.engine_block_bytes,
                    self.layout.tp_size * self.layout.pp_size, kept, self.ssd_dir or "off", self.ssd_slots, found,
                    self.engine_digest.hex()[:16])

    def _rescan_ssd(self, root: Path) -> int:
        """Register the blocks a previous run left on SSD (shard (0, 0)'s folder stands for all:
        a shard whose file is missing reports it, and vLLM recomputes); delete folders this model
        wrote in an older stored format. Returns the blocks found."""
        fp_dir, fp, stale = engine_shard_dir(root, self.engine_digest, self.fingerprint.model)
        for old in stale:
            logger.warning("kvroute tiers: deleting %s: blocks of an older stored format", old)
            shutil.rmtree(old, ignore_errors=True)
        if fp_dir is None:
            return 0
        infos = sorted(scan_fingerprint_dir(fp_dir, fp.digest(), fp.block_bytes), key=lambda i: i.mtime_s)
        paths = {i.key: i.path for i in infos}
        for key in self.planner.add_ssd_blocks(i.key for i in infos):
            paths[key].unlink(missing_ok=True)
        return len(infos)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """Also learn of vLLM's prefix cache resets: the ``AllBlocksCleared`` event they publish
        makes consumers forget every tier, so the tiers' blocks must be announced again (on their
        next hit). vLLM has no connector hook for this (``reset_cache`` runs only when the
        connector itself is reset), hence the wrapper around the manager's method."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if not self.layout.ok:
            return
        reset = kv_cache_manager.reset_prefix_cache

        def reset_prefix_cache(*args, **kwargs):
            done = reset(*args, **kwargs)
            if done:
                self.planner.unannounce_all()
            return done

        kv_cache_manager.reset_prefix_cache = reset_prefix_cache

    def _state(self, request: "Request") -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            eligible = (getattr(request, "lora_request", None) is None and not getattr(request, "mm_features", None)
                        and getattr(request, "prompt_embeds", None) is None)
            root = tier_root(self.engine_digest, getattr(request, "cache_salt", None)) if eligible else None
            st = self._reqs[request.request_id] = _ReqState(request, root)
        return st

    def _keys(self, st: _ReqState, n_blocks: int) -> list[bytes]:
        have = len(st.keys)
        if n_blocks > have:
            tokens = st.request.prompt_token_ids or []
            st.keys += tier_block_keys(tokens[:n_blocks * self.layout.block_size], self.layout.block_size,
                                       st.root, start=have, parent=st.keys[-1] if have else None)
        return st.keys

    def _engine_hash(self, request: "Request", block: int) -> EngineHash | None:
        hashes = request.block_hashes
        return maybe_convert_block_hash(hashes[block]) if block < len(hashes) else None

    def on_new_request(self, request: "Request") -> None:
        if self.layout.ok:
            self._state(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt's blocks past ``num_computed_tokens`` the tiers (then a peer) hold, never the
        last token. A hit with SSD or peer blocks loads asynchronously (the request waits in
        ``WAITING_FOR_REMOTE_KVS`` while the batch runs); CPU-only hits load in the step. A peer
        lookup runs in the background: until it answers (at most ``peer_locate_timeout_ms``) the
        request is asked about again next step (``None``), never the engine held up."""
        if not self.layout.ok:
            return 0, False
        st = self._state(request)
        if st.skip:
            return 0, False
        bs = self.layout.block_size
        n_max = (len(request.prompt_token_ids or []) - 1) // bs
        start = num_computed_tokens // bs
        if start >= n_max:
            return 0, False
        keys = self._keys(st, n_max)
        tiers = self.planner.lookup(keys[start:n_max])
        n = len(tiers)
        peer, m = None, 0
        pd = None if st.pd_pulled else self._remote_prefill(request)
        if pd is not None:  # P/D: the prefill worker's agent holds the prompt's blocks; no lookup
            peer, upto = pd
            m = max(0, min(upto, n_max) - (start + n))
        elif self.peer_pull and n_max - (start + n) >= max(1, self.settings.peer_pull_min_blocks):
            located = self._locate(st, start + n, n_max)
            if located is None:
                return None, False
            peer, m = located
        asynchronous = m > 0 or SSD in tiers
        self._pending_load[request.request_id] = (start, n, peer, m, asynchronous)
        return (n + m) * bs, asynchronous

    def _remote_prefill(self, request: "Request") -> tuple[str, int] | None:
        """``(peer, blocks)`` when ``request`` came with our P/D params and its blocks can be pulled
        (:func:`remote_prefill_source`); None otherwise (served as any other; why is logged)."""
        source = remote_prefill_source(getattr(request, "kv_transfer_params", None), self.engine_digest.hex())
        if source is None or isinstance(source, tuple) and source[0] == (self.agent_info or {}).get("worker_id"):
            return None
        why = source if isinstance(source, str) else None
        if why is None and not self.peer_pull:
            why = "peer pull is off (no agent, or an agent without peer pull)"
        if why is not None:
            self.stats["pd_refused"] += 1
            logger.warning("kvroute tiers: request %s: P/D params not usable (%s); computing its prompt",
                           request.request_id, why)
            st = self._reqs.get(request.request_id)
            if st is not None:
                st.pd_pulled = True  # said once
            return None
        return source

    def _locate(self, st: _ReqState, first: int, upto: int) -> tuple[str | None, int] | None:
        """Which peer's agent holds blocks ``first..upto-1``, and how many from ``first``; None
        while the background lookup runs. A prefix no peer held is not asked about again for
        ``NO_PEER_TTL_S``."""
        now = time.monotonic()
        key = st.keys[first]
        if self._no_peer.get(key, 0.0) > now:
            return None, 0
        loc = st.locating
        if loc is None or (loc.first, loc.upto) != (first, upto):
            loc = st.locating = _Locate(first, upto, self._locate_pool().submit(self._ask_locate, st, first, upto),
                                        now + self.settings.peer_locate_timeout_ms / 1000)
        if not loc.future.done():
            if now < loc.give_up_at:
                return None
            self.stats["locate_timeouts"] += 1
            logger.info("kvroute tiers: request %s: no answer within %.0f ms on which peer holds blocks %d..%d; "
                        "computing them", st.request.request_id, self.settings.peer_locate_timeout_ms, first, upto - 1)
            return None, 0
        peer, m = loc.future.result()
        m = max(0, min(m, upto - first))
        if not m:
            self._no_peer[key] = now + NO_PEER_TTL_S
            if len(self._no_peer) > NO_PEER_MAX:
                self._no_peer = {k: t for k, t in self._no_peer.items() if t > now}
            return None, 0
        return peer, m

    def _locate_pool(self) -> ThreadPoolExecutor:
        if self._locator is None:
            self._locator = ThreadPoolExecutor(1, thread_name_prefix="kvroute-locate")
            # the link waits as long as the scheduler may wait for the answer (peer_locate_timeout_ms)
            self._locate_link = AgentLink(self.settings.agent_socket,
                                          timeout_s=max(1.0, self.settings.peer_locate_timeout_ms / 1000))
        return self._locator

    def _connect_locate_link(self) -> None:
        try:
            self._locate_link.connect()
        except AgentLinkError as exc:  # the first lookup connects again
            logger.warning("kvroute tiers: cannot reach the agent for peer lookups yet: %s", exc)

    def _ask_locate(self, st: _ReqState, first: int, upto: int) -> tuple[str | None, int]:
        """Background thread: ask the agent (``locate``); no peer on any failure."""
        tokens = array.array("I", (st.request.prompt_token_ids or [])[:upto * self.layout.block_size])
        try:
            answer = self._locate_link.call({"op": "locate", "start_block": first, "max_blocks": upto - first,
                                             "cache_salt": getattr(st.request, "cache_salt", None)},
                                            memoryview(tokens).cast("B"))
            if answer.get("ok") and answer.get("peer") is not None:
                return str(answer["peer"]), int(answer.get("blocks") or 0)
        except (AgentLinkError, TypeError, ValueError) as exc:
            self.stats["locate_failures"] += 1
            logger.debug("kvroute tiers: locate failed: %s", exc)
        return None, 0

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        if not self.layout.ok:
            return
        pending = self._pending_load.pop(request.request_id, None)
        if num_external_tokens <= 0 or pending is None:
            return
        bs = self.layout.block_size
        start, n, peer, m, asynchronous = pending
        n_ext = min(n + m, num_external_tokens // bs)
        n_local = min(n, n_ext)
        st = self._state(request)
        block_ids = blocks.get_block_ids()[0][start:start + n_ext]
        keys = st.keys[start:start + n_ext]
        hashes = [self._engine_hash(request, b) for b in range(start, start + n_local)]
        ops, tiers = self.planner.plan_load(keys[:n_local], block_ids[:n_local], hashes, promote=not asynchronous)
        if n_ext > n_local:  # the rest from a peer, through the agent; saved to the CPU tier once loaded
            pd = not st.pd_pulled and self._remote_prefill(request) is not None
            # P/D: the prefill side's saves may land after its answer: the pull waits for them
            ops.append(LoadPeer(peer, keys[n_local:], block_ids[n_local:], pd=pd))
            tiers += [PEER] * (n_ext - n_local)
            if pd:
                st.pd_pulled = True
                self.stats["pd_pulls"] += 1
        # asynchronous: CPU-tier copies in the step (ordered with the slots' other copies), the rest in the background
        if asynchronous:
            self._pre_ops += [op for op in ops if isinstance(op, LoadCpu)]
            self._async_loads[request.request_id] = [op for op in ops if not isinstance(op, LoadCpu)]
        else:
            self._pre_ops += ops
        self._hit_tiers[request.request_id] = tiers
        st.saved_upto = max(st.saved_upto, start + n_local)
        by = Counter(tiers)
        self.stats.update({f"loaded_blocks_{t}": c for t, c in by.items()})
        located_ms = None if st.locating is None else (time.monotonic() - st.locating.t0) * 1000
        logger.info("kvroute tiers: request %s: %d tokens from the tiers (blocks: cpu %d, ssd %d, peer %d%s, "
                    "gone %d) after %d on GPU, %s%s", request.request_id, n_ext * bs, by[CPU], by[SSD], by[PEER],
                    f" from {peer}" if by[PEER] else "", by["miss"], start * bs,
                    "asynchronously" if asynchronous else "in the step",
                    "" if located_ms is None or not by[PEER] else f"; peer located {located_ms:.1f} ms before")

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        tiers = self._hit_tiers.pop(request.request_id, None)
        if not num_external_tokens:
            return {}
        if tiers is None:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        bs = self.layout.block_size
        by = Counter(tiers)
        out = {CacheHitSource.HOST: by[CPU] * bs, CacheHitSource.DISK: by[SSD] * bs,
               CacheHitSource.P2P: by[PEER] * bs}
        out[CacheHitSource.EXTERNAL_UNSPECIFIED] = num_external_tokens - sum(out.values())
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if not self.layout.ok:
            return TierConnectorMetadata([], [], {})
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        bs = self.layout.block_size
        post: list[TierOp] = []
        wait_saves = False
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None or st.skip or rid not in computed:
                continue
            prompt_blocks = len(st.request.prompt_token_ids or []) // bs
            upto = min(prompt_blocks, (computed[rid] + n_sched) // bs)
            if upto <= st.saved_upto:
                continue
            wait_saves = wait_saves or (upto == prompt_blocks and _remote_decode(st.request))
            keys = self._keys(st, upto)
            block_ids = self._kv_cache_manager.get_block_ids(rid)[0]
            for b in range(st.saved_upto, upto):
                ops = self.planner.plan_save(keys[b], block_ids[b], self._engine_hash(st.request, b))
                self.stats["saved_blocks"] += bool(ops)
                post += ops
            st.saved_upto = upto
            self.planner.touch_chain(keys[:upto])
        meta = TierConnectorMetadata(self._pre_ops, post, self._async_loads, wait_saves)
        self._pre_ops, self._async_loads = [], {}
        return meta

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, TierWorkerMetadata):
            return
        until = time.monotonic() + NO_PEER_TTL_S
        for peer, key in meta.short_pulls:  # vLLM re-queues the request: compute from there, do not pull again
            self._no_peer[key] = until
            for st in self._reqs.values():
                if st.locating is not None and st.locating.peer_answer()[0] == peer:
                    st.locating = None
        self.stats["short_pulls"] += len(meta.short_pulls)
        if not meta.failures:
            return
        for key, tier, slot in meta.failures:
            self.planner.forget(key, tier, slot)
        self.stats["failed_blocks"] += len(meta.failures)
        for st in self._reqs.values():  # re-offer their blocks: a failed step saved nothing
            st.saved_upto = 0
        logger.warning("kvroute tiers: %d block copies failed and were forgotten", len(meta.failures))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        """Forget the request; a P/D prefill request (``do_remote_decode``) answers where its blocks
        are (:func:`prefill_answer`), or None when it cannot (logged). No GPU block is held: the
        blocks are in the agent's tiers."""
        st = self._reqs.pop(request.request_id, None)
        self._pending_load.pop(request.request_id, None)
        self._hit_tiers.pop(request.request_id, None)
        if not _remote_decode(request):
            return False, None
        return False, self._prefill_params(request, st)

    def _prefill_params(self, request: "Request", st: _ReqState | None) -> dict | None:
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return None  # nobody reads it
        why = None
        if not self.layout.ok:
            why = "the tiers are disabled for this model"
        elif self.agent_info is None:
            why = "no offload agent (agent_socket unset or not answering): nothing can serve the blocks"
        elif not self.agent_info.get("serves_peers"):
            why = "the agent does not serve peers (start it with --serve-peers)"
        elif st is None or st.skip:
            why = "the tiers do not store this request (LoRA, multimodal inputs or prompt embeddings)"
        if why is not None:
            self.stats["pd_refused"] += 1
            logger.warning("kvroute tiers: request %s asked for remote decode, refused: %s; answering no "
                           "kv_transfer_params", request.request_id, why)
            return None
        bs = self.layout.block_size
        full = len(request.prompt_token_ids or []) // bs
        held = len(self.planner.lookup(self._keys(st, full)[:full]))
        self.stats["pd_prefills"] += 1
        logger.info("kvroute tiers: request %s: prefilled for remote decode, %d of %d full prompt blocks in "
                    "the tiers of %s", request.request_id, held, full, self.agent_info["worker_id"])
        return prefill_answer(str(self.agent_info["worker_id"]), held, self.engine_digest.hex())

    def take_events(self):
        if not self.layout.ok:
            return ()
        events: list = []
        last: tuple | None = None
        for ch in self.planner.take_changes():
            if ch.engine_hash is None:
                continue
            kind = (ch.op, ch.tier)
            if kind == last:
                events[-1].block_hashes.append(ch.engine_hash)
                continue
            medium = _MEDIUM[ch.tier]
            if ch.op == "stored":
                events.append(BlockStored(block_hashes=[ch.engine_hash], parent_block_hash=None, token_ids=[],
                                          block_size=0, lora_id=None, medium=medium, lora_name=None))
            else:
                events.append(BlockRemoved(block_hashes=[ch.engine_hash], medium=medium))
            last = kind
        return events

    def reset_cache(self) -> bool:
        if self.layout.ok:
            self._pre_ops += self.planner.clear()
            for st in self._reqs.values():
                st.saved_upto = 0
        return True

    # ============================================ worker side ======================================
    def _init_worker(self) -> None:
        _request_amx_permission()
        self.worker: TierWorker | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Read vLLM's KV cache views (any 0.32 layout; :class:`PagedKV`), fingerprint this shard
        from them, say hello to the agent with it, map its CPU tier file (or make a local slab) and
        start the byte path (:class:`TierWorker`). Raises ValueError for views it cannot store."""
        if not self.layout.ok:
            return
        L = self.layout
        try:
            kv = PagedKV([kv_caches[name] for name in L.layer_names], L.num_blocks, L.layer_names)
        except LayoutError as exc:
            raise ValueError(f"kvroute tiers: {exc}") from exc
        self.fingerprint = fp = L.fingerprint(self.settings.model_id, kv.layout, kv.block_bytes)
        if self.settings.agent_socket:
            self._hello_agent("worker", fp)
        self._size_tiers()
        shm = self._attach_slab(fp.digest(), kv.block_bytes) if self.agent_info is not None else None
        if self.agent_info is not None and shm is None:
            self.agent_info, self.peer_pull = None, False
        pull = _AgentPuller(self.settings, self._hello_header("worker", fp), fp.digest()) if self.peer_pull else None
        self.worker = TierWorker(kv, self.num_slots, fp, Path(self.ssd_dir) if self.ssd_dir else None, shm=shm,
                                 pull=pull)
        where = (f"the agent's shared memory {shm.path}" if shm is not None else "host memory of its own")
        logger.info("kvroute tiers: shard tp %d/%d pp %d/%d: %d slots of %d bytes in %s (%s), %d layers, page %s, "
                    "%s", L.tp_rank, L.tp_size, L.pp_rank, L.pp_size, self.num_slots, kv.block_bytes, where,
                    "pinned" if self.worker.pinned else ("unpinned" if kv.device.type == "cuda" else "CPU build"),
                    kv.num_layers, kv.layout, "one copy kernel for all layers" if kv.all_layers else "per-layer copies")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, TierConnectorMetadata):
            return
        if meta.pre_ops:
            self.worker.run_loads(meta.pre_ops)
        for req_id, ops in meta.async_loads.items():
            self.worker.start_async(req_id, ops)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves run once per step in wait_for_save, over all layers

    def wait_for_save(self) -> None:
        """Enqueue the step's saves (on CUDA the host does not wait for them: the slots are marked
        written once their copy completes)."""
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, TierConnectorMetadata):
            self.worker.run_saves(meta.post_ops)
            if meta.wait_saves:
                self.worker.settle_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return None, self.worker.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid_blocks() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        failures, short = self.worker.take_failures(), self.worker.take_short_pulls()
        return TierWorkerMetadata(failures, short) if failures or short else None

    def shutdown(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.close()
            self.worker = None


def _remote_decode(request: "Request") -> bool:
    """Whether ``request`` is a P/D prefill (``kv_transfer_params.do_remote_decode``)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


NO_PEER_TTL_S = 2.0   # a prefix no peer held is not looked up again for this long
NO_PEER_MAX = 4096    # remembered misses before expired ones are swept


def _hello(link: AgentLink, header: dict[str, Any], wait_s: float) -> dict[str, Any] | None:
    """Send ``header`` (a hello) until the agent answers ok, for up to ``wait_s``; None if not."""
    give_up = time.monotonic() + wait_s
    while True:
        try:
            answer = link.call(header)
            if answer.get("ok"):
                return answer
            logger.warning("kvroute tiers: the agent refused the hello: %s", answer.get("error"))
        except AgentLinkError as exc:
            logger.debug("kvroute tiers: agent not answering yet: %s", exc)
        if time.monotonic() >= give_up:
            return None
        time.sleep(0.2)


class _AgentPuller:
    """The worker's pulls through its agent (:data:`PullFn`), on a link of their own (they run in
    the byte path's background thread); a pull longer than the agent's pull area goes in parts,
    within one deadline. ``wait=True`` (P/D): a part that falls short is asked for again from its
    first missing block, after a pause growing from ``RETRY_FIRST_S`` to ``RETRY_MAX_S``, until
    the deadline (the prefill side's saves may land after its answer)."""

    RETRY_FIRST_S = 0.01
    RETRY_MAX_S = 0.1

    def __init__(self, settings: TierSettings, hello: dict[str, Any], digest: bytes) -> None:
        self.settings = settings
        self.link = AgentLink(settings.agent_socket, timeout_s=5.0)
        self.hello = hello
        self.digest = digest
        self.greeted = False

    def __call__(self, peer: str, keys: list[bytes], into: memoryview, wait: bool = False) -> tuple[int, str | None]:
        if not self.greeted:
            self.greeted = _hello(self.link, self.hello, 0.0) is not None
            if not self.greeted:
                return 0, "the agent did not answer"
        bb = int(self.hello["block_bytes"])
        room = int((self.link.hello_answer or {}).get("pull_bytes") or len(keys) * bb)
        per_pull = max(1, room // bb)  # the agent's pull area holds this many blocks
        give_up = time.monotonic() + self.settings.peer_pull_deadline_ms / 1000
        done, pause, retries = 0, self.RETRY_FIRST_S, 0
        while done < len(keys):
            part = keys[done:done + per_pull]
            left_ms = (give_up - time.monotonic()) * 1000
            if left_ms <= 0:
                return done, f"deadline: the pull's time ran out between its parts{_tries(retries)}"
            got = self.link.pull(peer, part, self.digest, left_ms, into[done * bb:(done + len(part)) * bb],
                                 connect_timeout_ms=self.settings.peer_connect_timeout_ms)
            done += got.blocks
            if got.blocks < len(part):
                if not wait or _no_retry(got.error):
                    return done, got.error
                if time.monotonic() + pause >= give_up:
                    return done, f"{got.error}{_tries(retries)}"
                retries += 1
                logger.debug("kvroute tiers: pull from %s: %d of %d blocks so far (%s); asking again",
                             peer, done, len(keys), got.error)
                time.sleep(pause)
                pause = min(pause * 2, self.RETRY_MAX_S)
        if retries:
            logger.info("kvroute tiers: pull from %s: all %d blocks after %d retries", peer, len(keys), retries)
        return done, None


def _no_retry(error: str | None) -> bool:
    """Whether a P/D pull that fell short with ``error`` must not ask again before its deadline: its
    agent skips the peer after pulls that found it unreachable or silent (``breaker: ...``,
    answered at once; asking again would spin until the deadline). Anything else (blocks not
    saved yet, a transfer corrupted on the wire, a first connection failure) is asked again."""
    return (error or "").split(":", 1)[0] == "breaker"


def _tries(retries: int) -> str:
    return f", after {retries} retries" if retries else ""
