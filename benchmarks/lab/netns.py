"""A shaped network link for benchmarks: a Linux network namespace joined to the root namespace
by a veth pair, with an optional ``tc`` rate limit on one direction. Needs root and ``ip``/``tc``
(iproute2).

    with ShapedLink() as link:                 # namespace kvrp<pid>, veth kvrp<pid>a <-> kvrp<pid>b
        proc = subprocess.Popen(link.exec_argv(["python", "server.py", link.ns_ip]))
        link.shape(10e9)                       # 10 Gbit/s out of the namespace (tbf)
        ...                                    # clients in the root namespace connect to link.ns_ip
        link.shape(None)                       # unshaped again
    # namespace and veth pair removed (also when the body raised)

What it makes (names carry the creating process's id, so runs never collide):

- network namespace ``kvrp<pid>`` with ``lo`` up;
- veth pair ``kvrp<pid>a`` (root namespace, address ``host_ip``) <-> ``kvrp<pid>b`` (inside,
  address ``ns_ip``), on a private ``10.201.<n>.0/24`` not routed on this machine yet
  (``.1`` outside, ``.2`` inside). A process inside reaches one outside through ``host_ip`` (a
  server outside must listen there or on ``0.0.0.0``) and the other way round through ``ns_ip``.
  Unix sockets with a path and ``/dev/shm`` files are shared across namespaces.

Shaping (:meth:`ShapedLink.shape`) is a ``tbf`` qdisc on the egress of one veth end:
``"out"`` (default) limits what leaves the namespace (set inside, on ``kvrp<pid>b``), ``"in"``
what enters it (on ``kvrp<pid>a``). The bucket is ``max(256 KiB, 100 µs of the rate)`` and the
queue 50 ms, so a transfer of a few MB sees the rate, not the bucket. Whether the kernel holds the
nominal rate at tens of Gbit/s on veth depends on the machine (a CPU-bound sender gets less): measure
it, e.g. with :func:`tcp_throughput_bytes_per_s`. On the 2-core development machine raw TCP gets
96 % of 1 Gbit/s and 95 % of 10 Gbit/s (tbf charges the packet headers), while 25 Gbit/s cannot
be checked there: one Python sender reaches 10-20 Gbit/s, shaped or not.

:meth:`ShapedLink.close` (also ``__exit__``) removes what was made, in reverse, and never raises
for something already gone; :func:`remove_stale` removes the leftovers of a killed run (names of
pids no longer alive). Errors: :class:`NetnsError` (not root, ``ip``/``tc`` missing or refusing,
no free subnet), always with the failing command and its message.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

PREFIX = "kvrp"
SUBNET_BASE = "10.201"
TBF_MIN_BURST_BYTES = 256 << 10
TBF_BURST_S = 100e-6
TBF_LATENCY_MS = 50
CMD_TIMEOUT_S = 20


class NetnsError(RuntimeError):
    """Setting up, shaping or measuring the link failed; the message names the command."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done


