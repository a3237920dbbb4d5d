"""Start one node's ranks and supervise them until they all finish.

`deepspeed.launcher.runner` resolves the command line into a `LaunchSpec` and calls
`launch_local` for a single-node job. For a multi-node job the runner starts
`python -m deepspeed.launcher.launch --world_info=... --node_rank=N ...` on every node (through
pdsh, ssh, or by hand with `--no_ssh`); that entry point turns the world description into this
node's `LaunchSpec`: global ranks `offset .. offset + slots - 1`, where `offset` counts the slots
of the nodes before it.

[Note: why each rank gets its own session]
Every rank starts in a new session (its own process group), so the supervisor can signal a
rank together with anything it spawned (data-loader workers, compilers) through `killpg`,
without signalling itself. The price is that a terminal's Ctrl-C reaches only the launcher;
the launcher forwards SIGINT, SIGTERM and SIGHUP to every rank's group, waits a grace period
and then kills what is left.

The price of a session of its own is that a launcher killed outright (SIGKILL: the OOM
killer, a scheduler) cannot forward anything, and its ranks would run on, orphaned, blocked in
a collective for the comm timeout. So each rank gets `DEEPSPEED_LAUNCHER_PID`, and
`init_distributed` calls `follow_launcher()`: on Linux a rank whose parent is that launcher
asks the kernel for SIGTERM when its parent dies (`PR_SET_PDEATHSIG`), and one whose launcher
is already gone refuses to join the job.

[Note: why one failure ends the job]
A rank that exits non-zero leaves its peers blocked in a collective it will never join.
The supervisor polls every child; on the first failure it terminates the others (SIGTERM,
then SIGKILL after the grace period) and exits with the failed child's code, so a crash is
a prompt non-zero exit instead of a hang. The same supervisor runs the per-host `ssh` clients
of `--launcher ssh`, so one node's failure ends the others: see [Note: stdin as a lifeline].

[Note: stdin as a lifeline]
When the `deepspeed` runner ends an `ssh` client, the remote sshd closes the session, and the
remote launcher's stdin reaches end-of-file. With `--stop_on_stdin_eof` (which the ssh runner
passes) the per-node launcher treats that EOF like SIGHUP: it ends its ranks and exits. No
extra port, no shared file system, and a dead runner cannot leave ranks behind. Ranks get
/dev/null as stdin in that mode so that none of them consumes the lifeline.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from deepspeed.launcher.hostfile import decode_world_info
from deepspeed.utils.logging import logger
from deepspeed.utils.numa import parse_range_list

POLL_INTERVAL_S = 0.05
DEFAULT_GRACE_S = 5.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class LaunchSpec:
    """Everything needed to start the ranks of one node of a job."""

    user_script: str
    user_args: list[str] = field(default_factory=list)
    num_procs: int = 1  # ranks on this node
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    module: bool = False  # run `user_script` as `python -m user_script`
    no_python: bool = False  # run `user_script` as an executable, without the interpreter
    no_local_rank: bool = False  # do not append `--local_rank=N` to the user's arguments
    log_dir: Optional[str] = None  # one `<log_prefix>_rank<N>.log` per rank instead of inheriting stdout
    # The start time, local, as upstream names the per-rank logs (`20261204221530_rank0.log`),
    # so a job's logs sit together and a relaunch does not overwrite the last one's.
    log_prefix: str = field(default_factory=lambda: time.strftime("%Y%m%d%H%M%S", time.localtime()))
    rank_cores: Optional[list[list[int]]] = None  # CPU cores per local rank, when binding
    visible_devices: Optional[dict[str, str]] = None  # e.g. {"CUDA_VISIBLE_DEVICES": "0,2"}
    # Upstream's --save_pid: the pid of the `deepspeed` process that started the job (0: off);
    # this launcher's pid goes to <tmp>/<that pid>.deepspeed while the ranks run.
    save_pid: int = 0
    grace_s: float = DEFAULT_GRACE_S
    node_rank: int = 0  # this node's index in the job (CROSS_RANK)
    num_nodes: int = 1  # nodes in the job (CROSS_SIZE)
    rank_offset: int = 0  # global rank of this node's local rank 0
    world_size: Optional[int] = None  # ranks in the job; None: this node's num_procs
    stop_on_stdin_eof: bool = False  # see [Note: stdin as a lifeline]


@dataclass
class ChildSpec:
    """One supervised child process: a rank, or a runner's per-node client (`ssh`, `pdsh`)."""

    name: str  # for messages: "rank 3", "node worker-1"
    cmd: list[str]
    env: Optional[dict[str, str]] = None  # None: inherit the launcher's environment
    log_path: Optional[str] = None  # stdout and stderr go here instead of being inherited
    cores: Optional[list[int]] = None  # CPU affinity
    stdin: Optional[int] = None  # subprocess.PIPE / DEVNULL, or None to inherit


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_log_level_args(parser: argparse.ArgumentParser) -> None:
    """Upstream's `--log_level` and `-q/--quiet` (= `--log_level error`), for this launcher's own messages."""
    parser.add_argument("--log_level", default=None, choices=LOG_LEVELS, help="the launcher's log level")
    parser.add_argument("-q", "--quiet", action="store_true", help="log errors only (--log_level error)")


