#!/usr/bin/env python3
"""The gateway at 64 / 256 / 1,024 workers, with virtual workers: index memory, KV event ingest
rate, lookups while events flow, and a real ``kvroute serve`` following N virtual workers.

Workload (:mod:`kvbench.scale`): the shipped first 1,000 requests of the Mooncake
conversation trace (``kvbench/data/``), repeated with shifted copies until the workers'
pools are full and evicting, routed by prefix (a conversation stays on one worker), each worker a
vLLM-like block pool (``simulator/block_pool.py``) of ``--capacity-blocks`` blocks of 16 tokens.
Token ids are the tiny test tokenizer's one-token words, so the gateway tokenizes the text
prompts sent to it into the very ids the events carry.

Per worker count N:

1. direct ingest (in this process, ``--direct``): every batch decoded, translated and written into
   the index (``--index``; the embedded gateway's path without the socket), ``--repeats`` times.
   Events and blocks per CPU second; bytes per (block, worker) entry of the whole ingest state
   (translators + index; RSS delta) and of the index alone (a second index filled from the
   translators' state with key ints of its own: RSS delta, and Python heap bytes by
   ``tracemalloc``); the index's own entry count against the pools'; whether each worker's last
   routed prompt is found on it and the 2,048-block prompt matched whole; decode cost per event
   as generated and with a large vocabulary's token ids.
2. lookups (``KVIndex.match`` wall time) of each worker's last routed prompt and of the
   2,048-block prompt, alternating, while the flow part's events are applied at
   ``--flow-events-per-s`` (one event loop, as in the gateway), for ``--lookup-s``.
3. gateway (``--gateway``): ``kvroute serve`` with N workers whose ``events:`` are ZMQ sockets
   of this process (XPUB, vLLM's wire format, no replay socket) and whose HTTP side is one fake
   aiohttp process on N ports (``/health``, a vLLM-shaped ``/metrics`` page with nothing running,
   ``/metrics/?name[]=...`` restricted to the names asked as vLLM 0.32 answers it,
   ``/v1/completions`` answered at once: the engine is not what is measured). The fill part's
   batches are published as fast as the sockets take them; the gateway's CPU (its process tree,
   user + system) and wall time until ``/admin/index`` shows every batch applied give its ingest
   rate through ZMQ (also less the idle rate), its RSS delta per entry, and whether its entries
   equal the pools'; then idle CPU (``--idle-s``, no traffic, no events: health probes and load
   scrapes) and CPU per routed request (``--requests`` trace prompts, ``--concurrency`` at a time,
   no events meanwhile).

Last, per N, the largest cluster one process can follow: workers whose steady-state event rate
(events per request once pools evict, times ``--requests-per-s-per-worker``, an assumption) one
core ingests at the measured CPU per event (``largest_cluster_*``; ``_with_idle`` adds the idle
cost per worker).

JSON (``--out``): table ``scale``, one row per N with the workload (``requests``, ``events``,
``blocks``, ``steady_events_per_request``...), ``direct`` and ``gateway`` objects as above.

Usage: python benchmarks/bench_scale.py [--quick] [--workers 64,256,1024] [--capacity-blocks 4096]
       [--no-direct] [--no-gateway] [--repeats 3] [--requests-per-s-per-worker 1] [--out FILE] [--logs DIR]
Everything runs on loopback and stops by itself (each child has a deadline).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_probe_cpu import start as start_bounded, stop, vllm_like_page  # noqa: E402
from kvbench import scale  # noqa: E402
from kvcore.index.base import KVIndex  # noqa: E402
from kvcore.index.host import HostIndex  # noqa: E402
from kvcore.index.memory import MemoryIndex  # noqa: E402
from kvcore.kv_events.wire import seq_bytes  # noqa: E402
from kvcore.tokenization import PromptTokenizer  # noqa: E402
from lab.figures import new_figures, add_table, write_json  # noqa: E402
from lab.process_sampler import tree_cpu_s  # noqa: E402
from kvbench.trace import DEFAULT_TRACE, read_trace  # noqa: E402
from kvbench.words import OneTokenWords  # noqa: E402
from kvroute.up import free_ports  # noqa: E402

TINY = ROOT / "tests/fixtures/tiny-model"
MODEL = "tiny"
BLOCK_SIZE = 16
DEADLINE_S = 1800  # every child process is killed after this
SUBSCRIBE_TIMEOUT_S = 120.0  # for the gateway to subscribe to every worker's events
def host_index() -> HostIndex:
    """A fresh host index (kvcore/index/host.py) as the writer, in a file already unlinked from
    /dev/shm (its memory goes with the index), sized for 1,024 workers' pools."""
    path = Path(tempfile.mkdtemp(prefix="bench-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)) / "index"
    idx = HostIndex(path, max_keys=8_000_000, max_workers=1024, max_holder_sets=65_536)
    idx.try_become_writer()
    path.unlink()
    path.parent.rmdir()
    return idx


INDEXES = {"memory": MemoryIndex, "host": host_index}  # --index name -> () -> KVIndex

FLEET = r'''
import asyncio, json, sys
from aiohttp import web
from lab.metrics_page import NamedPages
n_ports = int(sys.argv[1])
page = open(sys.argv[2]).read()
async def health(request):
    return web.Response(text="")
pages = NamedPages(page)
async def metrics(request):
    return web.Response(text=page)
async def metrics_named(request):  # vLLM's mount of prometheus_client's app: its name[] filter
    return web.Response(text=pages.of(request.query.getall("name[]", [])))
async def completions(request):
    body = await request.json()
    n = len(body.get("prompt", "").split())
    return web.json_response({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": body.get("model"),
        "choices": [{"index": 0, "text": " x", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}})
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 1000000}]})
async def main():
    ports = []
    for _ in range(n_ports):
        app = web.Application(client_max_size=1 << 28)
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/metrics/", metrics_named)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])
    print("ports " + ",".join(map(str, ports)), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
'''


def idle_engine_page() -> str:
    """``bench_probe_cpu``'s vLLM-shaped ``/metrics`` page with nothing running or waiting
    (a busy-looking worker would hold requests in the gateway's dispatch queue)."""
    lines = []
    for line in vllm_like_page().splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            line = line.rsplit(" ", 1)[0] + " 0"
        lines.append(line)
    return "\n".join(lines) + "\n"


# ---- process helpers ---------------------------------------------------------------------------
def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of ``pid`` (this process when None), from /proc, in bytes."""
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tree_rss_bytes(pid: int) -> int:
    """RSS of ``pid`` and its descendants, in bytes (0 when gone)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def start(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return start_bounded(argv, log, env, DEADLINE_S)


# ---- direct ingest -----------------------------------------------------------------------------
async def measure_direct(streams: scale.EventStreams, make_index, flow_events_per_s: float, lookup_s: float,
                         repeats: int) -> dict[str, Any]:
    """Steps 1-2 of the module docstring for one worker count."""
    ids = streams.worker_ids()
    out: dict[str, Any] = {}
    gc.collect()
    rss0 = rss_bytes()
    index: KVIndex = make_index()
    translators = scale.new_translators(streams, MODEL)
    first = await scale.ingest(index, streams, translators, 0, streams.fill_batches)
    gc.collect()
    rss1 = rss_bytes()
    own = await scale.index_entries(index)
    entries = sum(own.values())
    expected = sum(streams.fill_expected)
    out["entries"] = entries
    out["entries_expected"] = expected
    out["entries_match"] = [own.get(w, 0) for w in ids] == streams.fill_expected
    out["distinct_keys"] = len(index) if hasattr(index, "__len__") else None
    out["ingest_state_bytes"] = rss1 - rss0
    out["ingest_state_bytes_per_entry"] = round((rss1 - rss0) / max(entries, 1), 1)
    # the index alone: a second index filled from the translators' state, owning its key ints
    gc.collect()
    rss2 = rss_bytes()
    alone = make_index()
    await scale.copy_into(alone, translators, ids)
    gc.collect()
    rss3 = rss_bytes()
    out["index_bytes"] = rss3 - rss2
    out["index_bytes_per_entry"] = round((rss3 - rss2) / max(entries, 1), 1)
    del alone
    gc.collect()
    # the same, counted by tracemalloc: Python heap bytes the index holds (no allocator slack)
    tracemalloc.start()
    alone = make_index()
    await scale.copy_into(alone, translators, ids)
    out["index_heap_bytes"] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    out["index_heap_bytes_per_entry"] = round(out["index_heap_bytes"] / max(entries, 1), 1)
    del alone
    gc.collect()
    out["decode"] = scale.decode_cost(streams, sample=2000)
    # each worker's last routed prompt of the fill part is found on that worker
    numbers = [streams.last_fill_request[w] for w in sorted(streams.last_fill_request)]
    keys = scale.prompt_keys(streams, MODEL, numbers)
    found = 0
    for n, k in zip(numbers, keys):
        m = await index.match(k)
        w = ids[streams.requests[n].worker]
        found += bool(w in m and m[w].gpu > 0)
    out["routed_prompts_checked"] = len(numbers)
    out["routed_prompts_found"] = found
    long_keys = scale.prompt_keys(streams, MODEL, [streams.long_request]) if streams.long_request is not None else []
    if long_keys:
        m = await index.match(long_keys[0])
        out["long_prompt_blocks"] = len(long_keys[0])
        out["long_prompt_matched_blocks"] = m[ids[0]].gpu if ids[0] in m else 0
    lookups = await scale.lookups_while_flowing(index, streams, translators, {"trace": keys, "long": long_keys},
                                                flow_events_per_s, lookup_s)
    out["lookups"] = lookups.summary()
    runs = [first]
    del index, translators
    gc.collect()
    for _ in range(repeats - 1):
        idx = make_index()
        tr = scale.new_translators(streams, MODEL)
        runs.append(await scale.ingest(idx, streams, tr, 0, streams.fill_batches))
        del idx, tr
        gc.collect()
    out["ingest_runs"] = [{"events": r.events, "blocks": r.blocks, "batches": r.batches, "cpu_s": round(r.cpu_s, 3),
                           "wall_s": round(r.wall_s, 3), **{k: round(v, 1) for k, v in r.per_s().items()}}
                          for r in runs]
    return out


# ---- gateway -----------------------------------------------------------------------------------
async def gateway_phases(streams: scale.EventStreams, socks: list, gw_port: int, gw_pid: int,
                         texts: list[str], idle_s: float, concurrency: int, timeout_s: float) -> dict[str, Any]:
    """With one bound XPUB per worker in ``socks`` (kept open throughout, as a running engine
    keeps its publisher): wait for the gateway's subscriptions, publish the fill part's batches
    as fast as the sockets take them and wait until ``/admin/index`` shows them all applied; then
    the idle window; then the routed requests. Returns the ``ingest``, ``idle_cpu_ms_per_s``,
    ``load_scrape`` (workers scraped in the filtered form, whole, not yet) and ``requests``
    figures. Raises RuntimeError when the gateway does not subscribe or apply in
    time."""
    import zmq

    out: dict[str, Any] = {}
    end = time.monotonic() + SUBSCRIBE_TIMEOUT_S
    for i, s in enumerate(socks):  # a subscription message from the gateway's SUB socket
        left = end - time.monotonic()
        if left <= 0 or not await s.poll(int(left * 1000), zmq.POLLIN):
            subscribed = i + sum(1 for x in socks[i + 1:] if x.get(zmq.EVENTS) & zmq.POLLIN)
            raise RuntimeError(f"the gateway subscribed to {subscribed} of {len(socks)} workers' events "
                               f"in {SUBSCRIBE_TIMEOUT_S:.0f} s")
        await s.recv()
    end = time.monotonic() + timeout_s
    seqs = [0] * len(socks)
    rss0 = tree_rss_bytes(gw_pid)
    cpu0, t0 = tree_cpu_s(gw_pid), time.monotonic()
    for worker, payload in streams.order[:streams.fill_batches]:
        socks[worker].send_multipart((b"", seq_bytes(seqs[worker]), payload), copy=False)
        seqs[worker] += 1
    t_sent = time.monotonic()
    want = sum(seqs)
    async with httpx.AsyncClient() as client:
        while True:
            # the gateway's loop may be busy applying the flood for long stretches: each read may
            # take what is left of the whole wait
            r = await client.get(f"http://127.0.0.1:{gw_port}/admin/index", headers={"Authorization": "Bearer bench"},
                                 timeout=max(end - time.monotonic(), 1.0))
            workers = r.json()["workers"]
            applied = sum((w.get("kv_events") or {}).get("batches_applied", 0) for w in workers.values())
            if applied >= want:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"the gateway applied {applied} of {want} batches in time")
            await asyncio.sleep(0.2)
    t1, cpu1 = time.monotonic(), tree_cpu_s(gw_pid)
    rss1 = tree_rss_bytes(gw_pid)
    blocks = [int((workers.get(w) or {}).get("blocks", {}).get("gpu", 0)) for w in streams.worker_ids()]
    out["ingest"] = {
        "batches": want, "events": streams.fill_events, "blocks": streams.fill_blocks,
        "publish_s": round(t_sent - t0, 3), "wall_s": round(t1 - t0, 3), "cpu_s": round(cpu1 - cpu0, 3),
        "events_per_cpu_s": round(streams.fill_events / max(cpu1 - cpu0, 1e-9), 1),
        "blocks_per_cpu_s": round(streams.fill_blocks / max(cpu1 - cpu0, 1e-9), 1),
        "events_per_wall_s": round(streams.fill_events / max(t1 - t0, 1e-9), 1),
        "entries": sum(blocks), "entries_match": blocks == streams.fill_expected,
        "rss_delta_bytes": rss1 - rss0, "rss_bytes": rss1,
        "rss_bytes_per_entry": round((rss1 - rss0) / max(sum(blocks), 1), 1)}
    cpu0, t0 = tree_cpu_s(gw_pid), time.monotonic()
    await asyncio.sleep(idle_s)
    cpu1, t1 = tree_cpu_s(gw_pid), time.monotonic()
    idle = (cpu1 - cpu0) / (t1 - t0)
    out["idle_cpu_ms_per_s"] = round(idle * 1e3, 1)
    async with httpx.AsyncClient() as client:  # which form of /metrics the idle window's scrapes took
        r = await client.get(f"http://127.0.0.1:{gw_port}/admin/workers", headers={"Authorization": "Bearer bench"},
                             timeout=30)
    forms = [(w.get("engine") or {}).get("scrape_filtered") for w in r.json()["workers"]]
    out["load_scrape"] = {"filtered": forms.count(True), "whole": forms.count(False), "undecided": forms.count(None)}
    # the ingest window less what following the workers (probes, load scrapes) costs anyway
    gi = out["ingest"]
    ingest_cpu = max(1e-9, gi["cpu_s"] - idle * gi["wall_s"])
    gi["events_per_cpu_s_less_idle"] = round(gi["events"] / ingest_cpu, 1)
    gi["blocks_per_cpu_s_less_idle"] = round(gi["blocks"] / ingest_cpu, 1)
    await send_requests(gw_port, texts[:1], 1)  # warm the connections
    cpu0, t0 = tree_cpu_s(gw_pid), time.monotonic()
    errors: list[str] = []
    ok, failed = await send_requests(gw_port, texts, concurrency, errors)
    cpu1, t1 = tree_cpu_s(gw_pid), time.monotonic()
    spent = cpu1 - cpu0
    out["requests"] = {
        "sent": len(texts), "ok": ok, "failed": failed, "wall_s": round(t1 - t0, 3), "cpu_s": round(spent, 3),
        "cpu_ms_per_request": round(spent / max(ok, 1) * 1e3, 3),
        "cpu_ms_per_request_less_idle": round(max(0.0, spent - idle * (t1 - t0)) / max(ok, 1) * 1e3, 3),
        "mean_prompt_tokens": round(sum(len(t.split()) for t in texts) / max(len(texts), 1), 1),
        "errors": errors}
    return out


async def send_requests(gw_port: int, texts: list[str], concurrency: int,
                        errors: list[str] | None = None) -> tuple[int, int]:
    """POST each text as a completions prompt; returns (answered 200, failed); the first few
    failures' status and body go to ``errors``."""
    ok = failed = 0
    queue = list(texts)

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal ok, failed
        while queue:
            text = queue.pop()
            r = await client.post(f"http://127.0.0.1:{gw_port}/v1/completions",
                                  json={"model": MODEL, "prompt": text, "max_tokens": 1})
            if r.status_code == 200:
                ok += 1
            else:
                failed += 1
                if errors is not None and len(errors) < 3:
                    errors.append(f"{r.status_code}: {r.text[:300]}")

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
    return ok, failed


async def wait_until(pred, timeout_s: float, what: str) -> None:
    """Poll ``pred`` (a coroutine function) every 0.2 s until it returns true. Raises
    RuntimeError naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if await pred():
                return
        except (httpx.HTTPError, OSError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


async def measure_gateway(streams: scale.EventStreams, work: Path, texts: list[str], idle_s: float,
                          concurrency: int) -> dict[str, Any]:
    """Step 3 of the module docstring for one worker count. Every port is bound by its owner
    before the gateway's config names it (event sockets here, HTTP ports in the fleet)."""
    import zmq
    import zmq.asyncio

    n = streams.n_workers
    page = work / "metrics.txt"
    page.write_text(idle_engine_page())
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * n + 64)
    socks = []
    fleet_log = work / f"fleet-{n}.log"
    fleet = start([sys.executable, "-c", FLEET, str(n), str(page)], fleet_log,
                  {"PYTHONPATH": str(Path(__file__).resolve().parent)})
    gw = None
    try:
        event_ports = []
        for _ in range(n):
            s = ctx.socket(zmq.XPUB)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            event_ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
            socks.append(s)

        async def fleet_ports() -> bool:
            return fleet_log.read_text().startswith("ports ") and fleet_log.read_text().endswith("\n")

        await wait_until(fleet_ports, 120, "the fake worker fleet")
        http_ports = [int(x) for x in fleet_log.read_text().split()[1].split(",")]
        gw_port = free_ports(1)[0]
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port},
               "models": [{"name": MODEL, "tokenizer": str(TINY), "block_size": BLOCK_SIZE}],
               "index": {"backend": "memory"},
               "workers": [{"id": w, "url": f"http://127.0.0.1:{hp}", "model": MODEL,
                            "events": f"tcp://127.0.0.1:{ep}"}
                           for w, hp, ep in zip(streams.worker_ids(), http_ports, event_ports)]}
        path = work / f"gw-{n}.json"
        path.write_text(json.dumps(cfg))
        log = work / f"gw-{n}.log"
        gw = start([sys.executable, "-m", "kvroute", "serve", "--config", str(path)], log)

        async def ready() -> bool:
            async with httpx.AsyncClient(timeout=5) as client:
                return (await client.get(f"http://127.0.0.1:{gw_port}/health/ready")).status_code == 200

        try:
            await wait_until(ready, 180, "the gateway")
        except RuntimeError:
            return {"error": "gateway never ready", "log_tail": log.read_text()[-2000:] if log.exists() else ""}
        out: dict[str, Any] = {"rss_start_bytes": tree_rss_bytes(gw.pid)}
        try:
            out.update(await gateway_phases(streams, socks, gw_port, gw.pid, texts, idle_s, concurrency, 900))
        except RuntimeError as exc:
            out["error"] = str(exc)
            out["log_tail"] = log.read_text()[-1500:]
        return out
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        if gw is not None:
            stop(gw)
        stop(fleet)