def check_privileges() -> None:
    """NetnsError unless this process is root and ``ip`` and ``tc`` are on PATH."""
    if os.geteuid() != 0:
        raise NetnsError("network namespaces and tc need root (run as root, e.g. with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsError(f"`{tool}` (iproute2) is not installed")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove namespaces ``kvrp<pid>`` and veth ends ``kvrp<pid>a``/``b`` whose pid is no longer
    alive (left by a run that was killed with SIGKILL); returns what was removed. Never raises."""
    removed = []
    try:
        names = _run(["ip", "netns", "list"], check=False).stdout.split()
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
    except NetnsError:
        return removed
    for name in names:
        m = re.fullmatch(PREFIX + r"(\d+)", name)
        if m and not _pid_alive(int(m.group(1))):
            if _run(["ip", "netns", "del", name], check=False).returncode == 0:
                removed.append(f"netns {name}")
    for dev in re.findall(r"^\d+: (" + PREFIX + r"\d+[ab])[@:]", links, re.MULTILINE):
        if not _pid_alive(int(dev[len(PREFIX):-1])):
            # deleting a namespace takes its veth end's peer down with it, in the background: the
            # host end may be gone by now, removed all the same
            if (_run(["ip", "link", "del", dev], check=False).returncode == 0
                    or _run(["ip", "link", "show", "dev", dev], check=False).returncode != 0):
                removed.append(f"link {dev}")
    return removed


def _free_subnet(preferred: int) -> int:
    """A third octet ``n`` (1..254) such that ``10.201.n.0/24`` is on no interface or route here."""
    used = _run(["ip", "-4", "-o", "addr", "show"]).stdout + _run(["ip", "-4", "route", "show", "table", "all"]).stdout
    for i in range(254):
        n = (preferred + i) % 254 + 1
        if f"{SUBNET_BASE}.{n}." not in used:
            return n
    raise NetnsError(f"no free {SUBNET_BASE}.x.0/24 subnet")


class ShapedLink:
    """A network namespace and a veth pair to it (see the module docstring).

    ``tag``: the name stem (default ``kvrp<pid>``; at most 11 characters, a device name being at
    most 15). Attributes: ``ns`` (namespace name), ``host_dev``/``ns_dev`` (veth ends),
    ``host_ip``/``ns_ip`` (dotted quads), ``rate_bits_per_s`` (current shaping or None),
    ``shaped_dev`` (where the qdisc is, or None). Made by :meth:`open` (or ``__enter__``).
    """

    def __init__(self, tag: str | None = None) -> None:
        self.ns = tag or f"{PREFIX}{os.getpid()}"
        if len(self.ns) > 11 or not re.fullmatch(r"[A-Za-z0-9_-]+", self.ns):
            raise ValueError(f"tag {self.ns!r}: at most 11 letters, digits, '_' or '-'")
        self.host_dev = self.ns + "a"
        self.ns_dev = self.ns + "b"
        self.host_ip = self.ns_ip = ""
        self.rate_bits_per_s: float | None = None
        self.shaped_dev: str | None = None
        self._made: list[str] = []   # "netns", "link": what close() must remove

    # ---- setup and teardown ---------------------------------------------------------------------
    def open(self) -> "ShapedLink":
        """Make the namespace and the veth pair; NetnsError (with everything made so far removed)
        when not root or a command fails."""
        check_privileges()
        try:
            _run(["ip", "netns", "add", self.ns])
            self._made.append("netns")
            n = _free_subnet(os.getpid() % 254)
            self.host_ip, self.ns_ip = f"{SUBNET_BASE}.{n}.1", f"{SUBNET_BASE}.{n}.2"
            _run(["ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev])
            self._made.append("link")
            _run(["ip", "link", "set", self.ns_dev, "netns", self.ns])
            _run(["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_dev])
            _run(["ip", "link", "set", self.host_dev, "up"])
            self._in_ns(["ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_dev])
            self._in_ns(["ip", "link", "set", self.ns_dev, "up"])
            self._in_ns(["ip", "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> list[str]:
        """Remove the qdisc, the veth pair and the namespace (whatever of them exists); returns
        the problems met (empty when all went), never raises. Idempotent."""
        problems = []
        if "link" in self._made:
            # deleting one end deletes both, and with them any qdisc
            done = _run(["ip", "link", "del", self.host_dev], check=False)
            if done.returncode != 0 and "Cannot find device" not in done.stderr:
                problems.append(f"ip link del {self.host_dev}: {done.stderr.strip()}")
        if "netns" in self._made:
            done = _run(["ip", "netns", "del", self.ns], check=False)
            if done.returncode != 0 and "No such file" not in done.stderr:
                problems.append(f"ip netns del {self.ns}: {done.stderr.strip()}")
        self._made.clear()
        self.rate_bits_per_s = self.shaped_dev = None
        return problems

    def __enter__(self) -> "ShapedLink":
        return self.open()

    def __exit__(self, *exc) -> None:
        problems = self.close()
        if problems:
            print(f"netns cleanup: {'; '.join(problems)}", file=sys.stderr)

    def exists(self) -> bool:
        """Whether the namespace and the root end of the veth are there now (for checks)."""
        names = _run(["ip", "netns", "list"], check=False).stdout.split()
        dev = _run(["ip", "link", "show", self.host_dev], check=False).returncode == 0
        return self.ns in names or dev

    # ---- use ------------------------------------------------------------------------------------
    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec``, which execs it: same pid)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def _in_ns(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return _run(self.exec_argv(argv), check=check)

    def shape(self, rate_bits_per_s: float | None, direction: str = "out") -> None:
        """Limit one direction to ``rate_bits_per_s`` (a tbf qdisc; None: no limit). ``direction``
        ``"out"``: traffic leaving the namespace; ``"in"``: entering it. Replaces any earlier
        shaping (both directions are cleared first). NetnsError when tc refuses."""
        if direction not in ("out", "in"):
            raise ValueError(f"direction {direction!r}: 'out' or 'in'")
        if rate_bits_per_s is not None and not rate_bits_per_s > 0:
            raise ValueError(f"rate_bits_per_s must be > 0, got {rate_bits_per_s}")
        self._in_ns(["tc", "qdisc", "del", "dev", self.ns_dev, "root"], check=False)
        _run(["tc", "qdisc", "del", "dev", self.host_dev, "root"], check=False)
        self.rate_bits_per_s = self.shaped_dev = None
        if rate_bits_per_s is None:
            return
        burst = max(TBF_MIN_BURST_BYTES, int(rate_bits_per_s / 8 * TBF_BURST_S))
        tbf = ["tc", "qdisc", "add", "dev", "DEV", "root", "tbf", "rate", f"{int(rate_bits_per_s)}bit",
               "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]
        if direction == "out":
            tbf[4] = self.ns_dev
            self._in_ns(tbf)
            self.shaped_dev = self.ns_dev
        else:
            tbf[4] = self.host_dev
            _run(tbf)
            self.shaped_dev = self.host_dev
        self.rate_bits_per_s = float(rate_bits_per_s)

    def ns_tx_bytes(self) -> int:
        """Bytes sent so far out of the namespace through its veth end (headers included: what
        crossed the link, not the payload). NetnsError when ``ip`` cannot say."""
        done = _run(["ip", "-n", self.ns, "-s", "-j", "link", "show", "dev", self.ns_dev])
        try:
            return int(json.loads(done.stdout)[0]["stats64"]["tx"]["bytes"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise NetnsError(f"no tx byte count for {self.ns_dev}: {done.stdout[:200]!r}") from exc

    def qdisc(self) -> str:
        """``tc qdisc show`` of the shaped end (empty when unshaped), for reports."""
        if self.shaped_dev is None:
            return ""
        argv = ["tc", "qdisc", "show", "dev", self.shaped_dev]
        done = self._in_ns(argv, check=False) if self.shaped_dev == self.ns_dev else _run(argv, check=False)
        return done.stdout.strip()


# A sender run inside the namespace: listens on ADDR:PORT, prints "ready", and for one connection
# sends N bytes from a 1 MiB buffer, then exits. Stops by itself after DEADLINE seconds.
_SENDER = r"""
import signal, socket, sys
host, port, n, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
signal.alarm(deadline)
srv = socket.create_server((host, port))
print("ready", flush=True)
conn, _ = srv.accept()
buf = memoryview(bytes(1 << 20))
left = n
while left > 0:
    k = min(left, len(buf))
    conn.sendall(buf[:k])
    left -= k
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
"""


def tcp_throughput_bytes_per_s(link: ShapedLink, n_bytes: int = 64 << 20, deadline_s: float = 60.0) -> float:
    """Bytes per second of one raw TCP transfer of ``n_bytes`` leaving the namespace (a Python
    sender inside, this process receiving outside; timed from the first byte to the last, so the
    connection set-up is left out). NetnsError when the transfer fails or passes ``deadline_s``."""
    port = _free_port_in_ns(link)
    argv = ["timeout", "-s", "KILL", str(int(deadline_s) + 5),
            *link.exec_argv([sys.executable, "-c", _SENDER, link.ns_ip, str(port), str(n_bytes), str(int(deadline_s))])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise NetnsError(f"the TCP sender did not start: {line}{proc.stderr.read()[-1000:]}")
        got = 0
        buf = bytearray(1 << 20)
        with socket.create_connection((link.ns_ip, port), timeout=deadline_s) as sock:
            sock.settimeout(deadline_s)
            first = sock.recv_into(buf)
            t0 = time.perf_counter()
            got = first
            while got < n_bytes:
                k = sock.recv_into(buf)
                if k == 0:
                    break
                got += k
            seconds = time.perf_counter() - t0
        if got != n_bytes:
            raise NetnsError(f"TCP transfer through {link.ns_dev}: {got} of {n_bytes} bytes came")
        return (n_bytes - first) / seconds
    except OSError as exc:
        raise NetnsError(f"TCP transfer through {link.ns_dev}: {exc}") from exc
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _free_port_in_ns(link: ShapedLink) -> int:
    """A TCP port free on the namespace's address (asked inside it)."""
    done = link._in_ns([sys.executable, "-c", "import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 0)); "
                        "print(s.getsockname()[1])", link.ns_ip])
    return int(done.stdout.strip())

