"""The ZeRO stage as one strategy object, chosen once from the typed config (`choose_strategy`).

[Note: two families of stages]
Stages 0, 1 and 2 keep every parameter whole on every rank (`ReplicatedParameters`, see
stage_1_and_2.py's note); they differ only in their knobs: whether gradients are
reduce-scattered during backward (stage 2) or accumulated whole and reduced once at the
boundary (0 and 1), and how that boundary reduction ends (stage 0 all-reduces, leaving the
average in `param.grad` as plain data parallelism does; stage 1 reduce-scatters into the
shards). Stage 3 partitions the parameters themselves (`ShardedParameters`): the module is
converted as `zero.Init` would, hooks gather and release around each submodule, and every
gathered tensor is refreshed when the shards change. The engine holds one of the two and
asks it, by name, for each thing that depends on the stage; it never tests the stage number.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero import edits, gather, hpz, param_swap, quantized
from deepspeed.runtime.zero.hooks import ParameterCoordinator, mark_persistent, persistent_states
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from deepspeed.runtime.zero.linear import route_linears
from deepspeed.runtime.zero.mics import check_mics_partitioning, mics_layout
from deepspeed.runtime.zero.parameter import is_zero_param
from deepspeed.runtime.zero.partition_parameters import Init, cast_partitioned, live_modifier_gathers
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import (
    DeepSpeedZeroOptimizer,
    allreduce_whole_grads,
    make_replicated_shards,
    reduce_accumulated_grads,
    set_aside_grad,
    unpartition,
)
from deepspeed.utils.logging import logger
from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules_by_granularity


class NoSyncError(AssertionError):
    """Misuse of `engine.no_sync()`. An AssertionError, as upstream raises, so that code and
    tests written against upstream catch it."""


class GradientPhase(enum.Enum):
    """Where stages 0-1's whole gradients stand between a backward and the step."""

    ACCUMULATING = "accumulating"  # backward adds to them; nothing is reduced yet
    # Stage 0: reduced; `param.grad` holds the average over ranks (see
    # stage_1_and_2.allreduce_whole_grads) until the next backward or zero_grad.
    AVERAGED = "averaged"


def cast_in_place(tensors: Iterable[torch.Tensor], dtype: torch.dtype) -> None:
    """Floating tensors to `dtype`, all to the device, in place: aliases follow."""
    device = torch.device(get_accelerator().current_device_name())
    for t in tensors:
        target = dtype if t.is_floating_point() else t.dtype
        if t.device != device or t.dtype != target:
            t.data = t.data.to(device=device, dtype=target)


