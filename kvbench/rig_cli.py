"""``kvroute bench rig``: its flags and its run (the sequence is in :mod:`kvbench.rig`)."""
from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shlex
import sys
import tempfile
from pathlib import Path

DEFAULT_KVROUTE_ROUTERS = ("kvroute:ttft", "kvroute:kv_aware", "kvroute:round_robin")
DEFAULT_PD_ROUTERS = ("kvroute:ttft", "kvroute-pd:ttft")  # with --pd: unified against P/D on the same workers,
# then every installed peer's P/D mode (kvbench.peers_pd.PD_PEERS)


def pd_split(text: str) -> tuple[int, int]:
    """``--pd P:D`` -> (P, D), both >= 1. Raises argparse.ArgumentTypeError otherwise."""
    p, sep, d = text.partition(":")
    try:
        out = int(p), int(d)
    except ValueError:
        out = None
    if not sep or out is None or min(out) < 1:
        raise argparse.ArgumentTypeError(f"want P:D, two counts >= 1 (e.g. 2:6), got {text!r}")
    return out


def pd_roles(pd: tuple[int, int]) -> list[str]:
    """Worker roles of ``--pd P:D``: workers 0..P-1 prefill, the next D decode."""
    return ["prefill"] * pd[0] + ["decode"] * pd[1]


