"""The ``kvroute`` command: one subcommand per process kind.

Each part owns its flags in its own ``cli`` module exposing ``register(subparsers)``, which adds a
subparser whose ``func(args) -> int`` runs it. Imports of the heavy parts happen inside ``func``,
so ``kvroute --help`` stays fast and the router never imports the agent.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (command, the module that registers it), in order of the data flow. A part appears here only
# once it is built.
_PARTS = (
    ("sim", "simulator.cli"),
    ("serve", "router.cli"),
    ("agent", "offload_agent.cli"),
    ("up", "kvroute.up"),
    ("bench", "kvbench.cli"),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every built subcommand, or with only ``command``'s when it
    names one (each part's module imports what its flags' defaults need: ``kvroute serve``
    need not import the simulator's and the benchmarks' modules to start)."""
    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing for vLLM clusters")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    only = [m for c, m in _PARTS if c == command]
    for name in only or [m for _, m in _PARTS]:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvroute`` console script; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
