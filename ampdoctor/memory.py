"""Give freed host memory back to the operating system, so a diagnose's peak RSS is what it
holds, not what it once held.

A diagnose frees and allocates many model-sized tensors (runs, references, copies read back from
disk). glibc's malloc raises its mmap threshold to the largest block freed so far (up to 32 MiB),
after which blocks of that size come from the heap and stay in the process when freed: on a
22M-parameter model that kept ~400 MB the diagnose no longer used. A fixed threshold keeps
blocks of 4 MiB and more mmapped, returned to the system as soon as they are freed.

Only the processes ampdoctor owns call this (the CLI's diagnose and the DDP ranks it spawns):
the Python API leaves the user's process as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: mallopt's parameter number for the mmap threshold (glibc malloc.h).
M_MMAP_THRESHOLD = -3
#: Blocks of at least this many bytes are mmapped (glibc's default starts at 128 KiB and grows).
THRESHOLD = 4 * 2**20


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at THRESHOLD; False where there is no glibc or the user set
    MALLOC_MMAP_THRESHOLD_ themselves."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):   # musl and others: no mallopt
        return False
