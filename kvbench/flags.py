"""The flags ``kvroute bench run`` and ``rig`` share (workload, arrivals, report) and what they
build: the workload, the arrival process, the report's outputs. Heavy imports happen inside the
functions so ``kvroute --help`` stays fast."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

WORKLOADS = ("trace", "shared-prefix", "multiturn", "agent")


def _positive(kind: type):
    """An argparse ``type`` parsing ``kind`` (int or float) and refusing values not above 0."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be {'>= 1' if kind is int else '> 0'}, got {v}")
        return v
    return parse


positive_int = _positive(int)
positive_float = _positive(float)


def name_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://host:port, got {text!r}")
    return name, url


def add_workload_flags(p: argparse.ArgumentParser, default_block_size: int) -> None:
    """The flags that choose and shape the workload, the arrivals and the report."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, required=True,
                   help="trace: a Mooncake-format trace expanded into prompts; shared-prefix: groups of "
                        "prompts sharing a prefix (SGLang's generated-shared-prefix); multiturn: chats "
                        "re-sending their history each turn; agent: coding-agent sessions (one shared system "
                        "prompt and tool set, tool calls and results) through --api messages or responses")
    w.add_argument("--model", required=True, help="model name sent in each request (the served model name)")
    w.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="model directory whose tokenizer the workers use (prompts are built from its "
                        "one-token words and token counts are exact in it)")
    w.add_argument("--block-size", type=positive_int, default=default_block_size,
                   help=f"the engines' KV block size in tokens, the granularity of the ideal hit rate "
                        f"(default {default_block_size}; a smaller value than the engines' only loosens "
                        f"the ideal)")
    w.add_argument("--seed", type=int, default=0, help="seed of generated prompts and Poisson gaps (default 0)")
    w.add_argument("--output-tokens", type=positive_int, default=None,
                   help="tokens generated per request (ignore_eos); default: the trace's output length "
                        "scaled like its blocks, 16 for generated workloads")
    t = p.add_argument_group("trace workload")
    t.add_argument("--trace", type=Path, default=None,
                   help="Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids of "
                        "512-token blocks); default: the first 1,000 requests of Mooncake's public "
                        "conversation trace, shipped with kvroute")
    t.add_argument("--limit", type=positive_int, default=None, help="use only the first N requests of the trace")
    t.add_argument("--block-tokens", type=positive_int, default=64,
                   help="prompt tokens per 512-token trace block (default 64: 8x smaller prompts, so CPU or "
                        "simulated workers can serve them); a multiple of --block-size keeps shared trace "
                        "blocks on engine block boundaries")
    t.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="cut longer trace prompts to their leading whole blocks (fit the model's context)")
    g = p.add_argument_group("shared-prefix workload")
    g.add_argument("--groups", type=positive_int, default=4, help="prefix groups (default 4)")
    g.add_argument("--prompts-per-group", type=positive_int, default=16, help="prompts per group (default 16)")
    g.add_argument("--shared-tokens", type=positive_int, default=1536, help="tokens of each group's shared prefix (default 1536)")
    g.add_argument("--own-tokens", type=int, default=300, help="tokens of each prompt's own suffix (default 300)")
    m = p.add_argument_group("multiturn workload")
    m.add_argument("--conversations", type=positive_int, default=16, help="conversations (default 16)")
    m.add_argument("--turns", type=positive_int, default=4, help="turns per conversation (default 4)")
    m.add_argument("--system-prompts", type=positive_int, default=None,
                   help="distinct system prompts, conversation c uses c mod this (default: one per conversation)")
    m.add_argument("--system-tokens", type=positive_int, default=740, help="tokens of a system prompt (default 740)")
    m.add_argument("--user-tokens", type=positive_int, default=60, help="tokens of a user turn (default 60)")
    m.add_argument("--reply-tokens", type=int, default=40,
                   help="tokens of the fixed assistant reply added to the history after a turn (default 40)")
    ag = p.add_argument_group("agent workload (--conversations sessions of --turns turns; --system-tokens, "
                              "--user-tokens for the task, --reply-tokens for the agent's note before each call)")
    ag.add_argument("--api", choices=("messages", "responses"), default="messages",
                    help="Anthropic's /v1/messages (default) or OpenAI's /v1/responses, both streamed")
    ag.add_argument("--result-tokens", type=positive_int, default=120,
                    help="tokens of each tool result added to the history (default 120)")
    k = p.add_argument_group("KV pressure (generated workloads)")
    k.add_argument("--kv-pressure", type=positive_float, default=None, metavar="RATIO",
                   help="make the workload's distinct KV blocks RATIO times what the cluster holds: more "
                        "groups or conversations (bench run, with --cluster-kv-blocks) or, in the rig, "
                        "smaller worker caches (any workload)")
    k.add_argument("--cluster-kv-blocks", type=positive_int, default=None,
                   help="bench run: KV blocks of all workers together, for --kv-pressure and the capacity "
                        "bound on the hit rate (the rig knows its own)")
    a = p.add_argument_group("arrivals (one of; default: trace timestamps for a trace, else concurrency 4)")
    ex = a.add_mutually_exclusive_group()
    ex.add_argument("--time-scale", type=positive_float, default=None,
                    help="send at the trace's timestamps divided by X (2 = twice the trace's rate)")
    ex.add_argument("--rate", type=positive_float, default=None, help="Poisson arrivals at R requests/s")
    ex.add_argument("--concurrency", type=positive_int, default=None, help="closed loop: C requests in flight")
    o = p.add_argument_group("report")
    o.add_argument("--ttft-target-ms", type=positive_float, default=1000.0,
                   help="goodput counts requests with TTFT at most this (default 1000)")
    o.add_argument("--request-timeout-s", type=positive_float, default=600.0, help="per-request limit (default 600)")
    o.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="write the report with every per-request record as JSON")
    o.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="write PNGs: TTFT CDF per target, hit rate over time, per-worker load (needs matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def arrivals_from_args(args: argparse.Namespace, workload_name: str):
    """The arrival process the flags choose (default: trace timestamps, or concurrency 4)."""
    from kvbench.arrivals import Arrivals

    if args.rate is not None:
        return Arrivals("rate", rate=args.rate, seed=args.seed)
    if args.concurrency is not None:
        return Arrivals("concurrency", concurrency=args.concurrency)
    if args.time_scale is not None or workload_name == "trace":
        return Arrivals("trace")
    return Arrivals("concurrency", concurrency=4)


def workload_from_args(args: argparse.Namespace, cluster_kv_blocks: int | None = None,
                       max_model_len: int | None = None):
    """Expand the workload the flags describe; trace prompts are cut to fit ``max_model_len`` (the
    engines' context, when known). Raises ValueError on inconsistent flags."""
    from kvcore.tokenization import PromptTokenizer
    from kvbench import synthetic, trace
    from kvbench.words import OneTokenWords

    words = OneTokenWords(PromptTokenizer(args.tokenizer))
    bs = args.block_size
    if args.workload == "trace":
        if args.kv_pressure and cluster_kv_blocks:
            raise ValueError("--kv-pressure on a trace: size the workers' caches instead (bench rig does)")
        rows = trace.read_trace(args.trace or trace.DEFAULT_TRACE, args.limit)
        if not rows:
            raise ValueError("the trace has no requests")
        return trace.expand_trace(rows, words, args.block_tokens, bs, args.time_scale or 1.0,
                                  args.output_tokens, args.max_prompt_tokens, max_model_len)
    out = args.output_tokens or 16
    if args.workload == "shared-prefix":
        def make(groups: int):
            return synthetic.shared_prefix(words, bs, groups, args.prompts_per_group, args.shared_tokens,
                                           args.own_tokens, out, args.seed)
        base = args.groups
    elif args.workload == "agent":
        from kvbench.agent import agent

        def make(sessions: int):
            return agent(words, bs, sessions, args.turns, args.system_tokens, args.user_tokens, args.reply_tokens,
                         args.result_tokens, out, args.api, args.seed)
        base = args.conversations
    else:
        def make(conversations: int):
            return synthetic.multiturn(words, bs, conversations, args.turns, args.system_prompts or conversations,
                                       args.system_tokens, args.user_tokens, args.reply_tokens, out, args.seed)
        base = args.conversations
    if args.kv_pressure and cluster_kv_blocks:
        return synthetic.scale_for_kv_pressure(make, base, cluster_kv_blocks, args.kv_pressure)
    return make(base)


def prepare_outputs(args: argparse.Namespace) -> None:
    """Create the folders of ``--json`` and ``--plot`` now, so a bad path fails before the run.
    Raises OSError when one cannot be made (or ``--plot`` names a file)."""
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        if Path(args.json).is_dir():
            raise OSError(f"--json {args.json} is a folder")
    if args.plot:
        Path(args.plot).mkdir(parents=True, exist_ok=True)


def finish_report(report: dict, args: argparse.Namespace) -> None:
    """Write the JSON (first: nothing measured is lost), print the table, draw the plots."""
    from kvbench.report import table, write_json

    if args.json:
        write_json(report, args.json)
    print(table(report), flush=True)
    if args.json:
        print(f"json: {args.json}")
    if args.plot:
        from kvbench.plots import write_plots

        try:
            for path in write_plots(report, args.plot):
                print(f"plot: {path}")
        except RuntimeError as exc:
            print(f"no plots: {exc}", file=sys.stderr)