class ZeroStrategy:
    """What the engine asks of its ZeRO stage. The base answers for a stage that gathers
    nothing (no coordinator, no live gathers); the two families override the rest."""

    partitions_weights: bool  # stage 3
    partitions_gradients: bool  # stages 2-3: each gradient is reduce-scattered during backward
    optimizer_class: type  # the one optimizer wrapper, under upstream's class name for the stage
    coordinator: Optional[ParameterCoordinator]  # stage 3's module hooks; None below
    zero_states: list  # stage 3: every ZeRO parameter's state, by ds_id; empty below
    persistent: list  # stage 3: the states that stay gathered; empty below
    replicated: dict  # stages 0-2: id(param) -> ReplicatedShard; empty at stage 3
    mics: Any  # a MicsLayout under MiCS, else None
    inside_no_sync: bool  # see no_sync()

    def __init__(self, config: Any) -> None:
        self.config = config
        self.stage = config.zero_optimization_stage
        self.partitions_gradients = self.stage >= 2
        self.coordinator = None
        self.zero_states = []
        self.persistent = []
        self.replicated = {}
        self.inside_no_sync = False
        self.mics = None  # stage 3 with mics_shard_size: the MiCS groups (zero/mics.py)

    # ------------------------------------------------------------------ set-up

    def refuse_model_parallelism(self, model: nn.Module, mp_size: int) -> None:
        """An `mpu` with model-parallel ranks works only where every collective stays inside a
        data-parallel group: stage 3 with the model built under `zero.Init(mpu=...)`, and no
        clipping or fp16 (their global norm and overflow check are not summed over the
        model-parallel ranks here). Elsewhere ranks holding different tensor-parallel shards
        would be averaged and gathered together: refused rather than trained wrong."""
        if mp_size <= 1:
            return
        why = self._model_parallel_obstacle(model, dist.get_world_size())
        if why is not None:
            raise ValueError(
                f"deepspeed.initialize: the mpu has model-parallel size {mp_size}, and {why}, which would mix "
                "different model-parallel shards. Model parallelism is supported only at stage 3 with the model "
                'built under deepspeed.zero.Init(mpu=mpu), with "gradient_clipping": 0 and without fp16; otherwise '
                "train without model parallelism"
            )

    def _model_parallel_obstacle(self, model: nn.Module, world: int) -> Optional[str]:
        raise NotImplementedError

    def prepare_module(self, module: nn.Module, dtype: torch.dtype, on_leaf_backward_done: Callable) -> None:
        """Bring `module` into the stage's layout, in the training dtype, on the device."""
        raise NotImplementedError

    def shard_state_of(self, param: nn.Parameter) -> Any:
        """The object holding `param`'s shard on this rank (a ZeroParamState or a
        ReplicatedShard); the optimizer and checkpoints read and write shards through it."""
        raise NotImplementedError

    def hook_gradient(self, param: nn.Parameter) -> list:
        """Hooks the stage needs on `param` before its gradient is accumulated (their handles)."""
        return []

    # ------------------------------------------------------------------ gradients

    def grad_ready(
        self, param: nn.Parameter, reducer: Any, leaf_grads: Any, in_backward: bool, is_boundary: Callable
    ) -> None:
        """Autograd accumulated `param.grad`: reduce it now, or keep it for the boundary."""
        if self.partitions_gradients:
            if in_backward and leaf_grads.waits(param):
                return  # reduced with the rest of its leaf module's gradients (leaf_grads.py)
            grad, param.grad = param.grad, None  # the full gradient lives only until it is packed
            reducer.add(self.shard_state_of(param), grad)

    def refuse_deferred_reduction(self, enable_backward_allreduce: bool) -> None:
        """`enable_backward_allreduce=False` defers the reduction to `allreduce_gradients()`,
        which only stages 0-1 can do: stages 2-3 reduce each gradient inside backward."""
        if not enable_backward_allreduce and self.partitions_gradients:
            raise RuntimeError(
                f"engine.enable_backward_allreduce=False leaves gradients unreduced for allreduce_gradients(), "
                f"but ZeRO stage {self.stage} reduce-scatters each gradient while backward "
                "runs; set it back to True, or use stage 0 or 1"
            )

    def backward_started(self) -> None:
        """engine.backward is about to run autograd."""

    def autograd_done(self) -> None:
        """engine.backward's autograd is over (also when it raised)."""

    def flush_leaf_units(self, leaf_grads: Any, reducer: Any) -> None:
        """The end of backward: leaf units still waiting go to the reducer (stages 2-3)."""
        if self.partitions_gradients:
            leaf_grads.flush(reducer)

    def reduce_at_boundary(
        self, optimizer: Any, reducer: Any, leaf_grads: Any, bucket_size: Optional[int]
    ) -> None:
        """At a boundary: reduce what backward left unreduced (stages 0-1; nothing above)."""

    def on_zero_grad(self) -> None:
        """zero_grad discarded every gradient."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Upstream's context for accumulating without communication: stages 0 and 1 only."""
        if self.partitions_gradients:
            raise NoSyncError(
                f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
                f"{self.stage}; use it at stages 0 and 1, or accumulate with gradient_accumulation_steps"
            )
        if self.inside_no_sync:
            raise NoSyncError(
                "no_sync context manager reentry is unsupported: this engine is inside one already"
            )
        self.inside_no_sync = True
        try:
            yield
        finally:
            self.inside_no_sync = False

    # ------------------------------------------------------------------ around a step, a save, a load

    def settle_live_gathers(self) -> None:
        """Before a step or a save (see `ShardedParameters`); nothing is gathered below stage 3."""

    def refresh_full_params(self, optimizer: Any, after_load: bool) -> None:
        """After the shards changed (a step, a load): every full tensor must show them."""
        raise NotImplementedError

    def saves_16bit_model(self) -> bool:
        """Whether `save_16bit_model()` writes the whole 16-bit weights."""
        return True

    def refuse_loading_in_turns(self) -> None:
        """`zero_optimization.pipeline_loading_checkpoint` (ranks of a node load one after
        another) is a stage-3 feature upstream; refused at the other stages."""
        if not self.partitions_weights:
            raise ValueError(
                "zero_optimization.pipeline_loading_checkpoint loads rank by rank at stage 3 only, as "
                f"upstream; this engine runs stage {self.stage}: remove the key"
            )

    # ------------------------------------------------------------------ module hooks

    def pass_holds(self) -> list:
        """Holds a forward or backward keeps now (none between passes, none below stage 3)."""
        return []

    def release_unheld(self) -> None:
        """`empty_partition_cache()`: free gathered parameters nobody holds."""

    def exclude_from_compile(self) -> None:
        """Keep torch.compile out of the stage's module hooks."""

    def remove_hooks(self) -> None:
        """`destroy()`: remove the stage's module hooks."""

    def refuse_forward_without_hooks(self) -> None:
        """A forward through an engine after its `destroy()`: raise where the stage needs module
        hooks to run one and none are on the module (another engine's would do)."""


