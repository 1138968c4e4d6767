"""The agent as owner of its worker's tiers: it makes the CPU tier's shared memory file, names the
SSD folder, answers the worker's KV connector on a Unix socket (:mod:`offload_agent.agent_link`),
serves its blocks to peers over TCP (:mod:`offload_agent.peer`) and pulls blocks from peers for
its connector.

Ownership (see also :mod:`offload_agent.tiers.shm_slab`): the agent creates the CPU tier files
and is the only one that removes them (at a clean stop with ``remove_on_exit``); it never writes a
slot. The connector's planner places and evicts blocks in both tiers; the connector writes the
slots and the SSD files (atomically renamed). The agent reads both, only to serve peers: a slot
through the seqlock (a slot changing under the copy is not served), a file through its checksum.

KV shards: with tensor or pipeline parallelism every rank of the engine holds its own share of
each block (its KV heads, its layers) and says hello with its own shard fingerprint. The agent
keeps one CPU tier file per shard (:meth:`TierService.shard_path`), each made at that shard's
first hello and made again only when that shard's layout changes; the scheduler's hello makes
none. Every file has the same number of slots (``cpu_tier_bytes`` // the engine's bytes per
block, all shards together), so a slot number means the same block in every shard. The peer
server serves every shard, each request from the shard whose fingerprint it names; a ``pull``
names the asking rank's shard.

Which peer holds a prefix comes from the cluster index (Redis): the connector sends the prompt's
token ids, the agent makes the index's block keys (:func:`kvcore.block_keys.block_keys`, the
gateway's encoding) and asks :meth:`RedisIndex.match`; among workers whose agents publish a
``peer.serve`` address with the same engine fingerprint, the one with the longest run wins. A
peer's whole run counts as servable: its connector saves every prompt block to its CPU tier in the
step that computes it, so what vLLM holds on GPU is normally in the CPU tier too; a block that is
not is reported missing by the peer and recomputed.

What the agent publishes with its heartbeats (the ingest state's ``"peer"`` key, read by the
gateways to credit peer blocks): ``serve`` (host:port or None), ``pull`` (bool), ``block_bytes``
(one block of all shards: what a pull of a block moves over the link), ``block_size``,
``fingerprint`` (hex of shard (0, 0)), ``engine_fingerprint`` (hex of the engine: peers with equal
ones hold interchangeable blocks), ``fingerprints`` (hex of every shard served),
``link_bytes_per_s`` and ``pull_overhead_ms`` (measured over its recent pulls by
:class:`offload_agent.peer.client.PeerClient`, None before), ``pulls``, ``pulled_blocks``,
``failed_pulls``, ``breakers`` (:meth:`PeerBreaker.state`: the peers being skipped after failed
pulls); the ``"tiers"`` key carries the counters, ``breaker_opens`` (failed pulls that opened or
kept open a peer's breaker) and ``breaker_skips`` (pulls answered at once because of one) among them.

Dead peers (:class:`PeerBreaker`): a pull from a peer that died or stopped answering costs its
deadline once; after that the peer's pulls are answered at once (``breaker: ...``, 0 blocks, so the
connector recomputes) and ``locate`` does not offer it, for a back-off from ``BREAKER_FIRST_S``
doubling to ``BREAKER_MAX_S``; then one pull tries it again; a pull that brings blocks resets it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcore.block_keys import BlockExtras, block_keys
from kvcore.index.base import KVIndex, SupportsWorkerStates
from kvcore.index.errors import IndexUnavailable
from offload_agent.agent_link import (AgentLinkError, create_pull_area, decode_header, encode_frame, header_length,
                                      pull_area_path)
from offload_agent.peer.client import ERR_CONNECTION, ERR_DEADLINE, PeerClient
from offload_agent.peer.server import BlockSource, PeerServer
from offload_agent.tiers.keys import KEY_BYTES
from offload_agent.tiers.shm_slab import ROW_BYTES, ShmSlab
from offload_agent.tiers.ssd_file import CorruptBlockError, read_block_file

log = logging.getLogger("kvroute.agent.tiers")
MAX_PROMPT_TOKENS = 4 << 20
MAX_PULL_KEYS = 1 << 16
PROGRESS_EVERY_BYTES = 1 << 20  # a streamed pull's progress frame at most this often (and per block)
MAX_SHARDS = 1 << 10  # most ranks of one parallel dimension a hello may name
PEERS_TTL_S = 1.0
BREAKER_FIRST_S = 1.0   # a peer whose pull failed is skipped this long, doubling per failure in a row
BREAKER_MAX_S = 30.0    # ... up to this
BREAKER_KINDS = frozenset({ERR_CONNECTION, ERR_DEADLINE})  # a peer unreachable or not answering
STOP_WAIT_S = 1.0  # how long a stop waits for the connector's requests in progress
_ROW = np.dtype([("key", "V16"), ("seq", "<u8"), ("pad", "<u8")])  # a slot table row (shm_slab)
_ZERO_KEY = bytes(KEY_BYTES)


class PeerBreaker:
    """Remembers pulls that failed per peer (a circuit breaker), so that after a peer dies or stops
    answering, later pulls from it do not each wait out their deadline: after a failed pull (no
    block came and the peer could not be reached or did not answer in time: ``connection``,
    ``deadline``) the peer is skipped for a back-off that starts at ``first_s`` and doubles with
    each failure in a row up to ``max_s``; the first pull after it is tried (one at a time: others
    keep being skipped while it runs); a pull that brings blocks, or ends for a reason that shows
    the peer alive (``miss``, ``busy``, ``refused``; ``checksum``, ``protocol``, ``source`` and
    ``auth`` too: a bad transfer or a set-up fault, which waiting out a back-off does not mend),
    closes it.
    A peer that moves to another address starts afresh. Times from ``clock`` (monotonic)."""

    def __init__(self, first_s: float | None = None, max_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_s = BREAKER_FIRST_S if first_s is None else first_s
        self.max_s = BREAKER_MAX_S if max_s is None else max_s
        self.clock = clock
        self._peers: dict[str, dict[str, Any]] = {}  # peer -> addr, failures, open_until, trying

    def allow(self, peer: str, addr: str) -> float | None:
        """None when a pull from ``peer`` at ``addr`` may go now (then :meth:`record` must follow),
        else the seconds it is still skipped for."""
        st = self._peers.get(peer)
        if st is None or st["addr"] != addr:
            self._peers.pop(peer, None)
            return None
        now = self.clock()
        if st["trying"] or now < st["open_until"]:
            return max(0.0, st["open_until"] - now) if not st["trying"] else 0.0
        st["trying"] = True  # the retry after the back-off: one pull at a time
        return None

    def record(self, peer: str, addr: str, blocks: int, error_kind: str | None) -> bool:
        """Note how a pull ended; True when it opened (or kept open) the breaker."""
        if blocks or error_kind not in BREAKER_KINDS:
            self._peers.pop(peer, None)
            return False
        st = self._peers.get(peer)
        if st is None or st["addr"] != addr:
            st = self._peers[peer] = {"addr": addr, "failures": 0, "open_until": 0.0, "trying": False}
        st["failures"] += 1
        st["trying"] = False
        st["open_until"] = self.clock() + min(self.max_s, self.first_s * 2 ** (st["failures"] - 1))
        return True

    def abandon(self, peer: str) -> None:
        """A pull :meth:`allow` let go ended without a verdict (the connector left): let the next try."""
        st = self._peers.get(peer)
        if st is not None:
            st["trying"] = False

    def is_open(self, peer: str) -> bool:
        """Whether ``peer`` is being skipped now (a locate does not offer it)."""
        st = self._peers.get(peer)
        return st is not None and (st["trying"] or self.clock() < st["open_until"])

    def state(self) -> dict[str, dict[str, Any]]:
        """Per peer with failures in a row: ``addr``, ``failures``, ``open_s`` (seconds it is still
        skipped for, 0 once a retry may go), ``trying`` (a retry is running)."""
        now = self.clock()
        return {peer: {"addr": st["addr"], "failures": st["failures"],
                       "open_s": round(max(0.0, st["open_until"] - now), 3), "trying": st["trying"]}
                for peer, st in self._peers.items()}


class SlabSource:
    """The blocks this agent can serve (the peer server's ``BlockSource``): the CPU tier file,
    then the SSD folder ``ssd_fp_dir``. Thread-safe (the server reads from worker threads).

    Which slot holds a key is a map kept from the slot table: when a key is not in it and the
    table has changed (its version moved), the rows whose seq changed since the last look are
    read again (a vectorised diff of the seq column; the first look reads every row), so the cost
    follows the writes, not the tier's size (262,144 slots: ~80 ms for a full read).

    The CPU tier's blocks are also lent in place (:meth:`lend_block`): the server sends them from
    the shared memory without a copy and checks afterwards that the slot did not change
    (:mod:`offload_agent.peer.protocol`, lent blocks); SSD blocks are copied (:meth:`read_block`)."""

    def __init__(self, shm: ShmSlab, ssd_fp_dir: Path | None) -> None:
        self.shm = shm
        self.fingerprint_digest = shm.fingerprint_digest
        self.block_bytes = shm.block_bytes
        self._ssd_fp_dir = ssd_fp_dir
        self._slots: dict[bytes, int] = {}       # key -> slot
        self._slot_keys: dict[int, bytes] = {}   # slot -> key (to drop a slot's old key)
        self._seqs: np.ndarray | None = None     # each row's seq at the last look
        self._seen_version = -1
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Bring the key -> slot map up to date with the slot table (cost: the rows written since
        the last look)."""
        with self._lock:
            version = self.shm.table_version()
            if version == self._seen_version:
                return
            table = self.shm.table_bytes()
            rows = np.frombuffer(table, dtype=_ROW)
            seqs = rows["seq"].copy()
            changed = range(len(seqs)) if self._seqs is None else np.flatnonzero(seqs != self._seqs).tolist()
            for slot in changed:
                old = self._slot_keys.pop(slot, None)
                if old is not None and self._slots.get(old) == slot:
                    del self._slots[old]
                key = table[slot * ROW_BYTES:slot * ROW_BYTES + KEY_BYTES]
                if not int(seqs[slot]) & 1 and key != _ZERO_KEY:
                    self._slots[key] = slot
                    self._slot_keys[slot] = key
            self._seqs = seqs
            self._seen_version = version

    def lend_block(self, key: bytes) -> tuple[memoryview, Callable[[], bool]] | None:
        """``key``'s block in its CPU tier slot, in place, and a check that is True while the slot
        has not changed since this call (the server calls it after its checksum of the sent bytes);
        None when the map (as it is: no rescan, so it never blocks) has no stable slot for it."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        seq = self.shm.stable_seq(slot, key)
        if seq is None:
            return None
        shm = self.shm
        return shm.slot_view(slot), lambda: shm.unchanged(slot, key, seq)

    def read_block(self, key: bytes, out: memoryview) -> bool:
        """Copy ``key``'s block into ``out`` (``block_bytes``); False when neither tier holds it
        (or its slot changed during the copy, or its file is corrupt)."""
        for attempt in range(2):
            slot = self._slots.get(key)
            if slot is not None and self.shm.read_consistent(slot, key, out):
                return True
            if attempt == 0:
                self.refresh()
        if self._ssd_fp_dir is None:
            return False
        try:
            read_block_file(self._ssd_fp_dir, key, self.fingerprint_digest, out)
            return True
        except (FileNotFoundError, CorruptBlockError, OSError):
            return False


@dataclass(frozen=True)
class ShardHello:
    """A connector's hello, as the agent reads it: ``role`` ("scheduler" or "worker"), this KV
    shard's ``block_bytes`` and ``digest`` (16 B), its ranks ``pp_rank``/``pp_size`` and
    ``tp_rank``/``tp_size``, and the engine's ``engine_digest`` (16 B, equal for every shard of
    one engine) and ``engine_block_bytes`` (one block summed over all shards). A hello without
    ``"shard"`` (an older connector) is shard (pp 0, tp 0) of a one-shard engine."""

    role: str
    block_bytes: int
    digest: bytes
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    engine_digest: bytes
    engine_block_bytes: int

    @classmethod
    def parse(cls, header: dict[str, Any]) -> "ShardHello":
        """Raises ValueError, KeyError or TypeError for a malformed hello."""
        block_bytes = int(header["block_bytes"])
        digest = bytes.fromhex(header["fingerprint_digest"])
        shard = header.get("shard")
        if shard is None:
            ranks, engine_digest, engine_block_bytes = (0, 1, 0, 1), digest, block_bytes
        else:
            ranks = tuple(int(shard[k]) for k in ("pp_rank", "pp_size", "tp_rank", "tp_size"))
            engine_digest = bytes.fromhex(header["engine_digest"])
            engine_block_bytes = int(header["engine_block_bytes"])
        pp_rank, pp_size, tp_rank, tp_size = ranks
        if not (0 <= pp_rank < pp_size <= MAX_SHARDS and 0 <= tp_rank < tp_size <= MAX_SHARDS):
            raise ValueError(f"shard pp {pp_rank}/{pp_size}, tp {tp_rank}/{tp_size}")
        if len(digest) != KEY_BYTES or len(engine_digest) != KEY_BYTES:
            raise ValueError(f"digests must be {KEY_BYTES} bytes")
        if not 1 <= block_bytes <= engine_block_bytes:
            raise ValueError(f"block_bytes {block_bytes} must be 1..engine_block_bytes ({engine_block_bytes})")
        role = header.get("role", "worker")
        if role not in ("scheduler", "worker"):
            raise ValueError(f"role {role!r}")
        return cls(role, block_bytes, digest, pp_rank, pp_size, tp_rank, tp_size, engine_digest, engine_block_bytes)

    @property
    def ranks(self) -> tuple[int, int]:
        """``(pp_rank, tp_rank)``, the shard's key."""
        return self.pp_rank, self.tp_rank


