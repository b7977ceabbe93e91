"""Keep freed memory in the process, so every training step reuses the last step's pages.

A step allocates and frees the same large arrays each time (im2col columns of hundreds of MB), and glibc returns
a freed block over 32 MB to the kernel, so the next step faults in fresh zeroed pages (the measurements:
docs/how-it-works.md). :func:`keep_freed_memory` tells malloc to serve every block from its heap (``M_MMAP_MAX``
= 0), never to give the heap's top back (``M_TRIM_THRESHOLD`` = -1, read as the largest size_t: INT_MAX would
still give back a top of over 2 GB, as 300:1000's conv2 columns are at batch 256) and to use one arena for all
threads (``M_ARENA_MAX`` = 1, so a worker's compute thread shares it). The master and the worker call it at
start; ``TINYCONV_KEEP_FREED_MEMORY=0`` turns it off; elsewhere than glibc it does nothing. A calibration times
the *whole* layer on the whole batch, its own peak: :func:`release_freed_memory` (``malloc_trim``) gives every
free page back once it is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_NEVER = -1  # as M_TRIM_THRESHOLD: glibc converts the int to size_t, so SIZE_MAX bytes


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse; True if it applied. Call before big allocations and threads."""
    if os.environ.get("TINYCONV_KEEP_FREED_MEMORY", "1") == "0":
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    return all(
        mallopt(param, value) == 1 for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _NEVER), (M_ARENA_MAX, 1))
    )


def release_freed_memory() -> bool:
    """Give the kernel every whole free page of the heap (glibc's ``malloc_trim(0)``): the next
    allocations fault their pages in again. True if glibc released any; False elsewhere."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim(0) == 1


def _glibc(name: str) -> Any:
    """glibc's function ``name``, or None elsewhere than Linux or where the C library lacks it (musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