def apply_log_level(ns: argparse.Namespace) -> Optional[str]:
    """Set the deepspeed logger's level from `--log_level` / `--quiet`; returns the level set, if any."""
    level = "error" if ns.quiet else ns.log_level
    if level is not None:
        logger.setLevel(level.upper())
    return level


def check_cores_available(cores: list[int]) -> list[int]:
    """`cores`, if this process may run on every one of them; else ValueError naming the others."""
    allowed = os.sched_getaffinity(0)
    missing = [c for c in cores if c not in allowed]
    if missing:
        raise ValueError(
            f"cores {missing} of the core list are not available here (this process may run on "
            f"{sorted(allowed)}); pass --bind_core_list with cores from that set"
        )
    return cores


LAUNCHER_PID_ENV = "DEEPSPEED_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follow_launcher() -> None:
    """In a rank: end with the launcher that started it (see [Note: why each rank gets its own session]).

    Does nothing outside our launcher, off Linux, or when something else sits between the
    launcher and this process (`--no_python` with a shell script: the shell is the parent).
    Raises RuntimeError when the launcher has exited already, before this rank joins the job.
    """
    value = os.environ.get(LAUNCHER_PID_ENV)
    if not value or not sys.platform.startswith("linux"):
        return
    launcher = int(value)
    if os.getppid() != launcher:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            raise RuntimeError(
                f"the deepspeed launcher (pid {launcher}) that started this rank has exited; not joining "
                "the job (it would wait for peers that are gone)"
            ) from None
        except PermissionError:
            pass  # alive, someone else's: a pid reused, or a wrapper between us
        return  # a wrapper process is our parent: its death is not the launcher's
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not permitted here (a sandbox): the launcher's own signals still reach us
    if os.getppid() != launcher:  # it died between the check and the request
        os.kill(os.getpid(), signal.SIGTERM)


def split_cores(cores: list[int], num_procs: int) -> list[list[int]]:
    """Give each of `num_procs` ranks an equal, contiguous share of `cores`."""
    per_rank = len(cores) // num_procs
    if per_rank == 0:
        raise ValueError(
            f"cannot bind {num_procs} ranks to {len(cores)} cores {cores}: fewer cores than ranks"
        )
    return [cores[r * per_rank : (r + 1) * per_rank] for r in range(num_procs)]


def rank_command(spec: LaunchSpec, local_rank: int) -> list[str]:
    if spec.no_python:
        cmd = [spec.user_script]
    elif spec.module:
        cmd = [sys.executable, "-u", "-m", spec.user_script]
    else:
        cmd = [sys.executable, "-u", spec.user_script]
    if not spec.no_local_rank:
        cmd.append(f"--local_rank={local_rank}")
    return cmd + list(spec.user_args)


