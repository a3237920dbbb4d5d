"""Multi-node launching without processes: hostfiles, include/exclude, runner command lines,
exported environment, MPI / Slurm environment discovery. (The fake-cluster runs are in
test_launcher_cluster.py.)"""

import os
import socket
import subprocess
import sys

import pytest

from deepspeed.comm import env_discovery
from deepspeed.launcher import hostfile, launch, multinode_runner, runner
from deepspeed.launcher.multinode_runner import JobSpec

POOL = {"w0": [0, 1], "w1": [0, 1]}

# ----------------------------------------------------------------------------- hostfile


def test_hostfile_lines():
    text = "# cluster\n\nw0 slots=4\nw1   slots=2  # smaller\n"
    assert hostfile.parse_hostfile_text(text) == {"w0": 4, "w1": 2}


@pytest.mark.parametrize(
    "text, message",
    [
        ("w0 slots=2\nw1 slots=x\n", "line 2 ('w1 slots=x'): slots must be a positive integer"),
        ("w0 slots=2\nw0 slots=2\n", "line 2 ('w0 slots=2'): host 'w0' is already listed"),
        ("w0\n", "line 1 ('w0'): expected 'hostname slots=N'"),
        ("w0 slots=2 extra\n", "line 1 ('w0 slots=2 extra'): expected"),
        ("w0 slots=0\n", "slots must be a positive integer, got '0'"),
        ("# nothing\n\n", "lists no hosts"),
    ],
)
def test_bad_hostfile_names_the_line(text, message):
    with pytest.raises(ValueError, match="hostfile H") as err:
        hostfile.parse_hostfile_text(text, "H")
    assert message in str(err.value)


def test_read_hostfile(tmp_path):
    assert hostfile.read_hostfile(str(tmp_path / "missing")) is None
    (tmp_path / "h").write_text("w0 slots=1\n")
    assert hostfile.read_hostfile(str(tmp_path / "h")) == {"w0": 1}


def test_include_exclude_and_limits():
    pool = {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3], "w2": [0, 1, 2, 3]}
    assert hostfile.filter_pool(pool, include="w2:1,3@w0") == {"w0": [0, 1, 2, 3], "w2": [1, 3]}
    assert hostfile.filter_pool(pool, exclude="w1@w2:0") == {"w0": [0, 1, 2, 3], "w2": [1, 2, 3]}
    assert hostfile.filter_pool(pool, include="w0:0@w0:2") == {"w0": [0, 2]}
    assert hostfile.limit_pool(pool, num_nodes=2, num_gpus=3) == {"w0": [0, 1, 2], "w1": [0, 1, 2]}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(include="w9:0"), "--include 'w9:0': host 'w9' is not in the hostfile"),
        (dict(include="w0:7"), "--include 'w0:7': 'w0' has no slots [7]; it has [0, 1]"),
        (dict(include="w0:a"), "slots of 'w0' must be comma-separated integers"),
        (dict(include=":0"), "empty host name"),
        (dict(exclude="w0@w1"), "--exclude 'w0@w1' leaves no devices"),
        (dict(include="w0", exclude="w1"), "mutually exclusive"),
    ],
)
def test_bad_filters_name_the_spec(kwargs, message):
    with pytest.raises(ValueError) as err:
        hostfile.filter_pool(POOL, **kwargs)
    assert message in str(err.value)


def test_bad_limits():
    with pytest.raises(ValueError, match=r"--num_nodes=3, but the hostfile lists 2 hosts"):
        hostfile.limit_pool(POOL, num_nodes=3)
    with pytest.raises(ValueError, match=r"fewer slots: \{'w0': 2, 'w1': 2\}"):
        hostfile.limit_pool(POOL, num_gpus=4)


def test_world_info_and_node_layout():
    world = {"w0": [0, 1, 2], "w1": [1, 3]}
    assert hostfile.decode_world_info(hostfile.encode_world_info(world)) == world
    assert launch.node_layout(world, 1) == ([1, 3], 3, 5)
    with pytest.raises(ValueError, match="--node_rank=2 is outside the 2 nodes"):
        launch.node_layout(world, 2)
    with pytest.raises(ValueError, match="not base64-encoded JSON"):
        hostfile.decode_world_info("!!!")


def test_per_node_rank_env():
    spec = launch.LaunchSpec(
        user_script="t.py", num_procs=2, node_rank=1, num_nodes=2, rank_offset=2, world_size=4
    )
    env = launch.rank_env(spec, 1, base_env={})
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "1",
        "4",
        "2",
    )
    assert (env["CROSS_RANK"], env["CROSS_SIZE"]) == ("1", "2")
    assert [c.name for c in launch.rank_children(spec)] == ["rank 2", "rank 3"]


