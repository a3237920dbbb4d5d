"""The typed config: upstream-style configs parse, aliases map, bad input names its key.

Single-process and fast: nothing here touches torch.distributed.
"""

import base64
import copy
import json
import logging

import pytest
import torch

from deepspeed.runtime.config import (
    DeepSpeedBF16Config,
    DeepSpeedConfig,
    DeepSpeedFP16Config,
    DeepSpeedOptimizerConfig,
    DeepSpeedRootConfig,
    DeepSpeedSchedulerConfig,
    load_config_dict,
    resolve_batch_sizes,
)
from deepspeed.runtime.config_utils import CONFIG_WARNINGS, DeepSpeedConfigError
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum, get_zero_config
from deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

# The ZeRO-3 config from the HF transformers DeepSpeed guide, with the "auto" entries
# filled in the way the Trainer fills them. The guide offloads the optimizer to the CPU;
# that is refused until optimizer offload exists (tests/unit/test_config_honesty.py), so
# here its device is "none", as accelerate writes when offload is off.
HF_ZERO3 = {
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 1048576,
        "stage3_prefetch_bucket_size": 943718.4e1,
        "stage3_param_persistence_threshold": 10240,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
}


def zero(section):
    return DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": section}).zero_config


# ----------------------------------------------------------------------------------------
# Valid configs


def test_hf_zero3_config_parses():
    cfg = DeepSpeedConfig(copy.deepcopy(HF_ZERO3), world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        32,
        4,
        2,
    )
    assert cfg.zero_optimization_stage == 3 and cfg.zero_enabled
    assert cfg.zero_config.stage is ZeroStageEnum.weights
    z = cfg.zero_config
    assert z.prefetch_bucket_size == 9437184 and isinstance(z.prefetch_bucket_size, int)
    assert z.param_persistence_threshold == 10240
    assert z.max_live_parameters == 10**9 and z.max_reuse_distance == 10**9
    assert z.sub_group_size == 10**9 and isinstance(z.sub_group_size, int)
    assert z.gather_16bit_weights_on_model_save is True
    assert z.offload_param.device == OffloadDeviceEnum.cpu and z.offload_param.pin_memory
    assert z.offload_optimizer.device == "none" and z.offload_optimizer.pin_memory  # upstream's default
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 2000


def test_hf_config_precision_and_optimizer_attributes():
    cfg = DeepSpeedConfig(copy.deepcopy(HF_ZERO3), world_size=4)
    assert cfg.fp16_enabled and not cfg.bfloat16_enabled and not cfg.bf16_enabled
    assert cfg.loss_scale == 0 and cfg.initial_dynamic_scale == 2**16
    assert cfg.dynamic_loss_scale_args == {
        "init_scale": 2**16,
        "scale_window": 1000,
        "delayed_shift": 2,
        "consecutive_hysteresis": False,
        "min_scale": 1,
    }
    assert cfg.optimizer_name == "adamw"
    assert cfg.optimizer_params["torch_adam"] is True and cfg.optimizer_params["betas"] == [0.9, 0.999]
    assert cfg.scheduler_name == "WarmupLR" and cfg.scheduler_params["warmup_num_steps"] == 500
    assert cfg.world_size == 4
    assert cfg._param_dict["zero_optimization"]["stage"] == 3


def test_defaults_of_a_minimal_config():
    cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2})
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.world_size) == (2, 1, 1)
    assert cfg.zero_optimization_stage == 0 and not cfg.zero_enabled
    assert not cfg.fp16_enabled and not cfg.bfloat16_enabled
    assert cfg.dynamic_loss_scale_args is None
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10  # upstream 0.19's default clips
    assert cfg.optimizer_name is None and cfg.optimizer_params is None and cfg.scheduler_name is None
    assert not cfg.wall_clock_breakdown and not cfg.zero_allow_untested_optimizer
    z = cfg.zero_config
    assert z.reduce_bucket_size == 500_000_000 and z.prefetch_bucket_size == 50_000_000
    assert z.param_persistence_threshold == 100_000 and z.gather_16bit_weights_on_model_save is False
    assert z.enable_sanity_checks is False and z.offload_param is None


def test_static_loss_scale_and_bf16():
    static = DeepSpeedConfig({"train_batch_size": 4, "fp16": {"enabled": True, "loss_scale": 128}})
    assert static.loss_scale == 128 and static.dynamic_loss_scale_args is None
    bf16 = DeepSpeedConfig({"train_batch_size": 4, "bf16": {"enabled": True}})
    assert bf16.bfloat16_enabled and bf16.bf16_enabled and not bf16.fp16_enabled
    assert bf16.loss_scale == 1.0


def test_bfloat16_block_alias():
    cfg = DeepSpeedConfig({"train_batch_size": 4, "bfloat16": {"enabled": True}})
    assert cfg.bfloat16_enabled


