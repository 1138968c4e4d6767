"""The simulated vLLM server's HTTP API (FastAPI), vLLM 0.32's routes and shapes:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: stream or not, ``n``, ``max_tokens`` /
  ``max_completion_tokens``, ``stream_options.include_usage``, ``cache_salt``, ``seed``,
  ``ignore_eos``, ``vllm_xargs.kv_cache_report_mode``, ``kv_transfer_params`` (P/D, below);
  unknown fields are accepted and ignored.
- ``POST /v1/messages`` (Anthropic's Messages API): converted to chat as vLLM converts it
  (:mod:`kvcore.anthropic_messages`), one choice, stream or not, answered in Anthropic's shape
  (:mod:`simulator.anthropic_format`).
- ``POST /v1/responses`` (OpenAI's Responses API, not streamed): converted as vLLM converts it
  (:mod:`kvcore.responses_input`), answers stored for ``previous_response_id`` on this server.
- ``GET /v1/models``, ``POST /tokenize`` (``{count, max_model_len, tokens, token_strs}``),
  ``POST /detokenize`` (``{prompt}``), ``GET /health``, ``POST /reset_prefix_cache``,
  ``GET /metrics`` (vLLM's metric names, see :mod:`simulator.metrics`; ``GET /metrics/?name[]=N``
  only the metrics named, as vLLM answers it).
- Simulator only (no vLLM counterpart): ``GET /sim/requests`` returns the last bodies and headers
  received on the POST routes that take a body (completions, chat, messages, tokenize, detokenize), oldest
  first, as ``{"requests": [{"method", "path", "headers",
  "body"}]}`` (``body`` is the parsed JSON, or the raw text when it was not JSON);
  ``DELETE /sim/requests`` clears that record.

P/D disaggregation, vLLM's protocol as its NixlConnector speaks it (``kv_transfer_params``, an
object or null; anything else is a 400):

- ``do_remote_decode: true`` (a prefill leg): served as usual (the gateway asks for 1 token); a
  non-streaming answer carries ``kv_transfer_params`` = ``{"do_remote_prefill": true,
  "do_remote_decode": false, "remote_engine_id": "<this sim's engine id>", "remote_block_ids":
  [the prompt's block ids], "remote_host", "remote_port": this server's, "remote_request_id",
  "kvroute_sim_tokens": <prompt tokens prefilled>}`` (first prompt's first choice).
- ``do_remote_prefill: true`` (a decode leg): the prompt's uncached full blocks are loaded over
  the simulated link instead of computed (:mod:`simulator.engine`), then cached here (KV events)
  and counted in ``usage.prompt_tokens_details.cached_tokens``. The sim never contacts the prefill
  worker named in the params; the answer's ``kv_transfer_params`` is null, as vLLM's decode side's.

Errors use vLLM's shape (:func:`simulator.openai_format.error_body`): malformed JSON or bad field
400, unknown model 404, prompt (or prompt + max_tokens) over ``--max-model-len`` 400.
A client that disconnects aborts its request, freeing its blocks.

Determinism: output tokens depend only on (``--seed``, prompt, choice index, request ``seed``);
``id`` is ``cmpl-``/``chatcmpl-`` + the ``X-Request-Id`` header when given (as vLLM), else a hash of
a per-process counter; ``created`` is the process start time. So two identical requests with the
same ``X-Request-Id`` to one sim stream identical bytes (``cached_tokens`` in a usage chunk aside).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import make_asgi_app
from starlette.routing import Mount

from kvcore.data_parallel import DP_RANK_HEADER, rank_endpoint
from kvcore.responses_input import responses_to_chat
from kvcore.tokenization import BadPrompt, PromptTokenizer, UnsupportedPrompt
from simulator import anthropic_format as afmt
from simulator import responses_format as rfmt
from simulator import openai_format as fmt
from simulator.block_pool import BlockPool
from simulator.config import SimConfig
from simulator.engine import Engine, RequestTooLong, SimRequest
from simulator.events import make_publisher
from simulator.metrics import make_registry
from simulator.outputs import OutputSampler, text_pieces

JSON = "application/json"
STORED_RESPONSES = 1000  # Responses API answers kept for previous_response_id


class ApiError(Exception):
    """A client fault answered with ``status`` and vLLM's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type=JSON)


