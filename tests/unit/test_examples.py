"""Every script under examples/ runs both ways: plain (`python examples/x.py`, no launcher,
no process group) and under the `deepspeed` launcher at 2 processes, with its own check
passing. The launcher run of `zero3_demo.py` (`make demo`) is in test_launcher.py.
`plot_scalars.py` is a tool, not a training script: it runs on a log written here.
"""

import os
import subprocess
import sys

import pytest

from tests.unit.common import get_free_port
from tests.unit.test_launcher import clean_env, launcher_cmd

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TIMEOUT_S = 120


def run(cmd: list) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    )
    return proc.stdout


def test_every_example_is_covered():
    """A new example must be added to the cases below, or this fails."""
    assert sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py")) == sorted(
        ["build_with_init.py", "plot_scalars.py", "resize_lm_head.py", "zero3_demo.py"]
    )


@pytest.mark.parametrize("script", ["build_with_init.py", "resize_lm_head.py"])
@pytest.mark.parametrize("zero3", [False, True])
def test_check_example_runs_plain(script, zero3):
    out = run([sys.executable, f"examples/{script}"] + (["--zero3"] if zero3 else []))
    mode = "ZeRO-3" if zero3 else "plain (no ZeRO)"
    assert f"[rank 0/1] check: {mode}" in out and ": OK (" in out, out


@pytest.mark.parametrize("script", ["build_with_init.py", "resize_lm_head.py"])
def test_check_example_runs_on_two_ranks(script):
    port = str(get_free_port())
    out = run(launcher_cmd("--num_procs", "2", "--master_port", port, f"examples/{script}", "--zero3"))
    for rank in (0, 1):
        assert f"[rank {rank}/2] check: ZeRO-3" in out, out
    assert "MISMATCH" not in out and out.count(": OK (") == 2, out


def test_main_demo_runs_as_one_plain_process(tmp_path):
    """`python examples/zero3_demo.py`: the same code at world size 1, every resumed engine agreeing."""
    out = run([sys.executable, "examples/zero3_demo.py", "--log_dir", str(tmp_path)])
    assert "on 1 ranks (gloo)" in out, out
    assert "partitioned model equals the same-seed plain model: True" in out
    assert "edit kept: True" in out
    assert "resumed again 2/2" in out, out


def test_plot_scalars_draws_every_tag_of_a_log(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    log_dir = tmp_path / "log"
    writer = SummaryWriter(log_dir=str(log_dir))
    for step in range(1, 6):
        writer.add_scalar("Train/Samples/train_loss", 1.0 / step, step * 8)
        writer.add_scalar("Custom/x", float(step), step)
    writer.close()
    png = tmp_path / "scalars.png"
    out = run([sys.executable, "examples/plot_scalars.py", str(log_dir), str(png)])
    assert "2 scalar(s): Custom/x, Train/Samples/train_loss" in out, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = subprocess.run(
        [sys.executable, "examples/plot_scalars.py", str(tmp_path), str(tmp_path / "none.png")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=TIMEOUT_S,
    )
    assert empty.returncode == 1 and "no scalars under" in empty.stderr, empty.stderr
