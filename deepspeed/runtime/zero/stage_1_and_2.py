"""ZeRO stages 1 and 2: full parameters on every rank, optimizer state (1) and gradients (2) sharded.

[Note: the replicated layout]
Stages 1 and 2 keep every parameter whole on every rank, so forward and backward run as in
DDP, with no gather and no hooks. What is sharded is the optimizer's side. Each trainable
parameter is cut by the same shard math as stage 3 (lifecycle.py's note), and this rank owns
slice `rank` of every parameter: the `shard` of a `ReplicatedShard`, which is that slice of
the parameter itself where the parameter splits evenly over the ranks (else a copy, see
`make_replicated_shards`). The fp32 masters and the optimizer state exist only
for those slices (Adam in fp32: 8/N bytes per parameter for its moments, the master being
the slice itself; 4/N more for a copied slice), and the stage-3 optimizer
steps them unchanged, since a `ReplicatedShard` answers the same questions as a stage-3
`ZeroParamState` (shard, sizes, group). Only two things differ between the stages:
- when gradients are reduced: stage 2 reduce-scatters each gradient in buckets as soon as
  autograd has produced it (the stage-3 `GradientReducer`), so a rank keeps only its
  gradient slices; stage 1 (and 0) lets gradients accumulate whole in `param.grad`, as
  DDP's `no_sync` does, and reduce-scatters them once per optimizer step, at the boundary;
- who holds full parameters: after a step, every rank's updated slices are all-gathered
  back into the parameters in place, one collective per `allgather_bucket_size` elements
  (`gather.gather_into_params`, which also refreshes what stays gathered at stage 3).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus, shard_sizes
from deepspeed.runtime.zero.optimizer import ZeroStage3Optimizer


class ReplicatedShard:
    """This rank's slice of one full (replicated) parameter, for stages 1 and 2."""

    param: nn.Parameter  # full, on every rank
    ds_id: int  # the parameter's index in `module.parameters()`: equal on every rank
    shape: torch.Size
    numel: int
    group: Any  # the data-parallel group (None: the world)
    world_size: int
    rank: int
    partition_size: int  # elements per rank, padding included
    padding: int
    # 1D [partition_size], the parameter's dtype: the parameter's own slice where it splits
    # evenly, else a view into a flat buffer (see make_replicated_shards)
    shard: torch.Tensor
    shard_base: torch.Tensor  # that flat buffer (`shard` itself for an own slice)
    shard_offset: int  # where `shard` starts in it: adjacent shards gather from one view
    shard_version: int  # stage-3 compatibility: edits never land in a replicated shard
    # Stages 0-1 between micro-steps: the fp32 sum of a bf16/fp16 parameter's earlier gradients
    # (see [Note: whole gradients accumulate in fp32]); None when there is none.
    accumulated: Optional[torch.Tensor] = None
    # A replicated parameter is always whole, so code written for stage-3 states (refreshing
    # whatever is gathered after its shard changed) treats it as gathered.
    status = ZeroParamStatus.AVAILABLE
    stored = None  # stage-3 compatibility: never kept compressed (zero/quantized.py)
    swapper = None  # stage 3's NVMe partitions only (param_swap.py)

    def __init__(
        self, param: nn.Parameter, ds_id: int, group: Any, shard_out: torch.Tensor, base: torch.Tensor
    ) -> None:
        self.param = param
        self.ds_id = ds_id
        self.shape = param.shape
        self.numel = param.numel()
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.partition_size, self.padding = shard_sizes(self.numel, self.world_size)
        self.shard = shard_out
        self.shard_base = base
        self.shard_offset = shard_out.storage_offset() - base.storage_offset()
        self.shard_version = 0
        self.copy_from_param()

    @property
    def shard_dtype(self) -> torch.dtype:
        return self.shard.dtype

    def assign_shard(self, values: torch.Tensor) -> None:
        """Set the whole shard (`[partition_size]`) in place (stage 3's writer interface)."""
        self.shard.copy_(values)

    def own_slice_bounds(self) -> tuple:
        """`[start, end)` of this rank's real (non-padding) elements in the flat parameter."""
        start = self.rank * self.partition_size
        return min(start, self.numel), min(start + self.partition_size, self.numel)

    def in_param(self) -> bool:
        """Whether `shard` is the parameter's own slice (see `make_replicated_shards`)."""
        start = self.rank * self.partition_size
        data = self.param.data
        return (
            self.padding == 0
            and data.dtype == self.shard.dtype
            and data.is_contiguous()
            and self.shard.data_ptr() == data.data_ptr() + start * data.element_size()
        )

    @torch.no_grad()
    def copy_from_param(self) -> None:
        start, end = self.own_slice_bounds()
        if end > start and not self.in_param():
            self.shard[: end - start].copy_(self.param.data.reshape(-1)[start:end])


