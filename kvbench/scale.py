"""Virtual workers for scale measurements: the Mooncake conversation trace replayed through N
per-worker vLLM-like block pools, their KV event streams, and the index fed from them as the
gateway's embedded mode feeds it. Pure computation (no sockets, no files): the I/O lives in
``benchmarks/bench_scale.py``.

Trace (:mod:`kvbench.trace`): each 512-token trace block becomes 512 token ids that depend
only on its hash id (:class:`TraceTokens`, the same ids ``expand_trace`` gives with
``block_tokens=512`` for the same tokenizer's one-token words), so requests sharing their first k
hash ids share their first k x 512 tokens. To reach the size a cluster needs, the trace is repeated
(:func:`scale_requests`): copy ``c`` replays the same rows shifted by ``c`` times the trace's span
in time, with its block 0 drawn from another seed, so every copy is a disjoint set of
conversations (another tenant with its own system prompt) with the trace's reuse inside it.
Prompts longer than half a worker's pool keep their leading trace blocks (a worker must hold a
request whole; :func:`build_streams`).

Routing (:func:`route_by_prefix`): by prefix, as a cache-aware router keeps a conversation where
its history is: the worker is a stable hash of (copy, the request's first two trace blocks)
modulo N, so every turn of a conversation reaches the worker holding its earlier turns.

Workers (:class:`VirtualWorker`): one :class:`simulator.block_pool.BlockPool` each (vLLM's
block pool with prefix caching and lazy LRU eviction, driven without the simulator's HTTP
server). Requests run one at a time per worker: prefix hit, the rest allocated (evicting the
least recently freed blocks, one ``BlockRemoved`` per engine hash), the prompt's full blocks
stored in chunks of ``chunk_tokens`` (one ``BlockStored`` per prefill step, with token ids and
parent hash), then one ``BlockStored`` per full block of output, then the blocks freed tail
first. Each step's events are one batch, encoded as vLLM's ``ZmqEventPublisher`` encodes them
(:func:`kvcore.kv_events.wire.encode_batch`), so a worker's stream is what the gateway would receive.

Ingest (:func:`ingest`): each payload decoded (:func:`kvcore.kv_events.wire.decode_batch`), translated
by the worker's :class:`kvcore.kv_events.translate.EventTranslator` and written with
:func:`kvcore.kv_events.ingest.write_ops` into any :class:`kvcore.index.base.KVIndex`: the
embedded gateway's path without the ZMQ socket.
"""
from __future__ import annotations

import random
import statistics
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvbench.trace import TRACE_BLOCK_TOKENS, TraceRow
from kvcore.block_keys import block_keys
from kvcore.index.base import KVIndex
from kvcore.kv_events.ingest import write_ops
from kvcore.kv_events.translate import EventTranslator
from kvcore.kv_events.wire import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from simulator.block_pool import BlockPool

ENGINE_SEED = 0  # the virtual engines' hash seed (any: engine hashes only need to be consistent)


