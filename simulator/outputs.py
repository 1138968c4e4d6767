"""Deterministic simulated output: token ids drawn by a seeded RNG, and their text.

The same (simulator seed, prompt token ids, choice index, request ``seed``) always gives the same
output tokens, so runs are reproducible and two identical requests get identical text.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

import xxhash

NATURAL_OUTPUT_TOKENS = (16, 96)  # when max_tokens is absent or larger: the RNG picks a length here
MAX_PIECE_TOKEN_ID = 8192  # only the first ids of a big vocabulary are considered


def text_pieces(decode, vocab_size: int) -> dict[int, str]:
    """{token id: text} of ordinary tokens: ``decode([id])`` printable, not a replacement char and
    not a ``<...>`` marker. ``decode``: e.g. :meth:`PromptTokenizer.decode`."""
    out = {}
    for i in range(min(vocab_size, MAX_PIECE_TOKEN_ID)):
        p = decode([i])
        if p and p.isprintable() and "\ufffd" not in p and not (p.startswith("<") and p.endswith(">")):
            out[i] = p
    return out


class OutputSampler:
    """Deterministic output token ids and their text pieces.

    ``pieces``: {token id: text} of the ordinary (non-special, printable) tokens the sampler draws
    from, e.g. built from the model's tokenizer by :func:`simulator.outputs.text_pieces`.
    ``sample(...)`` -> (token ids, finish reason); the same inputs give the same output.
    """

    def __init__(self, pieces: dict[int, str], seed: int) -> None:
        if not pieces:
            raise ValueError("no ordinary tokens to sample from")
        self.pieces = pieces
        self._ids = sorted(pieces)
        self.seed = seed

    def rng(self, prompt_token_ids: Sequence[int], index: int, request_seed: int | None) -> random.Random:
        h = xxhash.xxh3_64(seed=self.seed)
        h.update(repr((index, request_seed)).encode())
        h.update(b"".join(t.to_bytes(4, "little") for t in prompt_token_ids))
        return random.Random(h.intdigest())

    def sample(self, prompt_token_ids: Sequence[int], index: int, max_tokens: int | None,
               request_seed: int | None = None, ignore_eos: bool = False) -> tuple[list[int], str]:
        """Output token ids for one choice and the finish reason ("length" or "stop")."""
        rng = self.rng(prompt_token_ids, index, request_seed)
        natural = rng.randint(*NATURAL_OUTPUT_TOKENS)
        if max_tokens is not None and (ignore_eos or max_tokens <= natural):
            n, reason = max_tokens, "length"
        else:
            n, reason = natural, "stop"
        return [rng.choice(self._ids) for _ in range(n)], reason

    def text(self, token_ids: Sequence[int]) -> str:
        """Text of sampled token ids (the pieces joined)."""
        return "".join(self.pieces[t] for t in token_ids)
