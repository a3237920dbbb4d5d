"""Sharded ZeRO-3 checkpoints: elastic load, zero_to_fp32, crash safety, 16-bit export.

[Note: one 2-rank checkpoint shared by the load tests]
The harness runs each world size in its own pool of ranks, and pools cannot nest, so a
test at world size 1 or 4 cannot itself start a 2-rank save. Instead the module-scoped
fixture `two_rank_checkpoint` runs in the pytest parent process and calls the harness's
`_run_distributed` on `_SaveOnTwo` (a `DistributedTest` whose name pytest does not
collect) at world size 2. Those ranks train for `SAVE_STEPS`, save, record the gathered
parameters, then train `MORE_STEPS` more (the run that never stopped) and record its
losses and parameters in `reference.pt`. The load tests at world sizes 1, 2 and 4, and
the zero_to_fp32 tests (plain, in the parent process), read that directory.
"""

import logging
import os
import subprocess
import sys
import time
from collections import OrderedDict, defaultdict, namedtuple
from unittest import mock

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint import layout, sharded
from deepspeed.checkpoint import load as checkpoint_load
from deepspeed.checkpoint.errors import CheckpointError
from deepspeed.checkpoint.layout import model_states_name, optim_states_name
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.utils import zero_to_fp32
from tests.unit.common import DistributedTest, _run_distributed
from tests.unit.test_engine import GLOBAL_BATCH, WIDTH, TinyLM, batches, gathered_params, my_slice, train

SAVE_STEPS, MORE_STEPS = 3, 2
CLIENT_STATE = {"epoch": 7, "note": "resume here"}


