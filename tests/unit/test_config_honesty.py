"""Every config key is acted on or refused (issue 10, item 3), and the acted-on ones work.

The walk below visits every field of every config model, nested sections included. Each one
must be either
- refused: listed in its class's `_unsupported`; its default parses and a non-default value
  raises a ValueError naming the dotted key;
- without effect by design: listed in `_no_effect` with the reason (a short, reviewed list);
- acted on: its reader (the field name, or the flat attribute in `READERS`) appears in the
  source of `deepspeed/` outside the config modules.
A new field that is none of these fails `test_every_field_is_acted_on_or_refused`.
See [Note: every key is acted on or rejected] in deepspeed/runtime/config_utils.py.
"""

from __future__ import annotations

import ast
import enum
import itertools
import logging
import os
import subprocess
import sys
import typing
from pathlib import Path, PurePath

import pytest
import torch
from pydantic import BaseModel
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint import layout
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedRootConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.forward_prologue import cast_floating_inputs
from deepspeed.runtime.zero.config import get_zero_config
from deepspeed.runtime.zero.hooks import persistent_states
from deepspeed.runtime.zero.patching import _orig_module_apply
from tests.unit.common import DistributedTest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deepspeed"
CONFIG_MODULES = {
    PACKAGE / "runtime" / "config.py",
    PACKAGE / "runtime" / "config_utils.py",
    PACKAGE / "runtime" / "config_loading.py",
    PACKAGE / "runtime" / "precision_config.py",
    PACKAGE / "runtime" / "zero" / "config.py",
    PACKAGE / "runtime" / "zero" / "offload_config.py",
    PACKAGE / "profiling" / "config.py",
    PACKAGE / "monitor" / "config.py",
    PACKAGE / "comm" / "config.py",
}

# Dotted key -> the name its reader uses, where that is not the field's own name (mostly the
# flat attributes `DeepSpeedConfig` derives). The one place that records who reads what.
READERS = {
    "fp16.enabled": "fp16_enabled",
    "fp16.auto_cast": "fp16_auto_cast",
    "fp16.initial_scale_power": "dynamic_loss_scale_args",
    "fp16.loss_scale_window": "dynamic_loss_scale_args",
    "fp16.hysteresis": "dynamic_loss_scale_args",
    "fp16.consecutive_hysteresis": "dynamic_loss_scale_args",
    "fp16.min_loss_scale": "dynamic_loss_scale_args",
    "bf16.enabled": "bfloat16_enabled",
    "bf16.check_grad_overflow": "bfloat16_check_grad_overflow",
    "optimizer.type": "optimizer_name",
    "optimizer.params": "optimizer_params",
    "scheduler.type": "scheduler_name",
    "scheduler.params": "scheduler_params",
    "zero_optimization.stage": "zero_optimization_stage",
    "zero_optimization.offload_param.device": "offload_from_config",  # zero.Init reads the dict
    "zero_optimization.offload_param.pin_memory": "offload_from_config",
}

# A realistic refused value per key where the generic one would not show the point.
SAMPLES = {
    "zero_optimization.offload_param.device": "nvme",
    "activation_checkpointing": {"partitioned_activations": True},  # not a key configure() reads
    "aio": {"use_gds": True},  # every other upstream key is acted on by NVMe offload's handles
    "checkpoint": {"load_universal": True},
    "data_types": {"grad_accum_dtype": "bf16"},
    "seq_parallel_communication_data_type": "bf16",
    "log_level": "debug",
    "datastates_ckpt": {"host_cache_size": 1},  # how upstream switches it on
}
# Keys that a refused sample needs beside it, to get past other validation first.
SAMPLE_SIBLINGS = {
    "zero_optimization.offload_param.device": {"nvme_path": "/tmp/nvme"},
}


