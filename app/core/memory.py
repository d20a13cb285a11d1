"""Keep freed memory in the heap for the next request, within a bound (glibc malloc only).

By default glibc hands large blocks back to the kernel as soon as they are freed (mmap'd blocks
above a threshold that starts at 128 KiB, and the top of the heap above 128 KiB): every request
then pays page faults for its body and answer buffers again. Raising both thresholds keeps up to
`TRIM_THRESHOLD` of freed memory for reuse; anything beyond is still returned. After large work
(`TRIM_AFTER_BYTES`) a process that has nothing else to do trims its heap, so what an idle server
keeps after a burst of maximum-size requests stays small. Elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("tokenizer")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest: blocks above this are mmap'd and freed at once
TRIM_THRESHOLD = 64 * 1024 * 1024


TRIM_AFTER_BYTES = 4 * 1024 * 1024  # a request or job this large is followed by a trim when things are quiet

_libc: ctypes.CDLL | None = None


def _c_library() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        try:
            _libc = ctypes.CDLL(name)
        except OSError:
            return None
    return _libc


def trim() -> bool:
    """Hand freed heap memory back to the kernel now (glibc malloc_trim): after a burst of large work.

    Keeping freed memory speeds up the next request of the same size, but after a maximum-size
    burst it would keep hundreds of MiB per process for good; callers trim once they are idle.
    """
    libc = _c_library()
    malloc_trim = getattr(libc, "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    return bool(malloc_trim(0))


def keep_freed_memory() -> bool:
    """Apply the thresholds to this process; False where malloc is not glibc's."""
    libc = _c_library()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
