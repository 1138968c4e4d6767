"""Soak: one gateway (`kvroute serve`, kv_aware, exact tokenization, in-memory index) in front of 2
`kvroute sim` workers takes N = 1000 concurrent streaming chat requests (the full figure: it fits in
well under 2 minutes on a 2-core machine). Every one answers 200 and ends with ``data: [DONE]``
(no error event); then the gateway's per-worker in-flight counts go back to 0, its open file
descriptors back to within a few of the baseline (idle upstream connections close after the
connector's keep-alive), and the process is alive. RSS before/peak/after is printed, never asserted
(the machine is shared; figures at scale are in benchmarks/bench_resilience.py).

Then the /metrics series count does not grow with request content: after one warm-up round of each
kind (streamed and non-streamed chats, unknown model -> 404, bad bodies -> 400), many requests with
distinct ``x-request-id`` values, ``user`` fields, unknown model names and bad bodies leave the
number of series (non-comment lines) unchanged: labels come only from bounded sets (worker ids,
statuses, policy reasons, configured model names), never from what a client sends.

Everything waits on conditions; every client call is bounded by a timeout so a hang fails the test
instead of stalling it.
"""
from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import httpx
import orjson
import psutil
import pytest

from lab.process_sampler import Sampler

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, serve_gateway, wait_http, wait_until

BLOCK = 32
N_SOAK = 1000
CLIENT_TIMEOUT_S = 120  # bound of one soak request (a hang fails, it never stalls the run)
PROBE_INTERVAL_S = 2.0  # health probe and load scrape, each, per worker
# The gateway's upstream pool (router/relay/upstream.py: aiohttp, keepalive_timeout=4 s) hands out its oldest
# idle connection first, so after a burst the periodic probes (2 calls per worker every 2 s) keep up
# to ~1 call/s x 4 s = 4 idle connections per worker open for good; that, not a leak, is the margin.
UPSTREAM_KEEPALIVE_S = 4
FD_MARGIN = 2 * (int(2 / PROBE_INTERVAL_S * UPSTREAM_KEEPALIVE_S) + 1) + 2
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
WORDS = "oak elm ash fir yew pine palm teak birch cedar maple alder".split()
SYSTEM = " ".join(random.Random(12).choice(WORDS) for _ in range(120))  # a few blocks, shared by all


def chat(user_text: str, stream: bool = True, system: bool = True, **extra) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    return {"model": "tiny", "messages": messages + [{"role": "user", "content": user_text}],
            "max_tokens": 3, "stream": stream, **extra}


class Gateway:
    def __init__(self, base: str, proc: Proc, sims: list[Proc]) -> None:
        self.base = base
        self.port = int(base.rsplit(":", 1)[1])
        self.proc = proc
        self.sims = sims

    @property
    def process(self) -> psutil.Process:
        """The gateway itself (Proc runs it under ``timeout``)."""
        kids = psutil.Process(self.proc.popen.pid).children()
        assert len(kids) == 1, kids
        return kids[0]

    def workers(self) -> dict[str, dict]:
        r = httpx.get(self.base + "/admin/workers", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return {w["id"]: w for w in r.json()["workers"]}

    def client_connections(self) -> int:
        """Client connections the gateway still holds (its listening socket aside)."""
        return sum(1 for c in self.process.net_connections("tcp")
                   if c.laddr and c.laddr.port == self.port and c.status != psutil.CONN_LISTEN)

    def series(self) -> list[str]:
        text = httpx.get(self.base + "/metrics", timeout=30).text
        return [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln and not ln.startswith("#")]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_model) -> Gateway:
    log_dir = tmp_path_factory.mktemp("soak")
    *sim_ports, gw_port = free_ports(3)
    started: list[Proc] = []
    try:
        sims = []
        for i, port in enumerate(sim_ports):
            p = Proc(f"w{i}", kvroute_argv(
                "sim", "--model", str(tiny_model), "--served-model-name", "tiny", "--host", "127.0.0.1",
                "--port", str(port), "--block-size", str(BLOCK), "--num-gpu-blocks-override", "4096",
                "--max-num-seqs", "512", "--enable-prompt-tokens-details", "--speedup", "100", "--seed", str(i)),
                log_dir)
            started.append(p)
            sims.append(p)
        for p, port in zip(sims, sim_ports):
            wait_http(f"http://127.0.0.1:{port}/health", p, timeout_s=180)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port}, "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
               "index": {"backend": "memory"},
               "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{port}", "model": "tiny"}
                           for i, port in enumerate(sim_ports)],
               "policy": {"name": "kv_aware"}, "load_scrape": {"interval_s": PROBE_INTERVAL_S},
               "health": {"interval_s": PROBE_INTERVAL_S}}
        base, _, proc = serve_gateway(cfg, log_dir, started)
        yield Gateway(base, proc, sims)
    finally:
        for p in reversed(started):
            p.stop()


