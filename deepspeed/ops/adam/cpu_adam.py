"""`DeepSpeedCPUAdam`: Adam/AdamW for parameters held in CPU memory (ZeRO-Offload)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from deepspeed.ops.op_builder import ALL_OPS
from deepspeed.runtime.huge_pages import HUGE_PAGE_BYTES, huge_page_zeros, huge_pages_available

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Bumps a tensor's autograd version counter, as an in-place torch op would (torch >= 2.1).
_increment_version = getattr(torch.autograd.graph, "increment_version", None)


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if lr < 0.0:
        raise ValueError(f"DeepSpeedCPUAdam: lr must be >= 0, got {lr}")
    if eps < 0.0:
        raise ValueError(f"DeepSpeedCPUAdam: eps must be >= 0, got {eps}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"DeepSpeedCPUAdam: betas[{i}] must be in [0, 1), got {beta}")
    if weight_decay < 0.0:
        raise ValueError(f"DeepSpeedCPUAdam: weight_decay must be >= 0, got {weight_decay}")


def torch_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    adamw_mode: bool,
) -> None:
    """The native kernel's update in torch ops, in torch.optim.Adam's order (in place).

    The math runs in the dtype of the optimizer states; a parameter of another dtype is
    upcast for the update and the result is copied back.
    """
    master = param if param.dtype == exp_avg.dtype else param.to(exp_avg.dtype)
    grad = grad.to(exp_avg.dtype)
    if weight_decay != 0:
        if adamw_mode:
            master.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(master, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if master is not param:
        param.copy_(master)


def _native_ok(param: torch.Tensor, state: dict[str, Any]) -> bool:
    """Whether the native op takes this parameter and its states as they are."""
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    return (
        param.dtype in _NATIVE_DTYPES
        and param.is_contiguous()
        and exp_avg.dtype == torch.float32
        and exp_avg_sq.dtype == torch.float32
        and exp_avg.is_contiguous()
        and exp_avg_sq.is_contiguous()
        and exp_avg.device.type == "cpu"
        and exp_avg_sq.device.type == "cpu"
    )


def _native_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient as the op takes it: contiguous, fp32 or the parameter's own dtype."""
    grad = param.grad.detach()
    if grad.dtype not in (torch.float32, param.dtype):
        grad = grad.to(torch.float32)
    return grad.contiguous().view(param.shape)