def test_get_bfloat16_config_reads_either_key_of_a_raw_dict():
    from deepspeed.runtime.precision_config import get_bfloat16_config

    assert get_bfloat16_config({"bf16": {"enabled": True}}).enabled
    assert get_bfloat16_config(
        {"bfloat16": {"enabled": True, "immediate_grad_update": True}}
    ).immediate_grad_update
    assert not get_bfloat16_config({}).enabled
    with pytest.raises(ValueError, match="bf16.enabled"):
        get_bfloat16_config({"bf16": {"enabled": "sometimes"}})


def test_overlap_comm_defaults_by_stage():
    assert zero({"stage": 3}).overlap_comm is True
    assert zero({"stage": 2}).overlap_comm is False
    assert zero({"stage": 2, "overlap_comm": True}).overlap_comm is True


@pytest.mark.parametrize(
    "name", ["Adam", "ADAMW", "sgd", "OneBitAdam", "Lamb", "Lion", "FusedAdam", "CPUAdam"]
)
def test_deepspeed_optimizer_names_lowercased(name):
    cfg = DeepSpeedConfig({"train_batch_size": 1, "optimizer": {"type": name, "params": {"lr": 0.1}}})
    assert cfg.optimizer_name == name.lower()


def test_other_optimizer_names_kept_for_torch_optim_lookup():
    cfg = DeepSpeedConfig({"train_batch_size": 1, "optimizer": {"type": "RMSprop"}})
    assert cfg.optimizer_name == "RMSprop" and cfg.optimizer_params is None


def test_accepted_upstream_sections_and_flags():
    extras = {
        "train_batch_size": 8,
        "activation_checkpointing": {"partition_activations": False},
        "flops_profiler": {"enabled": False},
        "tensorboard": {"enabled": False},
        "wandb": {"enabled": False},
        "comms_logger": {"enabled": False},
        "aio": {"block_size": 1048576},
        "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "FP32",
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "prescale_gradients": False,
        "gradient_predivide_factor": 2.0,
        "sparse_gradients": False,
        "memory_breakdown": False,
        "dump_state": False,
    }
    cfg = DeepSpeedConfig(extras)
    assert cfg.communication_data_type is torch.float32
    assert cfg.zero_allow_untested_optimizer and not cfg.zero_force_ds_cpu_optimizer
    assert cfg.gradient_predivide_factor == 2.0 and cfg.grad_accum_dtype == "fp32"
    assert not cfg.load_universal_checkpoint and cfg.checkpoint_config["tag_validation"] == "Warn"
    assert cfg.use_node_local_storage


def test_steps_per_print_infinity_from_accelerate():
    cfg = DeepSpeedConfig({"train_batch_size": 1, "steps_per_print": float("inf")})
    assert cfg.steps_per_print == float("inf")


def test_repr_and_print_are_readable(caplog):
    cfg = DeepSpeedConfig(copy.deepcopy(HF_ZERO3), world_size=4)
    assert "zero_stage=3" in repr(cfg) and "train_batch_size=32" in repr(cfg)
    text = cfg.describe("engine config")
    assert text.startswith("engine config:") and "fp16_enabled" in text and '"stage": 3' in text
    cfg.print("engine config")  # logs at INFO; must not raise


# ----------------------------------------------------------------------------------------
# Inputs: dict, JSON file, base64


def test_json_path_and_dict_agree(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_ZERO3))
    from_path = DeepSpeedConfig(str(path), world_size=4)
    from_pathlike = DeepSpeedConfig(path, world_size=4)
    from_dict = DeepSpeedConfig(copy.deepcopy(HF_ZERO3), world_size=4)
    assert from_path.zero_config == from_dict.zero_config == from_pathlike.zero_config
    assert from_path._param_dict == HF_ZERO3


def test_base64_json():
    encoded = base64.urlsafe_b64encode(json.dumps(HF_ZERO3).encode()).decode()
    assert load_config_dict(encoded) == HF_ZERO3


def test_missing_path_names_it():
    with pytest.raises(ValueError, match=r"'/no/such/ds_config\.json' does not exist"):
        DeepSpeedConfig("/no/such/ds_config.json")


def test_bad_json_file_names_path(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 8,,}')
    with pytest.raises(
        ValueError, match=r"broken\.json.* is not valid JSON \(nor HJSON\).*as HJSON: Found ','"
    ):
        DeepSpeedConfig(str(path))


