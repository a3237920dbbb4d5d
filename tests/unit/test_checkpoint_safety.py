"""Loading a checkpoint never runs code planted in its files (see [Note: loading untrusted
checkpoints] in deepspeed/checkpoint/safe_load.py).

A planted file is one of a real 2-rank checkpoint's files, re-saved with one more entry whose
pickle calls `os.system("touch MARKER")` when unpickled: what a file from a model hub could
hold. Each kind of file is planted in its own copy of the checkpoint:

  model_rank0 / model_rank1   a `*_model_states.pt`
  optim                       a `*_optim_states.pt`
  latest                      `latest` names another tag folder, whose model states are planted
  latest_outside              `latest` names `../outside` (a planted folder beside the checkpoint)
  export16                    a planted `pytorch_model.bin` (a 16-bit export) in the checkpoint's
                              folder and tag folder: no load path reads one, so loads succeed

and every load path opens every copy: `engine.load_checkpoint` (1 and 2 ranks: every rank
raises, naming the file), `get_fp32_state_dict_from_zero_checkpoint`,
`convert_zero_checkpoint_to_fp32_state_dict`, the `deepspeed.utils.zero_to_fp32` command line
and the `zero_to_fp32.py` script written into the checkpoint folder (in-process for every
kind, and once each as a real subprocess: exit status 1, the message on stderr). The marker
file is never created. The opt-ins (`trust_checkpoint=True`, `--trust_checkpoint`,
`DEEPSPEED_TRUST_CHECKPOINT=1`) really do unpickle such a file: the marker then appears.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import logging
import os
import pathlib
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint import layout, safe_load
from deepspeed.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from deepspeed.checkpoint.layout import model_states_name, optim_states_name
from deepspeed.utils import zero_to_fp32
from tests.unit.common import DistributedTest, _run_distributed
from tests.unit.test_checkpoint import build, train, train_config
from tests.unit.test_engine import batches

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG = "global_step1"
PLANTED_GLOBAL = f"{os.system.__module__}.system"  # "posix.system" on Linux
# Ordinary client state: every value a plain type the loader allows without an opt-in.
CLIENT_STATE = {
    "epoch": 3,
    "loss": 0.25,
    "note": "resume here",
    "flags": [True, False, None],
    "pair": (1, "a"),
    "seen": {1, 2},
    "blob": b"\x00\x01",
    "nested": {"best": torch.tensor([1.5]), "paths": {"a": 1}},
}
REFUSED_KINDS = ("model_rank0", "model_rank1", "optim", "latest", "latest_outside")
KINDS = REFUSED_KINDS + ("export16",)


class Planted:
    """Pickles as a call of `os.system("touch <marker>")`: the attack, made harmless."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


class PlantedSubprocess(Planted):
    """Pickles as `subprocess.call(["touch", <marker>])`, a module torch does not block."""

    def __reduce__(self):
        return (subprocess.call, (["touch", self.marker],))


class Hyper:
    """A user's own class in client state: outside the allowlist, loadable with an opt-in."""

    def __init__(self, width: int) -> None:
        self.width = width


def plant(path: str, marker: str, payload: type = Planted) -> None:
    """Re-save the checkpoint file `path` with one more entry that runs a command when unpickled."""
    sd = torch.load(path, weights_only=True)
    sd["planted"] = payload(marker)
    torch.save(sd, path)


class _SaveBase(DistributedTest):
    """Not collected: the module fixture runs it at world size 2."""

    world_size = 2

    def test_save(self, path):
        engine = build(train_config())
        train(engine, batches(1, seed=3))
        engine.save_checkpoint(path, client_state=CLIENT_STATE)