class BufferedLM(TinyLM):
    """TinyLM plus a persistent buffer (saved) and a non-persistent one (not saved)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def train_config(micro=None, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": micro or GLOBAL_BATCH // dist.get_world_size(),
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 10},
        },
        # Small parameters stay gathered: loading must refresh them too.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 50},
    }
    cfg.update(extra)
    return cfg


def zero_config(stage, offload=False):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 50}
    if offload:  # the optimizer becomes DeepSpeedCPUAdam, which keeps its step count as an int
        zero["offload_optimizer"] = {"device": "cpu"}
    return zero


def build(cfg, seed=42, model_cls=BufferedLM):
    torch.manual_seed(seed)
    engine, *_ = deepspeed.initialize(model=model_cls(), config=cfg)
    return engine


def all_data():
    return batches(SAVE_STEPS + MORE_STEPS, seed=3)


def assert_equal_params(got, expected):
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


class _SaveOnTwo(DistributedTest):
    """Not collected: the fixture below runs it at world size 2 (see the module note)."""

    world_size = 2

    def test_save(self, path, stage=3, offload=False):
        data = all_data()
        engine = build(train_config(zero_optimization=zero_config(stage, offload)))
        train(engine, data[:SAVE_STEPS])
        engine.save_checkpoint(path, client_state=CLIENT_STATE)
        saved = gathered_params(engine.module)
        buffers = {n: b.clone() for n, b in engine.module.named_buffers()}
        losses = train(engine, data[SAVE_STEPS:])
        final = gathered_params(engine.module)
        if dist.get_rank() == 0:
            reference = {"saved": saved, "buffers": buffers, "losses": losses, "final": final}
            torch.save(reference, os.path.join(path, "reference.pt"))


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("two_rank_checkpoint"))
    _run_distributed(_SaveOnTwo, "test_save", 2, {"path": path})
    return path


@pytest.fixture(scope="module")
def two_rank_stage2_checkpoint(tmp_path_factory):
    """The same run at ZeRO stage 2 (full parameters, sharded gradients and optimizer state)."""
    path = str(tmp_path_factory.mktemp("two_rank_stage2_checkpoint"))
    _run_distributed(_SaveOnTwo, "test_save", 2, {"path": path, "stage": 2})
    return path


@pytest.fixture(scope="module")
def two_rank_stage2_offload_checkpoint(tmp_path_factory):
    """The same run at ZeRO stage 2 with the optimizer offloaded to the CPU (DeepSpeedCPUAdam)."""
    path = str(tmp_path_factory.mktemp("two_rank_stage2_offload_checkpoint"))
    _run_distributed(_SaveOnTwo, "test_save", 2, {"path": path, "stage": 2, "offload": True})
    return path


def load_reference(path):
    return torch.load(os.path.join(path, "reference.pt"))


# ============================================================================ elastic load


class TestElasticLoad(DistributedTest):
    world_size = [1, 2, 4]

    def test_resume_matches_the_run_that_never_stopped(self, two_rank_checkpoint):
        reference = load_reference(two_rank_checkpoint)
        engine = build(train_config(), seed=0)  # other initial weights: all must come from the file
        path, client_state = engine.load_checkpoint(two_rank_checkpoint)
        assert client_state == CLIENT_STATE
        assert os.path.basename(path).endswith("_model_states.pt") and os.path.isfile(path)
        assert (engine.global_steps, engine.global_samples) == (SAVE_STEPS, SAVE_STEPS * GLOBAL_BATCH)
        assert engine.lr_scheduler.last_batch_iteration == SAVE_STEPS - 1
        assert_equal_params(gathered_params(engine.module), reference["saved"])
        torch.testing.assert_close(engine.module.scale, reference["buffers"]["scale"], rtol=0, atol=0)
        losses = train(engine, all_data()[SAVE_STEPS:])
        if dist.get_world_size() == 2:
            assert losses == reference["losses"]  # same ranks, same reduction order: bit for bit
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
        final = gathered_params(engine.module)
        for name, value in reference["final"].items():
            torch.testing.assert_close(final[name], value, rtol=1e-5, atol=5e-5, msg=name)

    def test_accumulation_restarts_at_a_boundary_after_a_load(self, two_rank_checkpoint):
        """A load zeroes the gradients, so the next micro-step starts a new accumulation: with
        gradient_accumulation_steps changed since the save (the usual way to keep the global
        batch when the world size changes), and into an engine caught mid-accumulation."""
        ws = dist.get_world_size()
        engine = build(train_config(micro=GLOBAL_BATCH // ws // 2, gradient_accumulation_steps=2), seed=0)
        ids, labels = all_data()[0]

        def micro_step(index):
            engine.backward(engine(my_slice(ids, index, 2), my_slice(labels, index, 2)))
            engine.step()

        micro_step(0)  # one micro-step of two: mid-accumulation
        assert engine.micro_steps == 1
        engine.load_checkpoint(two_rank_checkpoint)  # saved after 3 steps at gradient_accumulation_steps 1
        assert engine.micro_steps == 0 and not engine.is_gradient_accumulation_boundary()
        micro_step(0)  # the first micro-step after the load: no optimizer step
        assert engine.global_steps == SAVE_STEPS and engine.is_gradient_accumulation_boundary()
        micro_step(1)
        assert engine.global_steps == SAVE_STEPS + 1 and engine.was_step_applied()

    def test_the_optimizer_kernel_stays_as_this_run_built_it(self, two_rank_checkpoint):
        """The save ran torch's fused AdamW (the config default); a run that asks for the
        per-tensor loop keeps it after the load, and takes the saved hyperparameters."""
        cfg = train_config()
        cfg["optimizer"]["params"]["fused"] = False
        engine = build(cfg, seed=0)
        engine.load_checkpoint(two_rank_checkpoint)
        for group in engine.optimizer.optimizer.param_groups:
            assert group["fused"] is False and group["weight_decay"] == 0.01

    def test_a_stage2_save_resumes_at_every_stage_with_and_without_offload(
        self, two_rank_stage2_checkpoint, two_rank_stage2_offload_checkpoint
    ):
        # The optimizer state is the same data whatever the stage and wherever it lives: torch's
        # AdamW (step: a tensor) and the offloaded DeepSpeedCPUAdam (step: an int) load each
        # other's, partitioned for this stage and world size. One process group runs every case.
        for saved_with_offload, path in (
            (False, two_rank_stage2_checkpoint),
            (True, two_rank_stage2_offload_checkpoint),
        ):
            reference = load_reference(path)
            for load_stage in (1, 2, 3):
                for offload in (False, True):
                    case = f"saved with offload={saved_with_offload}, loaded at stage {load_stage} offload={offload}"
                    engine = build(train_config(zero_optimization=zero_config(load_stage, offload)), seed=0)
                    engine.load_checkpoint(path)
                    assert_equal_params(gathered_params(engine.module), reference["saved"])
                    losses = train(engine, all_data()[SAVE_STEPS:])
                    torch.testing.assert_close(
                        torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=0, msg=case
                    )
                    final = gathered_params(engine.module)
                    for name, value in reference["final"].items():
                        torch.testing.assert_close(
                            final[name],
                            value,
                            rtol=1e-5,
                            atol=5e-5,
                            msg=lambda m, where=f"{case}, {name}": f"{where}: {m}",
                        )

    def test_module_only_load_in_turns_reads_no_optimizer_state(self, two_rank_checkpoint, monkeypatch):
        """`load_module_only`: the saved weights (fp32 masters too), this run's counters and no
        optimizer state, and never a request for upstream's optimizer-only file (upstream's
        checkpoint tests patch `_get_optimizer_ckpt_name` to check that). Under
        `pipeline_loading_checkpoint` the ranks of the node read one after another."""
        reference = load_reference(two_rank_checkpoint)
        cfg = train_config()
        cfg["zero_optimization"]["pipeline_loading_checkpoint"] = True
        engine = build(cfg, seed=0)
        spans = []
        real_open = sharded.ShardedCheckpoint.open.__func__

        def timed_open(cls, *args, **kwargs):
            start = time.time()
            time.sleep(0.2)  # long enough that two ranks reading at once would overlap
            out = real_open(cls, *args, **kwargs)
            spans.append((start, time.time()))
            return out

        monkeypatch.setattr(sharded.ShardedCheckpoint, "open", classmethod(timed_open))
        with mock.patch.object(
            engine, "_get_optimizer_ckpt_name", wraps=engine._get_optimizer_ckpt_name
        ) as name:
            path, _ = engine.load_checkpoint(two_rank_checkpoint, load_module_only=True)
        name.assert_not_called()
        if dist.get_rank() < 2:  # saved on 2 ranks: the others get rank 0's file
            assert path == engine._get_ckpt_name(two_rank_checkpoint, f"global_step{SAVE_STEPS}")
        assert_equal_params(gathered_params(engine.module), reference["saved"])
        assert engine.global_steps == 0 and not engine.optimizer.optimizer.state
        turns = [None] * dist.get_world_size()
        dist.all_gather_object(turns, (dist.get_local_rank(), spans))
        assert [len(s) for _, s in turns] == [1] * len(turns)
        ordered = [s[0] for _, s in sorted(turns)]
        for (_, end), (start, _) in zip(ordered, ordered[1:]):
            assert end <= start, f"local ranks read at the same time: {ordered}"
        monkeypatch.undo()
        # Upstream asserts stage 3 for it: another stage refuses it at the load, on every rank.
        cfg["zero_optimization"]["stage"] = 2
        with pytest.raises(
            CheckpointError, match="pipeline_loading_checkpoint loads rank by rank at stage 3"
        ):
            build(cfg, seed=0).load_checkpoint(two_rank_checkpoint)

    def test_inference_engine_loads_the_weights(self, two_rank_checkpoint):
        reference = load_reference(two_rank_checkpoint)
        base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        engine = build(base, seed=0)
        assert engine.optimizer is None
        path, client_state = engine.load_checkpoint(two_rank_checkpoint)
        assert path is not None and client_state == CLIENT_STATE
        assert_equal_params(gathered_params(engine.module), reference["saved"])
        bf16 = build({**base, "bf16": {"enabled": True}}, seed=0)
        bf16.load_checkpoint(two_rank_checkpoint)
        with deepspeed.zero.GatheredParameters(list(bf16.module.parameters())):
            for name, p in bf16.module.named_parameters():
                assert p.dtype == torch.bfloat16
                assert torch.equal(p.data, reference["saved"][name].to(torch.bfloat16)), name

    def test_nothing_to_load_returns_none(self, tmp_path, two_rank_checkpoint, monkeypatch):
        warned = []
        monkeypatch.setattr(
            checkpoint_load.logger, "warning", lambda message, *a, **k: warned.append(message)
        )
        engine = build(train_config())
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)  # no `latest`
        assert engine.load_checkpoint(str(tmp_path), tag="absent") == (None, None)
        assert engine.load_checkpoint(str(tmp_path / "typo")) == (None, None)  # no such folder
        if dist.get_rank() == 0:  # the warnings are rank 0's
            assert len(warned) == 3 and "typo does not exist" in warned[2], warned
        if dist.get_world_size() > 1:  # one rank asks for a tag that is not there: named everywhere
            tag = f"global_step{SAVE_STEPS}" if dist.get_rank() == 0 else "nope"
            with pytest.raises(CheckpointError, match=r"ranks disagree.*'nope'.*the same arguments"):
                engine.load_checkpoint(two_rank_checkpoint, tag=tag)
            # Naming the tag `latest` names, beside a rank that lets `latest` name it, is one folder.
            latest = f"global_step{SAVE_STEPS}" if dist.get_rank() == 0 else None
            assert engine.load_checkpoint(two_rank_checkpoint, tag=latest)[0] is not None


# ============================================================================ zero_to_fp32 (no torch.distributed)


def test_zero_to_fp32_equals_the_gathered_parameters(two_rank_checkpoint):
    reference = load_reference(two_rank_checkpoint)
    state_dict = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(two_rank_checkpoint)
    assert list(state_dict)[: len(reference["saved"])] == list(reference["saved"])  # model order
    params = {n: t for n, t in state_dict.items() if n in reference["saved"]}
    assert_equal_params(params, reference["saved"])
    assert all(t.dtype == torch.float32 for t in state_dict.values())
    assert torch.equal(state_dict["scale"], reference["buffers"]["scale"])
    assert "scratch" not in state_dict  # non-persistent buffers are not part of a state dict
    tag_dir = os.path.join(two_rank_checkpoint, f"global_step{SAVE_STEPS}")
    assert zero_to_fp32.get_model_state_file(tag_dir, 3).endswith(model_states_name(0))
    assert [os.path.basename(f) for f in zero_to_fp32.get_optim_files(tag_dir)] == [
        optim_states_name(0),
        optim_states_name(1),
    ]
    with pytest.raises(FileNotFoundError):
        zero_to_fp32.get_optim_files(two_rank_checkpoint)


def test_zero_to_fp32_cli_writes_bin_and_safetensors(two_rank_checkpoint, tmp_path):
    from safetensors.torch import load_file

    expected = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(two_rank_checkpoint)
    # The console script's module, in a fresh interpreter with no process group.
    out_bin = tmp_path / "model.bin"
    cmd = [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", two_rank_checkpoint, str(out_bin)]
    subprocess.run([*cmd, "-t", f"global_step{SAVE_STEPS}"], check=True, capture_output=True)
    assert_equal_params(torch.load(out_bin), expected)
    # In-process main(): a folder of safetensors shards with an index.
    out_dir = tmp_path / "hf"
    assert (
        zero_to_fp32.main(
            [two_rank_checkpoint, str(out_dir), "--safe_serialization", "--max_shard_size", "2KB"]
        )
        == 0
    )
    shards = sorted(p for p in os.listdir(out_dir) if p.endswith(".safetensors"))
    assert len(shards) > 1 and (out_dir / "model.safetensors.index.json").is_file()
    merged = {}
    for shard in shards:
        merged.update(load_file(str(out_dir / shard)))
    assert_equal_params(merged, expected)
    assert zero_to_fp32.main([str(tmp_path / "nowhere"), str(tmp_path / "x.bin")]) == 1
    with pytest.raises(FileNotFoundError, match="nowhere' does not exist"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "nowhere"))


def test_zero_to_fp32_says_when_an_output_name_is_taken_as_a_folder(
    two_rank_checkpoint, tmp_path, capfd, caplog
):
    with caplog.at_level(logging.WARNING):
        assert zero_to_fp32.main([two_rank_checkpoint, str(tmp_path / "out.txt")]) == 0
    captured = capfd.readouterr()
    logged = captured.out + captured.err + caplog.text
    assert "out.txt does not end in .bin/.pt/.pth/.safetensors" in logged
    assert (tmp_path / "out.txt" / "pytorch_model.bin").is_file()


def test_zero_to_fp32_refuses_what_one_output_file_cannot_honour(two_rank_checkpoint, tmp_path, capfd):
    """A single output file is written in the format its name says, whole: safetensors asked
    for under a pickle's name, or a shard size smaller than the weights, is refused (both were
    ignored: safetensors bytes in a .bin file, one file past the limit)."""
    expected = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(two_rank_checkpoint)
    out = tmp_path / "model.bin"
    assert zero_to_fp32.main([two_rank_checkpoint, str(out), "--safe_serialization"]) == 1
    assert "name it *.safetensors" in capfd.readouterr().err and not out.exists()
    assert zero_to_fp32.main([two_rank_checkpoint, str(out), "--max_shard_size", "1KB"]) == 1
    assert "one file, which cannot be split" in capfd.readouterr().err and not out.exists()
    # A limit the weights fit under, or none, writes the one file; a .safetensors name is safetensors.
    assert zero_to_fp32.main([two_rank_checkpoint, str(out), "--max_shard_size", "1GB"]) == 0
    assert_equal_params(torch.load(out), expected)
    from safetensors.torch import load_file

    safe = tmp_path / "model.safetensors"
    assert zero_to_fp32.main([two_rank_checkpoint, str(safe), "--safe_serialization"]) == 0
    assert_equal_params(load_file(str(safe)), expected)


def test_zero_to_fp32_takes_upstreams_arguments(two_rank_checkpoint, tmp_path, capfd, caplog):
    """Upstream 0.19's signatures: `lazy_mode` fourth (a positional True must not mean
    trust_checkpoint, which is keyword-only everywhere), `convert_zero_checkpoint_to_state_dict`
    with a dtype, and the command line's `-d/--debug`."""
    import inspect

    for fn in (
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint,
        zero_to_fp32.load_state_dict_from_zero_checkpoint,
        zero_to_fp32.convert_zero_checkpoint_to_state_dict,
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict,
    ):
        kind = inspect.signature(fn).parameters["trust_checkpoint"].kind
        assert kind is inspect.Parameter.KEYWORD_ONLY, fn.__name__
    eager = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(two_rank_checkpoint)
    lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(two_rank_checkpoint, None, False, True)
    assert list(lazy) == list(eager)
    for name, value in lazy.items():
        if isinstance(value, zero_to_fp32.LazyFullTensor):
            assert value.shape == eager[name].shape and value.dtype == torch.float32, name
            assert torch.equal(value.contiguous(), eager[name]), name
        else:  # buffers are tensors either way
            assert torch.equal(value, eager[name]), name
    assert sum(isinstance(v, zero_to_fp32.LazyFullTensor) for v in lazy.values()) == len(
        load_reference(two_rank_checkpoint)["saved"]
    )

    paths = zero_to_fp32.convert_zero_checkpoint_to_state_dict(
        two_rank_checkpoint, str(tmp_path / "bf16"), dtype="bf16"
    )
    written = torch.load(paths[0])
    assert list(written) == list(eager)
    for name, t in written.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, eager[name].to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="dtype='int8'"):
        zero_to_fp32.convert_zero_checkpoint_to_state_dict(
            two_rank_checkpoint, str(tmp_path / "x"), dtype="int8"
        )

    out = tmp_path / "half.bin"
    assert zero_to_fp32.main([two_rank_checkpoint, str(out), "--dtype", "float16", "-d"]) == 0
    logged = capfd.readouterr().out + caplog.text  # the logger's stream handler, or pytest's capture
    first = next(iter(eager))
    assert f"{first} {tuple(eager[first].shape)} torch.float16" in logged, logged
    assert all(t.dtype == torch.float16 for t in torch.load(out).values())
    from deepspeed.utils.logging import logger

    assert logger.level != logging.DEBUG  # main() put the level back