# ----------------------------------------------------------------------------- exported environment


def test_exports_prefixes_and_env_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nB=cwd with spaces\n")
    environ = {
        "NCCL_IB_HCA": "mlx5",
        "PYTHONPATH": "/p",
        "CUDA_VISIBLE_DEVICES": "0",
        "HOME": "/h",
        "FI_X": "1",
    }
    got = multinode_runner.collect_exports(environ, [str(home), str(cwd)])
    assert got == {
        "NCCL_IB_HCA": "mlx5",
        "PYTHONPATH": "/p",
        "FI_X": "1",
        "A": "home",
        "B": "cwd with spaces",
    }
    (cwd / ".deepspeed_env").write_text('Q="a b"\nS = spaced \nP=/opt/bin:$HOME\n')
    assert multinode_runner.collect_exports({}, [str(cwd)]) == {
        "Q": "a b",
        "S": "spaced",
        "P": "/opt/bin:$HOME",
    }
    (cwd / ".deepspeed_env").write_text("GOOD=1\nnot a pair\n")
    with pytest.raises(ValueError, match=r"\.deepspeed_env, line 2 \('not a pair'\): expected NAME=value"):
        multinode_runner.collect_exports({}, [str(cwd)])
    (cwd / ".deepspeed_env").write_text("export FOO=1\n")  # a shell script's line
    with pytest.raises(ValueError, match=r"expected NAME=value; drop the leading 'export'"):
        multinode_runner.collect_exports({}, [str(cwd)])


# ----------------------------------------------------------------------------- runner command lines


def job(**kw) -> JobSpec:
    base = dict(
        pool=dict(POOL),
        user_script="train.py",
        user_args=["--lr", "0.1"],
        master_addr="w0",
        master_port=1234,
        exports={"NCCL_DEBUG": "INFO", "X": "a b"},
        python="/py",
        cwd="/work dir",
    )
    base.update(kw)
    return JobSpec(**base)


def test_exports_expand_variables_on_the_node_and_run_nothing():
    """Through a real shell: `$HOME` is the node's, quotes and spaces are kept, and a command
    substitution or backtick in a value stays text."""
    values = {"P": "/opt/bin:$HOME", "Q": 'say "hi" there', "R": "`id` $(id) \\n $((1+1))"}
    script = "; ".join(multinode_runner.shell_export(k, v) for k, v in values.items())
    script += '; printf "%s\\n" "$P" "$Q" "$R"'
    out = subprocess.run(["bash", "-c", script], env={"HOME": "/node/home"}, capture_output=True, text=True)
    assert out.stdout.splitlines() == ["/opt/bin:/node/home", 'say "hi" there', "`id` $(id) \\n $((1+1))"], (
        out
    )


