"""The one gather/release path for ZeRO-3 parameters, shared by GatheredParameters and the engine.

[Note: why release is refcounted, and why every hold has an owner]
A parameter can be wanted by several holders at once: two overlapping GatheredParameters
blocks, a GatheredParameters around a forward pass, the engine's hooks for each submodule
that uses it. Each holder is an owner object (the GatheredParameters, one submodule's
forward or backward, the prefetcher, `param.all_gather()`) that calls `fetch_states()` and
`release_states()` once each, naming itself. `fetch_states()` takes a hold and gathers only
parameters that are not yet gathered or in flight; `release_states()` drops that owner's
hold, and the last holder frees the gathered tensor. Because holds are named, a release by
an owner that holds nothing is an error rather than a silently dropped hold of someone
else's, a leaked hold can be traced to its owner (`ds_summary()["held_by"]`), and the
engine can find the gathers that are live at `step()`. Writing changes back is per holder:
a holder that modified the tensor (`has_been_updated=True`, or a broadcast from a modifier
rank) copies its slice into the shard when it releases, even if others still hold it.

[Note: coalescing]
All parameters asked for in one `fetch()` that share a (process group, dtype) go into one
all-gather: their shards are concatenated into one input, and the output is laid out rank
by rank, `[rank 0: p0 shard, p1 shard, ...][rank 1: ...]`. Each parameter's full tensor is
then cut out of that output; every rank issues the same collectives in the same order
because parameters are sorted by `ds_id`, which is equal on all ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.param_state import ZeroParamState, ZeroParamStatus, is_zero_param


def zero_states(params: Iterable) -> list:
    """The states of the ZeRO parameters among `params`, de-duplicated and sorted by ds_id."""
    seen: dict = {}
    for p in params:
        if is_zero_param(p):
            seen[p._zero_state.ds_id] = p._zero_state
    return [seen[k] for k in sorted(seen)]


def _compute_device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _buckets_by_group_and_dtype(states: list) -> list:
    """Split `states` (sorted by ds_id) into lists sharing a (group, dtype), order preserved."""
    buckets: dict = {}
    for s in states:
        buckets.setdefault((id(s.group), s.shard.dtype), []).append(s)
    return list(buckets.values())


def _adjacent_view(shards: list) -> Optional[torch.Tensor]:
    """One 1D view spanning `shards` when they lie back to back in one storage, else None."""
    first = shards[0]
    storage, end = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in shards:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != end or not t.is_contiguous():
            return None
        end += t.numel()
    return first.as_strided((end - first.storage_offset(),), (1,))


def _all_gather_shards(states: list, device: torch.device, async_op: bool) -> tuple:
    """One all-gather of the concatenated shards of `states` (one group and dtype): (output, handle).

    Shards that Init placed back to back (one module's) are sent as one view, with no copy.
    """
    shards = [s.shard.to(device, non_blocking=True) for s in states]
    flat_in = shards[0] if len(shards) == 1 else _adjacent_view(shards)
    if flat_in is None:
        flat_in = torch.cat(shards)
    flat_out = torch.empty(states[0].world_size * flat_in.numel(), dtype=flat_in.dtype, device=device)
    handle = dist.all_gather_into_tensor(flat_out, flat_in, group=states[0].group, async_op=async_op)
    return flat_out, handle


class _GatherBucket:
    """One coalesced all-gather for parameters of one (group, dtype); `wait()` installs them."""

    states: list  # ZeroParamState, sorted by ds_id
    flat_out: Optional[torch.Tensor]  # 1D, [world_size * sum(partition_size)], rank-major
    done: bool

    def __init__(self, states: list) -> None:
        self.states = states
        self.flat_out = None
        self._work = None
        self.done = False

    def issue(self, device: torch.device) -> None:
        self.flat_out, self._work = _all_gather_shards(self.states, device, async_op=True)
        for s in self.states:
            s.to_inflight(self)

    def wait(self) -> None:
        if self.done:
            return  # another holder waited on this bucket already
        self._work.wait()
        for s, full in zip(self.states, _cut_full_tensors(self.flat_out, self.states)):
            s.to_available(full)
        self.flat_out = None
        self.done = True


def _cut_full_tensors(flat_out: torch.Tensor, states: list) -> list:
    """Each state's full tensor (its shape) out of a rank-major coalesced all-gather output."""
    world = states[0].world_size
    rows = flat_out.view(world, -1)
    if len(states) == 1:
        # The whole output belongs to one parameter: a view, no copy.
        s = states[0]
        return [rows.reshape(-1)[: s.numel].view(s.shape)]
    # One fused copy moves every parameter's column block into its own padded buffer.
    padded = [
        torch.empty(world, s.partition_size, dtype=flat_out.dtype, device=flat_out.device) for s in states
    ]
    torch.split_with_sizes_copy(rows, [s.partition_size for s in states], dim=1, out=padded)
    return [buf.view(-1)[: s.numel].view(s.shape) for buf, s in zip(padded, states)]


def refresh_gathered(states: list) -> None:
    """Re-gather AVAILABLE tensors from their (updated) shards, in place: one collective per bucket.

    After an optimizer step, parameters that stay gathered (persistent ones, or ones a live
    holder keeps) must see the new shards.
    """
    gather_into_params([s for s in states if s.status is ZeroParamStatus.AVAILABLE])


def gather_into_params(states: list, bucket_elems: int = 0) -> None:
    """All-gather the shards of `states` and copy each full tensor into `state.param.data`, in place.

    One collective per (group, dtype) bucket, cut at `bucket_elems` gathered elements when
    given (stages 1 and 2: `allgather_bucket_size`), so the temporary output stays bounded.
    """
    if not states:
        return
    device = _compute_device()
    for same in _buckets_by_group_and_dtype(states):
        chunk, elems = [], 0
        for s in same:
            chunk.append(s)
            elems += s.world_size * s.partition_size
            if bucket_elems and elems >= bucket_elems:
                _gather_chunk_into_params(chunk, device)
                chunk, elems = [], 0
        if chunk:
            _gather_chunk_into_params(chunk, device)


def _gather_chunk_into_params(states: list, device: torch.device) -> None:
    flat_out, _ = _all_gather_shards(states, device, async_op=False)
    for s, full in zip(states, _cut_full_tensors(flat_out, states)):
        s.param.data.copy_(full)


class GatherHandle:
    """The result of `fetch()`: `wait()` completes every all-gather the fetch depends on."""

    def __init__(self, buckets: list) -> None:
        self._buckets = buckets  # ours plus other holders' in-flight buckets we need

    def wait(self) -> None:
        for bucket in self._buckets:
            bucket.wait()
        self._buckets = []

    def is_done(self) -> bool:
        return all(b.done for b in self._buckets)


class _ApiHolds:
    """The owner of holds taken by `param.all_gather()`, which `param.partition()` drops."""

    def __repr__(self) -> str:
        return "param.all_gather()"


PARAM_API = _ApiHolds()


def fetch_states(states: list, owner: object, async_op: bool = False) -> GatherHandle:
    """Take one hold for `owner` on each state and gather those not available (see both notes above)."""
    for s in states:
        s.hold(owner)
    missing = [s for s in states if s.status is ZeroParamStatus.NOT_AVAILABLE]
    in_flight = {id(s.pending): s.pending for s in states if s.status is ZeroParamStatus.INFLIGHT}
    buckets = []
    if missing:
        device = _compute_device()
        for group_states in _buckets_by_group_and_dtype(missing):
            bucket = _GatherBucket(group_states)
            bucket.issue(device)
            buckets.append(bucket)
    handle = GatherHandle(buckets + list(in_flight.values()))
    if not async_op:
        handle.wait()
    return handle


def fetch(params: Iterable, owner: object, async_op: bool = False) -> GatherHandle:
    return fetch_states(zero_states(params), owner, async_op=async_op)


def wait_available(states: list) -> None:
    """Complete any gather still in flight for `states`."""
    for s in states:
        if s.status is ZeroParamStatus.INFLIGHT:
            s.pending.wait()


def release_states(states: list, owner: object, has_been_updated: bool = False) -> None:
    """Drop one of `owner`'s holds on each state; write edits back first if `has_been_updated`."""
    wait_available(states)
    for s in states:
        if has_been_updated:
            s.write_back()
        if s.unhold(owner) and not s.persist:
            s.to_released()


def release_api_holds(params: Iterable, has_been_updated: bool = False) -> None:
    """Upstream's `param.partition()`: drop a hold taken by `param.all_gather()`.

    Other owners' holds are never dropped: a parameter that someone else (the engine, a live
    GatheredParameters) holds stays gathered, with edits written back if asked. A gathered
    parameter nobody holds is written back if asked and freed.
    """
    states = zero_states(params)
    wait_available(states)
    for s in states:
        if s.status is not ZeroParamStatus.AVAILABLE:
            continue
        if has_been_updated:
            s.write_back()
        if PARAM_API in s.holds:
            if s.unhold(PARAM_API) and not s.persist:
                s.to_released()
        elif not s.holds and not s.persist:
            s.to_released()


# Tensors at least this large are broadcast in place: coalescing them would copy them.
BROADCAST_COALESCE_LIMIT = 1 << 18  # elements


def broadcast_coalesced(tensors: list, src: int, group) -> None:
    """Broadcast `tensors` in place from global rank `src`.

    Large contiguous tensors go one collective each, in place (a flat copy would double the
    peak memory of building a layer under Init); small ones share one collective per dtype.
    """
    small: dict = {}
    for t in tensors:
        if t.is_contiguous() and t.numel() >= BROADCAST_COALESCE_LIMIT:
            dist.broadcast(t, src=src, group=group)
        else:
            small.setdefault(t.dtype, []).append(t)
    for same_dtype in small.values():
        if len(same_dtype) == 1 and same_dtype[0].is_contiguous():
            dist.broadcast(same_dtype[0], src=src, group=group)
            continue
        flat = torch.cat([t.reshape(-1) for t in same_dtype])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in same_dtype:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()


def broadcast_full(states: list, src_group_rank: int) -> None:
    """Make every rank's gathered tensors equal to group rank `src_group_rank`'s."""
    for bucket in _buckets_by_group_and_dtype(states):
        group = bucket[0].group
        src = dist.get_global_rank(group, src_group_rank)
        broadcast_coalesced([s.param.data for s in bucket], src, group)


def ranks_that_failed(states: list, failed_here: bool) -> list:
    """Group ranks (of `states[0]`'s group) that report `failed_here`; one all-reduce, every rank agrees."""
    group, world, rank = states[0].group, states[0].world_size, states[0].rank
    flags = torch.zeros(world, dtype=torch.int32, device=_compute_device())
    flags[rank] = int(failed_here)
    if world > 1:
        dist.all_reduce(flags, group=group)
    return [r for r, flag in enumerate(flags.tolist()) if flag]


def find_discarded_edits(states: list) -> list:
    """ds_ids of gathered tensors that differ from their shards on any rank (sanity checks).

    Regathers the shards and compares; the verdict is all-reduced so every rank agrees.
    """
    device = _compute_device()
    changed = []
    for bucket_states in _buckets_by_group_and_dtype(states):
        flags = torch.zeros(len(bucket_states), dtype=torch.int32, device=device)
        for i, s in enumerate(bucket_states):
            reference = torch.empty(s.world_size * s.partition_size, dtype=s.shard.dtype, device=device)
            dist.all_gather_into_tensor(reference, s.shard.to(device), group=s.group)
            current = s.param.data.reshape(-1).to(device)
            flags[i] = int(not torch.equal(reference[: s.numel], current))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=bucket_states[0].group)
        changed.extend(s.ds_id for s, f in zip(bucket_states, flags.tolist()) if f)
    return changed


def partition_new_state(state: ZeroParamState) -> None:
    """First partition of a freshly converted parameter: its shard exists, free the full tensor."""
    if state.holders == 0 and not state.persist:
        state.to_released()
