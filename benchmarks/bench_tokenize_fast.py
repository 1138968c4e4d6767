#!/usr/bin/env python3
"""Prompt encoding CPU: ``tokenizers`` against kvcore.bpe_fast.FastBPE (tiktoken), same ids.

Tokenizers: the tiny fixture (``tests/fixtures/tiny-model``, vocab 330), the generated small model
when it is there (``.cache/models/small-seed0``, vocab 2,048), and two byte-level BPEs of
``--vocab`` tokens trained here on this Python's standard library sources: one GPT-2-shaped
(``ByteLevel`` with its regex), one Llama 3 / Qwen 2-shaped (NFC, a ``Split`` by a cl100k-style
regex, ``ignore_merges``). Prompts: ASCII slices of other standard-library files, ``--tokens``
tokens each (with the tokenizer at hand). Real vocabularies can be added: ``--tokenizer-json`` a
model's ``tokenizer.json`` (litellm's wheel bundles DeepSeek V3's and Anthropic's), and
``--tiktoken-bpe`` a tiktoken rank file (litellm bundles cl100k_base and o200k_base) turned into a
``tokenizers`` BPE as Llama 3's ``tokenizer.json`` was made (transformers' ``TikTokenConverter``,
Llama 3's split regex, ``ignore_merges``).

Per tokenizer and prompt length, each engine encodes the same prompts one call per prompt, as the
gateway does (``tokenizers``: ``encode_batch_fast`` of one text, :func:`kvcore.token_cache.encode_ids`;
``FastBPE.encode_many`` of one text), ``--repeats`` rounds taking turns; the table gives the median
microseconds per prompt and nanoseconds per token over the rounds, and the ratio. Every prompt's
ids are compared first: a difference fails the run. Process CPU time (``time.process_time``).

Usage: python benchmarks/bench_tokenize_fast.py [--repeats 5] [--tokens 500 2000 8000] [--vocab 32000]
       [--tokenizer-json FILE ...] [--tiktoken-bpe FILE ...] [--json FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvcore.bpe_fast import FastBPE
from kvcore.token_cache import encode_ids
from lab.figures import add_output_args, add_table, emit, new_figures

ROOT = Path(__file__).resolve().parents[1]
CL100K_LIKE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _sources() -> tuple[list[str], list[str]]:
    """ASCII standard-library sources, split in two: for training and for prompts."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = []
    for f in files:
        try:
            t = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if t.isascii() and len(t) > 2000:
            texts.append(t)
    return texts[0::2], texts[1::2]


