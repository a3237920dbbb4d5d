"""`FusedAdam`: upstream's multi-tensor Adam/AdamW, with its constructor arguments.

Upstream fuses the update into one CUDA kernel over many tensors; here one `torch._foreach_*`
call per step phase covers every parameter of a group (torch's multi-tensor path), on any
device. The update is torch's Adam (`adam_w_mode=False`: L2 weight decay added to the
gradient) or AdamW (`adam_w_mode=True`, the default: decoupled decay), and its state keys
(`step`, `exp_avg`, `exp_avg_sq`) are torch's, so state dicts move between them.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW over all of a group's tensors at once (see the module docstring).

    `bias_correction=False` skips Adam's `1 - beta**t` corrections (upstream's option; torch's
    Adam has none). `amsgrad=True` is refused, as upstream. `set_grad_none` is upstream's
    `zero_grad` default (torch now always sets gradients to None unless asked otherwise).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support amsgrad=True; use torch.optim.Adam(amsgrad=True)")
        if lr < 0.0:
            raise ValueError(f"FusedAdam: lr={lr} must be >= 0")
        if eps < 0.0:
            raise ValueError(f"FusedAdam: eps={eps} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"FusedAdam: betas={betas} must be two values in [0, 1)")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_grad_none and set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update_group(group, params)
        return loss

    def _update_group(self, group: dict, params: list) -> None:
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients; use torch.optim.SparseAdam")
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        states = [self._state_for(p) for p in params]
        for s in states:
            s["step"] += 1
        if decay != 0.0:
            if self.adam_w_mode:
                torch._foreach_mul_(params, 1.0 - lr * decay)
            else:
                grads = torch._foreach_add(grads, params, alpha=decay)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        # Parameters of one group may have taken different numbers of steps (added later,
        # or without a gradient on some steps): bias corrections are per parameter.
        for p, s, m, v in zip(params, states, exp_avgs, exp_avg_sqs):
            step = float(s["step"])
            correction1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
            correction2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
            denom = (v.sqrt() / math.sqrt(correction2)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / correction1)

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
