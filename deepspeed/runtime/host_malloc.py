"""Keep host memory freed during a training step in the process for the next step (glibc).

[Note: why the engine sets glibc's malloc thresholds on the CPU]
PyTorch's CPU tensors come from `malloc`. glibc serves a request at or above its mmap
threshold with a fresh `mmap` that `free` unmaps, and gives a free heap top larger than its
trim threshold back to the kernel; both start low (128 KiB and 128 KiB) and grow only when
the process frees a large mmapped block. Memory a step frees (activations, full gradients
once reduced, gathered parameters once released) can then go back to the kernel, and the
next step faults every page in again, zero-filled. On our benchmarks' 2-core VM a ZeRO-2
step of the 3.7M-parameter decoder took about 3,000 minor faults and a ZeRO-3 step about
2,700, DDP's none; a fault costs 2 to 4 us there (a run with 32,000 faults per step was 60
to 130 ms slower), so a few percent of the step. How many a step takes depends on where
the kernel placed the heap: the same small script took from 5 to 2,700 per step.

So the engine, when it trains on the CPU, sets the two thresholds once, to values glibc's
own rule can reach (it raises the mmap threshold up to 32 MiB, and the trim threshold to
twice that): blocks under `MMAP_THRESHOLD_BYTES` come from the heap, and up to
`TRIM_THRESHOLD_BYTES` of free heap top stays mapped for reuse. What that costs is at most
that much freed memory held instead of returned. With them the ZeRO-2 step took no fault
and the ZeRO-3 step 150 to 800. Thresholds the user chose (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, or malloc tunables in `GLIBC_TUNABLES`) are left alone, and
`DEEPSPEED_HOST_MALLOC=0` keeps glibc's defaults; only 0 and 1 are accepted.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Optional

from deepspeed import process_state
from deepspeed.utils.logging import logger
from deepspeed.utils.switches import switch_error, switched_off

ENV = "DEEPSPEED_HOST_MALLOC"
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper bound for its dynamic mmap threshold
TRIM_THRESHOLD_BYTES = 64 << 20  # twice that, as glibc's dynamic rule pairs them
# mallopt parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# The outcome once decided in this process: [None] applied, [reason] not. Never reset: the
# allocator settings, once made, stay for the life of the process.
_applied: list = process_state.register("deepspeed.runtime.host_malloc._applied", [])


def env_error() -> Optional[str]:
    """What is wrong with this process's `DEEPSPEED_HOST_MALLOC`, if anything."""
    return switch_error(
        ENV,
        "keep glibc's malloc thresholds",
        "let the engine keep memory freed in a CPU training step for the next",
    )


def keep_freed_memory_for_reuse() -> Optional[str]:
    """Set the thresholds of the note, once per process; returns None when set, else why not.

    Raises ValueError for a `DEEPSPEED_HOST_MALLOC` other than 0 or 1.
    """
    error = env_error()
    if error is not None:
        raise ValueError(error)
    if _applied:
        return _applied[0]
    reason = _why_not()
    if reason is None:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
        reason = None if ok else "glibc's mallopt refused the values"
    _applied.append(reason)
    if reason is None:
        logger.info(
            f"host malloc: freed blocks under {MMAP_THRESHOLD_BYTES >> 20} MiB stay in the heap and up to "
            f"{TRIM_THRESHOLD_BYTES >> 20} MiB of free heap stays mapped, for the next step ({ENV}=0: off)"
        )
    else:
        logger.debug(f"host malloc thresholds left as they are: {reason}")
    return reason


def _why_not() -> Optional[str]:
    if switched_off(ENV):
        return f"{ENV}=0"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not Linux with glibc (mallopt's thresholds are glibc's)"
    chosen = [k for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"the process chose its own malloc settings ({', '.join(chosen)})"
    return None
