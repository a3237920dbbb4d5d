"""Process groups used by ZeRO: the data-parallel group is the whole world."""

from __future__ import annotations

from typing import Optional

from deepspeed import comm as dist


def _get_data_parallel_group() -> dist.ProcessGroup:
    return dist.get_world_group()


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    return dist.get_rank(_get_data_parallel_group())


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return _get_data_parallel_group()


def _get_zero_param_intra_parallel_group() -> Optional[dist.ProcessGroup]:
    return None  # hierarchical partitioning (ZeRO++ hpZ) is not implemented