def _plant_kind(kind: str, root: str, base: str) -> tuple:
    """Copy the base checkpoint to `root/kind`, plant `kind`; `(folder, marker, refused file)`."""
    folder = os.path.join(root, kind)
    shutil.copytree(base, folder)
    marker = os.path.join(root, f"MARKER_{kind}")
    tag_dir = os.path.join(folder, TAG)
    target = {
        "model_rank0": os.path.join(tag_dir, model_states_name(0)),
        "model_rank1": os.path.join(tag_dir, model_states_name(1)),
        "optim": os.path.join(tag_dir, optim_states_name(1)),
    }.get(kind)
    if kind == "latest":
        target = os.path.join(folder, "evil", model_states_name(0))
        shutil.copytree(tag_dir, os.path.dirname(target))
        layout.write_latest(folder, "evil")
    elif kind == "latest_outside":
        outside = os.path.join(root, "outside")
        shutil.copytree(tag_dir, outside)
        plant(os.path.join(outside, model_states_name(0)), marker)
        with open(os.path.join(folder, "latest"), "w") as f:
            f.write("../outside")
        target = os.path.join(folder, "latest")
    elif kind == "export16":
        for where in (folder, tag_dir):
            torch.save(
                {"w": torch.zeros(2, dtype=torch.bfloat16), "x": Planted(marker)},
                f"{where}/pytorch_model.bin",
            )
        target = None
    if kind in ("model_rank0", "model_rank1", "optim", "latest"):
        plant(target, marker)
    return folder, marker, target


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    """`{"base": folder, kind: (folder, marker, refused file or None)}` (see the module doc)."""
    root = str(tmp_path_factory.mktemp("planted"))
    base = os.path.join(root, "base")
    _run_distributed(_SaveBase, "test_save", 2, {"path": base})
    out = {"base": base, "root": root}
    for kind in KINDS:
        out[kind] = _plant_kind(kind, root, base)
    return out


def assert_refused(err: BaseException, kind: str, target: str) -> None:
    """The message names the file and the refused global (or the `latest` that points away)."""
    text = str(err)
    assert target in text, text
    if kind == "latest_outside":
        assert "'latest' may not point elsewhere" in text, text
    else:
        assert isinstance(err, UnsafeCheckpointError), repr(err)
        assert PLANTED_GLOBAL in text and "trust_checkpoint=True" in text, text
        assert safe_load.TRUST_ENV in text, text


# ============================================================================ zero_to_fp32, no process group


@pytest.mark.parametrize("kind", KINDS)
def test_zero_to_fp32_api_refuses_planted_files(planted, kind, tmp_path):
    folder, marker, target = planted[kind]
    calls = {
        "get_fp32_state_dict": lambda: zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder),
        "convert": lambda: zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
            folder, str(tmp_path / "o.bin")
        ),
        "load_state_dict": lambda: zero_to_fp32.load_state_dict_from_zero_checkpoint(
            torch.nn.Linear(1, 1), folder
        ),
    }
    for call in calls.values():
        if target is None:
            call()  # export16: loads from the sharded files, never opens the export
            continue
        with pytest.raises(CheckpointError) as info:
            call()
        assert_refused(info.value, kind, target)
    assert not os.path.exists(marker), kind
    assert os.path.exists(tmp_path / "o.bin") == (target is None)


@pytest.mark.parametrize("kind", KINDS)
def test_command_line_and_folder_script_exit_1(planted, kind, tmp_path, capsys, monkeypatch):
    folder, marker, target = planted[kind]
    out = str(tmp_path / "o.bin")
    assert zero_to_fp32.main([folder, out]) == (0 if target is None else 1)
    # The script written beside the checkpoint, as `python zero_to_fp32.py . out` runs it.
    monkeypatch.setattr(sys, "argv", ["zero_to_fp32.py", folder, out])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(os.path.join(folder, layout.RECOVERY_SCRIPT), run_name="__main__")
    assert info.value.code == (0 if target is None else 1)
    err = capsys.readouterr().err
    if target is not None:
        assert err.count("zero_to_fp32: error:") == 2 and target in err and not os.path.exists(out)
    assert not os.path.exists(marker), kind