def wait_idle(gw: Gateway) -> dict[str, dict]:
    """Wait until the gateway counts no request in flight on any worker; its workers then."""
    def idle() -> dict[str, dict] | None:
        ws = gw.workers()
        return ws if all(w["in_flight"] == 0 for w in ws.values()) else None

    return wait_until(idle, timeout_s=60, what="gateway in_flight back to 0 for every worker")




async def _one_stream(session: aiohttp.ClientSession, url: str, i: int) -> str | None:
    """One streamed chat; None when it answered 200 and ended with ``data: [DONE]`` and no error
    event, else what went wrong."""
    body = orjson.dumps(chat(f"soak question {i}"))
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json",
                                                          "x-request-id": f"soak-{i}"}) as r:
            raw = await r.read()
            if r.status != 200:
                return f"{i}: status {r.status}: {raw[:200]!r}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"{i}: {type(exc).__name__}: {exc}"
    events = [e for e in raw.split(b"\n\n") if e]
    if not events or events[-1] != b"data: [DONE]" or not raw.endswith(b"\n\n"):
        return f"{i}: stream did not end with [DONE]: {raw[-200:]!r}"
    if any(b'"error"' in e for e in events[:-1]):
        return f"{i}: error event: {raw[-300:]!r}"
    if len(events) < 2:
        return f"{i}: no content event: {raw!r}"
    return None


async def _soak(base: str, n: int) -> list[str]:
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        results = await asyncio.gather(*[_one_stream(session, base + "/v1/chat/completions", i) for i in range(n)])
    return [r for r in results if r is not None]


def test_concurrent_streams_all_complete_and_resources_come_back(gateway):
    wait_idle(gateway)
    gp = gateway.process
    fds_before, rss_before = gp.num_fds(), gp.memory_info().rss
    t0 = time.monotonic()
    with Sampler(gp) as sampler:
        errors = asyncio.run(_soak(gateway.base, N_SOAK))
    wall = time.monotonic() - t0
    assert errors == [], f"{len(errors)} of {N_SOAK} failed, first: {errors[:5]}"
    ws = wait_idle(gateway)
    assert set(ws) == {"w0", "w1"} and all(w["healthy"] for w in ws.values())
    # every client connection is closed (the soak's client has gone) ...
    wait_until(lambda: gateway.client_connections() == 0, timeout_s=60, what="client connections closed")
    # ... and idle upstream connections close after the pool's keep-alive, but for the probes' few
    wait_until(lambda: gp.num_fds() <= fds_before + FD_MARGIN, timeout_s=60,
               what=f"gateway fds back to within {FD_MARGIN} of {fds_before}")
    fds_after = gp.num_fds()
    assert gp.is_running() and gp.status() != psutil.STATUS_ZOMBIE and gateway.proc.alive()
    assert all(p.alive() for p in gateway.sims)
    mib = 1024 * 1024
    print(f"\nsoak: {N_SOAK} streams in {wall:.1f} s; gateway RSS before {rss_before / mib:.1f} MiB, "
          f"peak {sampler.peak_rss / mib:.1f} MiB, after {gp.memory_info().rss / mib:.1f} MiB; "
          f"fds before {fds_before}, peak {sampler.peak_fds}, after {fds_after}")


