"""Freed memory goes back to the operating system once a request ends.

glibc keeps what a program frees in its arenas for reuse, one arena per busy thread, and hands
pages back only from the top of each. A server whose requests run on several worker threads
therefore stays resident near its busiest moment, with its free space scattered between live
blocks, and slowly grows as new visitors come. What a host's memory limit sees is that resident
size. `malloc_trim(0)` returns every whole free page of every arena, which is cheap beside a run.
Where the C library has no such call (macOS, musl), release does nothing.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library this process already runs on
    except (AttributeError, OSError, TypeError):  # no such call, or no process-wide handle (Windows)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release() -> None:
    """Hand the C heap's whole free pages back to the OS (a no-op where the C library cannot)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
