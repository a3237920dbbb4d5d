"""MiCS: ZeRO-3 partitioned within shard groups and replicated across them.

[Note: MiCS]
With `zero_optimization.mics_shard_size = s` (stage 3), `zero.Init` and the engine partition
every parameter over this rank's shard group of `s` consecutive ranks instead of the world
(`deepspeed/utils/groups.py`, [Note: nodes and MiCS groups]). Each shard group holds a whole
replica of the model; the ranks at one position of every group hold the same shard.

- Gathers (forward, backward, `GatheredParameters`) go over the shard group only: each
  all-gather moves `s` shards, whatever the world size.
- Gradients are reduce-scattered within the shard group (each rank first divides by `s`),
  then the received shard is divided by the number of replicas and all-reduced across the
  replica group (`grad_reducer.py`): the average over the whole world, as plain ZeRO-3 gives.
- The fp32 masters and the optimizer state are partitioned like the parameters; replicas
  step on equal gradients and stay equal. The global gradient norm is summed over the shard
  group only (`optimizer.py` all-reduces over the parameters' group): one replica's shards
  are the whole gradient, counting the others would multiply it by the replica count. Which
  leaf-module parameters got a gradient is summed over the replicas too (the optimizer's
  `replica_group`): an expert run only in another replica was averaged in and trains here.
- At initialization every rank takes global rank 0's values (a broadcast over the world
  before partitioning), so the replicas start equal.
- A checkpoint is written by the first replica alone (global ranks `[0, s)`), as a save of
  `s` ranks; it loads on any layout (plain ZeRO-3 of any size, MiCS of any shard size) by
  the elastic resharding of `checkpoint/sharded.py`.

With `mics_hierarchical_params_gather`, a shard group that spans nodes gathers in two hops,
across nodes then within each node ([Note: the two-hop all-gather] in comm/hierarchical.py):
the same values, with the cross-node bytes sent once per node rather than once per rank.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from deepspeed import comm as dist
from deepspeed.runtime.zero.parameter import is_zero_param
from deepspeed.runtime.zero.partition_parameters import Init
from deepspeed.utils.groups import MicsLayout, mics_layout_for
from deepspeed.utils.logging import logger


class MiCS_Init(Init):  # noqa: N801 - upstream's name
    """`zero.Init` for MiCS: the config must set `zero_optimization.mics_shard_size`; parameters
    are partitioned over this rank's shard group. (`zero.Init` given the same config does the
    same; this class only refuses a config without MiCS, as upstream requires one.)"""

    def __init__(self, module: Optional[nn.Module] = None, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("config_dict_or_path", kwargs.get("config"))
        if config is None:
            raise ValueError(
                "zero.MiCS_Init needs config_dict_or_path= (or config=) with zero_optimization.mics_shard_size set"
            )
        super().__init__(module, *args, **kwargs)
        if self.enabled and (self.mics_config is None or self.mics_config.mics_shard_size < 1):
            raise ValueError(
                "zero.MiCS_Init: the config's zero_optimization.mics_shard_size is not set (or an mpu was "
                "given); set it to a positive divisor of the world size, or use deepspeed.zero.Init"
            )


def mics_layout(config: Any) -> Optional[MicsLayout]:
    """The MiCS groups of an engine's config (None when MiCS is off); logs the layout once."""
    zero = config.zero_config
    if zero.mics_shard_size > 0 and (
        config.mpu is not None or config.typed_config.sequence_parallel_size > 1
    ):
        raise ValueError(
            f"zero_optimization.mics_shard_size={zero.mics_shard_size} cannot be combined with an mpu or "
            "sequence parallelism here; set mics_shard_size to -1, or train without them"
        )
    layout = mics_layout_for(zero)
    if layout is not None and dist.get_rank() == 0:
        how = ""
        if layout.two_hop is not None:
            plan = layout.two_hop
            how = f"; each gather in two hops: across {plan.nodes} nodes, then within {plan.per_node} rank(s) per node"
        elif zero.mics_hierarchical_params_gather:
            how = "; mics_hierarchical_params_gather: each shard group lies within one node, one all-gather each"
        logger.info(f"MiCS: {layout.replicas} replica(s) of shard groups of {layout.shard_size} rank(s){how}")
    return layout


def check_mics_partitioning(module: nn.Module, layout: Optional[MicsLayout]) -> None:
    """Every parameter must be partitioned over this rank's shard group: one built under a
    `zero.Init` without the MiCS config would be cut over another group and train wrong."""
    if layout is None:
        return
    ranks = list(layout.shard_ranks)
    for name, param in module.named_parameters():
        if not is_zero_param(param):
            continue
        group_ranks = dist.get_all_ranks_from_group(param._zero_state.group)
        if group_ranks != ranks:
            raise ValueError(
                f"zero_optimization.mics_shard_size={layout.shard_size}: parameter {name!r} is partitioned over "
                f"ranks {group_ranks}, not this rank's shard group {ranks}; build the model under "
                "deepspeed.zero.Init(config_dict_or_path=ds_config) (or zero.MiCS_Init) with the same config"
            )
