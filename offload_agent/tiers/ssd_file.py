"""The SSD tier's on-disk format: one file per block, written atomically, checked on every read.

Layout of ``<tier dir>/<fingerprint dir>/<key hex[:2]>/<key hex>.kvb`` (little-endian)::

    offset size  field
    0      4     magic b"KVRT"
    4      2     format version (1)
    6      2     checksum algorithm (1 = zlib crc32, 2 = xxh3_64)
    8      16    fingerprint digest (:meth:`TierFingerprint.digest`)
    24     16    tier key of the block
    40     8     payload bytes
    48     8     checksum of the payload
    56     8     zero padding
    64     ...   payload: the block's KV, all layers, as the connector laid it out

A block is read after an ``fstat`` size check, the payload straight into the caller's buffer, with
the header in one ``readv`` (small blocks) or right after it (from :data:`SPLIT_READ_BYTES`); the
header (magic, version, fingerprint, key, size) and the payload's checksum are then checked. Batch
readers announce the next files to the kernel first (:func:`prefetch_block_files`), so that the disk
serves many of them at once.

A file is written to ``.<key hex>.<pid>.<thread>.tmp`` beside its final name and renamed into place
(``os.replace``), so a reader never sees a half-written block under a final name. There is no
fsync: after a power cut a renamed file may hold stale bytes, which the checksum catches (the block
is then recomputed, never served). Each fingerprint has its own folder with a ``fingerprint.json``
for people; files of other fingerprints are never read, counted or deleted.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from offload_agent.tiers.keys import FORMAT, TierFingerprint

try:  # xxhash is fast, but vLLM's interpreter may not have it
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

MAGIC = b"KVRT"
VERSION = 1
HEADER_BYTES = 64
CHECKSUM_CRC32 = 1
CHECKSUM_XXH3_64 = 2
_HEADER = struct.Struct("<4sHH16s16sQQ8x")
SUFFIX = ".kvb"
_O_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_fadvise = getattr(os, "posix_fadvise", None)  # Linux; absent on macOS
READ_AHEAD_BYTES = 8 << 20
"""Bytes of block files :meth:`TierStore.read_ssd_many` asks the kernel for ahead of its reads
(on a virtio disk, 8 MiB read faster than 32 MiB and no slower than 2 or 4 MiB)."""
READ_TASK_BYTES = 1 << 20
"""Bytes of blocks one I/O thread of :meth:`TierStore.read_ssd_many` reads per task."""
SPLIT_READ_BYTES = 1 << 20
"""From this payload size on, :func:`read_block_file` reads the header first and the payload with a
second call: the kernel then streams the payload (its read-ahead ramps up while the first pages are
copied), where one call for both waits for the whole payload's I/O before copying. Measured on a
cold 2 MiB file: 1.3 ms split, 2.0 ms in one call; equal at 1 MiB; one call is faster below."""


class CorruptBlockError(Exception):
    """A block file that must not be served: truncated, bad header, wrong fingerprint or key, or
    a checksum mismatch. The message says which."""


@dataclass(frozen=True)
class BlockFileInfo:
    """A block file found by :func:`scan_fingerprint_dir`: key, size in bytes, mtime (s)."""

    key: bytes
    path: Path
    file_bytes: int
    mtime_s: float


def default_checksum_algo() -> int:
    """xxh3_64 when xxhash is importable, else zlib crc32."""
    return CHECKSUM_XXH3_64 if _xxhash is not None else CHECKSUM_CRC32


def checksum(algo: int, payload) -> int:
    """Checksum of a bytes-like ``payload`` with algorithm ``algo``; ValueError when unavailable."""
    if algo == CHECKSUM_CRC32:
        return zlib.crc32(payload)
    if algo == CHECKSUM_XXH3_64 and _xxhash is not None:
        return _xxhash.xxh3_64_intdigest(payload)
    raise ValueError(f"checksum algorithm {algo} is not available here")


def block_path(fp_dir: Path, key: bytes) -> Path:
    """Final path of ``key``'s file in a fingerprint folder."""
    h = key.hex()
    return fp_dir / h[:2] / (h + SUFFIX)


def _block_file(fp_dir: str | os.PathLike, key: bytes) -> str:
    """:func:`block_path` as a string, without building a Path (a few us per block on the read path)."""
    h = key.hex()
    return f"{os.fspath(fp_dir)}/{h[:2]}/{h}{SUFFIX}"


def write_block_file(fp_dir: Path, key: bytes, fingerprint_digest: bytes, payload,
                     algo: int | None = None) -> int:
    """Write ``payload`` (bytes-like) as ``key``'s block file atomically; return the file's bytes.

    Raises OSError when the disk refuses (the temp file is removed).
    """
    algo = default_checksum_algo() if algo is None else algo
    mv = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, VERSION, algo, fingerprint_digest, key, mv.nbytes, checksum(algo, mv))
    final = block_path(fp_dir, key)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.stem}.{os.getpid()}.{threading.get_ident()}.tmp"  # one writer per name
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(mv)
        os.replace(tmp, final)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return HEADER_BYTES + mv.nbytes


def _parse_header(raw, where: str | Path) -> tuple[int, bytes, bytes, int, int]:
    if len(raw) < HEADER_BYTES:
        raise CorruptBlockError(f"{where}: truncated header ({len(raw)} of {HEADER_BYTES} bytes)")
    magic, version, algo, fp, key, n, csum = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlockError(f"{where}: not a kvroute block file (magic {magic!r}, version {version})")
    return algo, fp, key, n, csum


