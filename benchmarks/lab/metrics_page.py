"""A Prometheus text page restricted to named metrics, as vLLM 0.32 answers ``GET /metrics/?name[]=...``.

vLLM mounts prometheus_client's ASGI app at ``/metrics``; its ``name[]`` query keeps only the
metric families named (``prometheus_client.exposition``: ``registry.restricted_registry``). The
benchmarks' stand-in worker fleets (``bench_scale.py``, ``bench_probe_cpu.py``) serve a recorded
page through :class:`NamedPages` so the gateway's filtered load scrape reads what vLLM would send.
Pure text handling: no I/O.
"""
from __future__ import annotations

from collections.abc import Iterable


def metric_name(line: str) -> str:
    """The metric a page line belongs to: the third word of a ``# HELP``/``# TYPE`` line, else the
    sample's name (before its labels or value)."""
    if line.startswith("#"):
        parts = line.split(" ")
        return parts[2] if len(parts) > 2 else ""
    return line.split("{", 1)[0].split(" ", 1)[0]


def restrict(page: str, names: Iterable[str]) -> str:
    """The lines of ``page`` that belong to ``names``, each ending in a newline."""
    keep = frozenset(names)
    return "".join(line + "\n" for line in page.splitlines() if metric_name(line) in keep)


class NamedPages:
    """``page`` restricted per set of names, each computed once (a scrape asks the same names
    every time)."""

    def __init__(self, page: str) -> None:
        self.page = page
        self._by_names: dict[frozenset[str], str] = {}

    def of(self, names: Iterable[str]) -> str:
        key = frozenset(names)
        text = self._by_names.get(key)
        if text is None:
            text = self._by_names[key] = restrict(self.page, key)
        return text
