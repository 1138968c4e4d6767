"""Redis index backend: one index shared by many gateways; agents write it, gateways read it.

Uses redis-py's asyncio client (with the hiredis reply parser); every write is one Lua script call
(atomic, one round trip) and a prompt's lookup for all workers is one round trip of plain
commands. Gateways normally read through :class:`kvcore.index.redis_mirror.RedisMirrorIndex`
(config ``mirror: true``, the default), which keeps a copy in process from the change log below
and looks up locally; this class is the plain path (``mirror: false``) and the writer of both.

Servers: a standalone Redis >= 6.2, or Valkey (tested with 9.1: ``tests/test_redis_mirror.py``
runs on it when ``valkey-server`` is found). This class refuses a Redis Cluster node
(:class:`kvcore.index.errors.IndexLayoutMismatch` at the encoding check: its keys carry no hash tag
and its scripts build key names of many slots); :mod:`kvcore.index.redis_cluster` (config
``cluster: true``) shards the same schema over a cluster by block-key partitions. Scale reads with
gateway replicas (each with its mirror) and make Redis highly available with replicas + Sentinel.

Schema (``P`` = ``namespace + ":"``, default ``kvr:``; a block key ``k`` is written as its 8 bytes
big-endian, ``raw(k)``; a worker gets a permanent slot number ``s`` on first use):

- ``P slots`` HASH worker id -> slot (allocated as ``HLEN``; never reused, so a writer holding an
  old slot number can never write into another worker's bits);
- ``P b: raw(k)`` STRING, a bitmap: bit ``4*s + t`` (Redis ``SETBIT`` offsets) is set when worker
  ``s`` holds ``k`` in tier ``t`` (0 gpu, 1 cpu, 2 ssd; bit 3 is spare). Deleted when no bit is left;
- ``P o: s : t`` SET of ``raw(k)``: what worker ``s`` holds in tier ``t`` (for clearing and stats);
- ``P rc: s : t`` HASH ``raw(k)`` -> extra copies beyond the first (only for duplicates, as
  vLLM may store the same block twice and remove it twice);
- ``P hb: s`` STRING with a TTL (``heartbeat_ttl_s``): the worker's liveness, refreshed by every
  write and by :meth:`RedisIndex.heartbeat`. A worker's confirmed entries count in ``match`` only
  while this key exists, so a dead agent's worker stops attracting traffic within the TTL; its
  entries stay until the agent restarts (it clears them first) or the worker is removed
  (:meth:`clear_worker` purges everything);
- ``P m: s`` STRING: set by the agent once its full state is published; a heartbeat that finds it
  missing (Redis restarted or flushed, worker purged) tells the agent to publish again;
- ``P st: s`` HASH ``{at: Redis TIME "sec.usec", state: JSON}`` with the heartbeat's TTL: the
  agent's event-ingest state (:meth:`kvcore.kv_events.EventIngestor.state`: last seq, event age,
  gaps, replays, resyncs, blocks by tier as its events say), written with its heartbeats, read by
  the gateways' admin API (:meth:`RedisIndex.worker_states`). A few hundred bytes per worker;
- ``P seq`` STRING counter and ``P log`` STREAM, the change log: every script call that changes the
  state above appends one entry describing the change, in the same atomic call, numbered by
  ``INCR P seq`` and trimmed by ``XADD MAXLEN ~ stream_maxlen`` (default 100,000 entries; about
  150 B each for an agent's batch of 16 blocks, 8 B per key for larger ones). An entry's fields, in
  order: ``n`` seq, ``w`` worker id, then pairs applied in order: ``h`` heartbeat TTL ms (the write
  refreshed the worker's heartbeat); ``s<t>``/``r<t>`` packed keys stored in / removed from tier
  ``t`` (0 gpu, 1 cpu, 2 ssd; as :meth:`RedisIndex.apply_ops`, copies counted); ``R<t>`` ``""``
  the worker's duplicate counters of tier ``t`` were dropped; ``F`` ``""`` the worker was purged
  (heartbeat, marker and state deleted; replicas drop its speculative entries); ``c<t>`` packed
  keys cleared from tier ``t`` whatever their copies (a batch of :meth:`RedisIndex.clear_worker`);
  ``p`` TTL ms then ``x`` packed keys: speculative entries of a gateway
  (:meth:`RedisIndex.publish_speculative`; in the log only, not in the state); ``d`` packed keys:
  the worker's speculative entries of those keys withdrawn (the same call with ``ttl_s`` None: a
  request the worker refused; readers that predate it skip the field). Replicas that have
  applied entries 1..n hold exactly Redis's state after change n;
- ``P meta:block_key_encoding`` STRING: the block-key encoding version
  (:data:`kvcore.block_keys.ENCODING_VERSION`, as decimal text) of the keys in this namespace,
  written by the first process that reaches it (``SET NX``). Every process compares it with its
  own before its first call (again after each outage and after Redis lost its data) and refuses
  a mismatch (:class:`kvcore.index.errors.IndexEncodingMismatch`): a gateway and an agent on
  different encodings would otherwise silently never match.

Bytes per block: a (block, worker) entry held in one tier is the bitmap key (dict entry, key
name of 14 B, value) plus the member of the worker's owned set. A block held by several workers
pays the bitmap once (growing 4 bits per slot) and one owned-set member per further worker. Each
bitmap is its own STRING key so that writes can use SETBIT/BITCOUNT. (Bytes measured, and the
one-HASH layout compared: docs/tuning/redis_index.md.)

Lookup (:meth:`RedisIndex.match`): one round trip of four pipelined commands: ``MGET`` of the
bitmaps of all the prompt's keys (the request is laid out here from the packed keys without a
Python step per key: the names have a fixed width), ``MGET`` of every slot's heartbeat, and the
epoch and slot count (a changed one reloads the slot table and repeats the lookup, once). The
answer is used from block 0 up to the first key nobody holds (at least as far as this process's
speculative entries reach) and run-length coded here (a row only where the bitmap differs from the
block before), so the per-worker runs are computed with the same bitmask chains as
:class:`kvcore.index.memory.MemoryIndex` over the distinct holder sets, not over every block.
Building the key names and run-length coding here, not in a script on the server, spares
Redis's CPU (the server is shared by every gateway and agent) and lowers latency; the price is a
larger reply (tens of kB for a long prompt at many workers), which needs the hiredis parser
(redis-py's pure-Python parser is slow on it). Figures: docs/tuning/redis_index.md.

Speculative entries (:meth:`store_speculative`) stay in this process (they are the gateway's own
guesses for prompts it just routed) and are merged into every lookup as gpu bits. (The mirror
shares them between gateways through the change log.)

Failure: any connection error or timeout raises :class:`kvcore.index.errors.IndexUnavailable`;
after one, calls fail fast for ``retry_after_s`` before trying Redis again, so a dead Redis costs a
request nothing but the fallback. ``unavailable_errors`` counts failures, ``available`` says whether
the last call reached Redis; outages (WARNING) and recoveries (INFO) are logged once each. An
encoding mismatch is handled like an outage (its error is a subclass of ``IndexUnavailable``, so
callers fall back the same way), is logged at ERROR once, and is checked again after
``retry_after_s``; :meth:`RedisIndex.open` raises it at start-up.
"""
from __future__ import annotations

