"""Host memory: freed memory kept in the process, large buffers committed as they are used.

PyTorch's CPU allocator is glibc's malloc. Tensors above malloc's mmap
threshold (a few hundred KB, growing only as large chunks are freed) get
fresh pages from the kernel each time, and every page costs a fault on
first touch: on the VMs this project runs on, ~3 µs per 4 KiB page, so a
step's logits alone ([64, 49152] float32, 12 MB) cost ~10 ms. Raising the
thresholds once makes every later step reuse the heap's pages.

The paged KV cache is the other way round: one large buffer of which a
light load uses the first few blocks. ``untouched_zeros`` maps it straight
from the kernel, so a page is committed when a block on it is first
written, not when the cache is made. Its default size is a share of
``available_memory_bytes`` (``cadence.runner.device_setup``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os

import torch

from cadence.models.step_buffer import release_step_buffers

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems
_TRIM_THRESHOLD = 1 << 30
_TOP_PAD = 64 << 20


def _glibc_function(name: str, argtypes: list, restype) -> "ctypes._CFuncPtr | None":
    """glibc's ``name`` with its prototype, or None where there is no glibc."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        function = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


@functools.cache
def keep_freed_memory() -> bool:
    """Tune glibc's malloc for step-after-step reuse; False where there is no glibc."""
    mallopt = _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
                (_M_TOP_PAD, _TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc's malloc_trim);
    False where there is no glibc.

    Loading a model frees its transients (decoded metadata, copied tensors)
    in the middle of the heap, where the trim threshold never reaches: called
    once before the KV cache is allocated, the process's resident memory is
    the weights and the cache, not the load's leftovers as well. Called again
    whenever the engine goes idle; the step buffers (``StepBuffer``) go too.
    """
    release_step_buffers()
    malloc_trim = _glibc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on the CPU whose pages are committed on first write.

    An anonymous private mapping reads as zeros and takes no memory until a
    page is written (``torch.zeros`` writes every page at once). Huge pages
    are refused for it: under THP "always" a first write would commit 2 MiB
    where a KV block holds a few KiB. The tensor keeps the mapping alive.
    """
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, numel * dtype.itemsize),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def available_memory_bytes() -> int:
    """Memory the kernel can give without swapping (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
