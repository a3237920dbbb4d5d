"""Start the local ranks of a job and supervise them until they all finish.

`deepspeed.launcher.runner` resolves the command line into a `LaunchSpec` and calls
`launch_local`. `python -m deepspeed.launcher.launch --world_info=...` keeps the upstream
per-node entry point for scripts that call it directly (one node only).

[Note: why each rank gets its own session]
Every rank starts in a new session (its own process group), so the supervisor can signal a
rank together with anything it spawned (data-loader workers, compilers) through `killpg`,
without signalling itself. The price is that a terminal's Ctrl-C reaches only the launcher;
the launcher forwards SIGINT, SIGTERM and SIGHUP to every rank's group, waits a grace period
and then kills what is left.

[Note: why one failure ends the job]
A rank that exits non-zero leaves its peers blocked in a collective it will never join.
The supervisor polls every rank; on the first failure it terminates the others (SIGTERM,
then SIGKILL after the grace period) and exits with the failed rank's code, so a crash is
a prompt non-zero exit instead of a hang.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from deepspeed.utils.logging import logger

POLL_INTERVAL_S = 0.05
DEFAULT_GRACE_S = 5.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class LaunchSpec:
    """Everything needed to start the ranks of a single-node job."""

    user_script: str
    user_args: list[str] = field(default_factory=list)
    num_procs: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    module: bool = False  # run `user_script` as `python -m user_script`
    no_python: bool = False  # run `user_script` as an executable, without the interpreter
    no_local_rank: bool = False  # do not append `--local_rank=N` to the user's arguments
    log_dir: Optional[str] = None  # one `rank<N>.log` per rank instead of inheriting stdout
    rank_cores: Optional[list[list[int]]] = None  # CPU cores per local rank, when binding
    visible_devices: Optional[dict[str, str]] = None  # e.g. {"CUDA_VISIBLE_DEVICES": "0,2"}
    save_pid: bool = False  # write the rank pids to <tmp>/<launcher pid>.ds
    grace_s: float = DEFAULT_GRACE_S


def parse_core_list(text: str) -> list[int]:
    """`"0-3,8,10-11"` -> `[0, 1, 2, 3, 8, 10, 11]`."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if high < low:
                    raise ValueError
                cores.extend(range(low, high + 1))
            else:
                cores.append(int(part))
        except ValueError:
            raise ValueError(
                f"bad core list {text!r}: expected comma-separated cores or ranges like '0-3,8'"
            ) from None
    return cores


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
    size = str(spec.num_procs)
    env.update(
        RANK=str(local_rank),  # one node: the global rank is the local rank
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=size,
        LOCAL_WORLD_SIZE=size,
        LOCAL_SIZE=size,
        CROSS_RANK="0",
        CROSS_SIZE="1",
        GROUP_RANK="0",
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
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


def _exit_code(returncode: int) -> int:
    """A rank killed by signal N reports -N; a shell would say 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class RankSupervisor:
    """Owns the rank processes: start them, watch them, end them together (see the notes)."""

    _procs: list[subprocess.Popen]
    _logs: list  # open log files, one per rank when spec.log_dir is set
    _signal: Optional[int]  # the first forwarded signal, None while none arrived

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self._procs = []
        self._logs = []
        self._signal = None
        self._pid_file: Optional[str] = None

    def start(self) -> None:
        if self.spec.log_dir:
            os.makedirs(self.spec.log_dir, exist_ok=True)
        for local_rank in range(self.spec.num_procs):
            self._procs.append(self._start_rank(local_rank))
        if self.spec.save_pid:
            self._write_pid_file()

    def _start_rank(self, local_rank: int) -> subprocess.Popen:
        cmd = rank_command(self.spec, local_rank)
        out = None
        if self.spec.log_dir:
            out = open(os.path.join(self.spec.log_dir, f"rank{local_rank}.log"), "w")
            self._logs.append(out)
        logger.info(f"launching rank {local_rank}: {' '.join(cmd)}")
        try:
            proc = subprocess.Popen(
                cmd,
                env=rank_env(self.spec, local_rank),
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
            )
        except OSError as err:
            self.terminate_all()
            raise RuntimeError(f"could not start rank {local_rank} with {cmd}: {err}") from err
        if self.spec.rank_cores is not None:
            os.sched_setaffinity(proc.pid, self.spec.rank_cores[local_rank])
        return proc

    def _write_pid_file(self) -> None:
        self._pid_file = os.path.join(tempfile.gettempdir(), f"{os.getpid()}.ds")
        with open(self._pid_file, "w") as f:
            json.dump({"launcher": os.getpid(), "ranks": [p.pid for p in self._procs]}, f)

    def _on_signal(self, signum: int, _frame) -> None:
        if self._signal is None:
            self._signal = signum
        self._signal_groups(signum)

    def _signal_groups(self, signum: int) -> None:
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # the rank and everything it started are gone already

    def _first_failure(self) -> Optional[int]:
        for local_rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None and code != 0:
                return local_rank
        return None

    def wait(self) -> int:
        """Block until every rank succeeded (0), one failed, or a signal arrived."""
        while True:
            if self._signal is not None:
                logger.warning(f"launcher got signal {self._signal}; forwarded it to every rank")
                self.terminate_all(first_signal=None)
                return 128 + self._signal
            failed = self._first_failure()
            if failed is not None:
                code = self._procs[failed].returncode
                logger.error(f"rank {failed} exited with code {code}; terminating the other ranks")
                self.terminate_all()
                return _exit_code(code)
            if all(proc.returncode is not None for proc in self._procs):
                return 0
            time.sleep(POLL_INTERVAL_S)

    def terminate_all(self, first_signal: Optional[int] = signal.SIGTERM) -> None:
        """Signal every rank's group, wait up to the grace period, then kill the rest."""
        if first_signal is not None:
            self._signal_groups(first_signal)
        deadline = time.monotonic() + self.spec.grace_s
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
        if self._pid_file and os.path.exists(self._pid_file):
            os.remove(self._pid_file)


def launch_local(spec: LaunchSpec) -> int:
    """Run the job's ranks on this machine; return the exit code the launcher should use."""
    supervisor = RankSupervisor(spec)
    previous = {sig: signal.signal(sig, supervisor._on_signal) for sig in FORWARDED_SIGNALS}
    try:
        supervisor.start()
        return supervisor.wait()
    finally:
        if any(proc.returncode is None for proc in supervisor._procs):
            supervisor.terminate_all()  # an exception in the launcher itself: leave no orphans
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        supervisor.close()


# ----------------------------------------------------------------------------- per-node entry point


def _parse_launch_args(args: Optional[list[str]]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed.launcher.launch",
        description="Start this node's ranks (single node only); usually invoked by `deepspeed`.",
    )
    parser.add_argument("--world_info", default="None", help="base64 JSON {host: [device ids]}, one host")
    parser.add_argument("--node_rank", type=int, default=0)
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, default=29500)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--enable_each_rank_log", default="None")
    parser.add_argument("--save_pid", type=int, default=0)
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(args), parser


def main(args: Optional[list[str]] = None) -> int:
    ns, parser = _parse_launch_args(args)
    num_procs, visible = 1, None
    if ns.world_info != "None":
        try:
            world = json.loads(base64.urlsafe_b64decode(ns.world_info))
        except ValueError as err:
            parser.error(f"--world_info is not base64-encoded JSON: {err}")
        if len(world) != 1 or ns.node_rank != 0:
            parser.error(f"only local launching is supported; --world_info names hosts {sorted(world)}")
        device_ids = list(next(iter(world.values())))
        num_procs, visible = len(device_ids), visible_devices_env(device_ids)
    spec = LaunchSpec(
        user_script=ns.training_script,
        user_args=ns.training_script_args,
        num_procs=num_procs,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        module=ns.module,
        no_python=ns.no_python,
        no_local_rank=ns.no_local_rank,
        log_dir=None if ns.enable_each_rank_log == "None" else ns.enable_each_rank_log,
        save_pid=bool(ns.save_pid),
        visible_devices=visible,
    )
    return launch_local(spec)


if __name__ == "__main__":
    sys.exit(main())
