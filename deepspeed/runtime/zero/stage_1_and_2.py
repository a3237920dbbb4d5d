"""ZeRO stages 1 and 2: full parameters on every rank, optimizer state (1) and gradients (2) sharded.

[Note: the replicated layout]
Stages 1 and 2 keep every parameter whole on every rank, so forward and backward run as in
DDP, with no gather and no hooks. What is sharded is the optimizer's side. Each trainable
parameter is cut by the same shard math as stage 3 (param_state's note), and this rank owns
slice `rank` of every parameter: the `shard` of a `ReplicatedShard`, a view into one flat
buffer per dtype, in parameter order. The fp32 masters and the optimizer state exist only
for those slices (12/N bytes per parameter with Adam in fp32), and the stage-3 optimizer
steps them unchanged, since a `ReplicatedShard` answers the same questions as a stage-3
`ZeroParamState` (shard, sizes, group). Only two things differ between the stages:
- when gradients are reduced: stage 2 reduce-scatters each gradient in buckets as soon as
  autograd has produced it (the stage-3 `GradientReducer`), so a rank keeps only its
  gradient slices; stage 1 (and 0) lets gradients accumulate whole in `param.grad`, as
  DDP's `no_sync` does, and reduce-scatters them once per optimizer step, at the boundary;
- who holds full parameters: after a step, every rank's updated slices are all-gathered
  back into the parameters in place, one collective per `allgather_bucket_size` elements.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed.runtime.zero.param_state import ZeroParamStatus, shard_sizes


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
    shard: torch.Tensor  # 1D [partition_size], the parameter's dtype; a view into a flat buffer
    shard_version: int  # stage-3 compatibility: edits never land in a replicated shard
    # A replicated parameter is always whole, so code written for stage-3 states (refreshing
    # whatever is gathered after its shard changed) treats it as gathered.
    status = ZeroParamStatus.AVAILABLE

    def __init__(self, param: nn.Parameter, ds_id: int, group: Any, shard_out: torch.Tensor) -> None:
        self.param = param
        self.ds_id = ds_id
        self.shape = param.shape
        self.numel = param.numel()
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.partition_size, self.padding = shard_sizes(self.numel, self.world_size)
        self.shard = shard_out
        self.shard_version = 0
        self.copy_from_param()

    def own_slice_bounds(self) -> tuple:
        """`[start, end)` of this rank's real (non-padding) elements in the flat parameter."""
        start = self.rank * self.partition_size
        return min(start, self.numel), min(start + self.partition_size, self.numel)

    @torch.no_grad()
    def copy_from_param(self) -> None:
        start, end = self.own_slice_bounds()
        if end > start:
            self.shard[: end - start].copy_(self.param.data.reshape(-1)[start:end])


def make_replicated_shards(module: nn.Module, group: Any = None) -> dict:
    """`id(param) -> ReplicatedShard` for every parameter of `module` (see the note).

    Frozen parameters get one too, so a checkpoint stores every parameter the same way at
    every stage; only trainable ones get an fp32 master.
    """
    params = list(enumerate(module.parameters()))
    world = dist.get_world_size(group)
    by_key: dict = {}
    for index, p in params:
        by_key.setdefault((p.dtype, p.device), []).append((index, p))
    shards: dict = {}
    for (dtype, device), members in by_key.items():
        sizes = [shard_sizes(p.numel(), world)[0] for _, p in members]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        for (index, p), view in zip(members, torch.split(flat, sizes)):
            shards[id(p)] = ReplicatedShard(p, index, group, view)
    return shards


def gather_updated_slices(states: list, bucket_elems: int = 0) -> None:
    """All-gather every rank's slices of `states` back into their full parameters, in place.

    One collective per (group, dtype) bucket, closed once it holds `bucket_elems` gathered
    elements (`allgather_bucket_size`; 0: no limit), so the temporary output stays bounded. The
    output is rank-major (`[rank 0: p0 slice, p1 slice, ...][rank 1: ...]`); one fused copy
    moves each parameter's column block straight into its storage, which is
    `[world, partition_size]` when it has no padding. A padded parameter's block goes
    through a small buffer first, since its last rank's slice runs past its end.
    """
    by_key: dict = {}
    for s in states:
        by_key.setdefault((id(s.group), s.shard.dtype), []).append(s)
    for same in by_key.values():
        buckets, chunk, elems = [], [], 0
        for s in same:
            chunk.append(s)
            elems += s.world_size * s.partition_size
            if bucket_elems and elems >= bucket_elems:
                buckets.append(chunk)
                chunk, elems = [], 0
        if chunk:
            buckets.append(chunk)
        # One output buffer serves every bucket in turn (each completes before the next): a
        # fresh multi-MB buffer per bucket costs page faults on the CPU.
        first = same[0]
        capacity = max(sum(s.partition_size for s in b) for b in buckets) * first.world_size
        out = torch.empty(capacity, dtype=first.shard.dtype, device=first.param.device)
        for bucket in buckets:
            _gather_bucket(bucket, out)


@torch.no_grad()
def _gather_bucket(states: list, out: torch.Tensor) -> None:
    first = states[0]
    world, sizes = first.world_size, [s.partition_size for s in states]
    rows = out[: world * sum(sizes)].view(world, sum(sizes))
    torch.cat([s.shard for s in states], out=rows[first.rank])
    dist.all_gather_into_tensor(rows.view(-1), rows[first.rank], group=first.group)
    padded = [s for s in states if not _storage_is_rows(s)]
    scratch = {
        id(s): torch.empty(world, s.partition_size, dtype=rows.dtype, device=out.device) for s in padded
    }
    targets = [
        scratch[id(s)] if id(s) in scratch else s.param.data.view(world, s.partition_size) for s in states
    ]
    torch.split_with_sizes_copy(rows, sizes, dim=1, out=targets)
    for s in padded:
        s.param.data.copy_(scratch[id(s)].view(-1)[: s.numel].view(s.shape))


def _storage_is_rows(state: ReplicatedShard) -> bool:
    """Whether `state.param`'s storage can take its gathered block as a `[world, partition_size]` view."""
    data = state.param.data
    return state.padding == 0 and data.is_contiguous() and data.dtype == state.shard.dtype


def reduce_accumulated_grads(states: list, reducer: Any) -> None:
    """Stage 1 (and 0), at a step: reduce-scatter each accumulated `param.grad`, then free it."""
    for state in states:
        grad = state.param.grad
        if grad is None:
            continue
        state.param.grad = None
        reducer.add(state, grad)
    reducer.flush()


def refuse_partitioned(module: nn.Module, stage: int) -> Optional[str]:
    """An error message when `module` holds stage-3 partitioned parameters (built under zero.Init)."""
    from deepspeed.runtime.zero.param_state import is_zero_param

    names = [n for n, p in module.named_parameters() if is_zero_param(p)]
    if not names:
        return None
    return (
        f"zero_optimization.stage={stage} keeps full parameters on every rank, but {len(names)} parameters "
        f"(first: {names[0]}) were partitioned by deepspeed.zero.Init; build the model without zero.Init "
        "(or with Init(enabled=False)) for stages 0-2, or use stage 3"
    )


# Upstream's import path for the stage 1/2 memory estimators.
from deepspeed.runtime.zero.estimators import (  # noqa: E402, F401
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)
