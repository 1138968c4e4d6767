"""Mooncake-format traces expanded into deterministic completions prompts.

Trace format (kvcache-ai/Mooncake, FAST'25 release, ``traces/conversation_trace.jsonl``; one JSON
object per line): ``timestamp`` (ms from the first request), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (chained ids of the prompt's 512-token blocks: an equal id
at position i means equal first (i+1) x 512 tokens; the last block may be partial).

Expansion: each 512-token trace block becomes ``block_tokens`` one-token words that depend only on
its hash id (:meth:`OneTokenWords.block`), so requests sharing their first k hash ids share their
first k x ``block_tokens`` prompt tokens exactly. Block 0 is shortened by the tokens the tokenizer
puts before a completions prompt (a BOS), so trace block k ends on token (k+1) x ``block_tokens``
and, with ``block_tokens`` a multiple of the engine's block size, on an engine block boundary.
A partial last block keeps its share (``input_length mod 512`` scaled the same way). Output
lengths are scaled by the same factor unless fixed.

The repository ships the first 1,000 requests of the public conversation trace
(``kvbench/data/``, Apache-2.0, see the README there) as the default trace.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvbench.words import OneTokenWords
from kvbench.workload import BenchRequest, Workload

TRACE_BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_1000.jsonl"


@dataclass(frozen=True)
class TraceRow:
    """One trace request as read: arrival ``timestamp_ms``, token counts and block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path, limit: int | None = None) -> list[TraceRow]:
    """The first ``limit`` rows (all when None) of a Mooncake JSONL trace.

    Raises ValueError naming the line on a row without the four fields or with
    ``len(hash_ids) != ceil(input_length / 512)``."""
    rows: list[TraceRow] = []
    with Path(path).open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                row = TraceRow(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                               tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row ({exc})") from None
            if row.input_length < 1 or row.output_length < 0:
                raise ValueError(f"{path}:{line_no}: input_length must be >= 1 and output_length >= 0")
            if len(row.hash_ids) != -(-row.input_length // TRACE_BLOCK_TOKENS):
                raise ValueError(f"{path}:{line_no}: {len(row.hash_ids)} hash_ids for input_length "
                                 f"{row.input_length} (want ceil(input_length / {TRACE_BLOCK_TOKENS}))")
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    return rows


def expand_trace(rows: list[TraceRow], words: OneTokenWords, block_tokens: int, block_size: int,
                 time_scale: float = 1.0, output_tokens: int | None = None,
                 max_prompt_tokens: int | None = None, max_model_len: int | None = None) -> Workload:
    """The workload of ``rows``: completions requests with text prompts (see the module docstring).

    ``block_tokens``: prompt tokens per 512-token trace block (64 turns a 14k-token trace prompt
    into 1.8k); ``block_size``: the engine's block size (for the ideal hit rate); ``time_scale``:
    arrivals at ``timestamp / time_scale`` (2 = twice the rate); ``output_tokens``: fixed output
    length, else the trace's scaled by ``block_tokens / 512`` (at least 1); ``max_prompt_tokens``:
    longer prompts keep only their leading whole trace blocks; ``max_model_len``: the engines'
    context, so a prompt is also cut to leave room for its output.
    Raises ValueError when ``block_tokens`` does not exceed the tokenizer's prefix tokens.
    """
    if block_tokens <= words.prefix_tokens:
        raise ValueError(f"--block-tokens must exceed the {words.prefix_tokens} token(s) the tokenizer adds")
    if time_scale <= 0:
        raise ValueError("--time-scale must be > 0")
    scale = block_tokens / TRACE_BLOCK_TOKENS
    t0 = rows[0].timestamp_ms if rows else 0.0
    requests = []
    for i, row in enumerate(rows):
        full, rest = divmod(row.input_length, TRACE_BLOCK_TOKENS)
        sizes = [block_tokens] * full + ([max(1, round(rest * scale))] if rest else [])
        sizes[0] -= words.prefix_tokens
        out = output_tokens if output_tokens is not None else max(1, round(row.output_length * scale))
        cap = min(max_prompt_tokens or 1 << 62, (max_model_len - out) if max_model_len else 1 << 62)
        while len(sizes) > 1 and sum(sizes) + words.prefix_tokens > cap:
            sizes.pop()
        prompt_words: list[str] = []
        for block_id, n in zip(row.hash_ids, sizes):
            prompt_words += words.block(block_id, n, salt="trace")
        prompt = words.text(prompt_words)
        ids = words.tokenizer.encode_text(prompt, True)
        requests.append(BenchRequest(
            index=i, endpoint="completions", body={"prompt": prompt}, prompt_token_ids=ids,
            output_tokens=out, arrival_s=(row.timestamp_ms - t0) / 1000.0 / time_scale,
            group=str(row.hash_ids[1] if len(row.hash_ids) > 1 else row.hash_ids[0])))
    return Workload("trace", requests, block_size,
                    {"block_tokens": block_tokens, "time_scale": time_scale})
