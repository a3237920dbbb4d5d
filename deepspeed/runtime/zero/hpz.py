"""ZeRO++ hpZ: a secondary copy of each gathered parameter, partitioned within the node.

[Note: hpZ, the secondary shard]
With `zero_optimization.zero_hpz_partition_size = h` (stage 3; 1, the default, is off), the
world is cut into secondary groups of `h` consecutive ranks, each within one node
(`deepspeed.utils.groups.initialize_hpz`). Parameters stay partitioned over the whole
data-parallel group (the primary shard, what the optimizer steps), as plain ZeRO-3 has them.

- When a gather from the primary shards completes (the forward's, usually), each rank keeps
  its slice of the gathered tensor cut over its secondary group: `ceil(numel / h)` elements,
  zero-padded, in the parameter's dtype (`lifecycle.all_keep_secondary`); the slices of one
  gather bucket lie back to back in one buffer, so the next gather sends them as one view.
- A later gather of a parameter that has a secondary slice (the backward's, the recompute of
  activation checkpointing, the next micro-batch's forward before the step) all-gathers the
  secondary slices over the secondary group only (`gather._SecondaryBucket`): no byte of it
  crosses a node boundary, and the values are those the primary gather gave.
- The secondary slices are dropped whenever the primary shards change: after every optimizer
  step and every checkpoint load (`drop_secondaries`, from the strategy's
  `refresh_full_params`), and per parameter at every write-back of an edit
  (`GatheredParameters(modifier_rank=...)`, `param.partition(has_been_updated=True)`) or
  re-typing of its shard. The next primary gather makes them again, so a secondary slice
  never holds values older than the shard. Every rank drops and keeps them together (each
  of those events happens on every rank), so all ranks choose the same collective.

Memory: each rank holds `ceil(numel / h)` elements per gathered parameter from its first
gather after a step until the next step, on top of plain ZeRO-3's `ceil(numel / world)`:
`secondary_bytes` counts it.
"""

from __future__ import annotations

from typing import Any, Optional

from deepspeed import comm as dist
from deepspeed.runtime.zero.lifecycle import all_drop_secondary
from deepspeed.utils.groups import HpzLayout, initialize_hpz
from deepspeed.utils.logging import logger


def hpz_layout(config: Any) -> Optional[HpzLayout]:
    """The hpZ secondary groups an engine's config asks for (None when `zero_hpz_partition_size`
    is 1); refuses the combinations not built here, naming the key."""
    size = config.zero_config.zero_hpz_partition_size
    if size == 1:
        return None
    key = f"zero_optimization.zero_hpz_partition_size={size}"
    if config.zero_config.mics_shard_size > 0:
        raise ValueError(f"{key} cannot be combined with mics_shard_size here; set one of them off (1 / -1)")
    if config.mpu is not None or config.typed_config.sequence_parallel_size > 1:
        raise ValueError(
            f"{key} cannot be combined with an mpu or sequence parallelism here; set it to 1, or train without them"
        )
    layout = initialize_hpz(size)
    if dist.get_rank() == 0:
        logger.info(
            f"hpZ: backward gathers from secondary shards within groups of {size} rank(s) on one node"
        )
    return layout


def attach(states: list, layout: Optional[HpzLayout]) -> None:
    """Turn hpZ on for `states` (the engine's ZeRO parameters)."""
    if layout is None:
        return
    for s in states:
        s.hpz = layout


def drop_secondaries(states: list) -> None:
    """Forget every secondary slice (after a step or a load: the shards changed)."""
    all_drop_secondary([s for s in states if s.secondary is not None])


def secondary_bytes(states: list) -> int:
    """Bytes of the secondary slices this rank holds now."""
    return sum(s.secondary.numel() * s.secondary.element_size() for s in states if s.secondary is not None)
