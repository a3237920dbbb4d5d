"""Names upstream DeepSpeed's users and tests import, and what each does here.

Each one either works as upstream documents it (leaf-module defaults, the combined gather
handle, the throughput timer, the checkpoint file name) or stands for a feature this package
does not build, in which case using it says so (NVMe's `AsyncIOBuilder`, the stage-0
mixed-precision wrappers).
"""

import os

import pytest
import torch

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)
from deepspeed.utils.timer import ThroughputTimer
from tests.unit.common import DistributedTest
from tests.unit.test_engine import batches, engine_run


def test_leaf_module_defaults_are_what_the_config_starts_from():
    from deepspeed.runtime.zero.leaf_module_config import (
        DEFAULT_LEAF_MODULE_CLASSES,
        DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
        DEFAULT_LEAF_MODULE_NAMES,
    )

    leaf = DeepSpeedZeroConfig().leaf_module
    # Lists, so that a config's fields compare equal to them, as callers check.
    assert leaf.classes == DEFAULT_LEAF_MODULE_CLASSES and "MixtralSparseMoeBlock" in leaf.classes[0]
    assert (
        leaf.names == DEFAULT_LEAF_MODULE_NAMES == []
        and leaf.name_suffixes == DEFAULT_LEAF_MODULE_NAME_SUFFIXES
    )
    assert leaf.is_default()
    leaf.classes.append("my.Block")  # a config's list is its own copy
    assert "my.Block" not in DEFAULT_LEAF_MODULE_CLASSES
    custom = DeepSpeedZeroConfig(leaf_module={"classes": "my.Block", "names": "layer.0"}).leaf_module
    assert custom.classes == ["my.Block"] and custom.names == ["layer.0"] and not custom.is_default()


def test_multiple_all_gather_handles_pass_keywords_to_each_handle():
    from deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles

    seen = []

    class KeywordOnly:
        def wait(self, *, handle_dependency=True):
            seen.append(("kw", handle_dependency))

    class Plain:
        def wait(self):
            seen.append(("plain", None))

    MultipleAllGatherHandles([KeywordOnly(), KeywordOnly()]).wait(handle_dependency=False)
    assert seen == [("kw", False), ("kw", False)]
    seen.clear()
    MultipleAllGatherHandles([Plain(), KeywordOnly()]).wait()  # no keyword: each handle's default
    assert seen == [("plain", None), ("kw", True)]


def test_async_io_builder_is_compatible_where_ops_build():
    from deepspeed.ops.aio import AsyncIOBuilder
    from deepspeed.ops.op_builder import ALL_OPS, CPUAdamBuilder
    from deepspeed.runtime.swap_tensor import MIN_SWAPPABLE_BYTES

    assert AsyncIOBuilder.NAME == "async_io" and isinstance(ALL_OPS["async_io"], AsyncIOBuilder)
    # It needs what every JIT op needs (a compiler, ninja), so it agrees with cpu_adam's answer.
    assert AsyncIOBuilder().is_compatible() is CPUAdamBuilder().is_compatible()
    assert deepspeed.ops.__compatible_ops__["async_io"] is AsyncIOBuilder().is_compatible()
    assert AsyncIOBuilder().absolute_name() == "deepspeed.ops.aio.async_io_op"
    assert MIN_SWAPPABLE_BYTES == 1 << 20  # upstream's threshold, which callers size models by


def test_stage0_wrapper_names_refuse_construction():
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for cls in (BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer):
        assert issubclass(cls, DeepSpeedOptimizer)
        with pytest.raises(NotImplementedError, match=rf"{cls.__name__} is not built.*every stage"):
            cls(opt)


def test_model_ckpt_name_for_rank():
    from deepspeed.checkpoint.utils import get_model_ckpt_name_for_rank

    assert get_model_ckpt_name_for_rank("ck/global_step3", "00") == os.path.join(
        "ck/global_step3", "mp_rank_00_model_states.pt"
    )
    with pytest.raises(ValueError, match=r"mp_rank_str must be a string of digits.*got 0"):
        get_model_ckpt_name_for_rank("ck", 0)


