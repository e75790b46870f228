"""Give freed host memory back to the operating system, so a diagnose's peak RSS is what it
holds, not what it once held.

A diagnose frees and allocates many model-sized tensors (runs, references, copies read back from
disk). glibc's malloc raises its mmap threshold to the largest block freed so far (up to 32 MiB),
after which blocks of that size come from the heap and stay in the process once freed: on a
22M-parameter model that kept ~400 MB the diagnose no longer used. After each run and each rung,
`trim` hands the heap's free pages back (glibc's malloc_trim). Fixing the mmap threshold instead
returns every block at once but costs a page fault per page of every large allocation (measured:
13% more wall time on that model for 7% less peak memory), so it is not done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Literal

_LIBC: ctypes.CDLL | Literal[False] | None = None


def _libc() -> ctypes.CDLL | Literal[False]:
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _LIBC = False
    return _LIBC


def trim() -> bool:
    """Hand the heap's free pages back to the system (glibc's malloc_trim); False where there
    is no glibc (musl, macOS, Windows), where nothing is done."""
    libc = _libc()
    if not libc or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True
