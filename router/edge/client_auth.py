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
from collections.abc import Iterable
from typing import TYPE_CHECKING

from router.config.client_keys import load_key_hashes
from router.errors import GatewayError

if TYPE_CHECKING:
    from router.config.schema import ClientAuthConfig


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
        return cls(load_key_hashes(cfg.api_keys_env, cfg.api_keys_file))

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
