"""``kvroute serve --processes N`` with N > 1: a supervisor process that runs N gateway
processes on one port (:mod:`router.processes.group` says how they share the work) and keeps them up.

- Makes the run folder (under ``/dev/shm`` when present: the shared load table lives there, in
  memory), the load table (:func:`router.shared.load_table.create_table`), the probe table
  (:func:`router.shared.probe_table.create_table`) and the admission table
  (:func:`router.route.shared_admission.create_table`), and holds an exclusive
  ``flock`` on the folder's ``owner.lock`` for its whole life. A supervisor killed with
  ``SIGKILL`` cannot remove its folder, but the kernel drops its lock, so the next supervisor
  to start removes every ``kvroute-serve-*`` folder whose lock it can take
  (:func:`sweep_stale_run_dirs`). Then it starts each child as
  ``python -m kvroute serve --config FILE`` with the group's environment. Children stay in the
  supervisor's process group, so a signal to the group reaches all of them.
- ``SIGTERM``/``SIGINT``: sent on to every child as ``SIGTERM`` (each closes its socket and
  finishes the requests in flight within ``timeouts.shutdown_grace_s``); children still alive
  :data:`KILL_AFTER_S` after that are killed. ``SIGHUP``: sent on (each re-reads the config).
- A child gets ``SIGTERM`` when the supervisor dies, however it dies (``PR_SET_PDEATHSIG``).
- A child that exits on its own is started again after a back-off (1 s, doubling to 30 s; back
  to 1 s once a child has run for a minute), with its load row cleared.

Returns the exit status: 0 after a signal, 1 when the run folder or a child cannot be made.
"""
from __future__ import annotations

import fcntl
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from router.processes.group import ADMISSION_FILE, ENV_INDEX, ENV_PROCESSES, ENV_RUN_DIR, LOAD_FILE, PROBES_FILE
from router.route.shared_admission import create_table as create_admission_table
from router.shared.load_table import create_table
from router.shared.probe_table import create_table as create_probe_table

log = logging.getLogger("kvroute.supervisor")

KILL_AFTER_S = 10.0
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_RUN_S = 60.0
IDLE_WAIT_S = 1.0  # the longest sleep between checks of the children when no signal wakes it
RUN_DIR_PREFIX = "kvroute-serve-"
OWNER_LOCK = "owner.lock"
UNLOCKED_GRACE_S = 60.0  # a folder this young without its lock file may be one being made


