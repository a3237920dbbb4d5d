"""Upstream's `deepspeed.runtime.zero.stage3` path: stage 3's optimizer class and generation helper.

The optimizer itself is one wrapper for every stage (`optimizer.py`); this module keeps what
only stage 3 has, `DeepSpeedZeroOptimizer_Stage3` (upstream's class name for it, with
upstream's stage-3 attributes) and `unwrap_model_for_generation`, and re-exports the names
code written for upstream imports from here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.estimators import (  # noqa: F401 - upstream's import path
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from deepspeed.runtime.zero.optimizer import (  # noqa: F401 - this path's names before the split
    UnusedParametersError,
    ZeroStage3Optimizer,
    build_config_optimizer,
    copy_cast,
)


class DeepSpeedZeroOptimizer_Stage3(ZeroStage3Optimizer):  # noqa: N801 - upstream's name
    """The engine's optimizer at stage 3, under upstream's class name, so that code checking
    `isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)` sees what it expects."""

    # Upstream cuts each param group into sub-groups and keeps one flat fp32 tensor per
    # sub-group, the key of the wrapped optimizer's state. Here every trainable parameter's
    # master is one flat fp32 tensor (this rank's shard) keyed the same way, so each parameter
    # is a sub-group of its own: `fp16_groups[i]` and `fp32_partitioned_groups_flat[i]` are
    # the i-th, in the optimizer's order, and `optimizer.state[fp32_partitioned_groups_flat[i]]`
    # is that parameter's state, as code written for upstream reads it.

    def _sub_groups(self) -> list:
        """(parameter, master) per sub-group, in the wrapped optimizer's order."""
        param_of = {id(self.masters[s.ds_id]): s.param for s in self.states}
        return [(param_of[id(m)], m) for group in self.optimizer.param_groups for m in group["params"]]

    @property
    def fp16_groups(self) -> list:
        """Upstream's sub-groups of the model's (16-bit) parameters: here `[[param]]` per trainable parameter."""
        return [[param] for param, _ in self._sub_groups()]

    @property
    def fp32_partitioned_groups_flat(self) -> list:
        """Upstream's flat fp32 master per sub-group: here each trainable parameter's master
        (this rank's shard, 1-D), the tensor itself, not a copy."""
        return [master for _, master in self._sub_groups()]

    def _get_norm_groups(self) -> list:
        """Upstream's gradient norm per sub-group (0-dim fp32 tensors, over every rank's shards,
        loss-scaled as the gradient shards are until the step): their vector norm is the
        global norm. One all-reduce; every rank must call it."""
        comm_device = torch.device(get_accelerator().current_device_name())
        masters = [master for _, master in self._sub_groups()]
        squares = torch.zeros(len(masters), dtype=torch.float64, device=comm_device)
        for index, master in enumerate(masters):
            if master.grad is not None:
                squares[index] = master.grad.double().pow(2).sum().to(comm_device)
        dist.all_reduce(squares, group=self.group)
        return list(squares.sqrt().float().unbind())


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any):
    """Upstream's context for fast generation with a ZeRO-3 engine: every parameter gathered
    once, and the engine's per-submodule hooks off, so a generate loop runs as on a plain model.

    `model` is the engine. The hooks come back when the block ends, also when it raises
    (upstream's leaves them off then). At stages 0-2 the parameters are whole already and
    this only yields the engine.
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    coordinator = getattr(model, "coordinator", None)  # the engine's hooks (stage 3); None at stages 0-2
    with GatheredParameters(list(model.parameters())):
        if coordinator is None:
            yield model
            return
        coordinator.remove_hooks()
        try:
            yield model
        finally:
            coordinator._register_deepspeed_module(coordinator.module)
