"""`deepspeed --hostfile` on a fake two-node cluster: the real command lines, run for real.

The cluster: a hostfile naming 127.0.0.2 and 127.0.0.3 (loopback addresses, so the ranks of
"node 1" really connect to the master at 127.0.0.2), and fake `ssh`, `pdsh`, `mpirun` and
`srun` first on PATH (launcher_scripts/fake_cluster.py). They log their arguments and run the
"remote" command on this machine, the way the real tools would on the node: ssh with a bare
login environment in $HOME (only what our runner exports reaches the ranks), mpirun and srun
with their launchers' rank variables (OMPI_COMM_WORLD_*, PMI_*, SLURM_*) and nothing else.

Every runner mode runs a gloo all-reduce on 2 nodes (the ranks import torch and
deepspeed.comm only, to keep the grid quick on 2 cores); the default runner (pdsh) also trains
a ZeRO-3 model and must report the losses of the same world size on one node. Set
DS_TEST_CLUSTER_FULL=1 to train 2 nodes x 2 ranks with ZeRO-3 through every runner against a
4-rank single-node run (about 20 s per run on 2 cores).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.unit.common import get_free_port

SCRIPTS = os.path.join(os.path.dirname(__file__), "launcher_scripts")
FAKE_CLUSTER = os.path.join(SCRIPTS, "fake_cluster.py")
TRAIN = os.path.join(SCRIPTS, "cluster_train.py")
HOSTS = ["127.0.0.2", "127.0.0.3"]
RUN_TIMEOUT_S = 120
FULL = os.environ.get("DS_TEST_CLUSTER_FULL") == "1"
LAUNCHER_ENV_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "MV2_", "SLURM_", "PDSH_")
RANK_ENVS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class FakeCluster:
    """A temporary directory holding the fake tools, a hostfile, $HOME and the ranks' reports."""

    def __init__(self, root, slots: int) -> None:
        self.root = root
        self.slots = slots
        self.bin, self.home, self.out = root / "bin", root / "home", root / "out"
        for d in (self.bin, self.home, self.out):
            d.mkdir()
        for tool in ("ssh", "pdsh", "mpirun", "srun"):
            path = self.bin / tool
            path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_CLUSTER}" {tool} "$@"\n')
            path.chmod(0o755)
        self.hostfile = root / "hostfile"
        self.hostfile.write_text("".join(f"{h} slots={slots}  # a fake node\n" for h in HOSTS))
        # Both .deepspeed_env files are read; the working directory's wins.
        (self.home / ".deepspeed_env").write_text("FAKE_CLUSTER_MARK=home\n")
        (root / ".deepspeed_env").write_text("# read after ~/.deepspeed_env\nFAKE_CLUSTER_MARK=cwd\n")
        self.log = root / "calls.jsonl"
        self.port = get_free_port()

    @property
    def world(self) -> int:
        return self.slots * len(HOSTS)

    def env(self, **extra) -> dict:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in RANK_ENVS and not k.startswith(LAUNCHER_ENV_PREFIXES) and k != "FAKE_CLUSTER_MARK"
        }
        env.update(
            PATH=f"{self.bin}{os.pathsep}{env['PATH']}",
            HOME=str(self.home),
            FAKE_CLUSTER_HOSTS=",".join(HOSTS),
            FAKE_CLUSTER_LOG=str(self.log),
            DEEPSPEED_TIMEOUT="1",  # a rank left waiting fails within a minute, whatever happens
        )
        env.update(extra)
        return env

    def command(self, *args: str, mode: str = "allreduce", script_args=()) -> list[str]:
        head = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(self.hostfile)]
        head += ["--master_port", str(self.port), *args]
        return [*head, TRAIN, "--out", str(self.out), "--mode", mode, *script_args]

    def run(self, *args: str, mode: str = "allreduce", script_args=()) -> subprocess.CompletedProcess:
        cmd = self.command(*args, mode=mode, script_args=script_args)
        return subprocess.run(
            cmd, env=self.env(), cwd=self.root, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )

    def calls(self, tool: str) -> list[list[str]]:
        if not self.log.exists():
            return []
        lines = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [c["argv"] for c in lines if c["tool"] == tool]

    def reports(self) -> dict[int, dict]:
        return {
            int(p.stem[4:]): json.loads(p.read_text())
            for p in self.out.glob("rank*.json")
            if p.stem[4:].isdigit()
        }