def test_hjson_config_file_reads_as_upstream_reads_it(tmp_path):
    """Comments, trailing commas, quoteless keys and strings (upstream reads files and base64
    configs with `hjson`): the same dict as the plain JSON file."""
    path = tmp_path / "commented.json"
    path.write_text(
        "{\n"
        "  // the HF ZeRO-3 config, annotated\n"
        '  "train_micro_batch_size_per_gpu": 2,  # per rank\n'
        "  gradient_accumulation_steps: 1,\n"
        "  /* a block\n     comment */\n"
        '  "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",},},\n'
        "  optimizer: {\n    type: AdamW\n  }\n"  # a quoteless string runs to the line's end
        "}\n"
    )
    expected = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
        "optimizer": {"type": "AdamW"},
    }
    assert load_config_dict(str(path)) == expected
    assert load_config_dict(base64.b64encode(path.read_bytes()).decode()) == expected
    assert DeepSpeedConfig(str(path), world_size=2).zero_config.offload_param.device == "cpu"
    # zero.Init and deepspeed.checkpointing.configure read a path the same way.
    import deepspeed

    bf16 = tmp_path / "bf16.hjson"
    bf16.write_text("{\n  bf16: {enabled: true}  // trains in bfloat16\n  activation_checkpointing: {\n"
                    "    partition_activations: true\n  }\n}\n")  # fmt: skip
    assert deepspeed.zero.Init(config_dict_or_path=str(bf16), enabled=False).dtype == torch.bfloat16
    try:
        deepspeed.checkpointing.configure(None, deepspeed_config=str(bf16))
        assert deepspeed.checkpointing.SETTINGS.partition_activations is True
    finally:
        deepspeed.checkpointing.reset()
    path.write_text('{"train_batch_size": 8, // twice\n "train_batch_size": 16}')
    with pytest.raises(ValueError, match=r"commented\.json.*duplicate key 'train_batch_size'"):
        load_config_dict(str(path))


def test_duplicate_json_key_rejected(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match=r"dup\.json.*duplicate key 'train_batch_size'"):
        DeepSpeedConfig(str(path))


def test_json_file_must_hold_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"must hold a JSON object, got list"):
        DeepSpeedConfig(str(path))


def test_input_dict_not_modified():
    given = {"train_batch_size": 4, "zero_optimization": {"stage": 3, "cpu_offload_param": True}}
    snapshot = copy.deepcopy(given)
    DeepSpeedConfig(given)
    assert given == snapshot


# ----------------------------------------------------------------------------------------
# Batch-size identity


@pytest.mark.parametrize(
    "train, micro, gas, ws, expected",
    [
        (32, 4, 2, 4, (32, 4, 2)),
        (32, 4, None, 4, (32, 4, 2)),
        (32, None, 2, 4, (32, 4, 2)),
        (None, 4, 2, 4, (32, 4, 2)),
        (32, None, None, 4, (32, 8, 1)),
        (None, 4, None, 4, (16, 4, 1)),
        (None, None, 3, 2, (6, 1, 3)),
    ],
)
def test_batch_identity_fill_in(train, micro, gas, ws, expected):
    assert resolve_batch_sizes(train, micro, gas, ws) == expected


def test_batch_sizes_from_world_size_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = DeepSpeedConfig({"train_batch_size": 16, "gradient_accumulation_steps": 2})
    assert cfg.world_size == 2 and cfg.train_micro_batch_size_per_gpu == 4


def test_world_size_from_mpu():
    class Mpu:
        def get_data_parallel_world_size(self):
            return 3

    cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2}, mpu=Mpu())
    assert cfg.world_size == 3 and cfg.train_batch_size == 6


def test_batch_mismatch_names_all_values():
    with pytest.raises(ValueError, match=r"train_batch_size=30.*=4.*=2.*world_size=4.*4 \* 2 \* 4 = 32"):
        DeepSpeedConfig(
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            world_size=4,
        )


def test_batch_not_divisible():
    with pytest.raises(ValueError, match=r"train_batch_size=10.*not divisible by.*= 12"):
        DeepSpeedConfig({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, world_size=4)
    with pytest.raises(ValueError, match=r"not divisible by world_size \(no gradient accumulation\) = 2"):
        DeepSpeedConfig({"train_batch_size": 7}, world_size=2)


def test_no_batch_size_given():
    with pytest.raises(ValueError, match=r"set train_batch_size or train_micro_batch_size_per_gpu"):
        DeepSpeedConfig({"zero_optimization": {"stage": 3}})


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match=r"train_batch_size: got 0 \(int\).*greater than 0"):
        DeepSpeedConfig({"train_batch_size": 0})


# ----------------------------------------------------------------------------------------
# Aliases and deprecated keys


@pytest.mark.parametrize(
    "alias, field, value",
    [
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size", 123),
        ("stage3_param_persistence_threshold", "param_persistence_threshold", 456),
        ("stage3_model_persistence_threshold", "model_persistence_threshold", 789),
        ("stage3_max_live_parameters", "max_live_parameters", 1000),
        ("stage3_max_reuse_distance", "max_reuse_distance", 2000),
        ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", True),
        ("stage3_module_granularity_threshold", "module_granularity_threshold", 0),
    ],
)
def test_stage3_aliases_and_field_names(alias, field, value):
    assert getattr(zero({"stage": 3, alias: value}), field) == value
    assert getattr(zero({"stage": 3, field: value}), field) == value


def test_deprecated_gather_fp16_alias_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="deepspeed"):
        z = zero({"stage": 3, "stage3_gather_fp16_weights_on_model_save": True})
    assert z.gather_16bit_weights_on_model_save is True
    assert "stage3_gather_fp16_weights_on_model_save" in caplog.text and "deprecated" in caplog.text


