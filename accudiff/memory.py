"""How accudiff's processes use memory with glibc's malloc: giving it back to the system (glibc keeps freed
memory unless asked), and backing large blocks with huge pages when tensors are large. Elsewhere these
do nothing.

accudiff bounds the memory of its process tree: what it frees must leave the process, not wait in
malloc's free lists for an allocation that may never come.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from typing import Mapping

M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers (glibc's malloc.h)
M_ARENA_MAX = -8
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"  # glibc >= 2.35; older glibc and other C libraries ignore it
# Huge pages pay where tensors are this large: page faults then dominate (a 2 GB chain of 100 MB tensors:
# 9.2 s -> 5.6 s without the isolated run). With small tensors they cost: the kernel's default defrag
# policy (madvise) may compact memory on first touch, and the PP-OCRv4 recognizer's first marked run
# took 0.6 s instead of 0.1 s.
HUGE_PAGES_FROM_TENSOR_BYTES = 32 << 20
# A segmented comparison's tensors are dropped as it goes, and the memory must leave the process: each
# block of 1 MiB or more then gets a mapping of its own (`map_large_blocks_separately`). Where every tensor
# is smaller than this, glibc's own policy serves freed blocks again instead (with the fixed threshold,
# every block of 1 MiB or more, tensor or session buffer, was a fresh mapping, and the heap gave its top
# back at every 128 KB free: fresh pages again and again). The PP-OCRv4 recognizer's comparison (tensors
# under 4 MB): 3.47 -> 3.17 s, 228k -> 145k page faults, 32 MB more at the peak; a chain of 300 tensors
# of 4 MB: 5.1 -> 3.3 s, 12 MB more. With larger tensors the heap kept too much (a chain of 24 MB
# tensors: 400 -> 559 MB at the peak), so they keep their own mappings.
SEPARATE_MAPPINGS_FROM_TENSOR_BYTES = 4 << 20


@functools.cache
def _libc():
    """The C library's functions, from what the process already loaded: `ctypes.util.find_library` would
    start `ldconfig`, a fork of this process that a memory measurement of the process tree counts as a
    second copy of it (a 130 MB comparison worker counted twice, when it handed memory back)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def return_freed_memory() -> None:
    """Hand freed heap memory back to the system now (glibc keeps it otherwise)."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def one_heap() -> None:
    """Every thread of this process allocates from one heap. glibc gives a thread that allocates while another
    does a heap of its own, and memory freed in it stays resident beside what the others hold: the command
    line's caller measures a candidate's weights on one thread while another imports pandas (deferred.py),
    and held 24 MB more for the rest of a MiniLM comparison (140 MB against 116). Set where the process is
    accudiff's own (the command line), before its threads start."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_ARENA_MAX, 1)


def map_large_blocks_separately() -> None:
    """glibc serves a large block from its heap once a block that large was freed (its mmap threshold
    follows the largest freed block, up to 32 MiB), and a heap holding freed tensors between live ones
    cannot shrink: a process would keep the memory of tensors long dropped. A fixed threshold keeps every
    block of 1 MiB and more in its own mapping, returned to the system when freed."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def with_huge_pages(environment: Mapping[str, str]) -> dict[str, str]:
    """`environment` for a process whose malloc asks for transparent huge pages on its large blocks (unless
    the user already chose). Every tensor a segmented comparison produces is a fresh mapping, and with 4 KiB
    pages a 100 MB tensor costs ~25,000 page faults: half the time of an elementwise node. Memory still
    goes back to the system when a block is freed."""
    tunables = [t for t in environment.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith(HUGE_PAGES_TUNABLE + "=") for t in tunables):
        tunables.append(HUGE_PAGES_TUNABLE + "=1")
    return {**environment, "GLIBC_TUNABLES": ":".join(tunables)}