# ---- main --------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 and 32 workers of 2,560 blocks, short phases (well under a minute)")
    ap.add_argument("--workers", default=None, help="comma-separated worker counts (default 64,256,1024)")
    ap.add_argument("--capacity-blocks", type=int, default=None,
                    help="GPU blocks of 16 tokens per worker (default 4096; quick 2560)")
    ap.add_argument("--index", default="memory", choices=sorted(INDEXES))
    ap.add_argument("--flow-events-per-s", type=float, default=20_000.0,
                    help="event rate applied while lookups are timed")
    ap.add_argument("--lookup-s", type=float, default=None, help="seconds of lookups (default 5; quick 0.5)")
    ap.add_argument("--repeats", type=int, default=None, help="direct ingest runs per N (default 3; quick 1)")
    ap.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the in-process ingest and lookups (default on)")
    ap.add_argument("--gateway", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure a real kvroute serve (default on)")
    ap.add_argument("--requests", type=int, default=None, help="routed requests per N (default 200; quick 20)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=None, help="idle CPU window (default 10; quick 1)")
    ap.add_argument("--requests-per-s-per-worker", type=float, default=1.0,
                    help="assumed request rate of one worker, for the largest-cluster estimate")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--logs", type=Path, default=None,
                    help="keep the gateway's and the fleet's logs here (default: a temporary folder, removed)")
    args = ap.parse_args()
    q = args.quick
    counts = [int(x) for x in (args.workers or ("8,32" if q else "64,256,1024")).split(",")]
    capacity = args.capacity_blocks or (2560 if q else 4096)
    lookup_s = args.lookup_s if args.lookup_s is not None else (0.5 if q else 5.0)
    repeats = args.repeats or (1 if q else 3)
    n_requests = args.requests if args.requests is not None else (20 if q else 200)
    idle_s = args.idle_s if args.idle_s is not None else (1.0 if q else 10.0)
    make_index = INDEXES[args.index]

    words = OneTokenWords(PromptTokenizer(str(TINY)))
    word_ids = [words.tokenizer.encode_text(" " + w, False)[0] for w in words.words]
    word_of = dict(zip(word_ids, words.words))
    prefix = words.tokenizer.encode_text("", True)
    tokens = scale.TraceTokens(word_ids, prefix)
    rows = read_trace(DEFAULT_TRACE)
    figures = new_figures("bench_scale", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    figures["settings_used"] = {"workers": counts, "capacity_blocks": capacity, "block_size": BLOCK_SIZE,
                                "trace": DEFAULT_TRACE.name, "trace_rows": len(rows), "routing": "prefix",
                                "lookup_s": lookup_s, "repeats": repeats, "requests": n_requests, "idle_s": idle_s,
                                "cpus": os.cpu_count()}
    print(f"machine: {os.cpu_count()} CPUs; trace {DEFAULT_TRACE.name} ({len(rows)} rows, repeated); "
          f"{capacity} blocks of {BLOCK_SIZE} tokens per worker; index {args.index}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            tmp = str(args.logs)
        for n in counts:
            streams = scale.build_streams(rows, tokens, n, capacity, BLOCK_SIZE)
            fill_reqs = streams.fill_requests
            r: dict[str, Any] = {
                "workers": n, "capacity_blocks": capacity, "generate_s": round(streams.generate_s, 2),
                "requests": fill_reqs, "trace_copies": -(-fill_reqs // len(rows)),
                "batches": streams.fill_batches, "events": streams.fill_events, "blocks": streams.fill_blocks,
                "events_per_request": round(streams.fill_events / fill_reqs, 2),
                "blocks_per_request": round(streams.fill_blocks / fill_reqs, 2),
                # the flow part: pools already full, every stored block evicts one (steady state)
                "steady_events_per_request": round((sum(w.events for w in streams.workers) - streams.fill_events)
                                                   / max(1, len(streams.requests) - fill_reqs), 2),
                "steady_blocks_per_request": round((sum(w.blocks_stored + w.blocks_removed for w in streams.workers)
                                                    - streams.fill_blocks) / max(1, len(streams.requests) - fill_reqs), 2),
                "prefix_hit_rate": round(sum(w.hit_blocks for w in streams.workers)
                                         / max(1, sum(w.prompt_blocks for w in streams.workers)), 4)}
            print(f"N={n}: {fill_reqs} requests, {streams.fill_events} events, {streams.fill_blocks} blocks "
                  f"generated in {streams.generate_s:.1f} s", flush=True)
            if args.direct:
                r["direct"] = asyncio.run(measure_direct(streams, make_index, args.flow_events_per_s, lookup_s, repeats))
                print(f"N={n}: direct {json.dumps(r['direct'])}", flush=True)
            if args.gateway:
                sample = [streams.requests[i] for i in range(0, fill_reqs, max(1, fill_reqs // n_requests))]
                sample = [s for s in sample if s.copy >= 0][:n_requests]
                texts = [words.text([word_of[t] for t in s.prompt_ids[len(prefix):]]) for s in sample]
                gc.collect()
                r["gateway"] = asyncio.run(measure_gateway(streams, Path(tmp), texts, idle_s, args.concurrency))
                print(f"N={n}: gateway {json.dumps(r['gateway'])}", flush=True)
            if args.direct:
                runs = r["direct"]["ingest_runs"]
                cpu_per_event = sum(x["cpu_s"] for x in runs) / sum(x["events"] for x in runs)
                r["largest_cluster_direct"] = round(scale.largest_cluster(
                    cpu_per_event, r["steady_events_per_request"], args.requests_per_s_per_worker), 1)
            gi = (r.get("gateway") or {}).get("ingest") or {}
            if gi.get("cpu_s"):
                rate = args.requests_per_s_per_worker
                r["largest_cluster_gateway"] = round(scale.largest_cluster(
                    gi["cpu_s"] / gi["events"], r["steady_events_per_request"], rate), 1)
                per_event = 1.0 / gi["events_per_cpu_s_less_idle"]
                r["largest_cluster_gateway_ingest_only"] = round(scale.largest_cluster(
                    per_event, r["steady_events_per_request"], rate), 1)
                # one core = N x (ingest of one worker's events + following one worker when idle)
                idle_per_worker = r["gateway"]["idle_cpu_ms_per_s"] / 1e3 / n
                r["largest_cluster_gateway_with_idle"] = round(
                    1.0 / (per_event * r["steady_events_per_request"] * rate + idle_per_worker), 1)
            results.append(r)
            del streams
            gc.collect()
    add_table(figures, "scale", results)
    print_table(results, args.requests_per_s_per_worker)
    if args.out:
        write_json(figures, args.out)
        print(f"figures: {args.out}", file=sys.stderr)


def print_table(results: list[dict[str, Any]], rps: float) -> None:
    """The figures of ``results`` (rows of table ``scale``) as a text table on stdout."""
    print(f"\n{'N':>5} {'entries':>9} {'B/ent idx':>9} {'B/ent all':>9} {'state MB':>8} {'events/cpu-s':>20} "
          f"{'blocks/cpu-s':>20} {'lookup p50/p99 ms':>17} {'2048-blk p50/p99':>16} {'gw ev/cpu-s':>11} "
          f"{'gw B/ent':>8} {'gw idle ms/s':>12} {'gw ms/req':>9} {'max N':>11}")
    for r in results:
        d = r.get("direct") or {"entries": 0, "index_heap_bytes_per_entry": 0, "ingest_state_bytes_per_entry": 0,
                                "ingest_state_bytes": 0, "ingest_runs": [], "lookups": {}}
        runs = d["ingest_runs"]
        ev = "/".join(f"{x['events_per_cpu_s'] / 1e3:.0f}k" for x in runs)
        bl = "/".join(f"{x['blocks_per_cpu_s'] / 1e3:.0f}k" for x in runs)
        tr = d["lookups"].get("trace", {})
        lg = d["lookups"].get("long", {})
        g = r.get("gateway") or {}
        gi = g.get("ingest") or {}
        req = g.get("requests") or {}
        lookup = f"{tr.get('p50_ms', 0):.3f}/{tr.get('p99_ms', 0):.3f}"
        long_ = f"{lg.get('p50_ms', 0):.2f}/{lg.get('p99_ms', 0):.2f}"
        max_n = f"{r.get('largest_cluster_gateway_ingest_only', r.get('largest_cluster_direct', 0))}"
        if "largest_cluster_gateway_with_idle" in r:
            max_n += f"/{r['largest_cluster_gateway_with_idle']}"
        print(f"{r['workers']:>5} {d['entries']:>9} {d['index_heap_bytes_per_entry']:>9} "
              f"{d['ingest_state_bytes_per_entry']:>9} {d['ingest_state_bytes'] / 2**20:>8.0f} {ev:>20} {bl:>20} "
              f"{lookup:>17} {long_:>16} {gi.get('events_per_cpu_s_less_idle', 0):>11.0f} "
              f"{gi.get('rss_bytes_per_entry', 0):>8} {g.get('idle_cpu_ms_per_s', 0):>12} "
              f"{req.get('cpu_ms_per_request_less_idle', 0):>9} {max_n:>11}")
    print(f"B/ent idx: the index's Python heap per (block, worker) entry; all: translators + index (RSS); "
          f"gw: kvroute serve (events/cpu-s and ms/req less its idle CPU). max N: workers whose events one core "
          f"ingests at {rps} request/s per worker (the gateway's rate when measured, else the direct path's; "
          f"/ with the idle cost of following them)")


if __name__ == "__main__":
    main()