def test_deprecated_cpu_offload(caplog):
    # `cpu_offload: true` still means offload_optimizer on the CPU.
    with caplog.at_level(logging.WARNING, logger="deepspeed"):
        assert zero({"stage": 2, "cpu_offload": True}).offload_optimizer.device == OffloadDeviceEnum.cpu
    assert "cpu_offload" in caplog.text and "offload_optimizer" in caplog.text
    assert zero({"stage": 2, "cpu_offload": False}).offload_optimizer is None
    block = zero({"stage": 3, "offload_optimizer": {"device": "none"}}).offload_optimizer
    assert isinstance(block, DeepSpeedZeroOffloadOptimizerConfig) and block.device == OffloadDeviceEnum.none


def test_deprecated_cpu_offload_param_and_pin_memory():
    z = zero({"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True})
    assert isinstance(z.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert z.offload_param.device == "cpu" and z.offload_param.pin_memory
    assert z.offload_optimizer is None


def test_deprecated_key_conflicting_with_new_key():
    with pytest.raises(
        ValueError,
        match=r"zero_optimization: deprecated key 'cpu_offload'.*conflicts with 'offload_optimizer'",
    ):
        zero({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}})


def test_two_spellings_with_different_values():
    with pytest.raises(ValueError, match=r"'prefetch_bucket_size'=1, 'stage3_prefetch_bucket_size'=2"):
        zero({"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2})


def test_two_spellings_with_equal_values():
    assert zero({"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 1}).prefetch_bucket_size == 1
    both = {"train_batch_size": 1, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}
    assert DeepSpeedConfig(both).bfloat16_enabled


def test_legacy_boolean_zero_optimization():
    assert zero(True).stage == ZeroStageEnum.optimizer_states
    assert zero(False).stage == ZeroStageEnum.disabled


def test_get_zero_config_and_enum():
    z = get_zero_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8}})
    assert isinstance(z, DeepSpeedZeroConfig) and z.reduce_bucket_size == 500_000_000
    assert get_zero_config({}).stage == ZeroStageEnum.disabled
    assert [int(s) for s in ZeroStageEnum] == [0, 1, 2, 3]
    assert ZeroStageEnum.weights == 3 and ZeroStageEnum.max_stage == 3


def test_every_field_documented():
    models = (
        DeepSpeedRootConfig,
        DeepSpeedFP16Config,
        DeepSpeedBF16Config,
        DeepSpeedOptimizerConfig,
        DeepSpeedSchedulerConfig,
        DeepSpeedZeroConfig,
        DeepSpeedZeroOffloadParamConfig,
        DeepSpeedZeroOffloadOptimizerConfig,
    )
    for model in models:
        undocumented = [name for name, info in model.model_fields.items() if not info.description]
        assert undocumented == [], f"{model.__name__}: {undocumented}"


def test_assignment_is_validated():
    z = zero({"stage": 3})
    z.reduce_bucket_size = 1e6
    assert z.reduce_bucket_size == 1_000_000
    with pytest.raises(ValueError, match=r"stage: got 7 \(int\); allowed values: 0 \(disabled\)"):
        z.stage = 7


# ----------------------------------------------------------------------------------------
# Invalid configs


@pytest.fixture
def config_warnings(caplog):
    """The config warnings logged inside the test; each is logged once per process otherwise."""
    CONFIG_WARNINGS.reset()
    with caplog.at_level(logging.WARNING, logger="deepspeed"):
        yield caplog
    CONFIG_WARNINGS.reset()


def _lines_naming(caplog, text: str) -> list:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_unknown_top_level_key_is_ignored_with_one_warning_and_suggestion(config_warnings):
    # A typo must stay easy to spot: the warning names the key, says it does nothing, and
    # keeps the suggestion; the rest of the config applies as if the key were absent.
    for _ in range(3):  # HF, zero.Init and initialize each parse the same config
        cfg = DeepSpeedConfig({"train_batch_size": 8, "gradient_acumulation_steps": 4})
    assert cfg.gradient_accumulation_steps == 1
    (line,) = _lines_naming(config_warnings, "gradient_acumulation_steps")
    assert "unknown key 'gradient_acumulation_steps' at the top level has no effect here" in line
    assert "did you mean 'gradient_accumulation_steps'" in line


def test_other_tools_keys_are_ignored(config_warnings):
    # LLaMA-Factory's ds_z3_fp8_config.json carries `comms_config`, which upstream ignores.
    cfg = DeepSpeedConfig({"train_batch_size": 8, "comms_config": {"verbose": False}})
    assert "comms_config" not in cfg.typed_config.model_dump()
    assert _lines_naming(config_warnings, "unknown key 'comms_config' at the top level")


def test_unknown_nested_keys_warn_with_their_full_path(config_warnings):
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket": 5,
                "offload_param": {"device": "cpu", "pin_memroy": False},
            },
        }
    )
    assert cfg.zero_config.prefetch_bucket_size == DeepSpeedZeroConfig().prefetch_bucket_size
    assert cfg.zero_config.offload_param.pin_memory is True  # the misspelt false did nothing
    (zero_line,) = _lines_naming(config_warnings, "'zero_optimization.stage3_prefetch_bucket'")
    assert "in 'zero_optimization'" in zero_line and "did you mean 'stage3_prefetch_bucket_size'" in zero_line
    (offload_line,) = _lines_naming(config_warnings, "'zero_optimization.offload_param.pin_memroy'")
    assert "did you mean 'pin_memory'" in offload_line
    # get_zero_config (zero.Init's path) follows the same policy.
    assert zero({"stage": 3, "no_such_knob": 1}).stage == ZeroStageEnum.weights
    assert _lines_naming(config_warnings, "'zero_optimization.no_such_knob'")


