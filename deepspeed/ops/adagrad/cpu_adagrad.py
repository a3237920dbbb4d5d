"""`DeepSpeedCPUAdagrad`: Adagrad for parameters held in CPU memory (ZeRO-Offload).

accelerate swaps a client's `torch.optim.Adagrad` for this class when the optimizer is
offloaded (HF Trainer's ``optim="adagrad"`` with ``offload_optimizer``), passing the torch
optimizer's param groups as they are. So the update is torch.optim.Adagrad's, in its order
of operations, and every hyperparameter those groups carry that changes the result is acted
on (`lr_decay`, `initial_accumulator_value`, `maximize`), not only upstream's lr, eps and
weight decay. accelerate also passes ``adamw_mode=False``, meant for Adam, which upstream's
class does not take (accelerate's swap fails there); here it is accepted as what it says,
L2 weight decay, and ``True`` is refused. `foreach`, `fused` and `differentiable` choose how torch would run the same
update, so they change nothing here. The step is element-wise torch ops on the CPU: unlike
Adam, no native kernel.

A sparse gradient (an `nn.Embedding(sparse=True)`'s) updates only the rows it holds, as
torch's Adagrad does, and like torch's refuses weight decay.

The accumulated sum of squared gradients is kept under upstream's state key ``exp_avg_sq``
(torch's Adagrad calls it ``sum``), with an integer ``step``; fp16/bf16 parameters keep it
in fp32 when ``fp32_optimizer_states`` (the default), and are updated in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepspeed.ops.elementwise import ElementwiseOptimizer


class DeepSpeedCPUAdagrad(ElementwiseOptimizer):
    """Adagrad (L2 weight decay, as torch and upstream) on the CPU; see the module note."""

    STATE_KEYS = ("exp_avg_sq",)  # the sum of squared gradients, under upstream's name
    CPU_ONLY_ALTERNATIVE = "torch.optim.Adagrad"
    SPARSE_GRADIENTS = True

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
        lr_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        maximize: bool = False,
        adamw_mode: bool = False,
    ) -> None:
        # accelerate passes adamw_mode=False to whichever CPU optimizer it picks (upstream's
        # Adagrad then fails on the keyword); False is Adagrad's own L2 weight decay.
        if adamw_mode:
            raise ValueError(
                "DeepSpeedCPUAdagrad: adamw_mode=True (decoupled weight decay) is not an Adagrad update; "
                "pass adamw_mode=False, which applies weight_decay as torch.optim.Adagrad does"
            )
        if amsgrad:
            raise ValueError(
                "DeepSpeedCPUAdagrad has no amsgrad variant (neither has upstream's); pass amsgrad=False"
            )
        for name, value in (
            ("lr", lr),
            ("eps", eps),
            ("weight_decay", weight_decay),
            ("lr_decay", lr_decay),
            ("initial_accumulator_value", initial_accumulator_value),
        ):
            if value < 0.0:
                raise ValueError(f"DeepSpeedCPUAdagrad: {name} must be >= 0, got {value}")
        defaults = dict(
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            lr_decay=lr_decay,
            initial_accumulator_value=initial_accumulator_value,
            maximize=maximize,
        )
        super().__init__(model_params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states

    def _initial_value(self, key: str, group: dict[str, Any]) -> float:
        return group["initial_accumulator_value"]

    @staticmethod
    def _update(param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        squares = state["exp_avg_sq"]
        master = param if param.dtype == squares.dtype else param.to(squares.dtype)
        grad = param.grad.to(squares.dtype)
        if group["maximize"]:
            grad = -grad
        lr = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
        if grad.is_sparse:
            _sparse_update(master, squares, grad, lr, group)
        else:
            if group["weight_decay"] != 0:
                grad = grad.add(master, alpha=group["weight_decay"])
            squares.addcmul_(grad, grad, value=1)
            master.addcdiv_(grad, squares.sqrt().add_(group["eps"]), value=-lr)
        if master is not param:
            param.copy_(master)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load; a state saved by torch.optim.Adagrad (key ``sum``) is taken under ``exp_avg_sq``."""
        renamed = {
            key: {("exp_avg_sq" if name == "sum" else name): value for name, value in state.items()}
            for key, state in state_dict.get("state", {}).items()
        }
        super().load_state_dict({**state_dict, "state": renamed})


def _sparse_update(
    master: torch.Tensor, squares: torch.Tensor, grad: torch.Tensor, lr: float, group: dict
) -> None:
    """Adagrad on the entries a sparse gradient holds (torch's order of operations); the
    others, and their sums, stay as they are."""
    if group["weight_decay"] != 0:
        raise RuntimeError(
            f"DeepSpeedCPUAdagrad: weight_decay={group['weight_decay']} cannot apply to a sparse gradient "
            "(as in torch.optim.Adagrad); set weight_decay=0 or make the embedding dense (sparse=False)"
        )
    grad = grad.coalesce()
    indices, values = grad._indices(), grad._values()

    def sparse(vals: torch.Tensor) -> torch.Tensor:
        # The indices come from a coalesced gradient: valid, so not checked again.
        return torch.sparse_coo_tensor(indices, vals, grad.shape, check_invariants=False)

    squares.add_(sparse(values * values))
    held = squares.sparse_mask(grad)._values().sqrt_().add_(group["eps"])
    master.add_(sparse(values / held), alpha=-lr)
