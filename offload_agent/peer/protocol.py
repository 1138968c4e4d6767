"""The peer pull wire protocol, version 1: pure encoding and decoding of frames (no I/O).

One agent (the *client*) asks another (the *server*) for KV blocks by tier key over one TCP
connection; the server answers with the blocks it holds, in order, each with its fingerprint, key
and checksum, and stops at the first it does not hold. All integers are little-endian and
unsigned. Sizes are in bytes.

Frame header (8 bytes, before every frame)::

    offset size  field
    0      1     frame type (below)
    1      1     status (replies: table below; requests: 0)
    2      2     reserved, 0
    4      4     body length: the bytes that follow this header (bounded per type, below)

Frame types and bodies::

    type             dir   body
    1 HELLO          c->s  24 B: magic b"KVRP" (4) | version u16 (1) | flags u16 (0) | client nonce (16)
    2 HELLO_REPLY    s->c  32 B: magic b"KVRP" (4) | version u16 (1) | flags u16 (bit 0: auth required)
                                | server nonce (16) | max keys per request u32 | reserved u32 (0)
    3 AUTH           c->s  32 B: client proof (HMAC-SHA256, below)
    4 AUTH_REPLY     s->c  32 B server proof when status is OK; 0 B otherwise
    5 REQUEST        c->s  40 + 16 n B: request id u32 | flags u32 (below) | block bytes u64
                                | fingerprint digest (16) | n keys u32 | reserved u32 (0)
                                | n tier keys (16 each)
    6 BLOCK          s->c  48 + block bytes: request id u32 | index of the key in the request u32
                                | fingerprint digest (16) | tier key (16) | xxh3_64 of the payload u64
                                | payload (block bytes)
    7 END            s->c  8 + r B: request id u32 | blocks sent for this request u32
                                | reason, UTF-8 (r <= 1024 bytes; for people, may be empty)
    8 LENT_BLOCK     s->c  as BLOCK, the checksum field 0: the payload was sent from the server's
                                memory in place; its checksum comes later, in a CHECKS frame
    9 CHECKS         s->c  16 + 8 n B: request id u32 | index of the first block u32 | n u32
                                | reserved u32 (0) | n xxh3_64 u64, of the lent blocks first..first+n-1

A BLOCK or LENT_BLOCK frame is thus a fixed 56-byte prefix (header + block head) then the payload.

REQUEST flags: bit 0 (``REQUEST_LENT_OK``): the client takes LENT_BLOCK and CHECKS frames. A server
sends them only to a client that set it (others get BLOCK frames only); a server that does not know
the flag ignores it.

Blocks lent in place (why: the server sends a block straight from the memory that holds it,
without copying it first, and that memory may be rewritten meanwhile): the server notes the slot's
version when it lends the block, sends the payload, then computes the checksum over the slot and
checks that the version has not moved. The checksum therefore covers the bytes the kernel took only
when the slot stayed unchanged from before the send to after the checksum; a slot that changed is
reported as TORN, never checksummed. Order: a CHECKS frame comes after the payloads of the lent
blocks it covers and before any BLOCK frame or END; its ``first`` is the oldest lent block not yet
covered, and it covers them in order. The client holds a lent block (and every block after it)
until its checksum comes.

Body length limits (a frame outside them is a protocol error; the reader closes the connection
without reading the body): HELLO 24, HELLO_REPLY 32, AUTH 32, AUTH_REPLY 0 or 32,
REQUEST 40 + 16 n with n <= the server's max keys (<= 65536), BLOCK and LENT_BLOCK exactly 48 + the
requested block bytes (block bytes 1 .. 256 MiB), END 8 .. 8 + 1024, CHECKS 16 + 8 n with
1 <= n <= 65536. Unknown frame types are errors.

Statuses (frame header byte 1)::

    0 OK            HELLO_REPLY/AUTH_REPLY: go on; END: every requested block was sent
    1 MISS          END: the server does not hold key number ``blocks``; blocks after it not sent
    2 MISMATCH      END: the request's fingerprint digest or block bytes differ from the server's
    3 BUSY          END: the server's concurrency limit stayed full; HELLO_REPLY: too many connections
    4 BAD_REQUEST   any reply: malformed or oversized frame, unexpected frame type (connection closed)
    5 AUTH          AUTH_REPLY: wrong proof; END: a request before authentication (connection closed)
    6 VERSION       HELLO_REPLY: unknown magic or version (connection closed)
    7 SOURCE_ERROR  END: the server failed reading key number ``blocks`` (not a plain miss)
    8 TORN          END: lent block number ``blocks`` changed in the server's memory while it was
                    sent (rewritten by its owner); it and the lent blocks sent after it are not
                    valid; the blocks before it were covered by CHECKS. Ask again from it.

Conversation::

    client: HELLO
    server: HELLO_REPLY                 (status not OK: the server closes)
    [auth required: client AUTH, server AUTH_REPLY; status not OK: the server closes]
    then, any number of times, one at a time (keep-alive):
    client: REQUEST
    server: BLOCK x m, END              (m consecutive blocks from key 0; END.blocks == m; with
                                         REQUEST_LENT_OK any of them may be LENT_BLOCKs, each
                                         followed in time by the CHECKS covering it)

After END with status OK, MISS, MISMATCH, BUSY, SOURCE_ERROR or TORN the connection stays usable
for the next REQUEST; after any other status the server closes it. A client that stops reading mid-stream
(its deadline) closes the connection; so does either side on any protocol error.

Authentication (only when the server has a shared secret; the secret never crosses the wire)::

    client proof = HMAC-SHA256(secret, b"kvroute-peer-v1 client" | server nonce | client nonce)
    server proof = HMAC-SHA256(secret, b"kvroute-peer-v1 server" | client nonce | server nonce)

Nonces are 16 random bytes, new for every connection. The server proof lets a client that has a
secret refuse a server that does not know it. Neither the blocks nor the requests are encrypted or
MACed: use the protocol on a trusted network (or under a tunnel).

Checksums: xxh3_64 (seed 0) of the payload bytes, the same as the SSD tier's block files.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import xxhash

MAGIC = b"KVRP"
VERSION = 1
KEY_BYTES = 16
DIGEST_BYTES = 16
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_BLOCK_BYTES = 256 << 20
MAX_KEYS_LIMIT = 1 << 16
MAX_REASON_BYTES = 1024
FLAG_AUTH_REQUIRED = 1
REQUEST_LENT_OK = 1  # REQUEST flags bit 0: the client takes LENT_BLOCK and CHECKS frames

FRAME_HEADER = struct.Struct("<BBHI")
HELLO_BODY = struct.Struct("<4sHH16s")
HELLO_REPLY_BODY = struct.Struct("<4sHH16sII")
REQUEST_HEAD = struct.Struct("<IIQ16sII")
BLOCK_HEAD = struct.Struct("<II16s16sQ")
END_HEAD = struct.Struct("<II")
CHECKS_HEAD = struct.Struct("<IIII")
_CHECK = struct.Struct("<Q")
_BLOCK_PREFIX = struct.Struct("<BBHIII16s16sQ")  # frame header + block head, packed at once

FRAME_HEADER_BYTES = FRAME_HEADER.size          # 8
BLOCK_HEAD_BYTES = BLOCK_HEAD.size              # 48
BLOCK_PREFIX_BYTES = _BLOCK_PREFIX.size         # 56: what precedes a payload on the wire
REQUEST_HEAD_BYTES = REQUEST_HEAD.size          # 40


class FrameType(IntEnum):
    HELLO = 1
    HELLO_REPLY = 2
    AUTH = 3
    AUTH_REPLY = 4
    REQUEST = 5
    BLOCK = 6
    END = 7
    LENT_BLOCK = 8
    CHECKS = 9


class Status(IntEnum):
    OK = 0
    MISS = 1
    MISMATCH = 2
    BUSY = 3
    BAD_REQUEST = 4
    AUTH = 5
    VERSION = 6
    SOURCE_ERROR = 7
    TORN = 8


# END statuses after which the server keeps the connection for the next request
KEEPALIVE_STATUSES = frozenset({Status.OK, Status.MISS, Status.MISMATCH, Status.BUSY, Status.SOURCE_ERROR,
                                Status.TORN})


class FrameError(ValueError):
    """A frame that breaks the protocol: unknown type or status, length out of bounds, bad magic,
    inconsistent fields. The connection it came on cannot be trusted any more."""


class VersionError(FrameError):
    """A HELLO or HELLO_REPLY with another magic or protocol version."""


@dataclass(frozen=True)
class FrameHeader:
    """A decoded frame header: ``type``, ``status`` and ``body_bytes`` (length of what follows)."""

    type: FrameType
    status: Status
    body_bytes: int


@dataclass(frozen=True)
class HelloReply:
    """The server's HELLO_REPLY: ``auth_required``, its 16-byte ``server_nonce`` and ``max_keys``
    (most keys it accepts in one REQUEST)."""

    auth_required: bool
    server_nonce: bytes
    max_keys: int


@dataclass(frozen=True)
class Request:
    """A decoded REQUEST: ``request_id``, ``fingerprint`` (16 B), ``block_bytes``, ``keys`` (16 B
    each), ``flags`` (bit field: :data:`REQUEST_LENT_OK`; unknown bits are kept and ignored)."""

    request_id: int
    fingerprint: bytes
    block_bytes: int
    keys: list[bytes]
    flags: int = 0


@dataclass(frozen=True)
class BlockHead:
    """The 48 bytes after a BLOCK frame's header: ``request_id``, ``index`` (of the key in the
    request), ``fingerprint`` (16 B), ``key`` (16 B), ``checksum`` (xxh3_64 of the payload)."""

    request_id: int
    index: int
    fingerprint: bytes
    key: bytes
    checksum: int


@dataclass(frozen=True)
class End:
    """A decoded END body: ``request_id``, ``blocks`` (BLOCK frames sent for it), ``reason`` text."""

    request_id: int
    blocks: int
    reason: str


def payload_checksum(payload) -> int:
    """xxh3_64 (seed 0) of a bytes-like ``payload``, as an int."""
    return xxhash.xxh3_64_intdigest(payload)


def body_limits(frame_type: FrameType, *, block_bytes: int = 0, max_keys: int = MAX_KEYS_LIMIT) -> tuple[int, int]:
    """``(min, max)`` body bytes allowed for ``frame_type``; BLOCK needs the requested
    ``block_bytes`` (exact), REQUEST uses ``max_keys``."""
    if frame_type is FrameType.HELLO:
        return HELLO_BODY.size, HELLO_BODY.size
    if frame_type is FrameType.HELLO_REPLY:
        return HELLO_REPLY_BODY.size, HELLO_REPLY_BODY.size
    if frame_type is FrameType.AUTH:
        return MAC_BYTES, MAC_BYTES
    if frame_type is FrameType.AUTH_REPLY:
        return 0, MAC_BYTES
    if frame_type is FrameType.REQUEST:
        return REQUEST_HEAD_BYTES, REQUEST_HEAD_BYTES + KEY_BYTES * min(max_keys, MAX_KEYS_LIMIT)
    if frame_type in (FrameType.BLOCK, FrameType.LENT_BLOCK):
        return BLOCK_HEAD_BYTES + block_bytes, BLOCK_HEAD_BYTES + block_bytes
    if frame_type is FrameType.CHECKS:
        return CHECKS_HEAD.size + _CHECK.size, CHECKS_HEAD.size + _CHECK.size * MAX_KEYS_LIMIT
    return END_HEAD.size, END_HEAD.size + MAX_REASON_BYTES


def encode_frame_header(frame_type: FrameType, status: Status, body_bytes: int) -> bytes:
    """The 8-byte frame header."""
    return FRAME_HEADER.pack(frame_type, status, 0, body_bytes)


def decode_frame_header(data, *, block_bytes: int = 0, max_keys: int = MAX_KEYS_LIMIT) -> FrameHeader:
    """Decode 8 header bytes; FrameError for an unknown type or status, or a body length outside
    :func:`body_limits` (``block_bytes``: the block size this reader requested, for BLOCK frames)."""
    raw_type, raw_status, _reserved, n = FRAME_HEADER.unpack(data)
    try:
        frame_type, status = FrameType(raw_type), Status(raw_status)
    except ValueError as exc:
        raise FrameError(f"unknown frame type {raw_type} or status {raw_status}") from exc
    lo, hi = body_limits(frame_type, block_bytes=block_bytes, max_keys=max_keys)
    if not lo <= n <= hi:
        raise FrameError(f"{frame_type.name} frame of {n} body bytes (allowed {lo}..{hi})")
    return FrameHeader(frame_type, status, n)


def _frame(frame_type: FrameType, status: Status, body: bytes) -> bytes:
    return encode_frame_header(frame_type, status, len(body)) + body


def encode_hello(client_nonce: bytes) -> bytes:
    """A whole HELLO frame (32 bytes) carrying the 16-byte ``client_nonce``."""
    _check_len("client nonce", client_nonce, NONCE_BYTES)
    return _frame(FrameType.HELLO, Status.OK, HELLO_BODY.pack(MAGIC, VERSION, 0, client_nonce))


def decode_hello(body) -> bytes:
    """The client nonce of a HELLO body; VersionError for another magic or version."""
    magic, version, _flags, nonce = HELLO_BODY.unpack(body)
    if magic != MAGIC or version != VERSION:
        raise VersionError(f"hello with magic {magic!r} version {version}, expected {MAGIC!r} {VERSION}")
    return nonce


def encode_hello_reply(status: Status, auth_required: bool = False, server_nonce: bytes = bytes(NONCE_BYTES),
                       max_keys: int = 0) -> bytes:
    """A whole HELLO_REPLY frame (40 bytes)."""
    _check_len("server nonce", server_nonce, NONCE_BYTES)
    flags = FLAG_AUTH_REQUIRED if auth_required else 0
    body = HELLO_REPLY_BODY.pack(MAGIC, VERSION, flags, server_nonce, max_keys, 0)
    return _frame(FrameType.HELLO_REPLY, status, body)


def decode_hello_reply(body) -> HelloReply:
    """Decode a HELLO_REPLY body; VersionError for another magic or version, FrameError for
    ``max_keys`` outside 1..65536."""
    magic, version, flags, nonce, max_keys, _ = HELLO_REPLY_BODY.unpack(body)
    if magic != MAGIC or version != VERSION:
        raise VersionError(f"hello reply with magic {magic!r} version {version}, expected {MAGIC!r} {VERSION}")
    if not 1 <= max_keys <= MAX_KEYS_LIMIT:
        raise FrameError(f"hello reply with max keys {max_keys}")
    return HelloReply(bool(flags & FLAG_AUTH_REQUIRED), nonce, max_keys)


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The 32-byte proof a client sends in AUTH."""
    return hmac.new(secret, b"kvroute-peer-v1 client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The 32-byte proof a server sends in AUTH_REPLY."""
    return hmac.new(secret, b"kvroute-peer-v1 server" + client_nonce + server_nonce, hashlib.sha256).digest()


def encode_auth(proof: bytes) -> bytes:
    """A whole AUTH frame (40 bytes)."""
    _check_len("proof", proof, MAC_BYTES)
    return _frame(FrameType.AUTH, Status.OK, proof)


def encode_auth_reply(status: Status, proof: bytes = b"") -> bytes:
    """A whole AUTH_REPLY frame: ``proof`` (32 B) with OK, nothing otherwise."""
    if status is Status.OK:
        _check_len("proof", proof, MAC_BYTES)
    return _frame(FrameType.AUTH_REPLY, status, proof if status is Status.OK else b"")


def encode_request(request_id: int, fingerprint: bytes, block_bytes: int, keys: Sequence[bytes],
                   flags: int = 0) -> bytes:
    """A whole REQUEST frame (``flags``: :data:`REQUEST_LENT_OK` or 0). ValueError for a
    fingerprint or key that is not 16 bytes, block
    bytes outside 1..MAX_BLOCK_BYTES, or more than MAX_KEYS_LIMIT keys."""
    _check_len("fingerprint digest", fingerprint, DIGEST_BYTES)
    if not 1 <= block_bytes <= MAX_BLOCK_BYTES:
        raise ValueError(f"block_bytes must be 1..{MAX_BLOCK_BYTES}, got {block_bytes}")
    if len(keys) > MAX_KEYS_LIMIT:
        raise ValueError(f"{len(keys)} keys in one request (at most {MAX_KEYS_LIMIT})")
    joined = b"".join(keys)
    if len(joined) != KEY_BYTES * len(keys) or any(len(k) != KEY_BYTES for k in keys):
        raise ValueError(f"tier keys must be {KEY_BYTES} bytes each")
    head = REQUEST_HEAD.pack(request_id, flags, block_bytes, fingerprint, len(keys), 0)
    return encode_frame_header(FrameType.REQUEST, Status.OK, len(head) + len(joined)) + head + joined


def decode_request(body) -> Request:
    """Decode a REQUEST body (already length-checked by :func:`decode_frame_header`); FrameError
    when its key count disagrees with its length or its block bytes are out of range."""
    mv = memoryview(body)
    request_id, flags, block_bytes, fingerprint, n, _ = REQUEST_HEAD.unpack(mv[:REQUEST_HEAD_BYTES])
    if len(mv) != REQUEST_HEAD_BYTES + KEY_BYTES * n:
        raise FrameError(f"request says {n} keys in {len(mv) - REQUEST_HEAD_BYTES} key bytes")
    if not 1 <= block_bytes <= MAX_BLOCK_BYTES:
        raise FrameError(f"request for blocks of {block_bytes} bytes")
    raw = bytes(mv[REQUEST_HEAD_BYTES:])
    keys = [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
    return Request(request_id, fingerprint, block_bytes, keys, flags)


def pack_block_prefix_into(buf, offset: int, request_id: int, index: int, fingerprint: bytes, key: bytes,
                           checksum: int, block_bytes: int, frame_type: FrameType = FrameType.BLOCK) -> None:
    """Write a BLOCK (or LENT_BLOCK, ``checksum`` 0) frame's 56-byte prefix (frame header + block
    head) at ``buf[offset:]``; the payload goes right after it."""
    _BLOCK_PREFIX.pack_into(buf, offset, frame_type, Status.OK, 0, BLOCK_HEAD_BYTES + block_bytes,
                            request_id, index, fingerprint, key, checksum)


def encode_block(request_id: int, index: int, fingerprint: bytes, key: bytes, payload) -> bytes:
    """A whole BLOCK frame (copies the payload; for tests and other implementations)."""
    mv = memoryview(payload).cast("B")
    buf = bytearray(BLOCK_PREFIX_BYTES + mv.nbytes)
    pack_block_prefix_into(buf, 0, request_id, index, fingerprint, key, payload_checksum(mv), mv.nbytes)
    buf[BLOCK_PREFIX_BYTES:] = mv
    return bytes(buf)


def decode_block_head(data) -> BlockHead:
    """Decode the 48 bytes after a BLOCK frame's header."""
    request_id, index, fingerprint, key, checksum = BLOCK_HEAD.unpack(data)
    return BlockHead(request_id, index, fingerprint, key, checksum)


def encode_checks(request_id: int, first: int, checksums: Sequence[int]) -> bytes:
    """A whole CHECKS frame covering the lent blocks ``first .. first + len(checksums) - 1``.
    ValueError for no checksum or more than MAX_KEYS_LIMIT."""
    if not 1 <= len(checksums) <= MAX_KEYS_LIMIT:
        raise ValueError(f"a CHECKS frame covers 1..{MAX_KEYS_LIMIT} blocks, got {len(checksums)}")
    body = CHECKS_HEAD.pack(request_id, first, len(checksums), 0) + struct.pack(f"<{len(checksums)}Q", *checksums)
    return _frame(FrameType.CHECKS, Status.OK, body)


def decode_checks(body) -> tuple[int, int, tuple[int, ...]]:
    """``(request_id, first, checksums)`` of a CHECKS body (already length-checked); FrameError when
    its count disagrees with its length."""
    mv = memoryview(body)
    request_id, first, n, _ = CHECKS_HEAD.unpack(mv[:CHECKS_HEAD.size])
    if len(mv) != CHECKS_HEAD.size + _CHECK.size * n:
        raise FrameError(f"CHECKS says {n} checksums in {len(mv) - CHECKS_HEAD.size} bytes")
    return request_id, first, struct.unpack_from(f"<{n}Q", mv, CHECKS_HEAD.size)


def encode_end(status: Status, request_id: int, blocks: int, reason: str = "") -> bytes:
    """A whole END frame; ``reason`` is cut to MAX_REASON_BYTES of UTF-8."""
    text = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
    return _frame(FrameType.END, status, END_HEAD.pack(request_id, blocks) + text)


def decode_end(body) -> End:
    """Decode an END body (already length-checked)."""
    mv = memoryview(body)
    request_id, blocks = END_HEAD.unpack(mv[:END_HEAD.size])
    return End(request_id, blocks, bytes(mv[END_HEAD.size:]).decode("utf-8", "replace"))


def _check_len(what: str, value: bytes, n: int) -> None:
    if len(value) != n:
        raise ValueError(f"{what} must be {n} bytes, got {len(value)}")
