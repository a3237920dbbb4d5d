"""The `deepspeed` launcher: rank environment and arguments, failure handling, bad options.

End-to-end tests run the real launcher in a subprocess with `--num_procs`, which keeps torch
out of the launcher, on a helper script that does not import torch either, so each run
costs a fraction of a second.
"""

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from deepspeed.launcher import launch, runner
from deepspeed.utils.numa import parse_range_list
from tests.unit.common import LogRecords, get_free_port

SCRIPTS = os.path.join(os.path.dirname(__file__), "launcher_scripts")
RANK_SCRIPT = os.path.join(SCRIPTS, "rank_script.py")
RUN_TIMEOUT_S = 60
DIST_ENVS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def launcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", *args]


def clean_env() -> dict:
    """The test process's environment without any rank variables of its own."""
    return {k: v for k, v in os.environ.items() if k not in DIST_ENVS}


def run_launcher(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        launcher_cmd(*args), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=clean_env(), cwd=cwd
    )


def reports(stdout: str) -> dict[int, dict]:
    by_rank = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            report = json.loads(line)
            by_rank[int(report["RANK"])] = report
    return by_rank


# ----------------------------------------------------------------------------- end to end


def test_two_ranks_get_env_and_local_rank():
    port = str(get_free_port())
    result = run_launcher(
        "--num_procs", "2", "--master_port", port, RANK_SCRIPT, "--mode", "report", "--x", "1"
    )
    assert result.returncode == 0, result.stderr
    got = reports(result.stdout)
    assert sorted(got) == [0, 1]
    for rank, report in got.items():
        assert report["LOCAL_RANK"] == str(rank)
        assert report["WORLD_SIZE"] == report["LOCAL_WORLD_SIZE"] == "2"
        assert report["MASTER_ADDR"] == "127.0.0.1"
        assert report["MASTER_PORT"] == port
        assert report["local_rank_arg"] == rank
        # upstream order: --local_rank first, then the user's arguments untouched
        assert report["argv"] == [f"--local_rank={rank}", "--mode", "report", "--x", "1"]


def test_module_and_per_rank_logs(tmp_path):
    log_dir = tmp_path / "logs"
    args = ["--num_procs", "2", "--enable_each_rank_log", str(log_dir), "--master_addr", "localhost"]
    result = run_launcher(*args, "--module", "rank_script", "--mode", "report", cwd=SCRIPTS)
    assert result.returncode == 0, result.stderr
    assert reports(result.stdout) == {}  # the ranks wrote to their logs instead
    # Named as upstream names them: `<local start time, %Y%m%d%H%M%S>_rank<N>.log`, one prefix per job.
    logs = sorted(path.name for path in log_dir.iterdir())
    assert len(logs) == 2 and all(re.fullmatch(r"\d{14}_rank[01]\.log", name) for name in logs), logs
    assert logs[0][:14] == logs[1][:14]
    for rank in (0, 1):
        (report,) = reports((log_dir / f"{logs[0][:14]}_rank{rank}.log").read_text()).values()
        assert report["RANK"] == str(rank)
        assert report["MASTER_ADDR"] == "localhost"


def test_no_python_and_no_local_rank():
    args = ["--num_procs", "2", "--no_python", "--no_local_rank", sys.executable, RANK_SCRIPT]
    result = run_launcher(*args, "--mode", "report")
    assert result.returncode == 0, result.stderr
    got = reports(result.stdout)
    assert sorted(got) == [0, 1]
    assert all(r["local_rank_arg"] is None and r["argv"] == ["--mode", "report"] for r in got.values())


