"""`ds_report` prints the op table and the environment, and honours its flags."""

import re

import pytest
import torch

import deepspeed
from deepspeed import env_report
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import ALL_OPS, CPUAdamBuilder
from deepspeed.ops.op_builder.async_io import probe_io_uring


def run_report(capsys, *argv):
    assert env_report.main(list(argv)) == 0
    return capsys.readouterr().out


def value_of(out, label):
    match = re.search(rf"^{re.escape(label)} \.+ (.*)$", out, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{out}"
    return match.group(1)


def test_general_info(capsys):
    out = run_report(capsys, "--hide_operator_status")
    assert value_of(out, "deepspeed version") == deepspeed.__version__
    assert value_of(out, "torch version") == torch.__version__
    assert value_of(out, "torch cuda version") == str(torch.version.cuda)
    assert value_of(out, "deepspeed install path").endswith("deepspeed")
    accel = get_accelerator()
    assert value_of(out, "accelerator") == accel._name
    assert value_of(out, "communication backend") == accel.communication_backend_name()
    assert value_of(out, "device count") == str(accel.device_count())
    assert "cpu_adam" not in out


def test_half_precision_lines_say_training_runs_even_without_native_math(capsys, monkeypatch):
    """On the CPU, `fp16 supported` is upstream's native-math answer; the line must not read as
    "fp16 does not work" when fp16 training runs (emulated)."""
    accel = get_accelerator()
    if accel._name != "cpu":
        pytest.skip("the CPU accelerator's wording")
    monkeypatch.setattr(type(accel), "is_fp16_supported", lambda self: False)
    out = run_report(capsys, "--hide_operator_status")
    fp16 = value_of(out, "fp16 supported")
    assert fp16.startswith("False (no native math: torch emulates it, slower"), fp16
    assert fp16.endswith("fp16 training still runs on this CPU)"), fp16
    assert value_of(out, "bf16 supported").startswith(f"{accel.is_bf16_supported()} (")


def test_op_table(capsys):
    out = run_report(capsys)
    op = ALL_OPS["cpu_adam"]
    row = re.search(r"^cpu_adam\s+(\[\w+\])\s+(\[\w+\])", out, re.MULTILINE)
    assert row is not None, out
    assert row.group(1) == ("[YES]" if op.is_compatible() else "[NO]")
    assert row.group(2) == ("[YES]" if op.is_built() else "[NO]")
    assert value_of(out, "deepspeed version") == deepspeed.__version__


class Incompatible(CPUAdamBuilder):
    NAME = "ds_test_missing_op"

    def incompatibility_reasons(self):
        return ["no compiler in this test"]


@pytest.mark.parametrize("hide", [False, True])
def test_incompatible_op_reasons_and_hiding(capsys, monkeypatch, hide):
    monkeypatch.setitem(ALL_OPS, Incompatible.NAME, Incompatible())
    out = run_report(capsys, *(["--hide_errors_and_warnings"] if hide else []))
    assert re.search(rf"^{Incompatible.NAME}\s+\[NO\]\s+\[NO\]", out, re.MULTILINE), out
    assert ("no compiler in this test" in out) is not hide


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit):
        env_report.main(["--no_such_flag"])


def test_async_io_row_and_backend(capsys):
    out = run_report(capsys)
    op = ALL_OPS["async_io"]
    row = re.search(r"^async_io\s+(\[\w+\])", out, re.MULTILINE)
    assert row is not None and row.group(1) == ("[YES]" if op.is_compatible() else "[NO]"), out
    if op.is_compatible():
        note = value_of(out, "async_io backend")
        assert note.startswith(("io_uring: a ring sets up here", "thread_pool: io_uring is not usable")), note
        assert note.startswith("io_uring") == (probe_io_uring() == ""), note
    else:
        assert "async_io backend" not in out


def test_async_io_backend_note_says_how_the_backend_was_chosen(monkeypatch):
    op = ALL_OPS["async_io"]
    monkeypatch.setenv("DS_AIO_BACKEND", "thread_pool")
    assert op.backend_note() == "thread_pool: set by DS_AIO_BACKEND=thread_pool"
    monkeypatch.setenv("DS_AIO_BACKEND", "io_uring")
    usable = probe_io_uring() == ""
    assert op.backend_note().startswith("io_uring: set by DS_AIO_BACKEND=io_uring")
    assert ("handles raise" in op.backend_note()) is not usable
    monkeypatch.setenv("DS_AIO_BACKEND", "libaio")
    assert "libaio: invalid (choose from auto, io_uring, thread_pool)" in op.backend_note()
    monkeypatch.delenv("DS_AIO_BACKEND")
    monkeypatch.setattr(op, "is_built", lambda: False)  # ds_report before the first build
    reason = probe_io_uring()
    note = op.backend_note()
    assert note.endswith(
        "probed from Python; the op is not built yet)"
        if reason
        else "DS_AIO_BACKEND=thread_pool forces the thread pool"
    )
    assert note.startswith(
        "thread_pool: io_uring is not usable (io_uring_setup failed" if reason else "io_uring: a ring sets up"
    )
