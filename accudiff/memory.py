"""How accudiff's processes use memory with glibc's malloc: giving it back to the system (glibc keeps freed
memory unless asked). Elsewhere these do nothing.

Huge pages are not asked for: with the kernel's default defrag policy (madvise) the first touch of
madvised memory may compact memory first, and a process's first run paid for it (0.6 s instead of 0.1 s
for the PP-OCRv4 recognizer's marked run, on a machine whose memory had been in use).

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