import heapq
import json
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from itertools import compress, islice
from operator import ne
from typing import Any, TypeVar

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript

from kvcore.block_keys import ENCODING_VERSION
from kvcore.index.base import TIERS, KVIndex, TierMatch, WorkerIndexStats, check_tier
from kvcore.index.errors import IndexEncodingMismatch, IndexLayoutMismatch, IndexUnavailable
from kvcore.index.chain_rows import row_matches
from kvcore.index.memory import tier_matches
from kvcore.index.redis_scripts import LOG, SLOT_OF, SPECULATIVE_LUA, apply_body, clear_body, speculative_ttl_ms

log = logging.getLogger("kvroute.index.redis")
_T = TypeVar("_T")
ENCODING_KEY = "meta:block_key_encoding"  # after the namespace prefix; see the module docstring

# ARGV: prefix, worker, heartbeat ttl ms, log maxlen, then (op 's'|'r', tier, packed 8-byte keys)
# triples. Returns {keys removed that were absent, log seq of the change}.
_APPLY_LUA = SLOT_OF + LOG + """
local p = ARGV[1]
local slot = slot_of(p, ARGV[2])
""" + apply_body(ttl=3, first=5, maxlen=4, before_log="redis.call('SET', p .. 'hb:' .. slot, '1', 'PX', ARGV[3])\n")

# ARGV: prefix, worker, tier, batch size, first call ('1' drops the duplicate counters first),
# forget ('1': also drop the heartbeat and published marker), log maxlen. Returns {how many keys
# it cleared, log seq of the change (0: nothing changed)}.
_CLEAR_LUA = SLOT_OF + LOG + """
local p = ARGV[1]
local slot = slot_of(p, ARGV[2])
""" + clear_body(tier="ARGV[3]", batch=4, first=5, forget=6, maxlen=7,
                 on_forget="  redis.call('DEL', p .. 'hb:' .. slot, p .. 'm:' .. slot, p .. 'st:' .. slot)\n")

# ARGV: prefix, counts ('1': also each slot's owned-set sizes). Returns {Redis TIME seconds,
# microseconds, epoch, log seq, slot count, [heartbeat PTTL ms per slot], [SCARD per slot and tier]}.
_POLL_LUA = """
local p = ARGV[1]
local t = redis.call('TIME')
local n = redis.call('HLEN', p .. 'slots')
local ttl, counts = {}, {}
for s = 0, n - 1 do
  ttl[#ttl + 1] = redis.call('PTTL', p .. 'hb:' .. s)
  if ARGV[2] == '1' then
    for tier = 0, 2 do counts[#counts + 1] = redis.call('SCARD', p .. 'o:' .. s .. ':' .. tier) end
  end
end
return {t[1], t[2], redis.call('GET', p .. 'epoch') or '', redis.call('GET', p .. 'seq') or '0', n, ttl, counts}
"""

