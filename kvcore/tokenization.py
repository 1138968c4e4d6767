"""Prompt token ids exactly as vLLM makes them, from an OpenAI request body.

vLLM 0.32's path (``renderers/online_renderer.py`` -> ``renderers/hf.py``, ``chat_utils.py``):

- chat: messages are parsed (text parts of a multi-part content joined with "\\n" when the
  template takes string content; kept as ``[{"type": "text", "text": ...}]`` parts when it loops
  over content), the ``developer`` role mapped to ``system`` when the template has no
  ``developer``, assistant ``tool_calls`` arguments turned from JSON strings into dicts, then
  rendered with the model's chat template (``tokenize=False``; the compiled template is rendered
  directly when ``apply_chat_template`` would add only the special tokens) with ``tools``, ``documents``,
  ``add_generation_prompt`` (default True), ``continue_final_message``, ``reasoning_effort`` and
  the request's ``chat_template_kwargs``; the text is encoded with
  ``add_special_tokens`` (default **False** for chat: the template supplies BOS itself).
- completions: ``prompt`` is a string, a list of strings, a list of token ids or a list of lists
  of token ids; strings are encoded with ``add_special_tokens`` (default **True**).

Media parts (images, audio, video) raise :class:`kvcore.prompt_errors.MultimodalPrompt`: their
token ids depend on the model's processor, so the gateway has vLLM render them
(:mod:`router.route.render`). Other inputs we cannot reproduce exactly (files, prompt embeddings) raise
:class:`UnsupportedPrompt`; the gateway then routes by load and counts a fallback.

Text is encoded through a :class:`kvcore.token_cache.PrefixTokenCache` (exact: it cuts only where
the tokenizer itself cuts, at special tokens), so a chat turn re-sending its history encodes only
the new messages; what it encodes goes through :class:`kvcore.bpe_fast.FastBPE` (tiktoken, the same
ids) when the tokenizer is a byte-level BPE it proves exact for, else through ``tokenizers``.
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcore.anthropic_messages import messages_to_chat
from kvcore.bpe_fast import FastBPE
from kvcore.prompt_errors import BadPrompt, MultimodalPrompt, UnsupportedPrompt
from kvcore.responses_input import responses_to_chat
from kvcore.token_cache import (DEFAULT_MAX_TOKENS, PrefixTokenCache, TokenCacheStats, UnsupportedTokenizer,
                                encode_ids)

log = logging.getLogger("kvroute.tokenization")


_TEXT_PART_TYPES = {"text", "input_text"}
# vLLM's chat content parts that carry media (vllm/entrypoints/chat_utils.py's parsers)
MEDIA_PART_TYPES = frozenset({"image_url", "image_embeds", "input_image", "audio_url", "input_audio", "audio_embeds",
                              "video_url"})
_OPENAI_CONTENT_RE = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


class PromptTokenizer:
    """Renders and tokenizes request bodies for one model directory (HF tokenizer + template).

    ``model_dir``: a directory holding ``tokenizer.json``/``tokenizer_config.json`` and a chat
    template (``chat_template.jinja`` or in the tokenizer config); ``cache_max_tokens``: bound of
    the prefix token cache (:mod:`kvcore.token_cache`; 0 turns it off; a tokenizer it cannot cut
    exactly gets none, logged). Construction loads the tokenizer (tens of ms); the methods are
    thread-safe (HF fast tokenizers are, the cache locks), so the gateway runs them in a thread
    pool off its event loop.
    """

    def __init__(self, model_dir: str | Path, cache_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        from transformers import AutoTokenizer  # heavy import: only when a tokenizer is made
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.model_dir = str(model_dir)
        self._tok = AutoTokenizer.from_pretrained(self.model_dir)
        self._backend = getattr(self._tok, "backend_tokenizer", None)  # tokenizers.Tokenizer
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        self._template: str | None = template
        self._template_has_developer = bool(template) and "developer" in template
        # the model's template compiled as transformers compiles it, and what apply_chat_template
        # adds to a render: rendered directly when a request needs nothing else (render_chat)
        self._compiled = None
        if template:
            try:
                self._compiled = _compile_jinja_template(template)
            except Exception as exc:  # noqa: BLE001 - a template jinja refuses: apply_chat_template says why per request
                log.info("%s: chat template not compiled (%s)", self.model_dir, exc)
        # the template's globals (jinja's and transformers' raise_exception, strftime_now) as one
        # dict: Template.render flattens their ChainMap into each render's context (_render)
        self._globals = dict(self._compiled.globals) if self._compiled is not None else {}
        self._special_kwargs = dict(self._tok.special_tokens_map)
        self._apply_params = frozenset(inspect.signature(self._tok.apply_chat_template).parameters)
        self.content_format = "openai" if template and _OPENAI_CONTENT_RE.search(template) else "string"
        self.fast_bpe: FastBPE | None = None
        self._encode: Callable[[list[str], bool], list[list[int]]] | None = None
        if self._backend is not None:
            self._encode = functools.partial(encode_ids, self._backend)
            try:
                self.fast_bpe = FastBPE.build(self._backend)
                self._encode = self.fast_bpe.encode_many
                log.info("%s: byte-level BPE through tiktoken (exact for this tokenizer)", self.model_dir)
            except ValueError as exc:
                log.info("%s: encoded by tokenizers alone (%s)", self.model_dir, exc)
        self.token_cache: PrefixTokenCache | None = None
        if self._backend is not None and cache_max_tokens > 0:
            try:
                self.token_cache = PrefixTokenCache(self._backend, cache_max_tokens, encoder=self._encode)
            except UnsupportedTokenizer as exc:
                log.info("%s: no prefix token cache (%s)", self.model_dir, exc)

    # ---- chat ---------------------------------------------------------------------------------
    def render_chat(self, body: dict[str, Any]) -> str:
        """The chat template's output text for a chat-completions body (vLLM's kwargs)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadPrompt("'messages' must be a non-empty list")
        conversation = [self._parse_message(m, i) for i, m in enumerate(messages)]
        kwargs: dict[str, Any] = {}
        extra = body.get("chat_template_kwargs")
        if extra is not None:
            if not isinstance(extra, dict):
                raise BadPrompt("'chat_template_kwargs' must be an object")
            kwargs.update(extra)
        kwargs["add_generation_prompt"] = bool(body.get("add_generation_prompt", True))
        kwargs["continue_final_message"] = bool(body.get("continue_final_message", False))
        if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
            raise BadPrompt("'add_generation_prompt' and 'continue_final_message' are exclusive")
        if body.get("reasoning_effort") is not None:
            kwargs["reasoning_effort"] = body["reasoning_effort"]
            if "enable_thinking" not in (extra or {}):  # the request's own switch stays (build_chat_params)
                kwargs["enable_thinking"] = body["reasoning_effort"] != "none"
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadPrompt("'tools' must be a list")
        template = body.get("chat_template") or self._template
        if template is None:
            raise UnsupportedPrompt("model has no chat template")
        documents = body.get("documents")
        try:
            if (self._compiled is not None and template is self._template and not kwargs["continue_final_message"]
                    and not (extra and self._apply_params.intersection(extra))
                    and (documents is None or (isinstance(documents, list)
                                               and all(isinstance(d, dict) for d in documents)))):
                # what apply_chat_template(tokenize=False) renders for such a request (transformers
                # 5.16-5.19, render_jinja_template): the template with the special tokens, then the
                # request's kwargs, as variables; without its per-call wrapping
                agp = kwargs.pop("add_generation_prompt")
                del kwargs["continue_final_message"]
                return self._render(messages=conversation, tools=_normalize_tools(tools), documents=documents,
                                    add_generation_prompt=agp, **{**self._special_kwargs, **kwargs})
            return self._tok.apply_chat_template(
                conversation, tools=_normalize_tools(tools), documents=documents,
                chat_template=template, tokenize=False, **kwargs)
        except (BadPrompt, UnsupportedPrompt):
            raise
        except Exception as exc:  # jinja raise_exception, template errors
            raise BadPrompt(f"chat template failed: {exc}") from None

    def _render(self, **variables: Any) -> str:
        """``self._compiled.render(**variables)``, with the globals taken from :attr:`_globals`
        rather than flattened from their ChainMap again (jinja2's ``new_context`` without
        ``shared`` builds ``dict(globals, **variables)`` on every call): the same context, so
        the same text. Raises what the template raises."""
        template = self._compiled
        ctx = template.new_context({**self._globals, **variables}, shared=True)
        return template.environment.concat(template.root_render_func(ctx))

    def encode_chat(self, body: dict[str, Any]) -> list[int]:
        """Prompt token ids of a chat-completions body. Raises BadPrompt / UnsupportedPrompt."""
        text = self.render_chat(body)
        return self.encode_text(text, bool(body.get("add_special_tokens", False)))

    # ---- Anthropic messages and OpenAI responses -------------------------------------------------------------------
    def encode_messages(self, body: dict[str, Any]) -> list[int]:
        """Prompt token ids of an Anthropic Messages body (``POST /v1/messages``): converted as
        vLLM converts it (:mod:`kvcore.anthropic_messages`), then rendered and encoded as chat.
        Raises BadPrompt / UnsupportedPrompt."""
        return self.encode_chat(messages_to_chat(body, self.merge_inline_system, self.disabled_thinking_effort))

    def encode_responses(self, body: dict[str, Any]) -> list[int]:
        """Prompt token ids of an OpenAI Responses body (``POST /v1/responses``): converted as
        vLLM converts it (:mod:`kvcore.responses_input`), then rendered and encoded as chat.
        Raises BadPrompt / UnsupportedPrompt."""
        return self.encode_chat(responses_to_chat(body))

    @functools.cached_property
    def merge_inline_system(self) -> bool:
        """Whether the chat template rejects a system message after the first turn, so vLLM merges
        a Messages request's inline system messages into the leading one (vLLM's
        ``_detect_merge_inline_system``: it renders ``[system, user, system, user]``)."""
        if not self._template:
            return True
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                          extensions=[jinja2.ext.loopcontrols])
        probe = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
        try:
            env.from_string(self._template).render(messages=probe, add_generation_prompt=False)
        except jinja2.TemplateError:
            return True
        return False

    @functools.cached_property
    def disabled_thinking_effort(self) -> str:
        """The ``reasoning_effort`` a Messages request's ``thinking: {type: disabled}`` becomes:
        ``none``, or ``low`` when the template fails on ``none`` or renders it as one of the
        efforts (vLLM's ``_probe_disabled_thinking_effort``, which compares the prompts)."""
        def render(effort: str) -> str | None:
            try:
                return self.render_chat({"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort})
            except (BadPrompt, UnsupportedPrompt):
                return None
        none = render("none")
        if none is None or any(render(e) == none for e in ("low", "medium", "high", "xhigh", "max")):
            return "low"
        return "none"

    def _parse_message(self, msg: Any, index: int) -> dict[str, Any]:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadPrompt(f"messages[{index}] must be an object with a string 'role'")
        role = msg["role"]
        if role == "developer" and not self._template_has_developer:
            role = "system"  # vLLM (renderers/hf.py) maps it when the template lacks the role
        content = msg.get("content")
        if content is None:
            parts: list[str] = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    parts.append(part)
                    continue
                if not isinstance(part, dict):
                    raise BadPrompt(f"messages[{index}].content[{j}] must be an object")
                kind = part.get("type")
                if kind in _TEXT_PART_TYPES or (kind is None and "text" in part):
                    parts.append(str(part.get("text", "")))
                elif kind == "refusal":
                    parts.append(str(part.get("refusal", "")))
                elif kind in MEDIA_PART_TYPES:
                    raise MultimodalPrompt(f"content part of type {kind!r}")
                else:
                    raise UnsupportedPrompt(f"content part of type {kind!r}")
        else:
            raise BadPrompt(f"messages[{index}].content must be a string or a list")
        if self.content_format == "openai":
            out: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": p} for p in parts]}
        else:
            out = {"role": role, "content": "\n".join(parts)}
        if role == "assistant":
            calls = msg.get("tool_calls")
            if calls is not None:
                out["tool_calls"] = _normalize_tool_calls(calls, index)
            reasoning = msg.get("reasoning") or msg.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
        return out

    # ---- completions --------------------------------------------------------------------------
    def encode_completion(self, body: dict[str, Any]) -> list[list[int]]:
        """Token ids of each prompt in a completions body (vLLM makes one request per prompt).

        Raises BadPrompt when ``prompt`` is missing or ill-typed.
        """
        prompt = body.get("prompt")
        add_special = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, str):
            return [self.encode_text(prompt, add_special)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return [list(prompt)]
            if all(isinstance(p, str) for p in prompt):
                return [self.encode_text(p, add_special) for p in prompt]
            if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
                return [list(p) for p in prompt]
        if body.get("prompt_embeds") is not None:
            raise UnsupportedPrompt("prompt_embeds")
        raise BadPrompt("'prompt' must be a string, a list of strings, or token ids")

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """``tokenizer(text, add_special_tokens=...)['input_ids']``, as vLLM encodes.

        A fast tokenizer is called through its Rust backend directly (the same ids, without
        transformers' per-call wrapping nor the offsets: :func:`kvcore.token_cache.encode_ids`),
        or through tiktoken where :class:`kvcore.bpe_fast.FastBPE` applies (the same ids);
        special tokens come from the backend's post-processor, which transformers keeps in step
        with the tokenizer config. Through the prefix token cache when there is one (the same ids)."""
        if self.token_cache is not None:
            return self.token_cache.encode(text, add_special_tokens)
        if self._encode is not None:
            return self._encode([text], add_special_tokens)[0]
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens kept)."""
        return self._tok.decode(list(token_ids))

    def cache_stats(self) -> TokenCacheStats | None:
        """The prefix token cache's counters, None without a cache."""
        return None if self.token_cache is None else self.token_cache.stats()

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tok)