def _nested_model(annotation) -> type | None:
    if isinstance(annotation, type) and issubclass(annotation, DeepSpeedConfigModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def walk_fields(model_cls=DeepSpeedRootConfig, prefix=""):
    """(dotted key, owning class, field name) for every leaf field, sections recursed into."""
    for name, info in model_cls.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        nested = _nested_model(info.annotation)
        if nested is not None:
            yield from walk_fields(nested, key)
        else:
            yield key, model_cls, name


def _names_read_outside_config() -> set:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path in CONFIG_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
    return names


def _non_default(model_cls: type[BaseModel], name: str):
    info = model_cls.model_fields[name]
    default = info.get_default(call_default_factory=True)
    candidates = [info.annotation, *typing.get_args(info.annotation)]
    for kind in candidates:
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return next(m.value for m in kind if m != default)
        if typing.get_origin(kind) is typing.Literal:
            return next(v for v in typing.get_args(kind) if v != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 7 if default >= 0 else 4
    if isinstance(default, float):
        return default / 2
    if any(isinstance(k, type) and issubclass(k, PurePath) for k in candidates):
        return "/tmp/nvme"
    return {"enabled": True}  # the free-form sections


def _config_with(key: str, value, siblings: bool = False) -> dict:
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    if siblings:
        node.update(SAMPLE_SIBLINGS.get(key, {}))
    return cfg


FIELDS = list(walk_fields())
REFUSED = [(k, c, n) for k, c, n in FIELDS if n in c._unsupported]


def test_walk_sees_the_nested_sections():
    keys = {k for k, _, _ in FIELDS}
    assert {
        "fp16.auto_cast",
        "zero_optimization.overlap_comm",
        "zero_optimization.offload_optimizer.ratio",
    } <= keys
    assert len(keys) > 100


def test_rule_tables_name_real_fields_once():
    for model_cls in {c for _, c, _ in FIELDS}:
        fields = set(model_cls.model_fields)
        assert set(model_cls._unsupported) <= fields, model_cls
        assert set(model_cls._no_effect) <= fields, model_cls
        assert not set(model_cls._unsupported) & set(model_cls._no_effect), model_cls
        for reason in model_cls._no_effect.values():
            assert len(reason) > 20  # a reason, not a placeholder


def test_every_field_is_acted_on_or_refused():
    read = _names_read_outside_config()
    unread = []
    for key, model_cls, name in FIELDS:
        if name in model_cls._unsupported or name in model_cls._no_effect:
            continue
        if READERS.get(key, name) not in read:
            unread.append(key)
    assert not unread, (
        f"config keys accepted but never read outside the config modules: {unread}. Act on each, "
        "or list it in its class's _unsupported (see config_utils [Note: every key is acted on or rejected])"
    )


@pytest.mark.parametrize("key, model_cls, name", REFUSED, ids=[k for k, _, _ in REFUSED])
def test_refused_key_names_itself_and_default_parses(key, model_cls, name):
    default = model_cls.model_fields[name].get_default(call_default_factory=True)
    if default is not None:
        shown = default.value if isinstance(default, enum.Enum) else default
        DeepSpeedConfig(_config_with(key, shown))  # the default, written out, parses
    value = SAMPLES.get(key, _non_default(model_cls, name))
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')}=.*not supported") as err:
        DeepSpeedConfig(_config_with(key, value, siblings=True))
    assert "is not supported by this implementation;" in str(err.value)


def test_every_key_is_in_the_docs_table():
    text = (ROOT / "docs" / "config.md").read_text()
    missing = [key for key, _, _ in FIELDS if f"`{key}`" not in text]
    assert not missing, f"docs/config.md lacks {missing}"
    assert "config.md" in (ROOT / "docs" / "index.md").read_text()


def test_aliases_are_refused_too():
    with pytest.raises(ValueError, match=r"zero_optimization\.use_all_reduce_for_fetch_params=True"):
        get_zero_config({"zero_optimization": {"stage3_use_all_reduce_for_fetch_params": True}})


def test_assignment_after_parsing_is_checked():
    cfg = DeepSpeedConfig({"train_batch_size": 1})
    with pytest.raises(ValueError, match=r"legacy_stage1=True"):
        cfg.zero_config.legacy_stage1 = True


def test_offload_optimizer_to_cpu_and_nvme_parse():
    cfg = _config_with("zero_optimization.offload_optimizer", {"device": "cpu", "pin_memory": True})
    block = DeepSpeedConfig(cfg).zero_config.offload_optimizer
    assert block.device == "cpu" and block.pin_memory
    nvme = _config_with("zero_optimization.offload_optimizer", {"device": "nvme", "nvme_path": "/tmp/nvme"})
    assert str(DeepSpeedConfig(nvme).zero_config.offload_optimizer.nvme_path) == "/tmp/nvme"
    with pytest.raises(ValueError, match=r"offload_optimizer.device='nvme' needs nvme_path"):
        DeepSpeedConfig(_config_with("zero_optimization.offload_optimizer", {"device": "nvme"}))


def test_aio_block_is_acted_on_and_gds_refused():
    from deepspeed.runtime.swap_tensor.swap_store import AioSettings

    block = {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 2, "single_submit": True}
    cfg = DeepSpeedConfig({"train_batch_size": 1, "aio": block})
    settings = AioSettings.from_block(cfg.typed_config.aio)
    assert (settings.block_size, settings.queue_depth, settings.thread_count, settings.single_submit) == (
        262144,
        32,
        2,
        True,
    )
    for bad in ({"use_gds": True}, {"bogus": 1}):
        with pytest.raises(ValueError, match=r"aio=.*use_gds \(GPUDirect Storage\) is not implemented"):
            DeepSpeedConfig({"train_batch_size": 1, "aio": bad})


# ----------------------------------------------------------------------------------------
# What HF transformers, accelerate and Lightning write must parse


HF_DOCS_ZERO3 = {
    "fp16": {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": False},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 1048576,
        "stage3_prefetch_bucket_size": 943718,
        "stage3_param_persistence_threshold": 10240,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "checkpoint": {"use_node_local_storage": True},  # Trainer's save_on_each_node
    "zero_allow_untested_optimizer": True,  # the Trainer sets it for its own optimizer
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 8,
    "wall_clock_breakdown": False,
}

HF_DOCS_ZERO2 = {
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
    },
    "train_batch_size": 8,
}

ACCELERATE = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "nvme_path": None},
        "offload_param": {"device": "none", "nvme_path": None},
        "stage3_gather_16bit_weights_on_model_save": False,
    },
    "steps_per_print": float("inf"),
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": True},
}

