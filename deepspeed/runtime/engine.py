"""`DeepSpeedEngine`: a thin facade over the ZeRO-3 pieces in `deepspeed/runtime/zero/`.

It converts the model (if it was not built under `zero.Init`), installs the stage-3 hooks
(`ParameterCoordinator`), routes gradients into the `GradientReducer`, and steps the
`ZeroStage3Optimizer` and the LR scheduler on gradient-accumulation boundaries.

Every ZeRO stage in the config runs on the stage-3 machinery: partitioning parameters as
well as gradients and optimizer states gives the same training results as stages 0-2,
with less memory per rank and more communication.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed.runtime.checkpointing import CheckpointMixin
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.forward_prologue import forward_prologue
from deepspeed.runtime.zero import gather
from deepspeed.runtime.zero.grad_reducer import GradientReducer
from deepspeed.runtime.zero.hooks import ParameterCoordinator, mark_persistent, persistent_states
from deepspeed.runtime.zero.param_state import ZeroParamStatus, is_zero_param
from deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init, cast_partitioned
from deepspeed.runtime.zero.stage3 import ZeroStage3Optimizer
from deepspeed.utils.logging import logger


def _train_dtype(config: DeepSpeedConfig) -> torch.dtype:
    if config.bfloat16_enabled:
        return torch.bfloat16
    if config.fp16_enabled:
        return torch.float16
    return torch.float32


class DeepSpeedEngine(CheckpointMixin, nn.Module):
    """What `deepspeed.initialize` returns: call it like the model, then `backward` and `step`."""

    def __init__(
        self,
        args: Any = None,
        model: Optional[nn.Module] = None,
        optimizer: Any = None,
        model_parameters: Any = None,
        training_data: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
        collate_fn: Any = None,
        config: Any = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"deepspeed.initialize: model must be an nn.Module, got {type(model).__name__}")
        self._config = config if isinstance(config, DeepSpeedConfig) else DeepSpeedConfig(config, mpu=mpu)
        self.args = args
        self.module = model
        self.dtype = _train_dtype(self._config)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._boundary_override: Optional[bool] = None
        self._prepare_module()
        zero = self._config.zero_config
        self.coordinator = ParameterCoordinator(
            model, zero.prefetch_bucket_size, zero.max_live_parameters, zero.max_reuse_distance
        )
        self.zero_states = gather.zero_states(model.parameters())  # every ZeRO parameter, by ds_id
        self.persistent = persistent_states(
            model, zero.param_persistence_threshold, zero.model_persistence_threshold
        )
        mark_persistent(self.persistent)
        self.optimizer = self._build_optimizer(optimizer, model_parameters)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.training_dataloader = self._build_dataloader(training_data, collate_fn)
        self._grad_hooks = self._install_grad_hooks() if self.optimizer is not None else []

    # ------------------------------------------------------------------ set-up

    def _prepare_module(self) -> None:
        from deepspeed.accelerator import get_accelerator

        stage = self._config.zero_optimization_stage
        if stage != 3:
            logger.warning(f"zero_optimization.stage={stage}: running on the stage-3 engine (same results)")
        plain = [p for p in self.module.parameters() if not is_zero_param(p)]
        if plain:
            # A model not built under zero.Init: partition it now, in the training dtype.
            Init(module=self.module, dtype=self.dtype, config_dict_or_path=self._config._param_dict)
        cast_partitioned(self.module, self.dtype)  # parts built under an Init of another dtype
        device = torch.device(get_accelerator().current_device_name())
        for buf in self.module.buffers():
            target = self.dtype if buf.is_floating_point() else buf.dtype
            # In place, so every alias of the buffer (tied, or held by user code) follows.
            buf.data = buf.data.to(device=device, dtype=target)

    def _settle_live_gathers(self) -> None:
        """Before a step or a save: refuse pass holds, settle live gathers.

        Between passes no submodule may hold parameters (see hooks.py's note); one that does
        would keep a tensor the step makes stale. A live `GatheredParameters` with a
        `modifier_rank` writes its edits back first, so the step (or the checkpoint) starts
        from them. With `zero_optimization.enable_sanity_checks`, a non-persistent parameter
        that is gathered with no owner at all is an error too: nothing would ever free it.
        """
        leaked = self.coordinator.pass_holds()
        if leaked:
            raise RuntimeError(
                f"engine.step() or save_checkpoint() was called while {leaked} still hold parameters; "
                "call them after backward() returns, not inside a forward or backward"
            )
        if self._config.zero_config.enable_sanity_checks:
            orphans = [
                s.ds_id
                for s in self.zero_states
                if s.status is not ZeroParamStatus.NOT_AVAILABLE and not s.holds and not s.persist
            ]
            if orphans:
                raise RuntimeError(
                    f"[rank {dist.get_rank()}] parameters ds_id={orphans} are gathered with no holder"
                )
        writers: dict = {}
        for state in self.zero_states:
            for owner in state.holds:
                if isinstance(owner, GatheredParameters) and owner.modifier_rank is not None:
                    writers.setdefault(id(owner), owner)  # in ds_id order: the same on every rank
        for owner in writers.values():
            owner.write_back_edits()

    def _build_optimizer(self, client: Any, model_parameters: Any) -> Optional[ZeroStage3Optimizer]:
        if client is None and self._config.optimizer_name is None:
            return None  # an inference engine: forward gathers and releases, nothing trains
        return ZeroStage3Optimizer(self.module, self._config, client, model_parameters)

    def _build_scheduler(self, client: Any) -> Any:
        if client is not None:
            if callable(client) and not hasattr(client, "step"):
                return client(self.optimizer.optimizer)
            return client
        if self._config.scheduler_name is None or self.optimizer is None:
            return None
        from deepspeed.runtime.lr_schedules import build_lr_scheduler

        return build_lr_scheduler(
            self._config.scheduler_name, self.optimizer.optimizer, self._config.scheduler_params
        )

    def _build_dataloader(self, training_data: Any, collate_fn: Any) -> Any:
        if training_data is None:
            return None
        from deepspeed.runtime.dataloader import DeepSpeedDataLoader

        return DeepSpeedDataLoader(training_data, self.train_micro_batch_size_per_gpu(), collate_fn)

    def _install_grad_hooks(self) -> list:
        self.reducer = GradientReducer.from_config(self._config, self.optimizer.grad_shard)
        handles = []
        for state in self.optimizer.states:
            handles.append(state.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        untrained = self.optimizer.untrained(self.module)
        if untrained and dist.get_rank() == 0:
            # [Note: whose param groups train] in stage3.py: their gradients are dropped.
            logger.warning(
                f"{len(untrained)} trainable parameter(s) are in no optimizer param group, so they do not "
                f"train and their gradients are freed once computed: {', '.join(untrained)}. Set "
                "requires_grad=False on them (which also saves computing those gradients), or add them "
                "to the optimizer's param groups"
            )
        dropped = set(untrained)
        for name, param in self.module.named_parameters():
            if name in dropped:
                handles.append(param.register_post_accumulate_grad_hook(self._drop_grad))
        return handles

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        grad, param.grad = param.grad, None  # the full gradient lives only until it is packed
        self.reducer.add(param._zero_state, grad)

    @staticmethod
    def _drop_grad(param: nn.Parameter) -> None:
        param.grad = None  # a trainable parameter no optimizer group holds (warned at initialize)

    # ------------------------------------------------------------------ training

    def forward(self, *args, **kwargs):
        args, kwargs = forward_prologue(self, args, kwargs)  # fp16.auto_cast, steps_per_print
        # The module's own hooks gather, release and mark where a pass starts and ends, so a
        # direct call of the module (generate, an eval loop) behaves the same (see hooks.py).
        return self.module(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        if self.optimizer is None:
            raise RuntimeError(
                "engine.backward() needs an optimizer; pass one to deepspeed.initialize or the config"
            )
        scaled = loss.float() * self.optimizer.loss_scale
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        try:
            scaled.backward(retain_graph=retain_graph)
        finally:
            self.coordinator.finish_backward()
        self.reducer.flush()
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = bool(is_boundary)

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                "engine.step() needs an optimizer; pass one to deepspeed.initialize or the config"
            )
        if self.is_gradient_accumulation_boundary():
            self._settle_live_gathers()
            stepped = self.optimizer.step()
            # Whatever stays gathered across the step (persistent parameters, a live
            # GatheredParameters) is re-gathered, so no gathered tensor keeps old values.
            gather.refresh_gathered(self.zero_states)
            if stepped and self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.optimizer.zero_grad()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)

    # ------------------------------------------------------------------ queries

    @property
    def config(self) -> dict:
        return self._config._param_dict

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def get_global_grad_norm(self) -> Optional[float]:
        return None if self.optimizer is None else self.optimizer.get_global_grad_norm()

    def get_lr(self) -> list:
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization_stage

    def zero_optimization(self) -> bool:
        return True

    @property
    def local_rank(self) -> int:
        return dist.get_local_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def device(self) -> torch.device:
        from deepspeed.accelerator import get_accelerator

        return torch.device(get_accelerator().current_device_name())

    def destroy(self) -> None:
        """Remove every hook the engine installed; parameters stay partitioned."""
        self.coordinator.remove_hooks()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
