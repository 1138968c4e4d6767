"""The gateway's YAML config (DESIGN.md "Config"), as pydantic models validated at start.

The same models validate the admin API's bodies (``POST /admin/workers`` takes a
:class:`WorkerConfig`, ``PUT /admin/policy`` a policy mapping checked by the policy factory).

Example (every section but ``models`` and ``workers`` has defaults)::

    listen: {host: 127.0.0.1, port: 8000}
    admin: {token_env: KVROUTE_ADMIN_TOKEN}        # or {token: "..."}; the env var wins when set
    models:
      - {name: tiny, tokenizer: /path/to/model_dir, block_size: 32}
    index: {backend: memory}                       # or {backend: redis, url: redis://..., mirror: true, cluster: false}
    workers:
      - {id: w0, url: http://127.0.0.1:8101, model: tiny, events: tcp://127.0.0.1:5557}
    policy: {name: ttft, tier_credit: {gpu: 1.0, cpu: 0.75, ssd: 0.25}, queue: {enabled: true}}
    timeouts: {connect_s: 5, first_byte_s: 300, worker_call_s: 3}   # no limit on a stream's total length
    max_body_bytes: 67108864
    health: {interval_s: 2, timeout_s: 2, fail_threshold: 3, rise_threshold: 2}
    load_scrape: {interval_s: 1, timeout_s: 2}
    routing: {speculative_ttl_s: 5, approx_ttl_s: 120}
    cors: {allowed_origins: [], allow_credentials: false}   # vLLM's CORS flags and defaults
    admission: {max_in_flight_per_worker: 0, max_queued: 1024, queue_timeout_s: 30}   # 0: no limit
    client_auth: {api_keys_env: KVROUTE_API_KEYS, api_keys_file: null}   # SHA-256 hashes; off unless given
    discovery: {kubernetes: {label_selector: "app=vllm", model: tiny, port: http}}   # router/config/discovery.py
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvcore.data_parallel import rank_endpoint
from router.config.client_keys import load_key_hashes
from router.config.discovery import DiscoveryConfig
from router.policies.factory import make_policy

MIB = 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListenConfig(_Strict):
    """Where the gateway listens."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class AdminConfig(_Strict):
    """Admin bearer token: ``$token_env`` when that variable is set, else ``token``."""

    token_env: str | None = "KVROUTE_ADMIN_TOKEN"
    token: str | None = None

    def resolve_token(self) -> str | None:
        """The token to require, or None when none is configured (admin API then refuses all)."""
        if self.token_env and os.environ.get(self.token_env):
            return os.environ[self.token_env]
        return self.token or None


class ModelConfig(_Strict):
    """A served model: ``tokenizer`` is a directory with the HF tokenizer and chat template (None:
    route by load only); ``block_size`` the workers' ``--block-size``; ``lora_adapters`` adapter
    names a body's ``model`` may carry instead of ``name`` (keys then mix in the adapter name);
    ``sliding_window_tokens``: for a hybrid model (full and sliding-window attention layers), the
    window of its sliding-window layers (the model config's ``sliding_window``): a prefix hit is
    then credited only where vLLM can reuse it (:mod:`kvcore.sliding_window`); ``render_url``: a
    vLLM server (``vllm serve --enable-scale-out``, or a dedicated render server) whose render
    endpoints turn the model's prompts with media into token ids and multimodal hashes (None: a
    routable worker of the model does it, see ``routing.render_multimodal``)."""

    name: str = Field(min_length=1)
    tokenizer: str | None = None
    block_size: int = Field(ge=1)
    lora_adapters: list[str] = Field(default_factory=list)
    sliding_window_tokens: int | None = Field(None, ge=1)
    render_url: str | None = None

    @field_validator("render_url")
    @classmethod
    def _check_render_url(cls, v: str | None) -> str | None:
        if v is not None and (urlsplit(v).scheme not in ("http", "https") or not urlsplit(v).hostname):
            raise ValueError(f"render_url must be an http(s) URL, got {v!r}")
        return v


class IndexConfig(BaseModel):
    """Index backend, passed whole to :func:`kvcore.index.make_index` (backend-specific keys
    such as ``url`` or ``max_keys`` are allowed). ``backend: redis`` looks up in a local copy of
    the Redis index kept in step by Redis's change log (``mirror: true``, the default; options in
    :class:`kvcore.index.redis_mirror.RedisMirrorIndex`), or in Redis itself (``mirror: false``).
    ``cluster: true`` (redis only; default false) shards the Redis index over a Redis Cluster,
    ``url`` naming any of its nodes (:mod:`kvcore.index.redis_cluster`). Raises ValidationError
    for a ``cluster`` that is not a boolean or is given with another backend."""

    model_config = ConfigDict(extra="allow")
    backend: str = "memory"

    @model_validator(mode="after")
    def _check_cluster(self) -> IndexConfig:
        cluster = (self.model_extra or {}).get("cluster")
        if cluster is None:
            return self
        if not isinstance(cluster, bool):
            raise ValueError(f"index.cluster must be true or false, got {cluster!r}")
        if cluster and self.backend != "redis":
            raise ValueError(f"index.cluster: true needs backend: redis (a Redis Cluster), got backend: {self.backend}")
        return self