def test_zero_section_parses_alone_from_deprecated_keys_and_whole_config_checks_stage():
    # Alone, the section has no stage to check against (upstream builds it this way).
    assert isinstance(
        DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig
    )
    assert isinstance(
        DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig
    )
    assert DeepSpeedZeroConfig(
        stage3_gather_fp16_weights_on_model_save=True
    ).gather_16bit_weights_on_model_save
    # A whole config says the stage; below stage 3 the block has nothing to move: dropped (warned).
    below = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"cpu_offload_param": True}})
    assert below.zero_config.offload_param is None
    DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 3, "cpu_offload_param": True}})


def test_throughput_timer_counts_from_start_step():
    timer = ThroughputTimer(batch_size=4, start_step=1)
    timer.stop(global_step=True)  # before any start(): nothing happens
    assert (timer.initialized, timer.micro_step_count, timer.global_step_count) == (False, 0, 0)
    for micro in range(2):  # global step 1, not timed (before start_step)
        timer.start()
        timer.stop(global_step=micro == 1)
    assert (timer.micro_step_count, timer.global_step_count, timer.total_elapsed_time) == (2, 1, 0.0)
    assert timer.avg_samples_per_sec() == 0.0
    timer.start()
    assert timer.start_time > 0  # timed from start_step on
    timer.stop()
    assert timer.step_elapsed_time == timer.total_elapsed_time == timer.end_time - timer.start_time
    timer.start()
    timer.stop(global_step=True)
    assert timer.step_elapsed_time == 0.0 and timer.global_step_count == 2  # reset at the boundary
    assert timer.avg_samples_per_sec() == pytest.approx(4 / timer.total_elapsed_time)
    with pytest.raises(ValueError, match=r"batch_size >= 1.*got 0"):
        ThroughputTimer(batch_size=0)


class TestEngineThroughputTimer(DistributedTest):
    world_size = 1

    def test_engine_starts_at_forward_and_stops_at_step(self):
        engine, _ = engine_run(batches(3, seed=5), gas=2)
        timer = engine.tput_timer
        assert timer.batch_size == engine.train_micro_batch_size_per_gpu() * 2
        assert (timer.micro_step_count, timer.global_step_count) == (6, 3)
        assert timer.total_elapsed_time > 0  # the third step, past start_step=2, was timed
        assert timer.avg_samples_per_sec() > 0


