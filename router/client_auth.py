"""Client API keys (the config's ``client_auth`` section): optional, off by default.

When keys are configured, every OpenAI endpoint of the gateway (the proxied POST paths: ``/v1/*``,
``/tokenize``, ``/detokenize``, ...; and ``GET /v1/models``) needs ``Authorization: Bearer <key>``
with one of them, else 401 in the OpenAI error shape (``type`` "authentication_error", ``code``
"invalid_api_key"). ``/health``, ``/ping``, ``/metrics``, ``/version`` and ``/admin/*`` (its own
token) are not affected. The client's ``Authorization`` header still reaches the worker unchanged,
so a vLLM started with its own ``--api-key`` keeps checking it.

The gateway stores SHA-256 hashes of the keys, never the keys: ``$api_keys_env`` holds them
comma-separated, ``api_keys_file`` one per line (blank lines and ``#`` comments skipped; the first
field of a line, so ``sha256sum`` output lines work as they are); each a 64-digit hex digest,
``sha256:`` prefix allowed. Both sources together make the allowed set; auth is on when either is
given (the variable set and not empty, or the file named, even if it lists nothing: then every
request is refused). The presented key's hash is compared with every allowed hash with
:func:`hmac.compare_digest`, no early exit. Keys are read at start; restart to change them.

Hash a key: ``python -m router.client_auth hash KEY`` (or ``-`` / nothing: read it from stdin),
or ``printf %s KEY | sha256sum``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from router.errors import GatewayError

if TYPE_CHECKING:
    from router.config import ClientAuthConfig

PREFIX = "sha256:"
_HEX = frozenset("0123456789abcdef")


def hash_key(key: str) -> str:
    """The SHA-256 hex digest of ``key`` (UTF-8), as stored in the config."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_hash(entry: str) -> bytes:
    """One stored hash (``[sha256:]<64 hex digits>``, any case) as its 32 bytes. Raises
    ValueError without echoing ``entry`` (a key pasted by mistake must not reach the logs)."""
    text = entry.strip()
    if text[:len(PREFIX)].lower() == PREFIX:
        text = text[len(PREFIX):]
    text = text.lower()
    if len(text) != 64 or not set(text) <= _HEX:
        raise ValueError("not a SHA-256 hex digest (64 hex digits, optionally 'sha256:'-prefixed); "
                         "store hashes of the keys, not the keys")
    return bytes.fromhex(text)


def parse_env_hashes(value: str, source: str) -> list[bytes]:
    """Comma-separated hashes (empty entries skipped). ValueError names ``source`` and the entry's position."""
    out = []
    for i, entry in enumerate(value.split(","), 1):
        if entry.strip():
            try:
                out.append(parse_hash(entry))
            except ValueError as exc:
                raise ValueError(f"{source}: entry {i}: {exc}") from None
    return out


def parse_file_hashes(text: str, source: str) -> list[bytes]:
    """One hash per line, its first whitespace-separated field; blank and ``#`` lines skipped."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        try:
            out.append(parse_hash(fields[0]))
        except ValueError as exc:
            raise ValueError(f"{source}: line {n}: {exc}") from None
    return out


def load_key_hashes(cfg: ClientAuthConfig) -> list[bytes] | None:
    """The allowed key hashes from ``cfg``'s sources, or None when none is given (auth off).
    Raises ValueError (a bad entry) or OSError (the file cannot be read)."""
    hashes: list[bytes] | None = None
    if cfg.api_keys_env and os.environ.get(cfg.api_keys_env):
        hashes = parse_env_hashes(os.environ[cfg.api_keys_env], f"${cfg.api_keys_env}")
    if cfg.api_keys_file:
        path = Path(cfg.api_keys_file)
        hashes = (hashes or []) + parse_file_hashes(path.read_text(encoding="utf-8"), str(path))
    return hashes


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token bytes of the first ``Authorization: Bearer <token>`` header (scheme in any
    case), or None when there is none or another scheme."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            return token.strip()
    return None


def invalid_api_key() -> GatewayError:
    """401 in the OpenAI shape, with ``WWW-Authenticate: Bearer``."""
    return GatewayError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                        "authentication_error", "invalid_api_key",
                        headers=[(b"www-authenticate", b"Bearer")])


class ClientAuth:
    """The allowed key hashes (None: auth off, every request passes)."""

    def __init__(self, hashes: Iterable[bytes] | None) -> None:
        self._hashes = None if hashes is None else tuple(hashes)

    @classmethod
    def from_config(cls, cfg: ClientAuthConfig) -> ClientAuth:
        return cls(load_key_hashes(cfg))

    @property
    def enabled(self) -> bool:
        return self._hashes is not None

    def allows(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether the request's headers (ASGI: lower-case names) carry an allowed key."""
        if self._hashes is None:
            return True
        token = bearer_token(headers)
        if token is None:
            return False
        digest = hashlib.sha256(token).digest()
        ok = False
        for allowed in self._hashes:  # every hash compared: the time does not tell which matched
            ok |= hmac.compare_digest(digest, allowed)
        return ok

    def check(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Raise the 401 GatewayError unless :meth:`allows`."""
        if not self.allows(headers):
            raise invalid_api_key()


def main(argv: list[str] | None = None) -> int:
    """``python -m router.client_auth hash [KEY|-]``: print ``sha256:<hex>`` of the key (stdin
    when ``-`` or absent, one trailing newline dropped)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "hash" or len(args) > 2:
        print("usage: python -m router.client_auth hash [KEY|-]   (prints sha256:<hex> for client_auth)",
              file=sys.stderr)
        return 2
    key = args[1] if len(args) == 2 and args[1] != "-" else sys.stdin.read().removesuffix("\n")
    if not key:
        print("router.client_auth: empty key", file=sys.stderr)
        return 2
    print(PREFIX + hash_key(key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