LIGHTNING = {
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "synchronize_checkpoint_boundary": False,
    },
    "aio": {
        "block_size": 1048576,
        "queue_depth": 8,
        "single_submit": False,
        "overlap_events": True,
        "thread_count": 1,
    },
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 200_000_000,
        "reduce_bucket_size": 200_000_000,
        "sub_group_size": 1_000_000_000_000,
    },
    "train_micro_batch_size_per_gpu": 1,
}


@pytest.mark.parametrize(
    "cfg", [HF_DOCS_ZERO3, HF_DOCS_ZERO2, ACCELERATE, LIGHTNING], ids=["hf3", "hf2", "acc", "pl"]
)
def test_client_written_configs_parse(cfg):
    DeepSpeedConfig(cfg)


def test_switched_off_sections_parse():
    DeepSpeedConfig(
        {
            "train_batch_size": 1,
            "tensorboard": {"enabled": False, "output_path": "runs"},
            "flops_profiler": {"enabled": False, "profile_step": 1},
            "comms_logger": {},
            "amp": {"enabled": False},
            "compile": {"deepcompile": False},
        }
    )


# ----------------------------------------------------------------------------------------
# Acted-on keys: their effect


def test_cast_floating_inputs_leaves_integers():
    ids, x = torch.arange(3), torch.ones(2)
    args, kwargs = (
        cast_floating_inputs((ids, [x]), torch.float16),
        cast_floating_inputs({"m": x}, torch.float16),
    )
    assert args[0].dtype == torch.int64 and args[1][0].dtype == torch.float16
    assert kwargs["m"].dtype == torch.float16


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list = []

    def forward(self, x, ids, mask=None):
        self.seen = [x.dtype, ids.dtype, None if mask is None else mask.dtype]
        return self.lin(x).float().sum()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 7)
        self.c = nn.Linear(7, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


class _WeightTimesInput(torch.nn.Module):
    """loss = (weight * x).sum() with weight 0: one SGD step of lr 1 leaves minus the reduced input."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def _train(extra_config: dict, zero_extra: dict | None = None, steps: int = 3):
    """Train `_Net` under ZeRO-3; returns (engine, full parameters after training)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 40},
        **extra_config,
    }
    cfg["zero_optimization"].update(zero_extra or {})
    torch.manual_seed(0)
    model = _Net()
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4 * ws, 6, generator=gen)[rank * 4 : (rank + 1) * 4]
        engine.backward(engine(x))
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return engine, params