class ReplicatedParameters(ZeroStrategy):
    """Stages 0, 1 and 2: whole parameters on every rank, this rank's slices for the optimizer."""

    partitions_weights = False
    optimizer_class = DeepSpeedZeroOptimizer

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # Stage 0 ends a boundary with an all-reduce into `param.grad` (plain data parallelism),
        # stage 1 with a reduce-scatter into the gradient shards.
        self.averages_whole_grads = self.stage == 0
        self.phase = GradientPhase.ACCUMULATING

    def _model_parallel_obstacle(self, model: nn.Module, world: int) -> Optional[str]:
        return f"stage {self.stage} shards and reduces over all {world} ranks"

    def prepare_module(self, module: nn.Module, dtype: torch.dtype, on_leaf_backward_done: Callable) -> None:
        whole = unpartition(module)  # built under zero.Init: stages 0-2 keep parameters whole
        if whole:
            logger.info(
                "zero_optimization.stage=%d keeps parameters whole: %d parameters partitioned by "
                "zero.Init (first: %s) were gathered back",
                self.stage,
                len(whole),
                whole[0],
            )
        cast_in_place(module.parameters(), dtype)
        cast_in_place(module.buffers(), dtype)
        if dist.get_world_size() > 1:
            # Ranks may have drawn different random initial values: rank 0's are the model, as
            # upstream broadcasts them at initialize (stage 3 does it when it partitions). Left
            # alone, trainable weights would start from every rank's own and frozen ones never agree.
            edits.broadcast_coalesced([p.data for p in module.parameters()], 0, None)
        self.replicated = make_replicated_shards(module)

    def shard_state_of(self, param: nn.Parameter) -> Any:
        return self.replicated.get(id(param))

    def grad_ready(
        self, param: nn.Parameter, reducer: Any, leaf_grads: Any, in_backward: bool, is_boundary: Callable
    ) -> None:
        if self.partitions_gradients:
            super().grad_ready(param, reducer, leaf_grads, in_backward, is_boundary)
        elif self.inside_no_sync or not is_boundary():
            # Stages 0-1: accumulate whole until the boundary, as DDP's no_sync, in fp32 (see
            # [Note: whole gradients accumulate in fp32] in stage_1_and_2.py). At the boundary
            # the gradient stays in param.grad: backward reduces them all once it is over.
            set_aside_grad(self.shard_state_of(param))

    def backward_started(self) -> None:
        self.phase = GradientPhase.ACCUMULATING  # stage 0: this backward adds to what was reduced

    def reduce_at_boundary(
        self, optimizer: Any, reducer: Any, leaf_grads: Any, bucket_size: Optional[int]
    ) -> None:
        if self.partitions_gradients:
            return  # reduced inside backward
        if self.phase is GradientPhase.AVERAGED:
            return  # stage 0: this boundary's gradients are reduced and wait in `param.grad`
        configured = reducer.bucket_elems
        if bucket_size is not None:
            reducer.bucket_elems = bucket_size
        try:
            if self.averages_whole_grads:
                allreduce_whole_grads(optimizer.states, reducer, leaf_grads.fill, optimizer.drop_grad_shard)
                self.phase = GradientPhase.AVERAGED  # until the next backward adds gradients
            else:
                reduce_accumulated_grads(optimizer.states, reducer, leaf_grads.fill)
        finally:
            reducer.bucket_elems = configured

    def on_zero_grad(self) -> None:
        self.phase = GradientPhase.ACCUMULATING

    def refresh_full_params(self, optimizer: Any, after_load: bool) -> None:
        """Gather every rank's updated slices back into the full parameters: after a step the
        trained ones, after a load all of them."""
        if after_load:
            changed = sorted(self.replicated.values(), key=lambda s: s.ds_id)
        else:
            changed = optimizer.states if optimizer is not None else []
        gather.gather_into_params(changed, self.config.zero_config.allgather_bucket_size)


