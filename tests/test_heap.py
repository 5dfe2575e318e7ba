"""Freed memory goes back to the OS after a request: the C heap's free pages, not only its top."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from app.serve import heap


def _rss_mib() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


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
    freed = _rss_mib()
    heap.release()
    released = _rss_mib()
    libc.free(blocks[-1])
    assert freed - released >= 150, f"{freed:.0f} MiB resident after free, {released:.0f} MiB after release"