def _normalize_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to the template: each ``ChatCompletionToolsParam.model_dump()``,
    i.e. ``{"type": "function", "function": {"name", "description", "parameters"}}`` with absent
    ``description`` and ``parameters`` present as None, ``strict`` and ``defer_loading`` only when
    set (a tool's own ``defer_loading`` moves into its function), other keys dropped."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise BadPrompt(f"tools[{i}] must be an object with a 'function' object")
        given = tool["function"]
        if not isinstance(given.get("name"), str):
            raise BadPrompt(f"tools[{i}].function.name must be a string")
        fn = {"name": given["name"], "description": given.get("description"), "parameters": given.get("parameters")}
        if given.get("strict") is not None:
            fn["strict"] = given["strict"]
        defer = given.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")
        if defer is not None:
            fn["defer_loading"] = defer
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": fn}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def _normalize_tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """vLLM's ``_postprocess_messages``: tool-call arguments become dicts (JSON parsed)."""
    if not isinstance(calls, list):
        raise BadPrompt(f"messages[{index}].tool_calls must be a list")
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise BadPrompt(f"messages[{index}].tool_calls entries need a 'function' object")
        call = copy.deepcopy(call)
        args = call["function"].get("arguments")
        if not args:
            call["function"]["arguments"] = {}
        elif not isinstance(args, dict):
            try:
                call["function"]["arguments"] = json.loads(args)
            except (TypeError, ValueError):
                raise BadPrompt(f"messages[{index}].tool_calls arguments are not JSON") from None
        out.append(call)
    return out
