"""``kvroute COMMAND`` builds only that command's parser, so ``kvroute serve`` starts without
importing the simulator's and the benchmarks' modules; ``kvroute --help`` and an unknown command
still list every command."""
from __future__ import annotations

import subprocess
import sys

from kvroute.cli import build_parser

COMMANDS = ["sim", "serve", "agent", "up", "bench"]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_one_command_imports_only_its_part():
    got = _run("import sys; from kvroute.cli import build_parser; "
               "a = build_parser('serve').parse_args(['serve', '--config', 'gw.yaml']); "
               "print(a.command, a.config, *(m in sys.modules for m in "
               "('router.cli', 'simulator.config', 'kvbench.calibrate', 'offload_agent.cli')))")
    assert got == "serve gw.yaml True False False False"


def test_help_and_unknown_commands_list_every_command():
    help_text = subprocess.run([sys.executable, "-m", "kvroute", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    assert all(f"    {c} " in help_text for c in COMMANDS), help_text
    wrong = subprocess.run([sys.executable, "-m", "kvroute", "nope"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2
    assert "invalid choice: 'nope' (choose from 'sim', 'serve', 'agent', 'up', 'bench')" in wrong.stderr
    assert sorted(build_parser()._subparsers._group_actions[0].choices) == sorted(COMMANDS)
