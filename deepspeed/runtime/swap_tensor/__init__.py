"""Tensor swapping to NVMe (ZeRO-Infinity): scratch files and staging buffers (`swap_store`),
on the async I/O engine `deepspeed.ops.aio` (docs/nvme.md).

`MIN_SWAPPABLE_BYTES` is kept because callers size models by it: upstream swaps only tensors
of at least this many bytes (1 MiB) and keeps smaller ones in memory.
"""

MIN_SWAPPABLE_BYTES = 1 << 20

__all__ = ["MIN_SWAPPABLE_BYTES"]
