"""``KVRouteTierConnector``: vLLM's KV connector (``KVConnectorBase_V1``) in front of our CPU and
SSD tiers. Loaded by vLLM with::

    --kv-transfer-config '{"kv_connector": "KVRouteTierConnector",
        "kv_connector_module_path": "offload_agent.connector.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_tier_bytes": N, "ssd_tier_dir": DIR, "ssd_tier_bytes": N}}'

(:func:`offload_agent.connector.config.kv_transfer_config` builds it; the repository root must be
on vLLM's ``PYTHONPATH``.) Imports only vLLM, torch and the standard library.

What it does, per engine step (vLLM 0.32 connector API):

- scheduler side, ``get_num_new_matched_tokens``: the request's prompt blocks past vLLM's own
  prefix hit that the tiers hold, as a consecutive run (never the whole prompt: the last token is
  always computed); loads are synchronous (this step, before the forward pass);
- ``update_state_after_alloc``: plans the copies of those blocks into the GPU blocks vLLM just
  allocated (:meth:`TierPlanner.plan_load`);
- ``build_connector_meta``: plans saves. **A full prompt block is saved in the step whose forward
  pass computes it** (read after that pass, in ``wait_for_save``), not when the request finishes:
  the block is surely resident then, no block has to be held back from vLLM's allocator after the
  request ends, a long chunked prefill is saved chunk by chunk, and an identical prompt arriving
  while the first is still decoding already finds it. Only prompt blocks are saved (decode blocks
  are rarely shared);
- worker side: ``start_load_kv`` runs the load operations, ``wait_for_save`` the save operations,
  each batched per layer with ``index_select``/``index_copy_``. On CUDA the slab is pinned and
  copies run on a side stream; the forward stream waits for the loads (GPU-side, the CPU is not
  blocked) and ``wait_for_save`` synchronises the saves. (Only the CPU build is tested here.)
- failures (a slot or file that does not hold what it should, a corrupt file): the GPU blocks are
  reported to vLLM (``get_block_ids_with_load_errors``), which recomputes them; nothing of that step
  is saved (its KV may depend on the bad block); the planner forgets the bad copies
  (worker -> scheduler metadata);
- residency: ``take_events`` hands vLLM ``BlockStored``/``BlockRemoved`` with medium ``CPU`` /
  ``STORAGE`` and no tokens (vLLM's placeholder form: the block's hash only), published on vLLM's
  own KV event stream after the step's GPU events. Consumers map the hash through the GPU event
  that preceded it.

With the worker's offload agent on ``agent_socket`` (:mod:`offload_agent.agent_link`; both sides
say hello at start, waiting up to ``agent_wait_s``; without an answer, local tiers as above):

- the CPU slab is the agent's shared memory file (:mod:`offload_agent.tiers.shm_slab`), each
  slot written between ``begin_write`` and ``end_write`` so the agent can serve it to peers; the
  SSD folder is the agent's; the planner starts with the blocks the file still holds;
- peer pull: when the local tiers end before the prompt's creditable blocks (at least
  ``peer_pull_min_blocks`` short), the scheduler side asks the agent (``locate``, at most
  ``peer_locate_timeout_ms``) which peer holds the next blocks, and offers them to vLLM as
  external tokens (source ``p2p``); the worker side's ``load_peer`` op asks the agent to pull them
  (``pull``, deadline ``peer_pull_deadline_ms``), copies what came (each block verified by the
  agent) into vLLM's blocks and reports the rest failed, so vLLM recomputes it. Pulled blocks are
  then saved to the CPU tier like computed ones. The pull runs synchronously in the step, as the
  local loads do.

Requests with a LoRA adapter, multimodal inputs or prompt embeddings are neither saved nor loaded
(their KV depends on more than the tokens). Models with more than one KV cache group (hybrid
attention) disable the connector with a warning.
"""
from __future__ import annotations

import array
import os
import time
from collections import Counter
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