def _readv_full(fd: int, bufs: list[memoryview], total: int) -> int:
    """``os.readv`` into ``bufs`` (``total`` bytes together) from the fd's offset until full or
    end of file; the bytes read."""
    got = os.readv(fd, bufs)
    while 0 < got < total:  # a short read before the end (rare): go on where it stopped
        rest, skip = [], got
        for b in bufs:
            if skip >= b.nbytes:
                skip -= b.nbytes
                continue
            rest.append(b[skip:])
            skip = 0
        r = os.readv(fd, rest)
        if not r:
            break
        got += r
    return got


def read_block_file(fp_dir: Path, key: bytes, fingerprint_digest: bytes, out) -> None:
    """Read ``key``'s block into the writable bytes-like ``out`` (exactly the payload size), checking
    magic, version, fingerprint, key, size and checksum. Raises CorruptBlockError (``out`` then
    holds garbage) or FileNotFoundError.

    The payload is read straight into ``out`` (no intermediate copy), with the header in one
    ``readv`` (below :data:`SPLIT_READ_BYTES`) or after it; a file of another size than expected
    only has its header read, for the error."""
    path = _block_file(fp_dir, key)
    dst = memoryview(out).cast("B")
    n_want = dst.nbytes
    head = memoryview(bytearray(HEADER_BYTES))
    fd = os.open(path, _O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + n_want:
            got = _readv_full(fd, [head], HEADER_BYTES)
        elif n_want < SPLIT_READ_BYTES:
            got = _readv_full(fd, [head, dst], size)
        else:
            got = _readv_full(fd, [head], HEADER_BYTES)
            if got == HEADER_BYTES:
                got += _readv_full(fd, [dst], n_want)
    finally:
        os.close(fd)
    algo, fp, file_key, n, csum = _parse_header(head[:min(got, HEADER_BYTES)], path)
    if fp != fingerprint_digest:
        raise CorruptBlockError(f"{path}: fingerprint differs")
    if file_key != key:
        raise CorruptBlockError(f"{path}: holds key {file_key.hex()}, not {key.hex()}")
    if n != n_want:
        raise CorruptBlockError(f"{path}: payload of {n} bytes, expected {n_want}")
    if size > HEADER_BYTES + n:
        raise CorruptBlockError(f"{path}: longer than its header says ({size} bytes, not {HEADER_BYTES + n})")
    if size < HEADER_BYTES + n or got < size:  # short on disk, or cut while being read
        have = (size if size < HEADER_BYTES + n else got) - HEADER_BYTES
        raise CorruptBlockError(f"{path}: truncated ({have} of {n} payload bytes)")
    try:
        ok = checksum(algo, dst) == csum
    except ValueError as exc:
        raise CorruptBlockError(f"{path}: {exc}") from exc
    if not ok:
        raise CorruptBlockError(f"{path}: checksum mismatch")


def prefetch_block_files(fp_dir: Path, keys: Iterable[bytes]) -> None:
    """Ask the kernel to start reading these keys' files into the page cache now
    (``posix_fadvise(WILLNEED)``, which returns once the reads are queued), so that the disk works
    on many files at once while :func:`read_block_file` reads and checks them one by one. Missing
    files are skipped; a no-op where the call does not exist."""
    if _fadvise is None:
        return
    for key in keys:
        try:
            fd = os.open(_block_file(fp_dir, key), _O_RDONLY)
        except OSError:
            continue
        try:
            _fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def scan_fingerprint_dir(fp_dir: Path, fingerprint_digest: bytes, payload_bytes: int) -> Iterator[BlockFileInfo]:
    """The block files of one fingerprint folder whose header and size look right (the checksum is
    checked when a block is read). Leftover temp files are deleted; files with another fingerprint,
    a bad header or a wrong size are skipped (never deleted: they may be someone else's)."""
    if not fp_dir.is_dir():
        return
    for sub in sorted(fp_dir.iterdir()):
        if not sub.is_dir():
            continue
        for path in sub.iterdir():
            name = path.name
            if name.endswith(".tmp"):
                try:
                    path.unlink()
                except OSError:
                    pass
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    _, fp, key, n, _ = _parse_header(f.read(HEADER_BYTES), path)
            except (OSError, CorruptBlockError):
                continue
            if fp != fingerprint_digest or n != payload_bytes or st.st_size != HEADER_BYTES + n:
                continue
            if key.hex() + SUFFIX != name:
                continue
            yield BlockFileInfo(key, path, st.st_size, st.st_mtime)


def engine_shard_dir(root: Path, engine_digest: bytes, model: str, tp_rank: int = 0, pp_rank: int = 0,
                     ) -> tuple[Path | None, TierFingerprint | None, list[Path]]:
    """Look through the fingerprint folders under ``root`` (each with its ``fingerprint.json``):
    returns the folder of the given engine's shard (``tp_rank``, ``pp_rank``) and its fingerprint
    (Nones when absent), and the folders of ``model`` written in an older stored format (no or
    another :data:`~offload_agent.tiers.keys.FORMAT`), which the caller deletes: their bytes
    cannot be read as this format. Folders of other models are left alone."""
    found: tuple[Path | None, TierFingerprint | None] = (None, None)
    stale: list[Path] = []
    if not root.is_dir():
        return None, None, stale
    for sub in sorted(root.glob("fp-*")):
        try:
            fields = json.loads((sub / "fingerprint.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(fields, dict):
            continue
        if fields.get("format") != FORMAT:
            if fields.get("model") == model:
                stale.append(sub)
            continue
        try:
            fp = TierFingerprint(**fields)
        except TypeError:
            continue
        if (fp.engine_digest(), fp.tp_rank, fp.pp_rank) == (engine_digest, tp_rank, pp_rank) and sub.name == fp.dir_name():
            found = (sub, fp)
    return found[0], found[1], stale
