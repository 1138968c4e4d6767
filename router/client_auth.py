"""``python -m router.client_auth hash [KEY|-]``: print ``sha256:<hex>`` of a client API key, the
form the config's ``client_auth`` section stores (:mod:`router.config.client_keys`)."""
from __future__ import annotations

import sys

from router.config.client_keys import PREFIX, hash_key


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
