"""Edits made under `GatheredParameters(modifier_rank=...)`: broadcast from the modifying
rank, agree on failures, and (sanity checks) find edits that were never written back.

These are the collectives of a gather's write-back path; `gather.py` owns the gathering and
the buffers they read (a run's `_FullBuffer`, kept on each state).
"""

from __future__ import annotations

from typing import Optional

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.gather import _buckets_by_group_and_dtype as buckets_by_group_and_dtype
from deepspeed.runtime.zero.gather import _compute_device as compute_device
from deepspeed.runtime.zero.gather import _FullBuffer as FullBuffer

__all__ = ["broadcast_coalesced", "broadcast_full", "find_discarded_edits", "ranks_that_failed"]


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
    """Make every rank's gathered tensors equal to group rank `src_group_rank`'s.

    A bucket that is one whole run, each parameter's data still its view of the run's
    buffer, goes as that buffer: one collective in place, no packing and unpacking.
    """
    for bucket in buckets_by_group_and_dtype(states):
        group = bucket[0].group
        src = dist.get_global_rank(group, src_group_rank)
        flat = _whole_run(bucket)
        if flat is not None:
            dist.broadcast(flat, src=src, group=group)
        else:
            broadcast_coalesced([s.param.data for s in bucket], src, group)


def _whole_run(states: list) -> Optional[torch.Tensor]:
    """The flat buffer of `states`' gathered tensors when they are exactly one run's, in its
    order, and every parameter's data is still its view there (the body may have replaced it)."""
    fb = states[0].full_buffer
    if not isinstance(fb, FullBuffer) or len(fb.fulls) != len(states):
        return None
    for s, full in zip(states, fb.fulls):
        data = s.param.data
        if s.full_buffer is not fb or data.data_ptr() != full.data_ptr() or data.shape != full.shape:
            return None
    return fb.flat


def ranks_that_failed(states: list, failed_here: bool) -> list:
    """Group ranks (of `states[0]`'s group) that report `failed_here`; one all-reduce, every rank agrees."""
    group, world, rank = states[0].group, states[0].world_size, states[0].rank
    flags = torch.zeros(world, dtype=torch.int32, device=compute_device())
    flags[rank] = int(failed_here)
    if world > 1:
        dist.all_reduce(flags, group=group)
    return [r for r, flag in enumerate(flags.tolist()) if flag]


def find_discarded_edits(states: list) -> list:
    """ds_ids of gathered tensors that differ from their shards on any rank (sanity checks;
    parameters gathered quantized, qwZ, are not checked).

    Regathers the shards and compares; the verdict is all-reduced so every rank agrees.
    """
    states = [s for s in states if s.qwz is None]  # qwZ's copies differ from the shards by design
    if not states:
        return []
    device = compute_device()
    changed = []
    for bucket_states in buckets_by_group_and_dtype(states):
        flags = torch.zeros(len(bucket_states), dtype=torch.int32, device=device)
        for i, s in enumerate(bucket_states):
            reference = torch.empty(s.world_size * s.partition_size, dtype=s.shard.dtype, device=device)
            dist.all_gather_into_tensor(reference, s.shard.to(device), group=s.group)
            current = s.param.data.reshape(-1).to(device)
            flags[i] = int(not torch.equal(reference[: s.numel], current))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=bucket_states[0].group)
        changed.extend(s.ds_id for s, f in zip(bucket_states, flags.tolist()) if f)
    return changed