def rank_env(spec: LaunchSpec, local_rank: int, base_env: Optional[dict] = None) -> dict[str, str]:
    env = dict(os.environ if base_env is None else base_env)
    local_size = str(spec.num_procs)
    env.update(
        RANK=str(spec.rank_offset + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(spec.world_size or spec.num_procs),
        LOCAL_WORLD_SIZE=local_size,
        LOCAL_SIZE=local_size,
        CROSS_RANK=str(spec.node_rank),
        CROSS_SIZE=str(spec.num_nodes),
        GROUP_RANK=str(spec.node_rank),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        # The rank asks to die with this process (comm.follow_launcher): each rank has its own
        # session, so a launcher killed outright would otherwise leave it running.
        **{LAUNCHER_PID_ENV: str(os.getpid())},
    )
    if spec.visible_devices:
        env.update(spec.visible_devices)
    if spec.rank_cores is not None:
        env["OMP_NUM_THREADS"] = str(len(spec.rank_cores[local_rank]))
    return env


def visible_devices_env(device_ids: list[int]) -> dict[str, str]:
    """The accelerator's visible-devices variables restricted to `device_ids` (none on the CPU).

    Ids count among the devices this process already sees: with CUDA_VISIBLE_DEVICES=2,3,
    id 1 means physical device 3.
    """
    from deepspeed.accelerator import get_accelerator

    env: dict[str, str] = {}
    for name in get_accelerator().visible_devices_envs():
        seen = [d.strip() for d in os.environ.get(name, "").split(",") if d.strip()]
        if seen and max(device_ids) >= len(seen):
            raise ValueError(f"device ids {device_ids} are out of range for {name}={os.environ[name]!r}")
        env[name] = ",".join(seen[i] if seen else str(i) for i in device_ids)
    return env


def port_is_free(port: int) -> bool:
    """Whether a rendezvous store could listen on `port` now.

    SO_REUSEADDR as torch's TCPStore sets it: the connections a finished job leaves in
    TIME_WAIT (about a minute on Linux) do not stop the store from listening, so they must not
    make the port look busy either; a live listener still does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port no one listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def lone_rendezvous_port(port: int) -> int:
    """The port a single-process job listens on: `port`, or any free one where `port` is busy
    (another job's rendezvous on 29500): with no peer, nobody else needs to know it."""
    return port if port_is_free(port) else free_port()


def _exit_code(returncode: int) -> int:
    """A child killed by signal N reports -N; a shell would say 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Owns a set of child processes: start them, watch them, end them together (see the notes)."""

    _procs: list[subprocess.Popen]
    _logs: list  # open log files, one per child that has a log_path
    _signal: Optional[int]  # the first forwarded signal (or SIGHUP for a lost lifeline), None while none

    def __init__(self, children: list[ChildSpec], grace_s: float = DEFAULT_GRACE_S) -> None:
        self.children = children
        self.grace_s = grace_s
        self._procs = []
        self._logs = []
        self._signal = None

    def start(self) -> None:
        for child in self.children:
            self._procs.append(self._start_child(child))

    def _start_child(self, child: ChildSpec) -> subprocess.Popen:
        out = None
        if child.log_path:
            os.makedirs(os.path.dirname(child.log_path) or ".", exist_ok=True)
            out = open(child.log_path, "w")
            self._logs.append(out)
        logger.info(f"launching {child.name}: {' '.join(child.cmd)}")
        try:
            proc = subprocess.Popen(
                child.cmd,
                env=child.env,
                stdin=child.stdin,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
            )
        except OSError as err:
            self.terminate_all()
            raise RuntimeError(f"could not start {child.name} with {child.cmd}: {err}") from err
        if child.cores is not None:
            try:
                os.sched_setaffinity(proc.pid, child.cores)
            except OSError as err:  # it runs already: end it with the rest, leave no orphan
                proc.kill()
                proc.wait()
                self.terminate_all()
                raise RuntimeError(f"could not bind {child.name} to cores {child.cores}: {err}") from err
        return proc

    def on_signal(self, signum: int, _frame=None) -> None:
        if self._signal is None:
            self._signal = signum
        self._signal_groups(signum)

    def _signal_groups(self, signum: int) -> None:
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # the child and everything it started are gone already

    def _failures(self) -> list:
        """Indices of the children that exited with a non-zero code, in rank order."""
        return [i for i, proc in enumerate(self._procs) if proc.poll() not in (None, 0)]

    def _describe_exit(self, index: int) -> str:
        child, code = self.children[index], self._procs[index].returncode
        where = f" (its output: {child.log_path})" if child.log_path else ""
        return f"{child.name} exited with code {code}{where}"

    def wait(self) -> int:
        """Block until every child succeeded (0), one failed, or a signal arrived."""
        while True:
            if self._signal is not None:
                logger.warning(f"launcher got signal {self._signal}; forwarded it to every child")
                self.terminate_all(first_signal=None)
                return 128 + self._signal
            failed = self._failures()
            if failed:
                # A rank's exit often makes another fail at once (a collective with a dead
                # peer), and which one this poll saw first is chance: wait one more interval
                # and name every failure, so the cause is in the log whichever code is returned.
                time.sleep(POLL_INTERVAL_S)
                failed = self._failures()
                logger.error("; ".join(self._describe_exit(i) for i in failed) + "; terminating the others")
                self.terminate_all()
                return _exit_code(self._procs[failed[0]].returncode)
            if all(proc.returncode is not None for proc in self._procs):
                return 0
            time.sleep(POLL_INTERVAL_S)

    def terminate_all(self, first_signal: Optional[int] = signal.SIGTERM) -> None:
        """Signal every child's group, wait up to the grace period, then kill the rest."""
        if first_signal is not None:
            self._signal_groups(first_signal)
        deadline = time.monotonic() + self.grace_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._signal_groups(signal.SIGKILL)  # also reaps grandchildren left in the groups
        for proc in self._procs:
            proc.wait()

    def close(self) -> None:
        for log in self._logs:
            log.close()


def _watch_stdin(supervisor: Supervisor) -> None:
    """[Note: stdin as a lifeline] End the children once stdin reaches end-of-file."""

    def watch() -> None:
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        logger.warning("the runner's connection closed (stdin EOF); ending this node's ranks")
        supervisor.on_signal(signal.SIGHUP)

    threading.Thread(target=watch, name="stdin-lifeline", daemon=True).start()


def supervise(
    children: list[ChildSpec],
    grace_s: float = DEFAULT_GRACE_S,
    watch_stdin: bool = False,
) -> int:
    """Run `children` to completion under one supervisor; return the exit code to use."""
    supervisor = Supervisor(children, grace_s)
    previous = {sig: signal.signal(sig, supervisor.on_signal) for sig in FORWARDED_SIGNALS}
    try:
        supervisor.start()
        if watch_stdin:
            _watch_stdin(supervisor)
        return supervisor.wait()
    finally:
        if any(proc.returncode is None for proc in supervisor._procs):
            supervisor.terminate_all()  # an exception in the launcher itself: leave no orphans
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        supervisor.close()


def rank_children(spec: LaunchSpec) -> list[ChildSpec]:
    return [
        ChildSpec(
            name=f"rank {spec.rank_offset + local_rank}",
            cmd=rank_command(spec, local_rank),
            env=rank_env(spec, local_rank),
            log_path=os.path.join(spec.log_dir, f"{spec.log_prefix}_rank{spec.rank_offset + local_rank}.log")
            if spec.log_dir
            else None,
            cores=None if spec.rank_cores is None else spec.rank_cores[local_rank],
            stdin=subprocess.DEVNULL if spec.stop_on_stdin_eof else None,
        )
        for local_rank in range(spec.num_procs)
    ]


def pid_file_path(main_pid: int) -> str:
    """Where `--save_pid` puts this node's launcher pid, as upstream: <tmp>/<main pid>.deepspeed."""
    return os.path.join(tempfile.gettempdir(), f"{main_pid}.deepspeed")


def launch_local(spec: LaunchSpec) -> int:
    """Run this node's ranks; return the exit code the launcher should use."""
    pid_file = pid_file_path(spec.save_pid) if spec.save_pid else None
    if pid_file is not None:
        if os.path.exists(pid_file):
            raise RuntimeError(
                f"--save_pid: {pid_file} exists already (another job started by pid {spec.save_pid}?); "
                "remove it if that job is gone"
            )
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        print(f"launcher pid: {os.getpid()}", flush=True)  # upstream's line, for scripts that read it
    try:
        return supervise(rank_children(spec), spec.grace_s, watch_stdin=spec.stop_on_stdin_eof)
    finally:
        if pid_file is not None and os.path.exists(pid_file):
            os.remove(pid_file)


# ----------------------------------------------------------------------------- per-node entry point


def _parse_launch_args(args: Optional[list[str]]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed.launcher.launch",
        description="Start this node's ranks of a (multi-node) job; usually invoked by `deepspeed`.",
    )
    parser.add_argument(
        "--world_info", default="None", help="base64 JSON {host: [device slots]}, in node order"
    )
    parser.add_argument("--node_rank", type=int, default=0, help="this node's index in --world_info")
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, default=29500)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--enable_each_rank_log", default="None")
    parser.add_argument(
        "--save_pid",
        type=int,
        default=0,
        help="the main `deepspeed` pid: this launcher's pid goes to <tmp>/<it>.deepspeed",
    )
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--bind_core_list", default=None)
    parser.add_argument(
        "--stop_on_stdin_eof", action="store_true", help="end the ranks when stdin closes (the ssh runner)"
    )
    add_log_level_args(parser)
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(args), parser


def node_layout(world: dict[str, list[int]], node_rank: int) -> tuple[list[int], int, int]:
    """This node's device slots, the global rank of its first rank, and the job's world size."""
    hosts = list(world)
    if not 0 <= node_rank < len(hosts):
        raise ValueError(
            f"--node_rank={node_rank} is outside the {len(hosts)} nodes of this job {hosts} (node ranks 0-{len(hosts) - 1})"
        )
    offset = sum(len(world[h]) for h in hosts[:node_rank])
    return list(world[hosts[node_rank]]), offset, sum(len(v) for v in world.values())


def main(args: Optional[list[str]] = None) -> int:
    ns, parser = _parse_launch_args(args)
    apply_log_level(ns)
    slots, offset, world_size, num_nodes = [0], 0, 1, 1
    try:
        if ns.world_info != "None":
            world = decode_world_info(ns.world_info)
            slots, offset, world_size = node_layout(world, ns.node_rank)
            num_nodes = len(world)
        rank_cores = None
        if ns.bind_cores_to_rank or ns.bind_core_list:
            cores = (
                check_cores_available(parse_range_list(ns.bind_core_list))
                if ns.bind_core_list
                else sorted(os.sched_getaffinity(0))
            )
            rank_cores = split_cores(cores, len(slots))
    except ValueError as err:
        parser.error(str(err))
    # Only a node told to use particular devices restricts what its ranks see (this imports torch).
    visible = visible_devices_env(slots) if slots != list(range(len(slots))) else None
    spec = LaunchSpec(
        user_script=ns.training_script,
        user_args=ns.training_script_args,
        num_procs=len(slots),
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        module=ns.module,
        no_python=ns.no_python,
        no_local_rank=ns.no_local_rank,
        log_dir=None if ns.enable_each_rank_log == "None" else ns.enable_each_rank_log,
        rank_cores=rank_cores,
        save_pid=ns.save_pid,
        visible_devices=visible,
        node_rank=ns.node_rank,
        num_nodes=num_nodes,
        rank_offset=offset,
        world_size=world_size,
        stop_on_stdin_eof=ns.stop_on_stdin_eof,
    )
    return launch_local(spec)


if __name__ == "__main__":
    sys.exit(main())
