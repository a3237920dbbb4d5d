"""`DeepSpeedConfig`: the whole DeepSpeed JSON config, typed, checked and flattened.

The JSON layout and key names are upstream DeepSpeed 0.19's. Every known top-level key is a
field of `DeepSpeedRootConfig`; the sections of upstream features this package does not
implement (profilers, compression, ...) are free-form dicts that parse when absent,
empty or switched off (``{"enabled": false}``) and are refused otherwise, naming the key (see
[Note: every key is acted on or rejected] in `config_utils`). A key that names nothing (a typo,
another tool's key) is ignored with one warning naming it and the closest valid keys, and a
dotted top-level key is moved into its section ([Note: unknown and dotted keys] there).

`DeepSpeedConfig` adds what needs more than one key at a time: the batch-size identity
``train_batch_size = micro * accumulation * world_size``, and upstream's flat attributes
(`fp16_enabled`, `zero_optimization_stage`, ...) that engines and clients read.

[Note: "auto" values]
HF transformers and accelerate configs use the string "auto" as a placeholder that their
integration replaces before `deepspeed.initialize`. One left over is a bug, so by default it
raises. Two exceptions exist upstream and are kept through ``strict=False``: HF enters
`zero.Init` *before* it fills the model-dependent entries (``reduce_bucket_size``,
``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``, scheduler steps),
and upstream's typed sections drop "auto" in favour of the default. `zero.Init`, which does
not train, builds its config with ``strict=False``. In `zero_optimization` "auto" takes the
default in every mode (with a warning when strict): those knobs tune speed and memory only,
and TRL builds a reference-model engine before HF fills them (config_utils' note on "auto"
in zero_optimization).
"""

import json
import types
from typing import Any, ClassVar, Literal, Optional, Union

import torch
from pydantic import AliasChoices, Field, field_validator, model_validator

from deepspeed.comm.config import CommsLoggerConfig, DeepSpeedCommsConfig
from deepspeed.monitor.config import (
    MONITOR_KEYS,
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    MonitorConfigBlock,
    TensorBoardConfig,
    WandbConfig,
    resolve_monitor_config,
)
from deepspeed.profiling.config import DeepSpeedFlopsProfilerConfig
from deepspeed.runtime.config_loading import load_config_dict, resolve_batch_sizes, resolve_world_size
from deepspeed.runtime.config_utils import (
    DeepSpeedConfigError,
    DeepSpeedConfigModel,
    Unsupported,
    apply_dotted_keys,
    default_auto_values,
    parse_section,
    reject_auto_values,
    section_is_off,
    strip_auto_values,
    unsupported_when_true,
)
from deepspeed.runtime.precision_config import (
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    DeepSpeedTorchAutocastConfig,
    precision_attributes,
)
from deepspeed.runtime.zero.config import (
    ZERO_OPTIMIZATION,
    DeepSpeedZeroConfig,
    ZeroStageEnum,
    legacy_zero_value,
)
from deepspeed.utils.logging import get_log_level_from_string
from deepspeed.utils.logging import logger as ds_logger

__all__ = [
    "DeepSpeedBF16Config",
    "DeepSpeedCompileConfig",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedFP16Config",
    "DeepSpeedOptimizerConfig",
    "DeepSpeedRootConfig",
    "DeepSpeedSchedulerConfig",
    "load_config_dict",
    "resolve_batch_sizes",
]

# Optimizer names DeepSpeed itself knows; matched case-insensitively and stored lower-case.
# Any other name is kept as written, so an engine can look it up in `torch.optim`.
DEEPSPEED_OPTIMIZERS = (
    "adam",
    "adamw",
    "sgd",
    "adagrad",
    "lamb",
    "lion",
    "muon",
    "onebitadam",
    "onebitlamb",
    "zerooneadam",
    "muadam",
    "muadamw",
    "musgd",
    "fusedadam",
    "fusedlamb",
    "fusedlion",
    "cpuadam",
    "cpuadagrad",
    "cpulion",
    "deepspeedcpuadam",
)

# Upstream's names for the `optimizer.type` values (client code compares with them).
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"