class ShardedParameters(ZeroStrategy):
    """Stage 3: partitioned parameters, gathered around each submodule by the coordinator."""

    partitions_weights = True
    optimizer_class = DeepSpeedZeroOptimizer_Stage3

    def _model_parallel_obstacle(self, model: nn.Module, world: int) -> Optional[str]:
        spans_world = [
            n
            for n, p in model.named_parameters()
            if not is_zero_param(p) or p._zero_state.world_size == world
        ]
        config = self.config
        if spans_world:
            return f"parameters such as {spans_world[0]!r} are partitioned over all {world} ranks"
        if config.gradient_clipping > 0 or config.fp16_enabled:
            return (
                f"gradient_clipping={config.gradient_clipping} (1.0 when the config omits it, as upstream's) and "
                "fp16's overflow check use a norm not summed over the model-parallel ranks"
            )
        return None

    def prepare_module(self, module: nn.Module, dtype: torch.dtype, on_leaf_backward_done: Callable) -> None:
        zero = self.config.zero_config
        self.mics = mics_layout(self.config)  # [Note: MiCS] in zero/mics.py
        if any(not is_zero_param(p) for p in module.parameters()):
            # A model not built under zero.Init: partition it now, in the training dtype.
            Init(module=module, dtype=dtype, config_dict_or_path=self.config)
        check_mics_partitioning(module, self.mics)
        cast_partitioned(module, dtype)  # parts built under an Init of another dtype
        swappers = param_swap.swappers_of(gather.zero_states(module.parameters()))
        if swappers:  # the same model on every rank: all of them check, or none
            param_swap.check_setup(swappers)  # a full disk on one rank raises on all
        cast_in_place(module.buffers(), dtype)
        route_linears(module)  # [Note: what autograd keeps of a gathered weight] in zero/linear.py
        _mark_fine_grained_leaves(module, zero.module_granularity_threshold)
        self.coordinator = ParameterCoordinator(
            module,
            zero.prefetch_bucket_size,
            zero.max_live_parameters,
            zero.max_reuse_distance,
            on_leaf_backward_done=on_leaf_backward_done,
        )
        self.zero_states = gather.zero_states(module.parameters())
        hpz.attach(self.zero_states, hpz.hpz_layout(self.config))  # [Note: hpZ, the secondary shard]
        self.persistent = persistent_states(
            module, zero.param_persistence_threshold, zero.model_persistence_threshold
        )
        mark_persistent(self.persistent)
        quantized.attach(self.zero_states, self.config)  # [Note: block-wise int8] in zero/quantized.py

    def shard_state_of(self, param: nn.Parameter) -> Any:
        return param._zero_state if is_zero_param(param) else None

    def hook_gradient(self, param: nn.Parameter) -> list:
        # [Note: a gradient needs its parameter whole] in hooks.py
        return [
            _FullShapeAccumulator(param),
            param.register_hook(functools.partial(self.coordinator.gather_for_gradient, param)),
        ]

    def grad_ready(
        self, param: nn.Parameter, reducer: Any, leaf_grads: Any, in_backward: bool, is_boundary: Callable
    ) -> None:
        self.coordinator.release_after_gradient(param)
        super().grad_ready(param, reducer, leaf_grads, in_backward, is_boundary)

    def autograd_done(self) -> None:
        self.coordinator.finish_backward()

    def settle_live_gathers(self) -> None:
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
        # Complete every all-gather still in flight (a `start(async_op=True)` not yet waited
        # on): it reads the shards the step is about to change, and only what is gathered when
        # the step ends is refreshed, so it would otherwise show the old values for good.
        gather.wait_available(self.zero_states)
        if self.config.zero_config.enable_sanity_checks:
            orphans = [
                s.ds_id
                for s in self.zero_states
                if s.status is not ZeroParamStatus.NOT_AVAILABLE and not s.holds and not s.persist
            ]
            if orphans:
                raise RuntimeError(
                    f"[rank {dist.get_rank()}] parameters ds_id={orphans} are gathered with no holder"
                )
        for owner in live_modifier_gathers(self.zero_states):
            owner.write_back_edits()

    def refresh_full_params(self, optimizer: Any, after_load: bool) -> None:
        """Re-gather whatever stays gathered (persistent parameters, a live GatheredParameters),
        so no gathered tensor keeps old values; hpZ's secondary slices are dropped."""
        hpz.drop_secondaries(self.zero_states)
        gather.refresh_gathered(self.zero_states)
        gather.drop_pooled_buffers()  # between steps a rank keeps only what ZeRO-3 promises

    def saves_16bit_model(self) -> bool:
        return bool(self.config.zero_config.gather_16bit_weights_on_model_save)

    def pass_holds(self) -> list:
        return self.coordinator.pass_holds()

    def release_unheld(self) -> None:
        gather.release_unheld(
            [s for s in self.zero_states if s.status is ZeroParamStatus.AVAILABLE and not s.holds]
        )

    def exclude_from_compile(self) -> None:
        self.coordinator.exclude_from_compile()

    def remove_hooks(self) -> None:
        self.coordinator.remove_hooks()

    def refuse_forward_without_hooks(self) -> None:
        current = self.coordinator.module.__dict__.get("_ds_coordinator")  # a later engine's, maybe
        if current is None or not current.forward_hooks:
            raise RuntimeError(
                "forward() on an engine after its destroy() (accelerate's free_memory() calls it, as "
                "Trainer.train() does at its start): its ZeRO-3 hooks are gone, so the partitioned "
                "parameters cannot be gathered; build a new engine with deepspeed.initialize"
            )


