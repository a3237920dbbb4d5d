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

[Note: nodes and MiCS groups]
Which ranks share a node (`node_layout`) comes from the launcher: each rank contributes its
node's name (`CROSS_RANK`, which our launcher exports, else the host name) and the ranks
agree on the list with one all-gather. `DEEPSPEED_RANKS_PER_NODE=n` overrides it without
any collective: ranks [0, n) are node 0, [n, 2n) node 1, ..., so 4 local ranks can act as
2 nodes of 2 in tests. MiCS (`zero_optimization.mics_shard_size = s`) cuts the world into
shard groups of `s` consecutive ranks, [0, s), [s, 2 s), ...; parameters, gradients and
optimizer state are partitioned within a shard group, and each shard group holds a whole
replica of the model. The ranks at the same position of every shard group
(p, p + s, p + 2 s, ...) hold the same shard: they form a replica group, over which
gradients are averaged after the reduce-scatter inside the shard group.

hpZ (`zero_optimization.zero_hpz_partition_size = h`) cuts the world into secondary groups of
`h` consecutive ranks, each of which must lie within one node (`initialize_hpz`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

from deepspeed import comm as dist
from deepspeed import process_state
from deepspeed.comm import hierarchical


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

RANKS_PER_NODE_ENV = "DEEPSPEED_RANKS_PER_NODE"


@dataclass(frozen=True)
class MicsLayout:
    """This rank's MiCS groups ([Note: nodes and MiCS groups])."""

    shard_size: int  # ranks sharing one replica of the model
    shard_ranks: tuple  # this rank's shard group, global ranks in order
    shard_group: dist.ProcessGroup
    replica_ranks: tuple  # the ranks holding the same shard as this one (world / shard_size of them)
    replica_group: dist.ProcessGroup
    # mics_hierarchical_params_gather where the shard group spans nodes: its two-hop gather
    # (comm/hierarchical.py); None: one all-gather over the shard group.
    two_hop: Optional[hierarchical.TwoHopPlan] = None

    @property
    def replicas(self) -> int:
        return len(self.replica_ranks)

    @property
    def replica_index(self) -> int:
        """Which replica this rank belongs to (0: the first shard group)."""
        return self.replica_ranks.index(dist.get_rank())


@dataclass(frozen=True)
class HpzLayout:
    """This rank's hpZ secondary group ([Note: hpZ, the secondary shard] in runtime/zero/hpz.py)."""

    size: int  # ranks sharing one secondary partition (within one node)
    ranks: tuple  # this rank's secondary group, global ranks in order
    group: dist.ProcessGroup
    rank: int  # this rank's position in it


class _TopologyState:
    """The per-process node layout and MiCS groups (created once per size: every rank
    creates torch process groups together)."""

    def __init__(self) -> None:
        self.nodes: Optional[tuple] = None  # node index of every global rank
        self.mics: dict = {}  # (shard size, hierarchical) -> MicsLayout
        self.hpz: dict = {}  # size -> HpzLayout

    def reset(self) -> None:
        self.nodes = None
        self.mics = {}
        self.hpz = {}


_TOPOLOGY = process_state.register(
    "deepspeed.utils.groups._TOPOLOGY", _TopologyState(), lambda: _TOPOLOGY.reset()
)


def _ranks_per_node_override(world: int) -> Optional[int]:
    raw = os.environ.get(RANKS_PER_NODE_ENV)
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1 or world % n != 0:
        raise ValueError(
            f"{RANKS_PER_NODE_ENV}={raw!r} must be a positive integer dividing the world size {world}; "
            "unset it to take the nodes from the launcher"
        )
    return n


def node_layout() -> tuple:
    """The node index of every global rank, in rank order ([Note: nodes and MiCS groups]).

    Collective on its first call unless `DEEPSPEED_RANKS_PER_NODE` is set: every rank must call it."""
    if _TOPOLOGY.nodes is not None:
        return _TOPOLOGY.nodes
    world = dist.get_world_size()
    per_node = _ranks_per_node_override(world)
    if per_node is not None:
        nodes = tuple(r // per_node for r in range(world))
    else:
        name = os.environ.get("CROSS_RANK") or socket.gethostname()
        names = [None] * world
        dist.all_gather_object(names, name)
        first_seen: dict = {}
        nodes = tuple(first_seen.setdefault(n, len(first_seen)) for n in names)
    _TOPOLOGY.nodes = nodes
    return nodes


def ranks_on_node(node: int) -> tuple:
    """The global ranks of node `node`, in order."""
    return tuple(r for r, n in enumerate(node_layout()) if n == node)


def node_of(rank: int) -> int:
    """The node index of global rank `rank`."""
    return node_layout()[rank]


def initialize_mics(shard_size: int, hierarchical_gather: bool = False) -> MicsLayout:
    """The MiCS groups for `shard_size` (created on the first call for that size; every rank
    must call it with the same arguments). `hierarchical_gather`: shard groups that span
    nodes gather in two hops ([Note: the two-hop all-gather] in comm/hierarchical.py)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if (
        isinstance(shard_size, bool)
        or not isinstance(shard_size, int)
        or shard_size < 1
        or world % shard_size
    ):
        raise ValueError(
            f"zero_optimization.mics_shard_size={shard_size!r} must be a positive divisor of the world size "
            f"{world} (shard groups are made of consecutive ranks), or -1 to turn MiCS off"
        )
    known = _TOPOLOGY.mics.get((shard_size, hierarchical_gather))
    if known is not None:
        return known
    shard = replica = None
    # torch.distributed.new_group must be called by every rank for every group, in one order.
    for first in range(0, world, shard_size):
        ranks = tuple(range(first, first + shard_size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            shard = (ranks, group)
    for position in range(shard_size):
        ranks = tuple(range(position, world, shard_size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            replica = (ranks, group)
    two_hop = _two_hop_plan(shard_size, shard[1]) if hierarchical_gather else None
    layout = MicsLayout(shard_size, shard[0], shard[1], replica[0], replica[1], two_hop)
    _TOPOLOGY.mics[(shard_size, hierarchical_gather)] = layout
    return layout


def initialize_hpz(size: int) -> HpzLayout:
    """The hpZ secondary groups of `size` consecutive ranks (created on the first call for that
    size; every rank must call it). Each group must lie within one node."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={size!r} must be a positive divisor of the world size "
            f"{world} (secondary groups are made of consecutive ranks), or 1 to turn hpZ off"
        )
    known = _TOPOLOGY.hpz.get(size)
    if known is not None:
        return known
    nodes = node_layout()
    spanning = [f for f in range(0, world, size) if len({nodes[r] for r in range(f, f + size)}) > 1]
    if spanning:
        first = spanning[0]
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={size}: the group of ranks {list(range(first, first + size))} "
            f"spans nodes {sorted({nodes[r] for r in range(first, first + size)})} (nodes of the ranks: {nodes}); "
            "choose a divisor of the ranks per node (the node's rank count, usually)"
        )
    mine = None
    for first in range(0, world, size):
        ranks = tuple(range(first, first + size))
        group = dist.new_group(list(ranks))  # every rank creates every group, in one order
        if rank in ranks:
            mine = HpzLayout(size, ranks, group, ranks.index(rank))
    _TOPOLOGY.hpz[size] = mine
    return mine