# ---- trace -> token ids ----------------------------------------------------------------------
class TraceTokens:
    """Token ids of trace blocks. ``word_ids``: the token ids of a tokenizer's one-token words in
    :class:`kvbench.words.OneTokenWords` order; ``prefix_ids``: the ids the tokenizer puts
    before a completions prompt (a BOS, or none). Block ids of copy 0 give the ids
    ``expand_trace`` gives with ``block_tokens=512`` (salt ``"trace"``); copy ``c > 0`` draws its
    block 0 from salt ``"trace-copy<c>"``. Each block's ids are made once and kept."""

    def __init__(self, word_ids: Sequence[int], prefix_ids: Sequence[int] = ()) -> None:
        if not word_ids:
            raise ValueError("word_ids must not be empty")
        self.word_ids = list(word_ids)
        self.prefix_ids = list(prefix_ids)
        self._cache: dict[tuple[str, int], list[int]] = {}

    def block(self, block_id: int, copy: int = 0, first: bool = False) -> list[int]:
        """The 512 token ids of trace block ``block_id`` (``first``: at position 0, where copies
        differ)."""
        salt = f"trace-copy{copy}" if first and copy else "trace"
        got = self._cache.get((salt, block_id))
        if got is None:
            rng = random.Random(xxhash.xxh3_64_intdigest(f"{salt}/{block_id}".encode()))
            got = self._cache[(salt, block_id)] = rng.choices(self.word_ids, k=TRACE_BLOCK_TOKENS)
        return got

    def prompt(self, hash_ids: Sequence[int], input_length: int, copy: int = 0,
               max_tokens: int | None = None) -> list[int]:
        """A request's prompt token ids: the prefix ids, then its trace blocks (block 0 shortened
        by the prefix, a partial last block cut to ``input_length``), at most ``max_tokens`` (whole
        trace blocks kept, at least one)."""
        full, rest = divmod(input_length, TRACE_BLOCK_TOKENS)
        sizes = [TRACE_BLOCK_TOKENS] * full + ([rest] if rest else [])
        sizes[0] -= len(self.prefix_ids)
        while max_tokens is not None and len(sizes) > 1 and sum(sizes) + len(self.prefix_ids) > max_tokens:
            sizes.pop()
        out = list(self.prefix_ids)
        for i, (h, n) in enumerate(zip(hash_ids, sizes)):
            out += self.block(h, copy, first=(i == 0))[:n]
        return out


@dataclass
class ScaleRequest:
    """One replayed request: ``number`` in send order, trace ``copy`` and ``row`` (-1 for the
    concatenated long prompt), arrival ``arrival_s`` (seconds from the first), ``prompt_ids`` and
    ``output_tokens`` (tokens), ``route_key`` (the bytes :func:`route_by_prefix` hashes: copy and
    first two trace block ids) and the ``worker`` index it was routed to (set by
    :func:`build_streams`)."""

    number: int
    copy: int
    row: int
    arrival_s: float
    prompt_ids: list[int]
    output_tokens: int
    route_key: bytes
    worker: int = -1


