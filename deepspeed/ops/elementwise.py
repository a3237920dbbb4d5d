"""The base of the optimizers written as element-wise torch ops (CPU Adagrad, Lion).

`step()` walks every parameter with a gradient, creates its state on first use (a step count
and, for each name in `STATE_KEYS`, a tensor in fp32 when `fp32_optimizer_states`, else in
the parameter's dtype), counts the step and hands the update to `_update`. A class for
CPU-held state (ZeRO-Offload) sets `CPU_ONLY_ALTERNATIVE` and refuses other devices, naming
what to use there. `load_state_dict` keeps the state in fp32 when asked to.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import torch

from deepspeed.runtime.huge_pages import huge_page_zeros


class ElementwiseOptimizer(torch.optim.Optimizer):
    STATE_KEYS: ClassVar[tuple] = ()  # the state tensors each parameter gets
    CPU_ONLY_ALTERNATIVE: ClassVar[Optional[str]] = None  # set: the state lives in CPU memory only
    SPARSE_GRADIENTS: ClassVar[bool] = False  # whether `_update` takes a sparse (COO) gradient
    fp32_optimizer_states: bool  # state tensors in fp32 whatever the parameter dtype

    def _initial_value(self, key: str, group: dict[str, Any]) -> float:
        """What state tensor `key` starts as (filled everywhere)."""
        return 0.0

    def _update(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            name = type(self).__name__
            on_cpu = param.device.type == "cpu"
            if self.CPU_ONLY_ALTERNATIVE is not None and not on_cpu:
                raise ValueError(
                    f"{name}: a parameter is on {param.device}, but it must be on the CPU; enable "
                    '"offload_optimizer": {"device": "cpu"} in the ZeRO config, or use '
                    f"{self.CPU_ONLY_ALTERNATIVE} for accelerator parameters"
                )
            dtype = torch.float32 if self.fp32_optimizer_states else param.dtype
            state["step"] = 0
            for key in self.STATE_KEYS:
                if on_cpu:
                    tensor = huge_page_zeros(param.shape, dtype)
                else:
                    tensor = torch.zeros(param.shape, dtype=dtype, device=param.device)
                start = self._initial_value(key, group)
                state[key] = tensor.fill_(start) if start else tensor
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse and not self.SPARSE_GRADIENTS:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self._state(param, group)
                # int(): a state loaded from a torch optimizer holds its step as a 0-d tensor.
                state["step"] = int(state["step"]) + 1
                self._update(param, state, group)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.fp32_optimizer_states:
            for state in self.state.values():
                for key in self.STATE_KEYS:
                    if isinstance(state.get(key), torch.Tensor):
                        state[key] = state[key].float()
