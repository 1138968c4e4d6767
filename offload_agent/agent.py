"""The offload agent process, until SIGINT/SIGTERM, in one of two modes by its ``--index``:

- a Redis URL: an :class:`kvcore.kv_events.EventIngestor` writing the worker's KV events into
  the Redis index and, with ``--tier-socket``, the owner of its worker's tiers
  (:mod:`offload_agent.tier_service`: CPU tier in shared memory, SSD folder, peer pull), whose
  peer state goes out with the heartbeats. On a clean stop it purges its worker's entries (the
  index may under-report, never over-report). It refuses to run against an index of another
  block-key encoding version (:class:`kvcore.index.errors.IndexEncodingMismatch`): at start-up,
  or as soon as an index that was down at start-up answers.
- the gateway's URL (``http://host:port``, the gateway holding the embedded index): only the
  owner of the tiers (``--tier-socket`` required). It ingests no events (the gateway subscribes
  to the worker's KV events itself); it locates peers by asking the gateway
  (:class:`kvcore.index.gateway.GatewayIndex`, the admin token from ``--admin-token-env``) and
  publishes its peer state there every ``min(1, ttl / 3)`` seconds, live for ``--heartbeat-ttl-s``
  (``PUT /admin/workers/{id}/peer``; withdrawn at a clean stop). A gateway not up yet (``kvroute
  up`` starts it after the workers) is waited for quietly: one log line per outage. It stops
  (status 1) when the gateway computes block keys of another encoding version.

Logs its state every ``STATUS_EVERY_S`` seconds."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from kvcore.index.errors import IndexEncodingMismatch, IndexUnavailable
from kvcore.index.gateway import GatewayIndex, GatewayRefused, is_gateway_url
from kvcore.index.redis import RedisIndex
from kvcore.index.redis_cluster import RedisClusterIndex
from kvcore.kv_events.ingest import EventIngestor
from offload_agent.tier_service import TierService

log = logging.getLogger("kvroute.agent")
STATUS_EVERY_S = 30.0
CHECK_EVERY_S = 1.0  # how often the main loop looks for an encoding mismatch found by the index
# Redis command timeout for the agent. Longer than the gateway's (which falls back to load-only
# routing fast): a republish writes the worker's whole state in one script call, and a timeout
# shorter than that call on a busy host would make the agent republish over and over.
REDIS_TIMEOUT_S = 5.0
PUBLISH_EVERY_S = 1.0  # longest interval between two peer-state publishes to the gateway
WITHDRAW_TIMEOUT_S = 2.0  # a clean stop waits this long at most for the gateway to drop the state


def check_args(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work, or None."""
    if is_gateway_url(args.index):
        if not args.tier_socket:
            return (f"--index {args.index}: with the gateway's index the agent only owns the worker's tiers "
                    "(the gateway subscribes to the KV events itself), so it needs --tier-socket")
        if args.events or args.replay:
            return (f"--index {args.index}: leave out --events and --replay: the gateway holding the index "
                    "subscribes to the worker's KV events itself")
        if not os.environ.get(args.admin_token_env):
            return f"--admin-token-env {args.admin_token_env}: that variable is not set (the gateway's admin token)"
    elif not args.index.startswith(("redis://", "rediss://", "unix://")):
        return (f"--index {args.index!r}: expected a Redis URL (redis://host:port/db), which the agent writes "
                "the worker's KV events into, or the URL of a gateway holding the index (http://host:port)")
    elif args.events is None:
        return "--events is required with a Redis index"
    if args.block_size < 1:
        return f"--block-size must be >= 1, got {args.block_size}"
    if args.events is not None and not args.events.startswith(("tcp://", "ipc://")):
        return f"--events {args.events!r}: expected tcp://host:port"
    if args.heartbeat_ttl_s <= 0:
        return f"--heartbeat-ttl-s must be > 0, got {args.heartbeat_ttl_s}"
    tier_args = (args.cpu_tier_bytes, args.ssd_tier_dir, args.serve_peers, args.tier_shm)
    if any(tier_args) and not args.tier_socket:
        return "--cpu-tier-bytes, --ssd-tier-dir, --tier-shm and --serve-peers need --tier-socket"
    if args.tier_socket:
        if getattr(args, "peer_pull_max_bytes", None) is not None and args.peer_pull_max_bytes < 1:
            return f"--peer-pull-max-bytes must be > 0, got {args.peer_pull_max_bytes}"
        if args.cpu_tier_bytes <= 0:
            return "--tier-socket needs --cpu-tier-bytes > 0"
        if (args.ssd_tier_dir is None) != (args.ssd_tier_bytes <= 0):
            return "--ssd-tier-dir and --ssd-tier-bytes (> 0) go together"
        for flag in ("serve_peers", "advertise"):
            value = getattr(args, flag)
            if value is not None and parse_host_port(value) is None:
                return f"--{flag.replace('_', '-')} {value!r}: expected HOST:PORT"
        if args.peer_secret_env and not os.environ.get(args.peer_secret_env):
            return f"--peer-secret-env {args.peer_secret_env}: that variable is not set"
    return None


