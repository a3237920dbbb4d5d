"""The `torch_autocast` config section: the engine's forward under `torch.autocast` (upstream's module path).

[Note: torch_autocast]
    "torch_autocast": {"enabled": true, "dtype": "bfloat16",
                       "lower_precision_safe_modules": ["torch.nn.Linear", "torch.nn.Conv2d"]}

keeps the parameters, their gradients and the optimizer in their own dtype (fp32 unless
`bf16`/`fp16` says otherwise) and runs `engine.forward` under `torch.autocast` with `dtype`,
so the user's code needs no autocast of its own. The parameters of the modules whose class
is listed (exactly that class, by its qualified name; default `torch.nn.Linear` and
`Conv1d/2d/3d`) carry `param.comm_dtype = dtype`, and their gradients are reduced over the
ranks in that dtype, half the bytes of fp32; every other parameter's in its own dtype (the
config's `communication_data_type` is not used then), as upstream. With float16 the loss is
scaled dynamically (starting at 2**16, halved on a step with inf/nan gradients, which is
skipped, doubled after 2000 clean steps), as upstream's `torch.amp.GradScaler`; use
`engine.backward(loss)` or `engine.scale(loss).backward()`. Upstream also all-gathers those
parameters in `dtype` at stage 3; here stage 3 gathers them in their own dtype (more bytes,
the forward's autocast casts them the same).

A `torch.autocast` the caller opened around `engine(...)` for the engine's device type is
replaced inside the forward: by the config's when the section is enabled, and switched off
when it is not (the `bf16`/`fp16` sections govern precision then), each said once, as
upstream does on accelerators.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterable
from typing import Any, Optional

import torch

from deepspeed import process_state
from deepspeed.runtime.precision_config import DeepSpeedTorchAutocastConfig
from deepspeed.utils.logging import log_dist

__all__ = [
    "LOWER_PRECISION_SAFE_MODULES",
    "PARAM_COMM_DTYPE_ATTR_NAME",
    "DeepSpeedTorchAutocastConfig",
    "autocast_if_enabled",
    "get_all_comm_dtypes",
    "get_autocast_dtype",
    "get_comm_dtype",
    "get_default_autocast_lower_precision_modules",
    "has_comm_dtype",
    "init_autocast_params",
    "is_autocast_initialized",
    "sort_dtypes",
]

LOWER_PRECISION_SAFE_MODULES = (
    "torch.nn.Linear",
    "torch.nn.Conv1d",
    "torch.nn.Conv2d",
    "torch.nn.Conv3d",
)
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"


class _AutocastState:
    """Upstream keeps whether an engine initialized autocast, and its dtype, per process."""

    def __init__(self) -> None:
        self.dtype: Optional[torch.dtype] = None
        self.warned_nested = False

    def reset(self) -> None:
        self.dtype, self.warned_nested = None, False


_STATE = _AutocastState()
process_state.register("deepspeed.runtime.torch_autocast._STATE", _STATE, _STATE.reset)


def get_default_autocast_lower_precision_modules() -> list[str]:
    return list(LOWER_PRECISION_SAFE_MODULES)


def _resolve(name: str) -> type:
    module_name, _, class_name = str(name).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, AttributeError):
        cls = None
    if not isinstance(cls, type):
        raise ValueError(
            f"torch_autocast.lower_precision_safe_modules: {name!r} names no class; give qualified class "
            "names such as 'torch.nn.Linear' or 'mypackage.layers.Adapter'"
        )
    return cls


def init_autocast_params(engine: Any, dtype: torch.dtype, module_names: Optional[Iterable[str]]) -> None:
    """Mark the parameters of `engine.module`'s modules whose class is listed with `comm_dtype`."""
    if engine._config.zero_config.zero_quantized_weights:
        raise ValueError(
            "torch_autocast cannot be combined with zero_optimization.zero_quantized_weights (as upstream); "
            "turn one of them off"
        )
    names = get_default_autocast_lower_precision_modules() if module_names is None else list(module_names)
    classes = {_resolve(name) for name in names}
    for module in engine.module.modules():
        if type(module) in classes:
            for param in module.parameters(recurse=False):
                setattr(param, PARAM_COMM_DTYPE_ATTR_NAME, dtype)
    _STATE.dtype = dtype


def is_autocast_initialized() -> bool:
    return _STATE.dtype is not None


def get_autocast_dtype() -> Optional[torch.dtype]:
    return _STATE.dtype


def has_comm_dtype(param: torch.Tensor) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype `param`'s gradient is reduced in under torch_autocast: its mark, else its dtype."""
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable) -> set:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable) -> list:
    """`dtypes` in a fixed order (by name): every rank walks them alike."""
    return sorted(dtypes, key=str)


@contextlib.contextmanager
def autocast_if_enabled(engine: Any):
    """Around the engine's forward: the config's autocast, replacing one the caller opened."""
    device_type = (
        engine.device.type if isinstance(engine.device, torch.device) else torch.device(engine.device).type
    )
    section = engine._config.torch_autocast
    outer = torch.is_autocast_enabled(device_type)
    if outer and not _STATE.warned_nested:
        _STATE.warned_nested = True
        if section.enabled:
            log_dist(
                "torch.autocast is open around the engine's forward; inside it the torch_autocast section's "
                f"dtype {section.dtype} applies"
            )
        else:
            log_dist(
                "torch.autocast is open around the engine's forward, but the config's torch_autocast section is "
                "off, so the forward runs without autocast (the bf16/fp16 sections govern precision); enable "
                "torch_autocast in the config to run the forward under autocast",
                level=logging.WARNING,
            )
    if section.enabled:
        with torch.autocast(device_type=device_type, dtype=section.torch_dtype):
            yield
    elif outer:
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield
