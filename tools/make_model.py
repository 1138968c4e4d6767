#!/usr/bin/env python3
"""Make a random Llama model directory that vLLM can serve, for tests and benchmarks.

    VLLM_PY tools/make_model.py OUT_DIR [--size tiny|small] [--seed 0]

Run it with an interpreter that has ``torch``, ``transformers`` and ``tokenizers`` (the vLLM
virtualenv has all three); it shows its steps on stderr (``step_progress.py``: a live display on a
terminal, plain lines otherwise). Nothing is downloaded:

- the tokenizer is a byte-level BPE trained here on a generated corpus (English-like words, JSON,
  code, numbers, accented text and emoji), with the special tokens ``<s>`` (id 0, BOS), ``</s>``
  (id 1, EOS), ``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``</tool_call>``; encoding with
  ``add_special_tokens=True`` prepends ``<s>`` (as Llama tokenizers do);
- ``chat_template.jinja`` is a ChatML-style template that renders ``tools`` (one JSON line per tool
  in the system turn), assistant ``tool_calls`` (one ``<tool_call>`` JSON per call) and ``tool``
  results; it starts with the BOS token, so chat prompts are encoded without special tokens;
- the weights are a ``LlamaForCausalLM`` in bfloat16 initialised with ``initializer_range=1.0``
  (the default 0.02 gives a near-uniform next-token distribution that ignores the prompt), so the
  output depends on the prompt and the KV cache.

Sizes (head size 64 and a block size that is a multiple of 32 suit vLLM's CPU backend):
``tiny`` (vocab 512, hidden 128, 2 layers, 2 heads, 1 KV head) for tests; ``small`` (vocab 2048,
hidden 256, 4 layers, 4 heads, 2 KV heads) for benchmarks, whose 2k-token prefill takes over 200 ms
on one core of a 2-core AVX2 machine (no bf16 instructions there: serve it with ``--dtype float32``,
bf16 is about 4x slower; a hidden-768 8-layer model took 41 s per 2k-token prefill in bf16).

``--sliding-window N`` makes a hybrid model, as Gemma 3 or gpt-oss are: ``layer_types`` alternates
``sliding_attention`` (an N-token window) and ``full_attention``, which vLLM serves with one KV cache
group per kind.

The output is deterministic for a given size, seed and window. Writes: ``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``, ``chat_template.jinja`` and ``kvroute_model.json`` (size, seed and
:data:`GENERATOR_VERSION`, so a cache can tell a stale directory).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

GENERATOR_VERSION = 3

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096},
    "small": {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192},
}
HEAD_DIM = 64
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# A ChatML-style template (written for kvroute): system turn carries the tool list; assistant turns
# may carry tool calls; tool results are their own turn. `continue_final_message` is handled by
# transformers (it cuts the text after the last message's content).
CHAT_TEMPLATE = r"""{{- bos_token }}
{%- set sys_first = messages and messages[0]['role'] == 'system' %}
{%- if tools or sys_first %}
    {{- '<|im_start|>system\n' }}
    {%- if sys_first %}{{- messages[0]['content'] }}{%- endif %}
    {%- if tools %}
        {%- if sys_first %}{{- '\n\n' }}{%- endif %}
        {{- 'You may call these tools:\n' }}
        {%- for tool in tools %}{{- tool | tojson }}{{- '\n' }}{%- endfor %}
        {{- 'Answer a call with <tool_call>{"name": ..., "arguments": ...}</tool_call>.' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if loop.first and sys_first %}
    {%- elif m['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if m['content'] %}{{- m['content'] }}{%- endif %}
        {%- if m['tool_calls'] is defined and m['tool_calls'] %}
            {%- for call in m['tool_calls'] %}
                {{- '\n<tool_call>{"name": ' ~ (call['function']['name'] | tojson) ~ ', "arguments": ' }}
                {{- (call['function']['arguments'] | tojson) ~ '}</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif m['role'] == 'tool' %}
        {{- '<|im_start|>tool\n' }}
        {%- if m['tool_call_id'] is defined %}{{- '[' ~ m['tool_call_id'] ~ '] ' }}{%- endif %}
        {{- m['content'] ~ '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part cache block token prefix route worker server request model prompt "
    "system user assistant tool weather city temperature search query result answer question data file "
    "function name arguments value error status order price customer account"
).split()
_UNICODE = ["café", "naïve", "Zürich", "señor", "façade", "Ελληνικά", "русский", "日本語", "中文", "한국어",
            "😀", "🚀", "✨", "👍🏽", "🇫🇷", "→", "…", "—", "€", "½"]


def corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Generated training text: sentences, JSON objects, code lines, numbers and unicode."""
    rnd = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 5
        if kind == 0:
            words = [rnd.choice(_WORDS) for _ in range(rnd.randint(4, 18))]
            lines.append(" ".join(words).capitalize() + rnd.choice([".", "?", "!", ","]))
        elif kind == 1:
            obj = {rnd.choice(_WORDS): rnd.choice([rnd.randint(0, 9999), rnd.choice(_WORDS), True, None])
                   for _ in range(rnd.randint(1, 4))}
            lines.append(json.dumps(obj))
        elif kind == 2:
            name = "_".join(rnd.choice(_WORDS) for _ in range(2))
            lines.append(f"def {name}(x, y=None):\n    return x + {rnd.randint(0, 99)}  # {rnd.choice(_WORDS)}")
        elif kind == 3:
            lines.append(" ".join(str(rnd.randint(0, 10 ** rnd.randint(1, 6))) for _ in range(rnd.randint(2, 8))))
        else:
            lines.append(" ".join(rnd.choice(_UNICODE + _WORDS) for _ in range(rnd.randint(3, 10))))
    return lines


def train_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on :func:`corpus`; BOS added on request."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


WRITE_STEPS = 5  # the steps write_model shows


@contextmanager
def _no_step(desc: str) -> Iterator[None]:
    yield None


def write_model(out: Path, size: str, seed: int, steps=None, sliding_window: int | None = None) -> None:
    """Write the model directory ``out`` (created if missing) for ``size`` and ``seed``, in
    :data:`WRITE_STEPS` steps shown on ``steps`` (a ``step_progress.Steps``; none by default);
    ``sliding_window``: tokens of the window of every other layer (None: full attention only)."""
    step = steps.step if steps is not None else _no_step
    spec = SIZES[size]
    with step("import torch and transformers"):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    with step(f"train the byte-level BPE tokenizer (vocab {spec['vocab_size']})"):
        tok = train_tokenizer(spec["vocab_size"], seed)
        assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    with step("write the tokenizer files and the chat template"):
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "model_max_length": spec["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        }, indent=2) + "\n")
        (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}) + "\n")
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    with step(f"initialise the Llama weights (hidden {spec['hidden_size']}, {spec['num_hidden_layers']} layers)"):
        cfg = LlamaConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=spec["hidden_size"],
            intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_hidden_layers"],
            num_attention_heads=spec["num_attention_heads"], num_key_value_heads=spec["num_key_value_heads"],
            head_dim=HEAD_DIM, max_position_embeddings=spec["max_position_embeddings"],
            bos_token_id=0, eos_token_id=1, tie_word_embeddings=True, initializer_range=1.0, rms_norm_eps=1e-6)
        if sliding_window is not None:  # read by vLLM's Llama (per-layer window); transformers keeps them
            cfg.layer_types = [("sliding_attention", "full_attention")[i % 2]
                               for i in range(spec["num_hidden_layers"])]
            cfg.sliding_window = sliding_window
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with step("save model.safetensors and the config"):
        model.save_pretrained(out, safe_serialization=True)
        meta = {"generator_version": GENERATOR_VERSION, "size": size, "seed": seed}
        if sliding_window is not None:
            meta["sliding_window"] = sliding_window
        (out / "kvroute_model.json").write_text(json.dumps(meta) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Write the model directory the arguments name, showing each step's progress on stderr (a
    live display on a terminal, plain lines otherwise); print its path on stdout."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="model directory to write")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sliding-window", type=int, default=None, metavar="TOKENS",
                    help="make every other layer sliding-window attention with this window (a hybrid model)")
    args = ap.parse_args(argv)
    if args.sliding_window is not None and args.sliding_window < 1:
        ap.error("--sliding-window must be >= 1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_progress import Steps

    with Steps(f"make the {args.size} model (seed {args.seed}) in {args.out}", WRITE_STEPS, "make_model") as steps:
        write_model(Path(args.out), args.size, args.seed, steps, args.sliding_window)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