def test_default_is_one_rank_on_cpu(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    result = run_launcher("--hostfile", "/nonexistent/hostfile", RANK_SCRIPT, "--mode", "report")
    assert result.returncode == 0, result.stderr
    assert reports(result.stdout)[0]["WORLD_SIZE"] == "1"


def test_failing_rank_ends_the_job_promptly(tmp_path):
    start = time.monotonic()
    result = run_launcher("--num_procs", "2", RANK_SCRIPT, "--mode", "fail", "--dir", str(tmp_path))
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stderr
    assert elapsed < 30, f"the launcher took {elapsed:.1f}s; the sleeping rank was not terminated"
    sleeper = int((tmp_path / "rank0.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper, 0)


@contextlib.contextmanager
def launcher_log():
    """The launcher's log messages (its logger does not propagate to pytest's capture)."""
    from deepspeed.utils.logging import logger

    handler = LogRecords()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def test_every_rank_that_failed_at_once_is_named(tmp_path):
    """One rank's exit often fails another at once (a collective with a dead peer), and which
    one a poll sees first is chance: the error names both, with their codes and log files."""
    go = tmp_path / "go"
    wait_then_exit = (
        "import os, sys, time\nwhile not os.path.exists({go!r}): time.sleep(0.001)\nsys.exit({code})"
    )
    children = [
        launch.ChildSpec(
            f"rank {rank}",
            [sys.executable, "-c", wait_then_exit.format(go=str(go), code=code)],
            log_path=str(tmp_path / f"rank{rank}.log"),
        )
        for rank, code in ((0, 1), (1, 3))
    ]
    threading.Timer(2.0, go.touch).start()  # both started and waiting by then
    with launcher_log() as messages:
        code = launch.supervise(children, grace_s=5)
    assert code in (1, 3)
    failure = [m for m in messages if "terminating the others" in m]
    assert failure == [
        f"rank 0 exited with code 1 (its output: {tmp_path / 'rank0.log'}); "
        f"rank 1 exited with code 3 (its output: {tmp_path / 'rank1.log'}); terminating the others"
    ]


def test_sigterm_is_forwarded_to_ranks(tmp_path):
    """Also `--save_pid`, as upstream's: while the ranks run, <tmp>/<deepspeed's pid>.deepspeed
    holds the launcher's pid (on one machine, the same process), and it is gone after."""
    proc = subprocess.Popen(
        launcher_cmd(
            "--save_pid", "--num_procs", "2", RANK_SCRIPT, "--mode", "sigterm", "--dir", str(tmp_path)
        ),
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all((tmp_path / f"rank{r}.ready").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks never became ready"
            time.sleep(0.05)
        assert open(launch.pid_file_path(proc.pid)).read() == str(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.got").read_text() == str(int(signal.SIGTERM))
    assert f"launcher pid: {proc.pid}" in out and not os.path.exists(launch.pid_file_path(proc.pid))


def test_save_pid_refuses_an_existing_pid_file(tmp_path, monkeypatch):
    monkeypatch.setattr(launch.tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / "4242.deepspeed").write_text("1")
    spec = launch.LaunchSpec(user_script=RANK_SCRIPT, num_procs=1, save_pid=4242)
    with pytest.raises(RuntimeError, match="4242.deepspeed exists already"):
        launch.launch_local(spec)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_end_with_a_launcher_killed_outright(tmp_path):
    """Each rank has its own session, so a SIGKILLed launcher forwards nothing; the ranks
    asked the kernel (follow_launcher) to be ended when it dies, and are."""
    proc = subprocess.Popen(
        launcher_cmd("--num_procs", "2", RANK_SCRIPT, "--mode", "follow", "--dir", str(tmp_path)),
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
        proc.kill()
        proc.wait()
        assert all(_wait_gone(pid, 10.0) for pid in pids), f"ranks {pids} outlived their launcher"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_a_rank_whose_launcher_is_gone_does_not_join(monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv(launch.LAUNCHER_PID_ENV, str(gone.pid))
    if sys.platform.startswith("linux"):
        with pytest.raises(
            RuntimeError, match=f"launcher \\(pid {gone.pid}\\) that started this rank has exited"
        ):
            launch.follow_launcher()
    monkeypatch.setenv(launch.LAUNCHER_PID_ENV, str(os.getppid()))  # alive, not our parent: a wrapper
    launch.follow_launcher()


def test_main_raises_systemexit_on_a_failed_job_and_applies_the_log_level(tmp_path):
    """As upstream's runner.main: a failed job raises SystemExit with its code (a caller that
    ignores the return value still stops), success returns 0; -q / --log_level set the
    launcher's log level."""
    from deepspeed.utils.logging import logger

    level = logger.level
    try:
        with pytest.raises(SystemExit) as exc:
            runner.main(["-q", "--num_procs", "2", RANK_SCRIPT, "--mode", "fail", "--dir", str(tmp_path)])
        assert exc.value.code == 3
        assert logger.level == logging.ERROR
        port = str(get_free_port())
        args = ["--log_level", "debug", "--num_procs", "1", "--master_port", port, RANK_SCRIPT]
        assert runner.main(args) == 0
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(level)
    ns, _ = launch._parse_launch_args(["--log_level=info", "--quiet", "train.py"])
    assert (ns.log_level, ns.quiet) == ("info", True)


# ----------------------------------------------------------------------------- bad command lines

BAD_ARGS = [
    (["--num_nodes", "2"], "--num_nodes=2, but the hostfile lists 1 hosts"),
    (["--node_rank", "1"], "only meaningful with --no_ssh"),
    (["--no_ssh"], "--node_rank=N"),
    (["--include", "worker-1:0"], "host 'worker-1' is not in the hostfile"),
    (["--include", "localhost:0", "--exclude", "localhost:1"], "mutually exclusive"),
    (["--num_procs", "2", "--include", "localhost:0"], "cannot be combined"),
    (["--include", "localhost:5"], "'localhost' has no slots [5]; it has [0, 1]"),
    (["--exclude", "localhost"], "leaves no devices"),
    (["--launcher", "foo"], "--launcher 'foo' is unknown"),
    (["--elastic_training"], "elastic training is not supported"),
    (["--autotuning", "tune"], "--autotuning is not supported"),
    (["--num_procs", "0"], "must be a positive number"),
    (["--bind_core_list", "0", "--num_procs", "2"], "fewer cores than ranks"),
    (["--num_procs", "3"], "these hosts have fewer slots: {'localhost': 2}"),
    (["--bind_core_list", "a-b"], "bad core list"),
    (
        ["--bind_core_list", "0,4096", "--num_procs", "2"],
        "cores [4096] of the core list are not available here",
    ),
]


@pytest.mark.parametrize("args, message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_args_give_clear_errors(args, message, capsys, tmp_path):
    hostfile = tmp_path / "hostfile"  # fixes the local device count, whatever the machine has
    hostfile.write_text("localhost slots=2\n")
    with pytest.raises(SystemExit) as exc:
        runner.main(["--hostfile", str(hostfile), *args, RANK_SCRIPT])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "deepspeed: error:" in err and message in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["/nonexistent/train.py"], "does not exist"),
        (["--module", "--no_python", "pkg"], "mutually exclusive"),
    ],
)
def test_bad_script_gives_clear_error(args, message, capsys):
    with pytest.raises(SystemExit):
        runner.main(args)
    assert message in capsys.readouterr().err


def test_what_local_ranks_need_is_checked_first(capsys, tmp_path):
    """On this machine, a --no_python program that cannot run and a per-rank log path that is a
    file are refused by name before any rank starts (they were tracebacks from a started job)."""
    not_a_dir = tmp_path / "logs"
    not_a_dir.write_text("")
    cases = [
        (["--no_python", str(tmp_path / "missing.sh")], "--no_python runs"),
        (["--enable_each_rank_log", str(not_a_dir), RANK_SCRIPT], "is a file; name a directory"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exc:
            runner.main(["--hostfile", str(tmp_path / "none"), *args])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_remote_filter_without_hostfile_is_refused(capsys):
    with pytest.raises(SystemExit):
        runner.main(["--hostfile", "/nonexistent/hostfile", "--include", "worker-1:0", RANK_SCRIPT])
    assert "host 'worker-1' is not this machine, and there is no hostfile" in capsys.readouterr().err


# ----------------------------------------------------------------------------- helpers


def test_local_hostfile_and_include_exclude(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one local host\nlocalhost slots=4\n")

    def pool(*args):
        return runner.resolve_pool(runner.parse_args(["-H", str(hostfile), *args, "x.py"]))[0]

    assert pool() == {"localhost": [0, 1, 2, 3]}
    assert pool("-i", "localhost:0,2") == {"localhost": [0, 2]}
    assert pool("-e", "localhost:1") == {"localhost": [0, 2, 3]}
    assert pool("--num_gpus", "2") == {"localhost": [0, 1]}
    # Open MPI's max_slots bounds oversubscription: accepted when it allows the slots.
    from deepspeed.launcher.hostfile import parse_hostfile_text

    assert parse_hostfile_text("a slots=2 max_slots=4\nb slots=2") == {"a": 2, "b": 2}
    with pytest.raises(ValueError, match="line 1 .*max_slots=M' with M >= slots, got 'max_slots=1'"):
        parse_hostfile_text("a slots=2 max_slots=1")


def test_no_hostfile_means_this_machine():
    def pool(*args):
        return runner.resolve_pool(runner.parse_args(["-H", "/nonexistent/hostfile", *args, "x.py"]))

    with launcher_log() as messages:
        assert pool("--num_procs", "3") == ({"localhost": [0, 1, 2]}, False)
    # a hostfile named on the command line that is not there may be a typo: said, not silent
    assert messages == ["hostfile '/nonexistent/hostfile' does not exist; running on this machine only"]
    # any name of this machine works in a filter
    assert pool("--include", f"{runner.socket.gethostname()}:0") == ({"localhost": [0]}, False)


def test_core_lists():
    assert parse_range_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert launch.split_cores([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    # As upstream's launcher: out of order, overlapping or backwards lists are refused (a core
    # named twice would bind two ranks to it).
    for bad, why in (
        ("3-1", "runs backwards"),
        ("8,2-6", "ascending"),
        ("0,2-6,5-9", "ascending"),
        ("0,x", "not a core"),
    ):
        with pytest.raises(ValueError, match=f"bad core list .*{why}"):
            parse_range_list(bad)


def test_rank_command_and_env():
    spec = launch.LaunchSpec(user_script="train.py", user_args=["--lr", "1"], num_procs=4, master_port=1234)
    assert launch.rank_command(spec, 2) == [sys.executable, "-u", "train.py", "--local_rank=2", "--lr", "1"]
    env = launch.rank_env(spec, 2, base_env={"PATH": "/bin", "RANK": "9"})
    assert env["PATH"] == "/bin"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("2", "2", "4", "1234")
    bound = launch.LaunchSpec(user_script="m", module=True, rank_cores=[[0], [1, 2]], num_procs=2)
    assert launch.rank_command(bound, 1)[2:4] == ["-m", "m"]
    assert launch.rank_env(bound, 1, base_env={})["OMP_NUM_THREADS"] == "2"


def test_the_main_demo_runs_and_every_resumed_engine_agrees(tmp_path):
    """`make demo`'s script through the launcher: the partitioned model equals the plain one,
    the edit is kept, and after each checkpoint switch (stage 3 -> stage 2 with the optimizer
    offloaded -> stage 1, and stage 3 on NVMe) the engines print the same loss. The stage-3 engine's curve is in
    the CSV files the demo says it wrote: the losses it printed, at 8 samples a step."""
    demo = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "zero3_demo.py")
    port = str(get_free_port())
    proc = run_launcher(
        "--num_procs", "2", "--master_port", port, os.path.abspath(demo), "--log_dir", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "partitioned model equals the same-seed plain model: True" in out
    assert "edit kept: True" in out
    pairs = re.findall(r"loss (\d+\.\d+), (?:stage 2 \+ CPU optimizer|stage 1) loss (\d+\.\d+)", out)
    assert len(pairs) == 5, out
    assert all(a == b for a, b in pairs), pairs
    on_nvme = re.findall(r"stage 1 loss (\d+\.\d+), stage 3 \+ NVMe loss (\d+\.\d+)", out)
    assert len(on_nvme) == 2 and all(a == b for a, b in on_nvme), out
    log = tmp_path / "zero3_demo"
    assert f"TensorBoard log and CSV files in {log}/" in out, out
    printed = [float(v) for v in re.findall(r"step \d+/10: loss (\d+\.\d+)", out)]
    printed += [float(v) for v in re.findall(r"resumed step \d/3: stage 3 loss (\d+\.\d+), stage 2", out)]
    with open(log / "Demo_mean_loss_over_ranks.csv") as f:
        rows = [line.split(",") for line in f.read().split()][1:]
    assert [int(step) for step, _ in rows] == [8 * (i + 1) for i in range(13)], rows
    assert [round(float(v), 4) for _, v in rows] == printed, (rows, printed)
    assert len(list(log.glob("events.out.tfevents.*"))) == 1
    assert (log / "Train_Samples_train_loss.csv").read_text().count("\n") == 1 + 13
