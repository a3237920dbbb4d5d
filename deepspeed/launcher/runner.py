"""The `deepspeed` command: run a training script on this machine's ranks or on a cluster.

    deepspeed [--num_gpus N | --num_procs N] [--master_addr A] [--master_port P]
              [--hostfile H] [--include w0:0,2@w1 | --exclude w1:3] [--num_nodes N]
              [--launcher pdsh|ssh|openmpi|mpich|impi|mvapich|slurm] [--launcher_args '...']
              [--no_ssh --node_rank N] [--ssh_port P]
              [--module | --no_python] [--no_local_rank] [--enable_each_rank_log DIR]
              user_script.py [user args...]

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
CROSS_RANK and CROSS_SIZE in its environment and `--local_rank=N` before the user's arguments,
as with upstream. Without a hostfile (default `/job/hostfile`) the job runs on this machine
with the accelerator's `device_count()` ranks (1 on the CPU unless LOCAL_SIZE says otherwise).
With a hostfile of two or more hosts (or `--force_multi`) the job runs on every selected host
through the chosen `--launcher` (`multinode_runner.py`); `--no_ssh` starts only this node's
share, the command being run on every node by the user with its `--node_rank`.

Elastic training and autotuning are accepted by the parser so that upstream command lines
parse, and refused with an error saying so.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import sys
from typing import Optional

from deepspeed.launcher.hostfile import (
    ResourcePool,
    filter_pool,
    limit_pool,
    parse_filter,
    read_hostfile,
)
from deepspeed.launcher.launch import (
    LaunchSpec,
    add_log_level_args,
    apply_log_level,
    check_cores_available,
    free_port,
    launch_local,
    node_layout,
    port_is_free,
    split_cores,
    supervise,
    visible_devices_env,
)
from deepspeed.launcher.multinode_runner import (
    DEEPSPEED_ENV_FILE,
    RUNNERS,
    JobSpec,
    MultiNodeRunner,
    collect_exports,
)
from deepspeed.utils.logging import logger
from deepspeed.utils.numa import parse_range_list

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500
# The file of extra environment lines (NAME=value) exported to every node of a multi-node
# launch, looked up in the home directory and then the working directory.
DEEPSPEED_ENVIRONMENT_NAME = DEEPSPEED_ENV_FILE
KNOWN_LAUNCHERS = tuple(RUNNERS)
LOCALHOST = "localhost"


def _add_resource_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE, help="'hostname slots=N' lines")
    parser.add_argument("-i", "--include", default="", help="hosts/devices to use, e.g. 'w0:0,2@w1'")
    parser.add_argument("-e", "--exclude", default="", help="hosts/devices to skip, e.g. 'w1:3@w2'")
    parser.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    parser.add_argument(
        "--num_gpus",
        "--num_accelerators",
        "--num_procs",
        dest="num_gpus",
        type=int,
        default=-1,
        help="ranks per node (default: the hostfile's slots, or the accelerator's device count)",
    )
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="not supported")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="not supported")
    parser.add_argument("--elastic_training", action="store_true", help="not supported")
    parser.add_argument("--node_rank", type=int, default=-1, help="this node's index (with --no_ssh)")
    parser.add_argument("--force_multi", action="store_true", help="use --launcher even for one host")
    parser.add_argument("--autotuning", default="", choices=["", "tune", "run"], help="not supported")


def _add_multinode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master_port",
        type=int,
        default=None,
        help=f"rendezvous port (default {DEFAULT_MASTER_PORT}; a free one when that is busy on one node)",
    )
    parser.add_argument("--master_addr", default="", help="rendezvous host (default: the first host)")
    parser.add_argument(
        "--launcher", default="pdsh", type=str.lower, help=f"multi-node launcher {KNOWN_LAUNCHERS}"
    )
    parser.add_argument("--launcher_args", default="", help="extra arguments for pdsh/ssh/mpirun/srun")
    parser.add_argument("--ssh_port", type=int, default=None, help="ssh port of the nodes (pdsh, ssh)")
    parser.add_argument(
        "--no_ssh", action="store_true", help="start this node's ranks only (needs --node_rank)"
    )
    parser.add_argument("--no_ssh_check", action="store_true", help="accepted; no ssh check is made")
    parser.add_argument("--venv_script", default=None, help="script every node sources first (pdsh, ssh)")
    parser.add_argument("--comment", default="", help="srun's --comment (the Slurm launcher), as upstream")


def _add_process_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--module", action="store_true", help="run user_script as `python -m user_script`")
    parser.add_argument("--no_python", action="store_true", help="run user_script directly, not with python")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N")
    parser.add_argument(
        "--save_pid", action="store_true", help="write each node's launcher pid to <tmp>/<this pid>.deepspeed"
    )
    parser.add_argument("--enable_each_rank_log", default="None", help="directory for one log per rank")
    parser.add_argument("--bind_cores_to_rank", action="store_true", help="give each rank its own CPU cores")
    parser.add_argument("--bind_core_list", default=None, help="cores to share out, e.g. '0-7,16-23'")
    parser.add_argument("user_script", help="the training script (or module, or program)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments for the training script")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepspeed",
        description="Run a training script on this machine's accelerators or on the hosts of a hostfile.",
    )
    _add_resource_args(parser)
    _add_multinode_args(parser)
    add_log_level_args(parser)
    _add_process_args(parser)
    return parser


def parse_args(args: Optional[list[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(args)


# ----------------------------------------------------------------------------- resources


def _local_names() -> set[str]:
    hostname = socket.gethostname()
    return {LOCALHOST, "127.0.0.1", hostname, hostname.split(".")[0]}


def _local_device_count() -> int:
    from deepspeed.accelerator import get_accelerator  # imports torch: only when needed

    return max(1, get_accelerator().device_count())


def _localize_filter(spec: str, flag: str) -> str:
    """Without a hostfile the only host is this one: accept any of its names in a filter."""
    if not spec:
        return spec
    local = _local_names()
    parts = []
    for host, slots in parse_filter(spec, flag).items():
        if host not in local:
            raise ValueError(
                f"{flag} {spec!r}: host {host!r} is not this machine, and there is no hostfile; "
                "write the hosts into a hostfile (--hostfile) to run on them"
            )
        parts.append(LOCALHOST if slots is None else f"{LOCALHOST}:{','.join(map(str, slots))}")
    return "@".join(parts)


def resolve_pool(ns: argparse.Namespace) -> tuple[ResourcePool, bool]:
    """The hosts and device slots to run on, and whether they came from a hostfile."""
    if (ns.include or ns.exclude) and (ns.num_gpus > 0 or ns.num_nodes > 0):
        raise ValueError("--num_gpus/--num_procs/--num_nodes cannot be combined with --include/--exclude")
    hosts = read_hostfile(ns.hostfile)
    from_hostfile = hosts is not None
    include, exclude = ns.include, ns.exclude
    if hosts is None:
        if ns.hostfile != DEFAULT_HOSTFILE:  # named on the command line: maybe a typo
            logger.warning(f"hostfile {ns.hostfile!r} does not exist; running on this machine only")
        if ns.num_nodes > 1:
            raise ValueError(
                f"--num_nodes={ns.num_nodes} needs a hostfile listing the nodes; {ns.hostfile} does not exist"
            )
        count = ns.num_gpus if ns.num_gpus > 0 and not (include or exclude) else None
        hosts = {LOCALHOST: count or _local_device_count()}
        include, exclude = _localize_filter(include, "--include"), _localize_filter(exclude, "--exclude")
    pool = {host: list(range(slots)) for host, slots in hosts.items()}
    pool = filter_pool(pool, include, exclude)
    return limit_pool(pool, ns.num_nodes, ns.num_gpus), from_hostfile


# ----------------------------------------------------------------------------- validation


def check_supported(ns: argparse.Namespace) -> None:
    """Refuse, with a reason, the options this launcher does not offer or that conflict."""
    if ns.launcher not in KNOWN_LAUNCHERS:
        raise ValueError(f"--launcher {ns.launcher!r} is unknown; choose one of {list(KNOWN_LAUNCHERS)}")
    if ns.elastic_training or ns.min_elastic_nodes > 0 or ns.max_elastic_nodes > 0:
        raise ValueError("elastic training is not supported by this deepspeed launcher")
    if ns.autotuning:
        raise ValueError("--autotuning is not supported by this deepspeed launcher")
    if ns.module and ns.no_python:
        raise ValueError("--module and --no_python are mutually exclusive")
    if ns.no_ssh and ns.node_rank < 0:
        raise ValueError("--no_ssh starts one node of the job: give this node's index with --node_rank=N")
    if ns.node_rank >= 0 and not ns.no_ssh:
        raise ValueError(f"--node_rank={ns.node_rank} is only meaningful with --no_ssh")
    if not (ns.module or ns.no_python) and not os.path.isfile(ns.user_script):
        raise ValueError(f"user script {ns.user_script!r} does not exist")
    local = not (ns.force_multi or os.path.isfile(ns.hostfile))  # the ranks run here: check what they need
    if local and ns.no_python and shutil.which(ns.user_script) is None:
        raise ValueError(
            f"--no_python runs {ns.user_script!r} itself, but it is not an executable file or on PATH"
        )
    log_dir = _log_dir(ns)
    if local and log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ValueError(
            f"--enable_each_rank_log={log_dir!r} is a file; name a directory for the per-rank logs"
        )


def local_master_port(requested: Optional[int]) -> int:
    """The port of a single-node job: the one asked for, else 29500, else any free one."""
    if requested is not None:
        if not 0 < requested < 65536:
            raise ValueError(f"--master_port={requested} is not a port; pass one in [1, 65535]")
        if not port_is_free(requested):  # rank 0 would fail to listen on it, seconds later
            raise ValueError(
                f"--master_port={requested} is in use on this machine (another job's rendezvous?); "
                "pass a free port, or leave --master_port out to get 29500 or any free one"
            )
        return requested
    if port_is_free(DEFAULT_MASTER_PORT):
        return DEFAULT_MASTER_PORT
    port = free_port()
    logger.warning(f"port {DEFAULT_MASTER_PORT} is busy on this machine; using free port {port} instead")
    return port


def _rank_cores(ns: argparse.Namespace, num_procs: int) -> Optional[list[list[int]]]:
    if not (ns.bind_cores_to_rank or ns.bind_core_list):
        return None
    if ns.bind_core_list:
        cores = check_cores_available(parse_range_list(ns.bind_core_list))  # the ranks run here
    else:
        cores = sorted(os.sched_getaffinity(0))
    return split_cores(cores, num_procs)


def _log_dir(ns: argparse.Namespace) -> Optional[str]:
    return None if ns.enable_each_rank_log in ("None", "") else ns.enable_each_rank_log


# ----------------------------------------------------------------------------- the three modes


def build_spec(ns: argparse.Namespace) -> LaunchSpec:
    """A single-node job on this machine (a one-host hostfile runs here too, as upstream)."""
    pool, _ = resolve_pool(ns)
    (slots,) = pool.values()
    return LaunchSpec(
        user_script=ns.user_script,
        user_args=list(ns.user_args),
        num_procs=len(slots),
        master_addr=ns.master_addr or "127.0.0.1",
        master_port=local_master_port(ns.master_port),
        module=ns.module,
        no_python=ns.no_python,
        no_local_rank=ns.no_local_rank,
        log_dir=_log_dir(ns),
        rank_cores=_rank_cores(ns, len(slots)),
        visible_devices=visible_devices_env(slots) if (ns.include or ns.exclude) else None,
        save_pid=os.getpid() if ns.save_pid else 0,
    )


def build_node_spec(ns: argparse.Namespace, pool: ResourcePool) -> LaunchSpec:
    """`--no_ssh`: this node's share of a job the user starts on every node."""
    slots, offset, world_size = node_layout(pool, ns.node_rank)
    restricted = slots != list(range(len(slots)))
    return LaunchSpec(
        user_script=ns.user_script,
        user_args=list(ns.user_args),
        num_procs=len(slots),
        master_addr=ns.master_addr or next(iter(pool)),
        master_port=ns.master_port if ns.master_port is not None else DEFAULT_MASTER_PORT,
        module=ns.module,
        no_python=ns.no_python,
        no_local_rank=ns.no_local_rank,
        log_dir=_log_dir(ns),
        rank_cores=_rank_cores(ns, len(slots)),
        visible_devices=visible_devices_env(slots) if restricted else None,
        save_pid=os.getpid() if ns.save_pid else 0,
        node_rank=ns.node_rank,
        num_nodes=len(pool),
        rank_offset=offset,
        world_size=world_size,
    )


