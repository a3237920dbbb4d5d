"""Which accelerator this process uses: one process-wide instance, chosen on first use.

[Note: how the accelerator is chosen]
`DS_ACCELERATOR` ("cpu" or "cuda") decides when set; an unknown value is a `ValueError`
and "cuda" without a usable GPU is a `RuntimeError`, never a silent fall-back, so that a
job configured for GPUs does not quietly train on the host. Unset (or empty), CUDA is used
when `torch.cuda.is_available()`, else the CPU. `set_accelerator()` replaces the choice;
`reset_accelerator()` forgets it so that tests can select again.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from deepspeed import process_state
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.utils.logging import logger

ACCELERATOR_ENV = "DS_ACCELERATOR"
SUPPORTED_ACCELERATOR_LIST = ("cpu", "cuda")


def _requested_name() -> Optional[str]:
    value = os.environ.get(ACCELERATOR_ENV)
    if not value:
        return None
    if value not in SUPPORTED_ACCELERATOR_LIST:
        allowed = ", ".join(repr(name) for name in SUPPORTED_ACCELERATOR_LIST)
        raise ValueError(
            f"{ACCELERATOR_ENV}={value!r} is not a supported accelerator; use one of {allowed}, "
            f"or unset {ACCELERATOR_ENV} to detect one"
        )
    return value


def _build(name: str) -> DeepSpeedAccelerator:
    if name == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator, cuda_is_available

        if not cuda_is_available():
            raise RuntimeError(
                f"{ACCELERATOR_ENV}=cuda was requested but CUDA is not available "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                f"set {ACCELERATOR_ENV}=cpu or unset it to run on the CPU"
            )
        return CUDA_Accelerator()
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return CPU_Accelerator()


def _detect() -> DeepSpeedAccelerator:
    requested = _requested_name()
    if requested is not None:
        accelerator = _build(requested)
        logger.info(f"Setting ds_accelerator to {requested} ({ACCELERATOR_ENV} is set)")
        return accelerator
    from deepspeed.accelerator.cuda_accelerator import cuda_is_available

    name = "cuda" if cuda_is_available() else "cpu"
    accelerator = _build(name)
    logger.info(f"Setting ds_accelerator to {name} (auto detect)")
    return accelerator


class _AcceleratorHolder:
    """The one owner of the process-wide accelerator (see the note above)."""

    _accelerator: Optional[DeepSpeedAccelerator]

    def __init__(self) -> None:
        self._accelerator = None
        self._lock = threading.Lock()

    def get(self) -> DeepSpeedAccelerator:
        accelerator = self._accelerator
        if accelerator is not None:
            return accelerator
        with self._lock:
            if self._accelerator is None:
                self._accelerator = _detect()
            return self._accelerator

    def set(self, accelerator: DeepSpeedAccelerator) -> None:
        if not isinstance(accelerator, DeepSpeedAccelerator):
            raise TypeError(
                f"set_accelerator() needs a DeepSpeedAccelerator instance, got {type(accelerator).__name__}"
            )
        with self._lock:
            self._accelerator = accelerator

    def reset(self) -> None:
        with self._lock:
            self._accelerator = None


_holder = _AcceleratorHolder()
process_state.register("deepspeed.accelerator.real_accelerator._holder", _holder, _holder.reset)


def get_accelerator() -> DeepSpeedAccelerator:
    """The process-wide accelerator, chosen on the first call."""
    return _holder.get()


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Replace the process-wide accelerator (for example with a custom subclass)."""
    _holder.set(accel_obj)
    logger.info(f"Setting ds_accelerator to {accel_obj._name} (set by the caller)")


def reset_accelerator() -> None:
    """Forget the current choice; the next `get_accelerator()` selects again. For tests."""
    _holder.reset()


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED_ACCELERATOR_LIST
