"""The offload agent process: an :class:`kvcore.kv_events.EventIngestor` writing a Redis index,
and, with ``--tier-socket``, the owner of its worker's tiers (:mod:`offload_agent.tier_service`:
CPU tier in shared memory, SSD folder, peer pull), until SIGINT/SIGTERM. Logs its state every ``STATUS_EVERY_S`` seconds; on a clean stop it purges its
worker's entries (the index may under-report, never over-report). It refuses to run against an
index of another block-key encoding version (:class:`kvcore.index.errors.IndexEncodingMismatch`):
at start-up, or as soon as an index that was down at start-up answers."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from kvcore.index.errors import IndexEncodingMismatch, IndexUnavailable
from kvcore.index.redis import RedisIndex
from kvcore.kv_events import EventIngestor
from offload_agent.tier_service import TierService

log = logging.getLogger("kvroute.agent")
STATUS_EVERY_S = 30.0
CHECK_EVERY_S = 1.0  # how often the main loop looks for an encoding mismatch found by the index
# Redis command timeout for the agent. Longer than the gateway's (which falls back to load-only
# routing fast): a republish writes the worker's whole state in one script call, and a timeout
# shorter than that call on a busy host would make the agent republish over and over.
REDIS_TIMEOUT_S = 5.0


def check_args(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work, or None."""
    if not args.index.startswith(("redis://", "rediss://", "unix://")):
        return (f"--index {args.index!r}: the agent writes a shared index, so it needs a Redis URL "
                "(redis://host:port/db); an in-memory index lives in the gateway (index: memory there "
                "subscribes to the events itself)")
    if args.block_size < 1:
        return f"--block-size must be >= 1, got {args.block_size}"
    if not args.events.startswith(("tcp://", "ipc://")):
        return f"--events {args.events!r}: expected tcp://host:port"
    if args.heartbeat_ttl_s <= 0:
        return f"--heartbeat-ttl-s must be > 0, got {args.heartbeat_ttl_s}"
    tier_args = (args.cpu_tier_bytes, args.ssd_tier_dir, args.serve_peers, args.tier_shm)
    if any(tier_args) and not args.tier_socket:
        return "--cpu-tier-bytes, --ssd-tier-dir, --tier-shm and --serve-peers need --tier-socket"
    if args.tier_socket:
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


def tier_service(args: argparse.Namespace, index: RedisIndex) -> TierService | None:
    """The tiers' owner for ``--tier-socket`` (None without it)."""
    if not args.tier_socket:
        return None
    secret = os.environ[args.peer_secret_env].encode() if args.peer_secret_env else None
    return TierService(
        args.worker_id, args.model, args.block_size, args.tier_socket,
        args.tier_shm or f"/dev/shm/kvroute-tier-{args.worker_id}", args.cpu_tier_bytes, index,
        ssd_dir=args.ssd_tier_dir, ssd_tier_bytes=args.ssd_tier_bytes,
        serve=parse_host_port(args.serve_peers) if args.serve_peers else None, advertise=args.advertise,
        secret=secret, peer_pull=args.peer_pull, remove_on_exit=args.remove_tiers_on_exit)


async def run_agent(args: argparse.Namespace) -> int:
    """Run until a stop signal; returns the exit status: 0, or 1 when the index holds block keys of
    another encoding version (logged with what to do). Never fails for an unreachable Redis or
    vLLM (it waits for both)."""
    index = RedisIndex(args.index, heartbeat_ttl_s=args.heartbeat_ttl_s, socket_timeout_s=REDIS_TIMEOUT_S)
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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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
    return status


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvroute agent``; returns the exit status (2 for bad arguments, 1 for an index of
    another block-key encoding version)."""
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = check_args(args)
    if problem:
        print(f"kvroute agent: error: {problem}", file=sys.stderr)
        return 2
    return asyncio.run(run_agent(args))
