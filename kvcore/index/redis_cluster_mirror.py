"""Redis Cluster index with a local mirror: :class:`kvcore.index.redis_mirror.RedisMirrorIndex`
over the partitions of :class:`kvcore.index.redis_cluster.RedisClusterIndex`.

Config: ``index: {backend: redis, url: redis://<any node>:<port>, cluster: true}`` (``mirror: true``
is the default). Lookups, ``gpu_holders`` and ``stats`` are answered from the local copy (a
:class:`kvcore.index.memory.MemoryIndex`), with no Redis round trip, as in the standalone mirror.

How the copy is kept, per partition (each has its own change log, in the standalone format):

- one reader task per partition, on its own connection to the partition's node, ``XREAD BLOCK``s
  the partition's log and applies its entries in order (partitions hold disjoint block keys, so
  their entries commute; a worker's heartbeat, carried by every partition's entries, applies from
  whichever comes first; a purge, logged in every partition, drops the worker's speculative entries
  of that partition's keys, so that speculative entries appended to another partition after the
  purge but read before it stay);
- bootstrap (at :meth:`~RedisClusterMirrorIndex.open` and on every resync), partition by
  partition: one ``MULTI`` for the partition's epoch (created if missing), its log tail and seq and
  its ``mepoch``, then one ``MULTI`` per worker (its owned sets, duplicate counters and the seq),
  all workers of the partition in one pipeline; heartbeats' ``PTTL`` from the meta group. Its
  speculative entries of the last ``speculative_lookback_s`` seconds are replayed from its log. A
  partition whose ``mepoch`` is not the meta epoch is loaded empty (lookups of the plain backend
  ignore it too);
- a gap in a partition's log (the next entry is not seq+1) reloads the copy: trimmed past the
  reader, lookups keep using the old copy meanwhile; seq went back, lookups raise
  :class:`~kvcore.index.errors.IndexUnavailable` until the reload is done;
- a poll every ``poll_interval_s`` reads the meta epoch, the heartbeats' TTLs (the standalone poll
  script on the meta group) and every partition's epoch and seq; a partition epoch that is not the
  one loaded, or a seq below the one applied, means that partition lost its data (its shard
  restarted without persistence, or it was wiped): the copy is dropped and reloaded, and lookups
  raise IndexUnavailable until then. The agents republish by themselves (their heartbeat sees the
  same epoch change), and the copy follows their writes;
- the block-count check of the standalone mirror (``verify_interval_s``) is off: partitions are
  counted at different seqs;
- writes through this object wait (at most ``write_wait_s``) until every partition they touched
  has been applied here.

When a node cannot be reached (a shard down), lookups raise IndexUnavailable after
``stale_after_s`` without contact or at once when a call through this object failed, as in the
standalone mirror: answering from a copy that one shard can no longer bring up to date would route
on entries the shard may have lost.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvcore.index.memory import MemoryIndex
from kvcore.index.redis import _command
from kvcore.index.redis_cluster import PARTITIONS, RedisClusterIndex, _raise_error_reply
from kvcore.index.redis_mirror import _YIELD_KEYS, RedisMirrorIndex, _id_ms, _stop_tasks, log
from kvcore.index.redis_snapshot import hb_expiry, load_snapshot, snapshot_commands, take_snapshot


class RedisClusterMirrorIndex(RedisMirrorIndex, RedisClusterIndex):
    """The cluster index, mirrored in this process (see the module docstring). Takes
    :class:`kvcore.index.redis_mirror.RedisMirrorIndex`'s arguments (``verify_interval_s`` is
    accepted and unused) plus ``partitions`` (:class:`kvcore.index.redis_cluster.RedisClusterIndex`).
    Raises ValueError on a bad value."""

    def __init__(self, *args: Any, partitions: int = PARTITIONS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if partitions != self.partitions:
            self._set_partitions(partitions)
        n = self.partitions
        self.verify_interval_s = 0.0
        self._part_applied = [0] * n
        self._part_last_id = [b"0-0"] * n
        self._part_epochs: list[bytes | None] = [None] * n
        self._part_floors: list[dict[str, int]] = [{} for _ in range(n)]
        self._stream_clients: dict[tuple[str, int], aioredis.Redis] = {}
        self._conns: dict[Any, Any] = {}  # ("read", partition) or ("boot", node) -> connection
        self._applied = asyncio.Condition()
        self._desync = asyncio.Event()

    # ---- connections --------------------------------------------------------------------------
    def _stream_client_of(self, addr: tuple[str, int]) -> aioredis.Redis:
        client = self._stream_clients.get(addr)
        if client is None:
            node_client = self._client(addr)
            kw = node_client.connection_pool.connection_kwargs
            client = self._stream_clients[addr] = aioredis.Redis(
                host=addr[0], port=addr[1], username=kw.get("username"), password=kw.get("password"),
                protocol=2, socket_timeout=None, socket_connect_timeout=self.socket_timeout_s,
                retry=Retry(NoBackoff(), 0), health_check_interval=0)
        return client

    async def _conn_call(self, which: Any, addr: tuple[str, int], request: Sequence[bytes],
                         timeout_s: float) -> list[Any]:
        """Pre-encoded commands on connection ``which`` (to node ``addr``); their raw replies. The
        connection is dropped on any failure. Raises what redis-py raises, TimeoutError."""
        conn = self._conns.get(which)
        if conn is not None and (conn.host, conn.port) != addr:
            await conn.disconnect()
            conn = None
        if conn is None:
            conn = self._conns[which] = self._stream_client_of(addr).connection_pool.make_connection()
        try:
            async with asyncio.timeout(timeout_s):
                await conn.send_packed_command(list(request), check_health=False)
                return [await conn.read_response() for _ in request]
        except BaseException:
            await conn.disconnect()
            raise

    async def _part_atomic(self, part: int, commands: Sequence[bytes]) -> list[Any]:
        """``MULTI`` + commands + ``EXEC`` on the bootstrap connection to ``part``'s node; the EXEC
        reply. Raises what redis-py raises."""
        addr = self._part_nodes[part]
        request = [_command(b"MULTI"), *commands, _command(b"EXEC")]
        return (await self._conn_call(("boot", addr), addr, request, self.bootstrap_timeout_s))[-1]

    async def close(self) -> None:
        await super().close()
        for conn in self._conns.values():
            await conn.disconnect()
        for client in self._stream_clients.values():
            try:
                await client.aclose()
            except Exception:  # noqa: BLE001 - closing a client that may never have connected
                pass

    @property
    def applied_seq(self) -> int:
        """Change-log entries the local copy reflects, summed over the partitions."""
        return sum(self._part_applied)

    def mirror_state(self) -> dict[str, Any]:
        """As :meth:`RedisMirrorIndex.mirror_state`; ``applied_seq`` is summed over the partitions
        and ``partition_seqs`` lists each partition's."""
        out = super().mirror_state()
        out["applied_seq"] = self.applied_seq
        out["partition_seqs"] = list(self._part_applied)
        return out

    # ---- writes -------------------------------------------------------------------------------
    async def _caught_up(self, seqs: Any) -> None:
        """Wait until the local copy has applied ``{partition: seq}`` (at most ``write_wait_s``)."""
        if not seqs or not self._tasks or self.local is None:
            return

        def done() -> bool:
            return all(self._part_applied[p] >= s for p, s in seqs.items()) or not self._synced
        if done():
            return
        try:
            async with self._applied:
                await asyncio.wait_for(self._applied.wait_for(done), self.write_wait_s)
        except asyncio.TimeoutError:
            log.debug("redis index %s: changes %s not back through the logs after %.1f s", self.url, seqs,
                      self.write_wait_s)

    async def _notify_applied(self) -> None:
        async with self._applied:
            self._applied.notify_all()

    # ---- following the logs -------------------------------------------------------------------
    async def _read_loop(self) -> None:
        """Load the copy, then follow every partition's log until one says to reload."""
        assert self._sync_attempt is not None
        readers: list[asyncio.Task[None]] = []
        try:
            while not self._closed:
                try:
                    if not self._synced:
                        await _stop_tasks(readers, self.url)
                        readers = []
                        try:
                            await self._resync()
                        finally:
                            self._sync_attempt.set()
                        continue
                    if not readers:
                        self._desync.clear()
                        readers = [asyncio.create_task(self._read_partition(p), name=f"kvr-mirror-read-p{p}")
                                   for p in range(self.partitions)]
                    await self._desync.wait()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - an outage, a bug or a foreign entry: see _read_failed
                    self._read_failed(exc)
                    await asyncio.sleep(self.retry_after_s)
        finally:
            await _stop_tasks(readers, self.url)

    def _unsync(self, drop: bool) -> None:
        """Reload the copy (``drop``: and stop answering from it until then)."""
        self._synced = False
        if drop:
            self.local = None
            self._generation += 1
        self._desync.set()

    async def _read_partition(self, part: int) -> None:
        key = self.part_prefixes[part].encode() + b"log"
        while not self._closed and self._synced:
            try:
                addr = self._part_nodes[part]
                cmd = _command(b"XREAD", b"COUNT", b"%d" % self.read_count, b"BLOCK",
                               b"%d" % int(self.read_block_s * 1000), b"STREAMS", key, self._part_last_id[part])
                reply = await self._run(lambda: self._conn_call(("read", part), addr, [cmd],
                                                                self.read_block_s + self.socket_timeout_s))
                self._contact_at = time.monotonic()
                if reply[0] is not None:
                    await self._apply_part_entries(part, reply[0][0][1])
                    await self._notify_applied()
                    if self.read_coalesce_s and len(reply[0][0][1]) < self.read_count:
                        await asyncio.sleep(self.read_coalesce_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - an outage, a bug or a foreign entry: see _read_failed
                if not self._read_failed(exc, f" on partition {part}"):
                    self._unsync(drop=False)
                    return
                await asyncio.sleep(self.retry_after_s)

    async def _apply_part_entries(self, part: int, entries: list[list[Any]]) -> None:
        idx = self.local
        if idx is None:
            self._unsync(drop=False)
            return
        now_wall = time.time()
        budget = 0
        floors = self._part_floors[part]
        for entry_id, fields in entries:
            if fields[0] != b"n" or fields[2] != b"w":
                raise ValueError(f"change-log entry {entry_id!r} of partition {part} has an unknown format")
            seq = int(fields[1])
            if seq != self._part_applied[part] + 1:
                self.gaps += 1
                went_back = seq <= self._part_applied[part]
                log.warning("redis index %s: partition %d's change log %s (seq %d after %d); reloading the mirror",
                            self.url, part, "went back" if went_back else "was trimmed past this reader", seq,
                            self._part_applied[part])
                self._unsync(drop=went_back)
                return
            worker = fields[3].decode()
            state = not floors or seq > floors.get(worker, 0)
            if b"F" in fields[4::2]:  # a purge: this partition's speculative entries only
                n_parts = self.partitions
                idx.drop_speculative_sync(worker, [k for k in idx.speculative_keys(worker) if k % n_parts == part])
                if state:
                    self._set_alive(worker, 0.0)
                names = fields[4::2]
                at = 4 + 2 * names.index(b"F")
                fields = fields[:at] + fields[at + 2:]
            for n in self._apply_entry(idx, entry_id, worker, fields, state, now_wall):
                budget += n
                if budget >= _YIELD_KEYS:
                    budget = 0
                    await asyncio.sleep(0)  # let lookups in
                    if self.local is not idx or not self._synced:
                        return
            self._part_applied[part] = seq
            self._part_last_id[part] = entry_id
            self.entries_applied += 1
            self._lag_ms.append(max(0.0, (now_wall + self._offset_s) * 1000.0 - _id_ms(entry_id)))
        if floors and self._part_applied[part] >= max(floors.values()):
            floors.clear()
        idx.expire_sync()

    # ---- bootstrap ----------------------------------------------------------------------------
    async def _resync(self) -> None:
        """Load a fresh copy partition by partition (see the module docstring) and swap it in.
        Raises IndexUnavailable."""
        t0 = time.monotonic()
        new = MemoryIndex(max_keys=self.max_keys, clock=self._clock)
        await self._refresh_slots()  # also reads the node map, when not read yet
        slots = await self._slot_table()
        order = sorted(slots.items(), key=lambda kv: kv[1])
        t_send = time.time()
        meta_epoch = await self._run(lambda: self._redis.get(self.prefix + "epoch")) or b""
        applied = [0] * self.partitions
        last_ids = [b"0-0"] * self.partitions
        epochs: list[bytes | None] = [None] * self.partitions
        floors: list[dict[str, int]] = [{} for _ in range(self.partitions)]
        parts: list[tuple[str, str, bytes]] = []
        copies: list[tuple[str, str, list[bytes]]] = []
        stamp = b"%.6f.m" % time.time()
        for part, pp in enumerate(self.part_prefixes):
            p = pp.encode()
            (sec, usec), _, epoch, last, seq0, mepoch = await self._run(lambda: self._part_atomic(part, [
                _command(b"TIME"), _command(b"SET", p + b"epoch", stamp, b"NX"), _command(b"GET", p + b"epoch"),
                _command(b"XREVRANGE", p + b"log", b"+", b"-", b"COUNT", b"1"), _command(b"GET", p + b"seq"),
                _command(b"GET", p + b"mepoch")]))
            self._offset_s = int(sec) + int(usec) / 1e6 - (t_send + time.time()) / 2
            epochs[part] = epoch
            applied[part] = int(seq0 or 0)
            last_ids[part] = last[0][0] if last else b"0-0"
            if mepoch is not None and mepoch != meta_epoch:
                continue  # written under another slot table: nothing of it counts
            request: list[bytes] = []
            for _, slot in order:
                request += [_command(b"MULTI"), *snapshot_commands(p, slot), _command(b"EXEC")]
            if request:
                addr = self._part_nodes[part]
                replies = await self._run(lambda: self._conn_call(("boot", addr), addr, request,
                                                                  self.bootstrap_timeout_s))
                step = len(request) // len(order)
                for i, (name, _) in enumerate(order):
                    take_snapshot(name, replies[i * step + step - 1], applied[part], floors[part], parts, copies)
            await asyncio.sleep(0)
        ttls = await self._run(lambda: self._redis.execute_command(
            "EVAL", "local o = {} for i, k in ipairs(KEYS) do o[i] = redis.call('PTTL', k) end return o",
            len(order), *[f"{self.prefix}hb:{slot}" for _, slot in order])) if order else []
        now = time.monotonic()
        alive = {name: hb_expiry(pttl, now) for (name, _), pttl in zip(order, ttls)}
        await load_snapshot(new, parts, copies)
        for part in range(self.partitions):
            log_key = self.part_prefixes[part].encode() + b"log"
            await self._replay_speculative(new, last_ids[part], log_key,
                                           lambda cmds, part=part: self._run(lambda: self._part_atomic(part, cmds)))
        self._part_applied = applied
        self._part_last_id = last_ids
        self._part_epochs = epochs
        self._part_floors = floors
        self._swap_in(new, slots, alive, meta_epoch, t0)
        await self._notify_applied()
        log.info("redis index %s: mirror loaded: %d keys of %d workers in %d partitions in %.2f s", self.url,
                 len(new), len(alive), self.partitions, self.last_resync_s)

    # ---- liveness, data loss ------------------------------------------------------------------
    async def _poll(self) -> None:
        generation = self._generation
        applied_before = list(self._part_applied)
        t_send, sent_at = time.time(), time.monotonic()
        sec, usec, epoch, _, n_slots, ttls, _ = await self._script(self._poll_script, [self.prefix, "0"])
        heads = await self._partition_heads()
        now = time.monotonic()
        self._contact_at = now
        self._offset_s = int(sec) + int(usec) / 1e6 - (t_send + time.time()) / 2
        if generation != self._generation or not self._synced:
            return
        lost = [p for p, (e, s) in enumerate(heads) if e != self._part_epochs[p] or int(s or 0) < applied_before[p]]
        if lost or (self._epoch_seen and epoch != self._epoch_seen):
            log.warning("redis index %s: partitions %s lost their data (epoch changed or seq went back) or the "
                        "meta group did; reloading the mirror", self.url, lost or "-")
            self.gaps += 1
            self._unsync(drop=True)
            return
        await self._take_poll(epoch, n_slots, ttls, sent_at, now)

    async def _partition_heads(self) -> list[tuple[bytes | None, bytes | None]]:
        """Every partition's (epoch, seq), one pipeline per node. Raises IndexUnavailable."""
        async def read() -> list[tuple[bytes | None, bytes | None]]:
            heads = [r[0] for r in await self._each_partition(lambda p: [_command(b"MGET", p + b"epoch", p + b"seq")])]
            _raise_error_reply(heads)
            return [(r[0], r[1]) for r in heads]
        return await self._run(read)