def test_real_subprocesses_exit_1_without_running_it(planted, tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop(safe_load.TRUST_ENV, None)
    for kind, cmd in (
        ("model_rank1", [sys.executable, "-m", "deepspeed.utils.zero_to_fp32"]),
        ("optim", [sys.executable, layout.RECOVERY_SCRIPT]),
    ):
        folder, marker, target = planted[kind]
        done = subprocess.run(
            [*cmd, ".", str(tmp_path / f"{kind}.bin")], cwd=folder, env=env, capture_output=True, text=True
        )
        assert done.returncode == 1, (kind, done.stdout, done.stderr)
        assert os.path.basename(target) in done.stderr and PLANTED_GLOBAL in done.stderr, done.stderr
        assert not os.path.exists(marker), kind


def test_opting_in_unpickles_the_file(planted, tmp_path, monkeypatch):
    """The opt-ins are real: with them a planted `subprocess.call(["touch", ...])` runs.

    A planted `os.system` stays refused even then: torch blocks os / posix / nt / sys.
    """
    monkeypatch.delenv(safe_load.TRUST_ENV, raising=False)
    folder, marker, _ = planted["model_rank0"]
    with pytest.raises(UnsafeCheckpointError, match=f"{PLANTED_GLOBAL} whose module posix is blocked"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder, trust_checkpoint=True)
    assert not os.path.exists(marker)
    for way in ("api", "cli", "env"):
        folder = str(tmp_path / way)
        shutil.copytree(planted["base"], folder)
        marker = str(tmp_path / f"MARKER_{way}")
        plant(os.path.join(folder, TAG, optim_states_name(1)), marker, PlantedSubprocess)
        with pytest.raises(UnsafeCheckpointError, match="commands.call"):  # protocol 2's name
            zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder)
        assert not os.path.exists(marker)
        if way == "api":
            zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder, trust_checkpoint=True)
        elif way == "cli":
            assert zero_to_fp32.main([folder, str(tmp_path / "o.bin"), "--trust_checkpoint"]) == 0
        else:
            monkeypatch.setenv(safe_load.TRUST_ENV, "1")
            zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder)
            monkeypatch.delenv(safe_load.TRUST_ENV)
        assert os.path.exists(marker), way


def test_own_files_hold_only_torchs_safe_types(planted):
    """Our files need no allowlist beyond torch's weights_only set: no pickled classes at all."""
    tag_dir = os.path.join(planted["base"], TAG)
    files = sorted(f for f in os.listdir(tag_dir) if f.endswith(".pt"))
    assert len(files) == 4
    for name in files:
        assert torch.serialization.get_unsafe_globals_in_checkpoint(os.path.join(tag_dir, name)) == [], name


def test_corrupt_files_are_still_reported_as_corrupt(planted, tmp_path):
    folder = str(tmp_path / "corrupt")
    shutil.copytree(planted["base"], folder)
    path = os.path.join(folder, TAG, optim_states_name(0))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder)
    assert not isinstance(info.value, UnsafeCheckpointError) and path in str(info.value)


def _calls_in(tree: ast.AST, owner: str, names: tuple) -> list:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == owner
        and node.func.attr in names
    ]


def test_no_unrestricted_unpickling_in_the_package():
    """Every `torch.load` in deepspeed/ says weights_only=True; no pickle.load(s) / Unpickler."""
    loads = []
    for path in pathlib.Path(REPO, "deepspeed").rglob("*.py"):
        source = path.read_text()
        tree = ast.parse(source)
        assert not _calls_in(tree, "pickle", ("load", "loads", "Unpickler")), path
        assert "Unpickler)" not in source and "weights_only=False" not in source, path
        for call in _calls_in(tree, "torch", ("load",)):
            flags = [k.value for k in call.keywords if k.arg == "weights_only"]
            assert flags and isinstance(flags[0], ast.Constant) and flags[0].value is True, (
                path,
                call.lineno,
            )
            loads.append(path.name)
    assert loads == ["safe_load.py"]  # the one loader


# ============================================================================ the engine, on 1 and 2 ranks


@contextlib.contextmanager
def captured_warnings():
    """The deepspeed logger's warnings on this rank, as text."""
    from deepspeed.utils.logging import logger

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)


