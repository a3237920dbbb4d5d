"""What `DeepSpeedEngine.forward` does with the config before it calls the model.

Two config keys act here, kept out of the engine so that it stays a facade:

- ``fp16.auto_cast`` (with ``fp16.enabled``): floating-point tensors among the forward's
  inputs, found inside tuples, lists and dicts too, are cast to float16, as upstream does.
  Integer tensors (token ids, labels) and non-tensors pass unchanged.
- ``steps_per_print``: every that many optimizer steps, rank 0 logs the step and the
  learning rates at INFO. Upstream logs inside `step()`; here the next forward after such a
  step logs it (accelerate sets the key to infinity, which never logs).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from deepspeed.utils.logging import log_dist

__all__ = ["cast_floating_inputs", "forward_prologue"]


def cast_floating_inputs(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating-point tensor in it (nested in tuples, lists, dicts) cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its type
        return type(value)(*(cast_floating_inputs(v, dtype) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating_inputs(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, cast_floating_inputs(v, dtype)) for k, v in value.items())
    return value


def _report_progress(engine: Any) -> None:
    every = engine._config.steps_per_print
    step = engine.global_steps
    if step == 0 or math.isinf(every) or step % int(every) != 0:
        return
    if getattr(engine, "_last_progress_report", None) == step:
        return  # already logged for this step (several forwards per step)
    engine._last_progress_report = step
    log_dist(f"step={step}, lr={engine.get_lr()}", ranks=[0])


def forward_prologue(engine: Any, args: tuple, kwargs: dict) -> tuple:
    """`(args, kwargs)` for the model call, after acting on the keys in this module's docstring."""
    _report_progress(engine)
    if engine._config.fp16_auto_cast:
        args = cast_floating_inputs(args, torch.float16)
        kwargs = cast_floating_inputs(kwargs, torch.float16)
    return args, kwargs