def scale_requests(rows: Sequence[TraceRow], tokens: TraceTokens, n_requests: int,
                   max_request_tokens: int, start: int = 0) -> list[ScaleRequest]:
    """Requests ``start..n_requests-1`` of the trace repeated (module docstring): copy ``c`` of
    row ``i`` is request ``c * len(rows) + i``, arriving ``c`` trace spans later. Output lengths
    are the trace's, cut so prompt + output fit ``max_request_tokens``. Raises ValueError when
    ``rows`` is empty."""
    if not rows:
        raise ValueError("empty trace")
    t0 = rows[0].timestamp_ms
    span_s = (rows[-1].timestamp_ms - t0) / 1000.0 + 1.0
    out = []
    for n in range(start, n_requests):
        copy, i = divmod(n, len(rows))
        row = rows[i]
        prompt = tokens.prompt(row.hash_ids, row.input_length, copy, max_request_tokens // 2)
        output = max(1, min(row.output_length, max_request_tokens - len(prompt)))
        out.append(ScaleRequest(n, copy, i, copy * span_s + (row.timestamp_ms - t0) / 1000.0, prompt, output,
                                struct.pack("<q", copy) + repr(row.hash_ids[:2]).encode()))
    return out


def route_by_prefix(request: ScaleRequest, n_workers: int) -> int:
    """The worker index (0..n_workers-1) for ``request``: a stable hash of its copy and first two
    trace blocks (its conversation) modulo ``n_workers``."""
    return xxhash.xxh3_64_intdigest(request.route_key) % n_workers


# ---- virtual workers --------------------------------------------------------------------------
def engine_hashes(token_ids: Sequence[int], block_size: int, seed: int = ENGINE_SEED) -> list[int]:
    """Engine hashes of the full blocks of ``token_ids``: the same values as
    :func:`simulator.block_pool.engine_block_hashes` without extra keys (xxh3_64 with ``seed``
    over the parent hash, 8 bytes big-endian, then the block's ids, 4 bytes little-endian each),
    packed in one call per block."""
    fmt = struct.Struct(f"<{block_size}I")
    h = xxhash.xxh3_64_intdigest
    parent = 0
    out = []
    for i in range(len(token_ids) // block_size):
        parent = h(parent.to_bytes(8, "big") + fmt.pack(*token_ids[i * block_size:(i + 1) * block_size]), seed)
        out.append(parent)
    return out


class VirtualWorker:
    """One virtual vLLM worker: a block pool of ``capacity_blocks`` usable blocks of
    ``block_size`` tokens and its event stream (module docstring). ``chunk_tokens``: prefill
    tokens per engine step (one ``BlockStored`` each). Raises ValueError from the pool on a
    request larger than the pool."""

    def __init__(self, capacity_blocks: int, block_size: int, chunk_tokens: int = 8192) -> None:
        self.pool = BlockPool(capacity_blocks + 1, block_size)
        self.block_size = block_size
        self.chunk_blocks = max(1, chunk_tokens // block_size)
        self.seq = 0
        self.events = 0
        self.blocks_stored = 0
        self.blocks_removed = 0
        self.hit_blocks = 0
        self.prompt_blocks = 0

    def serve(self, prompt_ids: Sequence[int], output_ids: Sequence[int], ts: float) -> list[bytes]:
        """Run one request to completion; returns its event batches as encoded payloads (one per
        engine step that produced events; ``ts``: the batches' time stamp, unix seconds)."""
        pool, bs = self.pool, self.block_size
        tokens = list(prompt_ids) + list(output_ids)
        hashes = engine_hashes(tokens, bs)
        prompt_full = len(prompt_ids) // bs
        hit = pool.longest_hit(hashes[:prompt_full], len(prompt_ids))
        pool.touch(hit)
        blocks = hit + pool.allocate(-(-len(tokens) // bs) - len(hit))
        self.hit_blocks += len(hit)
        self.prompt_blocks += prompt_full
        payloads = []
        ends = list(range(len(hit) + self.chunk_blocks, prompt_full, self.chunk_blocks)) + [prompt_full]
        ends += list(range(prompt_full + 1, len(hashes) + 1))  # one decode step per full output block
        start = len(hit)
        for end in ends:
            if end > start:
                pool.cache_full_blocks(blocks, hashes, tokens, start, end)
                start = end
            events = pool.take_events()
            if events:
                payloads.append(encode_batch(EventBatch(ts=ts, events=events, data_parallel_rank=None)))
                self.events += len(events)
                for ev in events:
                    if isinstance(ev, BlockStored):
                        self.blocks_stored += len(ev.block_hashes)
                    elif isinstance(ev, BlockRemoved):
                        self.blocks_removed += len(ev.block_hashes)
        pool.free(blocks)
        self.seq += len(payloads)
        return payloads

    @property
    def cached_blocks(self) -> int:
        """Distinct engine hashes the pool holds: the (block, worker) entries the index should
        have for this worker."""
        return len(self.pool._cached)


@dataclass
class EventStreams:
    """N workers' event streams in send order. ``order``: ``(worker index, payload)`` per batch;
    ``requests``: every replayed request (``worker`` set); ``workers``: the virtual workers as
    they ended; ``expected_entries``: per worker, the distinct blocks held at the end of
    ``order[:fill_batches]`` (``fill_expected``) and at the end (``workers[i].cached_blocks``).
    ``fill_requests``: requests whose batches are the first ``fill_batches``."""

    n_workers: int
    block_size: int
    capacity_blocks: int
    order: list[tuple[int, bytes]] = field(default_factory=list)
    requests: list[ScaleRequest] = field(default_factory=list)
    workers: list[VirtualWorker] = field(default_factory=list)
    fill_batches: int = 0
    fill_requests: int = 0
    fill_events: int = 0
    fill_blocks: int = 0
    fill_expected: list[int] = field(default_factory=list)
    last_fill_request: dict[int, int] = field(default_factory=dict)  # worker -> request number
    long_request: int | None = None  # the concatenated long prompt's request number
    generate_s: float = 0.0

    def worker_ids(self) -> list[str]:
        """The workers' ids, by worker index."""
        return worker_ids(self.n_workers)


def worker_ids(n_workers: int) -> list[str]:
    """The virtual workers' ids: ``w0000``..."""
    return [f"w{i:04d}" for i in range(n_workers)]


def output_ids(request: ScaleRequest, word_ids: Sequence[int]) -> list[int]:
    """Generated token ids of ``request`` (unique to it: no later prompt matches them)."""
    rng = random.Random(request.number * 7919 + 1)
    return rng.choices(word_ids, k=request.output_tokens)


def long_prompt(rows: Sequence[TraceRow], tokens: TraceTokens, n_blocks: int, block_size: int) -> list[int]:
    """A prompt of exactly ``n_blocks`` full blocks: the trace's longest prompt's blocks, then
    the blocks of the next longest ones, concatenated (block ids in that order) and cut."""
    ids: list[int] = list(tokens.prefix_ids)
    want = n_blocks * block_size
    for row in sorted(rows, key=lambda r: -r.input_length):
        for h in row.hash_ids:
            ids += tokens.block(h)
            if len(ids) >= want:
                return ids[:want]
    raise ValueError(f"the trace has fewer than {n_blocks} blocks of {block_size} tokens")


def build_streams(rows: Sequence[TraceRow], tokens: TraceTokens, n_workers: int, capacity_blocks: int,
                  block_size: int = 16, fill_factor: float = 1.5, flow_factor: float = 0.25,
                  long_blocks: int = 2048, chunk_tokens: int = 8192,
                  clock: Callable[[], float] = time.perf_counter) -> EventStreams:
    """Replay the trace through ``n_workers`` virtual workers of ``capacity_blocks`` blocks.

    Requests are added (:func:`scale_requests`, routed by :func:`route_by_prefix`) until the
    blocks stored reach ``fill_factor x n_workers x capacity_blocks`` (pools full, evicting), then
    a ``long_blocks``-block prompt (:func:`long_prompt`; skipped when 0 or not below the pool) goes to
    worker 0: these make the fill part. Then ``flow_factor`` times as many blocks again make the
    flow part (events for measuring lookups while events flow). Requests are cut to half a pool.
    Raises ValueError on ``n_workers < 1`` or a pool under 64 blocks."""
    if n_workers < 1 or capacity_blocks < 64:
        raise ValueError("need n_workers >= 1 and capacity_blocks >= 64")
    t_start = clock()
    streams = EventStreams(n_workers, block_size, capacity_blocks)
    streams.workers = [VirtualWorker(capacity_blocks, block_size, chunk_tokens) for _ in range(n_workers)]
    max_tokens = capacity_blocks // 2 * block_size
    fill_target = int(fill_factor * n_workers * capacity_blocks)
    total_target = fill_target + int(flow_factor * n_workers * capacity_blocks)
    stored = 0
    number = 0
    filled = False
    batch_size = len(rows)
    while stored < total_target:
        batch = scale_requests(rows, tokens, number + batch_size, max_tokens, start=number)
        for req in batch:
            req.worker = route_by_prefix(req, n_workers)
            vw = streams.workers[req.worker]
            before = vw.blocks_stored
            for payload in vw.serve(req.prompt_ids, output_ids(req, tokens.word_ids), 1.7e9 + req.arrival_s):
                streams.order.append((req.worker, payload))
            stored += vw.blocks_stored - before
            streams.requests.append(req)
            number += 1
            if not filled:
                streams.last_fill_request[req.worker] = req.number
            if not filled and stored >= fill_target:
                filled = True
                if long_blocks and long_blocks < capacity_blocks:
                    ids = long_prompt(rows, tokens, long_blocks, block_size)
                    long_req = ScaleRequest(number, -1, -1, req.arrival_s, ids, 1, b"long", worker=0)
                    for payload in streams.workers[0].serve(ids, [], 1.7e9 + req.arrival_s):
                        streams.order.append((0, payload))
                    streams.requests.append(long_req)
                    streams.long_request = number
                    number += 1
                streams.fill_batches = len(streams.order)
                streams.fill_requests = number
                streams.fill_events = sum(w.events for w in streams.workers)
                streams.fill_blocks = sum(w.blocks_stored + w.blocks_removed for w in streams.workers)
                streams.fill_expected = [w.cached_blocks for w in streams.workers]
            if stored >= total_target:
                break
    streams.generate_s = clock() - t_start
    return streams


# ---- ingest -----------------------------------------------------------------------------------
@dataclass
class IngestResult:
    """One ingest run: ``batches``, ``events`` and ``blocks`` (stored + removed) applied,
    ``cpu_s`` (process CPU seconds) and ``wall_s`` spent."""

    batches: int
    events: int
    blocks: int
    cpu_s: float
    wall_s: float

    def per_s(self) -> dict[str, float]:
        """Events and blocks per CPU second (one core's ingest rate) and per wall second."""
        cpu = max(self.cpu_s, 1e-9)
        wall = max(self.wall_s, 1e-9)
        return {"events_per_cpu_s": self.events / cpu, "blocks_per_cpu_s": self.blocks / cpu,
                "events_per_wall_s": self.events / wall, "blocks_per_wall_s": self.blocks / wall}


def new_translators(streams: EventStreams, model: str) -> list[EventTranslator]:
    """One translator per virtual worker (model name and block size as the gateway's)."""
    return [EventTranslator(model, streams.block_size) for _ in range(streams.n_workers)]


async def ingest(index: KVIndex, streams: EventStreams, translators: Sequence[EventTranslator],
                 start: int, end: int) -> IngestResult:
    """Apply batches ``order[start:end]``: decode, translate, write into ``index`` (module
    docstring). Raises whatever the index raises."""
    ids = streams.worker_ids()
    events = blocks = 0
    c0, w0 = time.process_time(), time.perf_counter()
    for worker, payload in streams.order[start:end]:
        batch = decode_batch(payload)
        ops = translators[worker].translate(batch)
        events += len(batch.events)
        for _, _, keys in ops:
            blocks += len(keys)
        if ops:
            await write_ops(index, ids[worker], ops)
    return IngestResult(end - start, events, blocks, time.process_time() - c0, time.perf_counter() - w0)


async def index_entries(index: KVIndex) -> dict[str, int]:
    """The index's own count: per worker id, gpu blocks held (from :meth:`KVIndex.stats`)."""
    return {w: s.blocks.get("gpu", 0) for w, s in (await index.stats()).items()}


async def copy_into(index: KVIndex, translators: Sequence[EventTranslator], ids: Sequence[str]) -> int:
    """Write every translator's state (:meth:`EventTranslator.snapshot`) into ``index`` with
    freshly made key ints (so the index owns its keys, as in a process that decoded them
    itself); returns the keys written."""
    n = 0
    for t, worker in zip(translators, ids):
        for op, tier, keys in t.snapshot():
            fresh = [int.from_bytes(k.to_bytes(8, "little"), "little") for k in keys]
            n += len(fresh)
            await write_ops(index, worker, [(op, tier, fresh)])
    return n


def decode_cost(streams: EventStreams, sample: int = 2000, vocab: int = 128_000) -> dict[str, float]:
    """Microseconds per event to decode ``sample`` payloads spread over the fill part, as
    generated and re-encoded with every token id ``t`` replaced by ``(t * 2654435761) % vocab``
    (ids of a large vocabulary take 3 msgpack bytes where the test tokenizer's take 1-2)."""
    step = max(1, streams.fill_batches // sample)
    payloads = [streams.order[i][1] for i in range(0, streams.fill_batches, step)][:sample]
    wide = []
    for p in payloads:
        batch = decode_batch(p)
        for ev in batch.events:
            if getattr(ev, "token_ids", None):
                ev.token_ids = [(t * 2654435761) % vocab for t in ev.token_ids]
        wide.append(encode_batch(batch))
    out: dict[str, float] = {}
    for name, group in (("test_vocab", payloads), ("wide_vocab", wide)):
        events = 0
        t0 = time.process_time()
        for p in group:
            events += len(decode_batch(p).events)
        out[f"{name}_us_per_event"] = round((time.process_time() - t0) / max(events, 1) * 1e6, 3)
        out[f"{name}_bytes_per_event"] = round(sum(map(len, group)) / max(events, 1), 1)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; 0.0 when empty."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


@dataclass
class LookupResult:
    """Lookups while events flowed: per prompt kind (``trace``, ``long``) latencies in
    milliseconds; events applied meanwhile and the rate they were applied at (per wall second)."""

    latencies_ms: dict[str, list[float]]
    events: int
    wall_s: float

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"events_applied": self.events, "wall_s": round(self.wall_s, 3),
                               "events_per_s": round(self.events / max(self.wall_s, 1e-9), 1)}
        for kind, lat in self.latencies_ms.items():
            out[kind] = {"lookups": len(lat), "p50_ms": round(percentile(lat, 0.5), 4),
                         "p99_ms": round(percentile(lat, 0.99), 4),
                         "mean_ms": round(statistics.fmean(lat), 4) if lat else 0.0}
        return out


def prompt_keys(streams: EventStreams, model: str, numbers: Sequence[int]) -> list[list[int]]:
    """Block keys (as the gateway makes them) of the prompts of requests ``numbers``."""
    return [block_keys(streams.requests[n].prompt_ids, streams.block_size, model) for n in numbers]


async def lookups_while_flowing(index: KVIndex, streams: EventStreams, translators: Sequence[EventTranslator],
                                prompts: dict[str, list[list[int]]], events_per_s: float,
                                max_s: float, max_lookups: int = 20_000) -> LookupResult:
    """From batch ``fill_batches`` on, apply the flow part's batches at ``events_per_s`` (paced
    by wall time; as fast as possible when behind) and between them look up ``prompts`` (per kind,
    cycled, kinds alternating), timing each :meth:`KVIndex.match` with ``time.perf_counter``.
    Stops after ``max_s`` seconds, ``max_lookups`` lookups or the last batch."""
    ids = streams.worker_ids()
    kinds = [k for k, v in prompts.items() if v]
    lat: dict[str, list[float]] = {k: [] for k in kinds}
    pos = streams.fill_batches
    end = len(streams.order)
    events = 0
    t0 = time.perf_counter()
    i = 0
    while i < max_lookups:
        now = time.perf_counter() - t0
        if now > max_s:
            break
        due = events_per_s * now
        while events < due and pos < end:
            worker, payload = streams.order[pos]
            batch = decode_batch(payload)
            ops = translators[worker].translate(batch)
            if ops:
                await write_ops(index, ids[worker], ops)
            events += len(batch.events)
            pos += 1
        if pos >= end and events < due:
            break
        kind = kinds[i % len(kinds)]
        keys = prompts[kind][(i // len(kinds)) % len(prompts[kind])]
        t = time.perf_counter()
        await index.match(keys)
        lat[kind].append((time.perf_counter() - t) * 1e3)
        i += 1
    return LookupResult(lat, events, time.perf_counter() - t0)


def largest_cluster(cpu_s_per_event: float, events_per_request: float, requests_per_s_per_worker: float,
                    cores: float = 1.0) -> float:
    """Workers whose KV events one process ingests with ``cores`` of CPU: ``cores /
    (cpu_s_per_event x events_per_request x requests_per_s_per_worker)``. Raises ValueError on
    a non-positive figure."""
    if min(cpu_s_per_event, events_per_request, requests_per_s_per_worker) <= 0:
        raise ValueError("figures must be > 0")
    return cores / (cpu_s_per_event * events_per_request * requests_per_s_per_worker)
