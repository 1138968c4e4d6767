"""The files ``kvroute serve --processes N`` shares between its processes in the supervisor's run
folder (:mod:`router.shared.load_table`, :mod:`router.shared.probe_table`, :mod:`router.route.shared_admission`):
each is a zero-filled file of a fixed size that every process maps whole."""
from __future__ import annotations

import mmap
import os
from pathlib import Path


def create_zeroed(path: Path, size_bytes: int) -> Path:
    """Create (or truncate) ``path`` as ``size_bytes`` zero bytes. Raises OSError when the file
    cannot be made."""
    with open(path, "wb") as f:
        f.truncate(size_bytes)
    return path


def map_whole(path: Path, size_bytes: int, layout: str) -> tuple[int, mmap.mmap]:
    """``(fd, map)`` of ``path`` opened read-write and mapped whole. Raises ValueError (the file
    closed) when it has another size than ``size_bytes``, naming ``layout`` (what that size is
    made of, e.g. "4 rows"); OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    if size != size_bytes:
        os.close(fd)
        raise ValueError(f"{path} has {size} bytes, not the {size_bytes} of {layout}")
    return fd, mmap.mmap(fd, size)
