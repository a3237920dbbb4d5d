"""`deepspeed.monitor`: the config, the monitors' files, and the events a training run writes.

The training runs read back what rank 0 wrote (TensorBoard events with `EventAccumulator`,
the CSV files with `csv`, wandb's offline run file) and compare it with the losses, learning
rates and loss scales the script saw at the same steps.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.comm import comm as comm_facade
from deepspeed.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
from deepspeed.monitor.csv_monitor import csv_file_name
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.runtime.config import DeepSpeedConfig
from tests.unit.common import DistributedTest

TIMER_EVENTS = [
    "Train/Samples/elapsed_time_ms_forward",
    "Train/Samples/elapsed_time_ms_backward",
    "Train/Samples/elapsed_time_ms_backward_inner",
    "Train/Samples/elapsed_time_ms_backward_allreduce",
    "Train/Samples/elapsed_time_ms_step",
    "Train/Samples/elapsed_time_ms_all_gather",
    "Train/Samples/elapsed_time_ms_reduce_scatter",
    "Train/Samples/elapsed_time_ms_all_reduce",
]
COMM_KINDS = {  # the collectives' milliseconds of each step: the op names each event sums
    "Train/Samples/elapsed_time_ms_all_gather": "all_gather",
    "Train/Samples/elapsed_time_ms_reduce_scatter": "reduce_scatter",
    "Train/Samples/elapsed_time_ms_all_reduce": "all_reduce",
}


# ---------------------------------------------------------------------------------- readers


def read_csv(folder: Path, name: str) -> list:
    """`[(step, value), ...]` of one event's CSV file, after checking its header."""
    with open(folder / csv_file_name(name), newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", name.split("/")[-1]], rows[0]
    return [(int(step), float(value)) for step, value in rows[1:]]


def read_tensorboard(folder: Path) -> dict:
    """`{tag: [(step, value), ...]}` of every scalar in the event files of `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_wandb_history(wandb_dir: Path, patience_s: float = 20.0) -> tuple:
    """(project, group, `{key: [(step, value), ...]}`) of the one offline run under `wandb_dir`.

    wandb's service process writes the file; once in about a dozen runs it was read without
    its run record. Re-read until the record is there (up to `patience_s`), then fail naming
    the record types that were read.
    """
    deadline = time.monotonic() + patience_s
    while True:
        run, history, kinds = _parse_wandb_file(wandb_dir)
        if run is not None:
            return run.project, run.run_group, history
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no run record in wandb's offline file after {patience_s} s; records: {kinds}"
            )
        time.sleep(0.5)


def _parse_wandb_file(wandb_dir: Path) -> tuple:
    """(run record or None, history, {record type: count}) of the offline run's file as it is now.

    The run file is a sequence of protobuf records in LevelDB's log framing: a 7-byte file
    header, then in 32 KiB blocks records of (crc32, length, type) + data, a record split
    over blocks as FIRST / MIDDLE / LAST pieces.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    raw, block = path.read_bytes(), 32768
    assert raw[:4] == b":W&B"
    pos, pending, history, run, kinds = 7, b"", {}, None, {}
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            kinds[record.WhichOneof("record_type")] = kinds.get(record.WhichOneof("record_type"), 0) + 1
            if record.WhichOneof("record_type") == "run":
                run = record.run
            elif record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): item.value_json for item in record.history.item
                }
                for key, value in items.items():
                    if not key.startswith("_"):
                        history.setdefault(key, []).append((record.history.step.num, json.loads(value)))
    return run, history, kinds


# ---------------------------------------------------------------------------------- config


def test_defaults_are_upstreams_and_unknown_keys_warn():
    monitors = DeepSpeedConfig({"train_batch_size": 1}).monitor_config
    assert not monitors.enabled
    assert (monitors.tensorboard.output_path, monitors.tensorboard.job_name) == ("", "DeepSpeedJobName")
    assert (monitors.csv_monitor.output_path, monitors.csv_monitor.job_name) == ("", "DeepSpeedJobName")
    assert (monitors.wandb.project, monitors.wandb.group, monitors.wandb.team) == ("deepspeed", None, None)
    assert monitors.comet.samples_log_interval == 100 and monitors.comet.online is None
    # Upstream's helper reads the same from a dict, monitor_config included.
    helper = get_monitor_config({"monitor_config": {"enabled": True, "tag": "t", "wandb": {"enabled": True}}})
    assert helper.wandb.enabled and not helper.tensorboard.enabled
    with pytest.raises(ValueError, match=r"tensorboard\.enabled"):
        DeepSpeedConfig({"train_batch_size": 1, "tensorboard": {"enabled": "maybe"}})
    with pytest.raises(ValueError, match=r"comet\.samples_log_interval"):
        DeepSpeedConfig({"train_batch_size": 1, "comet": {"samples_log_interval": 0}})


