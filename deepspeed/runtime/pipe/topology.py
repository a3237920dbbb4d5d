"""Process topologies: named axes over the ranks (upstream's `deepspeed.runtime.pipe.topology`).

A topology lays the ranks out on a grid of named axes, row-major in the order the axes are
given: with axes `("pipe", "data")` and dims `(2, 3)`, rank 4 sits at pipe=1, data=1, and the
ranks along the last axis are adjacent. Scripts written for upstream's pipeline engine
(GPT-NeoX, Megatron-DeepSpeed) build one and hand it to `PipelineModule(topology=...)`; here a
topology may have one pipeline stage and one model-parallel rank (the module refuses more),
so its data axis is every rank. The arithmetic is kept whole, as those scripts also use it to
name checkpoint files and list groups.
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from collections.abc import Sequence
from typing import Any, Optional


class ProcessTopology:
    """Ranks on a row-major grid of named axes: `ProcessTopology(axes=["x", "y"], dims=[2, 3])`."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axes {axes} repeat a name")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: dims {dims} must all be >= 1")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        # itertools.product runs the last axis fastest: the row-major order, rank = position
        coords = [self.ProcessCoord(*c) for c in itertools.product(*(range(d) for d in dims))]
        self.mapping = {coord: rank for rank, coord in enumerate(coords)}
        self._coords = coords

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate: `get_rank(pipe=0, data=1)`."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(
                f"get_rank() needs every axis {self.axes} once, got {sorted(coord_kwargs)}; "
                "use filter_match() for a partial coordinate"
            )
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(
                f"get_rank(): coordinate {coord_kwargs} is outside dims {dict(zip(self.axes, self.dims))}"
            )
        return self.mapping[key]

    def get_axis_names(self) -> list:
        return self.axes

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """`rank`'s coordinate as text, e.g. "model_01" (checkpoint file names); data and pipe are left out."""
        coord = self.get_coord(rank)
        kept = [axis for axis in self.axes if axis not in set(omit_axes)]
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in kept)

    def get_dim(self, axis: str) -> int:
        """How many ranks lie along `axis` (0 for an axis this topology does not have)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> tuple:
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology (world size {len(self._coords)})")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list:
        """The rank lists that differ only along `axis` (one communication group each); [] for an unknown axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            where = dict(zip(others, fixed))
            lists.append(
                [self.mapping[self.ProcessCoord(**where, **{axis: i})] for i in range(self.get_dim(axis))]
            )
        return lists

    def filter_match(self, **filter_kwargs: int) -> list:
        """The ranks whose coordinate matches every given axis value, in rank order."""
        return [
            rank
            for rank, coord in enumerate(self._coords)
            if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list:
        """The ranks whose coordinate along `axis` is `idx`; [] for an unknown axis."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self._coords)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline and data parallelism: axes ("pipe", "data")."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and model parallelism: axes ("pipe", "data", "model")."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list:
    """`n`'s prime factors in increasing order, with repeats (`_prime_factors(12) == [2, 2, 3]`)."""
    if n < 1:
        raise ValueError(f"_prime_factors({n}): needs a positive integer")
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


def _default_topology(world: int) -> PipeDataParallelTopology:
    """Upstream's grid without a topology: the world's prime factors go alternately to the
    pipe axis and the data axis, the first to pipe."""
    factors = _prime_factors(world)
    pipe = math.prod(factors[0::2])
    return PipeDataParallelTopology(num_pp=pipe, num_dp=world // pipe)


class PipelineParallelGrid:
    """A topology's process groups, with upstream's mpu interface (data / pipe / model / slice).

    Every rank builds every group, in the same order (torch.distributed requires it), and
    keeps its own: `dp_group` / `pp_group` / `slice_group` are rank lists, the
    `*_proc_group`s the process groups. The "model" group of upstream's grid is every rank that
    shares this rank's data coordinate (all stages and tensor slices of one replica), which
    upstream uses for global norms and overflow checks.
    """

    def __init__(self, topology: Optional[ProcessTopology] = None, process_group: Any = None) -> None:
        del process_group  # upstream takes it and does not use it either
        from deepspeed import comm as dist

        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._topo = topology if topology is not None else _default_topology(self.world_size)
        if self._topo.world_size() != self.world_size:
            raise ValueError(
                f"PipelineParallelGrid: the topology spans {self._topo.world_size()} ranks "
                f"({dict(zip(self._topo.axes, self._topo.dims))}) but the job has {self.world_size}"
            )
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

        def mine(rank_lists: list) -> tuple:
            chosen = (None, None)
            for ranks in rank_lists:
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    chosen = (list(ranks), group)
            return chosen

        replicas = [sorted(self._topo.get_axis_list("data", i)) for i in range(self.data_parallel_size)]
        model_ranks, self.ds_model_proc_group = mine(replicas)
        self.ds_model_world_size = len(model_ranks)
        self.ds_model_rank = model_ranks.index(self.global_rank)
        self.dp_groups = self._lists_along("data")
        self.dp_group, self.dp_proc_group = mine(self.dp_groups)
        self.p2p_groups = self._build_p2p_groups()
        self.pipe_groups = self._lists_along("pipe")
        self.pp_group, self.pp_proc_group = mine(self.pipe_groups)
        self.model_groups = self._lists_along("model")
        self.slice_group, self.slice_proc_group = mine(self.model_groups)

    def _lists_along(self, axis: str) -> list:
        """The communication lists along `axis`; one rank each where the topology lacks it."""
        lists = self._topo.get_axis_comm_lists(axis)
        return lists if lists else [[rank] for rank in range(self.world_size)]

    def _build_p2p_groups(self) -> list:
        """For every rank, `[rank, the next stage's rank in its pipeline]` (the last wraps to the first)."""
        pairs = []
        for rank in range(self.world_size):
            line = next(ranks for ranks in self._lists_along("pipe") if rank in ranks)
            pairs.append([rank, line[(line.index(rank) + 1) % len(line)]])
        return pairs

    def _is_grid_valid(self) -> bool:
        return self._topo.world_size() == self.world_size

    def get_stage_id(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "pipe", 0)

    def get_data_parallel_id(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "data", 0)

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` in this rank's pipeline (other coordinates from kwargs)."""
        coord = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    # upstream's mpu interface
    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group
