"""Host memory the GPU copies to and from directly: the CPU tier's slab and staging buffers.

Torch and the standard library only. A DMA between the GPU and host memory runs asynchronously
only when the host pages are pinned; otherwise the driver stages through its own buffer and the
host waits. Two ways to get pinned pages, both here:

- memory that already exists (the agent's shared memory file, an anonymous mapping) is
  *registered* with ``cudaHostRegister`` (:func:`register`) in **one** call for the whole buffer:
  an asynchronous copy whose host range spans two registrations fails with
  ``cudaErrorInvalidValue`` (``tools/gpu_check_connector.py`` section E shows it), and a run of
  consecutive slots may lie anywhere in the slab. The return code is checked and a failure's error
  is cleared (``cudaGetLastError``), so it cannot surface later as an unrelated CUDA error. A
  failed registration is not fatal: copies still run, synchronously (a warning says so);
- the local CPU tier (no agent) is an anonymous mapping, registered the same way
  (:func:`host_buffer`), not ``torch.empty(pin_memory=True)``: torch's pinned allocator rounds a
  request up to a power of two (a 40 GiB tier would pin 64 GiB).

The CUDA runtime is called through ``ctypes`` on the ``libcudart`` torch has loaded (found in
``/proc/self/maps``), as vLLM's ``CudaRTLibrary`` does, because torch's ``cudart()`` binding has no
``cudaGetLastError``; without it, torch's binding is used and errors are only logged.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from dataclasses import dataclass, field

import torch

log = logging.getLogger("vllm.kvroute_tiers.host")


class _CudaRT:
    """``cudaHostRegister``/``cudaHostUnregister``/``cudaGetLastError`` of the process's libcudart."""

    def __init__(self) -> None:
        self._lib = None
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
        except OSError:
            paths = set()
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path)
                lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
                lib.cudaHostRegister.restype = ctypes.c_int
                lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
                lib.cudaHostUnregister.restype = ctypes.c_int
                lib.cudaGetLastError.restype = ctypes.c_int
                self._lib = lib
                break
            except (OSError, AttributeError):
                continue

    def host_register(self, ptr: int, nbytes: int) -> int:
        if self._lib is not None:
            return self._lib.cudaHostRegister(ptr, nbytes, 0)
        return _code(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))

    def host_unregister(self, ptr: int) -> int:
        if self._lib is not None:
            return self._lib.cudaHostUnregister(ptr)
        return _code(torch.cuda.cudart().cudaHostUnregister(ptr))

    def clear_error(self) -> None:
        if self._lib is not None:
            self._lib.cudaGetLastError()


def _code(result) -> int:
    return int(getattr(result, "value", result))


_cudart: _CudaRT | None = None


def cudart() -> _CudaRT:
    """The process's CUDA runtime calls (made once)."""
    global _cudart
    if _cudart is None:
        _cudart = _CudaRT()
    return _cudart


@dataclass
class Registration:
    """Host ranges registered by :func:`register`: ``(address, bytes)`` of each (one per buffer)."""

    chunks: list[tuple[int, int]] = field(default_factory=list)
    rt: "_CudaRT | None" = None

    @property
    def ok(self) -> bool:
        return bool(self.chunks)

    def release(self) -> None:
        """Unregister every range (errors cleared and logged)."""
        rt = self.rt or cudart()
        for ptr, _ in self.chunks:
            code = rt.host_unregister(ptr)
            if code:
                rt.clear_error()
                log.warning("cudaHostUnregister(%#x) failed with CUDA error %d", ptr, code)
        self.chunks.clear()


def register(t: torch.Tensor, rt: _CudaRT | None = None) -> Registration:
    """Register ``t``'s memory (a contiguous CPU tensor) for DMA in one ``cudaHostRegister`` call
    (module docstring: a copy may not span two registrations). Returns the registration (``ok``
    False when CUDA refused: the error is cleared and a warning names the code)."""
    rt = rt or cudart()
    reg = Registration(rt=rt)
    base, total = t.data_ptr(), t.numel() * t.element_size()
    code = rt.host_register(base, total)
    if code:
        rt.clear_error()
        log.warning("cudaHostRegister of %d bytes failed with CUDA error %d: the tier's copies run unpinned "
                    "(synchronous, slower)", total, code)
        return reg
    reg.chunks.append((base, total))
    return reg


def host_buffer(nbytes: int, cuda: bool) -> tuple[torch.Tensor, Registration | None]:
    """``uint8 [nbytes]`` host memory; on CUDA an anonymous mapping, populated and registered
    (exact size, no power-of-two rounding); on CPU a plain tensor. Raises OSError/MemoryError
    when the memory cannot be had."""
    if not cuda:
        return torch.empty(nbytes, dtype=torch.uint8), None
    mm = mmap.mmap(-1, max(1, nbytes))
    populate = getattr(mmap, "MADV_POPULATE_WRITE", None)
    if populate is not None:
        try:
            mm.madvise(populate)
        except OSError:
            pass  # an older kernel: registration faults the pages in
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    return t, register(t)
