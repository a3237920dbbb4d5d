"""The `deepspeed` command: run a training script on this machine's ranks.

    deepspeed [--num_gpus N | --num_procs N] [--master_addr A] [--master_port P]
              [--include localhost:0,2 | --exclude localhost:1] [--module | --no_python]
              [--no_local_rank] [--enable_each_rank_log DIR] user_script.py [user args...]

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
its environment and `--local_rank=N` before the user's arguments, as with upstream. The
default number of ranks is the accelerator's `device_count()` (1 on the CPU unless
LOCAL_SIZE says otherwise).

Only single-node launching is implemented. Options that exist for multi-node or elastic
runs are accepted by the parser so that upstream command lines parse, and each one that
would need more than this machine is refused with an error saying so.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Optional

from deepspeed.launcher.launch import (
    LaunchSpec,
    launch_local,
    parse_core_list,
    split_cores,
    visible_devices_env,
)

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500
# The file of extra environment lines (NAME=value) upstream exports to every node of a
# multi-node launch, looked up in the working directory and the home directory. Launching
# here is single-node (ranks inherit this environment), so only the name is kept, for
# clients that write the file (`accelerate launch`).
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
KNOWN_LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")
LOCAL_ONLY = "only local (single-node) launching is supported by this deepspeed"


def _add_resource_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE, help="hostfile; one local host at most")
    parser.add_argument("-i", "--include", default="", help="devices to use, e.g. 'localhost:0,2'")
    parser.add_argument("-e", "--exclude", default="", help="devices to skip, e.g. 'localhost:1'")
    parser.add_argument("--num_nodes", type=int, default=-1, help="must be 1 (or unset)")
    parser.add_argument(
        "--num_gpus",
        "--num_accelerators",
        "--num_procs",
        dest="num_gpus",
        type=int,
        default=-1,
        help="number of local ranks (default: the accelerator's device count)",
    )
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="not supported")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="not supported")
    parser.add_argument("--elastic_training", action="store_true", help="not supported")
    parser.add_argument("--node_rank", type=int, default=-1, help="must be 0 (or unset)")
    parser.add_argument("--force_multi", action="store_true", help="not supported")
    parser.add_argument("--autotuning", default="", choices=["", "tune", "run"], help="not supported")


def _add_multinode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT)
    parser.add_argument("--master_addr", default="", help="default 127.0.0.1")
    parser.add_argument(
        "--launcher",
        default="pdsh",
        type=str.lower,
        help=f"multi-node launcher {KNOWN_LAUNCHERS}; unused locally",
    )
    parser.add_argument("--launcher_args", default="", help="unused locally")
    parser.add_argument("--ssh_port", type=int, default=None, help="unused locally")
    parser.add_argument("--no_ssh", action="store_true", help="unused locally")
    parser.add_argument("--no_ssh_check", action="store_true", help="unused locally")
    parser.add_argument("--venv_script", default=None, help="unused locally")
    parser.add_argument("--comment", default="", help="unused locally")


def _add_process_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--module", action="store_true", help="run user_script as `python -m user_script`")
    parser.add_argument("--no_python", action="store_true", help="run user_script directly, not with python")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N")
    parser.add_argument("--save_pid", action="store_true", help="write the rank pids to <tmp>/<pid>.ds")
    parser.add_argument("--enable_each_rank_log", default="None", help="directory for one log per rank")
    parser.add_argument("--bind_cores_to_rank", action="store_true", help="give each rank its own CPU cores")
    parser.add_argument("--bind_core_list", default=None, help="cores to share out, e.g. '0-7,16-23'")
    parser.add_argument("user_script", help="the training script (or module, or program)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments for the training script")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepspeed",
        description="Run a training script on this machine's accelerators (single node).",
    )
    _add_resource_args(parser)
    _add_multinode_args(parser)
    _add_process_args(parser)
    return parser


def parse_args(args: Optional[list[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(args)


# ----------------------------------------------------------------------------- resources


def _local_names() -> set[str]:
    hostname = socket.gethostname()
    return {"localhost", "127.0.0.1", hostname, hostname.split(".")[0]}


def read_hostfile(path: str) -> Optional[dict[str, int]]:
    """`{host: slots}` from a `host slots=N` file, or None when the file does not exist."""
    if not os.path.isfile(path):
        return None
    hosts: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            host, _, slots = line.partition(" ")
            slots = slots.strip()
            if not slots.startswith("slots=") or not slots[6:].isdigit():
                raise ValueError(f"hostfile {path}: bad line {line!r}; expected 'hostname slots=N'")
            if host in hosts:
                raise ValueError(f"hostfile {path}: host {host!r} is listed twice")
            hosts[host] = int(slots[6:])
    return hosts


def _hostfile_slots(path: str) -> Optional[int]:
    hosts = read_hostfile(path)
    if not hosts:
        return None
    if len(hosts) > 1:
        raise ValueError(f"{LOCAL_ONLY}; hostfile {path} lists {len(hosts)} hosts {sorted(hosts)}")
    ((host, slots),) = hosts.items()
    if host not in _local_names():
        raise ValueError(f"{LOCAL_ONLY}; hostfile {path} names the remote host {host!r}")
    return slots


def parse_inclusion(text: str, flag: str) -> dict[str, Optional[list[int]]]:
    """`'localhost:0,2@other'` -> `{'localhost': [0, 2], 'other': None}` (None: every slot)."""
    hosts: dict[str, Optional[list[int]]] = {}
    for entry in text.split("@"):
        host, sep, slots = entry.strip().partition(":")
        if not host:
            raise ValueError(f"{flag} {text!r}: empty host name; expected 'host[:slot,slot]@...'")
        try:
            hosts[host] = [int(s) for s in slots.split(",")] if sep else None
        except ValueError:
            raise ValueError(f"{flag} {text!r}: slots of {host!r} must be comma-separated integers") from None
    remote = sorted(set(hosts) - _local_names())
    if remote:
        raise ValueError(f"{LOCAL_ONLY}; {flag} names remote hosts {remote}")
    return hosts


def _filter_slots(available: list[int], include: str, exclude: str) -> list[int]:
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive; use one")
    text, flag = (include, "--include") if include else (exclude, "--exclude")
    chosen: set[int] = set()
    every = False
    for slots in parse_inclusion(text, flag).values():
        every = every or slots is None
        chosen.update(slots or ())
    unknown = sorted(chosen - set(available))
    if unknown:
        raise ValueError(f"{flag} names devices {unknown}, but this machine has {available}")
    if include:
        return list(available) if every else sorted(chosen)
    selected = [] if every else [s for s in available if s not in chosen]
    if not selected:
        raise ValueError(f"--exclude {exclude!r} leaves no devices to run on")
    return selected


def _default_count(hostfile: str) -> int:
    slots = _hostfile_slots(hostfile)
    if slots is not None:
        return slots
    from deepspeed.accelerator import get_accelerator  # imports torch: only when needed

    return max(1, get_accelerator().device_count())


def resolve_device_ids(ns: argparse.Namespace) -> tuple[list[int], bool]:
    """The local device ids to run on, and whether they restrict the visible devices."""
    if ns.include or ns.exclude:
        if ns.num_gpus > 0 or ns.num_nodes > 0:
            raise ValueError("--num_gpus/--num_procs/--num_nodes cannot be combined with --include/--exclude")
        available = list(range(_default_count(ns.hostfile)))
        return _filter_slots(available, ns.include, ns.exclude), True
    if ns.num_gpus == 0 or ns.num_gpus < -1:
        raise ValueError(f"--num_gpus/--num_procs must be a positive number of ranks, got {ns.num_gpus}")
    if ns.num_gpus > 0:
        return list(range(ns.num_gpus)), False
    return list(range(_default_count(ns.hostfile))), False


# ----------------------------------------------------------------------------- validation and main


def check_supported(ns: argparse.Namespace) -> None:
    """Refuse, with a reason, the options that need more than this machine."""
    if ns.launcher not in KNOWN_LAUNCHERS:
        raise ValueError(f"--launcher {ns.launcher!r} is unknown; choose one of {list(KNOWN_LAUNCHERS)}")
    if ns.num_nodes > 1:
        raise ValueError(f"{LOCAL_ONLY}; got --num_nodes={ns.num_nodes}")
    if ns.force_multi:
        raise ValueError(f"{LOCAL_ONLY}; got --force_multi")
    if ns.node_rank > 0:
        raise ValueError(f"{LOCAL_ONLY}; got --node_rank={ns.node_rank}")
    if ns.elastic_training or ns.min_elastic_nodes > 0 or ns.max_elastic_nodes > 0:
        raise ValueError("elastic training is not supported by this deepspeed launcher")
    if ns.autotuning:
        raise ValueError("--autotuning is not supported by this deepspeed launcher")
    if ns.module and ns.no_python:
        raise ValueError("--module and --no_python are mutually exclusive")
    if not (ns.module or ns.no_python) and not os.path.isfile(ns.user_script):
        raise ValueError(f"user script {ns.user_script!r} does not exist")


def build_spec(ns: argparse.Namespace) -> LaunchSpec:
    check_supported(ns)
    device_ids, restricted = resolve_device_ids(ns)
    rank_cores = None
    if ns.bind_cores_to_rank or ns.bind_core_list:
        cores = parse_core_list(ns.bind_core_list) if ns.bind_core_list else sorted(os.sched_getaffinity(0))
        rank_cores = split_cores(cores, len(device_ids))
    return LaunchSpec(
        user_script=ns.user_script,
        user_args=list(ns.user_args),
        num_procs=len(device_ids),
        master_addr=ns.master_addr or "127.0.0.1",
        master_port=ns.master_port,
        module=ns.module,
        no_python=ns.no_python,
        no_local_rank=ns.no_local_rank,
        log_dir=None if ns.enable_each_rank_log in ("None", "") else ns.enable_each_rank_log,
        rank_cores=rank_cores,
        visible_devices=visible_devices_env(device_ids) if restricted else None,
        save_pid=ns.save_pid,
    )


def main(args: Optional[list[str]] = None) -> int:
    """Entry point of the `deepspeed` console script; returns the exit code."""
    parser = build_parser()
    ns = parser.parse_args(args)
    try:
        spec = build_spec(ns)
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and "deepspeed: error: ..."
    return launch_local(spec)


if __name__ == "__main__":
    sys.exit(main())
