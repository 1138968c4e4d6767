"""Prompt token ids and block keys for a request body, computed in a thread pool off the event loop.

Per model one :class:`kvcore.tokenization.PromptTokenizer` (vLLM's exact chat-template and
encode path); keys from :func:`kvcore.block_keys.block_keys` with the request's ``cache_salt`` and
LoRA adapter name as extras. When exact tokens cannot be made here (media parts: the router asks
a vLLM render endpoint, :mod:`router.route.render`; no tokenizer configured) the result says why; a
malformed prompt raises :class:`kvcore.tokenization.BadPrompt` (the gateway answers 400).
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvcore.block_keys import BlockExtras, block_keys
from kvcore.prompt_errors import MultimodalPrompt
from kvcore.sliding_window import declared_window_tokens
from kvcore.token_cache import DEFAULT_MAX_TOKENS
from kvcore.tokenization import BadPrompt, PromptTokenizer, UnsupportedPrompt
from router.config.schema import ModelConfig

PromptKind = Literal["chat", "completion", "messages", "responses"]
# the paths the policy routes, and the kind of body each takes
ROUTED_PATHS: dict[str, PromptKind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                                       "/v1/messages": "messages", "/v1/responses": "responses"}
# kinds whose body is not OpenAI chat or completions: no P/D legs, no usage option added
AGENT_KINDS = frozenset({"messages", "responses"})


@dataclass
class PromptBlocks:
    """A request's prompts as the engine will see them.

    ``token_ids``: one list per prompt (a completions body may carry several; vLLM runs one
    request per prompt), None when exact tokens could not be made; ``keys``: block keys per
    prompt (full blocks only); ``fallback``: why tokens are missing (a metric label), else None.
    """

    token_ids: list[list[int]] | None
    keys: list[list[int]] = field(default_factory=list)
    fallback: str | None = None

    @property
    def prompt_tokens(self) -> int | None:
        """Tokens of all prompts together, None when unknown."""
        return None if self.token_ids is None else sum(len(t) for t in self.token_ids)

    @property
    def first_keys(self) -> list[int]:
        """Keys of the first prompt (what routing matches), [] when unknown."""
        return self.keys[0] if self.keys else []


class TokenizerPool:
    """Tokenizers of every configured model plus the threads that run them.

    ``models``: the config's models; ``threads``: pool size; ``cache_max_tokens``: bound of each
    tokenizer's prefix token cache (:mod:`kvcore.token_cache`; 0: none). :meth:`load` must be
    awaited once before use (loading a tokenizer takes tens of ms to seconds).
    """

    def __init__(self, models: list[ModelConfig], threads: int = 2,
                 cache_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self._models = {m.name: m for m in models}
        self._cache_max_tokens = cache_max_tokens
        self._tokenizers: dict[str, PromptTokenizer] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvroute-tokenize")

    async def load(self) -> None:
        """Load every model's tokenizer (one at a time, in a pool thread: transformers' lazy
        imports are not thread-safe; models sharing a directory share one tokenizer).
        Raises OSError/ValueError for a bad directory, ValueError for a hybrid model whose
        window is not configured (:func:`check_sliding_window`)."""
        loop = asyncio.get_running_loop()
        by_dir: dict[str, PromptTokenizer] = {}
        for m in self._models.values():
            if not m.tokenizer or m.name in self._tokenizers:
                continue
            if m.tokenizer not in by_dir:
                by_dir[m.tokenizer] = await loop.run_in_executor(self._pool, PromptTokenizer, m.tokenizer,
                                                                 self._cache_max_tokens)
            self._tokenizers[m.name] = by_dir[m.tokenizer]
            check_sliding_window(m)

    def tokenizer(self, model: str) -> PromptTokenizer | None:
        """The loaded tokenizer of base model ``model``, None when it has none."""
        return self._tokenizers.get(model)

    def cache_totals(self) -> dict[str, int]:
        """Prefix token cache outcomes over every loaded tokenizer (each counted once):
        ``{"hit": n, "miss": n, "fallback": n}`` (see :class:`kvcore.token_cache.TokenCacheStats`)."""
        out = {"hit": 0, "miss": 0, "fallback": 0}
        for tok in {id(t): t for t in self._tokenizers.values()}.values():
            st = tok.cache_stats()
            if st is not None:
                out["hit"] += st.hits
                out["miss"] += st.misses
                out["fallback"] += st.fallbacks
        return out

    def engine_totals(self) -> dict[str, int]:
        """Text pieces encoded by each engine over the tokenizers :mod:`kvcore.bpe_fast` applies to
        (each counted once): ``{"tiktoken": n, "tokenizers": n}``."""
        out = {"tiktoken": 0, "tokenizers": 0}
        for tok in {id(t): t for t in self._tokenizers.values()}.values():
            if tok.fast_bpe is not None:
                out["tiktoken"] += tok.fast_bpe.fast_pieces
                out["tokenizers"] += tok.fast_bpe.slow_pieces
        return out

    async def prompt_blocks(self, model: ModelConfig, kind: PromptKind, body: dict[str, Any],
                            lora_name: str | None = None, inline: bool = False) -> PromptBlocks:
        """Token ids and block keys of ``body`` (an OpenAI chat or completions body) for base
        model ``model``. ``inline``: run on the calling thread (for small bodies, where the hop
        to a pool thread costs more than the work). Raises BadPrompt on a malformed prompt; never
        raises for inputs that cannot be tokenized exactly (see :class:`PromptBlocks.fallback`)."""
        tok = self._tokenizers.get(model.name)
        if tok is None:
            return PromptBlocks(None, fallback="no_tokenizer")
        if inline:
            return _prompt_blocks(tok, model, kind, body, lora_name)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _prompt_blocks, tok, model, kind, body, lora_name)

    def close(self) -> None:
        """Stop the threads (pending work is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_sliding_window(model: ModelConfig) -> None:
    """Refuse a hybrid model configured without its window (its prefix hits would be
    over-credited) or with another window than its ``config.json`` declares. Raises ValueError
    naming the fix; a directory without ``config.json`` is not checked."""
    path = Path(model.tokenizer or "") / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    declared = declared_window_tokens(hf_config) if isinstance(hf_config, dict) else None
    if declared is not None and model.sliding_window_tokens != declared:
        raise ValueError(
            f"model {model.name!r}: {path} declares sliding-window layers with a {declared}-token window, but "
            f"the config has sliding_window_tokens: {model.sliding_window_tokens}; set sliding_window_tokens: "
            f"{declared} so prefix hits are credited only where vLLM can reuse them")


def request_extras(body: dict[str, Any], lora_name: str | None) -> BlockExtras:
    """Block-key extras of a request: its ``cache_salt`` (vLLM's field) and LoRA adapter name.
    Raises BadPrompt when ``cache_salt`` is not a non-empty string."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadPrompt("'cache_salt' must be a non-empty string")
    if salt is None and lora_name is None:
        return BlockExtras()
    return BlockExtras(lora_name=lora_name, cache_salt=salt)


def _prompt_blocks(tok: PromptTokenizer, model: ModelConfig, kind: PromptKind, body: dict[str, Any],
                   lora_name: str | None) -> PromptBlocks:
    """Runs in a pool thread: render, encode and key the prompt(s)."""
    try:
        extras = request_extras(body, lora_name)
        if kind == "chat":
            prompts = [tok.encode_chat(body)]
        elif kind == "messages":
            prompts = [tok.encode_messages(body)]
        elif kind == "responses":
            prompts = [tok.encode_responses(body)]
        else:
            prompts = tok.encode_completion(body)
    except MultimodalPrompt:  # the gateway may have it rendered (router.route.render)
        return PromptBlocks(None, fallback="multimodal")
    except UnsupportedPrompt:
        return PromptBlocks(None, fallback="unsupported_prompt")
    except BadPrompt:
        if kind in AGENT_KINDS:  # the worker answers it, with the error vLLM gives in that API's shape
            return PromptBlocks(None, fallback="bad_prompt")
        raise
    except RecursionError:  # e.g. tool-call arguments nested ~1000 deep: json.loads gives up
        raise BadPrompt("the prompt is nested too deeply to parse") from None
    try:
        keys = [block_keys(ids, model.block_size, model.name, extras) for ids in prompts]
    except ValueError as exc:  # a token id outside 0..2**32-1
        raise BadPrompt(str(exc)) from None
    return PromptBlocks(prompts, keys)


__all__ = ["AGENT_KINDS", "BadPrompt", "PromptBlocks", "PromptKind", "ROUTED_PATHS", "TokenizerPool", "request_extras"]