def check_layout(cluster: FakeCluster, reports: dict, per_node_launcher: bool) -> None:
    """Every rank knows its place, ran on its node, and got the exported environment."""
    assert sorted(reports) == list(range(cluster.world))
    for rank, r in reports.items():
        node, local = divmod(rank, cluster.slots)
        assert r["host"] == HOSTS[node], r
        assert (r["rank"], r["world"]) == (rank, cluster.world)
        assert (r["RANK"], r["WORLD_SIZE"]) == (str(rank), str(cluster.world))
        assert (r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) == (str(local), str(cluster.slots))
        assert (r["MASTER_ADDR"], r["MASTER_PORT"]) == (HOSTS[0], str(cluster.port))
        assert r["mark"] == "cwd"  # from .deepspeed_env, through the runner's exports
        if per_node_launcher:  # only our own launcher can pass --local_rank and CROSS_*
            assert r["local_rank_arg"] == local
            assert (r["CROSS_RANK"], r["CROSS_SIZE"]) == (str(node), str(len(HOSTS)))
        if "sum" in r:
            assert r["sum"] == cluster.world * (cluster.world + 1) / 2


# ----------------------------------------------------------------------------- every runner, for real

# launcher -> (slots per node, what its command line must contain)
RUNNER_CASES = {
    "pdsh": (2, ["-S", "-f", "1024", "-w", "127.0.0.2,127.0.0.3"]),
    "ssh": (1, ["-p", "2222"]),
    "openmpi": (1, ["-n", "2", "--hostfile"]),
    "mpich": (1, ["-n", "2", "-ppn", "1", "-hosts", "127.0.0.2,127.0.0.3"]),
    "slurm": (1, ["-n", "2", "--nodes", "2", "--ntasks-per-node", "1", "--nodelist", "127.0.0.2,127.0.0.3"]),
}