def make_replicated_shards(module: nn.Module, group: Any = None) -> dict:
    """`id(param) -> ReplicatedShard` for every parameter of `module` (see the note).

    A parameter whose elements split evenly over the ranks keeps its slice where it is: the
    shard is row `rank` of the parameter seen as `[world, partition_size]`, so an fp32 master
    (which is the shard) steps inside the parameter, and the all-gather after a step writes
    only the other ranks' rows. The others get a copy in one flat buffer per dtype and
    device, in parameter order: a padded parameter (its last rank's slice runs past its end),
    and one whose storage another parameter shares (two masters in one memory would each
    apply their own update to it).

    Frozen parameters get one too, so a checkpoint stores every parameter the same way at
    every stage; only trainable ones get an fp32 master.
    """
    params = list(enumerate(module.parameters()))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    storages: dict = {}
    for _, p in params:
        key = (p.device, p.untyped_storage().data_ptr())
        storages[key] = storages.get(key, 0) + 1
    padded: dict = {}
    shards: dict = {}
    for index, p in params:
        size, padding = shard_sizes(p.numel(), world)
        shared = storages[(p.device, p.untyped_storage().data_ptr())] > 1
        if padding == 0 and p.data.is_contiguous() and not shared:
            row = p.data.view(world, size)[rank]
            shards[id(p)] = ReplicatedShard(p, index, group, row, row)
        else:
            padded.setdefault((p.dtype, p.device), []).append((index, p))
    for (dtype, device), members in padded.items():
        sizes = [shard_sizes(p.numel(), world)[0] for _, p in members]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        for (index, p), view in zip(members, torch.split(flat, sizes)):
            shards[id(p)] = ReplicatedShard(p, index, group, view, flat)
    return shards


# [Note: whole gradients accumulate in fp32]
# At stages 0-1 a micro-step that is not reduced (before the accumulation boundary, or inside
# no_sync) leaves its whole gradient behind. autograd would sum those in `param.grad`, in the
# parameter's dtype: for bf16 that rounds every sum to 8 bits of mantissa, so the boundary's
# gradient drifted by 0.5% of its largest element over 8 micro-steps (measured), where
# stages 2-3 sum reduced shards in fp32. So a low-precision `param.grad` is folded into an
# fp32 sum after each such micro-step (`set_aside_grad`), and the reduction after the
# boundary's backward takes the sum plus that backward's gradient (`take_whole_grad`), in
# fp32 unless `communication_data_type` says otherwise. The extra memory, 4 bytes per
# parameter, lives only between micro-steps (upstream's grad_accum_dtype fp32 optimizer keeps
# as much); fp32 parameters keep using `param.grad`.


def set_aside_grad(state: ReplicatedShard) -> None:
    """A micro-step that is not reduced: fold a low-precision `param.grad` into the fp32 sum."""
    grad = state.param.grad
    if grad is None or grad.dtype == torch.float32:
        return
    if state.accumulated is None:
        state.accumulated = grad.to(torch.float32)
    else:
        state.accumulated.add_(grad)
    state.param.grad = None


def whole_grad(state: ReplicatedShard) -> Optional[torch.Tensor]:
    """This rank's gradient so far (the fp32 sum and `param.grad`), leaving both in place."""
    grad, summed = state.param.grad, state.accumulated
    if summed is None or grad is None:
        return grad if summed is None else summed
    return summed + grad


def take_whole_grad(state: ReplicatedShard) -> Optional[torch.Tensor]:
    """`whole_grad(state)`, which its holders give up: the caller reduces it."""
    grad, summed = state.param.grad, state.accumulated
    state.param.grad, state.accumulated = None, None
    if summed is None or grad is None:
        return grad if summed is None else summed
    return summed.add_(grad)


def reduce_accumulated_grads(states: list, reducer: Any, fill: Callable) -> None:
    """Stage 1 (and 0), at a step: reduce-scatter each accumulated gradient, then free it.

    `fill(state, grad)` gives what to reduce: the gradient, or a zero gradient for a leaf
    module's parameter this rank did not use (see leaf_grads.py), or None to skip.
    """
    for state in states:
        grad = fill(state, take_whole_grad(state))
        if grad is not None:
            reducer.add(state, grad)
    reducer.flush()