def test_known_key_with_unsupported_value_is_still_refused(config_warnings):
    with pytest.raises(ValueError, match=r"elasticity=.*not supported.*elastic training"):
        DeepSpeedConfig({"train_batch_size": 8, "elasticity": {"enabled": True, "max_train_batch_size": 8}})
    with pytest.raises(ValueError, match=r"zero_optimization\.stage: got 5"):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 5, "unknown_too": 1}})


def test_monitor_blocks_are_typed_and_monitor_config_acts_as_the_top_level():
    cfg = DeepSpeedConfig({"train_batch_size": 8, "tensorboard": {"enabled": True, "output_path": "runs"}})
    assert cfg.monitor_config.tensorboard.output_path == "runs" and cfg.monitor_config.enabled
    assert cfg.monitor_config.tensorboard.job_name == "DeepSpeedJobName"  # upstream's default
    # LLaMA-Factory's block: its own `enabled` and `tag` switch nothing on.
    block = {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}}
    assert not DeepSpeedConfig({"train_batch_size": 8, "monitor_config": block}).monitor_config.enabled
    block["csv_monitor"] = {"enabled": True, "output_path": "logs"}
    monitors = DeepSpeedConfig({"train_batch_size": 8, "monitor_config": block}).monitor_config
    assert monitors.csv_monitor.enabled and monitors.csv_monitor.output_path == "logs"
    assert not monitors.tensorboard.enabled
    with pytest.raises(ValueError, match=r"csv_monitor=.*top level and monitor_config\.csv_monitor="):
        DeepSpeedConfig({"train_batch_size": 8, "monitor_config": block, "csv_monitor": {"enabled": True}})
    same = DeepSpeedConfig(
        {"train_batch_size": 8, "monitor_config": block, "csv_monitor": dict(block["csv_monitor"])}
    )
    assert same.monitor_config.csv_monitor.output_path == "logs"


def test_dotted_top_level_key_sets_the_nested_key(config_warnings):
    # TRL prepares a reference model with these keys beside the nested section.
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 8,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
            "zero_optimization.reduce_bucket_size": 4096,
            "zero_optimization.stage3_param_persistence_threshold": 640,
            "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64,  # TRL's float
            "zero_optimization.offload_param.device": "cpu",
        }
    )
    z = cfg.zero_config
    assert (z.reduce_bucket_size, z.param_persistence_threshold) == (4096, 640)
    assert z.prefetch_bucket_size == 3686  # rounded down, as HF rounds the same formula
    assert z.offload_param.device == OffloadDeviceEnum.cpu
    (line,) = _lines_naming(config_warnings, "'zero_optimization.reduce_bucket_size'")
    assert "sets that nested key to 4096" in line and "upstream DeepSpeed ignores dotted keys" in line
    assert "zero_optimization.reduce_bucket_size" not in cfg.typed_config.model_dump()


def test_dotted_key_without_a_section_creates_it_and_zero_init_sees_it():
    cfg = {"train_batch_size": 8, "zero_optimization.stage": 3, "zero_optimization.reduce_bucket_size": 77}
    assert DeepSpeedConfig(cfg).zero_optimization_stage == 3
    assert get_zero_config(cfg).reduce_bucket_size == 77 and get_zero_config(cfg).stage == 3


def test_dotted_key_loses_to_the_nested_value_with_a_warning_naming_both(config_warnings):
    # After HF filled the nested key, TRL's dotted copy differs by its fraction (HF rounds it
    # down, TRL does not); with an explicit nested value it differs more. The nested one wins,
    # as upstream, which never reads dotted keys: refusing would break TRL at ZeRO-3.
    cfg = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 500},
        "zero_optimization.reduce_bucket_size": 4096,
    }
    assert DeepSpeedConfig(cfg).zero_config.reduce_bucket_size == 500
    assert get_zero_config(cfg).reduce_bucket_size == 500
    (line,) = _lines_naming(config_warnings, "'zero_optimization.reduce_bucket_size'")
    assert "(4096) is ignored" in line and "already sets 'reduce_bucket_size' to 500" in line
    same = {**cfg, "zero_optimization.reduce_bucket_size": 500.0}
    assert DeepSpeedConfig(same).zero_config.reduce_bucket_size == 500  # equal: silently the same


