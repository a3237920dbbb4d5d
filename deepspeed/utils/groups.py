"""Process groups: ZeRO's data-parallel group is the whole world; sequence parallelism adds
its groups inside it.

[Note: the sequence-parallel layout]
With sequence parallelism of size `sp` (Ulysses), `sp` consecutive ranks split each sequence:
ranks [0, sp) form the first sequence-parallel group, [sp, 2 sp) the second, and so on, as
upstream lays them out (consecutive ranks sit on one node, where the all-to-all of every
attention layer is cheapest). The ranks holding the same position in their groups
(r, r + sp, r + 2 sp, ...) see different sequences: that is data parallelism of size
world / sp, the count the batch-size identity uses. ZeRO partitions parameters and reduces
gradients over all ranks, the "sequence-data-parallel" group, which is the world: the
sequence-parallel ranks' gradients are summed like any other rank's, and the convention that
makes that sum exact is stated in docs/sequence_parallel.md (each rank of a group computes the
whole sequence's loss, weighted by tokens, through a differentiable all-gather).

The layout is per process (the groups are torch process groups every rank created together),
registered in `deepspeed/process_state.py`; `initialize_sequence_parallel` sets it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from deepspeed import comm as dist
from deepspeed import process_state


@dataclass(frozen=True)
class SequenceParallelLayout:
    """This rank's sequence-parallel groups ([Note: the sequence-parallel layout])."""

    size: int  # ranks splitting one sequence
    ranks: tuple  # this rank's sequence-parallel group, global ranks in order
    group: dist.ProcessGroup  # those ranks
    data_parallel_ranks: tuple  # the ranks at this rank's position in every group
    data_parallel_group: dist.ProcessGroup  # those ranks (world / size of them)


class _SequenceParallelState:
    """The one per-process holder of the layout; None until sequence parallelism is set up."""

    def __init__(self) -> None:
        self.layout: Optional[SequenceParallelLayout] = None

    def reset(self) -> None:
        self.layout = None


_SP = process_state.register("deepspeed.utils.groups._SP", _SequenceParallelState(), lambda: _SP.reset())


def initialize_sequence_parallel(sequence_parallel_size: int) -> SequenceParallelLayout:
    """Create the sequence-parallel groups of size `sequence_parallel_size` (every rank must call
    this, with the same size); a second call with the same size returns the existing layout."""
    size = sequence_parallel_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"sequence_parallel_size must be a positive integer, got {size!r}")
    current = _SP.layout
    if current is not None:
        if current.size != size:
            raise ValueError(
                f"sequence parallelism is already set up with sequence_parallel_size={current.size}; "
                f"it cannot change to {size} in the same process"
            )
        return current
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size != 0:
        raise ValueError(
            f"sequence_parallel_size={size} does not divide the world size {world}: choose a divisor of {world} "
            "(sequence-parallel groups are made of consecutive ranks)"
        )
    # torch.distributed.new_group must be called by every rank for every group, in one order.
    sp_ranks = dp_ranks = ()
    sp_group = dp_group = None
    for first in range(0, world, size):
        ranks = tuple(range(first, first + size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            sp_ranks, sp_group = ranks, group
    for position in range(size):
        ranks = tuple(range(position, world, size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            dp_ranks, dp_group = ranks, group
    _SP.layout = SequenceParallelLayout(size, sp_ranks, sp_group, dp_ranks, dp_group)
    return _SP.layout


def sequence_parallel_layout() -> Optional[SequenceParallelLayout]:
    """The layout set up by `initialize_sequence_parallel`, or None without sequence parallelism."""
    return _SP.layout


def _require_layout(query: str) -> SequenceParallelLayout:
    if _SP.layout is None:
        raise RuntimeError(
            f"{query}: sequence parallelism is not set up; call "
            "UlyssesSPAttentionHF.register_with_transformers(...) or pass an mpu from it to deepspeed.initialize, "
            'or set "sequence_parallel_size" in the config'
        )
    return _SP.layout


def _get_data_parallel_group() -> dist.ProcessGroup:
    """ZeRO's group: every rank (the sequence-data-parallel group when sequence parallelism is on)."""
    return dist.get_world_group()


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    return dist.get_rank(_get_data_parallel_group())


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_sequence_data_parallel_group())


def _get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(_get_sequence_data_parallel_group())


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    """This rank's sequence-parallel group; raises when sequence parallelism is not set up."""
    return _require_layout("_get_sequence_parallel_group").group


def _get_sequence_parallel_world_size() -> int:
    """The sequence-parallel size; 1 without sequence parallelism."""
    layout = _SP.layout
    return 1 if layout is None else layout.size


def _get_sequence_parallel_rank() -> int:
    """This rank's position in its sequence-parallel group; 0 without sequence parallelism."""
    layout = _SP.layout
    return 0 if layout is None else layout.ranks.index(dist.get_rank())


def _get_zero_param_intra_parallel_group() -> Optional[dist.ProcessGroup]:
    return None  # hierarchical partitioning (ZeRO++ hpZ) is not implemented