def _error(exc: ApiError) -> Response:
    return _json(fmt.error_body(exc.status, exc.message, exc.param), exc.status)


@dataclass
class _Parsed:
    """A generation request after validation: one entry in ``prompts`` per prompt."""

    prompts: list[list[int]]
    n: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    extra_keys: list[Any] | None
    report_full: bool
    seed: int | None
    ignore_eos: bool
    remote_prefill: bool = False  # kv_transfer_params.do_remote_prefill
    remote_decode: bool = False  # kv_transfer_params.do_remote_decode
    model: str = ""  # the name answers carry: the served model's, or the LoRA adapter's the body named
    lora_name: str | None = None  # the LoRA adapter the body named (SimConfig.lora_modules)


class SimRank:
    """One data parallel rank: its block pool, engine and KV-event publisher (on the configured
    endpoints offset for the rank as vLLM offsets them, :func:`kvcore.data_parallel.rank_endpoint`,
    its batches tagged with the rank)."""

    def __init__(self, rank: int, cfg: SimConfig) -> None:
        self.rank = rank
        ev = cfg.kv_events
        self.events = dataclasses.replace(
            ev, endpoint=rank_endpoint(ev.endpoint, rank),
            replay_endpoint=rank_endpoint(ev.replay_endpoint, rank) if ev.replay_endpoint else None)
        self.pool = BlockPool(cfg.num_gpu_blocks, cfg.block_size, enable_events=ev.active)
        self.publisher = None
        self.engine = Engine(self.pool, cfg.timing, cfg.max_num_seqs, cfg.seed, publish=self._publish,
                             max_num_batched_tokens=cfg.max_num_batched_tokens, kv_load=cfg.kv_load)
        self._task: asyncio.Task | None = None

    def _publish(self, events: list) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)

    def start(self) -> None:
        """Bind the publisher and run the engine (on the running loop)."""
        self.publisher = make_publisher(self.events, self.rank)
        if self.publisher is not None:
            self.publisher.start()
        self._task = asyncio.get_running_loop().create_task(self.engine.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.publisher is not None:
            self.publisher.close()


class SimServer:
    """State of one simulated server: tokenizer, block pool, engine, publisher, metrics, and the
    record of received requests. ``app`` is the FastAPI application."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.model = cfg.model_name
        self.max_model_len = cfg.resolved_max_model_len()
        self.tokenizer = PromptTokenizer(cfg.model_dir)
        self.sampler = OutputSampler(text_pieces(self.tokenizer.decode, self.tokenizer.vocab_size), cfg.seed)
        self.ranks = [SimRank(rank, cfg) for rank in range(cfg.data_parallel_size)]
        self.registry = make_registry(self)
        self.created = int(time.time())  # one value per process, so identical requests give identical bytes
        self.engine_id = f"kvroute-sim-{cfg.port}-{cfg.seed}-{self.created}"
        self.recorded: deque[dict[str, Any]] = deque(maxlen=cfg.recorded_requests)
        self._stored: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()  # response id -> its messages
        self._counter = 0
        self.app = self._build_app()

    @property
    def engine(self) -> Engine:
        """Data parallel rank 0's engine (the only one without ``--data-parallel-size``)."""
        return self.ranks[0].engine

    @property
    def pool(self) -> BlockPool:
        """Data parallel rank 0's block pool."""
        return self.ranks[0].pool

    # ---- lifecycle ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        for rank in self.ranks:
            rank.start()
        try:
            yield
        finally:
            for rank in self.ranks:
                await rank.stop()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvroute sim", lifespan=self.lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/messages", self.messages, methods=["POST"])
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        # as vLLM mounts it (vllm/entrypoints/serve/instrumentator/metrics.py): any longer path
        # is prometheus_client's ASGI app, which honours its name[] filter
        metrics_mount = Mount("/metrics", make_asgi_app(registry=self.registry))
        metrics_mount.path_regex = re.compile("^/metrics(?P<path>.*)$")
        app.router.routes.append(metrics_mount)
        app.add_api_route("/sim/requests", self.sim_requests, methods=["GET"])
        app.add_api_route("/sim/requests", self.sim_requests_clear, methods=["DELETE"])
        return app

    # ---- helpers ------------------------------------------------------------------------------
    async def _body(self, request: Request, record: bool = False) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if record:
                self._record(request, raw.decode(errors="replace"))
            raise ApiError(400, f"JSON decode error: {exc}") from None
        if record:
            self._record(request, body)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _record(self, request: Request, body: Any) -> None:
        self.recorded.append({"method": request.method, "path": request.url.path,
                              "headers": dict(request.headers), "body": body})

    def _check_model(self, body: dict[str, Any]) -> str | None:
        """vLLM 0.32's check: no model (absent, null or "") means the served one; a LoRA adapter's
        name (``--lora-modules``) serves that adapter, whose name is returned; another name is a
        404 (``_is_model_supported``, vllm/entrypoints/serve/engine/serving.py)."""
        model = body.get("model")
        if model and model in self.cfg.lora_modules:
            return model
        if model and model != self.model:
            names = ", ".join([self.model, *self.cfg.lora_modules])
            raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {names}.", "model")
        return None

    def _request_id(self, request: Request, prefix: str) -> str:
        """vLLM's id: the ``X-Request-Id`` header when given, else (here) a seeded counter hash."""
        given = request.headers.get("x-request-id")
        if given:
            return f"{prefix}-{given}"
        self._counter += 1
        return f"{prefix}-{xxhash.xxh3_64_hexdigest(self._counter.to_bytes(8, 'big'), seed=self.cfg.seed)}"

    def _parse(self, body: dict[str, Any], chat: bool, encode: Callable[[], list[int]] | None = None) -> _Parsed:
        """``encode``: makes the prompt of a body that is neither chat nor completions (Anthropic
        messages, responses; ``chat`` True)."""
        lora_name = self._check_model(body)
        try:
            if encode is not None:
                prompts = [encode()]
            else:
                prompts = [self.tokenizer.encode_chat(body)] if chat else self.tokenizer.encode_completion(body)
        except (BadPrompt, UnsupportedPrompt) as exc:
            raise ApiError(400, str(exc), "messages" if chat else "prompt") from None
        n = _int_field(body, "n", 1, minimum=1)
        if chat:
            max_tokens = _int_field(body, "max_completion_tokens", None, minimum=1)
            if max_tokens is None:
                max_tokens = _int_field(body, "max_tokens", None, minimum=1)
        else:
            max_tokens = _int_field(body, "max_tokens", 16, minimum=1)
        for p in prompts:
            if len(p) > self.max_model_len:
                raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, your request has {len(p)} input tokens. Please reduce the "
                                    "length of the input messages.", "messages" if chat else "prompt")
            if max_tokens is not None and len(p) + max_tokens > self.max_model_len:
                raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                                    f"This model's maximum context length is {self.max_model_len} tokens and "
                                    f"your request has {len(p)} input tokens ({max_tokens} > "
                                    f"{self.max_model_len} - {len(p)}).", "max_tokens")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        opts = body.get("stream_options")
        xargs = body.get("vllm_xargs")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ApiError(400, "'seed' must be an integer", "seed")
        kvt = body.get("kv_transfer_params")
        if kvt is not None and not isinstance(kvt, dict):
            raise ApiError(400, "'kv_transfer_params' must be an object", "kv_transfer_params")
        kvt = kvt or {}
        return _Parsed(
            prompts=prompts, n=n, max_tokens=max_tokens, stream=bool(body.get("stream", False)),
            include_usage=isinstance(opts, dict) and bool(opts.get("include_usage")),
            extra_keys=[[salt]] if salt else None,
            report_full=isinstance(xargs, dict) and xargs.get("kv_cache_report_mode") == "full",
            seed=seed, ignore_eos=bool(body.get("ignore_eos", False)),
            remote_prefill=bool(kvt.get("do_remote_prefill")), remote_decode=bool(kvt.get("do_remote_decode")),
            model=lora_name or self.model, lora_name=lora_name)

    def _rank_for(self, request: Request | None) -> int:
        """The data parallel rank serving a request: the ``X-data-parallel-rank`` header's when it
        is an integer (vLLM ignores one that is not; 400 for a rank this server does not have),
        else the least loaded (waiting x 4 + running, as vLLM's balancer scores engines), lowest
        rank first."""
        given = request.headers.get(DP_RANK_HEADER) if request is not None else None
        if given is not None:
            try:
                rank = int(given)
            except ValueError:
                rank = None
            if rank is not None:
                if not 0 <= rank < len(self.ranks):
                    raise ApiError(400, f"data parallel rank {rank} is out of range [0, {len(self.ranks)})")
                return rank
        return min(range(len(self.ranks)),
                   key=lambda r: (4 * self.ranks[r].engine.num_waiting + self.ranks[r].engine.num_running, r))

    def _submit(self, parsed: _Parsed, rid: str, request: Request | None = None
                ) -> tuple[list[SimRequest], asyncio.Queue]:
        """One engine request per (prompt, choice), sharing one sink, on one data parallel rank
        (:meth:`_rank_for`); 400 if one can never fit."""
        engine = self.ranks[self._rank_for(request)].engine
        sink: asyncio.Queue = asyncio.Queue()
        reqs = []
        for pi, prompt in enumerate(parsed.prompts):
            for j in range(parsed.n):
                index = pi * parsed.n + j
                cap = self.max_model_len - len(prompt)
                out, reason = self.sampler.sample(prompt, j, parsed.max_tokens, parsed.seed, parsed.ignore_eos)
                if len(out) > cap:
                    out, reason = out[:max(1, cap)], "length"
                reqs.append(SimRequest(request_id=f"{rid}-{index}", prompt_token_ids=prompt,
                                       output_token_ids=out, finish_reason=reason,
                                       extra_keys=parsed.extra_keys, lora_name=parsed.lora_name,
                                       report_full=parsed.report_full,
                                       remote_prefill=parsed.remote_prefill, remote_decode=parsed.remote_decode,
                                       index=index, sink=sink))
        added = []
        try:
            for r in reqs:
                engine.add(r)
                added.append(r)
        except RequestTooLong as exc:
            for r in added:
                engine.abort(r)
            raise ApiError(400, str(exc), "prompt") from None
        return reqs, sink

    def _usage(self, parsed: _Parsed, reqs: list[SimRequest], chat: bool = False) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in parsed.prompts)
        completion_tokens = sum(r.num_output for r in reqs)
        cached = created = None
        if self.cfg.enable_prompt_tokens_details:
            cached = sum(reqs[i * parsed.n].num_cached_tokens or 0 for i in range(len(parsed.prompts)))
            if chat:
                created = self._created_cache_tokens(len(parsed.prompts[0]), reqs[0])
        return fmt.usage(prompt_tokens, completion_tokens, cached, created)

    def _created_cache_tokens(self, prompt_tokens: int, req: SimRequest) -> int:
        """Prompt tokens this request wrote to the prefix cache, as vLLM 0.32 counts them
        (``PrefillStats.finalize``: the tokens of the prompt's full blocks, less those it found
        cached)."""
        full_blocks_tokens = prompt_tokens // self.cfg.block_size * self.cfg.block_size
        return max(0, full_blocks_tokens - (req.num_cached_tokens or 0))

    async def _watch_disconnect(self, request: Request, reqs: list[SimRequest]) -> None:
        """Abort ``reqs`` when the client goes away (no-op for ones already finished)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for r in reqs:
                    r.engine.abort(r)
                return

    # ---- generation routes --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await self._body(request, record=True)
            parsed = self._parse(body, chat)
            rid = self._request_id(request, "chatcmpl" if chat else "cmpl")
            reqs, sink = self._submit(parsed, rid, request)
        except ApiError as exc:
            return _error(exc)
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(request, reqs))
        if parsed.stream:
            return StreamingResponse(self._stream(parsed, rid, chat, reqs, sink, watcher),
                                     media_type="text/event-stream")
        try:
            await _drain(sink, len(reqs))
        finally:
            watcher.cancel()
        texts = [self.sampler.text(r.output_token_ids[:r.num_output]) for r in reqs]
        reasons = [r.finish_reason for r in reqs]
        build = fmt.chat_completion if chat else fmt.completion
        kvt = self._prefill_params(request, reqs[0]) if parsed.remote_decode and not reqs[0].aborted else None
        return _json(build(rid, self.created, parsed.model, texts, reasons, self._usage(parsed, reqs, chat), kvt))

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (vLLM's ``/v1/messages``): the body converted to chat as vLLM
        converts it, one choice, answered in Anthropic's shape (:mod:`simulator.anthropic_format`)."""
        try:
            body = await self._body(request, record=True)
            if _int_field(body, "max_tokens", None, minimum=1) is None:
                raise ApiError(400, "'max_tokens' is required", "max_tokens")
            parsed = self._parse({k: v for k, v in body.items() if k not in ("n", "stream_options")}, chat=True,
                                 encode=lambda: self.tokenizer.encode_messages(body))
            rid = self._request_id(request, "msg")
            reqs, sink = self._submit(parsed, rid, request)
        except ApiError as exc:
            return _error(exc)
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(request, reqs))
        if parsed.stream:
            return StreamingResponse(self._stream_messages(parsed, rid, reqs, sink, watcher),
                                     media_type="text/event-stream")
        req, text = await self._one_answer(reqs, sink, watcher)
        return _json(afmt.message(rid, parsed.model, text, req.finish_reason, self._messages_usage(parsed, req)))

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API as vLLM serves it without a Harmony model, streamed or not
        (:mod:`simulator.responses_format`): the input converted to chat
        (:mod:`kvcore.responses_input`) after the stored history of ``previous_response_id`` (its
        messages without system ones, then its answer; 404 when this server made no such
        response), as vLLM's ``construct_input_messages``; the answer stored unless ``store`` is
        false (the latest :data:`STORED_RESPONSES`)."""
        try:
            body = await self._body(request, record=True)
            previous = body.get("previous_response_id")
            if previous is not None and not isinstance(previous, str):
                raise ApiError(400, "'previous_response_id' must be a string", "previous_response_id")
            history = self._stored.get(previous) if previous is not None else []
            if history is None:
                raise ApiError(404, f"Response with id '{previous}' not found.", "previous_response_id")
            try:
                chat = responses_to_chat({k: v for k, v in body.items() if k != "previous_response_id"})
            except (BadPrompt, UnsupportedPrompt) as exc:
                raise ApiError(400, str(exc), "input") from None
            lead = 1 if body.get("instructions") else 0
            chat["messages"] = chat["messages"][:lead] + history + chat["messages"][lead:]
            max_tokens = _int_field(body, "max_output_tokens", None, minimum=1)
            parsed = self._parse({"model": body.get("model"), "max_tokens": max_tokens,
                                  "cache_salt": body.get("cache_salt"), "ignore_eos": body.get("ignore_eos")},
                                 chat=True, encode=lambda: self.tokenizer.encode_chat(chat))
            self._counter += 1
            rid = f"resp_{xxhash.xxh3_128_hexdigest(self._counter.to_bytes(8, 'big'), seed=self.cfg.seed)}"
            reqs, sink = self._submit(parsed, rid, request)
        except ApiError as exc:
            return _error(exc)
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(request, reqs))
        store = body.get("store", True) is not False
        if body.get("stream"):
            return StreamingResponse(self._stream_response(parsed, rid, reqs, sink, watcher, chat, store),
                                     media_type="text/event-stream")
        req, text = await self._one_answer(reqs, sink, watcher)
        if store:
            self._store_response(rid, chat, text)
        return _json(rfmt.response(rid, self.created, parsed.model, "completed", [
            rfmt.message_item(rid, text, "completed")], self._responses_usage(parsed, req)))

    def _store_response(self, rid: str, chat: dict[str, Any], text: str) -> None:
        self._stored[rid] = [m for m in chat["messages"] if m.get("role") != "system"] + [
            {"role": "assistant", "content": text}]
        while len(self._stored) > STORED_RESPONSES:
            self._stored.popitem(last=False)

    def _responses_usage(self, parsed: _Parsed, req: SimRequest) -> dict[str, Any]:
        # vLLM's Responses usage counts cached and written tokens with or without
        # --enable-prompt-tokens-details (responses/serving.py)
        prompt_tokens = len(parsed.prompts[0])
        return rfmt.usage(prompt_tokens, req.num_output, req.num_cached_tokens or 0,
                          self._created_cache_tokens(prompt_tokens, req))

    async def _stream_response(self, parsed: _Parsed, rid: str, reqs: list[SimRequest], sink: asyncio.Queue,
                               watcher: asyncio.Task, chat: dict[str, Any], store: bool):
        req = reqs[0]
        stream = rfmt.ResponseStream(rid, self.created, parsed.model)
        try:
            yield stream.start()
            started = False
            while True:
                _, token = await sink.get()
                if token is None:
                    break
                if not started:
                    started = True
                    yield stream.first_token()
                yield stream.delta(self.sampler.pieces[token])
            if not req.aborted:
                if store:
                    self._store_response(rid, chat, stream.text)
                yield stream.end(self._responses_usage(parsed, req))
        finally:
            watcher.cancel()
            req.engine.abort(req)

    async def _one_answer(self, reqs: list[SimRequest], sink: asyncio.Queue, watcher: asyncio.Task
                          ) -> tuple[SimRequest, str]:
        """The one choice of an unstreamed request once it has ended, and its text."""
        try:
            await _drain(sink, 1)
        finally:
            watcher.cancel()
        req = reqs[0]
        return req, self.sampler.text(req.output_token_ids[:req.num_output])

    def _messages_usage(self, parsed: _Parsed, req: SimRequest) -> dict[str, Any]:
        prompt_tokens = len(parsed.prompts[0])
        if not self.cfg.enable_prompt_tokens_details:
            return afmt.usage(prompt_tokens, req.num_output, None)
        return afmt.usage(prompt_tokens, req.num_output, req.num_cached_tokens or 0,
                          self._created_cache_tokens(prompt_tokens, req))

    async def _stream_messages(self, parsed: _Parsed, rid: str, reqs: list[SimRequest], sink: asyncio.Queue,
                               watcher: asyncio.Task):
        req = reqs[0]
        try:
            started = False
            while True:
                _, token = await sink.get()
                if not started:  # with the first engine output, after the prefill, as vLLM
                    started = True
                    # vLLM's first chunk carries the whole prompt as input and no cache counts
                    yield afmt.stream_start(rid, parsed.model,
                                            {"input_tokens": len(parsed.prompts[0]), "output_tokens": 0})
                if token is None:
                    break
                yield afmt.text_delta(self.sampler.pieces[token])
            if not req.aborted:
                yield afmt.stream_end(req.finish_reason, self._messages_usage(parsed, req))
        finally:
            watcher.cancel()
            req.engine.abort(req)

    def _prefill_params(self, request: Request, req: SimRequest) -> dict[str, Any]:
        """The ``kv_transfer_params`` of a prefill leg's answer (module docstring)."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": req.final_block_ids or [],
                "remote_host": request.url.hostname or self.cfg.host, "remote_port": self.cfg.port,
                "remote_request_id": req.request_id, "kvroute_sim_tokens": len(req.prompt_token_ids)}

    async def _stream(self, parsed: _Parsed, rid: str, chat: bool, reqs: list[SimRequest],
                      sink: asyncio.Queue, watcher: asyncio.Task):
        model, created = parsed.model, self.created
        try:
            received = [0] * len(reqs)
            open_choices = len(reqs)
            opened = not chat
            while open_choices:
                index, token = await sink.get()
                if not opened:
                    # vLLM sends the role deltas with its first engine output (after the prefill),
                    # not at once: a router timing first bytes must see the prefill
                    opened = True
                    for r in reqs:
                        yield fmt.sse(fmt.chat_chunk(rid, created, model, r.index,
                                                     {"role": "assistant", "content": ""}, None))
                r = reqs[index]
                if token is None:
                    open_choices -= 1
                    if r.aborted:
                        return
                    continue
                received[index] += 1
                reason = r.finish_reason if received[index] == len(r.output_token_ids) else None
                piece = self.sampler.pieces[token]
                if chat:
                    chunk = fmt.chat_chunk(rid, created, model, index, {"content": piece}, reason)
                else:
                    chunk = fmt.completion_chunk(rid, created, model, index, piece, reason)
                if reason is not None and not parsed.include_usage:
                    # vLLM 0.32 stamps the fingerprint on a choice's last chunk, or on the usage
                    # chunk when one follows
                    chunk["system_fingerprint"] = fmt.SYSTEM_FINGERPRINT
                yield fmt.sse(chunk)
            if parsed.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield fmt.sse(fmt.usage_chunk(rid, obj, created, model, self._usage(parsed, reqs, chat)))
            yield fmt.SSE_DONE
        finally:
            watcher.cancel()
            for r in reqs:
                r.engine.abort(r)

    # ---- other routes -------------------------------------------------------------------------
    async def models(self) -> Response:
        """vLLM's listing: the served model, then each LoRA adapter with ``parent`` the served model
        and ``root`` its path (``OpenAIServingModels.show_available_models``)."""
        return _json({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": self.cfg.model_dir, "parent": None, "max_model_len": self.max_model_len}] + [{
            "id": name, "object": "model", "created": self.created, "owned_by": "vllm", "root": path,
            "parent": self.model, "max_model_len": None} for name, path in self.cfg.lora_modules.items()]})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: ``{"prompt": str}`` (add_special_tokens default true) or
        ``{"messages": [...]}`` (chat template, add_special_tokens default false)."""
        try:
            body = await self._body(request, record=True)
            self._check_model(body)
            try:
                if "messages" in body:
                    tokens = self.tokenizer.encode_chat(body)
                elif isinstance(body.get("prompt"), str):
                    tokens = self.tokenizer.encode_text(body["prompt"], bool(body.get("add_special_tokens", True)))
                else:
                    raise ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt")
            except (BadPrompt, UnsupportedPrompt) as exc:
                raise ApiError(400, str(exc)) from None
        except ApiError as exc:
            return _error(exc)
        strs = [self.tokenizer.decode([t]) for t in tokens] if body.get("return_token_strs") else None
        return _json({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                      "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}``."""
        try:
            body = await self._body(request, record=True)
            self._check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size
                                                       for t in tokens):
                raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
        except ApiError as exc:
            return _error(exc)
        return _json({"prompt": self.tokenizer.decode(tokens)})

    async def health(self) -> Response:
        return Response(status_code=200)

    async def reset_prefix_cache(self) -> Response:
        """200 ``{"success": true}``; 500 while requests still hold blocks (vLLM refuses then)."""
        if all([rank.engine.reset_prefix_cache() for rank in self.ranks]):
            return _json({"success": True})
        return _json(fmt.error_body(500, "Failed to reset prefix cache: requests still hold blocks"), 500)

    async def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def sim_requests(self) -> Response:
        return _json({"requests": list(self.recorded)})

    async def sim_requests_clear(self) -> Response:
        self.recorded.clear()
        return _json({"requests": []})


async def _drain(sink: asyncio.Queue, n: int) -> None:
    """Wait until ``n`` sequences have ended."""
    while n:
        _, token = await sink.get()
        if token is None:
            n -= 1


def _int_field(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ApiError(400, f"'{name}' must be an integer >= {minimum}", name)
    return value