def test_dotted_key_naming_nothing_is_an_unknown_key(config_warnings):
    DeepSpeedConfig({"train_batch_size": 8, "zero_optimization.no_such": 1, "optimizer.params.lr": 0.1})
    assert _lines_naming(config_warnings, "unknown key 'zero_optimization.no_such' at the top level")
    assert _lines_naming(config_warnings, "unknown key 'optimizer.params.lr' at the top level")


def test_dotted_key_fills_a_nested_auto_before_its_default_would(config_warnings):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    cfg["zero_optimization.reduce_bucket_size"] = 1000
    assert DeepSpeedConfig(cfg).zero_config.reduce_bucket_size == 1000
    assert not _lines_naming(config_warnings, "nothing filled it")


def test_auto_in_zero_optimization_takes_the_default_with_a_warning(config_warnings):
    # TRL builds its reference model (at stages 0-2) from the accelerate config before HF
    # fills the model-size knobs; upstream takes its defaults for them, and so do we.
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    assert DeepSpeedConfig(cfg).zero_config.reduce_bucket_size == 500_000_000
    (line,) = _lines_naming(config_warnings, "zero_optimization.reduce_bucket_size")
    assert 'is "auto" and nothing filled it; its default applies' in line


def test_bad_stage_names_key_value_and_allowed():
    with pytest.raises(
        ValueError,
        match=r"zero_optimization\.stage: got 4 \(int\); allowed values: 0 \(disabled\), "
        r"1 \(optimizer_states\), 2 \(gradients\), 3 \(weights\)",
    ):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 4}})


def test_bad_stage_through_get_zero_config():
    with pytest.raises(ValueError, match=r"zero_optimization\.stage: got -1"):
        get_zero_config({"zero_optimization": {"stage": -1}})


def test_bad_offload_device_lists_allowed():
    with pytest.raises(
        ValueError,
        match=r"zero_optimization\.offload_optimizer\.device: got 'gpu'.*allowed values: 'none', 'cpu', 'nvme'",
    ):
        zero({"stage": 3, "offload_optimizer": {"device": "gpu"}})


def test_bad_type():
    with pytest.raises(
        ValueError, match=r"zero_optimization\.reduce_bucket_size: got 'big' \(str\).*valid integer"
    ):
        zero({"reduce_bucket_size": "big"})
    with pytest.raises(
        ValueError, match=r"zero_optimization\.reduce_bucket_size: got 1\.5 .*fractional part"
    ):
        zero({"reduce_bucket_size": 1.5})
    with pytest.raises(ValueError, match=r"fp16\.enabled: got 'maybe' \(str\).*valid boolean"):
        DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": "maybe"}})


def test_several_problems_reported_together():
    with pytest.raises(ValueError, match=r"\(2 problems\)") as info:
        DeepSpeedConfig({"train_batch_size": 1, "gradient_clipping": -1, "zero_optimization": {"stage": 9}})
    assert "gradient_clipping" in str(info.value) and "zero_optimization.stage" in str(info.value)


def test_auto_rejected_with_hint():
    cfg = copy.deepcopy(HF_ZERO3)
    cfg["train_batch_size"] = "auto"
    cfg["gradient_clipping"] = "auto"
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"  # defaults: see the test above
    with pytest.raises(ValueError, match=r'still set to "auto".*HF transformers.*accelerate') as info:
        DeepSpeedConfig(cfg, world_size=4)
    assert "train_batch_size" in str(info.value) and "gradient_clipping" in str(info.value)
    assert "zero_optimization" not in str(info.value)


def test_auto_allowed_when_not_strict():
    # zero.Init sees HF configs before the model-dependent "auto" entries are filled.
    cfg = copy.deepcopy(HF_ZERO3)
    cfg["zero_optimization"]["reduce_bucket_size"] = "auto"
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    cfg["scheduler"]["params"]["warmup_num_steps"] = "auto"
    parsed = DeepSpeedConfig(cfg, world_size=4, strict=False)
    assert parsed.zero_config.reduce_bucket_size == 500_000_000
    assert parsed.zero_config.prefetch_bucket_size == 50_000_000
    assert parsed._param_dict["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_get_zero_config_auto(config_warnings):
    section = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}}
    assert get_zero_config(section).param_persistence_threshold == 100_000
    assert _lines_naming(config_warnings, "zero_optimization.stage3_param_persistence_threshold")
    assert get_zero_config(section, strict=False).param_persistence_threshold == 100_000