def _trained(train: list[str], vocab: int, llama3: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=llama3))
    if llama3:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(pattern=Regex(CL100K_LIKE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(train, trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|im_start|>", "<|im_end|>"]))
    return tok


def _from_tiktoken(path: Path) -> Tokenizer:
    """A tiktoken rank file (``base64-token rank`` lines) as a ``tokenizers`` BPE, converted by
    transformers' ``TikTokenConverter`` with its default (Llama 3's) regex."""
    import base64

    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    conv = TikTokenConverter(vocab_file=str(path), additional_special_tokens=["<|begin_of_text|>", "<|eot_id|>"])
    conv.load_tiktoken_bpe = lambda _url: ranks
    return conv.converted()


def _prompts(tok: Tokenizer, texts: list[str], tokens: int, n: int) -> list[str]:
    """``n`` slices of ``texts`` of about ``tokens`` tokens each."""
    joined = "\n".join(texts)
    ids = encode_ids(tok, [joined[:4_000_000]], False)[0]
    chars_per_token = min(len(joined), 4_000_000) / max(1, len(ids))
    size = int(tokens * chars_per_token)
    return [joined[i * size:(i + 1) * size] for i in range(n) if (i + 1) * size <= len(joined)]


def _cpu_per_prompt_s(encode, prompts: list[str]) -> float:
    t0 = time.process_time()
    for p in prompts:
        encode([p], False)
    return (time.process_time() - t0) / len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[500, 2000, 8000])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=60, help="prompts per length")
    ap.add_argument("--tokenizer-json", type=Path, nargs="*", default=[], help="real tokenizer.json files to add")
    ap.add_argument("--tiktoken-bpe", type=Path, nargs="*", default=[], help="tiktoken rank files to add")
    add_output_args(ap)
    args = ap.parse_args()

    train, held = _sources()
    tokenizers = {"tiny fixture (330)": Tokenizer.from_file(str(ROOT / "tests/fixtures/tiny-model/tokenizer.json"))}
    small = ROOT / ".cache/models/small-seed0/tokenizer.json"
    if small.exists():
        tokenizers["small model (2,048)"] = Tokenizer.from_file(str(small))
    t0 = time.monotonic()
    tokenizers[f"GPT-2 shape ({args.vocab:,})"] = _trained(train, args.vocab, llama3=False)
    tokenizers[f"Llama 3 shape ({args.vocab:,})"] = _trained(train, args.vocab, llama3=True)
    print(f"trained two tokenizers in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    for path in args.tokenizer_json:
        tok = Tokenizer.from_file(str(path))
        tokenizers[f"{path.stem} ({tok.get_vocab_size():,})"] = tok
    for path in args.tiktoken_bpe:
        tok = _from_tiktoken(path)
        tokenizers[f"tiktoken {path.name[:8]} ({tok.get_vocab_size():,})"] = tok

    rows = []
    for name, tok in tokenizers.items():
        t0 = time.perf_counter()
        fast = FastBPE.build(tok)
        build_ms = (time.perf_counter() - t0) * 1000
        slow = lambda texts, add, tok=tok: encode_ids(tok, texts, add)  # noqa: E731
        for tokens in args.tokens:
            prompts = _prompts(tok, held, tokens, args.prompts)
            want = [encode_ids(tok, [p], False)[0] for p in prompts]
            got = [fast.encode_many([p], False)[0] for p in prompts]
            if got != want:
                sys.exit(f"{name}: FastBPE's ids differ from tokenizers' on a {tokens}-token prompt")
            mean_tokens = statistics.mean(len(w) for w in want)
            runs: dict[str, list[float]] = {"tokenizers": [], "fast": []}
            for _ in range(args.repeats):
                runs["tokenizers"].append(_cpu_per_prompt_s(slow, prompts))
                runs["fast"].append(_cpu_per_prompt_s(fast.encode_many, prompts))
            med = {k: statistics.median(v) for k, v in runs.items()}
            rows.append({
                "tokenizer": name, "prompt_tokens": round(mean_tokens), "prompts": len(prompts),
                "tokenizers_us_per_prompt": round(med["tokenizers"] * 1e6, 1),
                "fast_us_per_prompt": round(med["fast"] * 1e6, 1),
                "tokenizers_ns_per_token": round(med["tokenizers"] * 1e9 / mean_tokens, 1),
                "fast_ns_per_token": round(med["fast"] * 1e9 / mean_tokens, 1),
                "fast_over_tokenizers": round(med["fast"] / med["tokenizers"], 3),
                "build_ms": round(build_ms, 1), "repeats": args.repeats})
    print(f"{'tokenizer':<24} {'tokens':>7} {'tokenizers us':>14} {'fast us':>9} {'ns/token':>15} {'fast/tok':>9}")
    for r in rows:
        print(f"{r['tokenizer']:<24} {r['prompt_tokens']:>7} {r['tokenizers_us_per_prompt']:>14} "
              f"{r['fast_us_per_prompt']:>9} {r['tokenizers_ns_per_token']:>7}/{r['fast_ns_per_token']:<7} "
              f"{r['fast_over_tokenizers']:>9}")
    print(f"medians of {args.repeats} rounds, engines taking turns; FastBPE built in "
          + ", ".join(f"{r['build_ms']} ms" for r in rows[::len(args.tokens)]))
    fig = new_figures("tokenize_fast", vars(args))
    add_table(fig, "encode", rows)
    emit(fig, args)


if __name__ == "__main__":
    main()
