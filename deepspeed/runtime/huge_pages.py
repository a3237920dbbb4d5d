"""Zeroed CPU tensors backed by transparent huge pages (2 MiB), for large streamed buffers.

A step of DeepSpeedCPUAdam streams each of its buffers once, start to end; with 4 KiB pages
every 4 KiB of every stream costs a TLB miss (and, in a VM, a two-level page walk). Backing
a buffer with 2 MiB pages cuts those misses by 512x. `huge_page_zeros` asks the kernel for
that and falls back to a plain `torch.zeros` wherever it cannot (see `_why_not`).

How the storage is held: the bytes live in an anonymous private `mmap` made here, never
touched before `madvise(MADV_HUGEPAGE)`, so every 2 MiB-aligned stretch the tensor covers is
faulted in as one huge page when first written. `torch.frombuffer` wraps the mapping; the
tensor's storage holds a reference to the mmap object, which unmaps only when the last
tensor (or view) on that storage is freed. No raw pointer outlives the tensor.
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Sequence
from functools import cache
from typing import Optional, Union

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@cache
def _why_not() -> Optional[str]:
    """None when huge-page buffers can be made here, else why not (the fallback's reason)."""
    if not sys.platform.startswith("linux"):
        return "transparent huge pages and MADV_HUGEPAGE are Linux-only"
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return "this Python's mmap has no MADV_HUGEPAGE / MAP_ANONYMOUS"
    if mmap.PAGESIZE != 4096:  # 16/64 KiB base pages: the PMD size is not 2 MiB
        return f"base page size {mmap.PAGESIZE} is not 4 KiB"
    try:
        with open(_THP_ENABLED) as f:
            mode = f.read()
    except OSError:
        return f"{_THP_ENABLED} is missing (kernel without transparent huge pages)"
    if "[never]" in mode:
        return "transparent huge pages are disabled ([never])"
    return None


def huge_pages_available() -> bool:
    """Whether `huge_page_zeros` can back large tensors with huge pages on this machine."""
    return _why_not() is None


def huge_page_zeros(
    size: Union[int, Sequence[int], torch.Size], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of `size` and `dtype`, in transparent huge pages where possible.

    Its first element sits on a 2 MiB boundary and the whole 2 MiB stretches it covers are
    madvised MADV_HUGEPAGE before anything touches them; the partial stretch at the end is
    left in 4 KiB pages so that it does not fault in up to 2 MiB past the tensor. Falls back
    to `torch.zeros` (same size, dtype, contents) when the tensor is smaller than one huge
    page (it could not use one), off Linux or with THP disabled (`_why_not`), or when mmap or
    madvise fail (an old kernel, a locked-down sandbox): huge pages are a speed-up only.
    """
    shape = torch.Size([size] if isinstance(size, int) else size)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or _why_not() is not None:
        return torch.zeros(shape, dtype=dtype)
    try:
        # Private anonymous memory, as malloc's own large blocks; mmap guarantees it zeroed.
        # Room for aligning the start: the mapping itself is only page-aligned.
        mapping = mmap.mmap(
            -1, nbytes + HUGE_PAGE_BYTES - mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
    except OSError:
        return torch.zeros(shape, dtype=dtype)
    # The tensor's storage is exactly its own bytes (torch.save writes whole storages, so a
    # view into a padded buffer would put the alignment padding into every checkpoint).
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError:  # EINVAL: a kernel built without THP; nothing is touched yet, drop it all
        mapping.close()
        return torch.zeros(shape, dtype=dtype)
    # The storage holds a reference to `mapping`, which unmaps when the last user goes.
    flat = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)
    # A tensor on that storage, not a view of `flat`: a view keeps its base alive, so a caller
    # that later points it elsewhere (`set_`, as NVMe swapping does with optimizer states)
    # would keep the whole mapping too.
    return torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), flat.storage_offset(), shape)


def anon_huge_page_bytes() -> Optional[int]:
    """Bytes of this process's anonymous memory in transparent huge pages right now
    (AnonHugePages of /proc/self/smaps_rollup), or None where that file does not exist."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
