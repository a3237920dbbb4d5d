"""Process groups used by ZeRO: by default the data-parallel group is the whole world.

Upstream keeps these as mutable module globals; we keep one registry object with a
`reset()` for tests (STYLE 6), and the upstream accessor names for callers.
"""

from __future__ import annotations

from typing import Optional

from deepspeed import comm as dist


class _GroupRegistry:
    """Owns the optional overrides of the default (world) groups."""

    def __init__(self) -> None:
        self.data_parallel: Optional[dist.ProcessGroup] = None

    def reset(self) -> None:
        self.data_parallel = None


_registry = _GroupRegistry()


def reset() -> None:
    _registry.reset()


def set_data_parallel_group(group: Optional[dist.ProcessGroup]) -> None:
    _registry.data_parallel = group


def _get_data_parallel_group() -> dist.ProcessGroup:
    return _registry.data_parallel if _registry.data_parallel is not None else dist.get_world_group()


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    return dist.get_rank(_get_data_parallel_group())


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return _get_data_parallel_group()


def _get_zero_param_intra_parallel_group() -> Optional[dist.ProcessGroup]:
    return None  # hierarchical partitioning (ZeRO++ hpZ) is not implemented
