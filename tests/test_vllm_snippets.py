"""The shared vLLM-interpreter runner (tests/vllm_snippets.py) answers as ``python -c`` would:
arguments, stdin, stdout, stderr and the exit status, an exception's traceback included, and a
refused command line is refused by vLLM's own parser."""
from __future__ import annotations

import json

from test_compose import _VLLM_CHECK


def test_a_snippet_gets_its_arguments_and_input_and_gives_its_status(vllm_snippets):
    done = vllm_snippets.run("import sys, vllm; print(sys.argv[1:], sys.stdin.read()[::-1]); sys.exit(3)",
                             ["a", "b"], stdin="olleh")
    assert (done.returncode, done.stdout) == (3, "['a', 'b'] hello\n")
    failed = vllm_snippets.run("raise ValueError('no such thing')")
    assert failed.returncode == 1 and "ValueError: no such thing" in failed.stderr
    assert vllm_snippets.run("print('still here')").stdout == "still here\n"  # the process went on


def test_vllms_parser_refuses_an_unknown_flag(vllm_snippets):
    done = vllm_snippets.run(_VLLM_CHECK, [json.dumps(["--model", "m", "--no-such-flag", "1"])])
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-500:])
    assert "--no-such-flag" in done.stderr