def _with_cwd_on_pythonpath(exports: dict[str, str]) -> dict[str, str]:
    """Every node's PYTHONPATH starts with the directory the job was launched from, as upstream's:
    the script's own imports of modules beside it work on every node."""
    here = os.path.abspath(os.getcwd())
    rest = exports.get("PYTHONPATH")
    return {**exports, "PYTHONPATH": here if not rest else f"{here}:{rest}"}


def build_runner(ns: argparse.Namespace, pool: ResourcePool) -> MultiNodeRunner:
    """A job on every host of `pool`, started through `--launcher`.

    An empty `pool` is a Slurm job without a hostfile: `--num_nodes` x `--num_gpus` tasks
    placed by srun in the current allocation.
    """
    job = JobSpec(
        pool=pool,
        user_script=ns.user_script,
        user_args=list(ns.user_args),
        master_addr=ns.master_addr or (next(iter(pool)) if pool else ""),
        master_port=ns.master_port if ns.master_port is not None else DEFAULT_MASTER_PORT,
        exports=_with_cwd_on_pythonpath(collect_exports()),
        launcher_args=shlex.split(ns.launcher_args),
        module=ns.module,
        no_python=ns.no_python,
        no_local_rank=ns.no_local_rank,
        ssh_port=ns.ssh_port,
        venv_script=ns.venv_script,
        log_dir=_log_dir(ns),
        save_pid=os.getpid() if ns.save_pid else 0,
        bind_cores_to_rank=ns.bind_cores_to_rank,
        bind_core_list=ns.bind_core_list,
        log_level="error" if ns.quiet else ns.log_level,
        comment=ns.comment,
        num_nodes=max(ns.num_nodes, 0),
        ntasks_per_node=max(ns.num_gpus, 0),
    )
    runner = RUNNERS[ns.launcher](job)
    runner.check()
    return runner


