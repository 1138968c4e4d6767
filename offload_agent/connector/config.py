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
    """

    cpu_tier_bytes: int
    ssd_tier_dir: str | None = None
    ssd_tier_bytes: int = 0
    model_id: str | None = None

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
        return cls(cpu, str(ssd_dir) if ssd_dir else None, ssd_bytes, extra.get("model_id") or None)


def kv_transfer_config(cpu_tier_bytes: int, ssd_tier_dir: str | os.PathLike | None = None,
                       ssd_tier_bytes: int = 0) -> dict[str, Any]:
    """The JSON object for vLLM's ``--kv-transfer-config`` loading the tiers connector
    (``kv_role`` ``kv_both``; a block that fails to load is recomputed, never an error).
    Raises ValueError for sizes :class:`TierSettings` rejects."""
    extra: dict[str, Any] = {"cpu_tier_bytes": int(cpu_tier_bytes)}
    if ssd_tier_dir is not None:
        extra["ssd_tier_dir"] = str(Path(ssd_tier_dir).resolve())
        extra["ssd_tier_bytes"] = int(ssd_tier_bytes)
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
