"""Tensor swapping to NVMe (ZeRO-Infinity): not built in this package (see op_builder/async_io.py).

`MIN_SWAPPABLE_BYTES` is kept because callers size models by it: upstream swaps only tensors
of at least this many bytes (1 MiB) and keeps smaller ones in memory.
"""

MIN_SWAPPABLE_BYTES = 1 << 20

__all__ = ["MIN_SWAPPABLE_BYTES"]