class _SignalWake:
    """Sleeps until a signal comes (``SIGCHLD``: a child exited; the stop and reload signals)
    or a timeout passes: the signals' wake-up fd (``signal.set_wakeup_fd``, a self-pipe, so a
    signal that lands just before the sleep still ends it) watched with ``select``. Main thread
    only (as ``signal.signal``)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._old_chld = signal.signal(signal.SIGCHLD, _on_child)

    def wait(self, timeout_s: float) -> None:
        select.select([self._r], [], [], timeout_s)
        try:
            while os.read(self._r, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        signal.signal(signal.SIGCHLD, self._old_chld)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._r)
        os.close(self._w)


def _on_child(signum: int, frame) -> None:
    """SIGCHLD: nothing to do here; its arrival on the wake-up fd ends the supervisor's sleep."""


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM it when the supervisor dies, even by SIGKILL (Linux
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing), so no gateway process outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_dir_base() -> str | None:
    """Where the run folder goes: ``/dev/shm`` (memory) when writable, else the temp folder."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _take_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive ``flock`` on ``path`` (created if missing), or
    None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def sweep_stale_run_dirs(base: str | None, now_s: float | None = None) -> list[Path]:
    """Remove the run folders of supervisors that are gone: every ``kvroute-serve-*`` folder in
    ``base`` (None: the temp folder) whose ``owner.lock`` no live process holds, or that has no
    lock file and is older than :data:`UNLOCKED_GRACE_S` (``now_s``: Unix time, default now).
    Returns the folders removed. Folders of live supervisors and anything unreadable are left."""
    root = Path(base if base is not None else tempfile.gettempdir())
    now_s = time.time() if now_s is None else now_s
    removed: list[Path] = []
    try:
        folders = [p for p in root.iterdir() if p.name.startswith(RUN_DIR_PREFIX) and p.is_dir()]
    except OSError:
        return removed
    for folder in folders:
        lock = folder / OWNER_LOCK
        try:
            if lock.exists():
                fd = _take_lock(lock)
                if fd is None:
                    continue  # a live supervisor holds it
                try:
                    shutil.rmtree(folder)
                finally:
                    os.close(fd)
            elif now_s - folder.stat().st_mtime > UNLOCKED_GRACE_S:
                shutil.rmtree(folder)
            else:
                continue
        except OSError:
            continue
        removed.append(folder)
    return removed


class Supervisor:
    """Runs and watches the children; see the module docstring. ``child_argv``: the command of
    one child (the same for all); ``grace_s``: the children's own shutdown grace."""

    def __init__(self, child_argv: list[str], processes: int, grace_s: float) -> None:
        if processes < 2:
            raise ValueError("a supervisor runs 2 or more processes")
        self.child_argv = child_argv
        self.processes = processes
        self.grace_s = grace_s
        base = run_dir_base()
        for stale in sweep_stale_run_dirs(base):
            log.info("removed the run folder of a supervisor that is gone: %s", stale)
        self.run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=base))
        self._owner_fd = _take_lock(self.run_dir / OWNER_LOCK)
        create_table(self.run_dir / LOAD_FILE, processes)
        create_probe_table(self.run_dir / PROBES_FILE)
        create_admission_table(self.run_dir / ADMISSION_FILE, processes)
        self.children: list[subprocess.Popen | None] = [None] * processes
        self.started_at = [0.0] * processes
        self.backoff_s = [BACKOFF_MIN_S] * processes
        self.restart_at = [0.0] * processes
        self.stopping = False

    def _spawn(self, index: int) -> None:
        env = {**os.environ, ENV_INDEX: str(index), ENV_PROCESSES: str(self.processes),
               ENV_RUN_DIR: str(self.run_dir)}
        self.children[index] = subprocess.Popen(self.child_argv, env=env, preexec_fn=_die_with_parent)
        self.started_at[index] = time.monotonic()

    def _signal_all(self, sig: int) -> None:
        for child in self.children:
            if child is not None and child.poll() is None:
                try:
                    child.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _on_stop(self, signum: int, frame) -> None:
        self.stopping = True

    def _on_hup(self, signum: int, frame) -> None:
        self._signal_all(signal.SIGHUP)

    def run(self) -> int:
        """Start the children and supervise them until a stop signal; then stop them."""
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        wake = _SignalWake()  # a child's exit or a signal ends the sleep between checks
        try:
            for i in range(self.processes):
                self._spawn(i)
            log.info("kvroute serve: %d gateway processes (run folder %s)", self.processes, self.run_dir)
            while not self.stopping:
                now = time.monotonic()
                self._watch(now)
                wake.wait(self._wait_s(now))
            self._stop_children()
            return 0
        except OSError as exc:
            print(f"kvroute serve: cannot start gateway processes: {exc}", file=sys.stderr)
            self._stop_children()
            return 1
        finally:
            wake.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self._owner_fd is not None:
                os.close(self._owner_fd)
                self._owner_fd = None

    def _wait_s(self, now: float) -> float:
        """Seconds until the next check is due without a signal: a restart's back-off ending,
        else :data:`IDLE_WAIT_S` (a child's healthy-run reset is checked at that pace)."""
        due = [at - now for child, at in zip(self.children, self.restart_at) if child is None]
        return max(0.0, min([IDLE_WAIT_S, *due]))

    def _watch(self, now: float) -> None:
        """Restart children that exited, each after its back-off."""
        for i, child in enumerate(self.children):
            if child is None:
                if now >= self.restart_at[i]:
                    self._spawn(i)
                continue
            code = child.poll()
            if code is None:
                if now - self.started_at[i] >= HEALTHY_RUN_S:
                    self.backoff_s[i] = BACKOFF_MIN_S
                continue
            wait_s = self.backoff_s[i]
            log.warning("gateway process %d exited with status %s; starting it again in %.0f s", i, code, wait_s)
            print(f"kvroute serve: gateway process {i} exited with status {code}; restarting in {wait_s:.0f} s",
                  file=sys.stderr, flush=True)
            self.children[i] = None
            self.restart_at[i] = now + wait_s
            self.backoff_s[i] = min(BACKOFF_MAX_S, wait_s * 2)

    def _stop_children(self) -> None:
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + KILL_AFTER_S
        for child in self.children:
            if child is None:
                continue
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