@dataclass
class _Shard:
    """One KV shard's CPU tier: its file (``shm``), what the peer server reads (``source``), and
    where pulls for it land (``pull_area``, None without peer pull; one pull at a time)."""

    pp_rank: int
    tp_rank: int
    shm: ShmSlab
    source: SlabSource
    pull_area: memoryview | None
    pull_lock: asyncio.Lock


class _LinkGone(Exception):
    """The connector closed its link during a pull."""


class TierService:
    """Owner of one worker's tiers; see the module docstring.

    ``socket_path``: the Unix socket the connector connects to; ``shm_path``: the CPU tier file of
    KV shard (pp 0, tp 0), the file of shard (p, t) being ``{shm_path}-pp{p}-tp{t}``
    (:meth:`shard_path`; each made at its shard's first hello, when its layout is known);
    ``cpu_tier_bytes`` > 0: the CPU tier of the whole engine (every shard gets as many slots as
    it holds blocks of all shards together);
    ``ssd_dir``/``ssd_tier_bytes``: the SSD tier (None/0: none); ``index``: the cluster index
    (peer locations and addresses; any :class:`KVIndex`, peers need :class:`SupportsWorkerStates`);
    ``serve``: ``(host, port)`` to serve peers on, None not to; ``advertise``: the address peers
    should use (default the bound one); ``secret``: shared secret of the peer protocol;
    ``peer_pull``: whether the connector may pull; ``peer_pull_max_bytes``: the most bytes one
    pull of a shard brings (the keys beyond are not asked for), the size of each worker shard's
    pull area (:func:`offload_agent.agent_link.create_pull_area`), or its CPU tier's slots'
    bytes when smaller (the area never doubles more than the tier); reserved whole in its folder
    at the shard's first hello (when it cannot be, that shard's hello answers ``peer_pull``
    false). Raises ValueError for bad sizes.
    """

    def __init__(self, worker_id: str, model: str, block_size: int, socket_path: str | os.PathLike,
                 shm_path: str | os.PathLike, cpu_tier_bytes: int, index: KVIndex, *,
                 ssd_dir: str | os.PathLike | None = None, ssd_tier_bytes: int = 0,
                 serve: tuple[str, int] | None = None, advertise: str | None = None,
                 secret: bytes | None = None, peer_pull: bool = True, peer_pull_max_bytes: int = 256 << 20,
                 remove_on_exit: bool = False) -> None:
        if cpu_tier_bytes < 1:
            raise ValueError(f"cpu_tier_bytes must be > 0, got {cpu_tier_bytes}")
        if peer_pull and peer_pull_max_bytes < 1:
            raise ValueError(f"peer_pull_max_bytes must be > 0, got {peer_pull_max_bytes}")
        if ssd_dir is not None and ssd_tier_bytes < 1:
            raise ValueError("ssd_tier_bytes must be > 0 with an SSD folder")
        self.worker_id = worker_id
        self.model = model
        self.block_size = block_size
        self.socket_path = Path(socket_path)
        self.shm_path = Path(shm_path)
        self.cpu_tier_bytes = cpu_tier_bytes
        self.ssd_dir = Path(ssd_dir).resolve() if ssd_dir is not None else None
        self.ssd_tier_bytes = ssd_tier_bytes if ssd_dir is not None else 0
        self.index = index
        self.serve = serve
        self.advertise = advertise
        self.secret = secret
        self.peer_pull = peer_pull
        self.peer_pull_max_bytes = peer_pull_max_bytes
        self.remove_on_exit = remove_on_exit
        self.shards: dict[tuple[int, int], _Shard] = {}   # (pp_rank, tp_rank) -> its tier
        self._by_digest: dict[bytes, _Shard] = {}
        self.engine_digest: bytes | None = None
        self.engine_block_bytes: int | None = None
        self.peer_server: PeerServer | None = None
        self.serving_at: str | None = None
        self.client = PeerClient(secret=secret)
        self._pulled_from: set[str] = set()
        self.counters = {"hellos": 0, "locates": 0, "located_blocks": 0, "pulls": 0, "pulled_blocks": 0,
                         "failed_pulls": 0, "pulled_bytes": 0, "breaker_opens": 0, "breaker_skips": 0}
        self.breaker = PeerBreaker()
        self._server: asyncio.AbstractServer | None = None
        self._links: dict[asyncio.StreamWriter, asyncio.Task] = {}  # the connector's connections
        self._peers: dict[str, dict[str, Any]] = {}
        self._peers_at = -1e9
        self._peers_lock = asyncio.Lock()
        self._layout_lock = asyncio.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve peers (with ``serve``) and listen on the Unix socket (a stale socket file is
        replaced). Raises OSError."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        if self.serve is not None:
            self.peer_server = PeerServer(self, self.serve[0], self.serve[1], secret=self.secret)
            host, port = await self.peer_server.start()
            self.serving_at = self.advertise or f"{host}:{port}"
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        log.info("tiers of worker %s: connector socket %s, CPU tier %d bytes in %s, SSD tier %s, peers %s, "
                 "pull %s", self.worker_id, self.socket_path, self.cpu_tier_bytes, self.shm_path,
                 f"{self.ssd_dir} ({self.ssd_tier_bytes} bytes)" if self.ssd_dir else "off",
                 f"served on {self.serving_at}" if self.serve else "not served",
                 "on" if self.peer_pull else "off")

    async def stop(self) -> None:
        """Stop serving; the CPU tier files stay unless ``remove_on_exit`` (their memory lives on
        in the worker's mappings either way)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._links):  # as a stopped process would: the connector reconnects
                writer.close()
            handlers = set(self._links.values())  # they end at their link's EOF (a pull: cut short)
            if handlers:
                _, late = await asyncio.wait(handlers, timeout=STOP_WAIT_S)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        if self.peer_server is not None:
            await self.peer_server.close()
            self.peer_server = None
        await self.client.close()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        if self.remove_on_exit:
            for shard in self.shards.values():
                shard.shm.unlink()
                if shard.pull_area is not None:
                    Path(pull_area_path(shard.shm.path)).unlink(missing_ok=True)

    # ---- shards ------------------------------------------------------------------------------
    def shard_path(self, pp_rank: int, tp_rank: int) -> Path:
        """The CPU tier file of KV shard (``pp_rank``, ``tp_rank``)."""
        if (pp_rank, tp_rank) == (0, 0):
            return self.shm_path
        return self.shm_path.with_name(f"{self.shm_path.name}-pp{pp_rank}-tp{tp_rank}")

    @property
    def shm(self) -> ShmSlab | None:
        """Shard (pp 0, tp 0)'s CPU tier file, None before its hello."""
        shard = self.shards.get((0, 0))
        return shard.shm if shard else None

    @property
    def source(self) -> SlabSource | None:
        """What the peer server reads for shard (pp 0, tp 0), None before its hello."""
        shard = self.shards.get((0, 0))
        return shard.source if shard else None

    def source_for(self, fingerprint_digest: bytes) -> BlockSource | None:
        """The peer server's :class:`~offload_agent.peer.server.BlockSources`: the source of the
        shard whose fingerprint digest is ``fingerprint_digest``, None when no shard has it."""
        shard = self._by_digest.get(fingerprint_digest)
        return shard.source if shard else None

    # ---- state for the gateways ---------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The ``"tiers"`` and ``"peer"`` keys of the agent's published state (module docstring)."""
        bytes_per_s, overhead_ms = self.link_estimate()
        shm = self.shm
        shards = [self.shards[k] for k in sorted(self.shards)]
        return {
            "tiers": {"cpu_tier_bytes": self.cpu_tier_bytes, "shm": str(self.shm_path),
                      "ssd_dir": str(self.ssd_dir) if self.ssd_dir else None, "ssd_tier_bytes": self.ssd_tier_bytes,
                      "cpu_slots": shards[0].shm.num_slots if shards else None,
                      "shards": [{"pp_rank": sh.pp_rank, "tp_rank": sh.tp_rank, "shm": str(sh.shm.path),
                                  "block_bytes": sh.shm.block_bytes} for sh in shards], **self.counters},
            "peer": {"serve": self.serving_at, "pull": self.peer_pull,
                     "block_bytes": self.engine_block_bytes, "block_size": self.block_size,
                     "fingerprint": shm.fingerprint_digest.hex() if shm else None,
                     "engine_fingerprint": self.engine_digest.hex() if self.engine_digest else None,
                     "fingerprints": [sh.shm.fingerprint_digest.hex() for sh in shards],
                     "link_bytes_per_s": round(bytes_per_s, 1) if bytes_per_s else None,
                     "pull_overhead_ms": round(overhead_ms, 3) if overhead_ms is not None else None,
                     "pulls": self.counters["pulls"], "pulled_blocks": self.counters["pulled_blocks"],
                     "failed_pulls": self.counters["failed_pulls"], "breakers": self.breaker.state(),
                     "served": self.peer_server.stats() if self.peer_server else None},
        }

    def link_estimate(self) -> tuple[float | None, float | None]:
        """``(bytes_per_s, overhead_ms)`` of this agent's pulls: the client's measures
        (:meth:`PeerClient.link_stats`) of the peers it pulled from, weighted by their pulls;
        Nones until measured (a rate needs a pull of 256 KiB or more)."""
        rates, overheads = [], []
        for addr in sorted(self._pulled_from):
            st = self.client.link_stats(addr)
            if not st:
                continue
            if st.get("bytes_per_s"):
                rates.append((st["bytes_per_s"], st["pulls"]))
            if st.get("overhead_ms") is not None:
                overheads.append((st["overhead_ms"], st["pulls"]))

        def mean(pairs):
            total = sum(w for _, w in pairs)
            return sum(v * w for v, w in pairs) / total if total else None
        return mean(rates), mean(overheads)

    # ---- the connector's requests -------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._links[writer] = asyncio.current_task()
        try:
            while True:
                try:
                    head = await reader.readexactly(4)
                except asyncio.IncompleteReadError:
                    return
                header = decode_header(await reader.readexactly(header_length(head)))
                size = header.get("payload_bytes", 0)
                if size > max(4 * MAX_PROMPT_TOKENS, KEY_BYTES * MAX_PULL_KEYS):
                    raise AgentLinkError(f"payload of {size} bytes")
                payload = await reader.readexactly(size) if size else b""
                try:
                    answer, out = await self._answer(header, payload, writer)
                except (ValueError, KeyError, TypeError) as exc:
                    answer, out = {"ok": False, "error": f"bad {header.get('op')!r} request: {exc}"}, None
                except OSError as exc:  # e.g. the CPU tier file cannot be made (/dev/shm full)
                    log.error("%s request failed: %s", header.get("op"), exc)
                    answer, out = {"ok": False, "error": f"{header.get('op')!r} failed: {exc}"}, None
                if answer is None:
                    return
                for piece in encode_frame(answer, out):
                    writer.write(piece)
                await writer.drain()
        except (AgentLinkError, asyncio.IncompleteReadError, ConnectionError) as exc:
            log.warning("connector link dropped: %s", exc)
        finally:
            self._links.pop(writer, None)
            writer.close()

    async def _answer(self, header: dict[str, Any], payload: bytes,
                      writer: asyncio.StreamWriter) -> tuple[dict[str, Any] | None, bytes | memoryview | None]:
        op = header.get("op")
        if op == "hello":
            return await self._hello(ShardHello.parse(header), header.get("pid")), None
        if self.engine_digest is None:
            return {"ok": False, "error": "no hello yet: the tiers' layout is unknown"}, None
        if op == "locate":
            return await self._locate(header, payload), None
        if op == "pull":
            return await self._pull(header, payload, writer)
        return {"ok": False, "error": f"unknown op {op!r}"}, None

    async def _hello(self, hello: ShardHello, pid: Any) -> dict[str, Any]:
        """Make (or reuse) the CPU tier file of a worker's shard; a scheduler's hello only learns
        the engine's layout and is answered with shard (0, 0)'s file, which it never makes."""
        num_slots = self.cpu_tier_bytes // hello.engine_block_bytes
        if num_slots < 1:
            return {"ok": False, "error": f"the CPU tier ({self.cpu_tier_bytes} bytes) holds no block of "
                                          f"{hello.engine_block_bytes} (all shards)"}
        path = self.shard_path(*hello.ranks) if hello.role == "worker" else self.shard_path(0, 0)
        if hello.role == "worker":
            async with self._layout_lock:
                shard = self.shards.get(hello.ranks)
                if shard is None or (shard.shm.fingerprint_digest, shard.shm.block_bytes, shard.shm.num_slots) != (
                        hello.digest, hello.block_bytes, num_slots):
                    shm = ShmSlab.create(path, hello.digest, hello.block_bytes, num_slots)
                    fp_dir = self.ssd_dir / ("fp-" + hello.digest.hex()[:16]) if self.ssd_dir is not None else None
                    old = self.shards.get(hello.ranks)
                    area = old.pull_area if old else None
                    if area is None and self.peer_pull:
                        try:
                            area_bytes = min(self.peer_pull_max_bytes, num_slots * hello.block_bytes)
                            area = memoryview(create_pull_area(pull_area_path(path), area_bytes))
                        except OSError as exc:  # e.g. /dev/shm sized for the CPU tier alone: no pulls
                            log.warning("no peer pull for shard pp %d tp %d: %s", hello.pp_rank, hello.tp_rank, exc)
                    self.shards[hello.ranks] = _Shard(hello.pp_rank, hello.tp_rank, shm, SlabSource(shm, fp_dir),
                                                      area, old.pull_lock if old else asyncio.Lock())
                    self._by_digest = {sh.shm.fingerprint_digest: sh for sh in self.shards.values()}
                    log.info("CPU tier %s: %d slots of %d bytes for shard pp %d/%d tp %d/%d, fingerprint %s (pid %s)",
                             path, num_slots, hello.block_bytes, hello.pp_rank, hello.pp_size, hello.tp_rank,
                             hello.tp_size, hello.digest.hex()[:16], pid)
        self.engine_digest, self.engine_block_bytes = hello.engine_digest, hello.engine_block_bytes
        self.counters["hellos"] += 1
        shard = self.shards.get(hello.ranks) if hello.role == "worker" else None
        pulls = self.peer_pull and (shard is None or shard.pull_area is not None)
        answer = {"ok": True, "worker_id": self.worker_id, "shm_path": str(path), "num_slots": num_slots,
                  "ssd_dir": str(self.ssd_dir) if self.ssd_dir else None, "ssd_tier_bytes": self.ssd_tier_bytes,
                  "peer_pull": pulls, "serves_peers": self.serve is not None}
        if shard is not None and shard.pull_area is not None:
            answer.update(pull_path=str(pull_area_path(path)), pull_bytes=shard.pull_area.nbytes)
        return answer

    async def peers(self) -> dict[str, dict[str, Any]]:
        """Other workers whose agents serve blocks of this engine's layout (their
        ``engine_fingerprint``, or ``fingerprint`` for agents that do not publish one): id ->
        their ``peer`` state (cached for ``PEERS_TTL_S``; empty when the index cannot say)."""
        if time.monotonic() - self._peers_at < PEERS_TTL_S:
            return self._peers
        async with self._peers_lock:  # concurrent callers (a pull per TP rank) wait for one refresh
            if time.monotonic() - self._peers_at < PEERS_TTL_S:
                return self._peers
            try:
                if not isinstance(self.index, SupportsWorkerStates) or self.engine_digest is None:
                    self._peers = {}
                    return self._peers
                try:
                    states = await self.index.worker_states()
                except IndexUnavailable as exc:
                    log.debug("peers unknown: %s", exc)
                    return self._peers
                fp = self.engine_digest.hex()
                self._peers = {wid: st["peer"] for wid, st in states.items()
                               if wid != self.worker_id and isinstance(st.get("peer"), dict) and st["peer"].get("serve")
                               and st["peer"].get("engine_fingerprint", st["peer"].get("fingerprint")) == fp}
                return self._peers
            finally:
                self._peers_at = time.monotonic()

    async def _locate(self, header: dict[str, Any], payload: bytes) -> dict[str, Any]:
        first, n = int(header["start_block"]), int(header["max_blocks"])
        if first < 0 or n < 0 or len(payload) % 4:
            raise ValueError("start_block and max_blocks must be >= 0, tokens uint32")
        self.counters["locates"] += 1
        peers = await self.peers()
        if not peers or n == 0:
            return {"ok": True, "peer": None, "blocks": 0}
        tokens = struct.unpack(f"<{len(payload) // 4}I", payload)
        salt = header.get("cache_salt")
        keys = block_keys(tokens[:(first + n) * self.block_size], self.block_size, self.model,
                          BlockExtras(cache_salt=salt) if salt else BlockExtras())
        try:
            matches = await self.index.match(keys)
        except IndexUnavailable:
            return {"ok": True, "peer": None, "blocks": 0}
        best, best_total = None, first
        for wid in sorted(peers):
            if self.breaker.is_open(wid):  # its pulls fail lately: do not send the request waiting for it
                continue
            total = matches[wid].total if wid in matches else 0
            if total > best_total:
                best, best_total = wid, total
        blocks = min(best_total, first + n) - first if best else 0
        self.counters["located_blocks"] += blocks
        return {"ok": True, "peer": best, "blocks": blocks}

    async def _pull(self, header: dict[str, Any], payload: bytes,
                    writer: asyncio.StreamWriter) -> tuple[dict[str, Any] | None, bytes | memoryview | None]:
        """Pull into the asking shard's pull area; with ``"stream"`` a progress frame goes out as
        blocks land (see :mod:`offload_agent.agent_link`), else the blocks go in the answer's
        payload. None as the answer: the link dropped during the pull."""
        peer = header["peer"]
        deadline_s = float(header.get("deadline_ms", 1000)) / 1000
        connect_s = float(header["connect_timeout_ms"]) / 1000 if "connect_timeout_ms" in header else None
        if len(payload) % KEY_BYTES:
            raise ValueError("keys must be 16 bytes each")
        keys = [bytes(payload[i:i + KEY_BYTES]) for i in range(0, len(payload), KEY_BYTES)]
        digest_hex = header.get("fingerprint_digest")
        shard = self._by_digest.get(bytes.fromhex(digest_hex)) if digest_hex is not None else self.shards.get((0, 0))
        if shard is None or shard.pull_area is None:
            why = "no pull area (peer pull is off, or the area could not be reserved)" if shard else (
                f"no CPU tier of shard fingerprint {digest_hex} here (no hello from that shard)" if digest_hex
                else "no hello from shard (0, 0)")
            return {"ok": False, "error": why}, None
        peers = await self.peers()
        if peer not in peers:
            self.counters["failed_pulls"] += 1
            return {"ok": True, "blocks": 0, "error": f"peer {peer!r} does not serve this layout"}, b""
        addr = peers[peer]["serve"]
        skipped_s = self.breaker.allow(peer, addr)
        if skipped_s is not None:  # failed lately: answered at once instead of waiting out the deadline again
            self.counters["breaker_skips"] += 1
            self.counters["failed_pulls"] += 1
            st = self.breaker.state().get(peer, {})
            return {"ok": True, "blocks": 0, "error": f"breaker: peer {peer!r} skipped for {skipped_s:.1f} s more "
                    f"after {st.get('failures', 0)} failed pulls in a row"}, b""
        bb = shard.shm.block_bytes
        room = shard.pull_area.nbytes // bb
        short = f"room: the pull area holds {room} blocks of {len(keys)}" if len(keys) > room else None
        keys = keys[:room]
        step = max(1, PROGRESS_EVERY_BYTES // bb) if header.get("stream") else len(keys) + 1
        told = 0

        def on_block(i: int, data: memoryview) -> None:
            nonlocal told
            if writer.is_closing():
                raise _LinkGone()
            if i + 1 - told >= step and i + 1 < len(keys):  # the answer tells the last ones
                told = i + 1
                for piece in encode_frame({"blocks": told}):
                    writer.write(piece)

        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        async with shard.pull_lock:  # one pull at a time writes a shard's pull area
            self._pulled_from.add(addr)
            try:
                result = await self.client.pull(addr, shard.shm.fingerprint_digest, bb, keys,
                                                max(0.0, end - loop.time()), on_block, into=shard.pull_area,
                                                connect_timeout_s=connect_s)
            except _LinkGone:
                log.info("connector link dropped during a pull from %s", peer)
                self.breaker.abandon(peer)
                return None, None
            except BaseException:
                self.breaker.abandon(peer)
                raise
        if self.breaker.record(peer, addr, result.blocks, result.kind):
            self.counters["breaker_opens"] += 1
            st = self.breaker.state()[peer]
            log.warning("peer %s (%s): pull failed (%s); skipping it for %.1f s (%d failures in a row)", peer, addr,
                        result.error, st["open_s"], st["failures"])
        self.counters["pulls"] += 1
        self.counters["pulled_blocks"] += result.blocks
        self.counters["pulled_bytes"] += result.blocks * bb
        error = result.error or short
        if error:
            self.counters["failed_pulls"] += 1
            log.info("pull of %d blocks from %s: %d came (%s)", len(keys), peer, result.blocks, error)
        answer = {"ok": True, "blocks": result.blocks, "error": error}
        return answer, None if header.get("stream") else shard.pull_area[:result.blocks * bb]