def _node_blocks(first: int, size: int, nodes: tuple) -> list:
    """The ranks [first, first + size) cut by node: a list of runs of consecutive ranks."""
    runs: list = []
    for r in range(first, first + size):
        if runs and nodes[runs[-1][-1]] == nodes[r]:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def _two_hop_plan(shard_size: int, shard_group: dist.ProcessGroup) -> Optional[hierarchical.TwoHopPlan]:
    """Create every shard group's hop groups (all ranks, one order) and register this rank's
    plan; None where shard groups lie within one node (nothing crosses nodes twice)."""
    nodes, world, rank = node_layout(), dist.get_world_size(), dist.get_rank()
    shape = {len(b) for first in range(0, world, shard_size) for b in _node_blocks(first, shard_size, nodes)}
    if len(shape) != 1:
        raise ValueError(
            f"zero_optimization.mics_hierarchical_params_gather: the shard groups of {shard_size} ranks do not "
            f"cut into equal runs of ranks per node (nodes of the ranks: {nodes}); choose mics_shard_size as a "
            "multiple of the ranks per node, or set the key to false"
        )
    per_node = shape.pop()
    if per_node == shard_size:
        return None
    across = within = None
    for first in range(0, world, shard_size):
        blocks = _node_blocks(first, shard_size, nodes)
        for block in blocks:
            group = dist.new_group(block)
            if rank in block:
                within = group
        for j in range(per_node):
            ranks = [block[j] for block in blocks]
            group = dist.new_group(ranks)
            if rank in ranks:
                across = group
    plan = hierarchical.TwoHopPlan(shard_size // per_node, per_node, across, within)
    hierarchical.register(shard_group, plan)
    return plan


def mics_layout_for(zero_config) -> Optional[MicsLayout]:
    """The MiCS groups a `zero_optimization` config asks for; None when MiCS is off
    (`mics_shard_size` -1)."""
    size = getattr(zero_config, "mics_shard_size", -1) if zero_config is not None else -1
    if size is None or size < 0:
        return None
    return initialize_mics(size, bool(zero_config.mics_hierarchical_params_gather))


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
