"""`DeepSpeedEngine`: a thin facade over the ZeRO pieces in `deepspeed/runtime/zero/`.

What depends on the ZeRO stage is asked of one strategy object, chosen once from the config
(`zero/stage.py`): at stage 3 it converts the model (if it was not built under `zero.Init`)
and installs the hooks that gather parameters around each submodule; at stages 0-2
parameters stay whole and only this rank's slices are kept for the optimizer
(`stage_1_and_2.py`). Every stage routes gradients into the `GradientReducer` (during
backward at stages 2-3, once per step at 0-1) and steps the same `ZeroStage3Optimizer` over
fp32 master slices, then the LR scheduler, on gradient-accumulation boundaries. Stage 0 runs
as stage 1: the same results as plain data parallelism, with the optimizer state sharded.
Upstream's config queries and small controls live in `engine_queries.py`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.engine_methods import CheckpointMethods
from deepspeed.monitor.engine_events import EngineEvents
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.profiling.flops_profiler.engine_hooks import (
    engine_profiler,
    profile_forward_begins,
    profile_step_ends,
)
from deepspeed.runtime.agreement import check_agreement, describe_config, describe_parameters
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine_queries import EngineQueries, train_dtype
from deepspeed.runtime.forward_prologue import forward_prologue, report_progress
from deepspeed.runtime.host_malloc import keep_freed_memory_for_reuse
from deepspeed.runtime.sequence_parallel.setup import configure_sequence_parallel
from deepspeed.runtime.torch_autocast import autocast_if_enabled, get_comm_dtype, init_autocast_params
from deepspeed.runtime.torch_backward import TorchStyleBackward, engine_backward_running
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.runtime.zero import quantized
from deepspeed.runtime.zero.grad_reducer import GradientReducer
from deepspeed.runtime.zero.leaf_grads import LeafGradients
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.offload_states import StateOffloader
from deepspeed.runtime.zero.optimizer import ZeroStage3Optimizer
from deepspeed.runtime.zero.parameter import is_zero_param
from deepspeed.runtime.zero.stage import NoSyncError, choose_strategy
from deepspeed.utils.logging import logger, set_log_level_from_string
from deepspeed.utils.timer import EngineTimers, SynchronizedWallClockTimer, ThroughputTimer
from deepspeed.utils.z3_leaf_module import apply_leaf_module_config

__all__ = ["DeepSpeedEngine", "NoSyncError"]


class DeepSpeedEngine(CheckpointMethods, EngineQueries, nn.Module):
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
        if self._config.log_level is not None:  # upstream's config key: the package logger's level
            set_log_level_from_string(self._config.log_level)
        dist.configure(self._config)  # the communication logger: its comms_logger section, if any
        # The step's all-gather / reduce-scatter ms, for the monitors; withdrawn at destroy().
        self._times_collectives = bool(self._config.wall_clock_breakdown)
        self._destroyed = False  # destroy() ran: a forward may no longer be able to gather
        if self._times_collectives:
            dist.count_totals(True)
        if get_accelerator().device_name() == "cpu":
            keep_freed_memory_for_reuse()  # see host_malloc.py's note
        self._check_ranks_agree(model)
        self.mpu = mpu
        # Ulysses: ZeRO still spans every rank (runtime/sequence_parallel/setup.py)
        self.sequence_parallel_size = configure_sequence_parallel(
            self._config.typed_config.sequence_parallel_size, mpu
        )
        self.zero = choose_strategy(self._config)  # the one object that knows the ZeRO stage (zero/stage.py)
        self.zero.refuse_model_parallelism(model, self.mp_world_size)
        self._configure_activation_checkpointing(mpu)
        self.args = args
        self.module = model
        self.dtype = train_dtype(self._config)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._boundary_override: Optional[bool] = None
        self._inside_backward = False  # engine.backward is running autograd
        self._stray_grads: list = []  # params whose gradients came from a backward outside it
        self._torch_backward = TorchStyleBackward(self)  # loss.backward() on the forward's outputs
        self._offloader = StateOffloader(self)  # what offload_states() moved off the accelerator
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
        # Upstream's attribute: the config's TensorBoard / wandb / CSV / Comet monitors (written
        # on global rank 0); the engine's own events go through `monitor_events`.
        self.monitor = MonitorMaster(self._config.monitor_config)
        self.monitor_events = EngineEvents(self.monitor)
        self._is_compiled = False  # see compile()
        # Every stage: leaves also shape gradient reduction.
        apply_leaf_module_config(model, self._config.zero_config.leaf_module)
        self.zero.prepare_module(model, self.dtype, self._on_leaf_backward_done)
        self._warn_unused_config_blocks(optimizer, lr_scheduler)
        self.client_optimizer = optimizer  # what the caller passed (upstream's attributes)
        self.client_lr_scheduler = lr_scheduler
        # [Note: a leaf's gradients are one unit] in leaf_grads.py
        self.leaf_grads = LeafGradients(
            model, self.zero.shard_state_of, lambda state: state.ds_id in self.optimizer.masters
        )
        self.optimizer = self._build_optimizer(optimizer, model_parameters)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.training_dataloader = self._build_dataloader(training_data, collate_fn)
        self._grad_hooks = self._install_grad_hooks() if self.optimizer is not None else []
        if self._config.torch_autocast_enabled:  # [Note: torch_autocast] in torch_autocast.py
            self._init_torch_autocast()
        self.flops_profiler = engine_profiler(self)  # None unless the config's flops_profiler is enabled

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
        shape_of = lambda p: p.ds_shape if is_zero_param(p) else p.shape  # noqa: E731
        check_agreement(
            "deepspeed.initialize: the config and the model's parameters",
            [describe_config(self._config._param_dict)]
            + describe_parameters(list(model.named_parameters()), shape_of),
            fix="Every rank must pass the same config (nvme_path aside) and build the same model, "
            "parameters in the same order.",
        )

    def _settle_live_gathers(self) -> None:
        """Before a step or a save: gathered parameters settle (see the strategy's)."""
        self.zero.settle_live_gathers()

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
        on_cpu = offload is not None and offload.device in ("cpu", "nvme")  # nvme: steps on the CPU too
        placement = {
            "master_device": torch.device("cpu") if on_cpu else None,
            # Pinning means nothing where the accelerator is the CPU itself.
            "pin_masters": on_cpu and offload.pin_memory and get_accelerator().device_name() != "cpu",
            "swap": offload if on_cpu and offload.device == "nvme" else None,
        }
        # One wrapper for every stage, under upstream's class name for the stage.
        return self.zero.optimizer_class(
            self.module,
            self._config,
            client,
            model_parameters,
            state_of=self.zero.shard_state_of,
            **placement,
            before_step=self._settle_live_gathers,
            after_step=self._refresh_full_params,
            before_zero_grad=self._discard_unreduced_grads,
            leaf_grads=self.leaf_grads,
            parameter_offload=self.zero.coordinator,
            replica_group=None if self.zero.mics is None else self.zero.mics.replica_group,
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

    def _install_grad_hooks(self) -> list:
        mics = self.zero.mics  # MiCS: gradients are averaged over the replicas too (zero/mics.py)
        self.reducer = GradientReducer.from_config(
            self._config,
            self.optimizer.accumulate_grad,
            self.optimizer.settle_gradients,
            replica_group=None if mics is None else mics.replica_group,
        )
        if self.optimizer.states:  # qgZ across nodes: within the node first ([Note: block-wise int8])
            self.reducer.two_hop = quantized.two_hop_reduce(self._config, self.optimizer.states[0].group)
        handles = []
        for state in self.optimizer.states:
            handles += self.zero.hook_gradient(state.param)
            handles.append(state.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        # loss.backward() works too: [Note: torch-style backward] in torch_backward.py.
        handles += self._torch_backward.hook([state.param for state in self.optimizer.states])
        untrained = self.optimizer.untrained(self.module)
        if untrained and dist.get_rank() == 0:
            # [Note: whose param groups train] in optimizer.py: their gradients are dropped.
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

    def _init_torch_autocast(self) -> None:
        """Mark the safe modules' parameters; gradients are then reduced in each one's comm dtype."""
        section = self._config.torch_autocast
        init_autocast_params(self, section.torch_dtype, section.lower_precision_safe_modules)
        if self.optimizer is not None:
            self.reducer.comm_dtypes = {
                state.ds_id: get_comm_dtype(state.param) for state in self.optimizer.states
            }

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._inside_backward and len(self._stray_grads) < 3:
            self._stray_grads.append(param)  # refused at the next backward or step, see _refuse_stray_grads
        self.zero.grad_ready(
            param,
            self.reducer,
            self.leaf_grads,
            self._inside_backward,
            self.is_gradient_accumulation_boundary,
        )

    def _on_leaf_backward_done(self, module: nn.Module) -> None:
        if self._inside_backward:
            self.leaf_grads.leaf_backward_done(module, self.reducer)

    @staticmethod
    def _drop_grad(param: nn.Parameter) -> None:
        param.grad = None  # a trainable parameter no optimizer group holds (warned at initialize)

    # ------------------------------------------------------------------ training

    def forward(self, *args, **kwargs):
        if self._destroyed:
            self.zero.refuse_forward_without_hooks()
        self._torch_backward.close_abandoned()
        self._offloader.refuse_while_offloaded("forward()", [OffloadStateTypeEnum.lp_params])
        args, kwargs = forward_prologue(self, args, kwargs)  # fp16.auto_cast
        # The module's own hooks gather, release and mark where a pass starts and ends, so a
        # direct call of the module (generate, an eval loop) behaves the same (see hooks.py).
        self._memory_report("Engine before forward")
        profiling = profile_forward_begins(self)  # flops_profiler: rank 0, at its profile_step
        self._start_timers("forward")
        try:
            with autocast_if_enabled(self):
                return self.module(*args, **kwargs)
        finally:
            self._stop_timers("forward")
            if profiling:
                self.flops_profiler.stop_profile()
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
        self._torch_backward.close_abandoned()
        if self._torch_backward.is_scaled(loss):
            raise ValueError(
                "engine.backward(loss) scales the loss itself; pass the loss, not engine.scale(loss) (which is "
                "for a .backward() of your own)"
            )
        self._torch_backward.forget_scale()
        self._backward_prologue("engine.backward()")
        scaled = loss.float() * self.optimizer.loss_scale
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        try:
            with engine_backward_running():
                scaled.backward(retain_graph=retain_graph)
        except BaseException:
            self._autograd_over(abandoned=True)
            raise
        self._autograd_over()
        self._backward_epilogue()
        self.monitor_events.after_backward(
            loss, self.is_gradient_accumulation_boundary(), self.global_samples
        )
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            # As upstream: the loss as it was scaled for the backward (its share of the boundary's step).
            return loss.detach() / self.gradient_accumulation_steps()
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale, for a `.backward()` of the caller's own (fp16 needs it;
        bf16 and fp32 get `loss` back). See [Note: torch-style backward] in torch_backward.py."""
        if self.optimizer is None:
            raise RuntimeError(
                "engine.scale() needs an optimizer; pass one to deepspeed.initialize or the config"
            )
        return self._torch_backward.scale(loss)

    def _backward_prologue(self, where: str) -> None:
        """Before autograd runs for `engine.backward` or a `loss.backward()` on the outputs."""
        self._refuse_stray_grads(where)
        self._offloader.refuse_while_offloaded("backward()")
        self.zero.refuse_deferred_reduction(self.enable_backward_allreduce)
        self._memory_report("Engine before backward")
        self._start_timers("backward")
        self.zero.backward_started()
        self.leaf_grads.refresh()
        self._inside_backward = True
        self._start_timers("backward_inner")  # autograd, with the reductions inside it (stages 2-3)

    def _autograd_over(self, abandoned: bool = False) -> None:
        """Autograd's run is over, or raised (`abandoned`: no epilogue follows)."""
        self._stop_timers("backward_inner")
        self._inside_backward = False
        self.zero.autograd_done()
        if abandoned:
            self._stop_timers("backward")

    def _backward_epilogue(self) -> None:
        """After autograd: reduce what is left (the last buckets; stages 0-1 at the boundary)."""
        self._start_timers("backward_reduce")  # what is left to reduce once autograd is done
        try:
            self.zero.flush_leaf_units(self.leaf_grads, self.reducer)
            self.reducer.flush()
            if self.enable_backward_allreduce and not self.zero.inside_no_sync:
                self.allreduce_gradients()
        finally:
            self._stop_timers("backward_reduce")
            self._stop_timers("backward")
        self._memory_report("Engine after backward")

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
        if self.is_gradient_accumulation_boundary():
            self.zero.reduce_at_boundary(self.optimizer, self.reducer, self.leaf_grads, bucket_size)

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
            "gradients in engine.backward, so call engine.backward(loss) instead. If another model's backward "
            "reached these parameters (a GAN's generator loss through its discriminator), freeze them for that "
            "backward (requires_grad_(False)), detach this engine's outputs there, or discard those gradients "
            "with engine.zero_grad() before this engine's backward (the engine's own: under accelerate, "
            "optimizer.zero_grad() leaves gradients to the engine and does nothing)"
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
        self.zero.on_zero_grad()

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
        if self.zero.inside_no_sync:
            raise NoSyncError(
                "It is illegal to call Engine.step() inside no_sync context manager: its gradients are "
                "not reduced yet; leave the `with engine.no_sync():` block first (the step then reduces them)"
            )
        self._torch_backward.close_abandoned()
        self._torch_backward.forget_scale()
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
        profile_step_ends(self, boundary)  # before _log_timers() resets the timers it reads
        self.tput_timer.stop(global_step=boundary)
        self.monitor_events.after_step(self, boundary)  # before _log_timers resets the step's timers
        self._log_timers()
        self.micro_steps += 1
        self._memory_report("Engine after step")

    def _refresh_full_params(self, after_load: bool = False) -> None:
        """After the shards changed (a step, a load): every full tensor must show them."""
        self.zero.refresh_full_params(self.optimizer, after_load)

    def _shard_state_of(self, param: nn.Parameter) -> Any:
        """The object holding `param`'s shard on this rank; checkpoints read and write shards through it."""
        return self.zero.shard_state_of(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient so far (see `ZeroStage3Optimizer.zero_grad`)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)

    def offload_states(
        self,
        include: Optional[Any] = None,
        device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the named states (all if `include` is None) to host memory, freeing their
        accelerator storage; `reload_states()` puts them back. See zero/offload_states.py."""
        if self.zero.pass_holds():
            raise RuntimeError(
                "engine.offload_states() was called inside a forward or backward; call it after step()"
            )
        self._offloader.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back, bit for bit, every state `offload_states()` moved."""
        self._offloader.reload(non_blocking)

    def destroy(self) -> None:
        """Remove every hook the engine installed and close its monitors (their files flushed,
        a wandb run finished); parameters stay partitioned."""
        self._destroyed = True
        self.zero.remove_hooks()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        self.monitor.close()
        if self._times_collectives:  # once, however often destroy() is called
            self._times_collectives = False
            dist.count_totals(False)

    # ================================================================== upstream API surface
    # Small controls clients call on an engine (HF transformers, accelerate, Lightning,
    # upstream's tests); its queries are `EngineQueries`'s (engine_queries.py).

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

    def was_step_applied(self) -> bool:
        """Whether the latest `step()` updated the parameters: False off an accumulation
        boundary (no optimizer step ran) and when inf/nan gradients skipped it."""
        if self.optimizer is None or self.micro_steps == 0:
            return False
        if self._boundary_override is not None:
            last_was_boundary = self._boundary_override
        else:
            last_was_boundary = self.micro_steps % self.gradient_accumulation_steps() == 0
        return bool(last_was_boundary and getattr(self.optimizer, "last_step_applied", False))

    def empty_partition_cache(self) -> None:
        """Free every gathered parameter nobody holds, persistent ones included (local, no collective).

        For after `generate` or evaluation. Persistent parameters are gathered again by the
        next forward that needs them; a live `GatheredParameters` keeps its parameters.
        """
        if self.zero.pass_holds():
            raise RuntimeError(
                "engine.empty_partition_cache() was called during a forward or backward; call it between passes"
            )
        self.zero.release_unheld()

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
        self.zero.exclude_from_compile()
        self.module.compile(backend=backend, **kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` compiled the module."""
        return self._is_compiled

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Upstream's context for accumulating gradients without communication (stages 0 and 1).

        Inside it, every backward leaves its gradients summed in `param.grad`, unreduced, even
        at an accumulation boundary; the first boundary backward or step outside it reduces the
        sum. ZeRO stages 2 and 3 partition gradients as they are computed, which needs the
        reduction: refused there. Re-entering it and `step()` inside it are refused too. The
        errors are `NoSyncError`, an AssertionError as upstream's, with upstream's wording.
        """
        return self.zero.no_sync()

    # ================================================================== checkpoint interface
    # `deepspeed.checkpoint.interface.CheckpointEngine`: all that the checkpoint code reads or
    # changes of an engine (`checkpoint_record`, a query of the config, is in EngineQueries). The
    # public checkpoint methods come from `CheckpointMethods`.

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
        mics = self.zero.mics  # MiCS: the shards are cut over the shard group ([Note: MiCS])
        if mics is not None:
            return mics.shard_ranks.index(dist.get_rank()), mics.shard_size
        return dist.get_rank(), dist.get_world_size()  # model parallelism is refused: dp is the world

    def checkpoint_writes_files(self) -> bool:
        return self.zero.mics is None or self.zero.mics.replica_index == 0

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
        return self.zero.saves_16bit_model()

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `zero_optimization.stage3_gather_16bit_weights_on_model_save`."""
        return bool(self._config.zero_config.gather_16bit_weights_on_model_save)

    def loads_in_turns(self) -> bool:
        if not self._config.zero_config.pipeline_loading_checkpoint:
            return False
        self.zero.refuse_loading_in_turns()
        return True

    def publishes_on_every_node(self) -> bool:
        return bool(self._config.use_node_local_storage)

    def checkpoint_tag_validation(self) -> str:
        return self._config.checkpoint_tag_validation
