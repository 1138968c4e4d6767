#!/usr/bin/env python3
"""Make a random LoRA adapter for a model directory that ``make_model.py`` wrote, for tests.

    VLLM_PY tools/make_lora.py BASE_DIR OUT_DIR [--seed 0] [--rank 8]

Run it with an interpreter that has ``torch`` and ``safetensors`` (the vLLM virtualenv has both).
The adapter is in PEFT's layout, which vLLM's LoRA loader reads (``vllm/lora/peft_helper.py`` for
the config, ``vllm/lora/utils.py`` ``parse_fine_tuned_lora_name`` for the weight names):

- ``adapter_config.json``: ``r`` (the rank), ``lora_alpha`` (2 x rank), ``target_modules``
  (``q_proj``, ``v_proj``), ``base_model_name_or_path`` (BASE_DIR), ``peft_type`` "LORA";
- ``adapter_model.safetensors``: per layer ``base_model.model.model.layers.{i}.self_attn.{q,v}_proj``
  ``.lora_A.weight`` of shape ``(rank, hidden)`` and ``.lora_B.weight`` of shape ``(out, rank)``,
  float32, drawn from N(0, 1) with ``seed`` (PEFT starts B at zero; a non-zero B makes the adapter
  change the model's output, so two adapters' KV differ from each other and from the base model's);
- ``kvroute_lora.json``: the seed, rank and base, so a cache can tell a stale directory.

The output is deterministic for a given base and seed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGET_MODULES = ("q_proj", "v_proj")


def lora_shapes(config: dict, rank: int) -> dict[str, tuple[int, int]]:
    """Weight name -> shape of the adapter for a Llama ``config`` (config.json's dict)."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out = {"q_proj": config["num_attention_heads"] * head_dim,
           "v_proj": config["num_key_value_heads"] * head_dim}
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes[f"{prefix}.lora_A.weight"] = (rank, hidden)
            shapes[f"{prefix}.lora_B.weight"] = (out[module], rank)
    return shapes


def write_lora(base: Path, out: Path, seed: int, rank: int = 8) -> None:
    """Write the adapter directory ``out`` (created if missing) for the model at ``base``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen, dtype=torch.float32)
               for name, shape in lora_shapes(config, rank).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(TARGET_MODULES), "fan_in_fan_out": False, "use_rslora": False,
    }, indent=2) + "\n")
    (out / "kvroute_lora.json").write_text(json.dumps({"seed": seed, "rank": rank, "base": str(base)}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="model directory (make_model.py's output)")
    ap.add_argument("out", help="adapter directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args(argv)
    write_lora(Path(args.base), Path(args.out), args.seed, args.rank)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
