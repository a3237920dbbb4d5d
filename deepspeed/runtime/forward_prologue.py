"""What `DeepSpeedEngine.forward` (and `step`) do with two config keys, kept out of the engine
so that it stays a facade:

- ``fp16.auto_cast`` (with ``fp16.enabled``): floating-point tensors among the forward's
  inputs, found inside tuples, lists and dicts too, are cast to float16, as upstream does.
  Integer tensors (token ids, labels) and non-tensors pass unchanged.
- ``steps_per_print``: every that many optimizer steps, rank 0 logs the step and the
  learning rates at INFO, from `step()` as upstream (accelerate sets the key to infinity,
  which never logs).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from deepspeed.utils.logging import log_dist

__all__ = ["cast_floating_inputs", "forward_prologue", "report_progress"]


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


def report_progress(engine: Any) -> None:
    """After an optimizer step: log it when `global_steps` is a multiple of `steps_per_print`."""
    every = engine._config.steps_per_print
    step = engine.global_steps
    if step == 0 or math.isinf(every) or step % int(every) != 0:
        return
    speed = engine.tput_timer.avg_samples_per_sec()  # 0.0 until the timer's start_step
    log_dist(
        f"step={step}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, RunningAvgSamplesPerSec={speed:.3f}",
        ranks=[0],
    )


def forward_prologue(engine: Any, args: tuple, kwargs: dict) -> tuple:
    """`(args, kwargs)` for the model call, cast as `fp16.auto_cast` asks; starts the
    throughput timer's micro step (`engine.step()` stops it)."""
    engine.tput_timer.start()
    if engine._config.fp16_auto_cast:
        args = cast_floating_inputs(args, torch.float16)
        kwargs = cast_floating_inputs(kwargs, torch.float16)
    return args, kwargs
