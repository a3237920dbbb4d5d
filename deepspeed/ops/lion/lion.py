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
from typing import Any, Callable, Optional

import torch

from deepspeed.runtime.huge_pages import huge_page_zeros


class FusedLion(torch.optim.Optimizer):
    """Lion on the parameters' own device (see the module note)."""

    fp32_optimizer_states: bool  # the momentum in fp32 whatever the parameter dtype

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

    def _check_device(self, param: torch.Tensor) -> None:
        """Where a parameter may live: anywhere here; the CPU class narrows it."""

    def _state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            self._check_device(param)
            dtype = torch.float32 if self.fp32_optimizer_states else param.dtype
            state["step"] = 0
            if param.device.type == "cpu":
                state["exp_avg"] = huge_page_zeros(param.shape, dtype)
            else:
                state["exp_avg"] = torch.zeros(param.shape, dtype=dtype, device=param.device)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self._state(param)
                state["step"] = int(state["step"]) + 1
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
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.fp32_optimizer_states:
            for state in self.state.values():
                if isinstance(state.get("exp_avg"), torch.Tensor):
                    state["exp_avg"] = state["exp_avg"].float()


class DeepSpeedCPULion(FusedLion):
    """Lion for parameters held in CPU memory (`offload_optimizer`); see the module note."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr, betas, weight_decay, fp32_optimizer_states=fp32_optimizer_states)

    def _check_device(self, param: torch.Tensor) -> None:
        if param.device.type != "cpu":
            raise ValueError(
                f"DeepSpeedCPULion: a parameter is on {param.device}, but it must be on the CPU; "
                'enable "offload_optimizer": {"device": "cpu"} in the ZeRO config, or use '
                "deepspeed.ops.lion.FusedLion for accelerator parameters"
            )