WorkerRole = Literal["both", "prefill", "decode"]
WORKER_ROLES: tuple[str, ...] = ("both", "prefill", "decode")


class WorkerConfig(_Strict):
    """One worker (a vLLM server). ``id`` defaults to ``host:port`` of ``url``; ``events`` /
    ``replay``: the server's ZMQ KV-event PUB and replay endpoints (absent: approximate mode).
    ``role``: ``both`` (serves whole requests), ``prefill`` or ``decode`` (one leg of a
    disaggregated request); roles matter only for a model whose ``policy.pd`` is on.

    Data parallelism (vLLM's ``--data-parallel-size``: engines behind one URL, each its own KV
    cache, :mod:`kvcore.data_parallel`): ``data_parallel_rank`` makes this entry one rank, a
    routing target of its own (the gateway names the rank in the ``X-data-parallel-rank`` header
    and reads its load from the ``engine="<rank>"`` metrics; ``events`` / ``replay`` are that
    rank's endpoints). ``data_parallel_size: N`` in the config file lists all N at once: the entry
    becomes N workers ``<id>-dp<rank>`` with ``events`` / ``replay`` offset for each rank as vLLM
    offsets them (:func:`expand_data_parallel`)."""

    id: str | None = Field(None, min_length=1)
    url: str
    model: str = Field(min_length=1)
    events: str | None = None
    replay: str | None = None
    role: WorkerRole = "both"
    data_parallel_rank: int | None = Field(None, ge=0)
    data_parallel_size: int = Field(1, ge=1)

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        try:
            port = parts.port  # raises on a port out of 0..65535 or not a number
        except ValueError:
            port = -1
        if (parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or port == -1
                or parts.query or parts.fragment or parts.username or parts.password):
            raise ValueError(f"worker url must be http(s)://host[:port] with a port in 1..65535 and no "
                             f"query, fragment or credentials, got {v!r}")
        return v.rstrip("/")

    @field_validator("events", "replay")
    @classmethod
    def _check_zmq_endpoint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        scheme, sep, rest = v.partition("://")
        ok = bool(sep) and bool(rest)
        if ok and scheme == "tcp":
            host, colon, port = rest.rpartition(":")
            ok = bool(colon) and bool(host) and port.isdigit() and 1 <= int(port) <= 65535
        elif ok:
            ok = scheme in ("ipc", "inproc")
        if not ok:
            raise ValueError(f"a ZMQ endpoint must be tcp://host:port (port 1..65535), ipc://path or "
                             f"inproc://name, got {v!r}")
        return v

    @model_validator(mode="after")
    def _default_id(self) -> "WorkerConfig":
        if not self.id:
            parts = urlsplit(self.url)
            self.id = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        if "/" in self.id:
            raise ValueError(f"worker id must not contain '/': {self.id!r}")
        if self.data_parallel_size > 1 and self.data_parallel_rank is not None:
            raise ValueError("give data_parallel_size (every rank) or data_parallel_rank (one), not both")
        if self.data_parallel_size > 1:
            for endpoint in (self.events, self.replay):
                if endpoint is not None:
                    rank_endpoint(endpoint, 1)  # raises for an endpoint vLLM cannot offset
        return self


def same_target(a: WorkerConfig, b: WorkerConfig) -> bool:
    """Whether two worker entries name the same engine: one URL, with a data parallel rank on
    neither, on only one (the whole server against one of its ranks) or the same on both."""
    return a.url == b.url and (a.data_parallel_rank is None or b.data_parallel_rank is None
                               or a.data_parallel_rank == b.data_parallel_rank)


def repeated_targets(workers: list[WorkerConfig]) -> list[str]:
    """URLs listed more than once as the same target (:func:`same_target`)."""
    by_url: dict[str, list[WorkerConfig]] = {}
    for w in workers:
        by_url.setdefault(w.url, []).append(w)
    return sorted(url for url, ws in by_url.items()
                  if any(same_target(a, b) for i, a in enumerate(ws) for b in ws[i + 1:]))