class TestEngineLoad(DistributedTest):
    world_size = [1, 2]

    def test_planted_files_raise_on_every_rank(self, planted, monkeypatch):
        monkeypatch.delenv(safe_load.TRUST_ENV, raising=False)
        engine = build(train_config(), seed=0)
        for kind in KINDS:
            folder, marker, target = planted[kind]
            if target is None:
                _, client_state = engine.load_checkpoint(folder)
                assert client_state.keys() == CLIENT_STATE.keys()
                continue
            with pytest.raises(CheckpointError) as info:
                engine.load_checkpoint(folder)
            assert_refused(info.value, kind, target)
            for r in range(dist.get_world_size()):  # every rank refused the file itself
                assert f"rank {r}: {target}" in str(info.value), str(info.value)
            assert not os.path.exists(marker), kind

    def test_client_state_round_trip_and_opt_ins(self, tmp_path, monkeypatch):
        monkeypatch.delenv(safe_load.TRUST_ENV, raising=False)
        root = str(tmp_path)
        engine = build(train_config())
        plain = {**CLIENT_STATE, "args": argparse.Namespace(lr=0.1), "dir": pathlib.Path("/data/x")}
        with captured_warnings() as warned:
            engine.save_checkpoint(root, tag="plain", client_state=plain)
        assert warned.getvalue() == ""
        _, client_state = engine.load_checkpoint(root, tag="plain")
        assert client_state.keys() == plain.keys() and client_state["args"] == plain["args"]
        assert client_state["dir"] == plain["dir"] and torch.equal(
            client_state["nested"]["best"], torch.tensor([1.5])
        )
        assert {k: v for k, v in client_state.items() if k != "nested"} == {
            k: v for k, v in plain.items() if k != "nested"
        }
        # A key the file itself uses is refused on every rank, before anything is written.
        with pytest.raises(CheckpointError, match=r"client_state keys \['global_steps'\].*rename them"):
            engine.save_checkpoint(root, tag="collide", client_state={"global_steps": 1})
        assert not os.path.exists(os.path.join(root, "collide"))
        assert open(os.path.join(root, "latest")).read().strip() == "plain"

        with captured_warnings() as warned:
            engine.save_checkpoint(root, tag="custom", client_state={"hyper": Hyper(8)})
        name = f"{Hyper.__module__}.Hyper"
        if dist.get_rank() == 0:
            assert name in warned.getvalue() and "trust_checkpoint=True" in warned.getvalue()
        with pytest.raises(UnsafeCheckpointError, match=name):
            engine.load_checkpoint(root, tag="custom")
        with torch.serialization.safe_globals([Hyper]):  # allowlist just this type
            assert engine.load_checkpoint(root, tag="custom")[1]["hyper"].width == 8
        assert engine.load_checkpoint(root, tag="custom", trust_checkpoint=True)[1]["hyper"].width == 8
        monkeypatch.setenv(safe_load.TRUST_ENV, "1")  # for clients that call load_checkpoint themselves
        assert engine.load_checkpoint(root, tag="custom")[1]["hyper"].width == 8
        monkeypatch.delenv(safe_load.TRUST_ENV)

        # numpy values: an array or scalar names numpy.dtype, whose instances are of classes
        # (numpy.dtypes.Int64DType) the file never names; trusted, they load as saved.
        import numpy as np

        rng = np.random.RandomState(3).get_state()
        numbers = {"arr": np.arange(3), "scalar": np.float64(1.5), "count": np.int64(7), "rng": rng}
        with captured_warnings() as warned:
            engine.save_checkpoint(root, tag="numpy", client_state=numbers)
        if dist.get_rank() == 0:
            assert "numpy" in warned.getvalue(), warned.getvalue()
        with pytest.raises(UnsafeCheckpointError, match="numpy"):
            engine.load_checkpoint(root, tag="numpy")
        for opt_in in ("argument", "environment"):
            if opt_in == "environment":
                monkeypatch.setenv(safe_load.TRUST_ENV, "1")
            got = engine.load_checkpoint(root, tag="numpy", trust_checkpoint=opt_in == "argument")[1]
            assert np.array_equal(got["arr"], numbers["arr"]) and got["arr"].dtype == np.int64, opt_in
            assert got["scalar"] == 1.5 and type(got["scalar"]) is np.float64, opt_in
            assert got["count"] == 7 and type(got["count"]) is np.int64, opt_in
            assert got["rng"][0] == rng[0] and np.array_equal(got["rng"][1], rng[1]), opt_in
        monkeypatch.delenv(safe_load.TRUST_ENV)
        assert zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root, tag="numpy", trust_checkpoint=True)
