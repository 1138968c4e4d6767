"""How ``kvroute up`` starts each kind of worker: the command line and environment per engine.

- ``sim``: ``kvroute sim`` with this interpreter (same flags as vLLM where they overlap);
- ``vllm``: vLLM's OpenAI server run by ``--vllm-python`` (vLLM usually has its own virtualenv),
  with prefix caching, ZMQ KV events plus a replay endpoint, ``usage.prompt_tokens_details`` and
  the block size; one slice of the cores (CPU build) or one GPU per worker.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path


def kvroute_argv(*args: str) -> list[str]:
    """argv running the ``kvroute`` CLI with this interpreter."""
    return [sys.executable, "-m", "kvroute", *args]


def sim_argv(args: argparse.Namespace, i: int, port: int, events_cfg: dict) -> list[str]:
    """``kvroute sim`` command line of worker ``i``."""
    argv = kvroute_argv("sim", "--model", str(args.model), "--served-model-name", args.served_model_name,
                    "--host", "127.0.0.1", "--port", str(port), "--block-size", str(args.block_size),
                    "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events_cfg),
                    "--seed", str(i))
    if args.num_gpu_blocks_override:
        argv += ["--num-gpu-blocks-override", str(args.num_gpu_blocks_override)]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.speedup != 1.0:
        argv += ["--speedup", str(args.speedup)]
    lora = getattr(args, "lora", None)
    if lora:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in lora.items())]
    if getattr(args, "data_parallel_size", 1) > 1:
        argv += ["--data-parallel-size", str(args.data_parallel_size)]
    return argv


def vllm_argv(args: argparse.Namespace, port: int, events_cfg: dict) -> list[str]:
    """The vLLM OpenAI server's command line (run by ``--vllm-python``; the ``vllm`` console script
    is avoided because some builds' package metadata breaks it): prefix caching, KV events with a
    replay endpoint, ``usage.prompt_tokens_details`` and the block size, ``--enable-scale-out`` for a
    multimodal model (its render endpoints, :mod:`router.route.render`), plus ``--vllm-args``."""
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(Path(args.model).resolve()), "--served-model-name", args.served_model_name,
            "--host", "127.0.0.1", "--port", str(port), "--block-size", str(args.block_size),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events_cfg)]
    if args.num_gpu_blocks_override:
        argv += ["--num-gpu-blocks-override", str(args.num_gpu_blocks_override)]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    lora = getattr(args, "lora", None)
    if lora:
        argv += lora_argv(lora)
    if getattr(args, "data_parallel_size", 1) > 1:
        argv += ["--data-parallel-size", str(args.data_parallel_size)]
    if getattr(args, "media_inputs", False):  # the gateway renders prompts with media here
        argv += ["--enable-scale-out"]
    return argv + shlex.split(args.vllm_args or "")


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks


def lora_argv(lora: dict[str, Path]) -> list[str]:
    """vLLM flags serving the adapters ``lora`` (name -> PEFT directory): ``--enable-lora``,
    ``--max-loras`` (all of them in one batch), ``--max-lora-rank`` (the smallest value vLLM allows
    at or above the largest adapter's ``r``; vLLM refuses an adapter above it) and ``--lora-modules``.
    Flags in ``--vllm-args`` come later and win."""
    ranks = []
    for path in lora.values():
        try:
            ranks.append(int(json.loads((Path(path) / "adapter_config.json").read_text()).get("r", 0)))
        except (OSError, ValueError, TypeError):
            ranks.append(0)
    rank = next((r for r in VLLM_LORA_RANKS if r >= max(ranks)), VLLM_LORA_RANKS[-1])
    return ["--enable-lora", "--max-loras", str(len(lora)), "--max-lora-rank", str(max(rank, 16)),
            "--lora-modules", *(f"{name}={path}" for name, path in lora.items())]


def tier_argv_env(args: argparse.Namespace, i: int, agent_socket: str | None = None,
                  worker_id: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The tiers' part of vLLM worker ``i``'s launch: ``--kv-transfer-config`` loading our KV
    connector (offload_agent/connector) with ``--cpu-tier-bytes`` of RAM and, when
    ``--ssd-tier-dir`` is given, ``--ssd-tier-bytes`` of block files in ``<dir>/<worker_id>``
    (default ``w<i>``; one folder per worker: two servers sharing a folder would evict each
    other's files), plus the
    ``PYTHONPATH`` vLLM needs to import the connector. ``agent_socket``: the worker's agent owns
    the tiers (same sizes; the connector falls back to these local tiers when the agent is
    absent). ``--tier-option KEY=VALUE`` flags (``args.tier_option``, when present) set the
    connector's other numbers (``peer_locate_timeout_ms``, ...: ``TierSettings``). Nothing when no
    tier flag is set. Raises ValueError for values the connector rejects."""
    if not args.cpu_tier_bytes:
        return [], {}
    from offload_agent.connector.config import kv_transfer_config, vllm_env as connector_env

    cfg = kv_transfer_config(args.cpu_tier_bytes, ssd_tier_folder(args, i, worker_id), args.ssd_tier_bytes or 0,
                             agent_socket=agent_socket, **tier_options(getattr(args, "tier_option", None) or []))
    return ["--kv-transfer-config", json.dumps(cfg)], connector_env()


TIER_OPTIONS = ("peer_locate_timeout_ms", "peer_pull_deadline_ms", "peer_connect_timeout_ms", "peer_pull_min_blocks",
                "agent_wait_s")


def tier_options(pairs: list[str]) -> dict[str, float]:
    """``KEY=VALUE`` strings (``--tier-option``) as the connector's settings; ValueError naming an
    unknown key (one of ``TIER_OPTIONS``) or a value that is not a number."""
    out: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in TIER_OPTIONS:
            raise ValueError(f"--tier-option {pair!r}: expected KEY=VALUE with KEY one of {', '.join(TIER_OPTIONS)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--tier-option {pair!r}: {value!r} is not a number") from None
    return out


def ssd_tier_folder(args: argparse.Namespace, i: int, worker_id: str | None = None) -> Path | None:
    """Worker ``i``'s SSD tier folder: ``<--ssd-tier-dir>/<worker_id>`` (default ``w<i>``), None
    without the flag."""
    return Path(args.ssd_tier_dir) / (worker_id or f"w{i}") if args.ssd_tier_dir else None


def agent_tier_argv(args: argparse.Namespace, i: int, socket_path: str, shm_path: str,
                    worker_id: str | None = None) -> list[str]:
    """``kvroute agent`` flags making worker ``i``'s agent the owner of its tiers, serving its
    blocks to peers on a free loopback port and removing the CPU tier file when it stops."""
    argv = ["--tier-socket", socket_path, "--tier-shm", shm_path, "--cpu-tier-bytes", str(args.cpu_tier_bytes),
            "--serve-peers", "127.0.0.1:0", "--remove-tiers-on-exit"]
    ssd = ssd_tier_folder(args, i, worker_id)
    if ssd is not None:
        argv += ["--ssd-tier-dir", str(ssd.resolve()), "--ssd-tier-bytes", str(args.ssd_tier_bytes)]
    return argv


def agent_argv(args: argparse.Namespace, i: int, events: str, replay: str, gateway_url: str,
               socket_path: str | None, shm_path: str, worker_id: str | None = None) -> list[str]:
    """``kvroute agent`` command line of worker ``i`` (id ``worker_id``, default ``w<i>``: the
    gateway's id of the worker, which its peers' P/D params and pulls name). With a Redis ``--index``: its
    KV events (``events``, ``replay``) into Redis, and its tiers when ``socket_path`` is given.
    With the embedded index (``--index memory``): only the owner of its tiers (``socket_path``
    required), the gateway at ``gateway_url`` as its index (the gateway subscribes to the events
    itself; the agent reads the admin token from ``KVROUTE_ADMIN_TOKEN``). Raises ValueError for
    the embedded index without ``socket_path`` (such an agent would have nothing to do)."""
    common = ["--worker-id", worker_id or f"w{i}", "--model", args.served_model_name, "--block-size", str(args.block_size)]
    if args.index == "memory":
        if socket_path is None:
            raise ValueError("with the embedded index an agent only owns the tiers: it needs a tier socket")
        argv = kvroute_argv("agent", *common, "--index", gateway_url)
    else:
        argv = kvroute_argv("agent", *common, "--events", events, "--replay", replay, "--index", args.index)
    return argv + (agent_tier_argv(args, i, socket_path, shm_path, worker_id) if socket_path else [])


def _cpu_slices(n_workers: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` values giving each worker its own cores ("0", "1-3", ...)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cpus) // n_workers)
    out = []
    for i in range(n_workers):
        mine = cpus[(i * per) % len(cpus):(i * per) % len(cpus) + per]
        out.append(str(mine[0]) if len(mine) == 1 else f"{mine[0]}-{mine[-1]}")
    return out


def _gpu_ids() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, ln in enumerate(listing.splitlines()) if ln.startswith("GPU ")]


def vllm_env(i: int, n_workers: int, data_parallel_size: int = 1) -> dict[str, str]:
    """Environment for vLLM worker ``i`` of ``n_workers``, never overriding what the user set.

    CPU build: ``VLLM_CPU_KVCACHE_SPACE`` 1 (GiB) and ``VLLM_CPU_OMP_THREADS_BIND`` a slice of the
    cores per engine: one per worker, or ``data_parallel_size`` of them joined by ``|`` (vLLM's
    CPU worker takes its data parallel rank's list from that, ``vllm/utils/ompmultiprocessing.py``).
    GPU hosts with a GPU per engine: ``CUDA_VISIBLE_DEVICES`` the worker's ``data_parallel_size``
    GPUs. (Variables of the other platform are ignored by vLLM.)
    """
    env: dict[str, str] = {}
    dp = data_parallel_size
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(_cpu_slices(n_workers * dp)[i * dp:(i + 1) * dp])
    gpus = _gpu_ids()
    if len(gpus) >= n_workers * dp:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * dp:(i + 1) * dp])
    return env
