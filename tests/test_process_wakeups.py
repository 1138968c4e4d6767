"""The benchmarks' wake-up count (``lab.process_sampler.tree_wakeups``, bench_gateway's
``wakeups``) on real processes: every sleep of every thread of a process below the root counts,
and nothing is counted for no process."""
from __future__ import annotations

import subprocess
import sys

from bench_gateway import wakeups
from lab.process_sampler import tree_wakeups

# a main thread and a second thread each go to sleep 60 times, then it says so; both stay (an
# ended thread's /proc entry, and its count, are gone)
SLEEPER = ("import threading, time\n"
           "napped = threading.Event()\n"
           "def naps():\n"
           "    for _ in range(60):\n"
           "        time.sleep(0.005)\n"
           "def second():\n"
           "    naps()\n"
           "    napped.set()\n"
           "    time.sleep(30)\n"
           "threading.Thread(target=second, daemon=True).start()\n"
           "naps()\n"
           "napped.wait()\n"
           "print('done', flush=True)\n"
           "time.sleep(30)")


def test_every_threads_sleeps_below_the_started_process_are_counted():
    # the sleeper is a grandchild, as the benchmark's processes sit below their `timeout` wrapper
    root = subprocess.Popen([sys.executable, "-c",
                             "import subprocess, sys\n"
                             f"subprocess.run([sys.executable, '-c', {SLEEPER!r}])"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "done"
        counted = tree_wakeups(root.pid)
        assert counted >= 120, counted  # 60 naps in each of two threads
        assert wakeups(root) >= counted  # the same processes, read again later
        assert wakeups(None) == 0
    finally:
        root.kill()
        root.wait(10)
