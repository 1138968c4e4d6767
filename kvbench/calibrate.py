"""``kvroute bench calibrate``: fit ``kvroute sim``'s timing model to a real worker.

Three measurements against one idle worker, every prompt new (unique one-token words, so nothing
is cached), streamed, timed by :func:`kvbench.client.send`:

1. prefill vs uncached tokens: one request at a time of ``n`` prompt tokens, ``max_tokens`` 1;
   TTFT = ``prefill_overhead_ms + prefill_ms_per_token x n + prefill_ms_per_token_sq x n^2`` by
   least squares (the square is attention; a negative coefficient is dropped and the rest refitted);
2. prefill vs batch: ``b`` such requests at once; vLLM schedules them into the same steps, so the
   last TTFT is compared with the model's step of ``b`` prefills (a check, not fitted);
3. decode vs batch: ``b`` requests at once with a short prompt and ``decode_tokens`` outputs;
   median inter-token latency = ``decode_ms_per_token + decode_ms_per_seq x (b - 1)`` by least
   squares.

Prints the fitted ``kvroute sim`` flags and a table of measured against the fit; running it again
against a sim started with those flags shows how closely the sim reproduces the worker.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
from pathlib import Path
from typing import Any

import aiohttp

from kvbench.client import send
from kvbench.workload import BenchRequest


def fit_prefill(ns: list[float], ttfts: list[float]) -> tuple[float, float, float]:
    """Least-squares ``(overhead, per_token, per_token_sq)`` of TTFT ms on prompt tokens, each
    >= 0: a negative coefficient is fixed at 0 and the others refitted (numpy.linalg.lstsq)."""
    import numpy as np

    x, y = np.asarray(ns, float), np.asarray(ttfts, float)
    columns = [np.ones_like(x), x, x * x]
    keep = [0, 1, 2]
    while keep:
        coef, *_ = np.linalg.lstsq(np.stack([columns[k] for k in keep], axis=1), y, rcond=None)
        if (coef >= 0).all():
            out = [0.0, 0.0, 0.0]
            for k, c in zip(keep, coef):
                out[k] = float(c)
            return out[0], out[1], out[2]
        keep.pop(int(np.argmin(coef)))
    return 0.0, 0.0, 0.0


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` on ``xs``; slope 0 when all xs are equal.
    Raises ValueError on fewer than one point."""
    if not xs:
        raise ValueError("no points to fit")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``kvroute bench calibrate`` to the ``bench`` subparsers."""
    p = sub.add_parser("calibrate", help="fit kvroute sim's timing model to a real worker",
                       description=__doc__.split("\n\n")[0] + ": measures prefill time against uncached "
                                   "tokens and batch, and decode time against batch, on one idle worker, "
                                   "and prints the kvroute sim flags that reproduce them.")
    p.add_argument("--url", required=True, help="the worker (http://host:port), idle while this runs")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="the worker's model directory")
    p.add_argument("--prompt-tokens", default="64,256,512,1024,1536,2048", help="prompt sizes for the prefill fit")
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes for the batch checks and the decode fit")
    p.add_argument("--batch-prompt-tokens", type=int, default=512, help="prompt size in the batched prefills")
    p.add_argument("--decode-tokens", type=int, default=48, help="outputs per request in the decode runs")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement (median taken)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write measurements and fit")
    p.set_defaults(func=_calibrate)


async def _batch(session: aiohttp.ClientSession, url: str, model: str, prompts: list[str], out_tokens: int):
    reqs = [BenchRequest(i, "completions", {"prompt": p}, [], out_tokens) for i, p in enumerate(prompts)]
    recs = await asyncio.gather(*(send(session, url, r, model, 0.0, 600.0) for r in reqs))
    bad = [r.error for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"calibration request failed: {bad[0]}")
    return recs


async def measure(url: str, model: str, words, sizes: list[int], batches: list[int], batch_tokens: int,
                  decode_tokens: int, repeats: int) -> dict[str, Any]:
    """The three measurements (module docstring); times in ms, medians over ``repeats``."""
    seq = iter(range(1 << 30))
    run_id = secrets.token_hex(8)  # prompts never seen before, even by a worker calibrated earlier

    def prompt(n: int) -> str:
        return words.text(words.filler(f"calibrate-{run_id}-{next(seq)}", n - words.prefix_tokens))

    out: dict[str, Any] = {"prefill": [], "batched_prefill": [], "decode": []}
    async with aiohttp.ClientSession() as session:
        await _batch(session, url, model, [prompt(64)], 2)  # warm-up
        for n in sizes:
            ttft = [(await _batch(session, url, model, [prompt(n)], 1))[0].ttft_ms for _ in range(repeats)]
            out["prefill"].append({"prompt_tokens": n, "ttft_ms": statistics.median(ttft)})
        for b in batches:
            last = []
            itl = []
            for _ in range(repeats):
                recs = await _batch(session, url, model, [prompt(batch_tokens) for _ in range(b)], 1)
                last.append(max(r.ttft_ms for r in recs))
                recs = await _batch(session, url, model, [prompt(32) for _ in range(b)], decode_tokens)
                # the middle of the run, where all b sequences decode together
                gaps = [g for r in recs for g in r.itl_ms[decode_tokens // 4: 3 * decode_tokens // 4]]
                itl.append(statistics.median(gaps))
            out["batched_prefill"].append({"batch": b, "prompt_tokens": batch_tokens,
                                           "last_ttft_ms": statistics.median(last)})
            out["decode"].append({"batch": b, "itl_ms": statistics.median(itl)})
    return out


def fit(measured: dict[str, Any]) -> dict[str, float]:
    """The ``kvroute sim`` timing values fitted to :func:`measure`'s output (ms)."""
    a, b, q = fit_prefill([m["prompt_tokens"] for m in measured["prefill"]],
                          [m["ttft_ms"] for m in measured["prefill"]])
    c, d = fit_line([m["batch"] - 1 for m in measured["decode"]], [m["itl_ms"] for m in measured["decode"]])
    return {"prefill_overhead_ms": a, "prefill_ms_per_token": b, "prefill_ms_per_token_sq": q,
            "decode_ms_per_token": max(0.0, c), "decode_ms_per_seq": max(0.0, d)}


