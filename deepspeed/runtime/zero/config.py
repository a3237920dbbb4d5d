"""The typed `zero_optimization` section, with upstream DeepSpeed 0.19 key names and aliases.

HF transformers and most published configs spell the stage-3 options with a ``stage3_``
prefix (``stage3_prefetch_bucket_size``); the fields here carry the short name and accept
the prefixed one as an alias, as upstream does. Sizes are integers but JSON configs write
them as floats (``5e8``); any float without a fractional part is accepted.
"""

import enum
import sys
from typing import Any, ClassVar, Optional

from pydantic import Field, ValidationInfo, field_validator

from deepspeed.runtime.config_utils import (
    DeepSpeedConfigModel,
    DeprecatedKey,
    Unsupported,
    default_auto_values,
    logger,
    merge_dotted_key,
    parse_section,
    strip_auto_values,
)
from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
from deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

__all__ = ["ZERO_OPTIMIZATION", "DeepSpeedZeroConfig", "ZeroStageEnum", "get_zero_config"]

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(enum.IntEnum):
    """What ZeRO partitions across the data-parallel ranks; each stage adds to the previous."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def _cpu_offload_to_block(value: Any) -> Optional[dict[str, Any]]:
    # `cpu_offload: true` meant "optimizer state on the CPU"; `false` sets nothing.
    return {"device": OffloadDeviceEnum.cpu.value} if value else None


_PIN_MEMORY_KEY = "cpu_offload_use_pin_memory"

# Stage-1/2 communication knobs (see stage_1_and_2.py): the results are the same either way.
_STAGE12 = (
    "a stage-1/2 communication knob; stages 1-2 here always reduce-scatter gradients and all-gather "
    "the updated slices in allgather_bucket_size buckets, with the same results"
)


def _refuse(what: str, instead: str) -> Unsupported:
    return Unsupported(f"{what}: not implemented here; {instead}")


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    """`zero_optimization`: which ZeRO stage to run and how it buckets, prefetches and offloads."""

    _deprecated_keys: ClassVar[dict[str, DeprecatedKey]] = {
        "cpu_offload": DeprecatedKey("offload_optimizer", _cpu_offload_to_block, 'Use {"device": "cpu"}.'),
        "cpu_offload_param": DeprecatedKey("offload_param", _cpu_offload_to_block, 'Use {"device": "cpu"}.'),
        "stage3_gather_fp16_weights_on_model_save": DeprecatedKey("gather_16bit_weights_on_model_save"),
    }
    _unsupported: ClassVar[dict[str, Unsupported]] = {
        "load_from_fp32_weights": Unsupported(
            "a checkpoint load always restores the fp32 master shards and the weights from them; "
            "remove the key or set it to true"
        ),
        "use_all_reduce_for_fetch_params": _refuse(
            "fetching parameters by all-reduce", "parameters are all-gathered; set it to false"
        ),
        "allgather_sequential": _refuse(
            "one all-gather per parameter", "parameters are gathered in coalesced buckets; set it to false"
        ),
        "legacy_stage1": _refuse("upstream's old stage-1 implementation", "set it to false"),
        "zeropp_loco_param": _refuse("LoCo-ZeRO++", "remove the key"),
        "log_trace_cache_warnings": _refuse("trace-cache warnings", "set it to false"),
        "save_muon_momentum_buffer_in_memory": _refuse("Muon NVMe offload options", "set it to false"),
        "zenflow": _refuse("ZenFlow", "remove the key"),
        # Upstream 0.19.8 keys: known, so that a non-default value is refused rather than
        # ignored as an unknown key (config_utils' [Note: unknown and dotted keys]).
        "compute_grad_norm": Unsupported(
            "the global gradient norm is always computed at the step (engine.get_global_grad_norm()); "
            "remove the key or set it to true"
        ),
        "parameter_alignment": _refuse("upstream's aligned parameter layout", "set it to false"),
    }
    _no_effect: ClassVar[dict[str, str]] = {
        "contiguous_gradients": "gradients are always packed into the contiguous bucket they are "
        "reduce-scattered from, and their shards live in one fp32 buffer per parameter",
        "reduce_scatter": _STAGE12 + " (gradients are always reduce-scattered)",
        "use_multi_rank_bucket_allreduce": _STAGE12,
        "allgather_partitions": _STAGE12,
        "elastic_checkpoint": "checkpoints always load on any number of ranks, as if true",
        "round_robin_gradients": "upstream's order of CPU gradient copies under offload; here each "
        "rank copies its own gradient slices as they are reduced, with the same results",
        "memory_efficient_linear": "torch's linear already saves only its input for backward, not "
        "a gathered weight copy, which is what upstream's variant avoids",
    }

    stage: ZeroStageEnum = ZeroStageEnum.disabled
    """0: plain data parallel; 1: partition optimizer state; 2: also gradients; 3: also parameters."""

    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""

    reduce_scatter: bool = True
    """Average gradients with reduce-scatter instead of all-reduce (stages 1 and 2)."""

    reduce_bucket_size: int = Field(int(5e8), gt=0)
    """Number of gradient elements reduced at once."""

    use_multi_rank_bucket_allreduce: bool = True
    """Stages 1-2: all-reduce buckets that span several ranks' partitions in one call."""

    allgather_partitions: bool = True
    """Stages 1-2: all-gather updated partitions (True) or broadcast them rank by rank (False)."""

    allgather_bucket_size: int = Field(int(5e8), ge=0)
    """Stages 1-2: number of parameter elements all-gathered at once."""

    overlap_comm: Optional[bool] = Field(None, validate_default=True)
    """Issue gradient reduce-scatters asynchronously during backward (at most two buckets in
    flight) and wait for them at the end of backward. Unset means True for stage 3 only."""

    load_from_fp32_weights: bool = True
    """On checkpoint load, rebuild 16-bit weights from the fp32 master copy."""

    elastic_checkpoint: bool = False
    """Stages 1-2: allow loading optimizer state saved with a different data-parallel size."""

    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = None
    """Stage 3: keep parameter shards on the CPU or NVMe (see `DeepSpeedZeroOffloadParamConfig`)."""

    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None
    """Keep optimizer state on the CPU or NVMe and step there (`DeepSpeedZeroOffloadOptimizerConfig`)."""

    sub_group_size: int = Field(int(1e9), ge=0)
    """With `offload_optimizer.device` "nvme" (any stage): fp32 master elements per sub-group the
    step reads, updates and writes back at once (one master larger than this is a group of its
    own); it sizes the swap buffers. Elsewhere the step is element-wise over each rank's shards
    and has no sub-groups, so the value changes nothing there."""

    prefetch_bucket_size: int = Field(int(5e7), ge=0, alias="stage3_prefetch_bucket_size")
    """Stage 3: maximum number of parameter elements prefetched ahead of use."""

    param_persistence_threshold: int = Field(int(1e5), ge=0, alias="stage3_param_persistence_threshold")
    """Stage 3: parameters with fewer elements stay gathered (not partitioned)."""

    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    """Stage 3: upper bound on the total elements kept gathered by `param_persistence_threshold`.

    Small parameters are taken smallest first until the next would pass the bound."""

    max_live_parameters: int = Field(int(1e9), ge=0, alias="stage3_max_live_parameters")
    """Stage 3: most parameter elements gathered at once before older ones are released."""

    max_reuse_distance: int = Field(int(1e9), ge=0, alias="stage3_max_reuse_distance")
    """Stage 3: keep a parameter gathered if it is used again within this many elements."""

    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Stage 3: `save_16bit_model()` gathers the full 16-bit weights and saves them."""

    module_granularity_threshold: int = Field(0, ge=0, alias="stage3_module_granularity_threshold")
    """Stage 3: modules whose parameters per layer are at most this are marked as leaves and
    fetched as one unit (utils/z3_leaf_module.py's note on granularity); 0: none."""

    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    """Stage 3: fetch parameters with all-reduce rather than all-gather."""

    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    """Stage 3: all-gather parameters one by one instead of through a flat bucket."""

    ignore_unused_parameters: bool = True
    """False: a step raises, naming them, when trainable parameters got no gradient since the
    last step (every stage here; upstream checks at stage 2). True: they are left untouched."""

    legacy_stage1: bool = False
    """Upstream's old stage-1 implementation; true is refused."""

    round_robin_gradients: bool = False
    """Stages 1-2 with CPU offload: spread gradient copies over ranks; no effect without offload."""

    zero_hpz_partition_size: int = 1
    """ZeRO++ hpZ (stage 3): after a parameter's gather, each rank keeps a secondary slice of it
    cut over groups of this many consecutive ranks within one node, and later gathers before the
    next step (backward's) go over that group only (docs/hierarchical.md). Must divide the world
    size and fit within a node; 1 turns it off."""

    zero_quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): parameter all-gathers send block-wise int8 (blocks of 256, one fp32
    scale each) and every rank dequantizes to the parameter dtype; the shards and fp32 masters
    stay exact (docs/hierarchical.md, zero/quantized.py)."""

    zero_quantized_nontrainable_weights: bool = False
    """Stage 3: parameters with requires_grad=False gather as int8 (qwZ) from codes made once
    and kept beside their shard (the full-precision shard is kept too)."""

    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ (stage 3): gradient buckets are reduce-scattered as block-wise int8 through one
    all-to-all (two hops, within the node then across, when the group spans several nodes of
    several ranks), dequantized and summed in fp32 on the receiving rank."""

    zeropp_loco_param: Optional[dict[str, Any]] = None
    """LoCo-ZeRO++ settings (``err_beta``, ``reset_T``); free-form."""

    mics_shard_size: int = -1
    """MiCS (stage 3): parameters, gradients and optimizer state are partitioned within groups of
    this many consecutive ranks and replicated across the groups; gradients are reduce-scattered
    within a group, then averaged across the groups. Must divide the world size; -1 turns MiCS off."""

    mics_hierarchical_params_gather: bool = False
    """MiCS: a shard group that spans nodes gathers parameters in two hops, across nodes then
    within each node (the same values as one all-gather; docs/hierarchical.md). Needs
    `mics_shard_size`; shard groups within one node gather in one hop."""

    memory_efficient_linear: bool = True
    """Stage 3: use the memory-efficient linear layer that does not keep gathered weights."""

    pipeline_loading_checkpoint: bool = False
    """Stage 3: `load_checkpoint` runs on the ranks of a node one after another (local rank 0
    first), so the node's host memory holds one rank's loaded files at a time. Another stage
    refuses it at the load, as upstream."""

    override_module_apply: bool = True
    """Stage 3: while `zero.Init` is active, `Module.apply` gathers the module's parameters.

    False leaves `Module.apply` unpatched: `fn` then sees partitioned (empty) parameters."""

    log_trace_cache_warnings: bool = False
    """Stage 3: log warnings from the parameter-fetch trace cache (e.g. invalidations)."""

    enable_sanity_checks: bool = False
    """Run internal consistency checks, e.g. detect edits inside a read-only `GatheredParameters`."""

    save_muon_momentum_buffer_in_memory: bool = False
    """Upstream Muon + NVMe option; true is refused."""

    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)
    """Modules marked as ZeRO-3 leaf modules at initialize (`DeepSpeedZeroLeafModuleConfig`)."""

    zenflow: Optional[dict[str, Any]] = None
    """Upstream ZenFlow settings; refused unless absent."""

    compute_grad_norm: bool = True
    """Upstream: false skips the gradient norm; refused (the norm is always computed)."""

    parameter_alignment: bool = False
    """Upstream's aligned parameter layout; true is refused (not implemented)."""

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [*super().valid_keys(), _PIN_MEMORY_KEY]

    @classmethod
    def _rewrite_before_validation(cls, data: dict[str, Any]) -> dict[str, Any]:
        # `cpu_offload_use_pin_memory` applied to whichever offload blocks exist, including
        # those just made from `cpu_offload` / `cpu_offload_param`, so it runs after them.
        if _PIN_MEMORY_KEY not in data:
            return data
        pin = data.pop(_PIN_MEMORY_KEY)
        logger.warning(
            f"Config key '{_PIN_MEMORY_KEY}' is deprecated; set 'pin_memory' in the offload blocks."
        )
        blocks = [key for key in ("offload_param", "offload_optimizer") if isinstance(data.get(key), dict)]
        if not blocks:
            logger.warning(f"'{_PIN_MEMORY_KEY}' has no effect: no offload block is configured.")
        for key in blocks:
            data[key] = {"pin_memory": bool(pin), **data[key]}  # an explicit pin_memory wins
        return data

    @field_validator("mics_shard_size", mode="after")
    @classmethod
    def _mics_shard_size_is_positive_or_off(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(
                f"must be a positive number of ranks per shard group, or -1 (MiCS off); got {value}"
            )
        return value

    @field_validator("elastic_checkpoint", mode="after")
    @classmethod
    def _elastic_checkpoint_is_deprecated(cls, value: bool) -> bool:
        if value:  # as upstream, which deprecated it: say so rather than accept it silently
            logger.warning(
                "Elastic checkpointing is deprecated and has no effect here: checkpoints always load "
                "on any number of ranks; remove zero_optimization.elastic_checkpoint"
            )
        return value

    @field_validator("leaf_module", mode="before")
    @classmethod
    def _null_leaf_module_is_the_default(cls, value: Any) -> Any:
        return {} if value is None else value  # as upstream: `"leaf_module": null` keeps the defaults

    @field_validator("overlap_comm", mode="after")
    @classmethod
    def _default_overlap_comm(cls, value: Optional[bool], info: ValidationInfo) -> bool:
        # Upstream's default depends on the stage: overlapping pays off when params are sharded.
        if value is not None:
            return value
        return info.data.get("stage") == ZeroStageEnum.weights

    def check_mics_stage(self) -> None:
        """MiCS partitions parameters, so it is a stage-3 feature (as upstream); called by the
        whole config, like `check_offload_stage`."""
        if self.mics_shard_size > 0 and self.stage != ZeroStageEnum.weights:
            raise ValueError(
                f"zero_optimization.mics_shard_size={self.mics_shard_size} (MiCS) needs stage 3, got stage "
                f"{int(self.stage)}; set stage to 3 or mics_shard_size to -1"
            )
        if self.zero_hpz_partition_size < 1:
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size={self.zero_hpz_partition_size} (hpZ) must be a positive "
                "number of ranks per secondary group: a divisor of the world size, or 1 (off)"
            )
        if self.zero_hpz_partition_size > 1 and self.stage != ZeroStageEnum.weights:
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size={self.zero_hpz_partition_size} (hpZ) needs stage 3, got "
                f"stage {int(self.stage)}; set stage to 3, or the key to 1 (off)"
            )
        if self.mics_hierarchical_params_gather and self.mics_shard_size < 1:
            raise ValueError(
                "zero_optimization.mics_hierarchical_params_gather=True needs MiCS: set mics_shard_size to a "
                "positive divisor of the world size, or the key to false"
            )

    def check_offload_stage(self) -> None:
        """Refuse (or, for `offload_param`, drop with a warning) offload settings the configured
        stage cannot act on. Called by the whole
        config (runtime/config.py), not by this section's own validation: upstream builds the
        section alone from deprecated keys (`DeepSpeedZeroConfig(cpu_offload_param=True)`)
        with no stage given, and only a whole config says which stage will run."""
        offload = self.offload_optimizer
        if offload is not None and offload.ratio < 1.0 and self.stage != ZeroStageEnum.weights:
            raise ValueError(
                f"offload_optimizer.ratio={offload.ratio} (partial offload) needs stage 3, "
                f"got stage {int(self.stage)}"
            )
        param = self.offload_param
        if param is not None and param.device != "none" and self.stage != ZeroStageEnum.weights:
            # Stages 0-2 keep every parameter whole on the accelerator: there is no shard to move.
            # Upstream ignores the block there, and configs in the wild carry it at every stage
            # (DeepSpeed-Chat's --offload), so it is dropped, with one warning, not refused.
            logger.warning(
                f"zero_optimization.offload_param.device='{param.device.value}' has no effect at stage "
                f"{int(self.stage)}: below stage 3 every rank keeps whole parameters on the accelerator "
                "(upstream ignores it too); offload_optimizer offloads the optimizer state at every stage, "
                "stage 3 offloads parameters"
            )
            self.offload_param = None