def add_rig_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``kvroute bench rig`` to the ``bench`` subparsers."""
    from kvbench.flags import add_workload_flags, positive_int
    from simulator.timing import PRESETS

    p = sub.add_parser(
        "rig", help="start workers and routers, run the workload through each router in turn",
        description="Start N workers (simulated or real vLLM), then one router after another in front of "
                    "the same workers (kvroute's policies and every installed peer router), reset the "
                    "workers' prefix caches between routers, replay the same requests in the same order "
                    "through each, and print one table.")
    r = p.add_argument_group("rig")
    r.add_argument("--workers", type=positive_int, default=None,
                   help="number of workers (default 2, or P+D with --pd)")
    r.add_argument("--pd", type=pd_split, default=None, metavar="P:D",
                   help="prefill-decode disaggregation: workers 0..P-1 get role prefill, the next D decode, and "
                        "kvroute-pd:<policy> routers run kvroute with those roles and policy.pd on, vllm-router-pd:<policy> "
                        "and smg-pd:cache_aware the peers' own P/D modes (vLLM's kv_transfer_params; sglang-router has "
                        "none); default routers become kvroute:ttft (unified, the same workers), kvroute-pd:ttft and "
                        "every installed peer's P/D mode")
    r.add_argument("--pd-min-prefill-tokens", type=int, default=None, metavar="N",
                   help="with --pd: policy.pd.min_prefill_tokens (below it the decode worker serves the request "
                        "whole; default: the gateway's)")
    r.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                   help="kvroute sim (default) or real vLLM run by --vllm-python")
    r.add_argument("--gateway-processes", type=int, default=1, metavar="N",
                   help="run each kvroute gateway as kvroute serve --processes N (default 1)")
    r.add_argument("--routers", default=None, metavar="LIST",
                   help="comma-separated routers: kvroute:<policy> (ttft, kv_aware, round_robin, least_load, session, "
                        "or a --policy-config label), kvroute-pd:<policy>, vllm-router-pd:cache_aware, vllm-router-pd:kv_aware "
                        "(--block-size 16), smg-pd:cache_aware (with --pd) and peers sglang:cache_aware, sglang:round_robin, "
                        "smg:cache_aware, vllm-router:kv_aware; default: kvroute:ttft, kvroute:kv_aware, "
                        "kvroute:round_robin and every installed peer")
    r.add_argument("--policy-config", action="append", default=[], metavar="LABEL=JSON",
                   help="a kvroute policy variant, e.g. 'kv_nolw={\"name\": \"kv_aware\", \"load_weight\": 0}', "
                        "then named kvroute:kv_nolw in --routers; repeatable")
    r.add_argument("--num-gpu-blocks-override", type=positive_int, default=None, metavar="N",
                   help="KV blocks per worker (default: the engine's own, or sized by --kv-pressure)")
    r.add_argument("--max-model-len", type=int, default=None, help="workers' context length (vLLM's flag)")
    r.add_argument("--timing-preset", choices=sorted(PRESETS), default="gpu",
                   help="sim engine: timing model and step token budget preset (default gpu; see kvroute sim "
                        "--help); cpu was fitted on vLLM run with --max-num-seqs 8")
    r.add_argument("--speedup", type=float, default=1.0, help="sim engine: run simulated time this many times faster")
    r.add_argument("--sim-args", default="", metavar="'ARGS'",
                   help="sim engine: extra kvroute sim flags, one shell-quoted string (e.g. "
                        "'--prefill-ms-per-token 0.4' to override one value of the preset)")
    r.add_argument("--vllm-python", default=os.environ.get("KVR_VLLM_PYTHON", "python"),
                   help="vllm engine: interpreter with vLLM (default $KVR_VLLM_PYTHON)")
    r.add_argument("--vllm-args", default="", metavar="'ARGS'",
                   help="vllm engine: extra flags for each server, one shell-quoted string")
    r.add_argument("--cpu-tier-bytes", type=positive_int, default=None, metavar="BYTES",
                   help="vllm engine: give each worker a CPU tier of this many bytes behind kvroute's KV "
                        "connector (as kvroute up does): blocks evicted from the engine's cache are kept there "
                        "and loaded back; emptied with the prefix caches between routers")
    r.add_argument("--repeats", type=positive_int, default=1,
                   help="run the whole sequence of routers this many times (interleaved: every router once, "
                        "then again, each round starting one router later, so no router is always the first "
                        "after the workers start); the table shows medians, the JSON every run (default 1)")
    r.add_argument("--log-dir", type=Path, default=None, help="every process's log (default: a temp dir)")
    add_workload_flags(p, default_block_size=32)
    p.set_defaults(func=_rig)


def _router_list(args: argparse.Namespace, labels: dict) -> tuple[list[str], list[str]]:
    """(routers to run, lines about peers left out); ``labels``: the --policy-config variants.
    Raises ValueError for an unknown router or kvroute policy."""
    from kvbench.peers import PEERS
    from kvbench.peers_pd import PD_PEERS, PD_REFUSED
    from router.policies.factory import make_policy

    default = list(DEFAULT_PD_ROUTERS) + list(PD_PEERS) if args.pd else list(DEFAULT_KVROUTE_ROUTERS) + list(PEERS)
    wanted = [n.strip() for n in args.routers.split(",") if n.strip()] if args.routers else default
    run, skipped = [], []
    for name in dict.fromkeys(wanted):  # each once, in order
        family = name.split(":", 1)[0]
        if family in PD_REFUSED:
            raise ValueError(f"{name}: {PD_REFUSED[family]}")
        if (name.startswith("kvroute-pd:") or name in PD_PEERS) and not args.pd:
            raise ValueError(f"{name} needs --pd P:D (the workers' roles)")
        if name in PD_PEERS:
            why = PD_PEERS[name].refusal(getattr(args, "block_size", 0))
            if why and args.routers:  # asked for by name: an error; in the default list: left out, said so
                raise ValueError(why)
            if why:
                skipped.append(f"{name}: {why}")
            elif PD_PEERS[name].installed():
                run.append(name)
            else:
                skipped.append(f"{name}: not installed (make install-peers)")
            continue
        if name.startswith(("kvroute:", "kvroute-pd:")):
            label = name.split(":", 1)[1]
            if label not in labels:
                make_policy({"name": label})  # ValueError now, not after the workers started
            run.append(name)
        elif name not in PEERS:
            raise ValueError(f"unknown router {name!r}; peers are {', '.join(PEERS)}"
                             + (f", P/D peers {', '.join(PD_PEERS)}" if args.pd else ""))
        elif not PEERS[name].installed():
            skipped.append(f"{name}: not installed (make install-peers)")
        else:
            run.append(name)
    return run, skipped


def rotated(routers: list[str], rep: int) -> list[str]:
    """The order of round ``rep`` (0-based) of a rig run: ``routers`` rotated left by ``rep``, so
    each router leads a round in turn and its place in the order biases no router (in one
    6-round run on 2 real vLLM workers, the router that led every round had TTFT p50 212 ms in
    the first round against 110-152 ms in the other five)."""
    if not routers:
        return []
    k = rep % len(routers)
    return routers[k:] + routers[:k]


def _policy_configs(items: list[str]) -> dict[str, dict]:
    from router.policies.factory import make_policy

    out = {}
    for item in items:
        label, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--policy-config wants LABEL=JSON, got {item!r}")
        cfg = json.loads(text)
        make_policy(cfg)  # validated now, not after the workers have started
        out[label] = cfg
    return out


def _model_max_len(model_dir: Path) -> int | None:
    try:
        return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _rig(args: argparse.Namespace) -> int:
    import httpx

    from kvcore.tokenization import UnsupportedPrompt
    from kvbench.flags import arrivals_from_args, finish_report, prepare_outputs, workload_from_args
    from kvbench.report import capacity_note
    from kvbench.rig import WARM_UP_REQUESTS, RigSpec, run_router, start_workers, warm_up
    from kvbench.runner import RunSettings
    from kvbench.stats import aggregate_repeats
    from kvroute.engines import sim_argv, tier_argv_env, vllm_argv, vllm_env
    from kvroute.up import Cluster

    model_dir = Path(args.tokenizer)
    try:
        if args.pd:
            if args.workers not in (None, sum(args.pd)):
                raise ValueError(f"--pd {args.pd[0]}:{args.pd[1]} runs {sum(args.pd)} workers, not --workers {args.workers}")
            args.workers = sum(args.pd)
            if args.engine != "sim":
                raise ValueError("--pd runs on --engine sim (vLLM workers need a KV connector for P/D: "
                                 "kvroute up --prefill-workers P --decode-workers D)")
        elif args.pd_min_prefill_tokens is not None:
            raise ValueError("--pd-min-prefill-tokens needs --pd")
        args.workers = args.workers or 2
        policy_configs = _policy_configs(args.policy_config)
        routers, skipped = _router_list(args, policy_configs)
        sim_extra = shlex.split(args.sim_args)
        if args.cpu_tier_bytes and args.engine != "vllm":
            raise ValueError("--cpu-tier-bytes needs --engine vllm (the tier lives behind vLLM's KV connector)")
        prepare_outputs(args)
        max_len = args.max_model_len or _model_max_len(model_dir)
        workload = workload_from_args(args, None, max_len)
        arrivals = arrivals_from_args(args, workload.name)
        arrivals.send_times_s(workload)
        blocks = args.num_gpu_blocks_override
        if args.kv_pressure:
            if blocks:
                raise ValueError("--kv-pressure sizes the workers' caches: drop --num-gpu-blocks-override")
            # the cluster holds 1/RATIO of the workload's distinct blocks (+1: vLLM's null block),
            # and each worker at least the longest request (else it could serve none of them)
            longest = max(len(q.prompt_token_ids) + q.output_tokens for q in workload.requests)
            blocks = max(math.ceil(workload.distinct_blocks() / (args.workers * args.kv_pressure)),
                         math.ceil(longest / args.block_size) + 1) + 1
        # the bound counts the engines' blocks alone: a CPU tier holds more
        summary = workload.summary(blocks * args.workers if blocks and not args.cpu_tier_bytes else None)
    except (ValueError, OSError, UnsupportedPrompt) as exc:
        print(f"kvroute bench rig: {exc}", file=sys.stderr)
        return 2
    for line in skipped:
        print(f"[rig] skipped {line}", file=sys.stderr)
    if not routers:
        print("kvroute bench rig: no router to run", file=sys.stderr)
        return 2
    os.environ.setdefault("KVROUTE_ADMIN_TOKEN", secrets.token_urlsafe(18))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvroute-rig-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    up_args = argparse.Namespace(model=str(model_dir), served_model_name=args.model, block_size=args.block_size,
                                 num_gpu_blocks_override=blocks, max_model_len=args.max_model_len,
                                 speedup=args.speedup, vllm_python=args.vllm_python,
                                 vllm_args=args.vllm_args + " --enable-scale-out",
                                 cpu_tier_bytes=args.cpu_tier_bytes, ssd_tier_dir=None, ssd_tier_bytes=None)

    def worker_argv(i: int, port: int, events_cfg: dict):
        if args.engine == "vllm":
            tier_argv, tier_env = tier_argv_env(up_args, i)
            return vllm_argv(up_args, port, events_cfg) + tier_argv, {**vllm_env(i, args.workers), **tier_env}
        return sim_argv(up_args, i, port, events_cfg) + ["--timing-preset", args.timing_preset] + sim_extra, None

    spec = RigSpec(args.workers, args.engine, model_dir, args.model, args.block_size, log_dir, worker_argv,
                   policy_configs, gateway_processes=args.gateway_processes,
                   reset_tiers=bool(args.cpu_tier_bytes), roles=pd_roles(args.pd) if args.pd else None,
                   pd_policy=({} if args.pd_min_prefill_tokens is None
                              else {"min_prefill_tokens": args.pd_min_prefill_tokens}))
    tiers = f" + a CPU tier of {args.cpu_tier_bytes} bytes" if args.cpu_tier_bytes else ""
    if args.pd:
        print(f"[rig] P/D {args.pd[0]}:{args.pd[1]}: w0..w{args.pd[0] - 1} prefill, w{args.pd[0]}..w{args.workers - 1} "
              f"decode for kvroute-pd targets; every worker serves whole requests for the others",
              file=sys.stderr, flush=True)
    print(f"[rig] {args.workers} {args.engine} workers x {blocks or 'default'} KV blocks of {args.block_size}{tiers}; "
          f"workload {workload.name}: {summary['requests']} requests, {summary['distinct_blocks']} distinct blocks, "
          f"ideal hit rate {summary['ideal_hit_rate']:.3f}{capacity_note(summary)}; {arrivals.describe()}; "
          f"routers: {', '.join(routers)}; "
          f"logs in {log_dir}", file=sys.stderr, flush=True)
    cluster = Cluster()
    failed: list[str] = []
    try:
        workers = start_workers(spec, cluster)
        if args.engine == "vllm":
            print(f"[rig] warming the workers up ({WARM_UP_REQUESTS} requests each)", file=sys.stderr, flush=True)
            warm_up(workers, workload, args.model, args.request_timeout_s)
        settings = RunSettings(model=args.model, arrivals=arrivals, timeout_s=args.request_timeout_s,
                               ttft_target_ms=args.ttft_target_ms, workers={w.id: w.url for w in workers},
                               progress=not args.no_progress)
        runs: dict[str, list[dict]] = {name: [] for name in routers}
        for rep in range(args.repeats):
            for name in rotated(routers, rep):
                if args.repeats > 1:
                    print(f"[rig] run {rep + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
                try:
                    runs[name].append(run_router(name, spec, workers, workload, settings, cluster))
                except (RuntimeError, TimeoutError, httpx.HTTPError, OSError) as exc:  # this router only
                    failed.append(f"{name} (run {rep + 1}): {type(exc).__name__}: {exc}")
                    print(f"[rig] {failed[-1]}; see {log_dir}", file=sys.stderr, flush=True)
        targets = [aggregate_repeats(runs[name]) for name in routers if runs[name]]
    except (RuntimeError, TimeoutError) as exc:  # the workers
        print(f"kvroute bench rig: {exc} (logs in {log_dir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvroute bench rig: interrupted", file=sys.stderr)
        return 130
    finally:
        cluster.stop()
    report = {"workload": summary, "arrivals": arrivals.describe(), "targets": targets,
              "rig": {"workers": args.workers, "engine": args.engine, "kv_blocks_per_worker": blocks,
                      "cpu_tier_bytes_per_worker": args.cpu_tier_bytes,
                      "block_size": args.block_size, "timing_preset": args.timing_preset if args.engine == "sim" else None,
                      "routers": routers, "skipped": skipped, "repeats": args.repeats,
                      "pd": {"prefill": args.pd[0], "decode": args.pd[1], "roles": pd_roles(args.pd),
                             "min_prefill_tokens": args.pd_min_prefill_tokens} if args.pd else None}}
    if failed:
        report["failed"] = failed
    if targets:
        finish_report(report, args)
    return 1 if failed or any(t["errors"] == t["requests"] for t in targets) else 0