def test_conflicting_monitor_names_both_places():
    block = {"enabled": True, "tag": "run1", "tensorboard": {"enabled": True, "job_name": "a"}}
    with pytest.raises(ValueError, match=r"tensorboard=.*job_name.*'b'.*monitor_config\.tensorboard=.*'a'"):
        DeepSpeedConfig(
            {
                "train_batch_size": 1,
                "monitor_config": block,
                "tensorboard": {"enabled": True, "job_name": "b"},
            }
        )
    # Off at the top level and on inside is also two different values for one monitor.
    with pytest.raises(ValueError, match=r"set twice"):
        DeepSpeedConfig({"train_batch_size": 1, "monitor_config": block, "tensorboard": {"enabled": False}})


def test_missing_packages_raise_naming_the_pip_command(monkeypatch):
    assert importlib.util.find_spec("comet_ml") is None, "this test expects comet_ml not to be installed"
    comet = DeepSpeedConfig({"train_batch_size": 1, "comet": {"enabled": True}}).monitor_config
    with pytest.raises(ImportError, match=r"'comet_ml' is not installed: pip install \"comet_ml>=3\.41\.0\""):
        MonitorMaster(comet)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a),
    )
    for key in ("wandb", "tensorboard"):
        config = DeepSpeedConfig({"train_batch_size": 1, key: {"enabled": True}}).monitor_config
        with pytest.raises(ImportError, match=rf"'{key}' is not installed: pip install {key} "):
            MonitorMaster(config)


def test_monitor_master_writes_every_enabled_monitor(tmp_path):
    """Outside a distributed run the process is rank 0 and writes; bad events are refused."""
    config = DeepSpeedMonitorConfig(
        tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"},
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "csv"},
    )
    master = MonitorMaster(config)
    assert master.enabled and master.is_writer and master.wandb_monitor is None
    master.write_events([("Custom/x y", 1.5, 3), ("Custom/x y", torch.tensor(2.25), torch.tensor(7))])
    master.write_events([("plain", -1.0, 0)])
    assert read_csv(tmp_path / "csv", "Custom/x y") == [(3, 1.5), (7, 2.25)]
    assert (tmp_path / "csv" / "Custom_x_y.csv").exists() and read_csv(tmp_path / "csv", "plain") == [
        (0, -1.0)
    ]
    assert read_tensorboard(tmp_path / "tb") == {"Custom/x y": [(3, 1.5), (7, 2.25)], "plain": [(0, -1.0)]}
    for bad in ([("no step", 1.0)], [(3, 1.0, 1)], [("x", "one", 1)], [("x", 1.0, 1.5)]):
        with pytest.raises(TypeError, match="write_events"):
            master.write_events(bad)
    master.close()
    # A resumed run appends to the same files without a second header.
    MonitorMaster(config).write_events([("plain", 4.0, 8)])
    assert read_csv(tmp_path / "csv", "plain") == [(0, -1.0), (8, 4.0)]
    assert not MonitorMaster().enabled  # no config: nothing on, nothing written


def test_comet_monitor_with_a_stand_in_comet_ml(monkeypatch):
    """comet_ml is not installed here: a stand-in records what the monitor asks of it."""
    import importlib.machinery
    import sys
    import types

    calls = []

    class Experiment:
        def set_name(self, name):
            calls.append(("set_name", name))

        def log_metric(self, name, value, step):
            calls.append(("log_metric", name, value, step))

        def end(self):
            calls.append(("end",))

    fake = types.ModuleType("comet_ml")
    fake.__spec__ = importlib.machinery.ModuleSpec("comet_ml", None)
    fake.start = lambda **kwargs: calls.append(("start", kwargs)) or Experiment()
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    block = {
        "enabled": True,
        "samples_log_interval": 10,
        "project": "p",
        "online": False,
        "experiment_name": "e",
    }
    master = MonitorMaster(DeepSpeedConfig({"train_batch_size": 1, "comet": block}).monitor_config)
    master.write_events([("a", 1.0, 0), ("b", 2.0, 0), ("a", 3.0, 5), ("a", 4.0, 10), ("b", 5.0, 12)])
    master.close()
    start = {
        "api_key": None,
        "project": "p",
        "workspace": None,
        "experiment_key": None,
        "mode": None,
        "online": False,
    }
    assert calls == [
        ("start", start),
        ("set_name", "e"),
        ("log_metric", "a", 1.0, 0),
        ("log_metric", "b", 2.0, 0),
        ("log_metric", "a", 4.0, 10),  # a at 5: under 10 samples after its last
        ("log_metric", "b", 5.0, 12),
        ("end",),
    ]


# ---------------------------------------------------------------------------------- training


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).float().pow(2).mean()


