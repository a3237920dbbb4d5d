"""`DeepSpeedEngine`: a thin facade over the ZeRO-3 pieces in `deepspeed/runtime/zero/`.

At stage 3 it converts the model (if it was not built under `zero.Init`) and installs the
hooks that gather parameters around each submodule (`ParameterCoordinator`). At stages 0-2
parameters stay whole and only this rank's slices are kept for the optimizer
(`stage_1_and_2.py`). Every stage routes gradients into the `GradientReducer` (during
backward at stages 2-3, once per step at 0-1) and steps the same `ZeroStage3Optimizer` over
fp32 master slices, then the LR scheduler, on gradient-accumulation boundaries. Stage 0 runs
as stage 1: the same results as plain data parallelism, with the optimizer state sharded.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any, Optional, Union

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.engine_methods import CheckpointMethods
from deepspeed.runtime.agreement import check_agreement, describe_parameters
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.forward_prologue import forward_prologue, report_progress
from deepspeed.runtime.host_malloc import keep_freed_memory_for_reuse
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.runtime.zero import gather
from deepspeed.runtime.zero.grad_reducer import GradientReducer
from deepspeed.runtime.zero.hooks import ParameterCoordinator, mark_persistent, persistent_states
from deepspeed.runtime.zero.leaf_grads import LeafGradients
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from deepspeed.runtime.zero.linear import route_linears
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.offload_states import StateOffloader
from deepspeed.runtime.zero.parameter import is_zero_param
from deepspeed.runtime.zero.partition_parameters import GatherHold, Init, cast_partitioned
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3, ZeroStage3Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import (
    DeepSpeedZeroOptimizer,
    allreduce_whole_grads,
    make_replicated_shards,
    reduce_accumulated_grads,
    set_aside_grad,
    unpartition,
)
from deepspeed.utils import groups
from deepspeed.utils.logging import logger
from deepspeed.utils.timer import EngineTimers, SynchronizedWallClockTimer, ThroughputTimer
from deepspeed.utils.z3_leaf_module import apply_leaf_module_config, set_z3_leaf_modules_by_granularity


class NoSyncError(AssertionError):
    """Misuse of `engine.no_sync()`. An AssertionError, as upstream raises, so that code and
    tests written against upstream catch it."""


def _train_dtype(config: DeepSpeedConfig) -> torch.dtype:
    if config.bfloat16_enabled:
        return torch.bfloat16
    if config.fp16_enabled:
        return torch.float16
    return torch.float32


class DeepSpeedEngine(CheckpointMethods, nn.Module):
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
        if get_accelerator().device_name() == "cpu":
            keep_freed_memory_for_reuse()  # see host_malloc.py's note
        self._check_ranks_agree(model)
        self.mpu = mpu
        self._refuse_model_parallelism(model)
        self._configure_activation_checkpointing(mpu)
        self.args = args
        self.module = model
        self.dtype = _train_dtype(self._config)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._boundary_override: Optional[bool] = None
        self._inside_backward = False  # engine.backward is running autograd
        self._stray_grads: list = []  # params whose gradients came from a backward outside it
        self._offloader = StateOffloader(self)  # what offload_states() moved off the accelerator
        # Stage 0: `param.grad` holds the average of every gradient so far (see
        # stage_1_and_2.allreduce_whole_grads); the next backward or zero_grad clears it.
        self._whole_grads_reduced = False
        self._inside_no_sync = False  # see no_sync()
        # Upstream's switch: False leaves stages 0-1's gradients unreduced after backward, for
        # the caller to reduce with allreduce_gradients() (see there).
        self.enable_backward_allreduce = True
        # `wall_clock_breakdown`: named timers around forward, backward and step (utils/timer.py).
        self.timers = SynchronizedWallClockTimer()
        self.engine_timers = EngineTimers(enabled=self._config.wall_clock_breakdown)
        self.engine_timers_cache: dict = {}  # get_wall_clock_timers(): the last step's readings
        self.tput_timer = ThroughputTimer(
            batch_size=self._config.train_micro_batch_size_per_gpu * self._config.gradient_accumulation_steps
        )  # samples/s per rank, reported with steps_per_print
        self._is_compiled = False  # see compile()
        zero = self._config.zero_config
        # Stages 0-2 keep full parameters (stage_1_and_2.py's note); stage 3 partitions them.
        self.partitions_weights = self._config.zero_optimization_stage == 3
        self.coordinator: Optional[ParameterCoordinator] = None
        self.replicated: dict = {}  # stages 0-2: id(param) -> ReplicatedShard
        self.zero_states: list = []  # stage 3: every ZeRO parameter, by ds_id
        self.persistent: list = []  # stage 3: parameters that stay gathered
        apply_leaf_module_config(model, zero.leaf_module)  # every stage: leaves also shape gradient reduction
        if self.partitions_weights:
            self._prepare_module()
            route_linears(model)  # [Note: what autograd keeps of a gathered weight] in zero/linear.py
            self._mark_fine_grained_leaves(zero.module_granularity_threshold)
            self.coordinator = ParameterCoordinator(
                model, zero.prefetch_bucket_size, zero.max_live_parameters, zero.max_reuse_distance
            )
            self.zero_states = gather.zero_states(model.parameters())
            self.persistent = persistent_states(
                model, zero.param_persistence_threshold, zero.model_persistence_threshold
            )
            mark_persistent(self.persistent)
        else:
            self._prepare_replicated_module()
        self._warn_unused_config_blocks(optimizer, lr_scheduler)
        self.client_optimizer = optimizer  # what the caller passed (upstream's attributes)
        self.client_lr_scheduler = lr_scheduler
        self.optimizer = self._build_optimizer(optimizer, model_parameters)
        if self.optimizer is not None:
            self.optimizer.before_step = self._settle_live_gathers
            self.optimizer.after_step = self._refresh_full_params
            self.optimizer.parameter_offload = self.coordinator
            self.optimizer.before_zero_grad = self._discard_unreduced_grads
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.training_dataloader = self._build_dataloader(training_data, collate_fn)
        self._grad_hooks = self._install_grad_hooks() if self.optimizer is not None else []

    # ------------------------------------------------------------------ set-up

    def _configure_activation_checkpointing(self, mpu: Any) -> None:
        """The config's `activation_checkpointing` block sets up `deepspeed.checkpointing`.

        Unless a script (Megatron, Lightning) called `deepspeed.checkpointing.configure` first:
        its explicit arguments stay in force.
        """
        from deepspeed.runtime.activation_checkpointing import checkpointing
        from deepspeed.runtime.config_utils import section_is_off

        if not section_is_off(self._config._param_dict.get("activation_checkpointing")):
            if not checkpointing.is_configured():
                checkpointing.configure(mpu, deepspeed_config=self._config)

    def _check_ranks_agree(self, model: nn.Module) -> None:
        """One collective: every rank passed the same config and the same parameters, in order.

        Everything the engine does next sizes collectives from them (runtime/agreement.py).
        """
        config = json.dumps(self._config._param_dict, sort_keys=True, default=lambda o: type(o).__name__)
        shape_of = lambda p: p.ds_shape if is_zero_param(p) else p.shape  # noqa: E731
        check_agreement(
            "deepspeed.initialize: the config and the model's parameters",
            [f"config {config}"] + describe_parameters(list(model.named_parameters()), shape_of),
            fix="Every rank must pass the same config and build the same model, parameters in the same order.",
        )

    def _refuse_model_parallelism(self, model: nn.Module) -> None:
        """An `mpu` with model-parallel ranks works only where every collective stays inside a
        data-parallel group: stage 3 with the model built under `zero.Init(mpu=...)`, and no
        clipping or fp16 (their global norm and overflow check are not summed over the
        model-parallel ranks here). Elsewhere ranks holding different tensor-parallel shards
        would be averaged and gathered together: refused rather than trained wrong."""
        size = self.mp_world_size
        if size <= 1:
            return
        stage, config = self._config.zero_optimization_stage, self._config
        world = dist.get_world_size()
        spans_world = [
            n
            for n, p in model.named_parameters()
            if not is_zero_param(p) or p._zero_state.world_size == world
        ]
        why = None
        if stage < 3:
            why = f"stage {stage} shards and reduces over all {world} ranks"
        elif spans_world:
            why = f"parameters such as {spans_world[0]!r} are partitioned over all {world} ranks"
        elif config.gradient_clipping > 0 or config.fp16_enabled:
            why = (
                f"gradient_clipping={config.gradient_clipping} (1.0 when the config omits it, as upstream's) and "
                "fp16's overflow check use a norm not summed over the model-parallel ranks"
            )
        if why is not None:
            raise ValueError(
                f"deepspeed.initialize: the mpu has model-parallel size {size}, and {why}, which would mix "
                "different model-parallel shards. Model parallelism is supported only at stage 3 with the model "
                'built under deepspeed.zero.Init(mpu=mpu), with "gradient_clipping": 0 and without fp16; otherwise '
                "train without model parallelism"
            )

    def _prepare_module(self) -> None:

        plain = [p for p in self.module.parameters() if not is_zero_param(p)]
        if plain:
            # A model not built under zero.Init: partition it now, in the training dtype.
            Init(module=self.module, dtype=self.dtype, config_dict_or_path=self._config._param_dict)
        cast_partitioned(self.module, self.dtype)  # parts built under an Init of another dtype
        self._cast_in_place(self.module.buffers())

    def _prepare_replicated_module(self) -> None:
        """Stages 0-2: full parameters and buffers in the training dtype, on the device."""
        whole = unpartition(self.module)  # built under zero.Init: stages 0-2 keep parameters whole
        if whole:
            logger.info(
                "zero_optimization.stage=%d keeps parameters whole: %d parameters partitioned by "
                "zero.Init (first: %s) were gathered back",
                self._config.zero_optimization_stage,
                len(whole),
                whole[0],
            )
        self._cast_in_place(self.module.parameters())
        self._cast_in_place(self.module.buffers())
        if dist.get_world_size() > 1:
            # Ranks may have drawn different random initial values: rank 0's are the model, as
            # upstream broadcasts them at initialize (stage 3 does it when it partitions). Left
            # alone, trainable weights would start from every rank's own and frozen ones never agree.
            gather.broadcast_coalesced([p.data for p in self.module.parameters()], 0, None)
        self.replicated = make_replicated_shards(self.module)

    def _cast_in_place(self, tensors) -> None:
        """Floating tensors to the training dtype, all to the device, in place: aliases follow."""

        device = torch.device(get_accelerator().current_device_name())
        for t in tensors:
            target = self.dtype if t.is_floating_point() else t.dtype
            if t.device != device or t.dtype != target:
                t.data = t.data.to(device=device, dtype=target)

    def _settle_live_gathers(self) -> None:
        """Before a step or a save: refuse pass holds, settle live gathers.

        Between passes no submodule may hold parameters (see hooks.py's note); one that does
        would keep a tensor the step makes stale. A live `GatheredParameters` with a
        `modifier_rank` writes its edits back first, so the step (or the checkpoint) starts
        from them. With `zero_optimization.enable_sanity_checks`, a non-persistent parameter
        that is gathered with no owner at all is an error too: nothing would ever free it.
        """
        if self.coordinator is None:
            return  # stages 0-2: parameters are never gathered
        leaked = self.coordinator.pass_holds()
        if leaked:
            raise RuntimeError(
                f"engine.step() or save_checkpoint() was called while {leaked} still hold parameters; "
                "call them after backward() returns, not inside a forward or backward"
            )
        # Complete every all-gather still in flight (a `start(async_op=True)` not yet waited
        # on): it reads the shards the step is about to change, and only what is gathered when
        # the step ends is refreshed, so it would otherwise show the old values for good.
        gather.wait_available(self.zero_states)
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
                if isinstance(owner, GatherHold) and owner.modifier_rank is not None:
                    writers.setdefault(id(owner), owner)  # in ds_id order: the same on every rank
        for owner in writers.values():
            owner.write_back_edits()

    def _warn_unused_config_blocks(self, optimizer: Any, lr_scheduler: Any) -> None:
        """As upstream, what `initialize` is passed wins over the config's block; say so, naming it."""
        passed = (
            ("optimizer", optimizer, self._config.optimizer_name),
            ("lr_scheduler", lr_scheduler, self._config.scheduler_name),
        )
        for argument, given, configured in passed:
            if given is not None and configured is not None and dist.get_rank() == 0:
                block = "optimizer" if argument == "optimizer" else "scheduler"
                logger.warning(
                    f"deepspeed.initialize: the {argument} passed in ({type(given).__name__}) is used and the "
                    f"config's {block!r} block (type {configured!r}) is not; remove one of them to silence this"
                )

    def _build_optimizer(self, client: Any, model_parameters: Any) -> Optional[ZeroStage3Optimizer]:
        if client is None and self._config.optimizer_name is None:
            return None  # an inference engine: forward gathers and releases, nothing trains
        offload = self._config.zero_config.offload_optimizer
        on_cpu = offload is not None and offload.device == "cpu"
        placement = {
            "master_device": torch.device("cpu") if on_cpu else None,
            # Pinning means nothing where the accelerator is the CPU itself.
            "pin_masters": on_cpu and offload.pin_memory and get_accelerator().device_name() != "cpu",
        }
        # One wrapper for every stage, under upstream's class name for the stage.
        wrapper = DeepSpeedZeroOptimizer_Stage3 if self.partitions_weights else DeepSpeedZeroOptimizer
        return wrapper(
            self.module,
            self._config,
            client,
            model_parameters,
            state_of=self._shard_state_of,
            **placement,
        )

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
        return self.deepspeed_io(training_data, collate_fn=collate_fn)

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: Optional[int] = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: Optional[int] = None,
    ) -> Any:
        """A data loader of `dataset` for this rank, as `initialize(training_data=...)` builds.

        `batch_size` defaults to the micro-batch size. `route` "train" shuffles each epoch
        (the same permutation on every rank, each rank its own share); "eval", "predict" and
        "encode" keep the data set's order. `data_sampler` replaces the per-rank sampler;
        `pin_memory` pins batches when the accelerator is not the CPU; `num_local_io_workers`
        are the DataLoader's worker processes.
        """
        from deepspeed.runtime.dataloader import DeepSpeedDataLoader

        routes = ("train", "eval", "predict", "encode")
        if route not in routes:
            raise ValueError(f"engine.deepspeed_io: route={route!r} is not one of {routes}")
        return DeepSpeedDataLoader(
            dataset,
            batch_size or self.train_micro_batch_size_per_gpu(),
            collate_fn,
            shuffle=route == "train",
            drop_last=self._config.dataloader_drop_last,
            sampler=data_sampler,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and get_accelerator().device_name() != "cpu",
        )

    def _mark_fine_grained_leaves(self, threshold: int) -> None:
        """`stage3_module_granularity_threshold`: fine-grained modules become leaf modules."""
        if threshold <= 0:
            return
        marked, finest = set_z3_leaf_modules_by_granularity(self.module, threshold)
        if dist.get_rank() != 0:
            return
        if marked:
            names = {id(m): n for n, m in self.module.named_modules()}
            logger.info(
                f"stage3_module_granularity_threshold={threshold}: {len(marked)} module(s) fetched as one unit: "
                + ", ".join(names[id(m)] or type(m).__name__ for m in marked[:8])
                + (", ..." if len(marked) > 8 else "")
            )
        else:
            logger.warning(
                f"stage3_module_granularity_threshold={threshold} marks no module: the finest module has "
                f"{finest} parameters per layer; set the threshold to at least that to fetch it as one unit"
            )

    def _install_grad_hooks(self) -> list:
        self.reducer = GradientReducer.from_config(
            self._config, self.optimizer.accumulate_grad, self.optimizer.settle_gradients
        )
        # [Note: a leaf's gradients are one unit] in leaf_grads.py
        self.leaf_grads = LeafGradients(
            self.module, self.optimizer.state_of, lambda state: state.ds_id in self.optimizer.masters
        )
        self.optimizer.leaf_grads = self.leaf_grads
        if self.coordinator is not None:
            self.coordinator.on_leaf_backward_done = self._on_leaf_backward_done
        handles = []
        for state in self.optimizer.states:
            if self.coordinator is not None:  # [Note: a gradient needs its parameter whole] in hooks.py
                gather_first = functools.partial(self.coordinator.gather_for_gradient, state.param)
                handles.append(state.param.register_hook(gather_first))
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
        if self.coordinator is not None:
            self.coordinator.release_after_gradient(param)
        if not self._inside_backward and len(self._stray_grads) < 3:
            self._stray_grads.append(param)  # refused at the next backward or step, see _refuse_stray_grads
        if self.zero_optimization_partition_gradients():
            if self._inside_backward and self.leaf_grads.waits(param):
                return  # reduced with the rest of its leaf module's gradients (leaf_grads.py)
            grad, param.grad = param.grad, None  # the full gradient lives only until it is packed
            self.reducer.add(self.optimizer.state_of(param), grad)
        elif self._inside_no_sync or not self.is_gradient_accumulation_boundary():
            # Stages 0-1: accumulate whole until the boundary, as DDP's no_sync, in fp32 (see
            # [Note: whole gradients accumulate in fp32] in stage_1_and_2.py). At the boundary
            # the gradient stays in param.grad: backward reduces them all once it is over.
            set_aside_grad(self.optimizer.state_of(param))

    def _on_leaf_backward_done(self, module: nn.Module) -> None:
        if self._inside_backward:
            self.leaf_grads.leaf_backward_done(module, self.reducer)

    @staticmethod
    def _drop_grad(param: nn.Parameter) -> None:
        param.grad = None  # a trainable parameter no optimizer group holds (warned at initialize)

    # ------------------------------------------------------------------ training

    def forward(self, *args, **kwargs):
        self._offloader.refuse_while_offloaded("forward()", [OffloadStateTypeEnum.lp_params])
        args, kwargs = forward_prologue(self, args, kwargs)  # fp16.auto_cast
        # The module's own hooks gather, release and mark where a pass starts and ends, so a
        # direct call of the module (generate, an eval loop) behaves the same (see hooks.py).
        self._memory_report("Engine before forward")
        self._start_timers("forward")
        try:
            return self.module(*args, **kwargs)
        finally:
            self._stop_timers("forward")
            self._memory_report("Engine after forward")

    def _memory_report(self, where: str) -> None:
        """`memory_breakdown: true`: print the accelerator's and host's memory here (rank 0)."""
        if self._config.memory_breakdown:
            see_memory_usage(where, force=True)

    def _start_timers(self, region: str) -> None:
        for name in self.engine_timers.regions[region]:  # empty without wall_clock_breakdown
            self.timers(name).start()

    def _stop_timers(self, region: str) -> None:
        for name in self.engine_timers.regions[region]:
            self.timers(name).stop()

    def _log_timers(self) -> None:
        """After each step() with `wall_clock_breakdown`: print and reset the micro-step timers,
        and at an accumulation boundary the step's (upstream's `time (ms) | fwd: ...` lines)."""
        if not self.engine_timers.micro_timers:
            return
        self.engine_timers_cache = {
            name: self.timers(name).elapsed(reset=False) for name in self.engine_timers.active_timers()
        }
        self.timers.log(self.engine_timers.micro_timers, memory_breakdown=self._config.memory_breakdown)
        if self.is_gradient_accumulation_boundary():
            self.timers.log(self.engine_timers.global_timers)

    def get_wall_clock_timers(self) -> dict:
        """`{timer name: milliseconds}` as read at the last step() (empty without `wall_clock_breakdown`)."""
        return self.engine_timers_cache

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        if self.optimizer is None:
            raise RuntimeError(
                "engine.backward() needs an optimizer; pass one to deepspeed.initialize or the config"
            )
        self._refuse_stray_grads("engine.backward()")
        self._offloader.refuse_while_offloaded("backward()")
        if not self.enable_backward_allreduce and self.zero_optimization_partition_gradients():
            raise RuntimeError(
                f"engine.enable_backward_allreduce=False leaves gradients unreduced for allreduce_gradients(), "
                f"but ZeRO stage {self.zero_optimization_stage()} reduce-scatters each gradient while backward "
                "runs; set it back to True, or use stage 0 or 1"
            )
        self._memory_report("Engine before backward")
        self._start_timers("backward")
        self._whole_grads_reduced = False  # stage 0: this backward adds to what was reduced
        try:
            self._backward(loss, retain_graph, scale_wrt_gas)
        finally:
            self._stop_timers("backward")
        self._memory_report("Engine after backward")
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            # As upstream: the loss as it was scaled for the backward (its share of the boundary's step).
            return loss.detach() / self.gradient_accumulation_steps()
        return loss

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool) -> None:
        scaled = loss.float() * self.optimizer.loss_scale
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        self.leaf_grads.refresh()
        self._inside_backward = True
        self._start_timers("backward_inner")  # autograd, with the reductions inside it (stages 2-3)
        try:
            scaled.backward(retain_graph=retain_graph)
        finally:
            self._stop_timers("backward_inner")
            self._inside_backward = False
            if self.coordinator is not None:
                self.coordinator.finish_backward()
        self._start_timers("backward_reduce")  # what is left to reduce once autograd is done
        try:
            if self.zero_optimization_partition_gradients():
                self.leaf_grads.flush(self.reducer)
            self.reducer.flush()
            if self.enable_backward_allreduce and not self._inside_no_sync:
                self.allreduce_gradients()
        finally:
            self._stop_timers("backward_reduce")

    def allreduce_gradients(self, bucket_size: Optional[int] = None) -> None:
        """Reduce the gradients backward left unreduced (upstream's name; each rank then holds
        the average over ranks in its gradient shards, which step() applies).

        Stages 0-1 reduce after the boundary's backward, as upstream's stage 1: whole gradients
        are replicated until then anyway, and on shared memory the ranks then meet back to back
        instead of once per bucket inside backward, each meeting paying the ranks' drift since
        the last one (1-3% of the decoder's step, measured side by side). engine.backward calls
        this unless `enable_backward_allreduce` is False or inside `no_sync()`; a caller that
        turned it off (to edit or inspect each rank's own gradients first) calls it before
        step(), and step() reduces whatever is still unreduced at the boundary, so no gradient
        is stepped on unreduced. Off the boundary it does nothing: the gradients keep
        accumulating, unreduced. `bucket_size`: elements per collective for this reduction
        (default `reduce_bucket_size`). Stages 2-3 reduce inside backward, as autograd
        produces each gradient, so nothing is left for this to do there.
        """
        if self.optimizer is None:
            raise RuntimeError(
                "engine.allreduce_gradients() needs an optimizer: it reduces into its gradient shards"
            )
        if bucket_size is not None and (
            not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size < 1
        ):
            raise ValueError(f"allreduce_gradients: bucket_size={bucket_size!r} must be a positive int")
        if self.zero_optimization_partition_gradients() or not self.is_gradient_accumulation_boundary():
            return
        if self._whole_grads_reduced:
            return  # stage 0: this boundary's gradients are reduced and wait in `param.grad`
        configured = self.reducer.bucket_elems
        if bucket_size is not None:
            self.reducer.bucket_elems = bucket_size
        try:
            if self.zero_optimization_stage() == 0:
                allreduce_whole_grads(
                    self.optimizer.states, self.reducer, self.leaf_grads.fill, self.optimizer.drop_grad_shard
                )
                self._whole_grads_reduced = True  # until the next backward adds gradients
            else:
                reduce_accumulated_grads(self.optimizer.states, self.reducer, self.leaf_grads.fill)
        finally:
            self.reducer.bucket_elems = configured

    def _refuse_stray_grads(self, where: str) -> None:
        """Raise if a backward other than engine.backward produced gradients of our parameters.

        Such gradients skip what engine.backward does around autograd (the fp16 loss scale, the
        division by gradient_accumulation_steps, the last bucket's reduction, stage 3's release
        of gathered parameters), so stepping on them would be silently wrong: at stage 2 they
        would wait in a bucket and be applied one step late.
        """
        if not self._stray_grads:
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        first = ", ".join(names.get(id(p), "?") for p in self._stray_grads)
        self._stray_grads = []
        raise RuntimeError(
            f"{where}: gradients of this engine's parameters ({first}, ...) came from a backward outside "
            "engine.backward(loss), such as loss.backward(); the engine scales, reduces and partitions "
            "gradients in engine.backward, so call engine.backward(loss) instead (if another model's backward "
            "reached these parameters, discard those gradients with zero_grad() before this engine's "
            "backward, or detach this engine's outputs there)"
        )

    def _discard_unreduced_grads(self) -> None:
        """`zero_grad`: gradients from a backward outside engine.backward are discarded, not refused.

        Their full gradients may wait in the reducer's unsent bucket (engine.backward flushes
        it, another backward does not); dropping them there, and the record that they came,
        lets the usual loop of two models run: a GAN's generator loss reaches the
        discriminator's parameters, whose gradients the discriminator's zero_grad then drops.
        """
        self.reducer.discard_pending()
        self._stray_grads = []
        self._whole_grads_reduced = False

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
        if self._inside_no_sync:
            raise NoSyncError(
                "It is illegal to call Engine.step() inside no_sync context manager: its gradients are "
                "not reduced yet; leave the `with engine.no_sync():` block first (the step then reduces them)"
            )
        self._refuse_stray_grads("engine.step()")
        self._offloader.refuse_while_offloaded("step()")
        self._memory_report("Engine before step")
        self._start_timers("step")
        boundary = self.is_gradient_accumulation_boundary()
        try:
            if boundary:
                # Stages 0-1: what no backward reduced yet (the switch off, a boundary that backward
                # did not see); nothing at stages 2-3 or when backward did it.
                self.allreduce_gradients()
                stepped = self.optimizer.step()  # settles live gathers, then refreshes full tensors
                if stepped and self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
                self.optimizer.zero_grad()
                self.global_steps += 1
                self.global_samples += self.train_batch_size()
                report_progress(self)  # steps_per_print
        finally:
            self._stop_timers("step")
        self.tput_timer.stop(global_step=boundary)
        self._log_timers()
        self.micro_steps += 1
        self._memory_report("Engine after step")

    def _refresh_full_params(self, after_load: bool = False) -> None:
        """After the shards changed (a step, a load): every full tensor must show them.

        Stage 3 re-gathers whatever stays gathered (persistent parameters, a live
        GatheredParameters), so no gathered tensor keeps old values; stages 0-2 gather every
        rank's updated slices back into the full parameters (after a step, the trained ones).
        """
        if self.partitions_weights:
            gather.refresh_gathered(self.zero_states)
            gather.drop_pooled_buffers()  # between steps a rank keeps only what ZeRO-3 promises
            return
        if after_load:
            changed = sorted(self.replicated.values(), key=lambda s: s.ds_id)
        else:
            changed = self.optimizer.states if self.optimizer is not None else []
        gather.gather_into_params(changed, self._config.zero_config.allgather_bucket_size)

    def _shard_state_of(self, param: nn.Parameter) -> Any:
        """The object holding `param`'s shard on this rank: a ZeroParamState (stage 3) or a
        ReplicatedShard (stages 0-2); checkpoints read and write shards through it."""
        if self.partitions_weights:
            return param._zero_state if is_zero_param(param) else None
        return self.replicated.get(id(param))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient so far (see `ZeroStage3Optimizer.zero_grad`)."""
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
        return self.partitions_weights

    @property
    def local_rank(self) -> int:
        return dist.get_local_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def device(self) -> torch.device:

        return torch.device(get_accelerator().current_device_name())

    def offload_states(
        self,
        include: Optional[Any] = None,
        device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the named states (all if `include` is None) to host memory, freeing their
        accelerator storage; `reload_states()` puts them back. See zero/offload_states.py."""
        if self.coordinator is not None and self.coordinator.pass_holds():
            raise RuntimeError(
                "engine.offload_states() was called inside a forward or backward; call it after step()"
            )
        self._offloader.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back, bit for bit, every state `offload_states()` moved."""
        self._offloader.reload(non_blocking)

    def destroy(self) -> None:
        """Remove every hook the engine installed; parameters stay partitioned."""
        if self.coordinator is not None:
            self.coordinator.remove_hooks()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []

    # ================================================================== upstream API surface
    # Queries and small controls clients call on an engine (HF transformers, accelerate,
    # Lightning, upstream's tests). Nothing here changes how a step trains.

    def __getattr__(self, name: str) -> Any:
        """Parameters, buffers and submodules as nn.Module; else the wrapped module's attribute.

        Upstream engines answer `engine.some_model_attribute` from the wrapped model; dunder
        names are never forwarded (copy and pickle probe them on the instance).
        """
        try:
            return super().__getattr__(name)  # nn.Module's: _parameters, _buffers, _modules
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is None or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"neither '{type(self).__name__}' nor its wrapped module '{type(module).__name__}' has "
                f"an attribute {name!r}"
            ) from None

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return getattr(self.optimizer, "skipped_steps", 0)

    def was_step_applied(self) -> bool:
        """Whether the latest `step()` updated the parameters: False off an accumulation
        boundary (no optimizer step ran) and when an fp16 overflow skipped it."""
        if self.optimizer is None or self.micro_steps == 0:
            return False
        if self._boundary_override is not None:
            last_was_boundary = self._boundary_override
        else:
            last_was_boundary = self.micro_steps % self.gradient_accumulation_steps() == 0
        return bool(last_was_boundary and getattr(self.optimizer, "last_step_applied", False))

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
        return _train_dtype(self._config)

    def zero_offload_optimizer(self) -> Any:
        """The `zero_optimization.offload_optimizer` block (None when not offloading)."""
        return self._config.zero_config.offload_optimizer

    def zero_offload_param(self) -> Any:
        """The `zero_optimization.offload_param` block (None when not offloading)."""
        return self._config.zero_config.offload_param

    # Upstream's config queries, answered from this engine's config.

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

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

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

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
        return self.zero_cpu_offload()

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

    def empty_partition_cache(self) -> None:
        """Free every gathered parameter nobody holds, persistent ones included (local, no collective).

        For after `generate` or evaluation. Persistent parameters are gathered again by the
        next forward that needs them; a live `GatheredParameters` keeps its parameters.
        """
        coordinator = getattr(self, "coordinator", None)
        if coordinator is not None and coordinator.pass_holds():
            raise RuntimeError(
                "engine.empty_partition_cache() was called during a forward or backward; call it between passes"
            )
        gather.release_unheld(
            [
                state
                for state in getattr(self, "zero_states", [])
                if state.status is ZeroParamStatus.AVAILABLE and not state.holds
            ]
        )

    def compile(
        self,
        backend: Optional[str] = None,
        compile_kwargs: Optional[dict] = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """`torch.compile` the module in place (`nn.Module.compile`), as upstream's engine does;
        accelerate calls it for a dynamo-enabled DeepSpeed run (HF Trainer's `torch_compile`).

        The config's `compile` block supplies the defaults: `backend` (else the accelerator's,
        `get_accelerator().get_compile_backend()`) and `kwargs`, under the `compile_kwargs`
        given here; with `compile.disable` true the module stays eager (a warning says so).
        A second call is a no-op. ZeRO-3's module hooks run eagerly between compiled regions
        (dynamo breaks its graph at them), so stage 3 gains less than stages 0-2, whose
        parameters need no hooks. Upstream's DeepCompile (`schedule`) and compiled autograd are
        not implemented: refused by name.
        """
        if schedule is not None:
            raise NotImplementedError(
                "engine.compile: schedule= (DeepCompile) is not implemented; call compile() without it"
            )
        if compiled_autograd_enabled:
            raise NotImplementedError(
                "engine.compile: compiled_autograd_enabled=True is not implemented; leave it False"
            )
        if self._is_compiled:
            return
        settings = self._config.compile_config
        if "backend" in (compile_kwargs or {}) or "backend" in settings.kwargs:
            raise ValueError(
                "engine.compile: pass the backend as compile(backend=...) or the config's "
                '"compile": {"backend": ...}, not inside compile_kwargs or compile.kwargs'
            )
        if settings.disable:
            logger.warning(
                'engine.compile(): the config sets "compile": {"disable": true}; the module stays eager'
            )
            return
        kwargs = {**settings.kwargs, **(compile_kwargs or {})}
        backend = backend or settings.backend or get_accelerator().get_compile_backend()
        if self.coordinator is not None:
            self.coordinator.exclude_from_compile()
        self.module.compile(backend=backend, **kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` compiled the module."""
        return self._is_compiled

    @contextlib.contextmanager
    def no_sync(self):
        """Upstream's context for accumulating gradients without communication (stages 0 and 1).

        Inside it, every backward leaves its gradients summed in `param.grad`, unreduced, even
        at an accumulation boundary; the first boundary backward or step outside it reduces the
        sum. ZeRO stages 2 and 3 partition gradients as they are computed, which needs the
        reduction: refused there. Re-entering it and `step()` inside it are refused too. The
        errors are `NoSyncError`, an AssertionError as upstream's, with upstream's wording.
        """
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise NoSyncError(
                f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
                f"{stage}; use it at stages 0 and 1, or accumulate with gradient_accumulation_steps"
            )
        if self._inside_no_sync:
            raise NoSyncError(
                "no_sync context manager reentry is unsupported: this engine is inside one already"
            )
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    # ================================================================== checkpoint interface
    # `deepspeed.checkpoint.interface.CheckpointEngine`: all that the checkpoint code reads or
    # changes of an engine. The public checkpoint methods come from `CheckpointMethods`.

    def checkpoint_module(self) -> nn.Module:
        return self.module

    def checkpoint_shard_of(self, param: nn.Parameter) -> Any:
        return self._shard_state_of(param)

    def checkpoint_optimizer(self) -> Optional[ZeroStage3Optimizer]:
        return self.optimizer

    def checkpoint_lr_scheduler(self) -> Any:
        return self.lr_scheduler

    def checkpoint_rank_and_world(self) -> tuple:
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(), dist.get_world_size()  # model parallelism is refused: dp is the world

    def checkpoint_record(self) -> dict:
        return {"zero_stage": self.zero_optimization_stage(), "dtype": self.dtype, "ds_config": self.config}

    def checkpoint_counters(self) -> dict:
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "micro_steps": self.micro_steps,
        }

    def restore_checkpoint_counters(self, global_steps: int, global_samples: int, skipped_steps: int) -> None:
        self.global_steps, self.global_samples = global_steps, global_samples
        if self.optimizer is not None:  # the engine's skipped_steps is the optimizer's count
            self.optimizer.skipped_steps = skipped_steps

    def restart_accumulation(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        self.micro_steps = 0

    def settle_before_save(self) -> None:
        self._settle_live_gathers()
        if self.optimizer is not None:
            # An edit written back since the last step is in the shard, not yet in a 16-bit
            # training's fp32 master, which is what the files (and zero_to_fp32) hold.
            self.optimizer.refresh_edited_masters()

    def refresh_after_load(self) -> None:
        self._refresh_full_params(after_load=True)

    def saves_16bit_weights(self) -> bool:
        return not self.partitions_weights or self.zero_gather_16bit_weights_on_model_save()

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `zero_optimization.stage3_gather_16bit_weights_on_model_save`."""
        return bool(self._config.zero_config.gather_16bit_weights_on_model_save)

    def loads_in_turns(self) -> bool:
        if not self._config.zero_config.pipeline_loading_checkpoint:
            return False
        if self.zero_optimization_stage() != 3:
            raise ValueError(
                "zero_optimization.pipeline_loading_checkpoint loads rank by rank at stage 3 only, as "
                f"upstream; this engine runs stage {self.zero_optimization_stage()}: remove the key"
            )
        return True

    def publishes_on_every_node(self) -> bool:
        return bool(self._config.use_node_local_storage)