_COMM_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "bfp16": torch.bfloat16,  # upstream's historical spelling
}
_COMM_DTYPES = types.MappingProxyType(_COMM_DTYPES)  # read-only from here on
_COMM_DTYPE_SYNONYMS = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
_COMM_DTYPE_SYNONYMS = types.MappingProxyType(_COMM_DTYPE_SYNONYMS)  # read-only from here on

FreeForm = Optional[dict[str, Any]]


def _off(feature: str, instead: str = "") -> Unsupported:
    """The rule for a free-form section of an upstream feature not implemented here."""
    hint = f"; {instead}" if instead else ""
    return Unsupported(
        f"{feature} is not implemented{hint}; remove the block or switch it off", section_is_off
    )


# Upstream's `aio` defaults (NVMe async I/O), which PyTorch Lightning writes into every config.
_AIO_DEFAULTS = {
    "block_size": 1048576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "thread_count": 1,
    "single_submit": False,
    "overlap_events": True,
    "use_gds": False,
}
_AIO_DEFAULTS = types.MappingProxyType(_AIO_DEFAULTS)  # read-only from here on
_CHECKPOINT_DEFAULTS = {"tag_validation": ("ignore", "warn", "fail"), "load_universal": (False,)}
_CHECKPOINT_DEFAULTS = types.MappingProxyType(_CHECKPOINT_DEFAULTS)  # read-only from here on


def _aio_supported(value: Optional[dict]) -> bool:
    # Every upstream key is acted on by NVMe offload's handles (swap_store.AioSettings) except
    # GPUDirect Storage; an unknown key is refused rather than ignored.
    block = value or {}
    return set(block) <= set(_AIO_DEFAULTS) and not block.get("use_gds", False)


def _checkpoint_supported(value: Optional[dict]) -> bool:
    for key, item in (value or {}).items():
        if key == "use_node_local_storage":
            continue  # acted on: every node's local rank 0 publishes `latest` (checkpointing.py)
        allowed = _CHECKPOINT_DEFAULTS.get(key)
        shown = item.lower() if isinstance(item, str) else item
        if allowed is None or shown not in allowed:
            return False
    return True


def _activation_checkpointing_keys() -> tuple:
    from deepspeed.runtime.activation_checkpointing.checkpointing import CONFIG_KEYS

    return CONFIG_KEYS


def _data_types_supported(value: Optional[dict]) -> bool:
    extra = set(value or {}) - {"grad_accum_dtype"}
    return not extra and (value or {}).get("grad_accum_dtype") in (None, "fp32", "float32")


class DeepSpeedCompileConfig(DeepSpeedConfigModel):
    """`compile`: the defaults of `engine.compile()`. The block compiles nothing by itself, as in
    upstream since its engine stopped wrapping the module: the module is compiled when the
    client calls `engine.compile()`, which accelerate does for a dynamo-enabled run
    (`TrainingArguments(torch_compile=True)`); see docs/engine.md."""

    _unsupported: ClassVar[dict[str, Unsupported]] = {
        "deepcompile": unsupported_when_true(
            "DeepCompile (upstream's compiler passes for ZeRO) is not implemented"
        ),
    }

    disable: bool = False
    """True: `engine.compile()` leaves the module eager, with a warning (torch.compile's `disable`)."""

    backend: Optional[str] = None
    """The backend `engine.compile()` uses when called without one; unset: the accelerator's."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for torch.compile; those passed as `compile_kwargs` take precedence."""

    deepcompile: bool = False
    """Upstream's DeepCompile; true is refused (not implemented)."""


class DeepSpeedOptimizerConfig(DeepSpeedConfigModel):
    """`optimizer`: which optimizer the engine builds when the client passes none."""

    _unsupported: ClassVar[dict[str, Unsupported]] = {
        "legacy_fusion": unsupported_when_true("upstream's old fused fp16 optimizer path is not implemented"),
    }

    type: Optional[str] = None
    """Optimizer name, case-insensitive for DeepSpeed's own (Adam, AdamW, Lamb, OneBitAdam, ...)."""

    params: FreeForm = None
    """Keyword arguments for the optimizer (lr, betas, eps, weight_decay, torch_adam, ...)."""

    legacy_fusion: bool = False
    """Upstream's old fused fp16 optimizer path; true is refused (not implemented)."""


