"""``kvroute sim``: one simulated vLLM server. Every flag vLLM also has keeps vLLM's name and
meaning (``vllm serve``), so a launch line can swap the two; the timing flags are the simulator's."""
from __future__ import annotations

import argparse

from simulator.config import (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
                              DEFAULT_NUM_GPU_BLOCKS)
from simulator.timing import (DEFAULT_DECODE_MS_PER_TOKEN, DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_KV_LINK_GBPS,
                              DEFAULT_PREFILL_MS_PER_TOKEN, DEFAULT_PREFILL_OVERHEAD_MS, PRESETS)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sim`` subcommand to the ``kvroute`` parser."""
    p = subparsers.add_parser("sim", help="run one simulated vLLM server (HTTP + KV events)",
                              description="A simulated vLLM server: OpenAI HTTP API, vLLM KV events "
                                          "over ZMQ, vLLM metrics; no model weights are used.")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model directory (its tokenizer and chat template are used)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name clients send (default: --model as given)")
    p.add_argument("--host", default="0.0.0.0", help="HTTP listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--num-gpu-blocks-override", type=int, default=DEFAULT_NUM_GPU_BLOCKS, metavar="N",
                   help=f"KV blocks in the pool, null block included (default {DEFAULT_NUM_GPU_BLOCKS})")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                   help=f"most sequences running at once; more wait (default {DEFAULT_MAX_NUM_SEQS})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help=f"token budget of one engine step; longer prefills are chunked (default: the timing "
                        f"preset's, else {DEFAULT_MAX_NUM_BATCHED_TOKENS}, vLLM's on an H100; vLLM's CPU "
                        f"build uses 2048)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KVEventsConfig as JSON, e.g. '{\"enable_kv_cache_events\": true, "
                        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}'")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens")
    p.add_argument("--timing-preset", choices=sorted(PRESETS), default=None,
                   help="named timing costs; the flags below override single values. "
                        + "; ".join(f"{k}: {v.source} ({v.prefill_overhead_ms:g} ms + {v.prefill_ms_per_token:g} "
                                    f"ms/token prefill, {v.decode_ms_per_token:g} ms decode step + "
                                    f"{v.decode_ms_per_seq:g} ms per extra sequence, {v.prefill_ms_per_token_sq:g} ms per "
                                    f"token x token of attention)" for k, v in PRESETS.items()))
    p.add_argument("--prefill-overhead-ms", type=float, default=None,
                   help=f"fixed cost of a step with prefill (default {DEFAULT_PREFILL_OVERHEAD_MS})")
    p.add_argument("--prefill-ms-per-token", type=float, default=None,
                   help=f"cost per uncached prompt token (default {DEFAULT_PREFILL_MS_PER_TOKEN})")
    p.add_argument("--prefill-ms-per-token-sq", type=float, default=None,
                   help="attention cost: ms per (uncached token x prompt token) of each prefill (default 0)")
    p.add_argument("--decode-ms-per-token", type=float, default=None,
                   help=f"cost of a decode step at batch 1 (default {DEFAULT_DECODE_MS_PER_TOKEN})")
    p.add_argument("--decode-ms-per-seq", type=float, default=None,
                   help="decode-step cost added by each running sequence beyond the first (default: "
                        "decode-ms-per-token / 64)")
    p.add_argument("--kv-bytes-per-token", type=float, default=None, metavar="BYTES",
                   help="P/D: KV bytes of one token, all layers, moved to a decode worker instead of its prefill "
                        f"(default: the timing preset's, else {DEFAULT_KV_BYTES_PER_TOKEN}, an 8B model in bf16)")
    p.add_argument("--kv-link-gbps", type=float, default=None, metavar="GBPS",
                   help=f"P/D: the link a decode worker loads remote KV over, Gb/s; one load at a time "
                        f"(default {DEFAULT_KV_LINK_GBPS:g})")
    p.add_argument("--kv-load", choices=("prompt", "full-blocks"), default="prompt",
                   help="P/D: what a decode worker loads instead of computing: 'prompt' (vLLM's NixlConnector and "
                        "MooncakeConnector: the whole prompt; its last token is computed again) or 'full-blocks' "
                        "(kvroute's tiers connector: full blocks only, the partial last block computed) "
                        "(default prompt)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served beside the model, as vLLM's flag (NAME=PATH or vLLM's JSON form "
                        "'{\"name\": ..., \"path\": ...}'): a request naming one is served with its name mixed into "
                        "every block's engine hash and KV event, as vLLM does (no weights are read)")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="engines behind this one server, as vLLM's flag: each its own block pool "
                        "(--num-gpu-blocks-override each), KV events on the endpoints offset by its rank, metrics "
                        "labelled engine=<rank>; a request goes to its X-data-parallel-rank header's rank, else "
                        "the least loaded (default 1)")
    p.add_argument("--speedup", type=float, default=1.0, help="divide all simulated times by this (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine hashes and output text (default 0)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from simulator.server import run_from_args

    return run_from_args(args)