def allreduce_whole_grads(states: list, reducer: Any, fill: Callable, drop_shard: Callable) -> None:
    """Stage 0, at a step: average each whole gradient over the ranks into `param.grad`, as
    upstream's engine without ZeRO leaves it after backward (code that reads `p.grad` between
    backward and step, a per-layer norm logged before the step, sees the average), and make
    this rank's slice of it the optimizer's fp32 gradient shard.

    A second backward before the step adds its gradients to that average in `param.grad`;
    reducing again averages the sum, which leaves the first part as it was (it is the same on
    every rank), so each reduction replaces the shard (`drop_shard(state)` first) instead of
    adding to it. One all-reduce per (group, dtype) bucket of `reducer.bucket_elems` elements,
    scaled around the sum as the reducer scales its reduce-scatters; `fill` as in
    `reduce_accumulated_grads`. An fp32 gradient's shard is a view of its averaged
    `param.grad`, so clipping during the step scales both, as upstream's stage 0 clips
    `param.grad` in place.
    """
    buckets: dict = {}
    for state in states:
        grad = fill(state, take_whole_grad(state))
        if grad is not None:
            dtype = reducer.dtype_for(state, grad)
            buckets.setdefault((id(state.group), dtype), []).append((state, grad))
    for (_, dtype), items in buckets.items():  # insertion order: the same on every rank
        chunk, elems = [], 0
        for i, (state, grad) in enumerate(items):
            items[i] = None  # the chunk holds it now, and lets go once it is packed
            chunk.append((state, grad))
            elems += state.numel
            if elems >= reducer.bucket_elems:
                _allreduce_into_grads(chunk, dtype, reducer, drop_shard)
                chunk, elems = [], 0
        if chunk:
            _allreduce_into_grads(chunk, dtype, reducer, drop_shard)
    if reducer.settle is not None:
        reducer.settle()  # offloaded shards land asynchronously (optimizer.py's note)


def _allreduce_into_grads(chunk: list, dtype: torch.dtype, reducer: Any, drop_shard: Callable) -> None:
    states = [state for state, _ in chunk]
    flat = torch.cat([grad.reshape(-1).to(dtype) for _, grad in chunk])
    chunk.clear()  # the whole gradients are packed: free them before the collective
    before, after = reducer.scales(states[0].world_size)
    if before != 1.0:
        flat.mul_(before)
    dist.all_reduce(flat, group=states[0].group)
    reducer.reduce_calls += 1
    if after != 1.0:
        flat.mul_(after)
    offset = 0
    for state in states:
        averaged = flat[offset : offset + state.numel]
        offset += state.numel
        state.param.grad = averaged.view(state.shape).to(state.param.dtype)
        start = state.rank * state.partition_size
        mine = averaged[start : start + state.partition_size]
        if mine.numel() < state.partition_size:  # the last rank's slice runs into the padding
            mine = torch.nn.functional.pad(mine, (0, state.partition_size - mine.numel()))
        drop_shard(state)
        reducer.accumulate(state, mine, 1.0)


def unpartition(module: nn.Module) -> list:
    """Make every parameter of `module` that `zero.Init` partitioned whole and plain again.

    Stages 0-2 keep full parameters and install no gathering hooks, so a model built under
    `zero.Init` (or with `initialize` called inside one) would run its forward on empty
    tensors. Each such parameter is gathered once, its full data kept, and its ZeRO state
    dropped: from then on it is an ordinary `nn.Parameter`, the same object, so optimizer
    parameter groups built from `model.parameters()` still name it. Returns their names.
    """
    from deepspeed.runtime.zero import gather
    from deepspeed.runtime.zero.parameter import is_zero_param

    named = [(n, p) for n, p in module.named_parameters() if is_zero_param(p)]
    if not named:
        return []
    states = [p._zero_state for _, p in named]
    owner = object()  # this conversion's hold, released below
    gather.fetch_states(states, owner)
    full = [p.data.clone() for _, p in named]  # the gathered data may be a pooled buffer's view
    gather.release_states(states, owner)
    for (_, param), data in zip(named, full):
        param.__class__ = nn.Parameter
        del param._zero_state
        param.data = data
    return [n for n, _ in named]


# Upstream's import path for the stage 1/2 memory estimators.
from deepspeed.runtime.zero.estimators import (  # noqa: E402, F401
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)


class DeepSpeedZeroOptimizer(ZeroStage3Optimizer):
    """The engine's optimizer at stages 0-2 (the one wrapper, see the module note), under
    upstream's class name, so that `isinstance(engine.optimizer, DeepSpeedZeroOptimizer)`
    answers as it does there."""

    @property
    def single_partition_of_fp32_groups(self) -> list:
        """Upstream's name for the flat fp32 master shards, one per group (`flat_master_copies`)."""
        return self.flat_master_copies()
