"""Redis index sharded over a Redis Cluster: block keys in a fixed number of partitions.

Config: ``index: {backend: redis, url: redis://<any node>:<port>, cluster: true}`` (with the mirror,
the default, :class:`kvcore.index.redis_cluster_mirror.RedisClusterMirrorIndex`; ``mirror: false``
is this class). The agent: ``--index redis://<any node>:<port> --index-cluster``. Cluster mode is
chosen in config, not detected: a standalone index opened on a cluster node, or a cluster index
opened on a standalone server, refuses to start with :class:`kvcore.index.errors.IndexLayoutMismatch`
saying which setting to change.

Layout. The schema of :mod:`kvcore.index.redis`, split in two kinds of key groups, each group under
one hash tag, so that it lives in one cluster slot and every Lua script touches one slot:

- the meta group, prefix ``{ns}:`` (``ns`` = namespace, default ``kvr``): the worker slot table
  (``slots``, ``epoch``), heartbeats ``hb:s``, published markers ``m:s``, agents' ingest states
  ``st:s``, the encoding version ``meta:block_key_encoding`` and the partition count
  ``meta:partitions``;
- :data:`PARTITIONS` partition groups, prefix ``{ns:pNN.J}:`` (``NN`` the partition number,
  ``J`` the first integer that puts partition ``NN``'s tag within 32 slots of the middle of the
  ``NN``-th of ``partitions`` equal ranges of the 16,384 cluster slots, so that a cluster whose
  nodes hold contiguous slot ranges of equal size, as ``redis-cli --cluster create`` makes them,
  gets an even share of partitions per node: 5, 6 and 5 of 16 on 3 nodes). Block
  key ``k`` lives in partition ``k % partitions``. Each partition holds what the standalone
  schema holds per block key: bitmaps ``b:raw(k)``, owned sets ``o:s:t``, duplicate counters
  ``rc:s:t``, and its own change log ``seq`` + ``log`` (entries in the standalone format, with
  only that partition's keys), plus ``epoch`` (set on its first write: a new value means the
  partition lost its data, e.g. its shard restarted without persistence), ``mepoch`` (the meta
  ``epoch`` its slot numbers belong to) and ``nslots``.

Worker slot numbers come from the meta group (allocated on first use, never reused); a writer
resolves and caches its slot there and passes it with the meta epoch to the partition scripts.
A partition whose ``mepoch`` differs from the meta ``epoch`` was written under a slot table the
meta group no longer has (the meta shard lost its data): lookups ignore it, and the first writer
that meets it, after re-reading its slot, wipes it (every key of the partition, one script call,
so the shard is busy for as long as deleting them takes; counted in ``partition_wipes``) and
writes on; the agents republish everything anyway since their published markers are gone.

Round trips. A write (:meth:`RedisClusterIndex.apply_ops`) is one script call per partition its
keys fall in, sent as one pipeline per node, all nodes at once (plus the heartbeat ``SET`` on the
meta node): atomic per partition, not across partitions. A lookup is one pipeline per node, all
nodes at once: per partition of the prompt one ``MGET`` of its bitmaps and, as its last key, its
``mepoch``; on the meta node also the heartbeats, epoch and slot count. Requests are laid out here
(pre-encoded, :func:`kvcore.index.redis._mget_fixed`, without a Python step per key) and sent on
one connection per node taken from that node's pool; redis-py's ``RedisCluster`` (which encodes
every argument in Python) is used by neither path. The slot -> node map comes from ``CLUSTER
SLOTS`` (of the URL's node, else of any node known); ``MOVED``/``ASK``/``TRYAGAIN``/``CLUSTERDOWN``
re-read it and repeat the call once, then raise IndexUnavailable. A heartbeat also reads every partition's ``epoch``: when one differs from what it was when
the agent last published (``mark_published``), it answers False, so the agent republishes
(:class:`kvcore.kv_events.EventIngestor`).

Failure: as :mod:`kvcore.index.redis`; a node that cannot be reached (a shard down, restarting)
fails every call that needs it with :class:`kvcore.index.errors.IndexUnavailable` (a lookup needs
every node holding a partition of the prompt, so in practice all of them). Resharding: once a
partition's slot has moved to another node, the next call's ``MOVED`` re-reads the map; while the
slot is migrating (its keys on both nodes, ``ASK``), calls that touch that partition raise
IndexUnavailable.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from kvcore.block_keys import ENCODING_VERSION
from kvcore.index.base import TIERS, check_tier
from kvcore.index.redis import (_CLEAR_BATCH, _CONNECTION_ERRORS, DEFAULT_STREAM_MAXLEN, ENCODING_KEY, RedisIndex,
                                _command, _mget_fixed, _op_code, _pack, _unpack)
from kvcore.index.redis_scripts import LOG, SLOT_OF, SPECULATIVE_LUA, apply_body, clear_body, speculative_ttl_ms

_T = TypeVar("_T")
log = logging.getLogger("kvroute.index.redis_cluster")
PARTITIONS = 16  # block-key partitions of a cluster index (written to Redis: all processes must agree)
PARTITIONS_KEY = "meta:partitions"  # after the meta prefix
_REDIRECTS = (redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.TryAgainError,
              redis.exceptions.ClusterDownError)
_TAG_NEAR_SLOTS = 32  # a partition's tag hashes this close to the middle of its slot range
_STALE = -1  # a partition script's answer: its slot numbers belong to another meta epoch

# A partition's guard, first in every partition write script: ARGV[1] prefix, ARGV[2] worker,
# ARGV[3] slot, ARGV[4] meta epoch. Returns from the script with {-1, 0} when the partition was
# written under another meta epoch.
_PART_GUARD = """
local p = ARGV[1]
local me = redis.call('GET', p .. 'mepoch')
if not me then
  redis.call('SET', p .. 'mepoch', ARGV[4])