# ARGV: prefix, worker, ttl ms, mark ('1' sets the published marker), ingest state JSON ('' = keep
# the last one). Returns 1 if the published marker was set before.
_HEARTBEAT_LUA = SLOT_OF + """
local p = ARGV[1]
local slot = slot_of(p, ARGV[2])
redis.call('SET', p .. 'hb:' .. slot, '1', 'PX', ARGV[3])
local had = redis.call('EXISTS', p .. 'm:' .. slot)
if ARGV[4] == '1' then redis.call('SET', p .. 'm:' .. slot, '1') end
if ARGV[5] ~= '' then
  local t = redis.call('TIME')
  local st = p .. 'st:' .. slot
  redis.call('HSET', st, 'at', t[1] .. '.' .. string.format('%06d', tonumber(t[2])), 'state', ARGV[5])
  redis.call('PEXPIRE', st, ARGV[3])
end
return had
"""

# ARGV: prefix. Returns {Redis TIME "sec.usec", [worker, at, state JSON, ...]} for every worker
# whose agent's state has not expired.
_STATES_LUA = """
local p = ARGV[1]
local t = redis.call('TIME')
local slots = redis.call('HGETALL', p .. 'slots')
local out = {}
for i = 1, #slots, 2 do
  local v = redis.call('HMGET', p .. 'st:' .. slots[i + 1], 'at', 'state')
  if v[1] and v[2] then
    out[#out + 1] = slots[i]
    out[#out + 1] = v[1]
    out[#out + 1] = v[2]
  end
end
return {t[1] .. '.' .. string.format('%06d', tonumber(t[2])), out}
"""

# Redis SETBIT numbers bits from the most significant bit of each byte; reversing the bits of every
# byte makes offset o bit o of a little-endian int.
_REV_BITS = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))
_REV_BITS_NP = np.frombuffer(_REV_BITS, np.uint8)
# a lookup goes through the matrix of holder rows (kvcore.index.chain_rows) from this many runs
# of equal bitmaps along the prompt (the first included), or past this many worker slots, when
# no speculative entry of this process covers block 0
_MANY_CHANGES = 32
_MANY_SLOTS = 128


