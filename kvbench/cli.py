"""``kvroute bench``: ``run`` replays a workload against OpenAI endpoints; ``rig`` starts workers
and routers and runs ``run``'s measurement through each router in turn; ``calibrate`` fits the
simulator's timing model to a real worker; ``compare`` tells whether two reports rank alike.

The workload, arrival and report flags are shared by ``run`` and ``rig`` (see ``--help``).
Heavy imports happen inside the subcommands so ``kvroute --help`` stays fast.
"""
from __future__ import annotations

import argparse
import sys

from kvbench.flags import add_workload_flags, arrivals_from_args, finish_report, name_url, prepare_outputs, \
    workload_from_args

def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvroute bench`` with its ``run``, ``rig`` and ``calibrate`` subcommands."""
    bench = subparsers.add_parser("bench", help="benchmark routers on a workload (run, rig, calibrate, compare)",
                                  description="run: replay a workload against OpenAI endpoints; rig: start "
                                              "workers and routers and run the workload through each in turn; "
                                              "calibrate: fit kvroute sim's timing to a real worker; compare: "
                                              "whether two reports rank the targets alike.")
    sub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")

    run = sub.add_parser("run", help="replay a workload against OpenAI endpoints, one after another",
                         description="Replay a workload against one or more OpenAI endpoints, one after "
                                     "another, streaming; print a table (TTFT, ITL, throughput, goodput, "
                                     "prefix-hit rate vs the workload's ideal, per-worker load).")
    run.add_argument("--target", action="append", type=name_url, required=True, metavar="NAME=URL",
                     help="an endpoint to measure (its OpenAI API under URL/v1); repeat for several")
    run.add_argument("--worker", action="append", type=name_url, default=[], metavar="NAME=URL",
                     help="a worker behind the targets: its vLLM counters give per-worker figures when a "
                          "router does not name the worker (x-kvroute-worker); repeat for each")
    run.add_argument("--reset-cache", action="store_true",
                     help="empty every --worker's prefix cache before each target (POST /reset_prefix_cache, "
                          "needs VLLM_SERVER_DEV_MODE=1 on vLLM)")
    run.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    add_workload_flags(run, default_block_size=16)
    run.set_defaults(func=_run)

    from kvbench.calibrate import add_calibrate_parser  # their imports wait until `kvroute bench`
    from kvbench.compare import add_compare_parser
    from kvbench.rig_cli import add_rig_parser

    add_rig_parser(sub)
    add_calibrate_parser(sub)
    add_compare_parser(sub)
    bench.set_defaults(func=lambda _args: bench.print_help() or 2)


def _run(args: argparse.Namespace) -> int:
    import httpx

    from kvcore.tokenization import UnsupportedPrompt
    from kvbench.report import capacity_note
    from kvbench.runner import RunSettings, Target, run_target
    from kvbench.workers import reachable, served_max_model_len

    if args.kv_pressure and (args.workload == "trace" or not args.cluster_kv_blocks):
        print("kvroute bench run: --kv-pressure needs a generated workload and --cluster-kv-blocks "
              "(for a trace, size the workers' caches: bench rig does)", file=sys.stderr)
        return 2
    if args.reset_cache and not args.worker:
        print("kvroute bench run: --reset-cache needs the workers (--worker NAME=URL)", file=sys.stderr)
        return 2
    try:
        prepare_outputs(args)
        unreachable = [url for _, url in args.target if not reachable(url)]
        if unreachable:
            raise ValueError(f"no answer from {', '.join(unreachable)} (GET /v1/models)")
        lens = [served_max_model_len(url, args.model) for _, url in args.target]
        max_model_len = min((n for n in lens if n), default=None)
        workload = workload_from_args(args, args.cluster_kv_blocks, max_model_len)
        arrivals = arrivals_from_args(args, workload.name)
        arrivals.send_times_s(workload)  # fails early on trace timing without timestamps
        summary = workload.summary(args.cluster_kv_blocks)
    except (ValueError, OSError, UnsupportedPrompt) as exc:
        print(f"kvroute bench run: {exc}", file=sys.stderr)
        return 2
    settings = RunSettings(model=args.model, arrivals=arrivals, timeout_s=args.request_timeout_s,
                           headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
                           ttft_target_ms=args.ttft_target_ms, workers=dict(args.worker),
                           reset_cache=args.reset_cache, progress=not args.no_progress)
    print(f"workload {workload.name}: {summary['requests']} requests, {summary['prompt_tokens']} prompt tokens, "
          f"{summary['distinct_blocks']} distinct blocks of {workload.block_size}, ideal hit rate "
          f"{summary['ideal_hit_rate']:.3f}{capacity_note(summary)}; {arrivals.describe()}", file=sys.stderr, flush=True)
    targets, failed = [], []
    for name, url in args.target:
        try:
            targets.append(run_target(Target(name, url), workload, settings))
        except (httpx.HTTPError, TimeoutError, OSError) as exc:  # the workers' counters or reset
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"kvroute bench run: {failed[-1]}", file=sys.stderr)
    report = {"workload": summary, "arrivals": arrivals.describe(), "targets": targets}
    if failed:
        report["failed"] = failed
    if targets:
        finish_report(report, args)
    return 1 if failed or any(t["errors"] == t["requests"] for t in targets) else 0
