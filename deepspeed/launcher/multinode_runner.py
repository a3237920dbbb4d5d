"""Multi-node runners: turn a resolved job into the command lines that start it on every node.

Two families:

* **Per-node launcher** (`pdsh`, `ssh`): every node runs `python -m deepspeed.launcher.launch
  --world_info=... --node_rank=N`, which starts that node's ranks with RANK, LOCAL_RANK,
  WORLD_SIZE, ... set (`launch.py`). The remote shell command exports the job's environment
  (`collect_exports`) and changes to the runner's working directory first.
* **One rank per MPI / Slurm task** (`openmpi`, `mpich`, `impi`, `mvapich`, `slurm`): the
  program starts every rank itself; each rank finds its place from the variables the program
  sets (`deepspeed.comm` env discovery), and MASTER_ADDR / MASTER_PORT are exported.

A runner's `children()` are the local processes the `deepspeed` command supervises (one for
pdsh, MPI and Slurm; one `ssh` client per node for ssh). Nothing here imports torch.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass, field
from typing import Optional

from deepspeed.launcher.hostfile import ResourcePool, encode_world_info
from deepspeed.launcher.launch import ChildSpec
from deepspeed.utils.logging import logger

# Variables whose names start with one of these are exported to every node, as upstream does
# (plus GLOO_ for CPU jobs and DEEPSPEED_ for the collective timeout).
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "FI_", "CUDA_", "MV2_", "MLFLOW", "GLOO_", "DEEPSPEED_")
# ... except these: each node decides what it sees, and the runner's own visibility must not leak.
NOT_EXPORTED = ("CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED", "PYTHONSTARTUP")
DEEPSPEED_ENV_FILE = os.getenv("DS_ENV_FILE", ".deepspeed_env")
PDSH_MAX_FAN_OUT = 1024
STOP_REMOTE_TIMEOUT_S = 30  # the pkill round through pdsh after a failed or interrupted job


def _ere_literal(text: str) -> str:
    """`text` as a POSIX extended regular expression (pkill's) that matches it literally."""
    return "".join("\\" + c if c in ".[]()*+?{}|^$\\" else c for c in text)


def read_env_file(path: str) -> dict[str, str]:
    """`NAME=value` lines of a `.deepspeed_env` file (blank lines and `#` comments skipped).

    Spaces around the `=` are dropped, and one pair of matching quotes around the value
    (`B="a b"` is `a b`). `$NAME` in a value stays as written here: the shell on each node
    expands it (`PATH=/opt/bin:$PATH`), see `shell_export`.
    """
    found: dict[str, str] = {}
    with open(path) as f:
        for number, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.partition("=")
            if not sep or not name.strip().isidentifier():
                hint = "; drop the leading 'export'" if name.startswith("export ") else ""
                raise ValueError(f"{path}, line {number} ({line!r}): expected NAME=value{hint}")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            found[name.strip()] = value
    return found


def shell_export(name: str, value: str) -> str:
    """`export NAME="value"` for a node's shell: spaces and quotes kept, `$VAR` expanded there.

    As upstream's pdsh and ssh commands do, the node's shell expands variable references, so
    `PATH=/opt/bin:$PATH` extends that node's PATH. Backslashes, double quotes, backticks and
    `$(` are escaped, so no command in a value runs (upstream's unquoted export would run it).
    """
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`").replace("$(", "\\$(")
    return f'export {name}="{escaped}"'


def collect_exports(
    environ: Optional[dict] = None, search_dirs: Optional[list[str]] = None
) -> dict[str, str]:
    """The variables every node gets: prefixed ones from `environ`, then `.deepspeed_env` files.

    The files are read from the home directory, then the working directory; a later one wins.
    """
    environ = os.environ if environ is None else environ
    exports = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES) and k not in NOT_EXPORTED}
    for directory in search_dirs if search_dirs is not None else [os.path.expanduser("~"), os.getcwd()]:
        path = os.path.join(directory, DEEPSPEED_ENV_FILE)
        if os.path.isfile(path):
            exports.update(read_env_file(path))
    return exports


@dataclass
class JobSpec:
    """A multi-node job, resolved from the command line."""

    pool: ResourcePool  # host -> device slots, in node order
    user_script: str
    user_args: list[str] = field(default_factory=list)
    master_addr: str = ""
    master_port: int = 29500
    exports: dict[str, str] = field(default_factory=dict)
    launcher_args: list[str] = field(default_factory=list)  # passed to pdsh / ssh / mpirun / srun
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    ssh_port: Optional[int] = None
    venv_script: Optional[str] = None  # sourced on every node before the launcher runs
    log_dir: Optional[str] = None
    save_pid: int = 0  # the runner's pid when --save_pid (each node's launcher writes <tmp>/<it>.deepspeed)
    bind_cores_to_rank: bool = False
    bind_core_list: Optional[str] = None
    log_level: Optional[str] = None  # each node's launcher's (--log_level)
    comment: str = ""  # srun's --comment
    cwd: str = field(default_factory=os.getcwd)
    python: str = sys.executable
    ntasks_per_node: int = 0  # Slurm without a hostfile: tasks per node (pool is empty then)
    num_nodes: int = 0  # Slurm without a hostfile: nodes

    @property
    def hosts(self) -> list[str]:
        return list(self.pool)

    @property
    def world_size(self) -> int:
        if not self.pool:
            return self.ntasks_per_node * self.num_nodes
        return sum(len(slots) for slots in self.pool.values())


class MultiNodeRunner:
    """Base: one launcher program, checked on PATH, and the children it runs."""

    name = ""
    program = ""

    def __init__(self, job: JobSpec) -> None:
        self.job = job

    def check(self) -> None:
        """Raise ValueError when this runner cannot run `job` (missing program, bad layout)."""
        if shutil.which(self.program) is None:
            raise ValueError(
                f"--launcher {self.name} needs the program {self.program!r}, which is not on PATH "
                f"({os.environ.get('PATH', '')}); install it or choose another --launcher"
            )

    def children(self) -> list[ChildSpec]:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Remove what `children()` wrote (temporary hostfiles)."""

    def stop_remote(self) -> None:
        """After a failed or interrupted job: end what may still run on the nodes (see PDSHRunner)."""

    # -- pieces shared by the subclasses

    def python_exec(self) -> list[str]:
        if self.job.no_python:
            return []
        return [self.job.python, "-u", "-m"] if self.job.module else [self.job.python, "-u"]

    def rank_program(self) -> list[str]:
        """What an MPI / Slurm task runs: the user's program with its arguments."""
        return [*self.python_exec(), self.job.user_script, *self.job.user_args]

    def master_exports(self) -> dict[str, str]:
        """MASTER_ADDR / MASTER_PORT for runners that start ranks directly."""
        master = {"MASTER_PORT": str(self.job.master_port)}
        if self.job.master_addr:
            master["MASTER_ADDR"] = self.job.master_addr
        return master

    def equal_slots(self) -> int:
        """Ranks per node for runners that take one number for every node; checks the pool."""
        counts = {host: len(slots) for host, slots in self.job.pool.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"--launcher {self.name} starts the same number of ranks on every node, but the "
                f"selected slots differ: {counts}; use equal slots or --launcher pdsh"
            )
        for host, slots in self.job.pool.items():
            if slots != list(range(len(slots))):
                raise ValueError(
                    f"--launcher {self.name} cannot start ranks on chosen devices ({host}: {slots}); "
                    "--include/--exclude may name whole hosts only with it, or use --launcher pdsh"
                )
        return next(iter(counts.values()))


# ----------------------------------------------------------------------------- per-node launcher runners


class PerNodeLauncherRunner(MultiNodeRunner):
    """Runs `deepspeed.launcher.launch` on every node through a remote shell."""

    stop_on_stdin_eof = False

    def node_command(self, node_rank: str) -> str:
        """The remote shell command for one node: exports, cd, then the per-node launcher."""
        job = self.job
        launch = [job.python, "-u", "-m", "deepspeed.launcher.launch"]
        launch += [f"--world_info={encode_world_info(job.pool)}", f"--node_rank={node_rank}"]
        launch += [f"--master_addr={job.master_addr}", f"--master_port={job.master_port}"]
        flags = {
            "--module": job.module,
            "--no_python": job.no_python,
            "--no_local_rank": job.no_local_rank,
            "--bind_cores_to_rank": job.bind_cores_to_rank,
            "--stop_on_stdin_eof": self.stop_on_stdin_eof,
        }
        launch += [flag for flag, on in flags.items() if on]
        if job.bind_core_list:
            launch.append(f"--bind_core_list={job.bind_core_list}")
        if job.log_dir:
            launch.append(f"--enable_each_rank_log={job.log_dir}")
        if job.save_pid:
            launch.append(f"--save_pid={job.save_pid}")
        if job.log_level:
            launch.append(f"--log_level={job.log_level}")
        launch += [job.user_script, *job.user_args]
        steps = [shell_export(name, value) for name, value in job.exports.items()]
        if job.venv_script:
            steps.append(f"source {shlex.quote(job.venv_script)}")
        steps.append(f"cd {shlex.quote(job.cwd)}")
        # `%n` (pdsh's node rank) must reach the remote side unquoted; shlex leaves it alone.
        steps.append(shlex.join(launch))
        return "; ".join(steps)


class PDSHRunner(PerNodeLauncherRunner):
    """`pdsh -S -w host,host 'exports; cd; launcher --node_rank=%n ...'`: pdsh fills in %n."""

    name = "pdsh"
    program = "pdsh"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PDSH_RCMD_TYPE"] = "ssh"
        if self.job.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = (
                f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {self.job.ssh_port}".strip()
            )
        return env

    def command(self) -> list[str]:
        hosts = ",".join(self.job.hosts)
        fan_out = ["-f", str(PDSH_MAX_FAN_OUT)]
        return ["pdsh", "-S", *fan_out, "-w", hosts, *self.job.launcher_args, self.node_command("%n")]

    def children(self) -> list[ChildSpec]:
        return [ChildSpec(name="pdsh", cmd=self.command(), env=self.env())]

    def stop_remote(self) -> None:
        """`pdsh -w hosts pkill -f <this job's launcher command>`, as upstream's runner does.

        Ending the local pdsh does not reach the nodes: their launchers keep running (pdsh
        passes no stdin, so the ssh runner's lifeline is not available). So after a failure or
        a signal the runner asks every node to terminate this job's per-node launcher, which
        ends its ranks; the pattern holds the job's world info and master port, so other
        jobs on the nodes are not matched.
        """
        job = self.job
        marker = f"deepspeed.launcher.launch --world_info={encode_world_info(job.pool)} --node_rank="
        port = f"--master_addr={job.master_addr} --master_port={job.master_port}"
        pattern = _ere_literal(marker) + "[0-9]+ " + _ere_literal(port)
        cmd = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(job.hosts), *job.launcher_args]
        cmd.append(f"pkill -f {shlex.quote(pattern)}")
        try:
            subprocess.run(cmd, env=self.env(), capture_output=True, timeout=STOP_REMOTE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            logger.warning(f"pdsh: could not stop the nodes' launchers ({err}); check {job.hosts} by hand")


class SSHRunner(PerNodeLauncherRunner):
    """One `ssh host 'exports; cd; launcher --node_rank=N ...'` per node, supervised together.

    The supervisor ends every client when one fails, and each remote launcher ends its ranks
    when its client goes away (see launch.py, [Note: stdin as a lifeline]).
    """

    name = "ssh"
    program = "ssh"
    stop_on_stdin_eof = True

    def command(self, node_rank: int) -> list[str]:
        port = ["-p", str(self.job.ssh_port)] if self.job.ssh_port is not None else []
        host = self.job.hosts[node_rank]
        return ["ssh", *port, *self.job.launcher_args, host, self.node_command(str(node_rank))]

    def children(self) -> list[ChildSpec]:
        return [
            ChildSpec(name=f"node {node_rank} ({host})", cmd=self.command(node_rank), stdin=subprocess.PIPE)
            for node_rank, host in enumerate(self.job.hosts)
        ]


# ----------------------------------------------------------------------------- MPI and Slurm runners


class OpenMPIRunner(MultiNodeRunner):
    """`mpirun -n N --hostfile <selected hosts> -x NAME=value ... python -u script args`."""

    name = "openmpi"
    program = "mpirun"
    _hostfile: Optional[str] = None

    def check(self) -> None:
        super().check()
        self.equal_slots()

    def command(self) -> list[str]:
        if self._hostfile is None:
            fd, self._hostfile = tempfile.mkstemp(prefix="deepspeed_openmpi_", suffix=".hostfile")
            with os.fdopen(fd, "w") as f:
                f.writelines(f"{host} slots={len(slots)}\n" for host, slots in self.job.pool.items())
        exports: list[str] = []
        for name, value in {**self.job.exports, **self.master_exports()}.items():
            exports += ["-x", f"{name}={value}"]
        head = ["mpirun", "-n", str(self.job.world_size), "--hostfile", self._hostfile]
        return [*head, *exports, *self.job.launcher_args, *self.rank_program()]

    def children(self) -> list[ChildSpec]:
        return [ChildSpec(name="mpirun", cmd=self.command())]

    def cleanup(self) -> None:
        if self._hostfile and os.path.exists(self._hostfile):
            os.remove(self._hostfile)


class HydraRunner(MultiNodeRunner):
    """MPICH's `mpirun` (Hydra), also Intel MPI's and MVAPICH2's:
    `mpirun -n N -ppn P -genv NAME value ... -hosts h1,h2 python -u script args`."""

    name = "mpich"
    program = "mpirun"

    def check(self) -> None:
        super().check()
        self.equal_slots()

    def command(self) -> list[str]:
        exports: list[str] = []
        for name, value in {**self.job.exports, **self.master_exports()}.items():
            exports += ["-genv", name, value]
        per_node = self.equal_slots()
        head = ["mpirun", "-n", str(self.job.world_size), "-ppn", str(per_node)]
        hosts = ["-hosts", ",".join(self.job.hosts)]
        return [*head, *exports, *hosts, *self.job.launcher_args, *self.rank_program()]

    def children(self) -> list[ChildSpec]:
        return [ChildSpec(name="mpirun", cmd=self.command())]


class IMPIRunner(HydraRunner):
    name = "impi"


class MVAPICHRunner(HydraRunner):
    name = "mvapich"


class SlurmRunner(MultiNodeRunner):
    """`srun -n N --nodes M --ntasks-per-node P [--nodelist h1,h2] --export=ALL python -u script args`.

    The exported variables travel in srun's own environment (`--export=ALL`), which avoids
    Slurm's comma-separated `--export` syntax for values with commas. `--kill-on-bad-exit=1`
    makes one failed task end the step.
    """

    name = "slurm"
    program = "srun"

    def check(self) -> None:
        super().check()
        if self.job.pool:
            self.equal_slots()

    def command(self) -> list[str]:
        if self.job.pool:
            nodes, per_node = len(self.job.pool), self.equal_slots()
            nodelist = ["--nodelist", ",".join(self.job.hosts)]
        else:
            nodes, per_node, nodelist = self.job.num_nodes, self.job.ntasks_per_node, []
        head = [
            "srun",
            "-n",
            str(nodes * per_node),
            "--nodes",
            str(nodes),
            "--ntasks-per-node",
            str(per_node),
        ]
        tail = ["--kill-on-bad-exit=1", "--export=ALL", *self.job.launcher_args]
        if self.job.comment:
            tail.insert(0, f"--comment={self.job.comment}")
        return [*head, *nodelist, *tail, *self.rank_program()]

    def env(self) -> dict[str, str]:
        return {**os.environ, **self.job.exports, **self.master_exports()}

    def children(self) -> list[ChildSpec]:
        return [ChildSpec(name="srun", cmd=self.command(), env=self.env())]


RUNNERS: dict[str, type[MultiNodeRunner]] = {
    cls.name: cls
    for cls in (PDSHRunner, SSHRunner, OpenMPIRunner, HydraRunner, IMPIRunner, MVAPICHRunner, SlurmRunner)
}
RUNNERS = types.MappingProxyType(RUNNERS)  # read-only from here on
