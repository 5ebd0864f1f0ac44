"""Giving memory back to the system (glibc's malloc keeps freed memory unless asked; elsewhere these do nothing).

accudiff bounds the memory of its process tree: what it frees must leave the process, not wait in
malloc's free lists for an allocation that may never come.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)


def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def return_freed_memory() -> None:
    """Hand freed heap memory back to the system now (glibc keeps it otherwise)."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def map_large_blocks_separately() -> None:
    """glibc serves a large block from its heap once a block that large was freed (its mmap threshold
    follows the largest freed block, up to 32 MiB), and a heap holding freed tensors between live ones
    cannot shrink: a process would keep the memory of tensors long dropped. A fixed threshold keeps every
    block of 1 MiB and more in its own mapping, returned to the system when freed."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