def _config(out: Path, stage: int, gas: int, extra: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": stage},
        "tensorboard": {"enabled": True, "output_path": str(out), "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "csv"},
        **extra,
    }


def _train(config: dict, steps: int) -> tuple:
    """Train `steps` optimizer steps; what the script saw: (losses per step, lrs, loss scales,
    and the collectives' totals from the end of the first step to the end, `comms_totals`)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_Net(), config=config)
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    dtype = torch.half if engine.fp16_enabled() else torch.float
    gen = torch.Generator().manual_seed(1)
    losses, lrs, scales, mark = [], [], [], None
    for _ in range(steps):
        step_losses = []
        for _ in range(gas):
            x = torch.randn(micro * ws, 6, generator=gen)[rank * micro : (rank + 1) * micro]
            loss = engine(x.to(dtype))
            step_losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        losses.append(sum(step_losses) / gas)
        lrs.append(engine.get_lr()[0])
        scales.append(engine.optimizer.loss_scale)
        mark = dist.comms_totals() if mark is None else mark
    return engine, losses, lrs, scales, dist.comms_totals(mark)


def _check_run(out: Path, engine, seen: tuple, timers: bool) -> None:
    """On rank 0: the CSV and TensorBoard files hold what the script saw, at upstream's steps."""
    losses, lrs, scales, comm_after_first_step = seen
    batch = engine.train_batch_size()
    expected = {
        "Train/Samples/train_loss": [(i * batch, loss) for i, loss in enumerate(losses)],  # before the step
        "Train/Samples/lr": [((i + 1) * batch, lr) for i, lr in enumerate(lrs)],  # after it
    }
    if engine.fp16_enabled():
        expected["Train/Samples/loss_scale"] = [((i + 1) * batch, s) for i, s in enumerate(scales)]
    names = set(expected) | (set(TIMER_EVENTS) if timers else set())
    tensorboard = read_tensorboard(out / "tb")
    assert set(tensorboard) == names | {"Custom/x"}, sorted(tensorboard)
    assert sorted(p.name for p in (out / "csv").iterdir()) == sorted(
        csv_file_name(n) for n in names | {"Custom/x"}
    )
    for name, rows in expected.items():
        from_csv = read_csv(out / "csv", name)
        assert from_csv == rows, (name, from_csv, rows)  # exact: the CSV holds repr(float)
        assert [s for s, _ in tensorboard[name]] == [s for s, _ in rows], name
        torch.testing.assert_close(
            [v for _, v in tensorboard[name]], [float(torch.tensor(v)) for _, v in rows]
        )
    for name in TIMER_EVENTS if timers else ():
        rows = read_csv(out / "csv", name)
        assert [s for s, _ in rows] == [s for s, _ in expected["Train/Samples/lr"]], name
        if name in COMM_KINDS:  # steps 2.. add up to what the collectives took since step 1
            seen_ms = sum(
                v["latency_ms"] for op, v in comm_after_first_step.items() if op.startswith(COMM_KINDS[name])
            )
            assert sum(ms for _, ms in rows[1:]) == pytest.approx(seen_ms, rel=1e-6, abs=1e-9), name
        if name != "Train/Samples/elapsed_time_ms_all_reduce":  # ZeRO-3 gathers and reduces every step
            assert all(ms > 0 for _, ms in rows), (name, rows)
    assert read_csv(out / "csv", "Custom/x") == [(3, 1.5)] and tensorboard["Custom/x"] == [(3, 1.5)]


class TestTrainingEvents(DistributedTest):
    world_size = 2

    def test_events_of_zero_runs(self, tmp_path):
        rank = dist.get_rank()
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "z3"), WANDB_SILENT="true")
        cases = (
            # ZeRO-3, two micro-steps per step, timers, wandb too.
            (
                "z3",
                3,
                2,
                {"wall_clock_breakdown": True, "wandb": {"enabled": True, "project": "p", "group": "g"}},
            ),
            # ZeRO-2 under fp16 with a loss scale that grows every 2 steps; LLaMA-Factory's block.
            ("z2", 2, 1, {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}}),
        )
        for name, stage, gas, extra in cases:
            out = tmp_path / name
            config = _config(out, stage, gas, extra)
            if name == "z2":
                config["monitor_config"] = {
                    "enabled": True,
                    "tag": "x",
                    "csv_monitor": config.pop("csv_monitor"),
                }
            engine, *seen = _train(config, steps=4)
            assert engine.monitor.enabled  # on every rank, as upstream
            engine.monitor.write_events([("Custom/x", 1.5, 3)])  # a client's own event
            # Only rank 0 holds monitors; had rank 1 written, every file would hold its rows twice.
            assert (len(engine.monitor.monitors()) > 0) == (rank == 0)
            engine.destroy()  # closes the monitors and withdraws wall_clock_breakdown's collective timing
            assert not comm_facade.comms_logger.timing  # later collectives are not synchronized for it
            dist.barrier()
            if rank == 0:
                _check_run(out, engine, seen, timers=name == "z3")
                if name == "z2":
                    assert len(set(seen[2])) > 1, seen[2]  # the loss scale did change
            if rank == 0 and name == "z3":
                project, group, history = read_wandb_history(out)
                assert (project, group) == ("p", "g")
                losses, lrs, *_ = seen
                batch = engine.train_batch_size()
                assert history["Train/Samples/train_loss"] == [(i * batch, v) for i, v in enumerate(losses)]
                assert history["Train/Samples/lr"] == [((i + 1) * batch, v) for i, v in enumerate(lrs)]
                assert set(TIMER_EVENTS) <= set(history)
                assert "Custom/x" not in history  # step 3 < the run's step: wandb drops it (its rule)
            dist.barrier()