def expand_data_parallel(workers: list[WorkerConfig]) -> list[WorkerConfig]:
    """``workers`` with each ``data_parallel_size: N`` entry replaced by its N ranks: ids
    ``<id>-dp<rank>``, ``data_parallel_rank`` set, ``events`` / ``replay`` offset per rank
    (:func:`kvcore.data_parallel.rank_endpoint`)."""
    out: list[WorkerConfig] = []
    for w in workers:
        if w.data_parallel_size == 1:
            out.append(w)
            continue
        for rank in range(w.data_parallel_size):
            out.append(w.model_copy(update={
                "id": f"{w.id}-dp{rank}", "data_parallel_rank": rank, "data_parallel_size": 1,
                "events": rank_endpoint(w.events, rank) if w.events else None,
                "replay": rank_endpoint(w.replay, rank) if w.replay else None}))
    return out


class TimeoutsConfig(_Strict):
    """Timeouts in seconds. For relayed requests: TCP connect, and first byte of the response
    body (for a non-streamed response that is the whole generation); ``total_s`` None: no limit.
    ``stream_idle_s``: longest silence of a worker mid-stream before the gateway ends the
    stream with an error event (None: no limit). ``shutdown_grace_s``: on SIGTERM or SIGINT the
    gateway stops accepting connections at once and gives the requests in flight this long to
    finish before it exits. ``worker_call_s``: the whole of each call the
    gateway makes to a worker on its own behalf (``GET /v1/models``, ``/version``); the health
    probe and the load scrape have their own ``timeout_s``."""

    connect_s: float = Field(5.0, gt=0)
    first_byte_s: float | None = Field(300.0, gt=0)
    total_s: float | None = Field(None, gt=0)
    worker_call_s: float = Field(3.0, gt=0)
    stream_idle_s: float | None = Field(120.0, gt=0)
    shutdown_grace_s: float = Field(30.0, ge=0)


class HealthConfig(_Strict):
    """``GET {url}{path}`` every ``interval_s``; ``fail_threshold`` failures in a row mark a
    worker down, ``rise_threshold`` successes in a row mark it up again. The first probe after
    a worker is added decides its state directly."""

    path: str = "/health"
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    fail_threshold: int = Field(3, ge=1)
    rise_threshold: int = Field(2, ge=1)


class LoadScrapeConfig(_Strict):
    """Engine load from each worker's Prometheus ``/metrics`` every ``interval_s``."""

    enabled: bool = True
    path: str = "/metrics"
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)


class AdmissionConfig(_Strict):
    """Admission control (:mod:`router.route.admission`): at most ``max_in_flight_per_worker`` x
    routable workers requests in flight through the gateway (0: no limit, the default); up to
    ``max_queued`` more wait in arrival order, each at most ``queue_timeout_s``; beyond either,
    429 with ``Retry-After``. Both counts are the whole gateway's: with ``kvroute serve
    --processes N`` every process's slots and waiters together (:mod:`router.route.shared_admission`)."""

    max_in_flight_per_worker: int = Field(0, ge=0)
    max_queued: int = Field(1024, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)


class ClientAuthConfig(_Strict):
    """Client API keys (checked by :mod:`router.edge.client_auth`): SHA-256 hashes of the allowed
    keys, comma-separated in ``$api_keys_env`` and/or one per line in ``api_keys_file``; off (the
    default) when neither is given. Read here (:mod:`router.config.client_keys`) so a bad entry or
    an unreadable file stops the gateway at start."""

    api_keys_env: str | None = "KVROUTE_API_KEYS"
    api_keys_file: str | None = None

    @model_validator(mode="after")
    def _check_keys(self) -> "ClientAuthConfig":
        try:
            load_key_hashes(self.api_keys_env, self.api_keys_file)
        except OSError as exc:
            raise ValueError(f"cannot read api_keys_file: {exc}") from None
        return self


class CorsConfig(_Strict):
    """Cross-origin requests from browsers, answered by the gateway (the origin a browser sees)
    with vLLM's flags and defaults (``--allowed-origins`` none, ``--allow-credentials`` false,
    ``--allowed-methods`` and ``--allowed-headers`` all), so a gateway in front of default vLLM
    answers a browser as vLLM would; a worker's own ``Access-Control-*`` headers are not relayed."""

    allowed_origins: list[str] = Field(default_factory=list)
    allow_credentials: bool = False
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])