def test_cwd_leads_every_nodes_pythonpath(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert runner._with_cwd_on_pythonpath({"PYTHONPATH": "/p"})["PYTHONPATH"] == f"{tmp_path}:/p"
    assert runner._with_cwd_on_pythonpath({})["PYTHONPATH"] == str(tmp_path)


def test_pdsh_command():
    r = multinode_runner.PDSHRunner(job(ssh_port=2222, launcher_args=["-R", "ssh"]))
    cmd = r.command()
    assert cmd[:8] == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-R", "ssh"]
    remote = cmd[8]
    assert remote.startswith(
        'export NCCL_DEBUG="INFO"; export X="a b"; cd \'/work dir\'; /py -u -m deepspeed.launcher.launch'
    )
    assert "--node_rank=%n --master_addr=w0 --master_port=1234 train.py --lr 0.1" in remote
    assert "--stop_on_stdin_eof" not in remote
    assert r.env()["PDSH_RCMD_TYPE"] == "ssh" and r.env()["PDSH_SSH_ARGS_APPEND"].endswith("-p 2222")


def test_ssh_commands():
    r = multinode_runner.SSHRunner(job(ssh_port=22, module=True, venv_script="/v/activate"))
    children = r.children()
    assert [c.cmd[:4] for c in children] == [["ssh", "-p", "22", "w0"], ["ssh", "-p", "22", "w1"]]
    assert "--node_rank=1" in children[1].cmd[-1] and "--module" in children[1].cmd[-1]
    assert "source /v/activate; cd" in children[0].cmd[-1]
    assert all(c.stdin == subprocess.PIPE and "--stop_on_stdin_eof" in c.cmd[-1] for c in children)


def test_openmpi_command():
    r = multinode_runner.OpenMPIRunner(job())
    cmd = r.command()
    try:
        assert cmd[:4] == ["mpirun", "-n", "4", "--hostfile"]
        with open(cmd[4]) as f:
            assert f.read() == "w0 slots=2\nw1 slots=2\n"
        assert cmd[5:13] == [
            "-x",
            "NCCL_DEBUG=INFO",
            "-x",
            "X=a b",
            "-x",
            "MASTER_PORT=1234",
            "-x",
            "MASTER_ADDR=w0",
        ]
        assert cmd[13:] == ["/py", "-u", "train.py", "--lr", "0.1"]
    finally:
        r.cleanup()
    assert not os.path.exists(cmd[4])


@pytest.mark.parametrize("name", ["mpich", "impi", "mvapich"])
def test_hydra_commands(name):
    cmd = multinode_runner.RUNNERS[name](job(no_python=True, launcher_args=["-bind-to", "core"])).command()
    assert cmd[:5] == ["mpirun", "-n", "4", "-ppn", "2"]
    assert cmd[5:8] == ["-genv", "NCCL_DEBUG", "INFO"] and "MASTER_ADDR" in cmd
    i = cmd.index("-hosts")
    assert cmd[i : i + 4] == ["-hosts", "w0,w1", "-bind-to", "core"]
    assert cmd[i + 4 :] == ["train.py", "--lr", "0.1"]


def test_slurm_command():
    r = multinode_runner.SlurmRunner(job())
    assert r.command() == [
        "srun", "-n", "4", "--nodes", "2", "--ntasks-per-node", "2", "--nodelist", "w0,w1",
        "--kill-on-bad-exit=1", "--export=ALL", "/py", "-u", "train.py", "--lr", "0.1",
    ]  # fmt: skip
    env = r.env()
    assert (env["X"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("a b", "w0", "1234")
    allocation = multinode_runner.SlurmRunner(job(pool={}, master_addr="", num_nodes=3, ntasks_per_node=4))
    assert allocation.command()[:7] == ["srun", "-n", "12", "--nodes", "3", "--ntasks-per-node", "4"]
    assert "MASTER_ADDR" not in allocation.master_exports()  # the ranks find it from SLURM_*


@pytest.mark.parametrize("name", ["openmpi", "mpich", "slurm"])
def test_mpi_runners_refuse_uneven_or_chosen_slots(name, monkeypatch):
    monkeypatch.setattr(multinode_runner.shutil, "which", lambda prog: "/bin/" + prog)
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        multinode_runner.RUNNERS[name](job(pool={"w0": [0, 1], "w1": [0]})).check()
    with pytest.raises(ValueError, match=r"cannot start ranks on chosen devices \(w1: \[1\]\)"):
        multinode_runner.RUNNERS[name](job(pool={"w0": [0], "w1": [1]})).check()


@pytest.mark.parametrize(
    "name, program", [("pdsh", "pdsh"), ("ssh", "ssh"), ("openmpi", "mpirun"), ("slurm", "srun")]
)
def test_missing_program_is_named(name, program, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(
        ValueError, match=f"--launcher {name} needs the program '{program}', which is not on PATH"
    ):
        multinode_runner.RUNNERS[name](job()).check()


# ----------------------------------------------------------------------------- the deepspeed command


def _plan(tmp_path, *args):
    (tmp_path / "t.py").write_text("")
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\nw2 slots=2\n")
    return runner.plan(runner.parse_args(["-H", str(tmp_path / "hosts"), *args, str(tmp_path / "t.py")]))


def test_plan_modes(tmp_path, monkeypatch):
    monkeypatch.setattr(multinode_runner.shutil, "which", lambda prog: "/bin/" + prog)
    r = _plan(tmp_path, "--exclude", "w1", "--launcher", "ssh")
    assert isinstance(r, multinode_runner.SSHRunner) and r.job.pool == {"w0": [0, 1], "w2": [0, 1]}
    assert r.job.master_addr == "w0" and r.job.master_port == runner.DEFAULT_MASTER_PORT
    node = _plan(tmp_path, "--no_ssh", "--node_rank", "2", "--master_port", "7")
    assert (node.rank_offset, node.world_size, node.num_procs, node.master_addr) == (4, 6, 2, "w0")
    single = _plan(tmp_path, "--include", "w1:1")  # one host left: launched here, as upstream
    assert isinstance(single, launch.LaunchSpec) and single.num_procs == 1
    forced = _plan(tmp_path, "--include", "w1", "--force_multi")
    assert isinstance(forced, multinode_runner.PDSHRunner)


def test_plan_slurm_allocation_without_hostfile(tmp_path, monkeypatch):
    monkeypatch.setattr(multinode_runner.shutil, "which", lambda prog: "/bin/" + prog)
    (tmp_path / "t.py").write_text("")
    args = ["-H", str(tmp_path / "none"), "--launcher", "slurm", "--num_nodes", "2", "--num_gpus", "4"]
    r = runner.plan(runner.parse_args([*args, str(tmp_path / "t.py")]))
    assert r.command()[:7] == ["srun", "-n", "8", "--nodes", "2", "--ntasks-per-node", "4"]
    # --comment goes to srun, as upstream; a job that is not srun's refuses it.
    r = runner.plan(runner.parse_args([*args, "--comment", "run 7", str(tmp_path / "t.py")]))
    assert r.command()[7] == "--comment=run 7"
    with pytest.raises(ValueError, match="--comment='run 7' is passed to srun"):
        _plan(tmp_path, "--launcher", "ssh", "--comment", "run 7")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--no_ssh"], "--node_rank=N"),
        (["--no_ssh", "--node_rank", "3"], "--node_rank=3 is outside the 3 nodes"),
        (["--launcher", "openmpi", "--include", "w0:1@w1"], "--launcher openmpi starts the same number"),
        (["--num_nodes", "2", "--include", "w0"], "cannot be combined"),
    ],
)
def test_bad_multinode_args(args, message, tmp_path, monkeypatch):
    monkeypatch.setattr(multinode_runner.shutil, "which", lambda prog: "/bin/" + prog)
    with pytest.raises(ValueError) as err:
        _plan(tmp_path, *args)
    assert message in str(err.value)


def test_busy_default_port_falls_back_to_a_free_one(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr(runner, "DEFAULT_MASTER_PORT", port)
        chosen = runner.local_master_port(None)
        assert chosen != port and runner.port_is_free(chosen)
        # an explicit busy port fails before any rank starts, naming it (not in rank 0's bind)
        with pytest.raises(ValueError, match=rf"--master_port={port} is in use on this machine"):
            runner.local_master_port(port)
    free = runner.free_port()
    assert runner.local_master_port(free) == free
    with pytest.raises(ValueError, match=r"--master_port=70000 is not a port"):
        runner.local_master_port(70000)


def test_port_left_in_time_wait_by_a_finished_job_is_free(monkeypatch):
    # A finished job's store (which listens with SO_REUSEADDR, as torch's TCPStore does) closed
    # its side of a connection first: that side sits in TIME_WAIT on the store's port, which a
    # new store may listen on at once (Linux allows it when both sockets set SO_REUSEADDR).
    with socket.socket() as store:
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(("", 0))
        store.listen()
        port = store.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = store.accept()
        served.close()  # the store's side closes first and enters TIME_WAIT
        client.close()
    monkeypatch.setattr(runner, "DEFAULT_MASTER_PORT", port)
    assert runner.local_master_port(None) == port
    with socket.socket() as listener:  # and the port really takes a listener with SO_REUSEADDR
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("", port))
        listener.listen()


# ----------------------------------------------------------------------------- env discovery


def test_discovery_openmpi_and_mpich():
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    found = env_discovery.discover({**ompi, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n0"})
    assert found.as_env() == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
    }  # fmt: skip
    pmi = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert env_discovery.discover(pmi).master_addr == "127.0.0.1"  # every rank on this node
    assert (
        env_discovery.discover(
            {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "m"}
        ).rank
        == 1
    )
    with pytest.raises(ValueError, match="MASTER_ADDR is not set and mpi4py is not installed"):
        env_discovery.discover({**ompi, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert env_discovery.discover({}) is None


def test_discovery_slurm():
    step = {
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),2",
        "SLURM_STEP_NODELIST": "gpu[07-09,12]",
    }
    found = env_discovery.discover(step)
    assert (found.rank, found.world_size, found.local_rank, found.local_world_size) == (5, 8, 1, 2)
    assert found.master_addr == "gpu07"
    # An sbatch script's own process (no srun step) is one process, whatever the allocation.
    assert env_discovery.discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None
    # MPI variables win inside an allocation
    mixed = {**step, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert env_discovery.discover(mixed).source == "Open MPI"


@pytest.mark.parametrize(
    "nodelist, first",
    [("n1", "n1"), ("n[3-5]", "n3"), ("a[01,04],b2", "a01"), ("x[2]-ib", "x2-ib"), ("h1,h2", "h1")],
)
def test_first_host(nodelist, first):
    assert env_discovery.first_host(nodelist) == first


def test_init_distributed_discovers_mpi_ranks(tmp_path):
    """A process started by mpirun (variables only, no launcher) joins as the rank they name."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0")
    env.update(OMPI_COMM_WORLD_LOCAL_SIZE="1", MASTER_PORT=str(runner.free_port()))
    code = (
        "import os, deepspeed, deepspeed.comm as dist; deepspeed.init_distributed(dist_backend='gloo');"
        "print(dist.get_rank(), dist.get_world_size(), os.environ['RANK'], os.environ['MASTER_ADDR'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1", "0", "127.0.0.1"]
