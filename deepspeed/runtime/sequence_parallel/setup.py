"""The engine's side of sequence parallelism: which size it trains with, and its groups.

ZeRO needs nothing else: it partitions and reduces over every rank (the sequence-data-parallel
group), and the loss convention in docs/sequence_parallel.md makes the averaged gradient the
one of the whole sequences ([Note: the sequence-parallel layout] in deepspeed/utils/groups.py).
"""

from __future__ import annotations

from typing import Any

from deepspeed.utils import groups


def configure_sequence_parallel(config_size: int, mpu: Any) -> int:
    """The sequence-parallel size: the mpu's when it has one (the config's `sequence_parallel_size`
    must then be 1 or the same), else the config's, whose groups are created here."""
    mpu_size = getattr(mpu, "get_sequence_parallel_world_size", None)
    if mpu_size is not None:
        size = int(mpu_size())
        if config_size not in (1, size):
            raise ValueError(
                f"deepspeed.initialize: the config's sequence_parallel_size={config_size} differs from the mpu's "
                f"sequence-parallel size {size}; set sequence_parallel_size to {size} or remove it"
            )
        return size
    if config_size > 1:
        groups.initialize_sequence_parallel(config_size)
    return config_size