def parse_host_port(value: str) -> tuple[str, int] | None:
    """``"host:port"`` as ``(host, port)`` (port 0..65535), else None."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return None
    return host.strip("[]"), int(port)


def tier_service(args: argparse.Namespace, index: RedisIndex | GatewayIndex) -> TierService | None:
    """The tiers' owner for ``--tier-socket`` (None without it); ``index``: where it locates peers."""
    if not args.tier_socket:
        return None
    secret = os.environ[args.peer_secret_env].encode() if args.peer_secret_env else None
    return TierService(
        args.worker_id, args.model, args.block_size, args.tier_socket,
        args.tier_shm or f"/dev/shm/kvroute-tier-{args.worker_id}", args.cpu_tier_bytes, index,
        ssd_dir=args.ssd_tier_dir, ssd_tier_bytes=args.ssd_tier_bytes,
        serve=parse_host_port(args.serve_peers) if args.serve_peers else None, advertise=args.advertise,
        secret=secret, peer_pull=args.peer_pull, remove_on_exit=args.remove_tiers_on_exit,
        **({"peer_pull_max_bytes": args.peer_pull_max_bytes} if getattr(args, "peer_pull_max_bytes", None) else {}))


async def run_agent(args: argparse.Namespace) -> int:
    """Run until a stop signal; returns the exit status: 0, or 1 when the index holds block keys of
    another encoding version (logged with what to do). Never fails for an unreachable Redis or
    vLLM (it waits for both)."""
    if is_gateway_url(args.index):
        return await run_gateway_agent(args)
    index_cls = RedisClusterIndex if getattr(args, "index_cluster", False) else RedisIndex
    index = index_cls(args.index, heartbeat_ttl_s=args.heartbeat_ttl_s, socket_timeout_s=REDIS_TIMEOUT_S)
    try:
        await index.open()
    except IndexEncodingMismatch as exc:
        log.error("not starting: %s", exc)
        await index.close()
        return 1
    except IndexUnavailable as exc:
        log.info("index not reachable yet (the agent waits for it; the encoding is checked then): %s", exc)
    tiers = tier_service(args, index)
    ingestor = EventIngestor(args.worker_id, args.events, args.replay, index, args.model, args.block_size,
                             topic=args.topic.encode(), heartbeat_ttl_s=args.heartbeat_ttl_s,
                             extra_state=tiers.state if tiers is not None else None)
    stop = _stop_event_on_signals()
    loop = asyncio.get_running_loop()
    if tiers is not None:
        await tiers.start()
    await ingestor.start()
    log.info("agent for worker %s: events %s, replay %s, index %s, model %s, block size %d",
             args.worker_id, args.events, args.replay, args.index, args.model, args.block_size)
    status = 0
    next_state_at = loop.time() + STATUS_EVERY_S
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), CHECK_EVERY_S)
            except asyncio.TimeoutError:
                pass
            if index.encoding_error is not None:  # found once a Redis that was down answered
                log.error("stopping: %s", index.encoding_error)
                status = 1
                break
            if loop.time() >= next_state_at:
                next_state_at += STATUS_EVERY_S
                log.info("state %s", json.dumps(ingestor.state(), sort_keys=True))
    finally:
        log.info("stopping; final state %s", json.dumps(ingestor.state(), sort_keys=True))
        await ingestor.stop(purge=status == 0)
        if tiers is not None:
            await tiers.stop()
        await index.close()
        _ignore_stop_signals()
    return status


