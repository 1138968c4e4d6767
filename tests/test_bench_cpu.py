"""The rig's CPU meter (kvbench.cpu) on real processes: a child that spins for a while is
charged about that much CPU, an idle one about none, and the report divides by requests and
duration."""
from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from kvbench.cpu import CpuMeter, cpu_report, tree_cpu_s

# spins once a line arrives on stdin (sent after the meter started: what it spends before the
# meter's first reading would not count)
SPIN = ("import sys, time\nsys.stdin.readline()\nend = time.process_time() + {s}\n"
        "while time.process_time() < end: pass\nprint('done', flush=True)\ntime.sleep(30)")


def _spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_spinning_grandchild_is_charged_to_its_root_and_an_idle_one_is_not():
    # the spinning process is a grandchild: the meter must follow descendants
    busy = _spawn("import subprocess, sys\n"
                  f"p = subprocess.Popen([sys.executable, '-c', {SPIN.format(s=0.6)!r}], stdout=sys.stdout)\n"
                  "p.wait()")
    idle = _spawn("import time\nprint('done', flush=True)\ntime.sleep(30)")
    try:
        meter = CpuMeter({"busy": [busy.pid], "idle": [idle.pid]})
        meter.start()
        busy.stdin.write("go\n")
        busy.stdin.flush()
        assert busy.stdout.readline().strip() == "done"  # waits on the spin finishing, not on a timer
        assert idle.stdout.readline().strip() == "done"
        spent = meter.stop()
        assert 0.55 <= spent["busy"] <= 1.5  # 0.6 s of process time (in 10 ms ticks), plus a little
        assert spent["idle"] < 0.3
    finally:
        for p in (busy, idle):
            for child in psutil.Process(p.pid).children(recursive=True):
                child.kill()
            p.kill()
            p.wait(10)


def test_a_process_that_is_gone_counts_nothing():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    assert tree_cpu_s(p.pid) == 0.0


def test_report_per_request_and_cores():
    report = cpu_report({"router": 2.0, "workers": 30.0}, requests=400, duration_s=20.0)
    assert report["router"] == {"cpu_s": 2.0, "ms_per_request": 5.0, "cores": 0.1}
    assert report["workers"] == {"cpu_s": 30.0, "ms_per_request": 75.0, "cores": 1.5}
    assert cpu_report({"router": 1.0}, requests=0, duration_s=0.0)["router"] == {
        "cpu_s": 1.0, "ms_per_request": None, "cores": None}
    assert pytest.approx(cpu_report({"r": 0.333333}, 3, 1.0)["r"]["ms_per_request"]) == 111.11
