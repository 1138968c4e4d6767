"""Client API key hashes as the config's ``client_auth`` section gives them (the check of requests
is :mod:`router.edge.client_auth`): each a SHA-256 hex digest of a key, ``sha256:`` prefix
allowed; ``$api_keys_env`` holds them comma-separated, ``api_keys_file`` one per line (blank lines
and ``#`` comments skipped; the first field of a line, so ``sha256sum`` output lines work as they
are). Read here so the config refuses a bad entry or an unreadable file at start.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

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


def load_key_hashes(api_keys_env: str | None, api_keys_file: str | None) -> list[bytes] | None:
    """The allowed key hashes from the variable named ``api_keys_env`` and the file
    ``api_keys_file`` (the config's ``client_auth`` fields), or None when neither is given (auth
    off). Raises ValueError (a bad entry) or OSError (the file cannot be read)."""
    hashes: list[bytes] | None = None
    if api_keys_env and os.environ.get(api_keys_env):
        hashes = parse_env_hashes(os.environ[api_keys_env], f"${api_keys_env}")
    if api_keys_file:
        path = Path(api_keys_file)
        hashes = (hashes or []) + parse_file_hashes(path.read_text(encoding="utf-8"), str(path))
    return hashes