class StatePublisher:
    """Publishes ``state()`` (the tiers' state) as ``worker_id``'s to the gateway, live there for
    ``ttl_s``; logs once per change between reachable and not (quiet while the gateway is not
    up yet)."""

    def __init__(self, index: GatewayIndex, worker_id: str, state, ttl_s: float) -> None:
        self.index, self.worker_id, self.state, self.ttl_s = index, worker_id, state, ttl_s
        self.published = 0
        self.failures = 0
        self._ok: bool | None = None  # None: never tried
        self._refused_logged = False

    async def publish(self) -> bool:
        """One publish; whether the gateway took it."""
        try:
            got = await self.index.publish_state(self.worker_id, self.state(), self.ttl_s)
        except IndexUnavailable as exc:
            self.failures += 1
            if isinstance(exc, GatewayRefused):
                if not self._refused_logged:
                    log.error("%s (retrying)", exc)
                self._refused_logged = True
            elif self._ok is None:
                log.info("gateway %s not answering yet; the peer state goes out once it does (%s)",
                         self.index.url, exc)
            elif self._ok:
                log.warning("publishing the peer state to gateway %s failed; retrying: %s", self.index.url, exc)
            self._ok = False
            return False
        self.published += 1
        self._refused_logged = False
        if not self._ok:
            log.info("peer state of worker %s published to gateway %s (registered there: %s, live %g s "
                     "after each publish)", self.worker_id, self.index.url, got.get("registered"), self.ttl_s)
        self._ok = True
        return True


async def run_gateway_agent(args: argparse.Namespace) -> int:
    """The agent with the gateway as its index (module docstring) until a stop signal; returns
    the exit status: 0, or 1 when the gateway's block-key encoding differs from this process's."""
    index = GatewayIndex(args.index, os.environ.get(args.admin_token_env))
    tiers = tier_service(args, index)
    assert tiers is not None  # check_args: --tier-socket is required with a gateway index
    publisher = StatePublisher(index, args.worker_id, tiers.state, args.heartbeat_ttl_s)
    stop = _stop_event_on_signals()
    loop = asyncio.get_running_loop()
    await tiers.start()
    log.info("agent for worker %s: owns its tiers; the gateway %s holds the index (it ingests the worker's "
             "KV events) and locates peers; model %s, block size %d", args.worker_id, args.index, args.model,
             args.block_size)
    status = 0
    every_s = max(0.05, min(args.heartbeat_ttl_s / 3, PUBLISH_EVERY_S))
    next_state_at = loop.time() + STATUS_EVERY_S
    try:
        while not stop.is_set():
            await publisher.publish()
            if index.encoding_error is not None:
                log.error("stopping: %s", index.encoding_error)
                status = 1
                break
            if loop.time() >= next_state_at:
                next_state_at += STATUS_EVERY_S
                log.info("state %s", json.dumps({**tiers.state(), "published": publisher.published,
                                                 "publish_failures": publisher.failures}, sort_keys=True))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
    finally:
        log.info("stopping; final state %s", json.dumps(tiers.state(), sort_keys=True))
        if publisher.published:
            try:  # peers stop asking for this worker's blocks at once, not after the TTL
                await asyncio.wait_for(index.withdraw_state(args.worker_id), WITHDRAW_TIMEOUT_S)
            except (IndexUnavailable, asyncio.TimeoutError) as exc:
                log.info("could not withdraw the peer state (it expires in %g s): %s", args.heartbeat_ttl_s, exc)
        await tiers.stop()
        await index.close()
        _ignore_stop_signals()
    return status


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_event_on_signals() -> asyncio.Event:
    """An event the running loop sets on SIGINT or SIGTERM (a second one while stopping is a
    no-op: the stop is already under way)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    return stop


def _ignore_stop_signals() -> None:
    """Once the stop is done: ignore SIGINT/SIGTERM for the rest of the process. Closing the
    loop would put back the default handlers, and a stop signal sent twice (``kill`` of the
    process group under ``timeout``, which forwards it again) would then end the process by
    the signal, exit status -15, after a clean stop."""
    loop = asyncio.get_running_loop()
    for sig in _STOP_SIGNALS:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvroute agent``; returns the exit status (2 for bad arguments, 1 for an index or
    gateway of another block-key encoding version)."""
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = check_args(args)
    if problem:
        print(f"kvroute agent: error: {problem}", file=sys.stderr)
        return 2
    return asyncio.run(run_agent(args))