class DeepSpeedSchedulerConfig(DeepSpeedConfigModel):
    """`scheduler`: the learning-rate schedule the engine builds when the client passes none."""

    type: Optional[str] = None
    """Scheduler name, e.g. WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest."""

    params: FreeForm = None
    """Keyword arguments for the scheduler (warmup_min_lr, warmup_max_lr, warmup_num_steps, ...)."""


class DeepSpeedRootConfig(DeepSpeedConfigModel):
    """Every top-level key of a DeepSpeed JSON config; unknown keys are ignored with a warning."""

    _unsupported: ClassVar[dict[str, Unsupported]] = {
        "sparse_gradients": unsupported_when_true("gradients are reduce-scattered as dense tensors"),
        "seq_parallel_communication_data_type": Unsupported(
            "Ulysses' all-to-all runs in the activations' dtype here; remove the key or set it to 'fp32'"
        ),
        "dump_state": unsupported_when_true(
            "state dumps are not implemented; print(engine._config.describe())"
        ),
        "disable_allgather": unsupported_when_true(
            "parameters are always all-gathered for forward and backward"
        ),
        "fp32_allreduce": unsupported_when_true('set "communication_data_type": "fp32" instead'),
        "graph_harvesting": unsupported_when_true("accelerator graph capture of the step is not implemented"),
        "use_data_before_expert_parallelism": unsupported_when_true(
            "mixture-of-experts groups are not implemented"
        ),
        "load_universal_checkpoint": unsupported_when_true(
            "universal checkpoints are not read; checkpoints saved here load on any number of ranks as they are"
        ),
        "checkpoint": Unsupported(
            "supported entries are use_node_local_storage, tag_validation 'Ignore', 'Warn' or 'Fail' "
            "and load_universal false",
            _checkpoint_supported,
        ),
        "data_types": Unsupported(
            "gradients always accumulate in fp32; remove data_types or set grad_accum_dtype to 'fp32'",
            _data_types_supported,
        ),
        "amp": _off("NVIDIA Apex AMP", "use fp16 or bf16"),
        "activation_checkpointing": Unsupported(
            "the block configures deepspeed.checkpointing (initialize passes it to "
            "deepspeed.checkpointing.configure), which reads only these keys: "
            + ", ".join(_activation_checkpointing_keys())
            + "; remove the others",
            lambda value: set(value or {}) <= set(_activation_checkpointing_keys()),
        ),
        "aio": Unsupported(
            "the block takes upstream's keys "
            f"{sorted(_AIO_DEFAULTS)}, and use_gds (GPUDirect Storage) is not implemented: "
            "remove unknown keys and set use_gds to false",
            _aio_supported,
        ),
        "elasticity": _off("elastic training"),
        "pipeline": _off("the pipeline-parallel engine"),
        "autotuning": _off("the autotuner"),
        "nebula": _off("the Nebula checkpoint service"),
        "compression_training": _off("compression training"),
        "data_efficiency": _off("data efficiency"),
        "curriculum_learning": _off("curriculum learning"),
        "weight_quantization": _off("weight quantization"),
        "hybrid_engine": _off("the RLHF hybrid engine"),
        "eigenvalue": _off("eigenvalue computation"),
        "progressive_layer_drop": _off("progressive layer drop"),
        "quantize_training": _off("quantization-aware training"),
        "sparse_attention": _off("sparse attention"),
        "timers": _off("engine timers"),
        "tensor_parallel": _off("AutoTP tensor parallelism"),
        # Upstream 0.19.8 keys: known, so that a non-default value is refused rather than
        # ignored as an unknown key (config_utils' [Note: unknown and dotted keys]).
        "managed_gradient_accumulation": Unsupported(
            "the engine always counts micro-steps and steps the optimizer at the accumulation "
            "boundary; remove the key or set it to true"
        ),
        "expert_parallel": _off("AutoEP expert parallelism"),
        "datastates_ckpt": _off("the DataStates asynchronous checkpoint engine"),
        "disable_python_gc": Unsupported(
            "Python's garbage collector runs as usual; remove the key or set it to false",
            lambda value: value is False or value == 0,
        ),
    }
    _no_effect: ClassVar[dict[str, str]] = {
        "zero_allow_untested_optimizer": "every client optimizer is allowed, as if true (HF and "
        "accelerate set it to true); the wrapped optimizer steps the fp32 shards whatever its class",
    }

    train_batch_size: Optional[int] = Field(None, gt=0)
    """Samples per optimizer step over all ranks: micro batch * accumulation steps * world size."""

    train_micro_batch_size_per_gpu: Optional[int] = Field(None, gt=0)
    """Samples per forward/backward pass on one rank."""

    gradient_accumulation_steps: Optional[int] = Field(None, gt=0)
    """Forward/backward passes whose gradients are summed before one optimizer step."""

    steps_per_print: Union[int, float] = 10
    """Log progress every this many optimizer steps; accelerate sets it to infinity to silence it."""

    gradient_clipping: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 turns clipping off. The default is
    upstream 0.19's (1.0): a config without the key clips there, so it clips here too."""

    prescale_gradients: bool = False
    """Divide gradients by the world size before the all-reduce rather than after."""

    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    """Divide gradients by this before the reduction and by world_size / factor after it."""

    sparse_gradients: bool = False
    """Reduce `torch.nn.Embedding` gradients as sparse tensors (stage 0 only)."""

    communication_data_type: Optional[Literal["fp32", "fp16", "bf16", "bfp16"]] = None
    """Data type of gradient reductions; unset means the training dtype."""

    seq_parallel_communication_data_type: Literal["fp32", "fp16", "bf16", "bfp16"] = "fp32"
    """Data type of sequence-parallel collectives."""

    fp16: DeepSpeedFP16Config = Field(default_factory=DeepSpeedFP16Config)
    """float16 training and loss scaling (`DeepSpeedFP16Config`)."""

    bf16: DeepSpeedBF16Config = Field(
        default_factory=DeepSpeedBF16Config, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    """bfloat16 training (`DeepSpeedBF16Config`); the old key `bfloat16` is accepted."""

    optimizer: Optional[DeepSpeedOptimizerConfig] = None
    """The optimizer the engine builds when the client passes none."""

    scheduler: Optional[DeepSpeedSchedulerConfig] = None
    """The learning-rate scheduler the engine builds when the client passes none."""

    zero_optimization: DeepSpeedZeroConfig = Field(default_factory=DeepSpeedZeroConfig)
    """ZeRO settings (`DeepSpeedZeroConfig`); absent means stage 0."""

    zero_allow_untested_optimizer: bool = False
    """Allow ZeRO with a client optimizer that DeepSpeed has not tested."""

    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require DeepSpeed's CPU optimizer rather than the client's."""

    wall_clock_breakdown: bool = False
    """Time forward, backward and step and log the breakdown."""

    memory_breakdown: bool = False
    """Log memory use at points during training."""

    dump_state: bool = False
    """Print the engine state after initialisation."""

    disable_allgather: bool = False
    """Upstream stage-1/2 option; true is refused (parameters are always all-gathered)."""

    fp32_allreduce: bool = False
    """Upstream: all-reduce gradients in fp32; true is refused (use `communication_data_type`)."""

    graph_harvesting: bool = False
    """Upstream: capture the step as an accelerator graph; true is refused."""

    use_node_local_storage: bool = False
    """Checkpoint files live on storage local to each node (upstream's legacy top-level key)."""

    load_universal_checkpoint: bool = False
    """Load a universal checkpoint (upstream's legacy top-level key)."""

    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of the engine-built data loader."""

    use_data_before_expert_parallelism: bool = False
    """Upstream MoE group layout option; true is refused."""

    sequence_parallel_size: int = Field(1, ge=1)
    """Ranks that split one sequence (Ulysses, docs/sequence_parallel.md): consecutive ranks form
    each group; it must divide the world size, and the batch-size identity counts world / sp
    data-parallel ranks. An mpu from `register_with_transformers` sets it; both given must agree."""

    checkpoint: FreeForm = None
    """Checkpoint options; use_node_local_storage and tag_validation are read, others refused."""

    data_types: FreeForm = None
    """Data type options; ``grad_accum_dtype`` "fp32" (what happens here) parses, others are refused."""

    amp: FreeForm = None
    """NVIDIA Apex AMP settings; refused unless absent, empty or switched off."""

    activation_checkpointing: FreeForm = None
    """Activation checkpointing settings; refused unless absent, empty or switched off."""

    flops_profiler: DeepSpeedFlopsProfilerConfig = Field(default_factory=DeepSpeedFlopsProfilerConfig)
    """The FLOPs profiler (`DeepSpeedFlopsProfilerConfig`); absent or null: off."""

    tensorboard: Optional[TensorBoardConfig] = None
    """The TensorBoard monitor (`deepspeed.monitor`); absent: off."""

    wandb: Optional[WandbConfig] = None
    """The Weights & Biases monitor (`deepspeed.monitor`); absent: off."""

    csv_monitor: Optional[CSVConfig] = None
    """The CSV monitor (`deepspeed.monitor`); absent: off."""

    comet: Optional[CometConfig] = None
    """The Comet monitor (`deepspeed.monitor`); absent: off."""

    monitor_config: Optional[MonitorConfigBlock] = None
    """Monitors in one block (LLaMA-Factory, CoLLiE); each acts as the top-level block of its name."""

    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Communication logger (`CommsLoggerConfig`): `deepspeed.comm.configure` reads it."""

    aio: FreeForm = None
    """Async I/O settings of NVMe offload's swap handles (block_size, queue_depth, thread_count or
    intra_op_parallelism, single_submit, overlap_events); use_gds true and unknown keys are refused."""

    elasticity: FreeForm = None
    """Elastic training settings; refused unless absent, empty or switched off."""

    pipeline: FreeForm = None
    """Pipeline-parallel engine settings; refused unless absent, empty or switched off."""

    autotuning: FreeForm = None
    """Autotuner settings; refused unless absent, empty or switched off."""

    compile: DeepSpeedCompileConfig = Field(default_factory=DeepSpeedCompileConfig)
    """How `engine.compile()` compiles the module (`DeepSpeedCompileConfig`)."""

    nebula: FreeForm = None
    """Nebula checkpoint service settings; refused unless absent, empty or switched off."""

    compression_training: FreeForm = None
    """Compression (quantisation, pruning) training; refused unless absent, empty or switched off."""

    data_efficiency: FreeForm = None
    """Data efficiency (sampling, routing) settings; refused unless absent, empty or switched off."""

    curriculum_learning: FreeForm = None
    """Legacy curriculum learning settings; refused unless absent, empty or switched off."""

    weight_quantization: FreeForm = None
    """Post-training weight quantisation settings; refused unless absent, empty or switched off."""

    hybrid_engine: FreeForm = None
    """RLHF hybrid engine settings; refused unless absent, empty or switched off."""

    eigenvalue: FreeForm = None
    """Eigenvalue computation settings; refused unless absent, empty or switched off."""

    progressive_layer_drop: FreeForm = None
    """Progressive layer drop settings; refused unless absent, empty or switched off."""

    quantize_training: FreeForm = None
    """Quantisation-aware training settings; refused unless absent, empty or switched off."""

    sparse_attention: FreeForm = None
    """Sparse attention settings; refused unless absent, empty or switched off."""

    timers: FreeForm = None
    """Engine timer settings; refused unless absent, empty or switched off."""

    torch_autocast: DeepSpeedTorchAutocastConfig = Field(default_factory=DeepSpeedTorchAutocastConfig)
    """The engine's forward under `torch.autocast` (runtime/torch_autocast.py)."""

    tensor_parallel: FreeForm = None
    """Upstream AutoTP training settings; refused unless absent, empty or switched off."""

    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """Whether the data-parallel reduction averages gradients over the ranks ("mean", as plain
    data parallelism) or sums them ("sum"); any case, as upstream."""

    managed_gradient_accumulation: bool = True
    """Upstream: false leaves accumulation boundaries to the client; refused (always managed)."""

    expert_parallel: FreeForm = None
    """Upstream AutoEP expert-parallel settings; refused unless absent, empty or switched off."""

    datastates_ckpt: FreeForm = None
    """Upstream DataStates checkpoint engine settings; refused unless absent, empty or switched off."""

    disable_python_gc: Union[bool, int] = False
    """Upstream: disable Python's garbage collector (and collect every N steps); refused."""

    log_level: Optional[str] = None
    """The package logger's level ("debug" ... "critical"), set at initialize; None leaves it
    (DEEPSPEED_LOG_LEVEL, default WARNING)."""

    @field_validator("log_level", mode="after")
    @classmethod
    def _check_log_level(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            get_log_level_from_string(value)  # raises naming the valid levels
        return value

    @field_validator("flops_profiler", mode="before")
    @classmethod
    def _null_section(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("zero_optimization", mode="before")
    @classmethod
    def _legacy_zero(cls, value: Any) -> Any:
        return legacy_zero_value(value)

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _lower_allreduce_op(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("communication_data_type", "seq_parallel_communication_data_type", mode="before")
    @classmethod
    def _normalise_dtype_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.lower()
            return _COMM_DTYPE_SYNONYMS.get(value, value)
        return value

    @field_validator("steps_per_print", mode="after")
    @classmethod
    def _check_steps_per_print(cls, value: Union[int, float]) -> Union[int, float]:
        # A float is fine when it is whole (10.0) or infinite (accelerate's "never print").
        if isinstance(value, float) and value != float("inf"):
            if not value.is_integer():
                raise ValueError(f"must be a whole number or infinity, got {value}")
            value = int(value)
        if value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @model_validator(mode="after")
    def _check_precision(self) -> "DeepSpeedRootConfig":
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        amp_on = bool((self.amp or {}).get("enabled", False))
        if amp_on and (self.fp16.enabled or self.bf16.enabled):
            precision = "fp16" if self.fp16.enabled else "bf16"
            raise ValueError(f"amp.enabled and {precision}.enabled are both true; enable at most one of them")
        return self

    @model_validator(mode="after")
    def _check_zero_offload(self) -> "DeepSpeedRootConfig":
        self.zero_optimization.check_offload_stage()  # needs the stage this whole config runs
        self.zero_optimization.check_mics_stage()
        return self

    @model_validator(mode="after")
    def _check_monitors(self) -> "DeepSpeedRootConfig":
        self.monitors()  # a monitor set differently at the top level and in monitor_config raises
        return self

    def monitors(self) -> DeepSpeedMonitorConfig:
        """The monitors' settings, from the top-level blocks and `monitor_config` together."""
        return resolve_monitor_config({key: getattr(self, key) for key in MONITOR_KEYS}, self.monitor_config)


# ----------------------------------------------------------------------------------------
# The config object engines read


class DeepSpeedConfig:
    """A parsed DeepSpeed config with upstream's flat attributes.

    `config` is a dict, a path to a JSON file, or base64-encoded JSON. `world_size` is the
    data-parallel size used by the batch-size identity; unset, it comes from `mpu`, then
    `mesh_device`, then ``$WORLD_SIZE``, then 1. With ``strict=False`` (for `zero.Init`),
    "auto" placeholders fall back to defaults and missing batch sizes default to 1; see
    [Note: "auto" values] at the top of this file.
    """

    _param_dict: dict[str, Any]  # the dict as given (or as loaded); never modified
    typed_config: DeepSpeedRootConfig  # every section, validated
    world_size: int  # data-parallel ranks
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    zero_config: DeepSpeedZeroConfig
    zero_optimization_stage: int
    zero_enabled: bool
    fp16_enabled: bool
    bfloat16_enabled: bool
    loss_scale: float
    initial_dynamic_scale: float
    dynamic_loss_scale_args: Optional[dict[str, Any]]  # None when the loss scale is static
    optimizer_name: Optional[str]  # lower-case for DeepSpeed's own names
    optimizer_params: Optional[dict[str, Any]]
    scheduler_name: Optional[str]
    scheduler_params: Optional[dict[str, Any]]

    def __init__(
        self,
        config: Any,
        mpu: Any = None,
        mesh_device: Any = None,
        world_size: Optional[int] = None,
        *,
        strict: bool = True,
    ) -> None:
        self._param_dict = load_config_dict(config)
        self.mpu = mpu
        self.mesh_device = mesh_device
        self.strict = strict
        self.world_size = resolve_world_size(world_size, mpu, mesh_device)
        # Dotted keys first: one may fill a nested "auto" that would otherwise be refused.
        data = apply_dotted_keys(DeepSpeedRootConfig, self._param_dict)
        if strict:
            if isinstance(data.get(ZERO_OPTIMIZATION), dict):  # config_utils' note on "auto" there
                zero = default_auto_values(data[ZERO_OPTIMIZATION], prefix=ZERO_OPTIMIZATION)
                data = {**data, ZERO_OPTIMIZATION: zero}
            reject_auto_values(data)
        else:
            data = strip_auto_values(data)
        self.typed_config = parse_section(DeepSpeedRootConfig, data)
        self._set_batch_sizes()
        self._set_precision_attributes()
        self._set_other_attributes()

    def _set_batch_sizes(self) -> None:
        typed = self.typed_config
        train = typed.train_batch_size
        micro = typed.train_micro_batch_size_per_gpu
        gas = typed.gradient_accumulation_steps
        if not self.strict and train is None and micro is None and gas is None:
            micro = 1  # zero.Init does not train; upstream would refuse here
        self.world_size = self._sequences_in_parallel(self.world_size)
        train, micro, gas = resolve_batch_sizes(train, micro, gas, self.world_size)
        self.train_batch_size = train
        self.train_micro_batch_size_per_gpu = micro
        self.gradient_accumulation_steps = gas

    def _sequences_in_parallel(self, world_size: int) -> int:
        """The data-parallel size of the batch identity: the world over `sequence_parallel_size`,
        unless a sequence-parallel mpu already gave it (its get_data_parallel_world_size)."""
        sp = self.typed_config.sequence_parallel_size
        if sp == 1 or hasattr(self.mpu, "get_sequence_parallel_world_size"):
            return world_size
        if world_size % sp != 0:
            raise DeepSpeedConfigError(
                f"sequence_parallel_size={sp} does not divide the world size {world_size}; choose a divisor of it"
            )
        return world_size // sp

    def _set_precision_attributes(self) -> None:
        typed = self.typed_config
        for name, value in precision_attributes(typed.fp16, typed.bf16, typed.amp).items():
            setattr(self, name, value)

    @property
    def bf16_enabled(self) -> bool:
        """Alias of `bfloat16_enabled`."""
        return self.bfloat16_enabled

    def _set_other_attributes(self) -> None:
        typed = self.typed_config
        self.zero_config = typed.zero_optimization
        self.compile_config = typed.compile
        self.monitor_config = typed.monitors()  # upstream's attribute, read by MonitorMaster
        self.comms_config = DeepSpeedCommsConfig("comms_logger" in typed.model_fields_set, typed.comms_logger)
        self.zero_optimization_stage = int(self.zero_config.stage)
        self.zero_enabled = self.zero_config.stage > ZeroStageEnum.disabled
        self.gradient_clipping = typed.gradient_clipping
        self.steps_per_print = typed.steps_per_print
        optimizer, scheduler = typed.optimizer, typed.scheduler
        self.optimizer_name = _normalise_optimizer_name(optimizer.type if optimizer else None)
        self.optimizer_params = optimizer.params if optimizer else None
        self.optimizer_legacy_fusion = optimizer.legacy_fusion if optimizer else False
        self.scheduler_name = scheduler.type if scheduler else None
        self.scheduler_params = scheduler.params if scheduler else None
        self.communication_data_type = _comm_dtype(typed.communication_data_type)
        self.torch_autocast = typed.torch_autocast
        self.torch_autocast_enabled = typed.torch_autocast.enabled
        self.torch_autocast_dtype = typed.torch_autocast.torch_dtype
        self.torch_autocast_lower_precision_safe_modules = typed.torch_autocast.lower_precision_safe_modules
        self.seq_parallel_communication_data_type = _comm_dtype(typed.seq_parallel_communication_data_type)
        for name in (
            "wall_clock_breakdown",
            "memory_breakdown",
            "dump_state",
            "prescale_gradients",
            "gradient_predivide_factor",
            "gradient_allreduce_op",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "disable_allgather",
            "graph_harvesting",
            "dataloader_drop_last",
            "log_level",
        ):
            setattr(self, name, getattr(typed, name))
        self.flops_profiler_config = typed.flops_profiler
        # upstream: the profiler's backward and step latency come from the engine's timers
        self.wall_clock_breakdown = typed.wall_clock_breakdown or typed.flops_profiler.enabled
        self.sparse_gradients_enabled = typed.sparse_gradients
        self.checkpoint_config = dict(typed.checkpoint or {})
        self.data_types = dict(typed.data_types or {})
        self.grad_accum_dtype = self.data_types.get("grad_accum_dtype")
        self.load_universal_checkpoint = typed.load_universal_checkpoint or bool(
            self.checkpoint_config.get("load_universal", False)
        )
        # What a save does with a tag that differs between ranks (checkpoint/save.py's _tag_to_save_under).
        self.checkpoint_tag_validation = str(self.checkpoint_config.get("tag_validation", "warn")).lower()
        self.use_node_local_storage = typed.use_node_local_storage or bool(
            self.checkpoint_config.get("use_node_local_storage", False)
        )

    # ------------------------------------------------------------------------------------

    def _attribute_items(self) -> list[tuple[str, Any]]:
        hidden = {"_param_dict", "typed_config", "mpu", "mesh_device"}
        items = [(k, v) for k, v in vars(self).items() if k not in hidden]
        items.append(("bf16_enabled", self.bf16_enabled))
        return sorted(items)

    def describe(self, name: str = "DeepSpeedConfig") -> str:
        """Every attribute on its own line, then the JSON as given: what `print` logs."""
        width = max(len(key) for key, _ in self._attribute_items()) + 2
        lines = [f"{name}:"]
        lines.extend(
            f"  {key} {'.' * (width - len(key))} {value!r}" for key, value in self._attribute_items()
        )
        lines.append(f"  json = {json.dumps(self._param_dict, sort_keys=True, indent=4, default=str)}")
        return "\n".join(lines)

    def print(self, name: str) -> None:
        """Log `describe(name)` at INFO on the package logger (upstream's method name)."""
        ds_logger.info(self.describe(name))

    def __repr__(self) -> str:
        precision = "fp16" if self.fp16_enabled else "bf16" if self.bfloat16_enabled else "fp32"
        return (
            f"DeepSpeedConfig(train_batch_size={self.train_batch_size}, "
            f"train_micro_batch_size_per_gpu={self.train_micro_batch_size_per_gpu}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
            f"world_size={self.world_size}, zero_stage={self.zero_optimization_stage}, "
            f"precision={precision}, optimizer={self.optimizer_name!r}, scheduler={self.scheduler_name!r})"
        )


def _normalise_optimizer_name(name: Optional[str]) -> Optional[str]:
    if name is None:
        return None
    return name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name


def _comm_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    return None if name is None else _COMM_DTYPES[name]


def get_gradient_clipping(param_dict: dict) -> float:
    """Upstream's reader: a raw config dict's `gradient_clipping` (default 1.0, as upstream 0.19)."""
    return param_dict.get("gradient_clipping", DeepSpeedRootConfig.model_fields["gradient_clipping"].default)


def get_log_level(param_dict: dict) -> Optional[str]:
    """Upstream's reader: a raw config dict's `log_level` (default None: the logger is left as it is)."""
    return param_dict.get("log_level")
