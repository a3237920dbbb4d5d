"""`DeepSpeedCPUAdam`: Adam/AdamW for parameters held in CPU memory (ZeRO-Offload)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable
from itertools import chain
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from deepspeed import process_state
from deepspeed.ops.op_builder import ALL_OPS
from deepspeed.runtime.huge_pages import HUGE_PAGE_BYTES, huge_page_zeros, huge_pages_available
from deepspeed.utils.logging import logger

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


PREFETCH_ENV = "DS_CPU_ADAM_PREFETCH"  # a distance in elements: fixed, not measured


class PrefetchTuner:
    """Chooses the `cpu_adam` op's software prefetch distance by timing real steps.

    [Note: the prefetch distance, measured where it runs]
    How far ahead the kernel should prefetch depends on how far the CPU's own prefetchers
    carry (csrc/adam/adam_kernel.h): 512 elements took a step from 1.16-1.20x to 1.01-1.03x
    the streaming floor on Intel Sapphire Rapids, and cost 10-26% on AMD Zen 4 and Zen 5.
    The op starts from its vendor rule (512 on Intel, none elsewhere), which covers only the
    CPUs measured; so the first steps that stream enough memory for it to matter (`MIN_ELEMENTS`
    in one call, every state touched by an earlier step) alternate between the two
    distances, `TRIALS` each, timing the native call per element, and the faster one is kept
    when it beats the default by `MARGIN`. A prefetch changes no value (bitwise, tested), so
    the trials cost only their time. Process-wide, as the op's setting is; `DS_CPU_ADAM_PREFETCH=N`
    fixes the distance instead. A process whose steps stay small never measures
    (`GIVE_UP_AFTER` calls) and keeps the default.
    """

    CANDIDATES = (0, 512)
    TRIALS = 3
    MIN_ELEMENTS = 1 << 22  # 16 MiB of fp32 parameters: steps below this live in the caches
    MARGIN = 0.03
    GIVE_UP_AFTER = 64  # calls too small to time, before keeping the default for good

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.done = False
        self.result: Optional[dict] = None  # {"distance", "source", "default", "ns_per_element"}
        self._default: Optional[int] = None
        self._plan: list = []  # distances still to time, in order
        self._times: dict = {}  # distance -> [ns per element]
        self._small = 0

    def before(self, op: ModuleType, elements: int, fresh: bool) -> Optional[int]:
        """Called before a native step of `elements`; returns the distance set for it when
        it is a timed trial (then call `after`), else None."""
        if self._default is None and not self._start(op):
            return None
        if fresh or elements < self.MIN_ELEMENTS:
            self._small += 1
            if self._small >= self.GIVE_UP_AFTER and not any(self._times.values()):
                self._finish(op, self._default, "default: no step large enough to time")
            return None
        distance = self._plan[0]
        op.set_prefetch(distance)
        return distance

    def after(self, op: ModuleType, distance: int, seconds: float, elements: int) -> None:
        self._times[distance].append(seconds * 1e9 / elements)
        self._plan.pop(0)
        if self._plan:
            return
        medians = {d: statistics.median(ts) for d, ts in self._times.items()}
        best = min(medians, key=medians.get)
        keep = best != self._default and medians[best] < (1 - self.MARGIN) * medians[self._default]
        self._finish(op, best if keep else self._default, "measured", medians)

    def _start(self, op: ModuleType) -> bool:
        self._default = op.prefetch()
        pinned = os.environ.get(PREFETCH_ENV)
        if pinned is not None:
            try:
                distance = int(pinned)
                op.set_prefetch(distance)
            except (ValueError, RuntimeError) as e:
                raise ValueError(
                    f"{PREFETCH_ENV}={pinned!r} is not a prefetch distance: give elements ahead as an "
                    f"integer from 0 (none) to 65536, or unset it to have the distance measured ({e})"
                ) from None
            self._finish(op, distance, f"{PREFETCH_ENV}")
            return False
        other = [d for d in self.CANDIDATES if d != self._default][0]
        self._plan = [self._default, other, other, self._default] * self.TRIALS
        self._plan = self._plan[: 2 * self.TRIALS]
        self._times = {self._default: [], other: []}
        return True

    def _finish(self, op: ModuleType, distance: int, source: str, medians: Optional[dict] = None) -> None:
        op.set_prefetch(distance)
        self.done = True
        self.result = {
            "distance": distance,
            "source": source,
            "default": self._default,
            "ns_per_element": medians,
        }
        if medians is not None:
            timed = ", ".join(f"{d}: {ns:.3f} ns/element" for d, ns in sorted(medians.items()))
            logger.info(f"DeepSpeedCPUAdam: prefetching {distance} elements ahead (timed steps: {timed})")


PREFETCH = PrefetchTuner()
process_state.register("deepspeed.ops.adam.cpu_adam.PREFETCH", PREFETCH, PREFETCH.reset)


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
        trial = None
        if not PREFETCH.done:  # [Note: the prefetch distance, measured where it runs]
            elements = sum(param.numel() for param in params)
            trial = PREFETCH.before(self._native, elements, fresh=min(steps) == 1)
            began = time.perf_counter()
        skipped = self._native.adam_step_supported(
            params,
            [param.grad for param in params],
            [state["exp_avg"] for state in states],
            [state["exp_avg_sq"] for state in states],
            outs,
            steps,
            *hyper,
        )
        if trial is not None:
            PREFETCH.after(self._native, trial, time.perf_counter() - began, elements)
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