@pytest.mark.parametrize("launcher", list(RUNNER_CASES))
def test_runner_starts_every_node(launcher, tmp_path):
    slots, expected = RUNNER_CASES[launcher]
    cluster = FakeCluster(tmp_path, slots)
    extra = ["--ssh_port", "2222"] if launcher == "ssh" else []
    result = cluster.run("--launcher", launcher, *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    check_layout(cluster, cluster.reports(), per_node_launcher=launcher in ("pdsh", "ssh"))
    tool = {"pdsh": "pdsh", "ssh": "ssh", "slurm": "srun"}.get(launcher, "mpirun")
    calls = cluster.calls(tool)
    assert len(calls) == (len(HOSTS) if tool == "ssh" else 1)
    for argv in calls:
        assert all(a in argv for a in expected), argv
    if launcher == "pdsh":
        assert "--node_rank=%n" in calls[0][-1]
    if launcher == "ssh":
        assert [argv[2] for argv in calls] == HOSTS or sorted(argv[2] for argv in calls) == HOSTS
        assert all("--stop_on_stdin_eof" in argv[-1] for argv in calls)
    if launcher in ("openmpi", "mpich"):
        assert (
            "MASTER_ADDR=127.0.0.2" in calls[0]
            or "127.0.0.2" in calls[0][calls[0].index("MASTER_ADDR") + 1 :]
        )


def test_no_ssh_mode_one_command_per_node(tmp_path):
    """`--no_ssh --node_rank=N`, started by hand on each node (here: twice, concurrently)."""
    cluster = FakeCluster(tmp_path, 1)
    procs = [
        subprocess.Popen(
            cluster.command("--no_ssh", f"--node_rank={node}"),
            env=cluster.env(FAKE_CLUSTER_HOST=host, FAKE_CLUSTER_MARK="cwd"),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node, host in enumerate(HOSTS)
    ]
    outputs = [proc.communicate(timeout=RUN_TIMEOUT_S)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    check_layout(cluster, cluster.reports(), per_node_launcher=True)
    assert cluster.calls("ssh") == [] and cluster.calls("pdsh") == []


# ----------------------------------------------------------------------------- failures


def _assert_gone(pid: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"rank process {pid} outlived the job")


def test_failure_on_one_node_ends_every_node_ssh(tmp_path):
    """Node 1's rank exits 7 while node 0's hangs: the runner ends node 0 too and exits 7."""
    cluster = FakeCluster(tmp_path, 1)
    start = time.monotonic()
    result = cluster.run("--launcher", "ssh", mode="fail", script_args=["--fail_rank", "1"])
    elapsed = time.monotonic() - start
    assert result.returncode == 7, result.stdout + result.stderr
    assert elapsed < 40, f"the job took {elapsed:.0f}s to end; node 0 was not torn down"
    _assert_gone(int((cluster.out / "rank0.pid").read_text()))
    assert (
        "stdin EOF" in result.stdout + result.stderr
    )  # node 0's launcher lost its lifeline and ended its rank


def test_failure_on_one_node_ends_every_node_pdsh(tmp_path):
    """Under pdsh the failed node exits 7 and gloo fails the survivors' collective: pdsh -S exits 7."""
    cluster = FakeCluster(tmp_path, 1)
    args = ["--fail_rank", "1", "--hang", "collective"]
    result = cluster.run("--launcher", "pdsh", mode="fail", script_args=args)
    assert result.returncode == 7, result.stdout + result.stderr
    _assert_gone(int((cluster.out / "rank0.pid").read_text()))


def test_interrupting_the_pdsh_runner_ends_every_node(tmp_path):
    """SIGINT to the runner: the local pdsh ends, which does not reach the nodes (pdsh gives
    them no stdin), so the runner has every node pkill this job's launcher, which ends its ranks."""
    cluster = FakeCluster(tmp_path, 1)
    cmd = cluster.command("--launcher", "pdsh", mode="fail", script_args=["--fail_rank", "99"])
    proc = subprocess.Popen(
        cmd, env=cluster.env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    pids = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(pids) < cluster.world:  # every rank passed init and the barrier: all sleep now
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
            pids = [int(p.read_text()) for p in cluster.out.glob("rank*.pid") if p.read_text()]
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=RUN_TIMEOUT_S)[0]
        assert proc.returncode == 130, out
        for pid in pids:
            _assert_gone(pid)
        assert any("pkill -f" in argv[-1] for argv in cluster.calls("pdsh")), cluster.calls("pdsh")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_missing_program_is_named(tmp_path):
    cluster = FakeCluster(tmp_path, 1)
    (cluster.bin / "srun").unlink()
    env = cluster.env(PATH=f"{cluster.bin}{os.pathsep}/nonexistent")
    cmd = cluster.command("--launcher", "slurm")
    result = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--launcher slurm needs the program 'srun', which is not on PATH" in result.stderr


# ----------------------------------------------------------------------------- ZeRO-3 parity


def _single_node_losses(tmp_path, world: int) -> list[float]:
    out = tmp_path / "reference"
    out.mkdir()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_procs", str(world)]
    cmd += ["--master_port", str(get_free_port()), TRAIN, "--out", str(out), "--mode", "train"]
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENVS}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = {tuple(json.loads((out / f"rank{r}.json").read_text())["losses"]) for r in range(world)}
    assert len(losses) == 1
    return list(losses.pop())


ZERO3_LAUNCHERS = ["pdsh", "ssh", "no_ssh", "openmpi", "mpich", "slurm"] if FULL else ["pdsh"]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    return _single_node_losses(tmp_path_factory.mktemp("zero3_ref"), 4 if FULL else 2)


@pytest.mark.parametrize("launcher", ZERO3_LAUNCHERS)
def test_zero3_training_matches_single_node(launcher, tmp_path, reference_losses):
    cluster = FakeCluster(tmp_path, 2 if FULL else 1)
    if launcher == "no_ssh":
        procs = [
            subprocess.Popen(
                cluster.command("--no_ssh", f"--node_rank={node}", mode="train"),
                env=cluster.env(FAKE_CLUSTER_HOST=host, FAKE_CLUSTER_MARK="cwd"),
                cwd=tmp_path,
            )
            for node, host in enumerate(HOSTS)
        ]
        assert [proc.wait(timeout=RUN_TIMEOUT_S) for proc in procs] == [0, 0]
    else:
        result = cluster.run("--launcher", launcher, mode="train")
        assert result.returncode == 0, result.stdout + result.stderr
    reports = cluster.reports()
    check_layout(cluster, reports, per_node_launcher=launcher in ("pdsh", "ssh", "no_ssh"))
    for r in reports.values():
        assert r["losses"] == reference_losses  # same ranks, same data, same collectives: bit-equal