def _prefill_ms(f: dict[str, float], batch: int, n: int) -> float:
    return (f["prefill_overhead_ms"] + f["prefill_ms_per_token"] * batch * n
            + f["prefill_ms_per_token_sq"] * batch * n * n)


def calibration_table(measured: dict[str, Any], f: dict[str, float]) -> str:
    """Measured against fitted, one line per point."""
    lines = [f"{'measurement':<34}{'measured ms':>12}{'fit ms':>10}"]
    for m in measured["prefill"]:
        pred = _prefill_ms(f, 1, m["prompt_tokens"])
        lines.append(f"{'prefill ' + str(m['prompt_tokens']) + ' tokens':<34}{m['ttft_ms']:>12.1f}{pred:>10.1f}")
    for m in measured["batched_prefill"]:
        pred = _prefill_ms(f, m["batch"], m["prompt_tokens"])
        label = f"prefill {m['batch']} x {m['prompt_tokens']} at once (last)"
        lines.append(f"{label:<34}{m['last_ttft_ms']:>12.1f}{pred:>10.1f}")
    for m in measured["decode"]:
        pred = f["decode_ms_per_token"] + f["decode_ms_per_seq"] * (m["batch"] - 1)
        lines.append(f"{'decode step, batch ' + str(m['batch']):<34}{m['itl_ms']:>12.1f}{pred:>10.1f}")
    return "\n".join(lines)


def _calibrate(args: argparse.Namespace) -> int:
    from kvcore.tokenization import PromptTokenizer
    from kvbench.words import OneTokenWords

    try:
        words = OneTokenWords(PromptTokenizer(args.tokenizer))
        sizes = [int(x) for x in args.prompt_tokens.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        measured = asyncio.run(measure(args.url.rstrip("/").removesuffix("/v1"), args.model, words, sizes, batches,
                                       args.batch_prompt_tokens, args.decode_tokens, args.repeats))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"kvroute bench calibrate: {exc}", file=sys.stderr)
        return 1
    f = fit(measured)
    print(calibration_table(measured, f))
    print("kvroute sim " + " ".join(f"--{k.replace('_', '-')} {v:.4g}" for k, v in f.items()))
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "fit": f}, indent=1))
    return 0