def _fusable_copy(param: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether the op can write `copy` in the step's own pass (fp32 master to a dense CPU copy)."""
    return (
        param.dtype == torch.float32
        and copy.dtype in _NATIVE_DTYPES
        and copy.device.type == "cpu"
        and copy.is_contiguous()
        and copy.numel() == param.numel()
    )


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """Adam (``adamw_mode=False``, L2 weight decay) or AdamW (decoupled weight decay) on CPU.

    The step runs the native ``cpu_adam`` op (``deepspeed.ops.op_builder.ALL_OPS``): one call
    per param group, which makes one vectorised (AVX-512, AVX2, NEON or scalar, whichever
    the CPU has), OpenMP-parallel pass over each parameter, its gradient and states. The op is
    compiled on first use (about a minute on two cores) and cached in
    ``$TORCH_EXTENSIONS_DIR``. When it cannot be built on this machine (no C++ compiler or
    ninja, or a failed build), the optimizer logs one warning and runs the same update as
    in-place torch ops instead; both follow torch.optim.Adam's order of operations, so the
    results agree with it to float rounding. ``uses_native`` says which path is active.

    fp16/bf16 parameters keep fp32 states when ``fp32_optimizer_states`` (the default): the
    op reads the low-precision value, updates it in fp32 and rounds it back in the same pass.
    ``step(fp16_param_groups=...)`` copies of fp32 parameters are written in that pass too.
    Parameters must be on the CPU; use ``"offload_optimizer": {"device": "cpu"}`` in the
    ZeRO config, or torch.optim.AdamW for accelerator parameters.
    """

    adamw_mode: bool  # decoupled weight decay (AdamW) rather than L2 (Adam)
    fp32_optimizer_states: bool  # exp_avg / exp_avg_sq in fp32 whatever the param dtype
    _native: Optional[ModuleType]  # the compiled op, or None on the torch fallback

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "DeepSpeedCPUAdam does not support amsgrad=True; pass amsgrad=False, or use "
                "torch.optim.Adam(amsgrad=True) for an unoffloaded optimizer"
            )
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=False,
        )
        super().__init__(model_params, defaults)
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        self._native = ALL_OPS["cpu_adam"].try_load()

    @property
    def uses_native(self) -> bool:
        """True when steps run the compiled ``cpu_adam`` op."""
        return self._native is not None

    def _init_state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            dtype = torch.float32 if self.fp32_optimizer_states else param.dtype
            state["step"] = 0
            # [Note: states in huge pages] every step streams both states once; in 2 MiB
            # pages their TLB misses all but vanish (see deepspeed/runtime/huge_pages.py).
            state["exp_avg"] = huge_page_zeros(param.shape, dtype)
            state["exp_avg_sq"] = huge_page_zeros(param.shape, dtype)
        return state

    def move_states_into_huge_pages(self) -> None:
        """Copies loaded exp_avg / exp_avg_sq of CPU parameters into huge-page buffers.

        torch's load leaves the state_dict's own tensors (or casts of them) as the states;
        those are ordinary allocations, so each large one is copied into a buffer from
        `huge_page_zeros`, as `_init_state` would have made it. Small ones stay as loaded, and
        so do non-contiguous ones (a swapped-out state is a stride-0 stand-in for its file).
        """
        if not huge_pages_available():
            return
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                value = state.get(key)
                if (
                    isinstance(value, torch.Tensor)
                    and value.device.type == "cpu"
                    and value.is_contiguous()  # not a stand-in (NVMe's swapped-out state: stride 0)
                    and value.numel() * value.element_size() >= HUGE_PAGE_BYTES
                ):
                    state[key] = huge_page_zeros(value.shape, value.dtype).copy_(value)

    @torch.no_grad()
    def step(
        self, closure: Optional[Callable[[], Any]] = None, fp16_param_groups: Optional[list[Any]] = None
    ) -> Any:
        """One update of every parameter that has a gradient: one native call per param group.

        ``fp16_param_groups`` (optional, one list or tensor per param group): low-precision
        copies that receive the updated values, as the old DeepSpeed API allowed. The native
        op writes them in the same pass as the update.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copies = self._copy_targets(fp16_param_groups)
        for group, group_copies in zip(self.param_groups, copies):
            batch = [(p, c) for p, c in zip(group["params"], group_copies) if p.grad is not None]
            if batch:
                self._step_group(group, batch)
        return loss

    def _copy_targets(self, fp16_param_groups: Optional[list[Any]]) -> list[list[Optional[torch.Tensor]]]:
        if fp16_param_groups is None:
            return [[None] * len(group["params"]) for group in self.param_groups]
        if isinstance(fp16_param_groups, torch.Tensor):
            fp16_param_groups = [fp16_param_groups]
        targets = [[g] if isinstance(g, torch.Tensor) else list(g) for g in fp16_param_groups]
        shape = [len(group["params"]) for group in self.param_groups]
        if [len(t) for t in targets] != shape:
            raise ValueError(
                f"DeepSpeedCPUAdam.step: fp16_param_groups has {[len(t) for t in targets]} tensors per "
                f"group but the optimizer has {shape}; pass one copy per parameter, group by group"
            )
        return targets

    def _step_group(
        self, group: dict[str, Any], batch: list[tuple[torch.Tensor, Optional[torch.Tensor]]]
    ) -> None:
        """One native call for the whole group; tensors it cannot take go one by one after."""
        beta1, beta2 = group["betas"]
        hyper = (
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group.get("bias_correction", True)),
            self.adamw_mode,
        )
        steps = self._count_step([param for param, _ in batch])
        pending: Iterable[int] = range(len(batch))
        if self._native is not None:
            pending = self._run_native(batch, steps, hyper)
        for i in pending:
            self._step_one(*batch[i], steps[i], hyper)

    def _count_step(self, params: list[torch.Tensor]) -> list[int]:
        """Creates missing states and counts this step; returns each parameter's step count."""
        steps = []
        for param in params:
            state = self.state[param]
            if not state:
                self._check_param(param)
                state = self._init_state(param)
            # int(): a state loaded from torch's Adam (a switch from plain to offloaded ZeRO
            # across a checkpoint) holds its step as a 0-d tensor.
            state["step"] = int(state["step"]) + 1
            steps.append(state["step"])
        return steps

    @staticmethod
    def _check_param(param: torch.Tensor) -> None:
        if param.device.type != "cpu":
            raise ValueError(
                f"DeepSpeedCPUAdam: a parameter is on {param.device}, but it must be on the CPU; "
                'enable "offload_optimizer": {"device": "cpu"} in the ZeRO config, or use '
                "torch.optim.AdamW for accelerator parameters"
            )
        if param.grad.is_sparse:
            raise RuntimeError("DeepSpeedCPUAdam does not support sparse gradients")

    def _run_native(
        self, batch: list[tuple[torch.Tensor, Optional[torch.Tensor]]], steps: list[int], hyper: tuple
    ) -> list[int]:
        """Steps, in one native call, every tensor the op takes as it is; returns the others' indices.

        [Note: one call per group, checks in the op]
        A step of thousands of small tensors must not pay Python work per tensor, so the op
        itself checks each tensor (dtype, layout, device, size) and skips, untouched, the
        ones it cannot take; step() then runs those one by one (`_step_one`), where any
        conversion or error happens. Per tensor, Python only counts the step and gathers
        pointers.
        """
        params = [param for param, _ in batch]
        states = [self.state[param] for param in params]
        outs: list[Optional[torch.Tensor]] = []
        if any(copy is not None for _, copy in batch):
            outs = [
                copy.detach().view(param.shape) if copy is not None and _fusable_copy(param, copy) else None
                for param, copy in batch
            ]
        skipped = self._native.adam_step_supported(
            params,
            [param.grad for param in params],
            [state["exp_avg"] for state in states],
            [state["exp_avg_sq"] for state in states],
            outs,
            steps,
            *hyper,
        )
        if _increment_version is not None:  # the kernel wrote through raw pointers
            _increment_version(params)
            if outs:
                _increment_version([out for out in outs if out is not None])
        if outs:
            not_done = set(skipped)
            for i, (param, copy) in enumerate(batch):
                if copy is not None and outs[i] is None and i not in not_done:
                    copy.copy_(param.detach().view_as(copy))
        return skipped

    def _step_one(self, param: torch.Tensor, copy: Optional[torch.Tensor], step: int, hyper: tuple) -> None:
        """One tensor the group call skipped: the op after converting its grad, or torch ops."""
        self._check_param(param)
        state = self.state[param]
        if self._native is None or not _native_ok(param, state):
            torch_adam_update(param, param.grad, state["exp_avg"], state["exp_avg_sq"], step, *hyper)
            if copy is not None:
                copy.copy_(param.detach().view_as(copy))
            return
        fused = copy is not None and _fusable_copy(param, copy)
        self._native.adam_step(
            [param.detach()],
            [_native_grad(param)],
            [state["exp_avg"]],
            [state["exp_avg_sq"]],
            [copy.detach().view(param.shape)] if fused else [],
            [step],
            *hyper,
        )
        if _increment_version is not None:
            _increment_version([param, copy] if fused else [param])
        if copy is not None and not fused:
            copy.copy_(param.detach().view_as(copy))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then exp_avg / exp_avg_sq restored to fp32 when the states are fp32,
        and copied into huge-page buffers (`move_states_into_huge_pages`).

        torch casts floating-point state to each parameter's dtype; for fp16/bf16 parameters
        with ``fp32_optimizer_states`` that would drop the states' precision.
        """
        super().load_state_dict(state_dict)
        if self.fp32_optimizer_states:
            self._restore_fp32_states(state_dict)
        self.move_states_into_huge_pages()

    def _restore_fp32_states(self, state_dict: dict[str, Any]) -> None:
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, param in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved.get(key)
                if isinstance(value, torch.Tensor) and param in self.state:
                    self.state[param][key] = value.to(device=param.device, dtype=torch.float32)
