"""One gateway process among the N of ``kvroute serve --processes N`` (:mod:`router.processes.supervisor`
starts them): where it listens, the table its load goes into, and how it reaches its siblings.

Every process is a whole gateway: its own policy and dispatch queue, on one TCP port that the
kernel shares out (``SO_REUSEPORT``: each process has its own listening socket and the kernel
hashes new connections over them). What must agree across processes goes as follows:

- the embedded index: one copy for all, ``<run dir>/index`` (:mod:`kvcore.index.host`), that one
  process (its writer) fills from every worker's KV events; the others read it and follow the
  writer's event streams on a board (:mod:`router.shared.ingest`), and one of them takes the
  writing over if the writer dies;
- in-flight load: through the shared table (:mod:`router.shared.load_table`);
- admission control's slots and queue (``admission``): counted for the whole gateway in
  ``<run dir>/admission`` (:mod:`router.route.shared_admission`), so every limit holds whatever N;
- the workers' health probes and load scrapes: the live process of lowest index makes them and
  the others apply its results (:mod:`router.shared.probe_table`), so a worker answers them once per
  interval whatever the process count;
- admin changes (``POST``/``DELETE /admin/workers``, ``drain``, ``PUT /admin/policy``): the
  process that gets one applies it, then sends it to each sibling over the sibling's private
  Unix socket (``<run dir>/p<i>.sock``) with the header :data:`SIBLING_HEADER`, which a sibling
  applies without sending it on; ``SIGHUP`` reaches every process from the supervisor;
- reads that span processes (``GET /admin/decisions``, ``GET /metrics``): the process asked
  gathers its siblings' answers over the same sockets and merges them.

The environment the supervisor sets (:data:`ENV_INDEX`, :data:`ENV_PROCESSES`,
:data:`ENV_RUN_DIR`) makes a ``kvroute serve`` a member; without it a process is alone.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from router.route.shared_admission import AdmissionTable
from router.shared.load_table import SharedLoadTable
from router.shared.probe_table import SharedProbeTable

log = logging.getLogger("kvroute.siblings")

ENV_INDEX = "KVROUTE_PROCESS_INDEX"
ENV_PROCESSES = "KVROUTE_PROCESSES"
ENV_RUN_DIR = "KVROUTE_RUN_DIR"
ENV_SHARED_LOAD = "KVROUTE_SHARED_LOAD"  # "off": each process sees only its own load (for comparison)
SIBLING_HEADER = "x-kvroute-sibling"
LOAD_FILE = "load"
PROBES_FILE = "probes"
ADMISSION_FILE = "admission"  # admission control's slots and queue (router.route.shared_admission)
INDEX_FILE = "index"  # the host index (kvcore.index.host), made by the first process to open it
FANOUT_TIMEOUT_S = 10.0


def socket_path(run_dir: Path, index: int) -> Path:
    """The private Unix socket of process ``index``."""
    return run_dir / f"p{index}.sock"


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP listening socket on ``host:port`` with ``SO_REUSEPORT`` (and ``SO_REUSEADDR``), so
    every gateway process binds the same port. Raises OSError when the port is taken by a socket
    without ``SO_REUSEPORT`` or the platform lacks it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def unix_socket(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` (a stale file there is removed first)."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(256)
    return sock


@dataclass
class ProcessGroup:
    """This process's place among its siblings. ``index``: 0..processes-1; ``run_dir``: the
    supervisor's folder (the load and probe tables, the Unix sockets); ``probes``: the shared
    probe table (None when ``table`` is); ``table``: the shared load table (None
    with ``KVROUTE_SHARED_LOAD=off``: each process then sees the others' requests only in the
    engines' scraped queues, as any other client's; kept for measuring the table's worth);
    ``admission``: the shared admission table (always shared: it enforces limits, not a
    routing signal; None only when built by hand without one)."""

    index: int
    processes: int
    run_dir: Path
    table: SharedLoadTable | None
    probes: SharedProbeTable | None = None
    admin_token: str | None = None
    admission: AdmissionTable | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ProcessGroup | None:
        """The group this process belongs to by the supervisor's environment, None when alone.
        Raises ValueError on an inconsistent environment."""
        env = os.environ if environ is None else environ
        if ENV_INDEX not in env:
            return None
        index, processes = int(env[ENV_INDEX]), int(env[ENV_PROCESSES])
        run_dir = Path(env[ENV_RUN_DIR])
        table = None if env.get(ENV_SHARED_LOAD) == "off" else SharedLoadTable(run_dir / LOAD_FILE, processes, index)
        probes = SharedProbeTable(run_dir / PROBES_FILE) if table is not None else None
        admission = AdmissionTable(run_dir / ADMISSION_FILE, processes, index)
        return cls(index, processes, run_dir, table, probes, admission=admission)

    def is_prober(self) -> bool:
        """Whether this process makes the workers' probes and scrapes for all
        (:mod:`router.shared.probe_table`): the live process of lowest index."""
        return self.table is None or self.table.first_live_row() == self.index

    @property
    def sibling_indices(self) -> list[int]:
        """The other processes' indices."""
        return [i for i in range(self.processes) if i != self.index]

    def close(self) -> None:
        """Unmap the tables."""
        if self.table is not None:
            self.table.close()
        if self.probes is not None:
            self.probes.close()
        if self.admission is not None:
            self.admission.close()

    async def _one(self, index: int, method: str, path: str, body: bytes | None,
                   headers: dict[str, str]) -> tuple[int, int, bytes]:
        connector = aiohttp.UnixConnector(path=str(socket_path(self.run_dir, index)))
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=FANOUT_TIMEOUT_S)) as session:
            async with session.request(method, "http://sibling" + path, data=body, headers=headers) as resp:
                return index, resp.status, await resp.read()

    async def fanout(self, method: str, path: str, body: bytes | None = None,
                     headers: dict[str, str] | None = None) -> list[tuple[int, int, bytes]]:
        """Send one request to every sibling (marked with :data:`SIBLING_HEADER`, carrying the
        admin token); returns ``(index, status, body)`` for those that answered. A sibling that
        fails to answer is logged and left out (it may be restarting)."""
        hdrs = {SIBLING_HEADER: "1", **(headers or {})}
        if self.admin_token:
            hdrs["Authorization"] = f"Bearer {self.admin_token}"
        results = await asyncio.gather(*(self._one(i, method, path, body, hdrs) for i in self.sibling_indices),
                                       return_exceptions=True)
        out = []
        for i, got in zip(self.sibling_indices, results):
            if isinstance(got, BaseException):
                log.warning("gateway process %d did not answer %s %s: %r", i, method, path, got)
            else:
                out.append(got)
        return out


def is_from_sibling(headers: Any) -> bool:
    """Whether a request came from a sibling process (it must not be sent on again)."""
    return headers.get(SIBLING_HEADER) == "1"


def merge_metrics(expositions: dict[int, str]) -> bytes:
    """The Prometheus text of every process's ``/metrics`` in one exposition: each sample gains
    the label ``process`` (its index), families keep their type and help. ``expositions``:
    process index -> its exposition text. Raises ValueError on text that does not parse."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for index in sorted(expositions):
        for fam in text_string_to_metric_families(expositions[index]):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, "process": str(index)}, s.value, s.timestamp,
                                         s.exemplar) for s in fam.samples)

    class _Merged:
        def collect(self):
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
