"""Redis index with a local mirror: lookups answered in this process, Redis stays the truth.

:class:`RedisMirrorIndex` is a :class:`kvcore.index.redis.RedisIndex` (same writes, same schema,
same agents) that also keeps a copy of the whole index in a :class:`kvcore.index.memory.MemoryIndex`
and answers :meth:`~RedisMirrorIndex.match` and :meth:`~RedisMirrorIndex.stats` from it, with no
Redis round trip. Config: ``index: {backend: redis, url: redis://..., mirror: true}`` (the default;
``mirror: false`` is the plain :class:`RedisIndex`, one Redis round trip per lookup).

How the copy is kept (the change log is described in :mod:`kvcore.index.redis`):

- every write script (agents' KV events, clears, purges) appends its change to the stream
  ``P log`` in the same atomic call, numbered by ``P seq`` (1, 2, 3, ...). A background task here
  ``XREAD BLOCK``s the stream and applies each entry to the local index in order, so after
  applying entry n the copy equals Redis's state after change n;
- bootstrap (at :meth:`~RedisMirrorIndex.open`, and on every resync): the stream's tail
  ``(id L0, seq S0)``, then worker by worker one ``MULTI`` reading the seq and the worker's owned
  sets, duplicate counters and heartbeat TTL. Tailing starts after ``L0``; an entry of worker w
  numbered at most that worker's snapshot seq only replays its effect on speculative entries (the
  snapshot holds the rest). No global lock, and Redis is blocked for one worker's read at a time;
- a gap (the next entry is not seq+1: the stream was trimmed past this reader, by
  ``stream_maxlen``, while it was away or bootstrapping) resyncs; lookups keep using the old copy
  meanwhile. Redis going back (restart without or with an older persisted state, ``FLUSHDB``:
  seq or epoch moved back) drops the copy and resyncs; lookups raise
  :class:`~kvcore.index.errors.IndexUnavailable` until done, as the plain backend would answer
  from an empty Redis;
- speculative entries (:meth:`~RedisMirrorIndex.store_speculative`) are applied here at once and
  appended to the same log (in the background, off the request path), so every replica reading
  it holds the same entries, with the TTL counted from the append (Redis's clock, from the entry
  id). A new replica replays the log's speculative entries of the last
  ``speculative_lookback_s`` seconds at bootstrap. So replicas on one Redis see the same evidence
  and route one prompt alike, up to the log's lag (docs/tuning/redis_index.md). Unlike the plain backend, a
  gpu removal or a purge written by any process also drops the speculative entries it covers (the
  contract of :mod:`kvcore.index.base`; the plain backend only drops this process's own), and so
  does a withdrawal (:meth:`~RedisMirrorIndex.drop_speculative`: a refused request's entries),
  appended to the log after the entries it withdraws;
- liveness: a worker's confirmed entries count while its heartbeat key lives, as in the plain
  backend. Its expiry is known here from ``PTTL`` (polled every ``poll_interval_s`` with the
  epoch, seq and Redis's clock in one script call) and from the heartbeat every write carries;
- a check every ``verify_interval_s`` compares each worker's blocks per tier with Redis's
  (``SCARD``) at the same seq and resyncs on a difference (e.g. a writer of an older kvroute
  release that does not append to the log): the copy cannot drift for long;
- writes through this object (``store``/``remove``/``apply_ops``/``clear_worker``) go to Redis and
  then wait (at most ``write_wait_s``) until the log has brought them back here, so a caller reads
  its own writes.

When Redis cannot be reached, lookups raise IndexUnavailable (route on load, as with the plain
backend) rather than answer from a copy that nobody can bring up to date; they come back once the
stream is read again (and resynced, if needed).

Costs (figures: docs/tuning/redis_index.md): a lookup costs what the in-memory index's does,
quiet or under agents' writes, without the plain backend's round trip. The bootstrap lays keys
out grouped by holders (:meth:`kvcore.index.memory.MemoryIndex.load_steps`: in Redis's set order
lookups would be slower); its time grows with the entries. Memory: the in-memory index's per
(block, worker) entry, in every gateway replica. Applying the log catches up quickly when
behind and takes a small share of a core at a steady write rate. Redis gets one ``INCR`` +
``XADD`` more per write (a small cost to an agent's ingest) and one small script call per
replica every ``poll_interval_s``; the log holds about ``stream_maxlen`` entries (~200 B for an
agent's batch, 8 B per key for larger ones: lower it when long prompts make speculative entries
big). Like the in-memory index, the copy's key dict rebuilds itself once every few million
inserts under steady churn (a compact dict never reuses the slot of a deleted key), holding the
event loop for a time that grows with the number of keys.

Redis Cluster: this class needs one standalone Redis, as the plain backend does; with ``cluster:
true`` the factory makes :class:`kvcore.index.redis_cluster_mirror.RedisClusterMirrorIndex`, the
same mirror over the partitions of a cluster (a change log per partition). Valkey (a fork of Redis
7.2) works: the commands used are Redis 6.2's; ``tests/test_redis_mirror.py`` runs against
``valkey-server`` when it is found.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvcore.index.base import TIERS, TierMatch, WorkerIndexStats
from kvcore.index.errors import IndexUnavailable
from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import DEFAULT_STREAM_MAXLEN, RedisIndex, _command, _pack, _unpack
from kvcore.index.redis_snapshot import hb_expiry, load_snapshot, snapshot_commands, take_snapshot

log = logging.getLogger("kvroute.index.redis_mirror")

_YIELD_KEYS = 2048  # keys applied between two yields to the event loop: bounds what a lookup may wait
_APPLY_CHUNK = 1024  # keys per step within one entry (an agent's republish carries a whole worker)
# speculative entries and withdrawals waiting to be appended; beyond, the oldest are dropped (counted)
_OUTBOX_MAX = 10_000
_LOOKBACK_PAGE = 256  # entries per XREVRANGE page when replaying speculative entries at bootstrap
_LAG_SAMPLES = 8192
_S, _R, _C, _RC, _F, _H, _P, _X, _D = (ord(c) for c in "srcRFhpxd")


def _id_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


class RedisMirrorIndex(RedisIndex):
    """The Redis index, mirrored in this process (see the module docstring).

    Takes :class:`RedisIndex`'s arguments plus: ``poll_interval_s``: liveness / epoch poll period;
    ``read_block_s``: longest ``XREAD BLOCK``; ``read_count``: entries per read;
    ``read_coalesce_s``: pause after a read that brought entries, so that a busy log is read in
    batches (a read costs several times the CPU of applying an agent's batch; the pause adds at
    most this to the lag);
    ``speculative_lookback_s``: how far back a bootstrap replays speculative entries (cover the
    gateway's longest speculative TTL, ``approx_ttl_s``); ``verify_interval_s``: period of the
    block-count check against Redis (0: off); ``write_wait_s``: longest wait for a write to come
    back through the log; ``stale_after_s``: lookups raise IndexUnavailable when neither the poll
    nor the stream reader reached Redis for this long; ``bootstrap_timeout_s``: socket timeout of
    the reader's connection for one bootstrap read; ``max_keys``: the local index's bound (beyond
    it, lookups under-report and the count check is off). Raises ValueError on a bad value.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", namespace: str = "kvr",
                 heartbeat_ttl_s: float = 10.0, socket_timeout_s: float = 0.5,
                 retry_after_s: float = 1.0, stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
                 clock: Callable[[], float] = time.monotonic, *, poll_interval_s: float = 0.2,
                 read_block_s: float = 1.0, read_count: int = 1000, read_coalesce_s: float = 0.002,
                 speculative_lookback_s: float = 120.0,
                 verify_interval_s: float = 5.0, write_wait_s: float = 1.0, stale_after_s: float = 3.0,
                 bootstrap_timeout_s: float = 30.0, max_keys: int = 20_000_000) -> None:
        super().__init__(url, namespace, heartbeat_ttl_s, socket_timeout_s, retry_after_s, stream_maxlen, clock)
        for name, value in (("poll_interval_s", poll_interval_s), ("read_block_s", read_block_s),
                            ("write_wait_s", write_wait_s), ("stale_after_s", stale_after_s),
                            ("bootstrap_timeout_s", bootstrap_timeout_s)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if read_count < 1 or max_keys < 1 or speculative_lookback_s < 0 or verify_interval_s < 0 \
                or read_coalesce_s < 0:
            raise ValueError("read_count and max_keys must be >= 1, speculative_lookback_s, "
                             "verify_interval_s and read_coalesce_s >= 0")
        self.poll_interval_s = poll_interval_s
        self.read_block_s = read_block_s
        self.read_count = read_count
        self.read_coalesce_s = read_coalesce_s
        self.speculative_lookback_s = speculative_lookback_s
        self.verify_interval_s = verify_interval_s
        self.write_wait_s = write_wait_s
        self.stale_after_s = stale_after_s
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.max_keys = max_keys
        p = self.prefix.encode()
        self._p = p
        self._log_key = p + b"log"
        # the reader's own connection: XREAD blocks on it, bootstrap reads run on it. RESP2, so
        # that replies have one shape (flat arrays; RESP3 would make maps and sets of some)
        self._stream_client = aioredis.Redis.from_url(
            url, protocol=2, socket_timeout=None, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._stream_conn: Any = None
        self.local: MemoryIndex | None = None  # the copy lookups use; None until the first sync
        self._synced = False  # False: the reader resyncs before reading on
        self._generation = 0  # bumped by every swap of self.local
        self._applied_seq = 0
        self._last_id = b"0-0"
        self._floors: dict[str, int] = {}  # worker -> seq its bootstrap snapshot already holds
        self._floor_max = 0
        self._epoch_seen = b""
        self._offset_s = 0.0  # Redis's clock minus time.time()
        self._alive_until: dict[str, float] = {}  # worker -> time.monotonic() its heartbeat expires
        self._alive_set_at: dict[str, float] = {}  # worker -> when a log entry last set that
        self._slot_names: dict[int, str] = {}
        self._hidden_bits = 0
        self._hidden_until = 0.0
        self._hidden_key: tuple[int, int] = (-1, -1)
        self._hidden_dirty = True
        self._contact_at = 0.0  # time.monotonic() of the last poll or read that reached Redis
        self._verify: tuple[int, dict[str, tuple[int, int, int]]] | None = None
        self._verify_seq = -1  # self._verify's seq, for a quick test per applied entry
        self._applying = False  # an entry is being applied (in steps)
        self._verify_due = 0.0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._outbox: list[tuple[str, float | None, bytes]] = []  # (worker, ttl_s or None: withdrawal, keys)
        self._outbox_ready: asyncio.Event | None = None
        self._publishing = False
        self._sync_attempt: asyncio.Event | None = None
        self._sync_error: str = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._lag_ms: deque[float] = deque(maxlen=_LAG_SAMPLES)
        self.entries_applied = 0
        self.keys_applied = 0
        self.resyncs = 0
        self.gaps = 0
        self.verify_checks = 0
        self.verify_mismatches = 0
        self.speculative_dropped = 0
        self.last_resync_s = 0.0

    # ---- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Check the encoding (as :meth:`RedisIndex.open`), then load the copy and start following
        the log; returns once the copy is in sync. Raises IndexEncodingMismatch (nothing started),
        IndexUnavailable when Redis cannot be reached or the first load failed (the background
        tasks go on trying; lookups raise IndexUnavailable until they succeed)."""
        try:
            await super().open()
        except IndexUnavailable as exc:
            if self.encoding_error is None:
                self._ensure_started()
            raise exc
        self._ensure_started()
        assert self._sync_attempt is not None
        while not (self._synced and self.local is not None):
            self._sync_attempt.clear()
            await self._sync_attempt.wait()
            if not self._synced and self._sync_error:
                raise IndexUnavailable(f"redis index {self.url}: mirror not loaded: {self._sync_error}")

    def _ensure_started(self) -> None:
        if self._tasks or self._closed:
            return
        self._outbox_ready = asyncio.Event()
        self._sync_attempt = asyncio.Event()
        self._tasks = [asyncio.create_task(self._read_loop(), name="kvr-mirror-read"),
                       asyncio.create_task(self._poll_loop(), name="kvr-mirror-poll"),
                       asyncio.create_task(self._publish_loop(), name="kvr-mirror-publish")]

    async def close(self) -> None:
        """Append the speculative entries still waiting (at most ``socket_timeout_s``), stop the
        background tasks and close both connections."""
        if self._tasks and self.available:
            await self.flush(self.socket_timeout_s)
        self._closed = True
        if self._outbox_ready is not None:
            self._outbox_ready.set()  # the publish loop sees _closed
        await _stop_tasks(self._tasks, self.url)
        self._tasks = []
        if self._stream_conn is not None:
            await self._stream_conn.disconnect()
        try:
            await self._stream_client.aclose()
        except Exception:  # noqa: BLE001 - closing a client that may never have connected
            pass
        await super().close()

    # ---- reads --------------------------------------------------------------------------------
    def _usable(self) -> MemoryIndex:
        idx = self.local
        if idx is None or not self.available or time.monotonic() - self._contact_at > self.stale_after_s:
            self._ensure_started()
            why = "not loaded yet" if idx is None else (self.last_error or "no contact")
            raise IndexUnavailable(f"redis index {self.url} unavailable (mirror): {why}")
        return idx

    async def match(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        """Per worker, the longest run of ``keys`` from block 0 by tier, from the local copy (no
        Redis round trip); workers without a live heartbeat count only their speculative entries.
        Raises IndexUnavailable while Redis cannot be reached or the copy is not loaded."""
        idx = self._usable()
        return idx.match_sync(keys, self._hidden(idx))

    async def gpu_holders(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker, which of ``keys`` it holds in gpu (a bit per position), from the local copy.
        Raises IndexUnavailable as :meth:`match` does."""
        idx = self._usable()
        return idx.gpu_holders_sync(keys, self._hidden(idx))

    def _hidden(self, idx: MemoryIndex) -> int:
        """Confirmed-tier bits of the workers whose heartbeat is not live now (cached until the
        next expiry, a liveness change or a new worker)."""
        now = time.monotonic()
        key = (self._generation, idx.worker_count)
        if self._hidden_dirty or now >= self._hidden_until or key != self._hidden_key:
            dead: list[str] = []
            until = math.inf
            for worker in idx.workers():
                t = self._alive_until.get(worker, 0.0)
                if t <= now:
                    dead.append(worker)
                elif t < until:
                    until = t
            self._hidden_bits = idx.confirmed_bits(dead)
            self._hidden_until = until
            self._hidden_key = key
            self._hidden_dirty = False
        return self._hidden_bits

    async def stats(self) -> dict[str, WorkerIndexStats]:
        """Per worker holding anything (confirmed or speculative), block counts by tier, from the
        local copy. Raises IndexUnavailable as :meth:`match` does."""
        idx = self._usable()
        return {w: st for w, st in (await idx.stats()).items() if st.speculative_blocks or any(st.blocks.values())}

    def agent_fed(self, worker: str) -> bool:
        """Whether ``worker`` has been seen with a live agent heartbeat."""
        return worker in self._agent_workers

    def __len__(self) -> int:
        """Distinct keys in the local copy."""
        return len(self.local) if self.local is not None else 0

    @property
    def dropped_keys(self) -> int:
        """Keys the local copy could not take (``max_keys``)."""
        return self.local.dropped_keys if self.local is not None else 0

    @property
    def applied_seq(self) -> int:
        """Change-log seq the local copy reflects."""
        return self._applied_seq

    def mirror_state(self) -> dict[str, Any]:
        """The copy's state for an admin page: whether in sync, seq applied, counters, and the
        apply lag (ms from the entry's append in Redis to its application here; entry ids have
        ms resolution) over the last few thousand entries. JSON-serialisable."""
        lags = sorted(self._lag_ms)

        def q(f: float) -> float | None:
            return round(lags[min(len(lags) - 1, int(len(lags) * f))], 3) if lags else None
        return {"synced": self._synced and self.local is not None, "applied_seq": self._applied_seq,
                "keys": len(self), "entries_applied": self.entries_applied, "keys_applied": self.keys_applied,
                "resyncs": self.resyncs, "gaps": self.gaps, "verify_mismatches": self.verify_mismatches,
                "speculative_dropped": self.speculative_dropped, "last_resync_s": round(self.last_resync_s, 3),
                "lag_ms_p50": q(0.5), "lag_ms_p99": q(0.99)}

    # ---- writes -------------------------------------------------------------------------------
    async def apply_ops(self, worker: str, ops: Sequence[tuple[str, str, Sequence[int]]]) -> int:
        """As :meth:`RedisIndex.apply_ops`; returns once the change is in the local copy too (or
        after ``write_wait_s``). Raises ValueError, IndexUnavailable."""
        missing, seq = await self._write_ops(worker, ops)
        await self._caught_up(seq)
        return missing

    async def clear_worker(self, worker: str, tier: str | None = None) -> None:
        """As :meth:`RedisIndex.clear_worker` (a full purge also drops ``worker``'s speculative
        entries in every replica); returns once the local copy has it too (or after
        ``write_wait_s``). Raises ValueError, IndexUnavailable."""
        await self._caught_up(await self._clear(worker, tier))

    async def store_speculative(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        """Hold ``keys`` as gpu on ``worker`` for ``ttl_s`` seconds: in the local copy at once,
        and in every replica once the background append reaches the log. Never waits for Redis;
        entries that cannot be appended (Redis down) are dropped and counted. Raises ValueError
        for keys that are not unsigned 64-bit ints."""
        packed = _pack(keys)
        if not packed:
            return
        if self.local is not None:
            self.local.store_speculative_sync(worker, keys, ttl_s)
        self._queue((worker, ttl_s, packed))

    def _queue(self, entry: tuple[str, float | None, bytes]) -> None:
        """Queue a log append (``ttl_s`` None: a withdrawal) for the background publisher."""
        self._ensure_started()
        self._outbox.append(entry)
        if len(self._outbox) > _OUTBOX_MAX:
            del self._outbox[0]
            self.speculative_dropped += 1
        if self._outbox_ready is not None:
            self._outbox_ready.set()

    async def drop_speculative(self, worker: str, keys: Sequence[int]) -> None:
        """From the local copy at once. The last entry of ``worker`` not yet appended to the log
        whose keys end with these keys (``Router.withdraw`` takes back a prompt's keys past the
        run the worker held) loses them in the outbox; when there is none (it was appended), a
        withdrawal is appended after it, in the background as entries are, and every replica
        drops those keys' speculative entries of ``worker`` when it reads it, whichever gateway
        stored them. Until then a replica keeps them, and this copy may get them back for that
        long from the log's record of the entry. A replica of a kvroute release that does not
        know withdrawals keeps them until their TTL."""
        if self.local is not None:
            self.local.drop_speculative_sync(worker, keys)
        packed = _pack(keys)
        if not packed:
            return
        outbox = self._outbox
        for i in range(len(outbox) - 1, -1, -1):
            w, ttl_s, entry = outbox[i]
            if w == worker and ttl_s is not None and entry.endswith(packed):
                if len(entry) == len(packed):
                    del outbox[i]
                else:
                    outbox[i] = (w, ttl_s, entry[:-len(packed)])
                return
        self._queue((worker, None, packed))

    async def flush(self, timeout_s: float = 1.0) -> bool:
        """Wait until every speculative entry stored so far has been appended to the log (or
        dropped because Redis was down), at most ``timeout_s``. Returns whether it got there."""
        end = time.monotonic() + timeout_s
        while self._outbox or self._publishing:
            if time.monotonic() >= end or not self._tasks:
                return False
            await asyncio.sleep(0.002)
        return True

    async def _publish_loop(self) -> None:
        assert self._outbox_ready is not None
        while not self._closed:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            batch, self._outbox = self._outbox, []
            if not batch:
                continue
            self._publishing = True
            try:
                await self.publish_speculative(batch)
            except IndexUnavailable:
                self.speculative_dropped += len(batch)
            except Exception:  # noqa: BLE001 - keep publishing whatever one batch did
                self.speculative_dropped += len(batch)
                log.exception("redis index %s: could not append speculative entries", self.url)
            finally:
                self._publishing = False

    async def _caught_up(self, seq: int) -> None:
        """Wait until the local copy has applied change ``seq`` (at most ``write_wait_s``)."""
        if seq <= self._applied_seq or not self._tasks or self.local is None:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (seq, id(fut), fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.write_wait_s)
        except asyncio.TimeoutError:
            log.debug("redis index %s: change %d not back through the log after %.1f s", self.url, seq,
                      self.write_wait_s)

    def _wake_waiters(self, upto: int) -> None:
        w = self._waiters
        while w and w[0][0] <= upto:
            fut = heapq.heappop(w)[2]
            if not fut.done():
                fut.set_result(None)

    # ---- following the log --------------------------------------------------------------------
    async def _reader_call(self, request: Sequence[bytes], replies: int, timeout_s: float) -> list[Any]:
        """Pre-encoded commands on the reader's own connection; their replies (raw, as hiredis
        parses them: a stream entry keeps repeated field names). The connection is dropped on
        any failure, a timeout included (redis-py's own ``read_response(timeout=...)`` answers
        None and keeps the connection, whose late reply would then answer the next command).
        Raises what redis-py raises, TimeoutError after ``timeout_s``."""
        conn = self._stream_conn
        if conn is None:
            conn = self._stream_conn = self._stream_client.connection_pool.make_connection()
        try:
            async with asyncio.timeout(timeout_s):
                await conn.send_packed_command(list(request), check_health=False)
                return [await conn.read_response() for _ in range(replies)]
        except BaseException:
            await conn.disconnect()
            raise

    async def _atomic(self, commands: Sequence[bytes]) -> list[Any]:
        """``MULTI`` + commands + ``EXEC`` on the reader's connection; the EXEC reply."""
        request = [_command(b"MULTI"), *commands, _command(b"EXEC")]
        replies = await self._run(lambda: self._reader_call(request, len(request), self.bootstrap_timeout_s))
        return replies[-1]

    async def _read_loop(self) -> None:
        assert self._sync_attempt is not None
        while not self._closed:
            try:
                if not self._synced:
                    try:
                        await self._resync()
                    finally:
                        self._sync_attempt.set()
                    continue
                cmd = _command(b"XREAD", b"COUNT", b"%d" % self.read_count, b"BLOCK",
                               b"%d" % int(self.read_block_s * 1000), b"STREAMS", self._log_key, self._last_id)
                reply = await self._run(lambda: self._reader_call(
                    [cmd], 1, self.read_block_s + self.socket_timeout_s))
                self._contact_at = time.monotonic()
                if reply[0] is not None:
                    await self._apply_entries(reply[0][0][1])
                    if self.read_coalesce_s and len(reply[0][0][1]) < self.read_count:
                        await asyncio.sleep(self.read_coalesce_s)  # let a busy log batch up
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - an outage, a bug or a foreign entry: see _read_failed
                self._read_failed(exc)
                await asyncio.sleep(self.retry_after_s)

    def _read_failed(self, exc: Exception, where: str = "") -> bool:
        """Record why reading the change log failed (``where``: which log, for the message, e.g.
        ``" on partition 3"``). Returns True for an outage (IndexUnavailable, already counted and
        logged by ``_run``: read again after ``retry_after_s``); False for anything else (a bug or
        an entry of a foreign format), logged with its traceback, after which the copy is marked
        for a reload from Redis (``_synced`` False)."""
        if isinstance(exc, IndexUnavailable):
            self._sync_error = str(exc)
            return True
        log.error("redis index %s: mirror failed%s; resyncing", self.url, where, exc_info=exc)
        self._sync_error = f"{type(exc).__name__}: {exc}"
        self._synced = False
        return False

    async def _apply_entries(self, entries: list[list[Any]]) -> None:
        idx = self.local
        if idx is None:
            self._synced = False
            return
        now_wall = time.time()
        budget = 0
        for entry_id, fields in entries:
            if fields[0] != b"n" or fields[2] != b"w":
                raise ValueError(f"change-log entry {entry_id!r} has an unknown format")
            seq = int(fields[1])
            if seq != self._applied_seq + 1:
                self._gap(seq)
                return
            worker = fields[3].decode()
            state = not self._floors or seq > self._floors.get(worker, 0)
            self._applying = True
            try:
                for n in self._apply_entry(idx, entry_id, worker, fields, state, now_wall):
                    budget += n
                    if budget >= _YIELD_KEYS:
                        budget = 0
                        self._wake_waiters(self._applied_seq)
                        await asyncio.sleep(0)  # let lookups in (they may see an entry half applied)
                        if self.local is not idx or not self._synced:
                            return
            finally:
                self._applying = False
            self._applied_seq = seq
            self._last_id = entry_id
            self.entries_applied += 1
            if seq == self._verify_seq:  # the copy is at the seq Redis counted at: compare now
                self._try_verify()
            self._lag_ms.append(max(0.0, (now_wall + self._offset_s) * 1000.0 - _id_ms(entry_id)))
        self._after_apply()

    def _after_apply(self) -> None:
        if self._floors and self._applied_seq >= self._floor_max:
            self._floors = {}
        self._wake_waiters(self._applied_seq)
        self._try_verify()
        if self.local is not None:
            self.local.expire_sync()  # here rather than in the next lookup

    def _apply_entry(self, idx: MemoryIndex, entry_id: bytes, worker: str, fields: list[Any], state: bool,
                     now_wall: float) -> Iterator[int]:
        """One change-log entry into ``idx``, in steps of at most ``_APPLY_CHUNK`` keys (yields
        each step's key count, so that the caller can let lookups in during an agent's republish
        of a whole worker). ``state``: False when the bootstrap snapshot already holds this
        worker's change, so that only its effect on speculative entries applies."""
        age_s = max(0.0, now_wall + self._offset_s - _id_ms(entry_id) / 1000.0)
        ttl_ms = 0
        for i in range(4, len(fields), 2):
            f, v = fields[i], fields[i + 1]
            c = f[0]
            if c in (_X, _S, _R, _C, _D):
                keys = _unpack(v)
                self.keys_applied += len(keys)
                left_s = ttl_ms / 1000.0 - age_s
                for j in range(0, len(keys), _APPLY_CHUNK):
                    chunk = keys[j:j + _APPLY_CHUNK] if len(keys) > _APPLY_CHUNK else keys
                    if c == _X:
                        if left_s > 0:
                            idx.store_speculative_sync(worker, chunk, left_s)
                    elif c == _D:  # a withdrawal (speculative entries are in no snapshot)
                        idx.drop_speculative_sync(worker, chunk)
                    elif c == _S:
                        if state:
                            idx.store_sync(worker, TIERS[f[1] - 48], chunk)
                    elif c == _R:
                        if state:
                            idx.remove_sync(worker, TIERS[f[1] - 48], chunk)
                        elif f[1] == 48:  # a gpu removal drops speculative entries
                            idx.drop_speculative_sync(worker, chunk)
                    elif state:
                        idx.drop_sync(worker, TIERS[f[1] - 48], chunk)
                    yield len(chunk)
            elif c == _P:
                ttl_ms = int(v)
            elif c == _RC:
                if state:
                    idx.drop_copies_sync(worker, TIERS[f[1] - 48])
            elif c == _F:
                idx.drop_speculative_sync(worker)
                if state:
                    self._set_alive(worker, 0.0)
            elif c == _H:
                if state:
                    self._set_alive(worker, time.monotonic() + int(v) / 1000.0 - age_s)

    def _set_alive(self, worker: str, until: float) -> None:
        self._alive_until[worker] = until
        self._alive_set_at[worker] = time.monotonic()
        if until > time.monotonic():
            self._agent_workers.add(worker)
        self._hidden_dirty = True

    def _gap(self, seq: int) -> None:
        """The next entry is not the one expected: resync (dropping the copy when Redis went back)."""
        self.gaps += 1
        self._synced = False
        if seq <= self._applied_seq:
            log.warning("redis index %s: change log went back (seq %d after %d): Redis lost data; "
                        "reloading the mirror", self.url, seq, self._applied_seq)
            self.local = None
            self._generation += 1
        else:
            log.warning("redis index %s: change log trimmed past this reader (seq %d after %d); resyncing "
                        "(raise stream_maxlen if this repeats)", self.url, seq, self._applied_seq)

    # ---- bootstrap ----------------------------------------------------------------------------
    async def _resync(self) -> None:
        """Load a fresh copy (see the module docstring) and swap it in. Raises IndexUnavailable."""
        t0 = time.monotonic()
        p = self._p
        new = MemoryIndex(max_keys=self.max_keys, clock=self._clock)
        t_send = time.time()
        (sec, usec), last, seq0, epoch = await self._atomic([
            _command(b"TIME"), _command(b"XREVRANGE", self._log_key, b"+", b"-", b"COUNT", b"1"),
            _command(b"GET", p + b"seq"), _command(b"GET", p + b"epoch")])
        self._offset_s = int(sec) + int(usec) / 1e6 - (t_send + time.time()) / 2
        start_seq = int(seq0 or 0)
        start_id = last[0][0] if last else b"0-0"
        floors: dict[str, int] = {}
        alive: dict[str, float] = {}
        slots = await self._slot_table()
        parts: list[tuple[str, str, bytes]] = []
        copies: list[tuple[str, str, list[bytes]]] = []
        for name, slot in sorted(slots.items(), key=lambda kv: kv[1]):
            r = await self._atomic([*snapshot_commands(p, slot), _command(b"PTTL", p + b"hb:%d" % slot)])
            take_snapshot(name, r, start_seq, floors, parts, copies)
            alive[name] = hb_expiry(int(r[-1]), time.monotonic())
            await asyncio.sleep(0)
        await load_snapshot(new, parts, copies)
        await self._replay_speculative(new, start_id)
        self._applied_seq = start_seq
        self._last_id = start_id
        self._floors = floors
        self._floor_max = max(floors.values(), default=0)
        self._verify = None
        self._verify_seq = -1
        self._swap_in(new, slots, alive, epoch or b"", t0)
        self._wake_waiters(start_seq)
        log.info("redis index %s: mirror loaded: %d keys of %d workers at change %d in %.2f s", self.url,
                 len(new), len(alive), start_seq, self.last_resync_s)

    def _swap_in(self, new: MemoryIndex, slots: dict[str, int], alive: dict[str, float], epoch: bytes,
                 t0: float) -> None:
        """End a resync: make ``new`` the copy lookups use, with the slot table ``slots`` (worker
        -> slot), each worker's heartbeat expiry ``alive`` (``time.monotonic()`` s) and the
        ``epoch`` it was read under; ``t0``: when the resync began (``time.monotonic()`` s). The
        caller sets where the log reading goes on from."""
        self.local = new
        self._generation += 1
        now = time.monotonic()
        self._alive_until = alive
        self._alive_set_at = {w: now for w in alive}
        self._slot_names = {s: w for w, s in slots.items()}
        self._agent_workers.update(w for w, t in alive.items() if t > now)
        self._hidden_dirty = True
        self._epoch_seen = epoch
        self._synced = True
        self._sync_error = ""
        self._contact_at = now
        self.resyncs += 1
        self.last_resync_s = time.monotonic() - t0

    async def _replay_speculative(self, idx: MemoryIndex, end_id: bytes, log_key: bytes | None = None,
                                  atomic: Callable[[Sequence[bytes]], Any] | None = None) -> None:
        """Speculative entries appended up to ``end_id`` within the last ``speculative_lookback_s``
        seconds (less those a later gpu removal, withdrawal or purge dropped) into ``idx``, with
        what is left of their TTL. ``log_key``/``atomic``: another change log and how to read it (a cluster
        partition's), instead of this index's own."""
        log_key = log_key or self._log_key
        atomic = atomic or self._atomic
        if end_id == b"0-0" or self.speculative_lookback_s <= 0:
            return
        now_ms = int((time.time() + self._offset_s) * 1000)
        start = b"%d" % max(0, now_ms - int(self.speculative_lookback_s * 1000))
        entries: list[list[Any]] = []
        end = end_id
        while True:
            page = (await atomic([_command(b"XREVRANGE", log_key, end, start, b"COUNT",
                                                 b"%d" % _LOOKBACK_PAGE)]))[0]
            entries.extend(page)
            if len(page) < _LOOKBACK_PAGE:
                break
            end = b"(" + page[-1][0]
        held: dict[str, dict[int, int]] = {}  # worker -> key -> expiry (Redis ms)
        for entry_id, fields in reversed(entries):
            worker = fields[3].decode()
            ttl_ms = 0
            for i in range(4, len(fields), 2):
                f, v = fields[i], fields[i + 1]
                if f == b"p":
                    ttl_ms = int(v)
                elif f == b"x":
                    expiry = _id_ms(entry_id) + ttl_ms
                    d = held.setdefault(worker, {})
                    for k in _unpack(v):
                        d[k] = expiry
                elif (f == b"r0" or f == b"d") and worker in held:
                    d = held[worker]
                    for k in _unpack(v):
                        d.pop(k, None)
                elif f == b"F":
                    held.pop(worker, None)
        now_ms = int((time.time() + self._offset_s) * 1000)
        for worker, d in held.items():
            by_expiry: dict[int, list[int]] = {}
            for k, expiry in d.items():
                if expiry > now_ms:
                    by_expiry.setdefault(expiry, []).append(k)
            for expiry, keys in by_expiry.items():
                idx.store_speculative_sync(worker, keys, (expiry - now_ms) / 1000.0)

    # ---- liveness, Redis identity, count check ------------------------------------------------
    async def _poll_loop(self) -> None:
        while not self._closed:
            try:
                await self._poll()
            except asyncio.CancelledError:
                raise
            except IndexUnavailable:
                pass  # counted and logged by _run; lookups raise until Redis answers
            except Exception:  # noqa: BLE001 - keep polling
                log.exception("redis index %s: mirror poll failed", self.url)
            await asyncio.sleep(self.poll_interval_s)

    async def _poll(self) -> None:
        now = time.monotonic()
        verify = self.verify_interval_s > 0 and now >= self._verify_due and self._synced
        if verify:
            self._verify_due = now + self.verify_interval_s
        applied_before, generation = self._applied_seq, self._generation
        t_send, sent_at = time.time(), time.monotonic()
        sec, usec, epoch, seq, n_slots, ttls, counts = await self._script(
            self._poll_script, [self.prefix, "1" if verify else "0"])
        now = time.monotonic()
        self._contact_at = now
        self._offset_s = int(sec) + int(usec) / 1e6 - (t_send + time.time()) / 2
        seq = int(seq)
        if generation != self._generation or not self._synced:
            return  # the copy changed meanwhile: this reply says nothing about it
        if seq < applied_before or (self._epoch_seen and epoch != self._epoch_seen):
            log.warning("redis index %s: Redis lost data (seq %d < %d applied, or epoch changed); "
                        "reloading the mirror", self.url, seq, applied_before)
            self.gaps += 1
            self._synced = False
            self.local = None
            self._generation += 1
            return
        await self._take_poll(epoch, n_slots, ttls, sent_at, now)
        if counts and not self._floors:
            expected = {self._slot_names[s]: tuple(counts[3 * s:3 * s + 3])
                        for s in range(len(counts) // 3) if s in self._slot_names}
            self._verify = (seq, expected)  # type: ignore[assignment]
            self._verify_seq = seq
            self._try_verify()

    async def _take_poll(self, epoch: bytes, n_slots: int, ttls: Sequence[int], sent_at: float, now: float) -> None:
        """Apply a poll's answer (one that found no data loss): the ``epoch`` seen, the slot table
        re-read when its size is not ``n_slots``, each slot's heartbeat expiry from its ``PTTL``
        in ``ttls`` (ms; -1: no TTL, -2: none) unless a log entry set it after the poll was sent
        (``sent_at``) -- both, and ``now``, ``time.monotonic()`` s -- then the speculative entries
        due. Raises IndexUnavailable."""
        self._epoch_seen = epoch
        if n_slots != len(self._slot_names):
            self._slot_names = {s: w for w, s in (await self._slot_table()).items()}
            now = time.monotonic()
        for s, pttl in enumerate(ttls):
            worker = self._slot_names.get(s)
            if worker is None or self._alive_set_at.get(worker, 0.0) > sent_at:
                continue  # a log entry set it after this poll ran: newer
            until = hb_expiry(pttl, now)
            if until != self._alive_until.get(worker):
                self._alive_until[worker] = until
                self._hidden_dirty = True
            if pttl > 0 or pttl == -1:
                self._agent_workers.add(worker)
        if self.local is not None:
            self.local.expire_sync()  # speculative entries due: here rather than in a lookup

    def _try_verify(self) -> None:
        """Compare the copy's blocks per worker and tier with Redis's, once it reflects the seq
        they were counted at; a difference resyncs."""
        if self._verify is None or self._applied_seq < self._verify[0] or self._applying:
            return  # not there yet, or an entry is half applied
        seq, expected = self._verify
        self._verify = None
        self._verify_seq = -1
        idx = self.local
        if self._applied_seq != seq or idx is None or idx.dropped_keys or self._floors:
            return
        self.verify_checks += 1
        diff = {w: (idx.held_sync(w), c) for w, c in expected.items() if idx.held_sync(w) != c}
        if diff:
            self.verify_mismatches += 1
            sample = dict(list(diff.items())[:3])
            log.warning("redis index %s: mirror differs from Redis at change %d (worker: (here, Redis) "
                        "blocks per tier) %s; resyncing. A writer of an older kvroute release that does "
                        "not append to the change log does this.", self.url, seq, sample)
            self._synced = False


async def _stop_tasks(tasks: list[asyncio.Task], url: str, rounds: int = 5, wait_s: float = 1.0) -> None:
    """Cancel ``tasks`` and wait for them to end. A cancellation can be lost on Python 3.11 (an
    ``asyncio.wait_for`` inside a client library that completes as it is cancelled swallows it),
    and the loops also stop on ``_closed``; so cancel again each ``wait_s`` for ``rounds`` rounds,
    then log and leave the rest rather than hang a shutdown."""
    pending = [t for t in tasks if not t.done()]
    for _ in range(rounds):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, still = await asyncio.wait(pending, timeout=wait_s)
        pending = list(still)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: a loop that failed was logged where it failed
    if pending:
        log.warning("redis index %s: %d mirror task(s) did not stop: %s", url, len(pending),
                    ", ".join(t.get_name() for t in pending))
