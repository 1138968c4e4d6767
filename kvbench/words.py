"""Words that are exactly one token each in a model's tokenizer, so generated prompts have exact
token counts and a block of ``k`` words is a block of ``k`` tokens.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen) splits text on spaces before merging, so the
text ``" w1 w2 ... wn"`` (each word with its leading space) encodes as one token per word when each
``" w"`` is a single vocabulary entry. :class:`OneTokenWords` finds those entries and checks the
property on a sample sequence; a tokenizer where it does not hold raises ``ValueError``.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

import xxhash

from kvcore.tokenization import PromptTokenizer

MAX_WORDS = 4096  # enough variety; more only slows the check
MIN_WORDS = 8


class OneTokenWords:
    """The one-token words of ``tokenizer`` and text made of them.

    ``words``: sorted list of words (without the leading space), each encoding, with one leading
    space, to exactly one token id. ``prefix_tokens``: tokens a completions prompt gets before the
    text (vLLM encodes completions with ``add_special_tokens=True``: a BOS on Llama-style
    tokenizers, none on Qwen's). Raises ValueError when fewer than 8 such words exist or a space-
    joined sequence of them does not encode one token per word.
    """

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer
        backend = tokenizer._backend
        vocab = backend.get_vocab() if backend is not None else tokenizer._tok.get_vocab()
        words = set()
        for token_id in vocab.values():
            piece = tokenizer.decode([token_id])
            word = piece[1:]
            if (len(piece) >= 3 and piece[0] == " " and word.isascii() and word.isalpha()
                    and tokenizer.encode_text(piece, False) == [token_id]):
                words.add(word)
        self.words: list[str] = sorted(words)[:MAX_WORDS]
        if len(self.words) < MIN_WORDS:
            raise ValueError(f"tokenizer of {tokenizer.model_dir} has only {len(self.words)} one-token words")
        sample = random.Random(0).choices(self.words, k=256)
        if len(tokenizer.encode_text(self.text(sample), False)) != len(sample):
            raise ValueError(f"tokenizer of {tokenizer.model_dir}: space-joined one-token words do not "
                             f"encode one token each (not a byte-level BPE?)")
        self.prefix_tokens = len(tokenizer.encode_text("", True))

    @staticmethod
    def text(words: Sequence[str]) -> str:
        """``" w1 w2 ... wn"``: each word with its leading space (n tokens)."""
        return "".join(" " + w for w in words)

    def block(self, block_id: int, n_words: int, salt: str = "") -> list[str]:
        """``n_words`` words that depend only on ``(salt, block_id)``: the same id always gives the
        same words, and a shorter request of the same id gives a prefix of them."""
        seed = xxhash.xxh3_64_intdigest(f"{salt}/{block_id}".encode())
        rng = random.Random(seed)
        return rng.choices(self.words, k=n_words)

    def filler(self, seed: str, n_words: int) -> list[str]:
        """``n_words`` words for a free-text part (a user turn, a reply), deterministic per ``seed``."""
        rng = random.Random(xxhash.xxh3_64_intdigest(seed.encode()))
        return rng.choices(self.words, k=n_words)
