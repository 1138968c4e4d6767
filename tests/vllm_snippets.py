"""Snippets run in vLLM's interpreter by one long-lived process.

Some checks run vLLM's own code on our inputs (its argument parser on the workers' command lines,
its Anthropic conversion on message bodies). Each as ``python -c`` would pay vLLM's import, ~7 s
on a 2-core machine; :class:`VllmSnippets` imports once and runs every snippet in the same
process as ``python -c SNIPPET ARG...`` would: ``sys.argv``, stdin, stdout and stderr of its own,
its exit status (``SystemExit``'s code, 1 on an exception, with the traceback on stderr). Logging
handlers made at import time keep the process's own stderr, which goes to a log file.

The process runs under ``timeout`` (it stops by itself) in ``REPO`` with a minimal environment
(``PYTHONPATH`` the repository, ``PATH`` /usr/bin:/bin, ``HOME``): nothing from the test runner's
virtualenv leaks into what vLLM's interpreter can import.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_MARK = b"\x00kvroute-snippet "
DEADLINE_S = 3600  # the process's own limit (a test session's worth)

# Runs in vLLM's interpreter: read one JSON request per line, answer one marked JSON line.
_LOOP = r"""
import io, json, sys, traceback
requests, answers, mark = sys.stdin, sys.stdout.buffer, %r
for line in requests:
    req = json.loads(line)
    sys.argv = ["-c", *req["args"]]
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(req["stdin"]), io.StringIO(), io.StringIO()
    rc = 0
    try:
        exec(compile(req["code"], "<snippet>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            rc = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            rc = 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    out, err = sys.stdout.getvalue(), sys.stderr.getvalue()
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    answers.write(mark + json.dumps({"rc": rc, "stdout": out, "stderr": err}).encode() + b"\n")
    answers.flush()
""" % (_MARK,)


class VllmSnippets:
    """One process of ``python`` (vLLM's interpreter) running snippets on request; logs its own
    stderr to ``log_path``. :meth:`close` stops it."""

    def __init__(self, python: str, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")}
        self._proc = subprocess.Popen(["timeout", "-s", "KILL", str(DEADLINE_S), python, "-c", _LOOP],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      bufsize=0, env=env, cwd=REPO, start_new_session=True)
        self._buf = b""

    def run(self, code: str, args: list[str] | None = None, stdin: str = "",
            timeout_s: float = 240) -> subprocess.CompletedProcess:
        """``code`` run as ``python -c code *args`` with ``stdin`` as its input: its exit status,
        stdout and stderr. Raises TimeoutError past ``timeout_s`` (the first run includes vLLM's
        import) and RuntimeError when the process has died (its log's tail in the message)."""
        req = {"code": code, "args": list(args or []), "stdin": stdin}
        try:
            self._proc.stdin.write(json.dumps(req).encode() + b"\n")
        except BrokenPipeError:
            raise RuntimeError(f"the vLLM snippet process has exited:\n{self._log_tail()}") from None
        answer = self._answer(time.monotonic() + timeout_s)
        return subprocess.CompletedProcess(["<snippet>", *req["args"]], answer["rc"], answer["stdout"],
                                           answer["stderr"])

    def _answer(self, deadline: float) -> dict:
        fd = self._proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(_MARK):
                    return json.loads(line[len(_MARK):])
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the vLLM snippet process:\n{self._log_tail()}")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the vLLM snippet process has exited:\n{self._log_tail()}")
                self._buf += chunk

    def _log_tail(self) -> str:
        return self.log_path.read_bytes()[-3000:].decode(errors="replace")

    def close(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait(30)
        self._log.close()