from offload_agent.agent_link import AgentLink, AgentLinkError
from offload_agent.connector.config import TierSettings
from offload_agent.tiers.keys import TierFingerprint, tier_block_keys, tier_root
from offload_agent.tiers.planner import CPU, SSD, EngineHash, TierPlanner
from offload_agent.tiers.shm_slab import ShmSlab, SlabMismatch
from offload_agent.tiers.ssd_file import HEADER_BYTES, scan_fingerprint_dir
from offload_agent.tiers.store import TierStore

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
    ``post_ops`` after it (saves); see :data:`offload_agent.tiers.planner.Op`."""

    def __init__(self, pre_ops: list, post_ops: list) -> None:
        self.pre_ops = pre_ops
        self.post_ops = post_ops


class TierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: ``failures`` as ``(key, tier, slot)`` to forget."""

    def __init__(self, failures: list) -> None:
        self.failures = failures

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        return TierWorkerMetadata(self.failures + list(getattr(other, "failures", [])))


class _Layout:
    """The KV cache layout the tiers store: one group's layers, bytes per block per layer."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", tp_rank: int) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.ok = len(groups) == 1
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        if not self.ok:
            self.layer_names, self.page_bytes, self.dtype = [], 0, torch.uint8
            return
        spec = groups[0].kv_cache_spec
        self.layer_names = list(groups[0].layer_names)
        self.page_bytes = int(spec.page_size_bytes)
        self.dtype = spec.dtype
        self.block_bytes = self.page_bytes * len(self.layer_names)
        shape = "x".join(str(getattr(spec, a, "?")) for a in ("num_kv_heads", "head_size"))
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = tp_rank
        self.model = str(vllm_config.model_config.model)
        self.shape = shape

    def fingerprint(self, model_id: str | None) -> TierFingerprint:
        return TierFingerprint(model=model_id or self.model, num_layers=len(self.layer_names),
                               dtype=str(self.dtype).replace("torch.", ""), block_size=self.block_size,
                               block_bytes=self.block_bytes, layout=self.shape, tp_rank=self.tp_rank,
                               tp_size=self.tp_size)


class _ReqState:
    __slots__ = ("request", "keys", "root", "saved_upto", "skip", "located")

    def __init__(self, request: "Request", root: bytes | None) -> None:
        self.request = request
        self.root = root
        self.keys: list[bytes] = []
        self.saved_upto = 0
        self.skip = root is None
        self.located: tuple[int, int, str | None, int] | None = None  # (from, upto, peer, blocks)


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
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            tp_rank = get_tensor_model_parallel_rank()
        self.layout = _Layout(vllm_config, kv_cache_config, tp_rank)
        if not self.layout.ok:
            logger.warning("kvroute tiers disabled: %d KV cache groups (only single-group models are "
                           "supported)", len(kv_cache_config.kv_cache_groups))
            return
        self.fingerprint = self.layout.fingerprint(self.settings.model_id)
        self.agent: AgentLink | None = None
        self.agent_info: dict[str, Any] | None = None
        self.peer_pull = False
        cpu_bytes, self.ssd_dir, ssd_bytes = (self.settings.cpu_tier_bytes, self.settings.ssd_tier_dir,
                                              self.settings.ssd_tier_bytes)
        if self.settings.agent_socket:
            self._hello_agent("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        if self.agent_info is not None:
            self.num_slots = int(self.agent_info["num_slots"])
            self.ssd_dir = self.agent_info.get("ssd_dir") or None
            ssd_bytes = int(self.agent_info.get("ssd_tier_bytes") or 0) if self.ssd_dir else 0
            self.peer_pull = bool(self.agent_info.get("peer_pull"))
        else:
            self.num_slots = cpu_bytes // self.layout.block_bytes
        if self.num_slots < 1:
            raise ValueError(f"cpu_tier_bytes={cpu_bytes} holds no block of {self.layout.block_bytes} bytes")
        self.ssd_slots = ssd_bytes // (HEADER_BYTES + self.layout.block_bytes)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    def _hello_agent(self, role: str) -> None:
        """Find the agent that owns the tiers (waiting up to ``agent_wait_s`` for its socket);
        without an answer, local tiers as configured (a warning says so)."""
        link = AgentLink(self.settings.agent_socket, timeout_s=5.0)
        hello = {"op": "hello", "role": role, "pid": os.getpid(), "block_bytes": self.layout.block_bytes,
                 "fingerprint": asdict(self.fingerprint), "fingerprint_digest": self.fingerprint.digest().hex()}
        give_up = time.monotonic() + self.settings.agent_wait_s
        while True:
            try:
                answer = link.call(hello)
                if not answer.get("ok"):
                    raise AgentLinkError(str(answer.get("error")))
                break
            except AgentLinkError as exc:
                if time.monotonic() >= give_up:
                    logger.warning("kvroute tiers (%s): no offload agent at %s (%s); running local tiers only",
                                   role, self.settings.agent_socket, exc)
                    link.close()
                    return
                time.sleep(0.2)
        self.agent, self.agent_info = link, answer
        logger.info("kvroute tiers (%s): the agent of worker %s owns the tiers: CPU tier %s (%d slots), "
                    "SSD tier %s, peer pull %s", role, answer.get("worker_id"), answer["shm_path"],
                    answer["num_slots"], answer.get("ssd_dir") or "off", "on" if answer.get("peer_pull") else "off")

    def _attach_slab(self) -> ShmSlab | None:
        """Map the agent's CPU tier file; None (and local tiers) when it is not the expected one."""
        try:
            shm = ShmSlab.attach(self.agent_info["shm_path"])
        except (OSError, SlabMismatch) as exc:
            logger.warning("kvroute tiers: cannot map the agent's CPU tier: %s", exc)
            return None
        if (shm.fingerprint_digest, shm.block_bytes, shm.num_slots) != (
                self.fingerprint.digest(), self.layout.block_bytes, self.num_slots):
            logger.warning("kvroute tiers: the agent's CPU tier %s has another layout", shm.path)
            return None
        return shm

    # =========================================== scheduler side ====================================
    def _init_scheduler(self) -> None:
        self.planner = TierPlanner(self.num_slots, self.ssd_slots)
        self._fp_digest = self.fingerprint.digest()
        self._reqs: dict[str, _ReqState] = {}
        self._pending_load: dict[str, tuple[int, int, str | None, int]] = {}
        self._locate_ms: dict[str, float] = {}  # request -> how long its peer lookup took
        self._hit_tiers: dict[str, list[str]] = {}
        self._pre_ops: list = []
        self.stats: Counter = Counter()
        found = 0
        if self.ssd_dir:
            fp_dir = Path(self.ssd_dir) / self.fingerprint.dir_name()
            infos = sorted(scan_fingerprint_dir(fp_dir, self._fp_digest, self.layout.block_bytes),
                           key=lambda i: i.mtime_s)
            found = len(infos)
            paths = {i.key: i.path for i in infos}
            for key in self.planner.add_ssd_blocks(i.key for i in infos):
                paths[key].unlink(missing_ok=True)
        kept = 0
        if self.agent_info is not None:
            shm = self._attach_slab()
            if shm is None:
                self.agent_info, self.peer_pull = None, False
            else:
                kept = self.planner.add_cpu_blocks(shm.stable_slots())  # the tier outlived a restart
                shm.close()
        logger.info("kvroute tiers: CPU tier %d blocks of %d bytes (%d bytes, %d kept from before), SSD tier "
                    "%s: %d blocks (%d found on disk), fingerprint %s", self.num_slots, self.layout.block_bytes,
                    self.num_slots * self.layout.block_bytes, kept, self.ssd_dir or "off",
                    self.ssd_slots, found, self.fingerprint.dir_name())

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
            root = tier_root(self._fp_digest, getattr(request, "cache_salt", None)) if eligible else None
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
        n = len(self.planner.lookup(keys[start:n_max]))
        peer, m = None, 0
        if self.peer_pull and n_max - (start + n) >= max(1, self.settings.peer_pull_min_blocks):
            peer, m = self._locate(st, start + n, n_max)
        self._pending_load[request.request_id] = (start, n, peer, m)
        return (n + m) * bs, False

    def _locate(self, st: _ReqState, first: int, upto: int) -> tuple[str | None, int]:
        """Which peer's agent holds blocks ``first..upto-1`` of the prompt, and how many from
        ``first`` (asked once per request and position; no peer when the agent is slow)."""
        if st.located is not None and st.located[:2] == (first, upto):
            return st.located[2], st.located[3]
        tokens = array.array("I", (st.request.prompt_token_ids or [])[:upto * self.layout.block_size])
        t0 = time.monotonic()
        try:
            answer = self.agent.call({"op": "locate", "start_block": first, "max_blocks": upto - first,
                                      "cache_salt": getattr(st.request, "cache_salt", None)},
                                     memoryview(tokens).cast("B"),
                                     timeout_s=self.settings.peer_locate_timeout_ms / 1000)
            peer, m = answer.get("peer"), int(answer.get("blocks") or 0)
            if not answer.get("ok") or peer is None:
                peer, m = None, 0
        except (AgentLinkError, TypeError, ValueError) as exc:
            self.stats["locate_failures"] += 1
            logger.debug("kvroute tiers: locate failed: %s", exc)
            peer, m = None, 0
        m = max(0, min(m, upto - first))
        self._locate_ms[st.request.request_id] = (time.monotonic() - t0) * 1000
        st.located = (first, upto, peer, m)
        return (peer, m) if m else (None, 0)

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        if not self.layout.ok:
            return
        pending = self._pending_load.pop(request.request_id, None)
        if num_external_tokens <= 0 or pending is None:
            return
        bs = self.layout.block_size
        start, n, peer, m = pending
        n_ext = min(n + m, num_external_tokens // bs)
        n_local = min(n, n_ext)
        st = self._state(request)
        block_ids = blocks.get_block_ids()[0][start:start + n_ext]
        keys = st.keys[start:start + n_ext]
        hashes = [self._engine_hash(request, b) for b in range(start, start + n_local)]
        ops, tiers = self.planner.plan_load(keys[:n_local], block_ids[:n_local], hashes)
        if n_ext > n_local:  # the rest from a peer, through the agent; saved to the CPU tier once loaded
            ops.append(("load_peer", peer, keys[n_local:], block_ids[n_local:]))
            tiers += [PEER] * (n_ext - n_local)
        self._pre_ops += ops
        self._hit_tiers[request.request_id] = tiers
        st.saved_upto = max(st.saved_upto, start + n_local)
        by = Counter(tiers)
        self.stats.update({f"loaded_blocks_{t}": c for t, c in by.items()})
        located_ms = self._locate_ms.pop(request.request_id, None)
        logger.info("kvroute tiers: request %s: %d tokens from the tiers (blocks: cpu %d, ssd %d, peer %d%s, "
                    "gone %d) after %d on GPU%s", request.request_id, n_ext * bs, by[CPU], by[SSD], by[PEER],
                    f" from {peer}" if by[PEER] else "", by["miss"], start * bs,
                    "" if located_ms is None else f"; peer located in {located_ms:.1f} ms")

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
            return TierConnectorMetadata([], [])
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        bs = self.layout.block_size
        post: list = []
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None or st.skip or rid not in computed:
                continue
            prompt_blocks = len(st.request.prompt_token_ids or []) // bs
            upto = min(prompt_blocks, (computed[rid] + n_sched) // bs)
            if upto <= st.saved_upto:
                continue
            keys = self._keys(st, upto)
            block_ids = self._kv_cache_manager.get_block_ids(rid)[0]
            for b in range(st.saved_upto, upto):
                ops = self.planner.plan_save(keys[b], block_ids[b], self._engine_hash(st.request, b))
                self.stats["saved_blocks"] += bool(ops)
                post += ops
            st.saved_upto = upto
            self.planner.touch_chain(keys[:upto])
        meta = TierConnectorMetadata(self._pre_ops, post)
        self._pre_ops = []
        return meta

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, TierWorkerMetadata) or not meta.failures:
            return
        for key, tier, slot in meta.failures:
            self.planner.forget(key, tier, slot)
        self.stats["failed_blocks"] += len(meta.failures)
        for st in self._reqs.values():  # re-offer their blocks: a failed step saved nothing
            st.saved_upto = 0
        logger.warning("kvroute tiers: %d block copies failed and were forgotten", len(meta.failures))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        self._reqs.pop(request.request_id, None)
        self._pending_load.pop(request.request_id, None)
        self._hit_tiers.pop(request.request_id, None)
        self._locate_ms.pop(request.request_id, None)
        return False, None

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
        self._kv: list[torch.Tensor] = []
        self._store: TierStore | None = None
        self._invalid: set[int] = set()
        self._failed_step = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.layout.ok:
            return
        L = self.layout
        views = []
        for name in L.layer_names:
            t = kv_caches[name]
            if t.shape[0] != L.num_blocks and t.dim() > 1 and t.shape[1] == L.num_blocks:
                t = t.transpose(0, 1)  # (2, blocks, ...) layouts: blocks first
            if t.shape[0] != L.num_blocks or t[0].numel() * t.element_size() != L.page_bytes:
                raise ValueError(f"kvroute tiers: layer {name}: KV cache of shape {tuple(t.shape)} does not "
                                 f"hold {L.num_blocks} blocks of {L.page_bytes} bytes")
            views.append(t)
        self._kv = views
        self._device = views[0].device
        cuda = self._device.type == "cuda"
        shm = self._attach_slab() if self.agent_info is not None else None
        if shm is not None:  # the agent's shared memory; registered with CUDA for fast copies
            self._slab = torch.frombuffer(shm.slab, dtype=torch.uint8).view(self.num_slots, L.block_bytes)
            if cuda:
                torch.cuda.cudart().cudaHostRegister(self._slab.data_ptr(), self._slab.numel(), 0)
            where = f"the agent's shared memory {shm.path}"
        else:
            if self.agent_info is not None:
                self.agent_info, self.peer_pull = None, False
            self._slab = torch.empty((self.num_slots, L.block_bytes), dtype=torch.uint8, pin_memory=cuda)
            where = "pinned host memory" if cuda else "host memory"
        self._slab_kv = self._slab.view(L.dtype).view(self.num_slots, len(views), -1)
        self._staging_rows(1)
        self._pull_buf: torch.Tensor | None = None
        self._stream = torch.cuda.Stream(device=self._device) if cuda else None
        ssd = Path(self.ssd_dir) if self.ssd_dir else None
        self._store = TierStore(self._slab.numpy(), self.num_slots, L.block_bytes, self.fingerprint, ssd, shm=shm)
        logger.info("kvroute tiers: worker slab %d x %d bytes in %s, %d layers", self.num_slots,
                    L.block_bytes, where, len(views))

    def _staging_rows(self, n: int) -> None:
        """Make the staging buffer (blocks read from SSD on their way to vLLM) hold ``n`` blocks."""
        if getattr(self, "_staging", None) is not None and self._staging.shape[0] >= n:
            return
        L = self.layout
        self._staging = torch.empty((n, L.block_bytes), dtype=torch.uint8, pin_memory=self._device.type == "cuda")
        self._staging_kv = self._staging.view(L.dtype).view(n, len(self._kv), -1)

    def _read_ahead(self, ops: list) -> dict[int, tuple[int, bool]]:
        """Read the SSD files of this list's ``promote``/``load_ssd`` ops in parallel into staging
        rows: ``{op index: (row, ok)}``. A key whose file an earlier op of the list writes or
        deletes is left to be read in order."""
        touched: set[bytes] = set()
        picks: list[int] = []
        for i, op in enumerate(ops):
            if op[0] == "spill":
                touched.add(op[2])
            elif op[0] == "drop_ssd":
                touched.add(op[1])
            elif op[0] in ("promote", "load_ssd") and op[1] not in touched:
                picks.append(i)
        self._sync_row = len(picks)  # the row for reads done in order
        self._staging_rows(len(picks) + 1)
        if not picks:
            return {}
        oks = self._store.read_ssd_many([ops[i][1] for i in picks],
                                        [self._staging[r].numpy() for r in range(len(picks))])
        return {i: (r, ok) for r, (i, ok) in enumerate(zip(picks, oks))}

    def _copy_to_slab(self, slots: list[int], gpu_blocks: list[int]) -> None:
        idx = torch.tensor(gpu_blocks, dtype=torch.long, device=self._device)
        sl = torch.tensor(slots, dtype=torch.long)
        for l, t in enumerate(self._kv):
            self._slab_kv[sl, l] = t.index_select(0, idx).reshape(len(slots), -1).to("cpu")

    def _copy_from(self, src: torch.Tensor, rows: list[int], gpu_blocks: list[int]) -> None:
        idx = torch.tensor(gpu_blocks, dtype=torch.long, device=self._device)
        rows_t = torch.tensor(rows, dtype=torch.long)
        for l, t in enumerate(self._kv):
            data = src[rows_t, l].reshape(len(rows), *t.shape[1:])
            t.index_copy_(0, idx, data.to(self._device, non_blocking=True))

    def _run_ops(self, ops: list, saving: bool) -> None:
        store = self._store
        batch: list[tuple] = []  # consecutive "save" or "load_cpu" ops

        def flush() -> None:
            if not batch:
                return
            if batch[0][0] == "save":
                for op in batch:
                    store.begin(op[1])
                self._copy_to_slab([op[1] for op in batch], [op[3] for op in batch])
                for op in batch:
                    store.mark(op[1], op[2])
            else:
                self._copy_from(self._slab_kv, [op[1] for op in batch], [op[3] for op in batch])
            batch.clear()

        ahead = {} if saving else self._read_ahead(ops)
        for i, op in enumerate(ops):
            kind = op[0]
            if kind == "save":
                if self._failed_step:
                    store.mark(op[1], None)
                    store.fail(op[2], CPU, op[1])
                    continue
                if batch and batch[0][0] != "save":
                    flush()
                batch.append(op)
                continue
            if kind == "load_cpu":
                if not store.holds(op[1], op[2]):
                    self._load_failed(op[3])
                    store.fail(op[2], CPU, op[1])
                    continue
                if batch and batch[0][0] != "load_cpu":
                    flush()
                batch.append(op)
                continue
            flush()
            if kind == "spill":
                store.spill(op[1], op[2])
            elif kind == "drop_ssd":
                store.drop_ssd(op[1])
            elif kind == "promote":
                if i not in ahead:
                    store.promote(op[1], op[2])
                elif ahead[i][1]:
                    store.put(op[2], op[1], self._staging[ahead[i][0]].numpy())
                else:
                    store.mark(op[2], None)
                    store.fail(op[1], CPU, op[2])
            elif kind == "load_ssd":
                row, ok = ahead.get(i, (self._sync_row, None))
                if ok is None:
                    ok = store.read_ssd(op[1], self._staging[row].numpy())
                if ok:
                    self._copy_from(self._staging_kv, [row], [op[2]])
                else:
                    self._load_failed(op[2])
            elif kind == "load_peer":
                self._load_from_peer(op[1], op[2], op[3])
            elif kind == "fail_block":
                self._load_failed(op[1])
        flush()

    def _load_from_peer(self, peer: str, keys: list[bytes], gpu_blocks: list[int]) -> None:
        """Pull ``keys`` from ``peer`` through the agent (verified there) into ``gpu_blocks``;
        blocks that do not come in time are reported failed, so vLLM recomputes them."""
        L = self.layout
        n = len(keys)
        if self._pull_buf is None or self._pull_buf.shape[0] < n:
            self._pull_buf = torch.empty((n, L.block_bytes), dtype=torch.uint8, pin_memory=self._device.type == "cuda")
            self._pull_kv = self._pull_buf.view(L.dtype).view(n, len(self._kv), -1)
        deadline_ms = self.settings.peer_pull_deadline_ms
        got, error = 0, None
        t0 = time.monotonic()
        try:
            answer = self.agent.call({"op": "pull", "peer": peer, "deadline_ms": deadline_ms},
                                     memoryview(b"".join(keys)), timeout_s=deadline_ms / 1000 + 1.0,
                                     into=memoryview(self._pull_buf.numpy()).cast("B"))
            if answer.get("ok"):
                got = min(n, int(answer.get("payload_bytes", 0)) // L.block_bytes)
            error = answer.get("error")
        except (AgentLinkError, TypeError, ValueError) as exc:
            error = str(exc)
        if got:
            self._copy_from(self._pull_kv, list(range(got)), gpu_blocks[:got])
        for g in gpu_blocks[got:]:
            self._load_failed(g)
        logger.info("kvroute tiers: pulled %d of %d blocks from %s in %.1f ms%s", got, n, peer,
                    (time.monotonic() - t0) * 1000, f" ({error}; the rest is recomputed)" if got < n else "")

    def _load_failed(self, gpu_block: int) -> None:
        self._invalid.add(gpu_block)
        self._failed_step = True

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._store is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, TierConnectorMetadata) or not meta.pre_ops:
            return
        if self._stream is None:
            self._run_ops(meta.pre_ops, saving=False)
            return
        main = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(main)   # after vLLM's zeroing of new blocks
        with torch.cuda.stream(self._stream):
            self._run_ops(meta.pre_ops, saving=False)
        main.wait_stream(self._stream)   # the forward pass reads the loaded blocks

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves run once per step in wait_for_save, over all layers

    def wait_for_save(self) -> None:
        if self._store is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        try:
            if isinstance(meta, TierConnectorMetadata) and meta.post_ops:
                if self._stream is None:
                    self._run_ops(meta.post_ops, saving=True)
                else:
                    self._stream.wait_stream(torch.cuda.current_stream(self._device))
                    with torch.cuda.stream(self._stream):
                        self._run_ops(meta.post_ops, saving=True)
                    self._stream.synchronize()
        finally:
            self._failed_step = False

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._store is None:
            return None
        failures = self._store.take_failures()
        return TierWorkerMetadata(failures) if failures else None
