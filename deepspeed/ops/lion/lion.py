"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), upstream's two classes.

Per element, with `g` the gradient and `m` the momentum (state key ``exp_avg``):

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)      (decoupled weight decay)
    m = beta2 * m + (1 - beta2) * g

`FusedLion` steps parameters on any device and `DeepSpeedCPULion` those in CPU memory
(ZeRO-Offload, which refuses accelerator parameters with the fix); both are the same
element-wise torch ops, so an optimizer block of type Lion gives the same numbers with and
without `offload_optimizer`. fp16/bf16 parameters keep the momentum in fp32 when
``fp32_optimizer_states`` (the default) and are updated in fp32.

One deliberate difference: where `c` is exactly zero (a zero gradient on zero momentum: the
first step of a padding row) the sign step is zero, as sign(0) = 0 in the paper and in torch
(only weight decay moves the element); upstream's CPU kernel steps it by -lr there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from deepspeed.ops.elementwise import ElementwiseOptimizer


class FusedLion(ElementwiseOptimizer):
    """Lion on the parameters' own device (see the module note)."""

    STATE_KEYS = ("exp_avg",)  # the momentum

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        name = type(self).__name__
        if lr < 0.0:
            raise ValueError(f"{name}: lr must be >= 0, got {lr}")
        if weight_decay < 0.0:
            raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{name}: betas must be two values in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.fp32_optimizer_states = fp32_optimizer_states
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """torch's zero_grad; without an argument, `set_grad_none` (upstream's constructor flag) decides."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    @staticmethod
    def _update(param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        momentum = state["exp_avg"]
        master = param if param.dtype == momentum.dtype else param.to(momentum.dtype)
        grad = param.grad.to(momentum.dtype)
        direction = momentum.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
        if group["weight_decay"] != 0:
            master.mul_(1 - group["lr"] * group["weight_decay"])
        master.add_(direction, alpha=-group["lr"])
        momentum.mul_(beta2).add_(grad, alpha=1 - beta2)
        if master is not param:
            param.copy_(master)


class DeepSpeedCPULion(FusedLion):
    """Lion for parameters held in CPU memory (`offload_optimizer`); see the module note."""

    CPU_ONLY_ALTERNATIVE = "deepspeed.ops.lion.FusedLion"

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr, betas, weight_decay, fp32_optimizer_states=fp32_optimizer_states)