def _padded_slice(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s partition of `full` under DeepSpeed's shard math (zeros past the end)."""
    size = -(-full.numel() // world)
    flat = torch.zeros(size * world, dtype=torch.float32)
    flat[: full.numel()] = full.detach().reshape(-1).float()
    return flat[rank * size : (rank + 1) * size]


class TestOptimizerShardViews(DistributedTest):
    world_size = 2

    def test_grad_partitions_and_flat_masters_are_this_ranks_shards(self):
        import deepspeed.comm as dist

        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        torch.manual_seed(1)
        reference = torch.nn.Linear(5, 3)  # 15 weights: partitions of 8, the last padded by one
        model = torch.nn.Linear(5, 3)
        model.load_state_dict(reference.state_dict())
        engine, *_ = deepspeed.initialize(model=model, config=config)
        rank, world = dist.get_rank(), dist.get_world_size()
        x = torch.arange(10.0).view(2, 5)  # the same batch on both ranks: the average is its gradient
        # One sub-group per parameter: its master, this rank's padded fp32 shard, in order.
        flat = engine.optimizer.fp32_partitioned_groups_flat
        assert len(flat) == 2 and [g[0] for g in engine.optimizer.fp16_groups] == list(model.parameters())
        for master, p in zip(flat, reference.parameters()):
            assert torch.equal(master, _padded_slice(p, rank, world))
        assert engine.optimizer.get_fp32_grad_partitions() == {}  # nothing reduced yet
        for _ in range(2):  # a second backward without a step adds to the shards
            engine.backward(engine(x).sum())
            reference(x).sum().backward()
            parts = engine.optimizer.get_fp32_grad_partitions()
            assert set(parts) == {0} and set(parts[0]) == {0, 1}, parts
            for i, p in enumerate(reference.parameters()):
                torch.testing.assert_close(parts[0][i], _padded_slice(p.grad, rank, world))
                assert parts[0][i].dtype == torch.float32
            assert [t.data_ptr() for t in engine.optimizer.averaged_gradients[0]] == [
                t.data_ptr() for t in parts[0].values()
            ]
        # Upstream's per-sub-group norms: each parameter's whole gradient norm, on every rank.
        norms = engine.optimizer._get_norm_groups()
        for norm, p in zip(norms, reference.parameters()):
            torch.testing.assert_close(norm, p.grad.norm())
        engine.step()
        torch.testing.assert_close(
            torch.linalg.vector_norm(torch.stack(norms)), engine.get_global_grad_norm()
        )
        assert engine.optimizer.get_fp32_grad_partitions() == {}  # a step frees them
        # The wrapped optimizer's state is keyed by them (upstream's test reads `step` this way).
        for master in engine.optimizer.fp32_partitioned_groups_flat:
            assert engine.optimizer.optimizer.state[master]["momentum_buffer"].shape == master.shape


class TestSkipInitUnderInit(DistributedTest):
    world_size = 2

    def test_meta_built_module_is_partitioned_when_materialised(self):
        from torch.nn.utils import skip_init

        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.patching import originals_in_place

        with deepspeed.zero.Init(
            config_dict_or_path={"train_batch_size": 2, "zero_optimization": {"stage": 3}}
        ):
            layer = skip_init(torch.nn.Linear, 10, 10)
            meta = torch.nn.Linear(4, 4, device="meta")  # still on meta: nothing to partition yet
        assert originals_in_place()  # to_empty is torch's again
        assert layer.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
        assert layer.weight.ds_tensor.numel() == 50 and layer.bias.ds_tensor.numel() == 5
        with deepspeed.zero.GatheredParameters(layer.weight):
            assert layer.weight.shape == (10, 10)
        assert meta.weight.device.type == "meta" and not hasattr(meta.weight, "ds_id")
        meta.to_empty(device="cpu")  # outside Init: torch's own, nothing partitioned
        assert not hasattr(meta.weight, "ds_id") and meta.weight.shape == (4, 4)


def test_elastic_checkpoint_warns_that_it_is_deprecated(monkeypatch):
    said = []
    monkeypatch.setattr("deepspeed.utils.logger.warning", lambda msg, *a, **k: said.append(str(msg)))
    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=False)
    assert said == []
    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert any("elastic checkpointing is deprecated" in m.lower() for m in said), said


class TestRecoveryScriptPermissions(DistributedTest):
    world_size = 1

    def test_saved_script_is_executable_and_a_refusal_is_logged(self, tmp_path):
        from unittest import mock

        from deepspeed.utils import logger

        engine, _ = engine_run(batches(1, seed=2))
        engine.save_checkpoint(str(tmp_path), tag="t")
        script = tmp_path / "zero_to_fp32.py"
        assert os.access(script, os.X_OK)
        logged = []
        # Patched here, in the rank, and undone here: ranks are pooled across tests.
        with mock.patch.object(logger, "info", lambda msg, *a, **k: logged.append(str(msg))):
            engine._change_recovery_script_permissions(str(tmp_path / "missing.py"))  # stat fails: logged
        assert len(logged) == 1 and "could not make" in logged[0] and "missing.py" in logged[0]


def test_fused_adam_builder_needs_nothing_built():
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.ops.op_builder import ALL_OPS, FusedAdamBuilder

    builder = ALL_OPS["fused_adam"]
    assert isinstance(builder, FusedAdamBuilder) and builder.is_compatible() and builder.is_built()
    assert deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME] is True
    assert builder.load().FusedAdam is FusedAdam  # the pure-torch multi-tensor Adam


def test_torch_written_optimizer_builders_are_compatible_and_load_their_classes():
    """Upstream's tests and callers ask these builders before choosing the optimizers."""
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from deepspeed.ops.op_builder import ALL_OPS, CPUAdagradBuilder, CPULionBuilder, FusedLionBuilder

    for builder_class, attribute, cls in (
        (CPUAdagradBuilder, "DeepSpeedCPUAdagrad", DeepSpeedCPUAdagrad),
        (CPULionBuilder, "DeepSpeedCPULion", DeepSpeedCPULion),
        (FusedLionBuilder, "FusedLion", FusedLion),
    ):
        builder = ALL_OPS[builder_class.NAME]
        assert isinstance(builder, builder_class) and builder.is_compatible() and builder.is_built()
        assert deepspeed.ops.__compatible_ops__[builder_class.NAME] is True
        assert getattr(builder.load(), attribute) is cls