def _slurm_allocation(ns: argparse.Namespace) -> bool:
    """`--launcher slurm --num_nodes N --num_gpus G` without a hostfile: srun places the tasks."""
    if ns.launcher != "slurm" or os.path.isfile(ns.hostfile) or ns.num_nodes <= 1:
        return False
    if ns.num_gpus <= 0 or ns.include or ns.exclude:
        raise ValueError(
            "--launcher slurm without a hostfile takes --num_nodes N and --num_gpus G (tasks per node), "
            "and no --include/--exclude"
        )
    return True


def plan(ns: argparse.Namespace):
    """What to run: a LaunchSpec for this node, or a MultiNodeRunner for the cluster."""
    check_supported(ns)
    if _slurm_allocation(ns):
        job = build_runner(ns, {})
    else:
        pool, from_hostfile = resolve_pool(ns)
        if ns.no_ssh:
            job = build_node_spec(ns, pool)
        elif from_hostfile and (len(pool) > 1 or ns.force_multi):
            job = build_runner(ns, pool)
        elif ns.force_multi:
            raise ValueError(f"--force_multi needs a hostfile; {ns.hostfile} does not exist")
        else:
            job = build_spec(ns)
    if ns.comment and not (isinstance(job, MultiNodeRunner) and job.name == "slurm"):
        raise ValueError(
            f"--comment={ns.comment!r} is passed to srun, and this job does not run through Slurm "
            "(--launcher slurm on more than one node); drop it"
        )
    return job


def run_multinode(runner: MultiNodeRunner) -> int:
    children = runner.children()
    logger.info(f"{runner.name}: starting {runner.job.world_size} ranks on {runner.job.hosts}")
    code = None
    try:
        code = supervise(children)
        return code
    finally:
        runner.cleanup()
        if code != 0:  # failed, interrupted, or the runner itself raised: the nodes may still run
            runner.stop_remote()


def main(args: Optional[list[str]] = None) -> int:
    """Entry point of the `deepspeed` console script (and `ds`): 0 when every rank succeeded;
    otherwise raises `SystemExit` with the job's exit code, as upstream's `main` does, so a
    program that calls it and ignores the result still stops on a failed job."""
    parser = build_parser()
    ns = parser.parse_args(args)
    apply_log_level(ns)
    try:
        job = plan(ns)
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and "deepspeed: error: ..."
    code = launch_local(job) if isinstance(job, LaunchSpec) else run_multinode(job)
    if code:
        raise SystemExit(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
