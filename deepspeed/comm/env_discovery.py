"""Find a process's place in the job from what mpirun or srun put in its environment.

`init_distributed(auto_mpi_discovery=True)` calls `discover()` when RANK / WORLD_SIZE are not
set, so `mpirun -n 4 python train.py` and `srun -n 4 python train.py` work without the
`deepspeed` launcher and without mpi4py. The first family whose variables are all present wins:

| started by                     | rank                      | size                       | local rank                 |
| ------------------------------ | ------------------------- | -------------------------- | -------------------------- |
| Open MPI                       | OMPI_COMM_WORLD_RANK      | OMPI_COMM_WORLD_SIZE       | OMPI_COMM_WORLD_LOCAL_RANK |
| MVAPICH2                       | MV2_COMM_WORLD_RANK       | MV2_COMM_WORLD_SIZE        | MV2_COMM_WORLD_LOCAL_RANK  |
| MPICH / Intel MPI (Hydra, PMI) | PMI_RANK                  | PMI_SIZE                   | MPI_LOCALRANKID            |
| PMIx launchers                 | PMIX_RANK                 | PMIX_SIZE                  | PMIX_LOCAL_RANK            |
| Slurm `srun`                   | SLURM_PROCID              | SLURM_STEP_NUM_TASKS       | SLURM_LOCALID              |

Slurm's size is the step's (set by srun), not the allocation's SLURM_NTASKS: a plain
`python train.py` in an sbatch script sees SLURM_PROCID=0 and SLURM_NTASKS=N but is one
process, and must not wait for N - 1 peers. MPI variables are checked before Slurm's:
`mpirun` inside a Slurm allocation sees both, and the MPI ones describe the job. MASTER_ADDR, when not set, is the first node of the Slurm step
(`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`), 127.0.0.1 when every rank is on this node,
else rank 0's host name through mpi4py when it is installed; otherwise discovery raises,
asking for MASTER_ADDR (e.g. `mpirun -x MASTER_ADDR=node0`).

This module does not import torch.distributed (the layer rule of deepspeed/comm/comm.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Family:
    """The variables one kind of launcher sets for each process."""

    name: str
    rank: str
    size: tuple[str, ...]  # the first one present is used
    local_rank: str
    local_size: str


FAMILIES = (
    Family(
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        ("OMPI_COMM_WORLD_SIZE",),
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    Family(
        "MVAPICH2",
        "MV2_COMM_WORLD_RANK",
        ("MV2_COMM_WORLD_SIZE",),
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    Family("MPICH/Intel MPI", "PMI_RANK", ("PMI_SIZE",), "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Family("PMIx", "PMIX_RANK", ("PMIX_SIZE",), "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    Family("Slurm", "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS",), "SLURM_LOCALID", ""),
)


@dataclass
class Discovered:
    """What `discover` found: the values for RANK, WORLD_SIZE, LOCAL_RANK, ... and their source."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: Optional[int]
    master_addr: Optional[str]

    def as_env(self) -> dict[str, str]:
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank)}
        if self.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.master_addr is not None:
            env["MASTER_ADDR"] = self.master_addr
        return env


def _int(env: dict, name: str, source: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{source} environment: {name}={env[name]!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `'gpu[07-09,12],cpu1'` -> `'gpu07'`."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if not match or not (match.group(1) or match.group(2)):
        raise ValueError(f"cannot read a host name from the Slurm node list {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",", 1)[0].split("-", 1)[0]
    return prefix + first + suffix


def slurm_local_size(env: dict) -> Optional[int]:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE (`'2(x3),1'`) and SLURM_NODEID."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not text or "SLURM_NODEID" not in env:
        return None
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None  # an unknown format: leave LOCAL_WORLD_SIZE unset rather than guess
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = _int(env, "SLURM_NODEID", "Slurm")
    return counts[node] if 0 <= node < len(counts) else None


def _mpi4py_master() -> Optional[str]:
    try:
        from mpi4py import MPI  # optional: only when the variables do not name the master
    except ImportError:
        return None
    import socket

    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def _master_addr(env: dict, family: Family, world_size: int, local_world_size: Optional[int]) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if family.name == "Slurm":
        nodelist = (
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        )
        if nodelist:
            return first_host(nodelist)
    if world_size == 1 or local_world_size == world_size:
        return "127.0.0.1"  # every rank runs on this machine
    found = _mpi4py_master()
    if found:
        return found
    raise ValueError(
        f"init_distributed: started by {family.name} with {world_size} ranks, not known to share this node; "
        "MASTER_ADDR is not set and mpi4py is not installed to find rank 0's host; export "
        "MASTER_ADDR (e.g. `mpirun -x MASTER_ADDR=<first node>`) or start with `deepspeed --launcher ...`"
    )


def discover(env: Optional[dict] = None) -> Optional[Discovered]:
    """The job layout from MPI / Slurm variables, or None when no launcher family's are present."""
    env = os.environ if env is None else env
    for family in FAMILIES:
        size_name = next((name for name in family.size if name in env), None)
        if family.rank not in env or size_name is None:
            continue
        rank = _int(env, family.rank, family.name)
        world_size = _int(env, size_name, family.name)
        if not 0 <= rank < world_size:
            raise ValueError(
                f"{family.name} environment: {family.rank}={rank} is outside [0, {size_name}={world_size})"
            )
        local_rank = _int(env, family.local_rank, family.name) if family.local_rank in env else rank
        local_size = None
        if family.local_size and family.local_size in env:
            local_size = _int(env, family.local_size, family.name)
        elif family.name == "Slurm":
            local_size = slurm_local_size(env)
        master = _master_addr(env, family, world_size, local_size)
        return Discovered(family.name, rank, world_size, local_rank, local_size, master)
    return None


def apply(env: Optional[dict] = None) -> Optional[Discovered]:
    """`discover()`, then set RANK, WORLD_SIZE, LOCAL_RANK, ... in `os.environ` (as upstream does)."""
    found = discover(env)
    if found is not None:
        for name, value in found.as_env().items():
            os.environ.setdefault(name, value)
    return found
