"""Run one simulated vLLM server: flags -> :class:`SimConfig` -> :class:`SimServer` under uvicorn
(uvloop and httptools when installed), one process, one event loop."""
from __future__ import annotations

import argparse
import sys

from kvcore.data_parallel import rank_endpoint
from kvcore.lora_modules import parse_lora_modules
from simulator.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, SimConfig
from simulator.events import KVEventsConfig
from simulator.timing import PRESETS, TimingModel, preset_timing

GRACEFUL_SHUTDOWN_S = 2


def timing_from_args(args: argparse.Namespace) -> TimingModel:
    """The timing model of ``--timing-preset`` (if any) with the single timing flags applied."""
    overrides = {"prefill_overhead_ms": args.prefill_overhead_ms, "prefill_ms_per_token": args.prefill_ms_per_token,
                 "decode_ms_per_token": args.decode_ms_per_token, "decode_ms_per_seq": args.decode_ms_per_seq,
                 "prefill_ms_per_token_sq": args.prefill_ms_per_token_sq,
                 "kv_bytes_per_token": args.kv_bytes_per_token,
                 "kv_link_gbps": args.kv_link_gbps}
    if args.timing_preset:
        return preset_timing(args.timing_preset, args.speedup, **overrides)
    return TimingModel(speedup=args.speedup, **{k: v for k, v in overrides.items() if v is not None})


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` for parsed ``kvroute sim`` flags. Raises ValueError on bad values."""
    budget = args.max_num_batched_tokens
    if budget is None:
        preset = PRESETS[args.timing_preset] if args.timing_preset else None
        budget = (preset.max_num_batched_tokens if preset else None) or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if (args.block_size < 1 or args.num_gpu_blocks_override < 2 or args.max_num_seqs < 1
            or budget < 1):
        raise ValueError("--block-size, --max-num-seqs, --max-num-batched-tokens must be >= 1 and "
                         "--num-gpu-blocks-override >= 2")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError("--max-model-len must be >= 1")
    if args.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    events = KVEventsConfig.from_json(args.kv_events_config)
    if events.active and args.data_parallel_size > 1:
        for endpoint in (events.endpoint, events.replay_endpoint):
            if endpoint:
                rank_endpoint(endpoint, 1)  # every rank's endpoint must exist, as in vLLM
    return SimConfig(
        model_dir=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks_override,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        kv_events=events,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        timing=timing_from_args(args),
        kv_load=args.kv_load.replace("-", "_"),
        lora_modules=parse_lora_modules(args.lora_modules),
        data_parallel_size=args.data_parallel_size,
        seed=args.seed)


def serve(cfg: SimConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    import uvicorn

    from simulator.app import SimServer

    server = SimServer(cfg)
    ev = cfg.kv_events
    print(f"kvroute sim: model {cfg.model_name!r} on http://{cfg.host}:{cfg.port}, "
          f"{cfg.num_gpu_blocks} blocks of {cfg.block_size} tokens, events "
          f"{ev.endpoint + ' replay ' + str(ev.replay_endpoint) if ev.active else 'off'}", flush=True)
    # "auto" picks uvloop and httptools (both dependencies) and falls back to asyncio / h11
    uvicorn.run(server.app, host=cfg.host, port=cfg.port, loop="auto", http="auto",
                log_level="warning", access_log=False, lifespan="on",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def run_from_args(args: argparse.Namespace) -> int:
    """``kvroute sim`` entry: exit status 2 on a bad flag value."""
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"kvroute sim: error: {exc}", file=sys.stderr)
        return 2
    serve(cfg)
    return 0