def _match_rows(bitmaps: list[bytes], starts: list[int], count: int, alive_mask: int,
                names: dict[int, str]) -> dict[str, TierMatch]:
    """:meth:`RedisIndex.match` without speculative entries, as one matrix: ``bitmaps[r]`` (Redis
    bit order: bit ``4*slot + tier`` is the byte's most significant bit first) holds for blocks
    ``starts[r]`` up to the next start, ``count`` blocks in all; ``alive_mask`` keeps the tiers of
    workers with a live heartbeat. The run ends at the first row no live worker holds."""
    width = max(max(map(len, bitmaps)), -(-alive_mask.bit_length() // 8))
    row_bytes = -(-width // 8) * 8
    raw = np.frombuffer(b"".join([b.ljust(row_bytes, b"\0") for b in bitmaps]), np.uint8)
    rows = _REV_BITS_NP[raw].view("<u8").reshape(len(bitmaps), row_bytes // 8)
    rows &= np.frombuffer(alive_mask.to_bytes(row_bytes, "little"), "<u8")
    empty = np.flatnonzero(~rows.any(axis=1))
    end = count
    if empty.size:
        if not empty[0]:
            return {}
        end = starts[int(empty[0])]
        rows = rows[:empty[0]]
    return row_matches(rows, np.array(starts[:len(rows)], np.int64), end, names)


_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_CLEAR_BATCH = 2000
DEFAULT_STREAM_MAXLEN = 100_000  # change-log entries kept (about; see the module docstring)


def _pack(keys: Sequence[int]) -> bytes:
    try:
        return struct.pack(f">{len(keys)}Q", *keys)
    except struct.error as exc:
        raise ValueError(f"block keys must be unsigned 64-bit ints: {exc}") from None


def _unpack(packed: bytes) -> tuple[int, ...]:
    """The block keys of ``packed`` (8-byte big-endian keys back to back, as :func:`_pack` writes
    them); a trailing partial key is ignored."""
    return struct.unpack(f">{len(packed) // 8}Q", packed)


def _op_code(op: str, tier: str) -> tuple[str, int]:
    """An :meth:`RedisIndex.apply_ops` op as the apply script takes it: ``("s"`` store or ``"r"``
    remove, the tier's number). Raises ValueError on an unknown op or tier."""
    if op not in ("store", "remove"):
        raise ValueError(f"unknown index op {op!r}")
    return "s" if op == "store" else "r", check_tier(tier)


def _command(*args: bytes) -> bytes:
    """One command in the Redis protocol (RESP2 array of bulk strings)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _mget_fixed(prefix: bytes, packed: bytes) -> bytearray:
    """``MGET prefix+k0 prefix+k1 ...`` in the Redis protocol, for 8-byte keys packed back to back.
    Every argument has the same length, so the request is one repeated template with the key bytes
    written in by 8 strided slice assignments: no Python step per key (the client library's own
    encoder takes one per argument, which adds up over a long prompt's thousands of keys; timing:
    docs/tuning/redis_index.md)."""
    n = len(packed) // 8
    head = b"$%d\r\n%s" % (len(prefix) + 8, prefix)
    stride = len(head) + 10
    preamble = b"*%d\r\n$4\r\nMGET\r\n" % (n + 1)
    buf = bytearray(preamble) + (head + bytes(8) + b"\r\n") * n
    first = len(preamble) + len(head)
    for c in range(8):
        buf[first + c::stride] = packed[c::8]
    return buf


class RedisIndex(KVIndex):
    """The shared index in Redis; see the module docstring for schema, costs and failure handling.

    ``url``: ``redis://host:port/db``. ``namespace``: key prefix (several clusters can share one
    Redis). ``heartbeat_ttl_s``: how long a worker counts after its agent's last write or
    heartbeat. ``socket_timeout_s``: per-command timeout before :class:`IndexUnavailable`.
    ``retry_after_s``: fail-fast window after a failure. ``stream_maxlen``: the change log is
    trimmed to about this many entries (``XADD MAXLEN ~``) by this process's writes. ``clock``:
    monotonic seconds for speculative TTLs (tests). Raises ValueError on a bad value.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", namespace: str = "kvr",
                 heartbeat_ttl_s: float = 10.0, socket_timeout_s: float = 0.5,
                 retry_after_s: float = 1.0, stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {heartbeat_ttl_s}")
        if stream_maxlen < 1:
            raise ValueError(f"stream_maxlen must be >= 1, got {stream_maxlen}")
        self.url = url
        self.stream_maxlen = int(stream_maxlen)
        self.socket_timeout_s = socket_timeout_s
        self.prefix = f"{namespace}:"
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._apply_script = self._redis.register_script(_APPLY_LUA)
        self._clear_script = self._redis.register_script(_CLEAR_LUA)
        self._heartbeat_script = self._redis.register_script(_HEARTBEAT_LUA)
        self._states_script = self._redis.register_script(_STATES_LUA)
        self._speculative_script = self._redis.register_script(SPECULATIVE_LUA)
        self._poll_script = self._redis.register_script(_POLL_LUA)
        self.encoding_key = f"{self.prefix}{ENCODING_KEY}"
        self._encoding_checked = False  # compared since the last outage / data loss
        self.encoding_error: IndexEncodingMismatch | None = None  # the mismatch found last, if any
        self._epoch = b""
        self._names: dict[int, str] = {}  # slot -> worker, as of self._epoch
        self._agent_workers: set[str] = set()  # workers seen with a live agent heartbeat
        self._hb_mget = b""  # MGET of every known slot's heartbeat key
        p = self.prefix.encode()
        self._bitmap_prefix = p + b"b:"
        self._epoch_get = _command(b"GET", p + b"epoch")
        self._slots_hlen = _command(b"HLEN", p + b"slots")
        self._spec: dict[int, dict[str, float]] = {}  # key -> worker -> expiry (clock s)
        self._spec_heap: list[tuple[float, int, str]] = []
        self._down_until = 0.0
        self.available = True
        self.unavailable_errors = 0
        self.last_error = ""

    async def open(self) -> None:
        """Reach Redis and check the namespace's block-key encoding version (writing ours when the
        namespace has none). Call once at start-up; the check also runs before the first call
        otherwise. Raises :class:`IndexEncodingMismatch` when the namespace holds another version
        (refuse to start: the message says what to do), :class:`IndexUnavailable` when Redis
        cannot be reached (the caller may go on: the check runs when it answers)."""
        self._encoding_checked = False
        await self._run(self._redis.ping)

    # ---- plumbing -----------------------------------------------------------------------------
    def _unavailable(self, exc: BaseException) -> IndexUnavailable:
        self._down_until = time.monotonic() + self.retry_after_s
        self._encoding_checked = False  # it may come back as another (empty) Redis
        self.unavailable_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.available:
            log.warning("redis index %s unavailable: %s", self.url, self.last_error)
        self.available = False
        return IndexUnavailable(f"redis index {self.url} unavailable: {self.last_error}")

    def _mismatch(self, stored: str) -> IndexEncodingMismatch:
        self._down_until = time.monotonic() + self.retry_after_s
        self.unavailable_errors += 1
        err = IndexEncodingMismatch(self.url, self.encoding_key, stored, ENCODING_VERSION)
        self.last_error = str(err)
        if self.encoding_error is None or self.encoding_error.stored != stored:
            log.error("%s", err)
        self.encoding_error = err
        self.available = False
        return err

    def _layout_error(self, stored: str, key: str, expected: Any, message: str) -> IndexLayoutMismatch:
        """Record and return an :class:`IndexLayoutMismatch` (handled as an encoding mismatch)."""
        self._down_until = time.monotonic() + self.retry_after_s
        self.unavailable_errors += 1
        err = IndexLayoutMismatch(self.url, key, stored, expected, message)
        self.last_error = str(err)
        if self.encoding_error is None or str(self.encoding_error) != str(err):
            log.error("%s", err)
        self.encoding_error = err
        self.available = False
        return err

    async def _check_encoding(self) -> None:
        """Write our encoding version if the namespace has none, then compare (one round trip).
        Raises IndexEncodingMismatch, IndexLayoutMismatch when the server is a Redis Cluster node,
        or what redis-py raises."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.info("cluster")
            pipe.set(self.encoding_key, str(ENCODING_VERSION), nx=True)
            pipe.get(self.encoding_key)
            info, *rest = await pipe.execute(raise_on_error=False)
        if isinstance(info, dict) and info.get("cluster_enabled"):
            raise self._layout_error(
                "", "cluster", "standalone",
                f"redis index {self.url}: the server is a Redis Cluster node; this index is configured "
                f"for one standalone Redis. Set cluster: true in the index config (the agent: "
                f"--index-cluster) to shard the index over the cluster.")
        for r in (info, *rest):
            if isinstance(r, Exception):
                raise r
        stored = rest[1]
        if stored is not None and stored != str(ENCODING_VERSION).encode():
            raise self._mismatch(stored.decode(errors="replace"))
        self._encoding_checked = stored is not None
        if self.encoding_error is not None:
            log.info("redis index %s: block-key encoding version %d matches now", self.url, ENCODING_VERSION)
            self.encoding_error = None

    async def _run(self, call: Callable[[], Awaitable[_T]]) -> _T:
        if time.monotonic() < self._down_until:
            self.unavailable_errors += 1
            if self.encoding_error is not None:
                raise self.encoding_error.again()
            raise IndexUnavailable(f"redis index {self.url} unavailable: {self.last_error}")
        try:
            if not self._encoding_checked:
                await self._check_encoding()
            result = await call()
        except _CONNECTION_ERRORS as exc:
            raise self._unavailable(exc) from exc
        if not self.available:
            log.info("redis index %s reachable again", self.url)
            self.available = True
        return result

    async def _script(self, script: AsyncScript, args: list[str | int | bytes]) -> Any:
        """Run a Lua script (no KEYS); returns its reply as redis-py decodes it."""
        return await self._run(lambda: script(keys=[], args=args))

    async def _slot_table(self) -> dict[str, int]:
        raw = await self._run(lambda: self._redis.hgetall(self.prefix + "slots"))
        return {name.decode(): int(slot) for name, slot in raw.items()}

    async def _refresh_slots(self) -> None:
        """Reload the slot -> worker table and the epoch it belongs to."""
        async def read() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.get(self.prefix + "epoch")
                pipe.hgetall(self.prefix + "slots")
                return await pipe.execute()
        epoch, flat = await self._run(read)
        self._epoch = epoch or b""
        self._names = {int(slot): name.decode() for name, slot in flat.items()}
        hb = (f"{self.prefix}hb:{s}".encode() for s in range(len(self._names)))
        self._hb_mget = _command(b"MGET", *hb) if self._names else b""

    async def _roundtrip(self, request: Sequence[bytes | bytearray], replies: int) -> list[Any]:
        """Send pre-encoded commands in one write and read their ``replies`` (one round trip).
        The connection is dropped on any failure, so a half-read reply never reaches the next
        caller. Raises what redis-py raises (connection errors, timeouts, ResponseError)."""
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(request, check_health=False)
            return [await conn.read_response() for _ in range(replies)]
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    # ---- writes -------------------------------------------------------------------------------
    async def apply_ops(self, worker: str, ops: Sequence[tuple[str, str, Sequence[int]]]) -> int:
        """Apply ``(op, tier, keys)`` in order in one round trip; ``op`` is ``"store"`` or
        ``"remove"`` (the agent's per-batch writes). Returns how many removed keys were absent.
        Raises ValueError on an unknown op or tier, IndexUnavailable when Redis is down."""
        missing, _ = await self._write_ops(worker, ops)
        return missing

    async def _write_ops(self, worker: str, ops: Sequence[tuple[str, str, Sequence[int]]]) -> tuple[int, int]:
        """:meth:`apply_ops`, returning ``(absent removed keys, change-log seq)``; seq 0 when
        there was nothing to write."""
        args: list[str | int | bytes] = [self.prefix, worker, int(self.heartbeat_ttl_s * 1000), self.stream_maxlen]
        for op, tier, keys in ops:
            code, t = _op_code(op, tier)
            if keys:
                args += [code, t, _pack(keys)]
            if op == "remove" and t == 0 and self._spec:
                self._drop_speculative(worker, keys)
        if len(args) == 4:
            return 0, 0
        missing, seq = await self._script(self._apply_script, args)
        return int(missing), int(seq)

    async def drop_speculative(self, worker: str, keys: Sequence[int]) -> None:
        """Local to this process, as :meth:`store_speculative`; never touches Redis."""
        self._drop_speculative(worker, keys)

    def _drop_speculative(self, worker: str, keys: Sequence[int]) -> None:
        """Forget ``worker``'s speculative entries for ``keys`` (their heap entries expire as stale)."""
        for key in keys:
            per_key = self._spec.get(key)
            if per_key is not None and per_key.pop(worker, None) is not None and not per_key:
                del self._spec[key]

    async def store(self, worker: str, tier: str, keys: Sequence[int]) -> None:
        await self.apply_ops(worker, [("store", tier, keys)])

    async def remove(self, worker: str, tier: str, keys: Sequence[int]) -> int:
        return await self.apply_ops(worker, [("remove", tier, keys)])

    async def clear_worker(self, worker: str, tier: str | None = None) -> None:
        """Forget ``worker``'s entries: one tier, or (``tier`` None) every tier plus its heartbeat,
        published marker and speculative entries (the purge of a removed worker). Runs in batches
        of ``_CLEAR_BATCH`` keys per script call, so Redis is never blocked for long."""
        await self._clear(worker, tier)
        if tier is None:
            for key in [k for k, d in self._spec.items() if worker in d]:
                del self._spec[key][worker]
                if not self._spec[key]:
                    del self._spec[key]

    async def _clear(self, worker: str, tier: str | None) -> int:
        """The Redis side of :meth:`clear_worker`; returns the change-log seq of its last change
        (0: nothing changed). Raises ValueError on an unknown tier, IndexUnavailable."""
        tiers = [check_tier(tier)] if tier is not None else list(range(len(TIERS)))
        forget = "1" if tier is None else "0"
        last = 0
        for t in tiers:
            first = "1"
            while True:
                n, seq = await self._script(self._clear_script, [self.prefix, worker, t, _CLEAR_BATCH, first, forget,
                                                                 self.stream_maxlen])
                first = forget = "0"
                last = max(last, int(seq))
                if int(n) < _CLEAR_BATCH:
                    break
        return last

    async def publish_speculative(self, entries: Sequence[tuple[str, float | None, Sequence[int] | bytes]]) -> int:
        """Append ``(worker, ttl_s, keys)`` speculative entries to the change log (one round trip),
        for the replicas that read it (:class:`kvcore.index.redis_mirror.RedisMirrorIndex`); the
        Redis index state itself does not keep them. ``ttl_s`` None withdraws ``worker``'s
        speculative entries of ``keys`` (a log record of its own, in order with the others).
        ``keys``: ints, or already packed as 8-byte big-endian. Returns the log seq of the last
        entry (0 for none). Raises ValueError for keys that are not unsigned 64-bit ints,
        IndexUnavailable."""
        args: list[str | int | bytes] = [self.prefix, self.stream_maxlen]
        for worker, ttl_s, keys in entries:
            packed = keys if isinstance(keys, (bytes, bytearray)) else _pack(keys)
            if packed:
                args += [worker, speculative_ttl_ms(ttl_s), packed]
        if len(args) == 2:
            return 0
        return int(await self._script(self._speculative_script, args))

    async def heartbeat(self, worker: str, ttl_s: float | None = None, mark_published: bool = False,
                        state: dict[str, Any] | None = None) -> bool:
        """Keep ``worker`` counting for ``ttl_s`` (default ``heartbeat_ttl_s``) more seconds.
        ``mark_published``: the caller just published its full state. ``state``: the agent's
        ingest state (JSON-serialisable), kept for the same TTL for :meth:`worker_states`. Returns
        whether the published marker was there before (False: Redis lost or purged the worker's
        entries, so the agent should publish again). Raises IndexUnavailable; TypeError when
        ``state`` is not JSON-serialisable."""
        ttl_ms = int((ttl_s or self.heartbeat_ttl_s) * 1000)
        state_json = "" if state is None else json.dumps(state, separators=(",", ":"))
        had = await self._script(self._heartbeat_script,
                                 [self.prefix, worker, ttl_ms, "1" if mark_published else "0", state_json])
        if not await self._still_published(worker, mark_published):
            had = 0
        if not had:  # Redis may have lost everything (restart, flush): compare the encoding again
            self._encoding_checked = False
        return bool(had)

    async def _still_published(self, worker: str, mark_published: bool) -> bool:
        """Part of :meth:`heartbeat`, after the published marker was read (and, with
        ``mark_published``, set): False when ``worker``'s published entries were lost elsewhere
        than the marker shows. Always True here (the marker is in the same Redis); the cluster
        index compares its partitions' epochs. Raises IndexUnavailable."""
        return True

    async def store_speculative(self, worker: str, keys: Sequence[int], ttl_s: float) -> None:
        """Local to this process (see the module docstring); never touches Redis."""
        now = self._clock()
        self._expire(now)
        expiry = now + ttl_s
        for key in keys:
            self._spec.setdefault(key, {})[worker] = expiry
            heapq.heappush(self._spec_heap, (expiry, key, worker))

    def _expire(self, now: float) -> None:
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            _, key, worker = heapq.heappop(heap)
            per_key = self._spec.get(key)
            if per_key is None:
                continue
            exp = per_key.get(worker)
            if exp is not None and exp <= now:
                del per_key[worker]
                if not per_key:
                    del self._spec[key]

    # ---- reads --------------------------------------------------------------------------------
    async def _bitmaps(self, keys: Sequence[int]) -> tuple[list[bytes | None], list[Any]]:
        """Each key's worker bitmap (None: nobody holds it) and each slot's heartbeat flag (None:
        not alive), in one round trip; the slot table is re-read and the lookup repeated once
        when a worker was added or Redis restarted (slot numbers changed, and the encoding key
        may be gone). Raises IndexUnavailable."""
        mget = _mget_fixed(self._bitmap_prefix, _pack(keys))
        for _ in range(2):
            request = [mget, self._hb_mget, self._epoch_get, self._slots_hlen]
            replies = await self._run(lambda: self._roundtrip(request, 4 if self._hb_mget else 3))
            vals, flags = replies[0], (replies[1] if self._hb_mget else [])
            if (replies[-2] or b"") == self._epoch and replies[-1] == len(self._names):
                break
            self._encoding_checked = False
            await self._refresh_slots()
        return vals, flags

    async def match(self, keys: Sequence[int]) -> dict[str, TierMatch]:
        """Per worker, the longest run of ``keys`` from block 0 by tier (see
        :mod:`kvcore.index.base`); workers without a live heartbeat count only their speculative
        entries. One round trip. Raises IndexUnavailable when Redis is down."""
        if not keys:
            return {}
        if self._spec_heap:
            self._expire(self._clock())
        spec = self._spec
        spec_reach = 0
        if spec:
            while spec_reach < len(keys) and keys[spec_reach] in spec:
                spec_reach += 1
        vals, flags = await self._bitmaps(keys)
        # rows fetched: up to the first key nobody holds, at least as far as speculative entries reach
        try:
            count = vals.index(None, spec_reach)
        except ValueError:
            count = len(keys)
        # run-length code the bitmaps: a row only where the bitmap differs from the block before
        starts = [0] if count else []
        starts += compress(range(1, count), map(ne, islice(vals, 1, count), vals))
        bitmaps = [vals[i] or b"" for i in starts]
        alive_mask = 0
        for s, flag in enumerate(flags):
            if flag is not None:
                alive_mask |= 0b111 << (4 * s)
                if s in self._names:
                    self._agent_workers.add(self._names[s])
        names = self._names
        spec_slots: dict[str, int] = {}
        if spec_reach:
            # speculative workers by name -> their Redis slot, or a local slot past Redis's ones
            by_name = {w: s for s, w in names.items()}
            for i in range(spec_reach):
                for w in spec[keys[i]]:
                    if w not in spec_slots:
                        s = by_name.get(w)
                        spec_slots[w] = s if s is not None else len(self._names) + len(spec_slots)
            names = dict(names)
            names.update({s: w for w, s in spec_slots.items()})
        if not spec_reach and count and (len(starts) >= _MANY_CHANGES or len(flags) > _MANY_SLOTS):
            return _match_rows(bitmaps, starts, count, alive_mask, names)
        n_rows = max(count, spec_reach)
        # Rows only change where a bitmap changes or speculative bits apply; visit just those.
        points = sorted(set(starts) | set(range(spec_reach + 1))) if spec_reach else starts
        gpu_sel = ((1 << (4 * (max(names, default=0) + 1))) - 1) // 15  # bit 4*s for every slot s
        other_sel = (gpu_sel << 1) | (gpu_sel << 2)
        g = gc = a = 0
        drops: list[tuple[int, int, int, int]] = []
        end = n_rows
        seg = -1
        last_seg = len(starts) - 1
        for i in points:
            if i >= n_rows:
                break
            while seg < last_seg and starts[seg + 1] <= i:
                seg += 1
            bits = int.from_bytes(bitmaps[seg].translate(_REV_BITS), "little") & alive_mask if i < count else 0
            if i < spec_reach:
                for w in spec[keys[i]]:
                    bits |= 1 << (4 * spec_slots[w])
            if i == 0:  # the memory backend's three chains; a worker's bit sits at position 4*slot
                g = bits & gpu_sel
                gc = (bits | bits >> 1) & gpu_sel
                a = (bits | bits >> 1 | bits >> 2) & gpu_sel
                if not a:
                    return {}
                continue
            if not bits:
                end = i
                break
            if bits & other_sel:
                ng, ngc, na = g & bits, gc & (bits | bits >> 1), a & (bits | bits >> 1 | bits >> 2)
                if ng == g and ngc == gc and na == a:
                    continue
            else:
                if a & bits == a:
                    continue
                ng, ngc, na = g & bits, gc & bits, a & bits
            drops.append((g & ~ng, gc & ~ngc, a & ~na, i))
            g, gc, a = ng, ngc, na
            if not a:
                end = i
                break
        if n_rows == 0:
            return {}
        return tier_matches(drops, (g, gc, a), end, names, 4)

    async def gpu_holders(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker, which of ``keys`` it holds in gpu (a bit per position); workers without a
        live heartbeat count only their speculative entries. One round trip. Raises
        IndexUnavailable when Redis is down."""
        if not keys:
            return {}
        if self._spec_heap:
            self._expire(self._clock())
        vals, flags = await self._bitmaps(keys)
        alive = {s for s, flag in enumerate(flags) if flag is not None}
        out: dict[str, int] = {}
        for i, raw in enumerate(vals):
            if raw:
                bits = int.from_bytes(raw.translate(_REV_BITS), "little")
                for s in alive:
                    if bits >> (4 * s) & 1 and s in self._names:
                        out[self._names[s]] = out.get(self._names[s], 0) | 1 << i
            for w in self._spec.get(keys[i], ()):
                out[w] = out.get(w, 0) | 1 << i
        return out

    async def stats(self) -> dict[str, WorkerIndexStats]:
        """Per worker holding anything (confirmed or speculative), block counts by tier."""
        workers = sorted((await self._slot_table()).items(), key=lambda kv: kv[1])
        if self._spec_heap:
            self._expire(self._clock())
        c_all = await self._owned_counts([slot for _, slot in workers]) if workers else []
        spec_counts: dict[str, int] = {}
        for per_key in self._spec.values():
            for w in per_key:
                spec_counts[w] = spec_counts.get(w, 0) + 1
        out: dict[str, WorkerIndexStats] = {}
        for i, (worker, _) in enumerate(workers):
            c = c_all[i * len(TIERS):(i + 1) * len(TIERS)]
            if any(c):
                out[worker] = WorkerIndexStats(blocks={t: int(c[j]) for j, t in enumerate(TIERS)})
        for worker, n in spec_counts.items():  # like the memory backend: a worker holding nothing is absent
            out.setdefault(worker, WorkerIndexStats()).speculative_blocks = n
        return out

    async def _owned_counts(self, slots: Sequence[int]) -> list[int]:
        """Blocks held (owned-set sizes) per slot of ``slots`` and tier, flat: ``slots[i]``'s tier
        ``t`` at ``i * len(TIERS) + t``. One round trip. Raises IndexUnavailable."""
        async def counts() -> list[int]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for slot in slots:
                    for t in range(len(TIERS)):
                        pipe.scard(f"{self.prefix}o:{slot}:{t}")
                return await pipe.execute()
        return await self._run(counts)

    async def worker_states(self) -> dict[str, dict[str, Any]]:
        """Per worker whose agent published within the heartbeat TTL, that agent's ingest state
        (the dict it passed to :meth:`heartbeat`) plus ``published_age_s`` (seconds since it was
        written) and ``last_event_age_s`` advanced by that age; both ages use Redis's clock, so
        the agent's and the gateway's clocks need not agree. One round trip. Raises
        IndexUnavailable."""
        now, flat = await self._script(self._states_script, [self.prefix])
        now_s = float(now)
        out: dict[str, dict[str, Any]] = {}
        for i in range(0, len(flat), 3):
            try:
                state = json.loads(flat[i + 2])
            except ValueError:
                continue  # not written by this module
            if not isinstance(state, dict):
                continue
            published_age_s = max(0.0, now_s - float(flat[i + 1]))
            state["published_age_s"] = round(published_age_s, 3)
            if isinstance(state.get("last_event_age_s"), (int, float)):
                state["last_event_age_s"] = round(state["last_event_age_s"] + published_age_s, 3)
            out[flat[i].decode()] = state
        return out

    def agent_fed(self, worker: str) -> bool:
        """Whether a lookup has seen ``worker`` with a live agent heartbeat (its events reach
        this index), so speculative entries for it need to outlive only the events' lag."""
        return worker in self._agent_workers

    async def live_workers(self) -> set[str]:
        """Workers whose heartbeat has not expired. Raises IndexUnavailable."""
        names = sorted((await self._slot_table()).items(), key=lambda kv: kv[1])
        if not names:
            return set()

        async def flags() -> list[int]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for _, s in names:
                    pipe.exists(f"{self.prefix}hb:{s}")
                return await pipe.execute()
        return {w for (w, _), f in zip(names, await self._run(flags)) if f}

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except _CONNECTION_ERRORS:
            pass