def test_zero_to_fp32_names_a_truncated_file(two_rank_checkpoint, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(two_rank_checkpoint, copy)
    victim = copy / f"global_step{SAVE_STEPS}" / optim_states_name(1)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=str(victim)):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(copy))


# ============================================================================ crash safety and errors


def gathered_now(engine):
    return gathered_params(engine.module)


class TestCrashSafety(DistributedTest):
    world_size = 2

    def test_interrupted_saves_leave_the_previous_tag_loadable(self, tmp_path, monkeypatch):
        root = str(tmp_path)
        engine = build(train_config())
        train(engine, all_data()[:1])
        engine.save_checkpoint(root, tag="good")
        good = gathered_now(engine)
        train(engine, all_data()[1:2])

        # A rank dies half-way through writing a shard: that file never appears under its name.
        def torn_save(obj, f):
            f.write(b"half a file")
            raise OSError("disk full (simulated)")

        if dist.get_rank() == 1:
            monkeypatch.setattr(torch, "save", torn_save)
        with pytest.raises(CheckpointError, match="rank 1: OSError: disk full"):
            engine.save_checkpoint(root, tag="torn")
        monkeypatch.undo()
        assert not os.path.exists(os.path.join(root, "torn", model_states_name(1)))
        assert not [n for n in os.listdir(os.path.join(root, "torn")) if n.endswith(".tmp")]

        # Killed between the shard writes and `latest`: every rank raises, `latest` is unchanged.
        def killed(save_dir, tag):
            raise OSError("killed before latest (simulated)")

        monkeypatch.setattr(layout, "write_latest", killed)
        with pytest.raises(CheckpointError, match="rank 0: OSError: killed before latest"):
            engine.save_checkpoint(root, tag="unpublished")
        monkeypatch.undo()
        assert layout.read_latest(root) == "good"
        assert os.path.isfile(os.path.join(root, "unpublished", optim_states_name(1)))

        fresh = build(train_config(), seed=1)
        path, _ = fresh.load_checkpoint(root)
        assert os.path.dirname(path) == os.path.join(root, "good")
        assert_equal_params(gathered_now(fresh), good)

    def test_truncated_or_missing_shard_fails_on_every_rank(self, tmp_path):
        root = str(tmp_path)
        engine = build(train_config())
        train(engine, all_data()[:1])
        engine.save_checkpoint(root, tag="t")
        before = gathered_now(engine)
        victim = os.path.join(root, "t", optim_states_name(1))
        if dist.get_rank() == 0:
            with open(victim, "r+b") as f:
                f.truncate(os.path.getsize(victim) // 2)
        dist.barrier()
        with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
            engine.load_checkpoint(root)
        assert victim in str(info.value)
        assert_equal_params(gathered_now(engine), before)  # nothing was half-loaded
        assert engine.global_steps == 1

        missing = os.path.join(root, "t", model_states_name(1))
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(missing)
        dist.barrier()
        with pytest.raises(CheckpointError, match="missing") as info:
            engine.load_checkpoint(root, tag="t")
        assert missing in str(info.value)

    def test_an_error_seen_by_one_rank_raises_on_all(self, tmp_path, monkeypatch):
        root = str(tmp_path)
        engine = build(train_config())
        engine.save_checkpoint(root)
        if dist.get_rank() == 1:

            def unreadable(directory, *args, **kwargs):
                raise CheckpointError(f"{directory}: unreadable on this node (simulated)")

            monkeypatch.setattr(sharded.ShardedCheckpoint, "open", unreadable)
        with pytest.raises(CheckpointError, match="rank 1: .*unreadable on this node"):
            engine.load_checkpoint(root)

    def test_files_of_two_saves_are_not_mixed(self, tmp_path):
        root = str(tmp_path)
        engine = build(train_config())
        engine.save_checkpoint(root, tag="a")
        train(engine, all_data()[:1])
        engine.save_checkpoint(root, tag="b")
        dist.barrier()
        if dist.get_rank() == 0:
            os.replace(
                os.path.join(root, "b", optim_states_name(1)), os.path.join(root, "a", optim_states_name(1))
            )
        dist.barrier()
        with pytest.raises(CheckpointError, match="different save"):
            engine.load_checkpoint(root, tag="a")


class WiderLM(BufferedLM):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 3 * WIDTH + 2)
        self.down = nn.Linear(3 * WIDTH + 2, WIDTH)