def test_not_strict_without_batch_sizes():
    cfg = DeepSpeedConfig({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, strict=False)
    assert cfg.zero_optimization_stage == 3 and cfg.bfloat16_enabled


def test_fp16_and_bf16_both_enabled():
    with pytest.raises(ValueError, match=r"fp16\.enabled and bf16\.enabled are both true"):
        DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_bf16_and_bfloat16_disagreeing():
    with pytest.raises(ValueError, match=r"'bf16'=.*'bfloat16'=.*keep one"):
        DeepSpeedConfig({"train_batch_size": 1, "bf16": {"enabled": True}, "bfloat16": {"enabled": False}})


def test_partial_offload_needs_stage_3():
    with pytest.raises(ValueError, match=r"offload_optimizer\.ratio=0\.5 .*needs stage 3, got stage 2"):
        zero({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})


def test_nvme_param_offload_needs_a_path_and_stage_3():
    with pytest.raises(
        ValueError, match=r"offload_param\.device='nvme' needs zero_optimization\.offload_param\.nvme_path"
    ):
        zero({"stage": 3, "offload_param": {"device": "nvme"}})
    block = {
        "device": "nvme",
        "nvme_path": "/local_nvme",
        "buffer_count": 2,
        "buffer_size": 10,
        "max_in_cpu": 0,
    }
    parsed = zero({"stage": 3, "offload_param": block}).offload_param
    assert (parsed.buffer_count, parsed.buffer_size, parsed.max_in_cpu) == (2, 10, 0)
    assert zero({"stage": 2, "offload_param": block}).offload_param is None  # dropped (see below)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage_3_is_dropped_with_a_warning(stage, caplog):
    # Stages 0-2 keep parameters whole on the accelerator: the block would do nothing. Upstream
    # ignores it, and DeepSpeed-Chat's --offload writes it at every stage: a warning, not an error.
    with caplog.at_level(logging.WARNING, logger="deepspeed"):
        parsed = zero(
            {"stage": stage, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
        )
    assert parsed.offload_param is None and parsed.offload_optimizer.device == "cpu"
    assert f"offload_param.device='cpu' has no effect at stage {stage}" in caplog.text
    zero({"stage": stage, "offload_param": {"device": "none"}})  # what accelerate writes when off


def test_bad_communication_data_type():
    with pytest.raises(
        ValueError, match=r"communication_data_type: got 'int8'.*allowed values: 'fp32', 'fp16'"
    ):
        DeepSpeedConfig({"train_batch_size": 1, "communication_data_type": "int8"})


def test_free_form_section_must_be_a_dict():
    with pytest.raises(ValueError, match=r"activation_checkpointing: got True \(bool\).*dictionary"):
        DeepSpeedConfig({"train_batch_size": 1, "activation_checkpointing": True})


def test_direct_construction():
    assert DeepSpeedZeroConfig(stage3_max_live_parameters=5).max_live_parameters == 5
    with pytest.raises(ValueError, match=r"stage"):
        DeepSpeedZeroConfig(stage=8)


def test_errors_are_value_errors_without_pydantic_chain():
    with pytest.raises(DeepSpeedConfigError) as info:
        zero({"stage": 5})
    assert isinstance(info.value, ValueError) and info.value.__cause__ is None


def test_optimizer_params_reach_the_optimizer_as_upstream_passes_them():
    """Only the keys that choose the optimizer (torch_adam, adam_w_mode) are taken out; torch's
    own options such as `fused` take effect, and a key the optimizer does not take is its
    TypeError naming the key, not dropped."""
    from deepspeed.runtime.zero.stage3 import build_config_optimizer

    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    opt = build_config_optimizer("AdamW", {"lr": 0.01, "torch_adam": True, "fused": True}, groups)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True and opt.defaults["lr"] == 0.01
    opt = build_config_optimizer("Adam", {"adam_w_mode": False, "foreach": False}, groups)
    assert type(opt) is torch.optim.Adam and opt.defaults["foreach"] is False and not opt.defaults["fused"]
    # Without either, torch's fused kernel where it takes the masters (the CPU included), and
    # it steps as torch's default per-tensor loop does.
    for params in ({"torch_adam": True}, {}):
        assert build_config_optimizer("AdamW", dict(params), groups).defaults["fused"] is True
    ints = [{"params": [torch.zeros(3, dtype=torch.int64)]}]
    assert not build_config_optimizer("AdamW", {}, ints).defaults["fused"]
    torch.manual_seed(0)
    fused, looped = (torch.nn.Parameter(torch.randn(1000)) for _ in range(2))
    looped.data.copy_(fused.data)
    steps = [build_config_optimizer("AdamW", {"lr": 0.01, "torch_adam": True}, [{"params": [fused]}])]
    steps.append(torch.optim.AdamW([looped], lr=0.01, foreach=False))
    for _ in range(5):
        grad = torch.randn(1000)
        for p, opt in zip((fused, looped), steps):
            p.grad = grad.clone()
            opt.step()
    torch.testing.assert_close(fused, looped)
    with pytest.raises(TypeError, match="cuda_aware"):
        build_config_optimizer("AdamW", {"cuda_aware": False}, groups)
    # Weight decay left out: upstream's FusedAdam and DeepSpeedCPUAdam default to 0, torch's
    # AdamW (what `torch_adam` builds) to 0.01; with or without offload the same config trains alike.
    for name in ("Adam", "AdamW"):
        assert build_config_optimizer(name, {"lr": 0.01}, groups).defaults["weight_decay"] == 0.0
        assert (
            build_config_optimizer(name, {"lr": 0.01}, groups, offload=True).defaults["weight_decay"] == 0.0
        )
    assert build_config_optimizer("AdamW", {"torch_adam": True}, groups).defaults["weight_decay"] == 0.01
    assert build_config_optimizer("AdamW", {"weight_decay": 0.1}, groups).defaults["weight_decay"] == 0.1
    with pytest.raises(TypeError, match="fused"):  # DeepSpeedCPUAdam is one fused kernel already
        build_config_optimizer("AdamW", {"fused": True}, groups, offload=True)


def test_reduce_bucket_size_must_be_positive():
    with pytest.raises(DeepSpeedConfigError, match="reduce_bucket_size: got 0"):
        DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": 0}})


def test_other_optimizer_types_are_torch_optim_classes_by_name():
    from deepspeed.runtime.zero.stage3 import build_config_optimizer

    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    opt = build_config_optimizer("RMSprop", {"lr": 0.05, "alpha": 0.9}, groups)
    assert type(opt) is torch.optim.RMSprop and opt.defaults["alpha"] == 0.9
    assert type(build_config_optimizer("NAdam", {}, groups)) is torch.optim.NAdam
    for name in ("Foo", "LRScheduler", "rmsprop"):  # not an optimizer class (torch spells RMSprop)
        with pytest.raises(ValueError, match=f"optimizer.type={name!r} is not supported"):
            build_config_optimizer(name, {}, groups)


def test_adagrad_config_builds_torch_adagrad_or_cpu_adagrad_under_offload():
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.runtime.zero.stage3 import build_config_optimizer

    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    opt = build_config_optimizer("Adagrad", {"lr": 0.05, "lr_decay": 0.1}, groups)
    assert type(opt) is torch.optim.Adagrad and opt.defaults["lr_decay"] == 0.1
    for name, offload in (("Adagrad", True), ("CPUAdagrad", False)):
        opt = build_config_optimizer(name, {"lr": 0.05, "eps": 1e-8}, groups, offload=offload)
        assert type(opt) is DeepSpeedCPUAdagrad and opt.defaults["eps"] == 1e-8


def test_leaf_module_defaults_strings_null_and_typos():
    """`zero_optimization.leaf_module`: upstream's default classes (HF's sparse MoE blocks), one
    string taken as a list, null as the defaults, and a misspelt field refused by name."""
    default = DeepSpeedZeroConfig().leaf_module
    assert default.is_default() and len(default.classes) == 3
    assert all(c.endswith("SparseMoeBlock") for c in default.classes)
    assert DeepSpeedZeroConfig(leaf_module=None).leaf_module.is_default()
    custom = DeepSpeedZeroConfig(leaf_module={"classes": "Expert", "name_suffixes": "mlp"}).leaf_module
    assert custom.classes == ["Expert"] and custom.names == [] and custom.name_suffixes == ["mlp"]
    assert not custom.is_default()
    with pytest.raises(Exception, match="clases"):
        DeepSpeedZeroConfig(leaf_module={"clases": ["Expert"]})


def test_leaf_module_classes_match_by_name_or_module_path(caplog):
    from torch import nn

    from deepspeed.utils.z3_leaf_module import apply_leaf_module_config, z3_leaf_module

    class Expert(nn.Linear):
        pass

    model = nn.Sequential(Expert(2, 2), nn.Linear(2, 2))
    path = f"{Expert.__module__}.{Expert.__qualname__}"
    config = DeepSpeedZeroConfig(leaf_module={"classes": [path], "names": ["1"]}).leaf_module
    assert apply_leaf_module_config(model, config) == [model[0], model[1]]
    assert z3_leaf_module(model[0]) and z3_leaf_module(model[1])
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        config = DeepSpeedZeroConfig(leaf_module={"names": ["missing"], "classes": []}).leaf_module
        assert apply_leaf_module_config(nn.Sequential(nn.Linear(2, 2)), config) == []
    assert "['missing']" in caplog.text and "matched no module" in caplog.text


def test_strict_unknown_key_error_keeps_the_suggestion_and_points_to_the_docs():
    """A strict model's unknown-key error names the key and the close spellings, then points to
    docs/config.md instead of listing every valid key on one line."""
    from pydantic import ValidationError

    from deepspeed.runtime.config_utils import validation_error_to_value_error

    with pytest.raises(ValidationError) as caught:
        DeepSpeedZeroConfig.model_validate({"stage": 3, "overlap_comn": True})
    message = str(validation_error_to_value_error(caught.value, DeepSpeedZeroConfig, "zero_optimization"))
    assert "unknown key 'overlap_comn' in 'zero_optimization'; did you mean 'overlap_comm'?" in message
    assert message.endswith("(docs/config.md lists every key and its aliases)"), message
    assert "reduce_bucket_size" not in message  # no list of every valid key
