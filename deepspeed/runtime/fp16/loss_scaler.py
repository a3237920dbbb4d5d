"""Loss scaling for fp16 training: a static scaler and DeepSpeed's dynamic one.

fp16 gradients underflow to zero for small values, so the loss is multiplied by a scale
before `backward()` and the gradients are divided by it before the optimizer step. The
dynamic scaler keeps the scale as large as it can: it divides the scale on an overflow
(the step is then skipped by the caller) and multiplies it once `scale_window` clean
iterations in a row have passed (on the next clean one, DeepSpeed's count).

[Note: hysteresis]
With `delayed_shift` = k > 1 the scale survives k - 1 overflows before it is divided; the
k-th divides it. The allowance is restored whenever the scale grows, or, with
`consecutive_hysteresis`, after every clean iteration (so only k overflows in a row
divide the scale). These are DeepSpeed's rules.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Iterable
from typing import Any, Optional

import torch

from deepspeed.utils.logging import log_dist

# Keys of `dynamic_loss_args`, as the fp16 config section maps them.
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


def to_python_float(t: Any) -> float:
    """A one-element tensor (or a plain number) as a Python float."""
    return float(t.item()) if hasattr(t, "item") else float(t)


def has_inf_or_nan(x: torch.Tensor) -> bool:
    """Whether `x` holds an inf or a nan.

    One reduction and one host sync: the float32 sum is non-finite exactly when `x` holds a
    non-finite value, or when its finite values are too large to add up in float32, which
    for a gradient is an overflow as well.
    """
    total = x.detach().sum(dtype=torch.float32)
    return not math.isfinite(total.item())


class LossScaleAtMinimumError(RuntimeError):
    """The dynamic loss scale overflowed while already at `min_scale`."""


class LossScalerBase:
    """What every scaler offers: the scale, scaled backward, and a no-op update."""

    cur_scale: float
    dynamic: bool  # whether update_scale() ever changes the scale

    def __init__(self, cur_scale: float) -> None:
        if isinstance(cur_scale, bool) or not isinstance(cur_scale, (int, float)) or not cur_scale > 0:
            raise ValueError(f"loss scale must be a positive number, got {cur_scale!r}")
        self.cur_scale = cur_scale
        self.dynamic = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        """A module backward hook that multiplies the incoming gradients by the scale."""
        return tuple(None if g is None else g * self.loss_scale for g in grad_in)

    def update_scale(self, overflow: bool) -> None:
        pass

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict) -> None:
        """A fixed scale (or none: fp32, bf16) is the config's, not running state: a saved one
        is not loaded, so a run whose fp16 settings changed since the save trains as configured."""
        _require_keys(sd, {"cur_scale": None})
        if sd["cur_scale"] != self.cur_scale:
            log_dist(
                f"checkpoint's loss scale {sd['cur_scale']} not loaded: this run's config fixes it at "
                f"{self.cur_scale}",
                ranks=[0],
                level=logging.WARNING,
            )


class LossScaler(LossScalerBase):
    """A fixed loss scale.

    As in DeepSpeed, a static scaler's own `has_overflow` reports none and its scale never
    changes; whether a step with inf/nan gradients is skipped is the ZeRO optimizer's decision
    (`zero/optimizer.py`'s `skips_nonfinite_steps`), taken on the global norm.
    """

    def __init__(self, scale: float = 1) -> None:
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """A loss scale that shrinks on overflow and grows after a run of clean iterations.

    On an overflow (see [Note: hysteresis]) the scale is divided by `scale_factor`, never
    below `min_scale`; an overflow already at `min_scale` raises `LossScaleAtMinimumError`
    unless `raise_error_at_min_scale` is False. On the clean iteration that follows
    `scale_window` clean iterations in a row (counted from the last overflow, or from the
    start), and every `scale_window` clean iterations after it, the scale is multiplied by
    `scale_factor`, as DeepSpeed does.
    """

    cur_iter: int  # update_scale() calls so far
    last_overflow_iter: int  # cur_iter of the last overflow, -1 if none
    scale_factor: float  # > 1
    scale_window: int  # clean iterations between growths, >= 1
    min_scale: float  # > 0
    delayed_shift: int  # overflows needed to divide the scale, >= 1
    cur_hysteresis: int  # overflows left before the next division, in [1, delayed_shift]
    consecutive_hysteresis: bool
    raise_error_at_min_scale: bool
    dtype: torch.dtype  # the training dtype, for messages only

    def __init__(
        self,
        init_scale: float = 2**32,
        scale_window: int = 1000,
        min_scale: float = 1,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
        *,
        scale_factor: float = 2.0,
    ) -> None:
        # Positional order as DeepSpeed 0.19's (which fixes the factor at 2); `scale_factor`
        # is keyword-only so that a positional `scale_window` cannot land in it.
        super().__init__(init_scale)
        _check_dynamic_args(init_scale, scale_factor, scale_window, min_scale, delayed_shift)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = int(scale_window)
        self.min_scale = min_scale
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = self.delayed_shift
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.dynamic = True
        self.dtype = dtype

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any gradient among `params` holds an inf or a nan (this rank only)."""
        return any(p.grad is not None and self._has_inf_or_nan(p.grad) for p in params)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        # This rank only: agreeing across ranks is the caller's collective to make.
        return self.has_overflow_serial(params)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return has_inf_or_nan(x)

    def update_scale(self, overflow: bool) -> None:
        """Record one iteration's outcome and adjust the scale (call once per step)."""
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            self._on_clean_iteration()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift > 1 and self.cur_hysteresis > 1:
            # Hysteresis absorbs this overflow; the scale stays.
            self.cur_hysteresis -= 1
            log_dist(f"OVERFLOW! Skipping step; hysteresis left: {self.cur_hysteresis}", ranks=[0])
            return
        if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
            raise LossScaleAtMinimumError(
                f"Current loss scale already at minimum ({self.min_scale}) - cannot decrease scale "
                "anymore. Gradients overflow even at the smallest scale: lower min_scale, set "
                "raise_error_at_min_scale=False to keep skipping steps, or train in bf16."
            )
        next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        message = "OVERFLOW! Skipping step."
        if self.dtype == torch.half:
            message += (
                f" Attempted loss scale: {self._show(self.cur_scale)}, reducing to {self._show(next_scale)}"
            )
        log_dist(message, ranks=[0])
        self.cur_scale = next_scale

    def _on_clean_iteration(self) -> None:
        if self.consecutive_hysteresis:
            # Only consecutive overflows count against the allowance.
            self.cur_hysteresis = self.delayed_shift
        # Clean iterations before this one since the last overflow (or the start). DeepSpeed
        # grows the scale on the iteration after `scale_window` of them, then every
        # `scale_window`: window 2 grows on the 3rd, 5th, ... clean iteration in a row.
        clean_before = self.cur_iter - self.last_overflow_iter - 1
        if clean_before > 0 and clean_before % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    @staticmethod
    def _show(scale: float) -> str:
        return str(int(scale)) if scale >= 1 else str(scale)

    def state_dict(self) -> dict:
        """The running state; the settings come from the constructor."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, sd: dict) -> None:
        """The running state of a dynamic scaler saved before. A checkpoint of a run without one
        (fp32, bf16, a fixed fp16 scale) has none to resume: the scaler starts as configured."""
        # What a fixed (or no) scaler saves: ours its scale alone, upstream's also `dynamic: False`.
        if set(sd) == {"cur_scale"} or sd.get("dynamic") is False:
            log_dist(
                f"checkpoint's loss scale {sd['cur_scale']} was fixed (or unscaled): the dynamic loss scale "
                f"starts as configured, at {self.cur_scale}",
                ranks=[0],
                level=logging.WARNING,
            )
            return
        _require_keys(sd, self.state_dict())
        self.cur_scale = sd["cur_scale"]
        self.cur_iter = sd["cur_iter"]
        self.last_overflow_iter = sd["last_overflow_iter"]
        self.cur_hysteresis = sd["cur_hysteresis"]


def _require_keys(sd: dict, expected: dict) -> None:
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise ValueError(f"loss scaler state is missing {missing} (has {sorted(sd)})")


def _check_dynamic_args(init_scale, scale_factor, scale_window, min_scale, delayed_shift) -> None:
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not number(scale_factor) or scale_factor <= 1:
        raise ValueError(f"scale_factor must be a number > 1, got {scale_factor!r}")
    if not number(scale_window) or scale_window < 1 or scale_window != int(scale_window):
        raise ValueError(f"scale_window must be a whole number >= 1, got {scale_window!r}")
    if not number(min_scale) or min_scale <= 0:
        raise ValueError(f"min_scale must be a number > 0, got {min_scale!r}")
    if not number(delayed_shift) or delayed_shift < 1 or delayed_shift != int(delayed_shift):
        raise ValueError(f"delayed_shift (hysteresis) must be a whole number >= 1, got {delayed_shift!r}")
    if init_scale < min_scale:
        raise ValueError(f"init_scale={init_scale!r} is below min_scale={min_scale!r}")


_DYNAMIC_ARG_KEYS = (
    INITIAL_LOSS_SCALE,
    "scale_factor",
    SCALE_WINDOW,
    MIN_LOSS_SCALE,
    DELAYED_SHIFT,
    CONSECUTIVE_HYSTERESIS,
    "raise_error_at_min_scale",
)


def CreateLossScaler(
    dtype: torch.dtype,
    static_loss_scale: float,
    dynamic_scaling: bool,
    dynamic_loss_args: Optional[dict],
) -> LossScalerBase:
    """The scaler DeepSpeed would use for `dtype`.

    fp16 with dynamic scaling gets a `DynamicLossScaler` built from `dynamic_loss_args`
    (keys: init_scale, scale_window, delayed_shift, consecutive_hysteresis, min_scale, and
    also scale_factor, raise_error_at_min_scale); fp16 without it gets a static scaler at
    `static_loss_scale`; any other dtype needs no scaling and gets a static scale of 1.
    """
    if dtype == torch.half and dynamic_scaling:
        args = dict(dynamic_loss_args or {})
        unknown = sorted(set(args) - set(_DYNAMIC_ARG_KEYS))
        if unknown:
            raise ValueError(
                f"unknown dynamic_loss_args key(s) {unknown}; allowed: {list(_DYNAMIC_ARG_KEYS)}"
            )
        return DynamicLossScaler(dtype=dtype, **args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)


# torch_autocast with float16 and no `fp16` section: torch.amp.GradScaler's dynamic scale (no
# lower bound), as upstream scales then ([Note: torch_autocast] in runtime/torch_autocast.py).
_AUTOCAST_FP16_SCALING = {
    "init_scale": 2.0**16,
    "scale_window": 2000,
    "delayed_shift": 1,
    "min_scale": 2.0**-24,
    "raise_error_at_min_scale": False,
}
_AUTOCAST_FP16_SCALING = types.MappingProxyType(_AUTOCAST_FP16_SCALING)  # read-only from here on


def loss_scaler_for(config: Any) -> LossScalerBase:
    """The scaler a `DeepSpeedConfig` asks for: its `fp16` section's, else float16 autocast's."""
    if (
        not config.fp16_enabled
        and config.torch_autocast_enabled
        and config.torch_autocast_dtype == torch.float16
    ):
        return CreateLossScaler(torch.float16, 0.0, True, _AUTOCAST_FP16_SCALING)
    return CreateLossScaler(
        torch.float16 if config.fp16_enabled else torch.float32,
        config.loss_scale,
        config.fp16_enabled and config.loss_scale == 0,
        config.dynamic_loss_scale_args,
    )
