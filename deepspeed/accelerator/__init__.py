"""Device abstraction: `get_accelerator()` is the only door to the GPU runtime.

Code elsewhere in `deepspeed/` asks the accelerator for device names, streams, RNG state and
memory statistics instead of calling `torch.cuda`, so the same code runs on the CPU (gloo)
and on CUDA (nccl); a layering test enforces it.
"""

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.accelerator.real_accelerator import (
    SUPPORTED_ACCELERATOR_LIST,
    get_accelerator,
    is_current_accelerator_supported,
    reset_accelerator,
    set_accelerator,
)

__all__ = [
    "DeepSpeedAccelerator",
    "SUPPORTED_ACCELERATOR_LIST",
    "get_accelerator",
    "is_current_accelerator_supported",
    "reset_accelerator",
    "set_accelerator",
]