class TestActedOnKeys(DistributedTest):
    world_size = [1, 2]

    def test_prescale_and_predivide_give_the_average(self):
        _, plain = _train({})
        for extra in ({"prescale_gradients": True}, {"gradient_predivide_factor": 4.0}):
            _, scaled = _train(extra)
            for name, p in plain.items():
                torch.testing.assert_close(scaled[name], p, rtol=1e-6, atol=1e-7, msg=f"{extra} {name}")

    def test_gradient_allreduce_op_sum_sums_over_ranks(self):
        """`gradient_allreduce_op`: "mean" averages the ranks' gradients, "sum" (any case) sums
        them, at every stage and with each of upstream's scaling paths."""
        ws, rank = dist.get_world_size(), dist.get_rank()
        inputs = [torch.tensor([1.0, 2.0]) * (r + 1) for r in range(ws)]  # different on each rank
        total = sum(inputs)
        scalings = ({}, {"prescale_gradients": True}, {"gradient_predivide_factor": 2.0})
        for stage, op, scaling in itertools.product((0, 1, 2, 3), ("mean", "SUM"), scalings):
            cfg = {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_clipping": 0.0,
                "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                "zero_optimization": {"stage": stage},
                "gradient_allreduce_op": op,
                **scaling,
            }
            model = _WeightTimesInput()
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            assert engine.gradient_average is (op == "mean")
            engine.backward(engine(inputs[rank]))
            engine.step()
            with deepspeed.zero.GatheredParameters([engine.module.weight]):
                weight = engine.module.weight.detach().clone()
            expected = -total if op == "SUM" else -total / ws
            torch.testing.assert_close(weight, expected, msg=f"stage {stage}, {op}, {scaling}")

    def test_fp16_gradients_are_averaged_before_they_can_overflow(self):
        """Each rank's scaled gradient (49152) fits fp16; their sum would not. Upstream divides
        by the world size before the sum, so no step is skipped at any world size or stage."""
        for stage in (1, 2, 3):
            cfg = {
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "SGD", "params": {"lr": 1e-6}},
                "zero_optimization": {"stage": stage},
                "fp16": {"enabled": True, "initial_scale_power": 15, "hysteresis": 1},
            }
            model = torch.nn.Linear(4, 1, bias=False)
            torch.nn.init.constant_(model.weight, 0.5)
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            engine.backward(engine(torch.full((1, 4), 1.5, dtype=torch.half)).float().sum())
            engine.step()
            assert engine.skipped_steps == 0 and engine.optimizer.cur_scale == 2.0**15, stage
            assert engine.get_global_grad_norm() == pytest.approx(3.0), stage  # four elements of 1.5

    def test_overlap_comm_is_async_and_equal_to_sync(self, monkeypatch):
        """On gloo's own path (overlap is moot through shared memory, checked below)."""
        from deepspeed.comm import comm as facade

        shm_results = {}
        for overlap in (False, True):
            engine, shm_results[overlap] = _train({}, {"overlap_comm": overlap})
            on_shm = facade.completes_on_issue(None, torch.zeros(1))
            assert on_shm == (dist.get_world_size() > 1)  # a group of one has no channel
            assert engine.reducer.reduce_calls > 0 and (engine.reducer.async_calls == 0 or not on_shm)
        for name, p in shm_results[False].items():
            assert torch.equal(shm_results[True][name], p), name
        monkeypatch.setattr(facade, "_shm_channel", lambda group, *tensors: None)
        calls = []
        original = dist.reduce_scatter_tensor

        def counting(*args, **kwargs):
            calls.append(kwargs.get("async_op", False))
            return original(*args, **kwargs)

        monkeypatch.setattr(dist, "reduce_scatter_tensor", counting)
        sync_engine, sync_params = _train({}, {"overlap_comm": False})
        assert calls and not any(calls) and sync_engine.reducer.async_calls == 0
        calls.clear()
        async_engine, async_params = _train({}, {"overlap_comm": True})
        assert calls and all(calls) and async_engine.reducer.async_calls == len(calls)
        assert not async_engine.reducer._in_flight  # flush() waited on everything
        for name, p in sync_params.items():
            assert torch.equal(async_params[name], p), name
            # the same sums in the same order through either transport
            assert torch.equal(shm_results[False][name], p), name

    def test_model_persistence_threshold_caps_persistent_elements(self):
        caps = {}
        for cap in (None, 40, 0):
            zero = {"stage3_param_persistence_threshold": 100}
            if cap is not None:
                zero["stage3_model_persistence_threshold"] = cap
            engine, _ = _train({}, zero, steps=1)
            caps[cap] = sum(s.numel for s in engine.persistent)
        assert caps[None] == 6 * 5 + 5 + 5 * 7 + 7 + 7 * 3 + 3  # every parameter is under 100
        assert 0 < caps[40] <= 40 and caps[0] == 0

    def test_persistent_states_order_and_cap(self):
        with deepspeed.zero.Init():
            model = _Net()
        chosen = persistent_states(model, threshold=100, model_threshold=36)
        assert [s.numel for s in chosen] == [30, 5]  # a.weight, a.bias; then nothing else fits

    def test_override_module_apply(self):
        def body(cfg):
            init = deepspeed.zero.Init(config_dict_or_path=cfg).start()
            try:
                patched = nn.Module.apply is not _orig_module_apply
                seen = []
                nn.Linear(3, 2).apply(
                    lambda m: seen.append(m.weight.numel()) if isinstance(m, nn.Linear) else None
                )
            finally:
                init.stop()
            return patched, seen[0]

        assert body({"zero_optimization": {"stage": 3}}) == (True, 6)  # gathered around fn
        assert body({"zero_optimization": {"stage": 3, "override_module_apply": False}}) == (False, 0)
        assert nn.Module.apply is _orig_module_apply

    def test_fp16_auto_cast_casts_floating_inputs(self):
        for auto_cast, expected in ((True, torch.float16), (False, torch.float32)):
            cfg = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "auto_cast": auto_cast}}
            engine, *_ = deepspeed.initialize(model=_Recorder(), config=cfg)
            x = torch.ones(2, 4, dtype=torch.float16 if not auto_cast else torch.float32)
            engine(x.float() if auto_cast else x, torch.arange(2), mask=torch.ones(2))
            assert engine.module.seen == [torch.float16, torch.int64, expected]

    def test_steps_per_print_logs_every_n_steps(self):
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        from deepspeed.utils.logging import logger

        logger.addHandler(handler)
        old_level = logger.level
        logger.setLevel(logging.INFO)
        try:
            engine, _ = _train({"steps_per_print": 2}, steps=5)
            engine(torch.zeros(4, 6))
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
        steps = [r.getMessage() for r in records if "step=" in r.getMessage()]
        if dist.get_rank() == 0:
            assert [m.split("step=")[1].split(",")[0] for m in steps] == ["2", "4"], [
                r.getMessage() for r in records
            ]
        else:
            assert steps == []


# ----------------------------------------------------------------------------------------
# Item 4: the recovery script exits non-zero on error


def _run_recovery_script(folder: Path, *args: str) -> subprocess.CompletedProcess:
    layout.write_recovery_script(str(folder))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(folder / layout.RECOVERY_SCRIPT), str(folder), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_recovery_script_fails_on_missing_checkpoint(tmp_path):
    result = _run_recovery_script(tmp_path, str(tmp_path / "out.bin"))
    assert result.returncode != 0
    assert "zero_to_fp32: error:" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.bin").exists()


def test_recovery_script_fails_on_corrupt_checkpoint(tmp_path):
    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tmp_path / layout.LATEST_FILE).write_text("global_step1")
    (tag / layout.model_states_name(0)).write_bytes(b"not a torch file")
    result = _run_recovery_script(tmp_path, str(tmp_path / "out.bin"))
    assert result.returncode != 0
    assert "zero_to_fp32: error:" in result.stderr and "Traceback" not in result.stderr
