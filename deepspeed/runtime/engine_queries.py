"""`EngineQueries`: upstream's query surface of `DeepSpeedEngine`, answered from its config.

Queries and small read-only properties clients call on an engine (HF transformers,
accelerate, Lightning, upstream's tests): config accessors (`train_batch_size()`,
`zero_reduce_bucket_size()`, `fp16_enabled()`, ...), ranks and groups, and the engine's
ZeRO strategy's data under the attribute names the engine had before the strategy held
them. A mixin of the engine: it reads only `self._config` and the engine's public
attributes (`optimizer`, `module`, `mpu`, `dtype`, `zero`), and nothing here changes how a
step trains.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.utils import groups

__all__ = ["EngineQueries", "train_dtype"]


def train_dtype(config: DeepSpeedConfig) -> torch.dtype:
    """The dtype the engine trains in: bf16, else fp16, else fp32."""
    if config.bfloat16_enabled:
        return torch.bfloat16
    if config.fp16_enabled:
        return torch.float16
    return torch.float32


class EngineQueries:
    """Upstream's engine queries (see the module docstring); mixed into `DeepSpeedEngine`."""

    @property
    def config(self) -> dict:
        return self._config._param_dict

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size through the accumulation steps (the micro-batch size
        stays): it must be a multiple of micro-batch size x data-parallel ranks."""
        micro, ranks = self.train_micro_batch_size_per_gpu(), self._config.world_size
        if train_batch_size < 1 or train_batch_size % (micro * ranks):
            raise ValueError(
                f"engine.set_train_batch_size({train_batch_size}): must be a positive multiple of "
                f"train_micro_batch_size_per_gpu ({micro}) x data-parallel ranks ({ranks})"
            )
        self._change_batch_sizes(micro, train_batch_size // (micro * ranks), "set_train_batch_size")

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size; the accumulation steps stay, so the global batch follows."""
        if micro_batch_size < 1:
            raise ValueError(f"engine.set_train_micro_batch_size({micro_batch_size}): must be >= 1")
        self._change_batch_sizes(
            micro_batch_size, self.gradient_accumulation_steps(), "set_train_micro_batch_size"
        )

    def _change_batch_sizes(self, micro: int, gas: int, caller: str) -> None:
        if self.micro_steps % self.gradient_accumulation_steps():
            raise RuntimeError(
                f"engine.{caller}: {self.micro_steps % self.gradient_accumulation_steps()} micro-steps of "
                "an accumulation are pending; call it after the boundary's step()"
            )
        self._config.train_micro_batch_size_per_gpu = micro
        self._config.gradient_accumulation_steps = gas
        self._config.train_batch_size = micro * gas * self._config.world_size
        self.tput_timer.batch_size = micro * gas

    def get_global_grad_norm(self) -> Union[torch.Tensor, float, None]:
        return None if self.optimizer is None else self.optimizer.get_global_grad_norm()

    @property
    def basic_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer that steps the fp32 masters (the client's, or the one the config
        named), under upstream's name for it; None for an engine without an optimizer."""
        return None if self.optimizer is None else self.optimizer.optimizer

    def get_lr(self) -> list:
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    def sparse_gradients_enabled(self) -> bool:
        return self._config.sparse_gradients_enabled  # always False: true is refused (dense reduce-scatters)

    @property
    def sparse_tensor_module_names(self) -> set:
        """Upstream's record of the modules whose gradients it reduces as sparse tensors: none
        here, since `sparse_gradients: true` is refused."""
        return set()

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization_stage

    def zero_optimization(self) -> bool:
        return self._config.zero_optimization_stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self._config.zero_optimization_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._config.zero_optimization_stage == 3

    @property
    def local_rank(self) -> int:
        return dist.get_local_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def device(self) -> torch.device:

        return torch.device(get_accelerator().current_device_name())

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return getattr(self.optimizer, "skipped_steps", 0)

    def fp16_enabled(self) -> bool:
        return bool(self._config.fp16_enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self._config.bfloat16_enabled)

    @property
    def communication_data_type(self) -> torch.dtype:
        """The config's `communication_data_type`, else the training dtype (upstream's answer).

        Unset, the reduction itself takes each gradient's own dtype: the training dtype, except
        at stages 0-1 with accumulation, where a bf16/fp16 model's micro-steps are summed and
        reduced in fp32 (see [Note: whole gradients accumulate in fp32] in stage_1_and_2.py).
        """
        if self._config.communication_data_type is not None:
            return self._config.communication_data_type
        return train_dtype(self._config)

    def zero_offload_optimizer(self) -> Any:
        """The `zero_optimization.offload_optimizer` block (None when not offloading)."""
        return self._config.zero_config.offload_optimizer

    def zero_offload_param(self) -> Any:
        """The `zero_optimization.offload_param` block (None when not offloading)."""
        return self._config.zero_config.offload_param

    # Upstream's config queries, answered from this engine's config.

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def log_level(self) -> Optional[str]:
        """The config's `log_level` (None when absent)."""
        return self._config.log_level

    def steps_per_print(self) -> Any:
        return self._config.steps_per_print

    def optimizer_name(self) -> Optional[str]:
        return self._config.optimizer_name

    def optimizer_params(self) -> Optional[dict]:
        return self._config.optimizer_params

    def scheduler_name(self) -> Optional[str]:
        return self._config.scheduler_name

    def scheduler_params(self) -> Optional[dict]:
        return self._config.scheduler_params

    def dynamic_loss_scale(self) -> bool:
        """fp16 with a dynamic scale (`fp16.loss_scale` 0)."""
        return self.fp16_enabled() and self._config.loss_scale == 0

    def loss_scale(self) -> float:
        """The config's static `fp16.loss_scale` (0: dynamic); the live scale is the optimizer's `loss_scale`."""
        return self._config.loss_scale

    def initial_dynamic_scale(self) -> float:
        return self._config.initial_dynamic_scale

    def dynamic_loss_scale_args(self) -> Optional[dict]:
        return self._config.dynamic_loss_scale_args

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    @property
    def gradient_average(self) -> bool:
        """Upstream's flag: True where gradients are averaged over the ranks, False under
        `gradient_allreduce_op: "sum"`."""
        return self._config.gradient_allreduce_op == "mean"

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def flops_profiler_enabled(self) -> bool:
        return self._config.flops_profiler_config.enabled

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self._config.flops_profiler_config.recompute_fwd_factor

    def flops_profiler_profile_step(self) -> int:
        return self._config.flops_profiler_config.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self._config.flops_profiler_config.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self._config.flops_profiler_config.top_modules

    def flops_profiler_detailed(self) -> bool:
        return self._config.flops_profiler_config.detailed

    def flops_profiler_output_file(self) -> Optional[str]:
        return self._config.flops_profiler_config.output_file

    def memory_breakdown(self) -> bool:
        return self._config.memory_breakdown

    def zero_reduce_bucket_size(self) -> int:
        return self._config.zero_config.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self._config.zero_config.allgather_bucket_size

    def zero_overlap_comm(self) -> bool:
        return self._config.zero_config.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self._config.zero_config.contiguous_gradients

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state lives on the CPU (`offload_optimizer.device` cpu)."""
        offload = self._config.zero_config.offload_optimizer
        return offload is not None and offload.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the step runs on the CPU: optimizer offload to the CPU or to NVMe (as upstream)."""
        offload = self._config.zero_config.offload_optimizer
        return offload is not None and offload.device in ("cpu", "nvme")

    def get_batch_info(self) -> tuple:
        """`(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`."""
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def get_data_types(self) -> tuple:
        """`(model dtype, gradient accumulation dtype)`; gradients accumulate in fp32 here at every stage."""
        return self.dtype, torch.float32

    @property
    def data_parallel_group(self) -> Any:
        """The group this engine partitions and reduces over: its optimizer's (from `zero.Init`'s
        group or an `mpu`'s data-parallel group at stage 3), else the default data-parallel group."""
        group = getattr(self.optimizer, "dp_process_group", None)
        return group if group is not None else groups._get_data_parallel_group()

    @property
    def dp_world_size(self) -> int:
        return dist.get_world_size(self.data_parallel_group)

    @property
    def mp_world_size(self) -> int:
        """The mpu's model-parallel size; 1 without one, or with an mpu that has no model parallelism."""
        # Not `self.mpu.get_model_parallel_world_size()` unguarded: an AttributeError raised in a
        # property is reported by `__getattr__` as the wrapped module lacking `mp_world_size`.
        size = getattr(self.mpu, "get_model_parallel_world_size", None)
        return 1 if size is None else int(size())

    def get_mom(self) -> list:
        """Per param group: Adam's `betas`, else SGD's `momentum` (upstream's choice)."""
        if self.optimizer is None:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self.optimizer.param_groups]

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict:
        """The wrapped module's `state_dict` (partitioned parameters appear as their shape-[0]
        placeholders, as upstream; `_zero3_consolidated_16bit_state_dict` gathers them)."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

    # The ZeRO strategy's data (zero/stage.py) under the engine's attribute names, which
    # clients and tests read: stage 3's coordinator and states, stages 0-2's replicated shards.

    @property
    def coordinator(self) -> Any:
        """Stage 3's `ParameterCoordinator` (the module hooks); None at stages 0-2."""
        return self.zero.coordinator

    @property
    def zero_states(self) -> list:
        """Stage 3: every ZeRO parameter's state, by ds_id; empty at stages 0-2."""
        return self.zero.zero_states

    @property
    def persistent(self) -> list:
        """Stage 3: the parameter states that stay gathered; empty at stages 0-2."""
        return self.zero.persistent

    @property
    def replicated(self) -> dict:
        """Stages 0-2: `id(param) -> ReplicatedShard`; empty at stage 3."""
        return self.zero.replicated

    def checkpoint_record(self) -> dict:
        """What checkpoint files record about the run (`CheckpointEngine.checkpoint_record`)."""
        return {"zero_stage": self.zero_optimization_stage(), "dtype": self.dtype, "ds_config": self.config}