elseif me ~= ARGV[4] then
  return {-1, 0}
end
if redis.call('EXISTS', p .. 'epoch') == 0 then
  local t = redis.call('TIME')
  redis.call('SET', p .. 'epoch', t[1] .. '.' .. t[2])
end
local slot = tonumber(ARGV[3])
if slot >= tonumber(redis.call('GET', p .. 'nslots') or '0') then redis.call('SET', p .. 'nslots', slot + 1) end
"""

# KEYS[1] the partition's seq key (routing). ARGV: prefix, worker, slot, meta epoch, heartbeat
# ttl ms, log maxlen, then (op 's'|'r', tier, packed keys) triples, as the standalone apply script.
# Returns {keys removed that were absent, log seq} or {-1, 0}.
_PART_APPLY_LUA = LOG + "local function body()" + _PART_GUARD + "\n" + apply_body(ttl=5, first=7, maxlen=6) + """end
return body()
"""

# KEYS[1] the partition's seq key. ARGV: prefix, worker, slot, meta epoch, tier, batch size, first
# call ('1' drops the duplicate counters first), forget ('1': log the purge 'F'), log maxlen.
# Returns {keys cleared, log seq (0: nothing changed)} or {-1, 0}.
_PART_CLEAR_LUA = LOG + "local function body()" + _PART_GUARD + """
local t = ARGV[5]
""" + clear_body(tier="t", batch=6, first=7, forget=8, maxlen=9) + """end
return body()
"""

# KEYS[1] the partition's seq key. ARGV: prefix, meta epoch. Deletes the partition's index state
# (bitmaps, owned sets, duplicate counters of every slot it has seen), then takes the meta epoch
# and a new partition epoch (readers reload it, agents republish). The log and its seq stay.
_PART_WIPE_LUA = """
local p = ARGV[1]
local n = tonumber(redis.call('GET', p .. 'nslots') or '0')
for s = 0, n - 1 do
  for t = 0, 2 do
    local o = p .. 'o:' .. s .. ':' .. t
    local ks = redis.call('SMEMBERS', o)
    local batch = {}
    for _, k in ipairs(ks) do
      batch[#batch + 1] = p .. 'b:' .. k
      if #batch == 1000 then redis.call('DEL', unpack(batch)); batch = {} end
    end
    if #batch > 0 then redis.call('DEL', unpack(batch)) end
    redis.call('DEL', o, p .. 'rc:' .. s .. ':' .. t)
  end
end
redis.call('DEL', p .. 'nslots')
redis.call('SET', p .. 'mepoch', ARGV[2])
local t = redis.call('TIME')
redis.call('SET', p .. 'epoch', t[1] .. '.' .. t[2] .. '.w')
return n
"""

# KEYS[1] the meta slots key. ARGV: meta prefix, worker, forget ('1': drop heartbeat, published
# marker and ingest state). Returns {slot, meta epoch}.
_META_SLOT_LUA = SLOT_OF + """
local p = ARGV[1]
local slot = slot_of(p, ARGV[2])
if ARGV[3] == '1' then redis.call('DEL', p .. 'hb:' .. slot, p .. 'm:' .. slot, p .. 'st:' .. slot) end
return {slot, redis.call('GET', p .. 'epoch')}
"""


def partition_tags(namespace: str, partitions: int) -> list[str]:
    """The hash tag of each partition (``{ns:pNN.J}``, braces included), spread over the cluster's
    16,384 slots: partition ``i``'s tag hashes within 32 slots of the middle of the ``i``-th of
    ``partitions`` equal slot ranges (``J``: the first integer that does). Raises ValueError for
    ``partitions`` outside 1..1024."""
    if not 1 <= partitions <= 1024:
        raise ValueError(f"partitions must be 1..1024, got {partitions}")
    tags = []
    width = REDIS_CLUSTER_HASH_SLOTS / partitions
    near = max(1, min(_TAG_NEAR_SLOTS, int(width / 2)))
    for i in range(partitions):
        mid = int((i + 0.5) * width)
        j = 0
        while abs(key_slot(f"{namespace}:p{i:02d}.{j}".encode()) - mid) >= near:
            j += 1
        tags.append(f"{{{namespace}:p{i:02d}.{j}}}")
    return tags


def _raise_error_reply(replies: Sequence[Any]) -> None:
    """Raise the first of ``replies`` that is an exception (an error reply, or a failed node's
    error from ``asyncio.gather``); return when there is none."""
    for r in replies:
        if isinstance(r, BaseException):
            raise r


def _mget_and(prefix: bytes, packed: bytes, last: bytes) -> bytearray:
    """:func:`kvcore.index.redis._mget_fixed` of ``packed`` with one more key, ``last``, at the end."""
    n = len(packed) // 8
    buf = _mget_fixed(prefix, packed)
    head = b"*%d\r\n" % (n + 1)
    return bytearray(b"*%d\r\n" % (n + 2)) + buf[len(head):] + b"$%d\r\n%s\r\n" % (len(last), last)


class RedisClusterIndex(RedisIndex):
    """The shared index over a Redis Cluster; see the module docstring for layout, costs and
    failure handling. Takes :class:`kvcore.index.redis.RedisIndex`'s arguments (``url``: any
    node of the cluster, ``redis://[user:password@]host:port``; the cluster's other nodes are
    reached with the same credentials) plus ``partitions``: how many block-key partitions
    (:data:`PARTITIONS`; every gateway and agent of one namespace must use the same, checked at
    open). Raises ValueError on a bad value."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", namespace: str = "kvr",
                 heartbeat_ttl_s: float = 10.0, socket_timeout_s: float = 0.5,
                 retry_after_s: float = 1.0, stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
                 clock: Callable[[], float] = time.monotonic, partitions: int = PARTITIONS) -> None:
        super().__init__(url, namespace, heartbeat_ttl_s, socket_timeout_s, retry_after_s, stream_maxlen, clock)
        self.namespace = namespace
        self._set_partitions(partitions)
        self.prefix = f"{{{namespace}}}:"  # the meta group; the base class's meta-key methods use it
        self.meta_slot = key_slot(namespace.encode())
        self.encoding_key = f"{self.prefix}{ENCODING_KEY}"
        self.partitions_key = f"{self.prefix}{PARTITIONS_KEY}"
        p = self.prefix.encode()
        self._epoch_get = _command(b"GET", p + b"epoch")
        self._slots_hlen = _command(b"HLEN", p + b"slots")
        self._seed = self._redis
        self._scripts = {name: self._seed.register_script(src) for name, src in (
            ("apply", _PART_APPLY_LUA), ("clear", _PART_CLEAR_LUA), ("wipe", _PART_WIPE_LUA),
            ("speculative", SPECULATIVE_LUA), ("meta_slot", _META_SLOT_LUA))}
        self._url_parts = urlsplit(url)
        self._clients: dict[tuple[str, int], aioredis.Redis] = {}
        self._slot_ranges: list[tuple[int, int, tuple[str, int]]] | None = None  # None: map not read
        self._part_nodes: list[tuple[str, int]] = []
        self._meta_node: tuple[str, int] | None = None
        self._worker_slots: dict[str, int] = {}  # worker -> slot, valid for self._slots_epoch
        self._slots_epoch = b""
        self._published_epochs: dict[str, list[bytes | None]] = {}  # worker -> partition epochs at publish
        self.partition_wipes = 0  # partitions this process wiped (written under a lost slot table)

    def _set_partitions(self, partitions: int) -> None:
        """Lay out ``partitions`` partitions (their tags, slots, key prefixes). Raises ValueError."""
        tags = partition_tags(self.namespace, int(partitions))
        self.partitions = int(partitions)
        self.part_prefixes = [f"{tag}:" for tag in tags]
        self.part_slots = [key_slot(tag[1:-1].encode()) for tag in tags]
        self._part_bitmap_prefix = [pp.encode() + b"b:" for pp in self.part_prefixes]
        self._part_mepoch_key = [pp.encode() + b"mepoch" for pp in self.part_prefixes]
        self._slot_ranges = None

    # ---- topology -----------------------------------------------------------------------------
    def _client(self, addr: tuple[str, int]) -> aioredis.Redis:
        client = self._clients.get(addr)
        if client is None:
            u = self._url_parts
            auth = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""
            node_url = urlunsplit((u.scheme or "redis", f"{auth}{addr[0]}:{addr[1]}", "/0", u.query, ""))
            client = self._clients[addr] = aioredis.Redis.from_url(
                node_url, socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.socket_timeout_s,
                retry=Retry(NoBackoff(), 0), health_check_interval=0)
        return client

    def _node_of(self, slot: int) -> tuple[str, int]:
        assert self._slot_ranges is not None
        for lo, hi, addr in self._slot_ranges:
            if lo <= slot <= hi:
                return addr
        raise redis.exceptions.ClusterDownError(f"slot {slot} is not served by any node")

    async def _discover(self) -> None:
        """Read the slot -> node map (``CLUSTER SLOTS``) from the URL's node, else from any node
        known; route partitions and the meta group. Raises IndexLayoutMismatch when the server is
        not a cluster node, what redis-py raises when no node answers."""
        last: BaseException | None = None
        for client in [self._seed, *self._clients.values()]:
            try:
                raw = await client.execute_command("CLUSTER SLOTS")
                break
            except redis.exceptions.ResponseError as exc:
                if "cluster support disabled" in str(exc).lower():
                    raise self._layout_error(
                        "", "standalone", "cluster",
                        f"redis index {self.url}: configured with cluster: true, but the server is not a "
                        f"Redis Cluster node (cluster support disabled). Remove cluster: true (the agent: "
                        f"--index-cluster) to use it as one standalone index, or point url at a node of "
                        f"the cluster.") from None
                last = exc
            except _CONNECTION_ERRORS as exc:
                last = exc
        else:
            assert last is not None
            raise last
        ranges = []
        for lo, hi, primary, *_ in raw:
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            ranges.append((int(lo), int(hi), (host or self._url_parts.hostname or "127.0.0.1", int(primary[1]))))
        self._slot_ranges = sorted(ranges)
        self._part_nodes = [self._node_of(s) for s in self.part_slots]
        self._meta_node = self._node_of(self.meta_slot)
        self._redis = self._client(self._meta_node)

    def shard_of_partitions(self) -> dict[tuple[str, int], list[int]]:
        """Node address -> the partitions it holds, from the map read last (empty before the
        first call reached the cluster)."""
        out: dict[tuple[str, int], list[int]] = {}
        for i, addr in enumerate(self._part_nodes):
            out.setdefault(addr, []).append(i)
        return out

    # ---- plumbing -----------------------------------------------------------------------------
    async def _check_encoding(self) -> None:
        """Read the node map, then write our encoding version and partition count where the
        namespace has none and compare both (one round trip to the meta node). Raises
        IndexEncodingMismatch, IndexLayoutMismatch, or what redis-py raises."""
        await self._discover()
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self.encoding_key, str(ENCODING_VERSION), nx=True)
            pipe.get(self.encoding_key)
            pipe.set(self.partitions_key, str(self.partitions), nx=True)
            pipe.get(self.partitions_key)
            _, stored, _, parts = await pipe.execute()
        if stored is not None and stored != str(ENCODING_VERSION).encode():
            raise self._mismatch(stored.decode(errors="replace"))
        if parts is not None and parts != str(self.partitions).encode():
            raise self._layout_error(
                parts.decode(errors="replace"), self.partitions_key, self.partitions,
                f"redis index {self.url}: partition count mismatch: the cluster index holds block keys in "
                f"{parts.decode(errors='replace')} partitions (key {self.partitions_key!r}), this process "
                f"uses {self.partitions}. Run the same kvroute release and partitions setting on every "
                f"gateway and agent sharing this index; to change it, stop them all, delete the "
                f"namespace's keys on every node and start them again (agents republish by themselves).")
        self._encoding_checked = stored is not None and parts is not None
        if self.encoding_error is not None:
            self.encoding_error = None

    async def _run(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """As :meth:`RedisIndex._run`; a cluster redirection (slot moved, cluster down) re-reads
        the node map and repeats ``call`` once, then counts as unavailable."""
        try:
            return await super()._run(call)
        except _REDIRECTS:
            self._encoding_checked = False  # re-reads the node map first
        try:
            return await super()._run(call)
        except _REDIRECTS as exc:
            raise self._unavailable(exc) from exc

    async def _script(self, script: Any, args: list[str | int | bytes]) -> Any:
        """A meta-group script on the meta node (its slots key declared, for routing)."""
        return await self._run(lambda: script(keys=[self.prefix + "slots"], args=args, client=self._redis))

    async def _node_calls(self, requests: dict[tuple[str, int], list[bytes | bytearray]],
                          ) -> dict[tuple[str, int], list[Any]]:
        """Send each node its pre-encoded commands in one write, all nodes at once; each node's
        replies in order (a command's error reply is returned in its place as the exception).
        Raises what redis-py raises for a connection failure or timeout."""
        async def one(addr: tuple[str, int], request: list[bytes | bytearray]) -> list[Any]:
            pool = self._client(addr).connection_pool
            conn = await pool.get_connection()
            try:
                await conn.send_packed_command(request, check_health=False)
                out = []
                for _ in request:
                    try:
                        out.append(await conn.read_response())
                    except redis.exceptions.ResponseError as exc:
                        out.append(exc)
                return out
            except BaseException:
                await conn.disconnect()
                raise
            finally:
                await pool.release(conn)
        addrs = list(requests)
        if len(addrs) == 1:
            return {addrs[0]: await one(addrs[0], requests[addrs[0]])}
        replies = await asyncio.gather(*(one(a, requests[a]) for a in addrs), return_exceptions=True)
        _raise_error_reply(replies)
        return dict(zip(addrs, replies))  # type: ignore[arg-type]

    async def _each_partition(self, commands: Callable[[bytes], list[bytes]]) -> list[list[Any]]:
        """Send every partition the pre-encoded ``commands(its key prefix)``, one pipeline per node,
        all nodes at once; each partition's replies, in partition order (a command's error reply in
        its place as the exception). Raises what redis-py raises for a connection failure or
        timeout."""
        requests: dict[tuple[str, int], list[bytes | bytearray]] = {}
        where = []
        for part, pp in enumerate(self.part_prefixes):
            cmds = commands(pp.encode())
            req = requests.setdefault(self._part_nodes[part], [])
            where.append((self._part_nodes[part], len(req), len(cmds)))
            req += cmds
        replies = await self._node_calls(requests)
        return [replies[a][i:i + n] for a, i, n in where]

    def _evalsha(self, name: str, partition: int, args: Sequence[str | int | bytes]) -> bytes:
        sha = self._scripts[name].sha.encode()
        enc = [a if isinstance(a, (bytes, bytearray)) else str(a).encode() for a in args]
        return _command(b"EVALSHA", sha, b"1", self.part_prefixes[partition].encode() + b"seq", *enc)

    async def _part_scripts(self, calls: list[tuple[int, str, list[str | int | bytes]]],
                            extra: dict[tuple[str, int], list[bytes]] | None = None) -> list[Any]:
        """Run ``(partition, script name, ARGV)`` script calls, grouped into one pipeline per node
        (``extra``: more commands for some nodes, sent after, their replies not returned); the
        replies in ``calls`` order. A script a node has not cached is loaded and the calls
        repeated. Raises what redis-py raises; redirections as ResponseError subclasses."""
        for attempt in range(2):
            requests: dict[tuple[str, int], list[bytes | bytearray]] = {}
            where: list[tuple[tuple[str, int], int]] = []
            for part, name, args in calls:
                addr = self._part_nodes[part]
                req = requests.setdefault(addr, [])
                where.append((addr, len(req)))
                req.append(self._evalsha(name, part, args))
            for addr, cmds in (extra or {}).items():
                requests.setdefault(addr, []).extend(cmds)
            replies = await self._node_calls(requests)
            out = [replies[a][i] for a, i in where]
            missing = {a for (a, i), r in zip(where, out) if isinstance(r, redis.exceptions.NoScriptError)}
            if not missing or attempt:
                _raise_error_reply(out)
                return out
            for addr in missing:
                for script in self._scripts.values():
                    await self._client(addr).script_load(script.script)
        raise AssertionError("unreachable")

    async def _slot_for(self, worker: str, forget: bool = False) -> tuple[int, bytes]:
        """``worker``'s slot and the meta epoch (from the cache unless ``forget``, which also drops
        its heartbeat, marker and state in the meta group). Raises what redis-py raises."""
        if not forget and worker in self._worker_slots and self._slots_epoch:
            return self._worker_slots[worker], self._slots_epoch
        slot, epoch = await self._scripts["meta_slot"](
            keys=[self.prefix + "slots"], args=[self.prefix, worker, "1" if forget else "0"], client=self._redis)
        epoch = epoch or b""
        if epoch != self._slots_epoch:
            self._worker_slots = {}
            self._slots_epoch = epoch
        self._worker_slots[worker] = int(slot)
        return int(slot), epoch

    async def _guarded(self, worker: str, build: Callable[[int, bytes], list[tuple[int, str, list[Any]]]],
                       forget: bool = False, extra: Callable[[int], dict[tuple[str, int], list[bytes]]] | None = None,
                       ) -> list[Any]:
        """Run the partition script calls ``build(slot, meta_epoch)`` for ``worker``; partitions
        answering stale (another meta epoch) get the slot re-read, then are wiped if still stale,
        and their calls repeated. Replies in ``build``'s order. Raises IndexUnavailable."""
        async def attempt() -> list[Any]:
            slot, epoch = await self._slot_for(worker, forget)
            calls = build(slot, epoch)
            replies = await self._part_scripts(calls, extra(slot) if extra else None)
            stale = [i for i, r in enumerate(replies) if isinstance(r, list) and int(r[0]) == _STALE]
            if not stale:
                return replies
            self._worker_slots.pop(worker, None)
            slot2, epoch2 = await self._slot_for(worker)
            if (slot2, epoch2) != (slot, epoch):
                calls = build(slot2, epoch2)
            else:
                wiped = sorted({calls[i][0] for i in stale})
                self.partition_wipes += len(wiped)
                log.warning("redis index %s: partitions %s hold slot numbers of a lost slot table; wiping them",
                            self.url, wiped)
                await self._part_scripts([(part, "wipe", [self.part_prefixes[part], epoch2]) for part in wiped])
            replies = await self._part_scripts(calls)
            if any(isinstance(r, list) and int(r[0]) == _STALE for r in replies):
                raise redis.exceptions.TryAgainError("partition slot table changed during the write")
            return replies
        return await self._run(attempt)

    # ---- writes -------------------------------------------------------------------------------
    def _split(self, keys: Sequence[int]) -> dict[int, list[int]]:
        n = self.partitions
        out: dict[int, list[int]] = {}
        for k in keys:
            out.setdefault(k % n, []).append(k)
        return out

    async def _write_ops(self, worker: str, ops: Sequence[tuple[str, str, Sequence[int]]]) -> tuple[int, Any]:
        """:meth:`apply_ops`, returning ``(absent removed keys, {partition: change-log seq})``
        (empty when there was nothing to write)."""
        per_part: dict[int, list[tuple[str, int, bytes]]] = {}
        for op, tier, keys in ops:
            code, t = _op_code(op, tier)
            for part, pk in self._split(keys).items():
                per_part.setdefault(part, []).append((code, t, _pack(pk)))
            if op == "remove" and t == 0 and self._spec:
                self._drop_speculative(worker, keys)
        if not per_part:
            return 0, {}
        ttl_ms = int(self.heartbeat_ttl_s * 1000)
        parts = sorted(per_part)

        def build(slot: int, epoch: bytes) -> list[tuple[int, str, list[Any]]]:
            calls = []
            for part in parts:
                args: list[Any] = [self.part_prefixes[part], worker, slot, epoch, ttl_ms, self.stream_maxlen]
                for op, t, packed in per_part[part]:
                    args += [op, t, packed]
                calls.append((part, "apply", args))
            return calls

        def heartbeat(slot: int) -> dict[tuple[str, int], list[bytes]]:
            assert self._meta_node is not None
            return {self._meta_node: [_command(b"SET", f"{self.prefix}hb:{slot}".encode(), b"1", b"PX",
                                               b"%d" % ttl_ms)]}
        replies = await self._guarded(worker, build, extra=heartbeat)
        return sum(int(r[0]) for r in replies), {part: int(r[1]) for part, r in zip(parts, replies)}

    async def _clear(self, worker: str, tier: str | None) -> Any:
        """The Redis side of :meth:`clear_worker`; returns ``{partition: change-log seq of its last
        change}`` (partitions that changed). Raises ValueError on an unknown tier, IndexUnavailable."""
        tiers = [check_tier(tier)] if tier is not None else list(range(len(TIERS)))
        forget = tier is None
        last: dict[int, int] = {}
        if forget:
            await self._run(lambda: self._slot_for(worker, forget=True))
            self._published_epochs.pop(worker, None)
        for t in tiers:
            pending = {part: "1" for part in range(self.partitions)}  # partition -> first call flag
            flags = {part: "1" if forget and t == tiers[0] else "0" for part in range(self.partitions)}
            while pending:
                order = sorted(pending)

                def build(slot: int, epoch: bytes, order: list[int] = order) -> list[tuple[int, str, list[Any]]]:
                    return [(part, "clear", [self.part_prefixes[part], worker, slot, epoch, t, _CLEAR_BATCH,
                                             pending[part], flags[part], self.stream_maxlen]) for part in order]
                replies = await self._guarded(worker, build)
                for part, (n, seq) in zip(order, replies):
                    flags[part] = "0"
                    if int(seq):
                        last[part] = max(last.get(part, 0), int(seq))
                    if int(n) < _CLEAR_BATCH:
                        del pending[part]
                    else:
                        pending[part] = "0"
        return last

    async def publish_speculative(self, entries: Sequence[tuple[str, float | None, Sequence[int] | bytes]]) -> Any:
        """As :meth:`RedisIndex.publish_speculative` (``ttl_s`` None: a withdrawal), each entry
        split over the partitions of its keys (one log entry per partition). Returns
        ``{partition: log seq of its last entry}``. Raises ValueError, IndexUnavailable."""
        per_part: dict[int, list[Any]] = {}
        for worker, ttl_s, keys in entries:
            if isinstance(keys, (bytes, bytearray)):
                keys = _unpack(keys)
            ttl_ms = speculative_ttl_ms(ttl_s)
            for part, pk in self._split(keys).items():
                per_part.setdefault(part, []).extend([worker, ttl_ms, _pack(pk)])
        if not per_part:
            return {}
        parts = sorted(per_part)
        calls = [(p, "speculative", [self.part_prefixes[p], self.stream_maxlen, *per_part[p]]) for p in parts]
        replies = await self._run(lambda: self._part_scripts(calls))
        return {p: int(r) for p, r in zip(parts, replies)}

    async def _still_published(self, worker: str, mark_published: bool) -> bool:
        """Part of :meth:`RedisIndex.heartbeat`: False when a partition's epoch changed since this
        process last published ``worker`` (``mark_published``, which records the epochs): that
        partition lost its data (its shard restarted), so the heartbeat answers False and the
        agent publishes again. Raises IndexUnavailable."""
        epochs = await self._partition_epochs(create=mark_published)
        if mark_published:
            self._published_epochs[worker] = epochs
            return True
        return self._published_epochs.get(worker, epochs) == epochs

    async def _partition_epochs(self, create: bool) -> list[bytes | None]:
        """Every partition's epoch (``create``: set the missing ones first). Raises IndexUnavailable."""
        async def read() -> list[bytes | None]:
            stamp = b"%.6f.h" % time.time()

            def commands(p: bytes) -> list[bytes]:
                set_nx = [_command(b"SET", p + b"epoch", stamp, b"NX")] if create else []
                return [*set_nx, _command(b"GET", p + b"epoch")]
            out = [r[-1] for r in await self._each_partition(commands)]
            _raise_error_reply(out)
            return out
        return await self._run(read)

    # ---- reads --------------------------------------------------------------------------------
    async def _bitmaps(self, keys: Sequence[int]) -> tuple[list[bytes | None], list[Any]]:
        """Each key's worker bitmap (None: nobody holds it, or its partition belongs to another
        meta epoch) and each slot's heartbeat flag, in one pipeline per node (all nodes at once):
        per partition of ``keys`` one ``MGET`` of its bitmaps and its ``mepoch``; on the meta node
        the heartbeats, epoch and slot count. The slot table is re-read and the lookup repeated
        once when it changed. Raises ValueError for keys that are not unsigned 64-bit ints,
        IndexUnavailable."""
        n = self.partitions
        try:
            arr = np.fromiter(keys, dtype=np.uint64, count=len(keys))
        except (OverflowError, ValueError, TypeError) as exc:
            raise ValueError(f"block keys must be unsigned 64-bit ints: {exc}") from None
        parts = (arr % np.uint64(n)).astype(np.intp)
        order = np.argsort(parts, kind="stable")  # positions grouped by partition
        counts = np.bincount(parts, minlength=n).tolist()
        packed = arr[order].astype(">u8").tobytes()
        used: list[tuple[int, int, int]] = []  # (partition, first, count) in ``order``
        first = 0
        for p, c in enumerate(counts):
            if c:
                used.append((p, first, c))
                first += c
        mgets = {p: _mget_and(self._part_bitmap_prefix[p], packed[f * 8:(f + c) * 8], self._part_mepoch_key[p])
                 for p, f, c in used}

        async def roundtrip() -> tuple[dict[Any, list[Any]], list[tuple[int, int, tuple[str, int], int]],
                                       tuple[str, int], int]:
            if self._slot_ranges is None:
                await self._discover()
            requests: dict[tuple[str, int], list[bytes | bytearray]] = {}
            where = []
            for p, _, c in used:
                req = requests.setdefault(self._part_nodes[p], [])
                where.append((p, c, self._part_nodes[p], len(req)))
                req.append(mgets[p])
            assert self._meta_node is not None
            meta = requests.setdefault(self._meta_node, [])
            meta_at = len(meta)
            meta += ([self._hb_mget] if self._hb_mget else []) + [self._epoch_get, self._slots_hlen]
            replies = await self._node_calls(requests)
            for r in replies.values():
                _raise_error_reply(r)
            return replies, where, self._meta_node, meta_at

        flags: list[Any] = []
        for _ in range(2):
            replies, where, meta_node, meta_at = await self._run(roundtrip)
            meta = replies[meta_node][meta_at:]
            flags = meta[0] if self._hb_mget else []
            if (meta[-2] or b"") == self._epoch and meta[-1] == len(self._names):
                break
            self._encoding_checked = False
            await self._refresh_slots()
        epoch = self._epoch
        grouped: list[bytes | None] = []
        for p, c, addr, at in where:
            got = replies[addr][at]
            mepoch = got.pop()
            # a partition written under a slot table the meta group no longer has counts as empty
            grouped += got if mepoch is None or mepoch == epoch else [None] * c
        vals: list[bytes | None] = [None] * len(keys)
        for i, v in zip(order.tolist(), grouped):
            vals[i] = v
        return vals, flags

    async def _owned_counts(self, slots: Sequence[int]) -> list[int]:
        """As :meth:`RedisIndex._owned_counts`, summed over the partitions (one pipeline per node,
        all nodes at once). Raises IndexUnavailable."""
        n = len(slots) * len(TIERS)

        per_part = await self._run(lambda: self._each_partition(
            lambda p: [_command(b"SCARD", p + b"o:%d:%d" % (s, t)) for s in slots for t in range(len(TIERS))]))
        return [sum(int(c[j]) for c in per_part) for j in range(n)]

    async def close(self) -> None:
        for client in [self._seed, *self._clients.values()]:
            try:
                await client.aclose()
            except _CONNECTION_ERRORS:
                pass
