"""The KV-event ingest of ``kvroute serve --processes N`` with the host index
(:mod:`kvcore.index.host`): one process (the index's writer) subscribes to every worker's KV
events and writes the index all of them read; the others see its ingest through a board.

The writer writes the board, ``<run dir>/ingest.json``, every :data:`PUBLISH_EVERY_S` seconds
(a whole new file renamed over the old one): per worker, whether its subscriber is connected, the
batches it received and the ingestor's state (:meth:`kvcore.kv_events.EventIngestor.state`).
A reader process keeps a :class:`PublishedIngest` on each worker registration instead of an
ingestor, so that ``events_live`` (whether the worker's prefix evidence is credited), its
``/admin`` views and ``kvroute_worker_events_live`` follow the writer's stream. When the writer
dies, a reader takes the index over and starts the ingestors itself
(:func:`router.workers.embedded_events.embedded_ingest_task`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvcore.ticks import ticks

log = logging.getLogger("kvroute.shared_ingest")

BOARD_FILE = "ingest.json"
PUBLISH_EVERY_S = 1.0
READ_EVERY_S = 0.5  # a reader reads the board at most this often


class IngestBoard:
    """The board file at ``path`` (module docstring); read and written by any process."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._cache: dict[str, Any] = {}
        self._read_at = -1e9

    def publish(self, workers: dict[str, dict[str, Any]]) -> None:
        """Replace the board with ``workers``: id -> {"connected", "batches_received", "state"}.
        Raises OSError when the run folder cannot be written."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"written_unix_s": time.time(), "workers": workers}))
        os.replace(tmp, self.path)

    def worker(self, worker_id: str) -> dict[str, Any] | None:
        """The writer's last word on ``worker_id``, None when it has none (yet)."""
        now = time.monotonic()
        if now - self._read_at >= READ_EVERY_S:
            self._read_at = now
            try:
                self._cache = json.loads(self.path.read_text()).get("workers", {})
            except (OSError, ValueError):
                pass  # not written yet, or mid-rename on an odd filesystem: keep the last view
        return self._cache.get(worker_id)


class PublishedIngest:
    """A worker's ingest as the board shows it, in the place of an ingestor (duck-typed: the
    registry reads ``subscriber.connected``, ``subscriber.batches_received`` and ``state()``)."""

    def __init__(self, board: IngestBoard, worker_id: str) -> None:
        self.board = board
        self.worker_id = worker_id

    @property
    def subscriber(self) -> PublishedIngest:
        return self

    @property
    def connected(self) -> bool:
        entry = self.board.worker(self.worker_id)
        return bool(entry and entry.get("connected"))

    @property
    def batches_received(self) -> int:
        entry = self.board.worker(self.worker_id)
        return int(entry.get("batches_received", 0)) if entry else 0

    def state(self) -> dict[str, Any] | None:
        entry = self.board.worker(self.worker_id)
        return dict(entry["state"], ingest_process="writer") if entry and entry.get("state") else None

    async def restore_if_continuous(self) -> bool:
        return False  # the writer restores its own view


async def publish_loop(board: IngestBoard, is_writer: Callable[[], bool],
                       ingestors: Callable[[], Iterable[tuple[str, Any]]]) -> None:
    """While this process is the writer, publish its ingestors' states every
    :data:`PUBLISH_EVERY_S` seconds. ``ingestors``: (worker id, EventIngestor) pairs."""
    while True:
        if is_writer():
            workers = {}
            for worker_id, ing in ingestors():
                sub = ing.subscriber
                workers[worker_id] = {"connected": bool(sub.connected), "batches_received": sub.batches_received,
                                      "state": ing.state()}
            try:
                board.publish(workers)
            except OSError as exc:
                log.warning("could not write the KV-event ingest board %s: %s", board.path, exc)
        await ticks().wait(PUBLISH_EVERY_S)  # on the probe loops' ticks: no wake-up of its own