class _FullShapeAccumulator:
    """Keeps `param`'s gradient accumulator (autograd's AccumulateGrad node) alive, made while
    `param.data` had the full shape; `remove()` lets it go.

    Autograd checks each gradient a function returns against the shape its target had when
    the target's accumulator was made, and makes the accumulator at the parameter's first use
    in a graph. A custom autograd function handed a partitioned weight, which gathers it
    itself in forward and backward (TRL's distillation loss passes `lm_head.weight` to one),
    would fix that shape at [0], and its full gradient would be refused before any hook could
    gather ("returned an invalid gradient ... expected shape compatible with [0]"). Upstream
    keeps an accumulator made while the parameter is gathered, for the same reason. Made
    here with a full-shaped data that holds one element (a 0-dim tensor expanded), so no
    gather is needed; a change of dtype or device would make autograd drop it (`set_data`).
    """

    def __init__(self, param: nn.Parameter) -> None:
        shape = param._zero_state.shape
        with torch._C.DisableTorchFunctionSubclass(), torch.enable_grad():
            data = param.data
            if data.shape != shape:
                param.data = torch.empty((), dtype=data.dtype, device=data.device).expand(shape)
            try:
                self.node = param.view_as(param).grad_fn.next_functions[0][0]
            finally:
                param.data = data

    def remove(self) -> None:
        self.node = None


def choose_strategy(config: Any) -> ZeroStrategy:
    """The strategy for `config.zero_optimization_stage`: the one place the stage is tested."""
    quantized.check_config(config)  # qwZ / qgZ are stage 3's
    if config.zero_optimization_stage == 3:
        return ShardedParameters(config)
    return ReplicatedParameters(config)


def _mark_fine_grained_leaves(module: nn.Module, threshold: int) -> None:
    """`stage3_module_granularity_threshold`: fine-grained modules become leaf modules."""
    if threshold <= 0:
        return
    marked, finest = set_z3_leaf_modules_by_granularity(module, threshold)
    if dist.get_rank() != 0:
        return
    if marked:
        names = {id(m): n for n, m in module.named_modules()}
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