class ExtraLM(BufferedLM):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(WIDTH, 2)


class TestModelMismatch(DistributedTest):
    world_size = 2

    def test_shape_and_name_mismatches_name_the_parameter(self, tmp_path):
        root = str(tmp_path)
        build(train_config()).save_checkpoint(root)
        wider = build(train_config(), model_cls=WiderLM)
        with pytest.raises(CheckpointError, match=r"shape of 'up.weight' is \(37, 12\) in the checkpoint"):
            wider.load_checkpoint(root)
        extra = build(train_config(), model_cls=ExtraLM)
        with pytest.raises(CheckpointError, match="missing from the checkpoint: 'extra.weight'"):
            extra.load_checkpoint(root)
        keep = gathered_now(extra)["extra.weight"]
        extra.load_checkpoint(root, load_module_strict=False)
        assert torch.equal(gathered_now(extra)["extra.weight"], keep)  # not in the file: untouched

    def test_frozen_parameters_and_inference_saves(self, tmp_path):
        root = str(tmp_path)
        engine = build(train_config(), model_cls=FrozenEmbedLM)
        train(engine, all_data()[:1])
        engine.save_checkpoint(root, tag="all")
        engine.save_checkpoint(root, tag="trainable", exclude_frozen_parameters=True)
        saved = gathered_now(engine)
        fresh = build(train_config(), seed=5, model_cls=FrozenEmbedLM)
        fresh.load_checkpoint(root, tag="all")
        assert_equal_params(gathered_now(fresh), saved)  # frozen weights come from their own shards
        other = build(train_config(), seed=5, model_cls=FrozenEmbedLM)
        with pytest.raises(CheckpointError, match="missing from the checkpoint: 'embed.weight'"):
            other.load_checkpoint(root, tag="trainable")
        other.load_checkpoint(root, tag="trainable", load_module_strict=False)
        got = gathered_now(other)
        assert not torch.equal(got["embed.weight"], saved["embed.weight"])  # kept its own init
        assert torch.equal(got["head.weight"], saved["head.weight"])
        trainable = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            root, tag="all", exclude_frozen_parameters=True
        )
        assert "embed.weight" not in trainable and "head.weight" in trainable
        # A checkpoint from an engine without an optimizer has only weights.
        inference = build({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, seed=9)
        inference.save_checkpoint(root, tag="weights")
        trainer = build(train_config())
        with pytest.raises(CheckpointError, match="load_optimizer_states=False"):
            trainer.load_checkpoint(root, tag="weights")
        trainer.load_checkpoint(root, tag="weights", load_optimizer_states=False)
        assert_equal_params(gathered_now(trainer), gathered_now(inference))
        train(trainer, all_data()[:1])  # the masters were loaded too: training goes on from them


class FrozenEmbedLM(BufferedLM):
    def __init__(self):
        super().__init__()
        self.embed.weight.requires_grad_(False)


# ============================================================================ 16-bit export


def bf16_config(gather_on_save=True):
    cfg = train_config(bf16={"enabled": True})
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather_on_save
    return cfg


class TiedLM(BufferedLM):
    def __init__(self):
        super().__init__()
        self.head.weight = self.embed.weight


class TestSave16bit(DistributedTest):
    world_size = [1, 2]

    def test_save_16bit_model_equals_gathered_params(self, tmp_path):
        engine = build(bf16_config(), model_cls=TiedLM)
        train(engine, all_data()[:1])
        assert engine.zero_gather_16bit_weights_on_model_save()
        assert engine.save_16bit_model(str(tmp_path), "model16.bin") is True
        expected = {}
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            for name, p in engine.module.named_parameters(remove_duplicate=False):
                expected[name] = p.data.detach().clone()
        consolidated = engine._zero3_consolidated_16bit_state_dict()
        if dist.get_rank() != 0:
            assert consolidated is None
            return
        saved = torch.load(tmp_path / "model16.bin")
        assert list(saved) == list(engine.module.state_dict())  # same keys, same order
        for name, value in expected.items():
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], value), name
        assert saved["head.weight"].data_ptr() == saved["embed.weight"].data_ptr()  # tied: stored once
        assert torch.equal(saved["scale"], engine.module.scale)

    def test_flag_off_saves_nothing_at_stage_3_only(self, tmp_path):
        engine = build(bf16_config(gather_on_save=False))
        assert engine.zero_gather_16bit_weights_on_model_save() is False
        assert engine.save_16bit_model(str(tmp_path)) is False
        assert not os.path.exists(tmp_path / "pytorch_model.bin")
        # Stages 0-2 hold whole weights: the flag is a stage-3 setting and they always save.
        for stage in (0, 1, 2):
            cfg = bf16_config(gather_on_save=False)
            cfg["zero_optimization"]["stage"] = stage
            engine = build(cfg, model_cls=TiedLM)
            path = tmp_path / f"stage{stage}"
            assert engine.save_16bit_model(str(path)) is True
            if dist.get_rank() == 0:
                saved = torch.load(path / "pytorch_model.bin")
                assert list(saved) == list(engine.module.state_dict())
                for name, value in engine.module.state_dict().items():
                    assert torch.equal(saved[name], value), name


# ============================================================================ clone_tensors_for_torch_save


def test_clone_tensors_for_torch_save_makes_compact_copies():
    big = torch.arange(1000.0)
    Pair = namedtuple("Pair", "x y")
    counts = defaultdict(int, {"n": 1})
    item = OrderedDict(a=big[10:20], b=[big[:2], (big[5:7], 3)], c=Pair(big[1:2], "s"), d=counts)
    out = clone_tensors_for_torch_save(item)
    assert type(out) is OrderedDict and type(out["c"]) is Pair and isinstance(out["b"][1], tuple)
    assert out["d"].default_factory is int and out["d"]["n"] == 1 and out["c"].y == "s"
    assert torch.equal(out["a"], big[10:20]) and out["a"].untyped_storage().nbytes() == 10 * 4
    assert out["b"][0].data_ptr() != big.data_ptr() and out["b"][1][1] == 3
    out["a"].zero_()
    assert big[10] == 10  # a copy, not a view