# ---- /metrics cardinality -----------------------------------------------------------------------
BAD_BODIES = [b"", b"{not json", b"[1, 2]", b'"a string"', b"null"]


async def _content_round(base: str, n: int, tag: str) -> dict[int, int]:
    """``n`` of each kind, each with its own request id, user, model name or broken body; returns
    the count per status. Statuses are asserted by the caller."""
    url = base + "/v1/chat/completions"
    rnd = random.Random(tag)
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(16)
    timeout = aiohttp.ClientTimeout(total=60)

    async def send(data: bytes, headers: dict[str, str]) -> None:
        async with sem, session.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as r:
            raw = await r.read()
            if r.status == 200 and b"data: " in raw[:6]:
                assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
            statuses[r.status] = statuses.get(r.status, 0) + 1

    jobs = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        for i in range(n):
            rid = f"{tag}-{i}-{rnd.getrandbits(64):x}"
            user = f"user-{tag}-{i}-{rnd.getrandbits(32):x}"
            # short distinct prompts (under one block): no prefix to match, so the policy's reason
            # label is the same for all of them, whatever the cluster's cache holds
            text = f"q {i} {rnd.choice(WORDS)}"
            jobs.append(send(orjson.dumps(chat(text, stream=i % 2 == 0, system=False, user=user)),
                             {"x-request-id": rid}))
            jobs.append(send(orjson.dumps({**chat("q", stream=i % 2 == 1), "model": f"no-such-model-{rid}"}),
                             {"x-request-id": rid + "-m"}))
            jobs.append(send(BAD_BODIES[i % len(BAD_BODIES)] + rid.encode() * (i % 2), {"x-request-id": rid + "-b"}))
            jobs.append(send(orjson.dumps({"model": "tiny", "messages": f"not a list {rid}", "user": user}),
                             {"x-request-id": rid + "-t"}))
        await asyncio.gather(*jobs)
    return statuses


def learn_prefill_rates(gw: Gateway) -> None:
    """State, not content: a worker's learned prefill rate is a series of its own once the gateway
    has seen a few first tokens of distinct sizes from it (router/estimates/prefill_rate.py), so streams of
    varied lengths go out until every worker has one (the soak above does this when it runs)."""
    rnd = random.Random(5)

    async def batch() -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one() -> None:
                text = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 400)))
                async with session.post(gw.base + "/v1/chat/completions", json=chat(text)) as r:
                    assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            await asyncio.gather(*[one() for _ in range(8)])

    def learned() -> bool:
        have = {s for s in gw.series() if s.startswith("kvroute_worker_prefill_ms_per_token{")}
        if len(have) == len(gw.sims):
            return True
        asyncio.run(batch())
        return False

    wait_until(learned, timeout_s=60, what="every worker's prefill rate learned")


def test_metrics_series_do_not_grow_with_request_content(gateway):
    learn_prefill_rates(gateway)
    warm = asyncio.run(_content_round(gateway.base, len(BAD_BODIES) * 2, "warm"))
    assert warm == {200: len(BAD_BODIES) * 2, 404: len(BAD_BODIES) * 2, 400: len(BAD_BODIES) * 4}, warm
    wait_idle(gateway)
    baseline = gateway.series()
    got = asyncio.run(_content_round(gateway.base, 200, "many"))
    assert got == {200: 200, 404: 200, 400: 400}, got
    wait_idle(gateway)
    after = gateway.series()
    new = sorted(set(after) - set(baseline))
    assert len(after) == len(baseline), f"series grew by {len(after) - len(baseline)}: {new[:20]}"
    assert not any("no-such-model" in s or "user-" in s or "many-" in s for s in after)
    assert gateway.process.is_running()
