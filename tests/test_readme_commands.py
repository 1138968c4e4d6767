"""Every ``kvroute`` command README shows parses with the real CLI as a shell expands it, and each
``kvroute bench rig --engine sim`` example runs to its report, shortened only in size
(``--limit``, ``--repeats``) and to kvroute's default policy (``--routers``): the set-up, reset
and report paths are the README's own. The real-vLLM rig and the ``bench run`` against a running
gateway are parsed, not run (minutes of CPU vLLM; a gateway the reader started)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kvroute_argv
from kvroute.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
SHORTENED = ["--limit", "24", "--repeats", "1", "--routers", "kvroute:ttft", "--no-progress"]


def readme_commands() -> list[str]:
    """The ``kvroute ...`` lines of README's bash blocks, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [line.strip() for line in joined.splitlines() if line.strip().startswith("kvroute ")]
    return out


def expanded(line: str) -> list[str]:
    """``line``'s words as bash expands them (comments dropped, ``$((...))`` computed), with
    ``$KVR_VLLM_PYTHON`` set to this interpreter."""
    proc = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, check=True,
                          env={"KVR_VLLM_PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, cwd=REPO)
    return proc.stdout.decode().split("\0")[:-1]


COMMANDS = readme_commands()


def test_readme_shows_the_commands_this_file_checks():
    kinds = {" ".join(expanded(c)[1:3]) for c in COMMANDS}
    assert {"up --engine", "bench rig", "bench run"} <= kinds, kinds
    assert sum(c.startswith("kvroute bench rig") and "--engine sim" in c for c in COMMANDS) >= 3


@pytest.mark.parametrize("line", COMMANDS, ids=lambda c: c[:70])
def test_readme_command_parses(line):
    argv = expanded(line)
    assert argv[0] == "kvroute"
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"README command does not parse (exit {exc.code}): {line}")
    assert callable(args.func)


@pytest.mark.parametrize("line", [c for c in COMMANDS if c.startswith("kvroute bench rig") and "--engine sim" in c],
                         ids=lambda c: c[:70])
def test_readme_sim_rig_runs(line, tmp_path):
    argv = expanded(line)[1:] + SHORTENED + ["--json", str(tmp_path / "report.json"), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(kvroute_argv(*argv), capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads((tmp_path / "report.json").read_text())
    (target,) = report["targets"]
    assert target["name"] == "kvroute:ttft" and target["requests"] == 24 and target["errors"] == 0, target["error_sample"]
    assert target["cached_tokens"] > 0  # the trace's shared blocks were hit: routing on the index engaged
