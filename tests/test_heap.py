"""Freed memory goes back to the OS after a request: the C heap's free pages, not only its top."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
from app_server import rss_mib

from app.serve import heap


def test_release_hands_free_pages_between_live_blocks_back_to_the_os():
    if heap._malloc_trim() is None or not Path("/proc/self/status").exists():
        pytest.skip("no malloc_trim in this C library, or no /proc to read memory from")
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 64 * 1024, 3200  # 200 MiB in blocks below the mmap threshold, so they come from the heap
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[:-1]:  # the last block stays live above the freed space, as a live request's would
        libc.free(b)
    freed = rss_mib(os.getpid())
    heap.release()
    released = rss_mib(os.getpid())
    libc.free(blocks[-1])
    assert freed - released >= 150, f"{freed:.0f} MiB resident after free, {released:.0f} MiB after release"
