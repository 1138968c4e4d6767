"""How vLLM loads our connector: the ``--kv-transfer-config`` value and the environment.

Nothing here imports vLLM or torch, so launchers (``kvroute up``, tests, benchmarks) can use it.
vLLM's process finds the connector through ``kv_connector_module_path``; the repository root must
be importable there, which :func:`vllm_env` arranges with ``PYTHONPATH`` (the connector itself needs
only what vLLM's virtualenv has: torch and the standard library).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONNECTOR_CLASS = "KVRouteTierConnector"
CONNECTOR_MODULE = "offload_agent.connector.vllm_connector"
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TierSettings:
    """The tiers' sizes, from ``kv_connector_extra_config``.

    ``cpu_tier_bytes``: RAM for the CPU tier (> 0); ``ssd_tier_dir``: folder of the SSD tier or
    None; ``ssd_tier_bytes``: bytes of block files allowed there (> 0 when a folder is given);
    ``model_id``: overrides the model identity in the fingerprint (default: vLLM's model path).

    ``agent_socket``: the Unix socket of this worker's offload agent (``kvroute agent
    --tier-socket``). When the agent answers there, it owns the tiers: the CPU tier is its shared
    memory file and the SSD tier its folder, with its sizes (the three values above are then
    unused), and blocks missing locally may be pulled from peers' agents. When it does not answer
    within ``agent_wait_s`` at start, the connector runs its own local tiers as configured above.
    ``peer_pull_deadline_ms``: longest wait for a pull (what has not come by then is recomputed);
    ``peer_connect_timeout_ms``: longest wait of each of the pull's tries for the peer's agent to
    connect and answer the handshake (within the deadline; a peer that does not is skipped for a
    back-off, :class:`offload_agent.tier_service.PeerBreaker`);
    ``peer_locate_timeout_ms``: longest wait for the agent to say which peer holds a prefix (the
    request waits meanwhile, other requests' steps run; past it the blocks are computed); ``peer_pull_min_blocks``: a prompt missing fewer blocks than this
    locally is not looked up (its pull would save less than the lookup costs the engine).
    """

    cpu_tier_bytes: int
    ssd_tier_dir: str | None = None
    ssd_tier_bytes: int = 0
    model_id: str | None = None
    agent_socket: str | None = None
    agent_wait_s: float = 10.0
    peer_pull_deadline_ms: float = 1000.0
    peer_connect_timeout_ms: float = 1000.0
    peer_locate_timeout_ms: float = 100.0
    peer_pull_min_blocks: float = 4.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "TierSettings":
        """Validate ``kv_connector_extra_config``; ValueError naming the bad key."""
        try:
            cpu = int(extra.get("cpu_tier_bytes", 0))
            ssd_bytes = int(extra.get("ssd_tier_bytes", 0) or 0)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cpu_tier_bytes and ssd_tier_bytes must be integers: {exc}") from exc
        ssd_dir = extra.get("ssd_tier_dir") or None
        if cpu <= 0:
            raise ValueError(f"kv_connector_extra_config.cpu_tier_bytes must be > 0, got {cpu}")
        if ssd_dir is not None and ssd_bytes <= 0:
            raise ValueError("kv_connector_extra_config.ssd_tier_bytes must be > 0 with ssd_tier_dir")
        if ssd_dir is None and ssd_bytes:
            raise ValueError("kv_connector_extra_config.ssd_tier_bytes needs ssd_tier_dir")
        timing = {}
        for key, default in (("agent_wait_s", 10.0), ("peer_pull_deadline_ms", 1000.0),
                             ("peer_connect_timeout_ms", 1000.0), ("peer_locate_timeout_ms", 100.0),
                             ("peer_pull_min_blocks", 4.0)):
            value = extra.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be a number >= 0, got {value!r}")
            timing[key] = float(value)
        agent_socket = extra.get("agent_socket") or None
        if agent_socket is not None and not isinstance(agent_socket, str):
            raise ValueError(f"kv_connector_extra_config.agent_socket must be a path, got {agent_socket!r}")
        return cls(cpu, str(ssd_dir) if ssd_dir else None, ssd_bytes, extra.get("model_id") or None,
                   agent_socket, **timing)


def kv_transfer_config(cpu_tier_bytes: int, ssd_tier_dir: str | os.PathLike | None = None,
                       ssd_tier_bytes: int = 0, agent_socket: str | os.PathLike | None = None,
                       **extra_settings: Any) -> dict[str, Any]:
    """The JSON object for vLLM's ``--kv-transfer-config`` loading the tiers connector
    (``kv_role`` ``kv_both``; a block that fails to load is recomputed, never an error).
    ``agent_socket`` and ``extra_settings`` (``peer_pull_deadline_ms``, ...): see
    :class:`TierSettings`. Raises ValueError for values :class:`TierSettings` rejects."""
    extra: dict[str, Any] = {"cpu_tier_bytes": int(cpu_tier_bytes)}
    if ssd_tier_dir is not None:
        extra["ssd_tier_dir"] = str(Path(ssd_tier_dir).resolve())
        extra["ssd_tier_bytes"] = int(ssd_tier_bytes)
    if agent_socket is not None:
        extra["agent_socket"] = str(Path(agent_socket).resolve())
    extra.update(extra_settings)
    TierSettings.from_extra(extra)
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Variables to add to vLLM's environment so it can import the connector: ``PYTHONPATH``
    with the repository root first (keeping ``base``'s or this process's ``PYTHONPATH``)."""
    current = (base if base is not None else os.environ).get("PYTHONPATH", "")
    parts = [str(REPO_ROOT)] + [p for p in current.split(os.pathsep) if p and p != str(REPO_ROOT)]
    return {"PYTHONPATH": os.pathsep.join(parts)}


def unsupported_setup(vllm_config: Any, settings: TierSettings, machine: str | None = None) -> str | None:
    """Why the tiers cannot serve this vLLM set-up correctly, or None; the connector refuses to
    start with it (never runs a set-up wrong). ``vllm_config``: vLLM's ``VllmConfig`` (read by
    attribute, so this module needs no vLLM); ``machine``: ``os.uname().machine`` by default.

    - decode or prefill context parallelism (DCP/PCP): each rank holds only some of a block's
      tokens, which the shard fingerprint does not describe;
    - data parallelism with an agent or an SSD folder: each data-parallel rank is an engine of its
      own, and they would share one agent's CPU tier files or one SSD folder, each planner evicting
      the others' blocks (run one agent, or SSD folder, per rank: one vLLM server per rank);
    - an agent on a CPU that is not x86-64: the CPU tier file's slot seqlock relies on x86's store
      order (``offload_agent/tiers/shm_slab.py``), so the agent could serve a torn slot.
    """
    par = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(par, name, 1) or 1) > 1:
            return (f"{name} = {getattr(par, name)}: context-parallel ranks hold part of each block's tokens, "
                    "which the tiers cannot store yet; run without the tiers connector or without context parallelism")
    if int(getattr(par, "data_parallel_size", 1) or 1) > 1 and (settings.agent_socket or settings.ssd_tier_dir):
        return ("data_parallel_size > 1 with agent_socket or ssd_tier_dir: the data-parallel ranks would share one "
                "agent's CPU tier or one SSD folder; run one vLLM server (and agent, and SSD folder) per rank")
    machine = machine or os.uname().machine
    if settings.agent_socket and machine not in ("x86_64", "AMD64"):
        return (f"agent_socket on {machine}: the shared CPU tier's slot seqlock needs x86-64 store order; "
                "drop agent_socket to run local tiers (no peer pull) on this machine")
    return None
