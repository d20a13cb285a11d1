"""Keep freed memory in the heap for the next request, within a bound (glibc malloc only).

By default glibc hands large blocks back to the kernel as soon as they are freed (mmap'd blocks
above a threshold that starts at 128 KiB, and the top of the heap above 128 KiB): every request
then pays page faults for its body and answer buffers again. Raising both thresholds keeps up to
`TRIM_THRESHOLD` of freed memory for reuse; anything beyond is still returned, so what an idle
process keeps after a burst stays bounded. Elsewhere (musl, macOS) this does nothing.
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


def keep_freed_memory() -> bool:
    """Apply the thresholds to this process; False where malloc is not glibc's."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