def legacy_zero_value(value: Any) -> Any:
    """Upstream still reads ``"zero_optimization": true`` as stage 1 (false: stage 0)."""
    if isinstance(value, bool):
        logger.warning(
            f'"zero_optimization": {str(value).lower()} is deprecated; use {{"stage": {int(value)}}} instead.'
        )
        return {"stage": int(value)}
    return value


def get_zero_config(param_dict: Optional[dict[str, Any]], strict: bool = True) -> DeepSpeedZeroConfig:
    """The typed `zero_optimization` section of a whole DeepSpeed config dict (stage 0 if absent).

    Raises `ValueError` naming ``zero_optimization.<key>`` for anything invalid. "auto"
    values take their defaults, with a warning unless ``strict=False`` (`zero.Init`, which HF
    enters before it fills them): config_utils' note on "auto" in zero_optimization.
    """
    section = legacy_zero_value((param_dict or {}).get(ZERO_OPTIMIZATION, {}))
    for key, value in (param_dict or {}).items():  # TRL's "zero_optimization.<key>" (config_utils' note)
        if isinstance(section, dict) and isinstance(key, str) and key.startswith(ZERO_OPTIMIZATION + "."):
            section = merge_dotted_key(DeepSpeedZeroConfig, section, key.split(".", 1)[1], value, key)
    if strict:
        section = default_auto_values(section, prefix=ZERO_OPTIMIZATION)
    else:
        section = strip_auto_values(section)
    return parse_section(DeepSpeedZeroConfig, section, prefix=ZERO_OPTIMIZATION)
