"""The ``kvroute`` command: one subcommand per process kind.

Each part owns its flags in its own ``cli`` module exposing ``register(subparsers)``, which adds a
subparser whose ``func(args) -> int`` runs it. Imports of the heavy parts happen inside ``func``,
so ``kvroute --help`` stays fast and the router never imports the agent.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (module, in order of the data flow). A part appears here only once it is built.
_PARTS = (
    "simulator.cli",
    "router.cli",
    "offload_agent.cli",
    "kvroute.up",
    "kvbench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every built subcommand."""
    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing for vLLM clusters")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _PARTS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvroute`` console script; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
