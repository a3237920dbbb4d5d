"""The sequence-parallel groups as an mpu: `register_with_transformers` returns this module, and
`deepspeed.initialize(mpu=...)` reads it. The groups themselves live in `deepspeed.utils.groups`
([Note: the sequence-parallel layout] there); this module only answers the mpu's queries.

Its "data-parallel" answers count distinct sequences (world / sp ranks at this rank's position
in every sequence-parallel group): the batch-size identity uses that size. ZeRO partitions and
reduces over the sequence-data-parallel group, the whole world. There is no model parallelism:
its size is 1 and its rank 0.
"""

from __future__ import annotations

from deepspeed import comm as dist
from deepspeed.utils import groups


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the groups (every rank, the same size); a repeated call with the same size is a no-op."""
    groups.initialize_sequence_parallel(sequence_parallel_size)


def sequence_parallel_is_initialized() -> bool:
    return groups.sequence_parallel_layout() is not None


def get_sequence_parallel_group() -> dist.ProcessGroup:
    return groups._get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return groups._get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return groups._get_sequence_parallel_rank()


def get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return groups._get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    return groups._get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    return groups._get_sequence_data_parallel_rank()


def get_data_parallel_group() -> dist.ProcessGroup:
    """The ranks at this rank's position in every sequence-parallel group (they see different sequences)."""
    layout = groups.sequence_parallel_layout()
    return dist.get_world_group() if layout is None else layout.data_parallel_group


def get_data_parallel_world_size() -> int:
    return dist.get_world_size() // groups._get_sequence_parallel_world_size()


def get_data_parallel_rank() -> int:
    return dist.get_rank() // groups._get_sequence_parallel_world_size()


def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0