class RoutingConfig(_Strict):
    """Routing knobs outside the policy.

    ``speculative_ttl_s``: life of the routed prompt's keys in the index for a worker with KV
    events (until events confirm them); ``approx_ttl_s``: the same for workers without events
    (approximate mode: the gateway's own history is all the index knows). ``measure_stream_usage``: ask
    streaming workers for usage to compare predicted with actual cached tokens (the usage chunk
    is stripped when the client did not ask for it). ``tokenize_threads``: tokenizer pool size;
    ``inline_tokenize_max_bytes``: bodies up to this size (16 KiB, ~3k tokens) are tokenized on the
    event loop, larger ones in the pool: on a busy host the hop to a pool thread costs more than
    tokenizing a body that small, all the more for a chat turn whose history the token cache
    holds (figures: docs/tuning/event_loop.md).
    ``max_tokenize_bytes``: bodies past this size (4 MiB: ~1M tokens, past any context length)
    are routed by load without tokenizing (``kvroute_tokenization_fallbacks_total{reason="too_large"}``).
    ``decisions_kept``: recent routing decisions kept for ``GET /admin/decisions`` and the
    dashboard (:mod:`router.route.decision_log`; 0 keeps none). ``tokenize_cache_max_tokens``: bound of
    each tokenizer's prefix token cache (:mod:`kvcore.token_cache`: a chat turn encodes only its
    new messages; ~8 bytes per token; 0 turns it off). ``render_multimodal``: prompts with media
    get their token ids and multimodal hashes from a vLLM render endpoint (:mod:`router.route.render`;
    the model's ``render_url``, else a worker of the model, which needs ``--enable-scale-out``);
    off, or when rendering fails, they are routed by load. ``render_timeout_s``: the whole render
    call; ``render_retry_s``: how long a render endpoint that failed is left alone.
    """

    speculative_ttl_s: float = Field(5.0, gt=0)
    approx_ttl_s: float = Field(120.0, gt=0)
    measure_stream_usage: bool = True
    tokenize_threads: int = Field(2, ge=1)
    inline_tokenize_max_bytes: int = Field(16384, ge=0)
    max_tokenize_bytes: int = Field(4 * MIB, ge=0)
    decisions_kept: int = Field(1024, ge=0, le=1_000_000)
    tokenize_cache_max_tokens: int = Field(2_000_000, ge=0)
    render_multimodal: bool = True
    render_timeout_s: float = Field(10.0, gt=0)
    render_retry_s: float = Field(30.0, ge=0)


class GatewayConfig(_Strict):
    """The whole gateway config; see the module docstring. Raises pydantic ValidationError on a
    bad shape, ValueError (via :func:`load_config`) on a bad policy."""

    listen: ListenConfig = Field(default_factory=ListenConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    models: list[ModelConfig] = Field(min_length=1)
    index: IndexConfig = Field(default_factory=IndexConfig)
    workers: list[WorkerConfig] = Field(default_factory=list)
    policy: dict[str, Any] = Field(default_factory=lambda: {"name": "ttft"})
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    max_body_bytes: int = Field(64 * MIB, ge=32 * MIB)
    health: HealthConfig = Field(default_factory=HealthConfig)
    load_scrape: LoadScrapeConfig = Field(default_factory=LoadScrapeConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    cors: CorsConfig = Field(default_factory=CorsConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    client_auth: ClientAuthConfig = Field(default_factory=ClientAuthConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)

    @model_validator(mode="after")
    def _cross_check(self) -> "GatewayConfig":
        self.workers = expand_data_parallel(self.workers)
        names = [m.name for m in self.models]
        for m in self.models:
            names.extend(m.lora_adapters)
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model or adapter names repeated: {sorted(dup)}")
        bases = {m.name for m in self.models}
        ids = [w.id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids repeated: {sorted({i for i in ids if ids.count(i) > 1})}")
        repeated = repeated_targets(self.workers)
        if repeated:  # one server (or rank) listed twice would count twice in routing
            raise ValueError(f"worker urls repeated: {repeated}")
        for w in self.workers:
            if w.model not in bases:
                raise ValueError(f"worker {w.id!r} serves unknown model {w.model!r}; models: {sorted(bases)}")
        k8s = self.discovery.kubernetes
        if k8s is not None and k8s.model not in bases:
            raise ValueError(f"discovery.kubernetes.model {k8s.model!r} is not a model; models: {sorted(bases)}")
        if not isinstance(self.policy.get("name"), str):
            raise ValueError("policy.name must be a string")
        return self


def check_policy(cfg: dict[str, Any]) -> None:
    """Build the policy once to validate ``cfg``; raises ValueError when it is bad."""
    make_policy(cfg)


def validation_message(exc: ValidationError) -> str:
    """Every problem of a pydantic ValidationError on one line: ``field.path: message; ...``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def parse_config(data: Any) -> GatewayConfig:
    """Validate a parsed YAML document. Raises ValueError with every problem listed."""
    if not isinstance(data, dict):
        raise ValueError("config must be a mapping")
    try:
        cfg = GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid gateway config: {validation_message(exc)}") from None
    check_policy(cfg.policy)
    return cfg


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate the YAML file at ``path``. Raises ValueError (bad content) or OSError."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"config {path} is not valid YAML: {exc}") from None
    return parse_config(data)
