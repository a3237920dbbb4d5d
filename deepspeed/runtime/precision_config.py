"""The `fp16`, `bf16` and `torch_autocast` sections of a DeepSpeed config, and the flat precision attributes
`DeepSpeedConfig` derives from them (`fp16_enabled`, `loss_scale`, `dynamic_loss_scale_args`, ...).

Upstream's module path; `config.py` re-exports both section classes too.
"""

import types
from typing import Any, ClassVar, Optional

import torch
from pydantic import Field, field_validator

from deepspeed.runtime.config_utils import (
    DeepSpeedConfigModel,
    Unsupported,
    parse_section,
    unsupported_when_true,
)

__all__ = [
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "DeepSpeedTorchAutocastConfig",
    "get_bfloat16_config",
    "precision_attributes",
]


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """`fp16`: train in float16 with a (by default dynamic) loss scale."""

    _unsupported: ClassVar[dict[str, Unsupported]] = {
        "fp16_master_weights_and_grads": unsupported_when_true(
            "masters and gradients are always kept in fp32 (upstream allows fp16 only with CPU-offload Adam)"
        ),
    }

    enabled: bool = False
    """Train with float16 parameters and activations."""

    auto_cast: bool = False
    """Cast floating-point tensors among the engine forward's inputs to float16 (with `enabled`)."""

    loss_scale: float = Field(0.0, ge=0.0)
    """Static loss scale; 0 selects dynamic loss scaling."""

    initial_scale_power: int = Field(16, ge=0)
    """Dynamic scaling starts at 2**initial_scale_power."""

    loss_scale_window: int = Field(1000, gt=0)
    """Overflow-free steps before the dynamic scale is raised."""

    hysteresis: int = Field(2, ge=1)
    """Overflows tolerated before the dynamic scale is lowered (upstream `delayed_shift`)."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step."""

    min_loss_scale: float = Field(1.0, gt=0.0)
    """The dynamic scale never drops below this."""

    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in float16 too (upstream, CPU-offload Adam only)."""


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """`bf16` (also spelt `bfloat16`): train in bfloat16; no loss scaling is needed."""

    _unsupported: ClassVar[dict[str, Unsupported]] = {
        "bf16_master_weights_and_grads": unsupported_when_true(
            "master weights and gradients are always kept in fp32"
        ),
        "bf16_optimizer_states": unsupported_when_true("optimizer states are always kept in fp32"),
    }
    _no_effect: ClassVar[dict[str, str]] = {
        "immediate_grad_update": "reduced gradients are always added to the fp32 gradient shard as each "
        "bucket is reduced (what true means upstream); false only delays that upstream",
    }

    enabled: bool = False
    """Train with bfloat16 parameters and activations."""

    immediate_grad_update: bool = False
    """Upstream: apply gradients to the fp32 copy as they arrive; always so here (no effect)."""

    check_grad_overflow: bool = True
    """Skip a step whose gradients hold inf or nan (upstream's default); false applies it at
    stages 1-2 (stage 3 skips such a step whatever this says, as upstream's)."""

    bf16_master_weights_and_grads: bool = False
    """Upstream: keep master weights and gradients in bfloat16; true is refused (always fp32)."""

    bf16_optimizer_states: bool = False
    """Upstream: keep optimizer states in bfloat16; true is refused (always fp32)."""


_AUTOCAST_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_AUTOCAST_DTYPES = types.MappingProxyType(_AUTOCAST_DTYPES)  # read-only from here on


class DeepSpeedTorchAutocastConfig(DeepSpeedConfigModel):
    """`torch_autocast`: the engine's forward under `torch.autocast` ([Note: torch_autocast] in torch_autocast.py)."""

    enabled: bool = False
    """Run `engine.forward` under `torch.autocast` with `dtype`."""

    dtype: str = "bfloat16"
    """The autocast dtype: "bfloat16" or "float16" (also "torch.bfloat16", "bf16", "fp16")."""

    lower_precision_safe_modules: Optional[list[str]] = None
    """Qualified class names whose parameters' gradients are reduced in `dtype` (default:
    torch.nn.Linear, Conv1d, Conv2d, Conv3d)."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _known_dtype(cls, value: Any) -> str:
        name = str(value).lower().removeprefix("torch.")
        if name not in _AUTOCAST_DTYPES:
            raise ValueError(f"torch_autocast.dtype={value!r}: use 'bfloat16' or 'float16'")
        return "bfloat16" if _AUTOCAST_DTYPES[name] is torch.bfloat16 else "float16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _AUTOCAST_DTYPES[self.dtype]


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """Upstream's helper: the typed `bf16` section of a raw config dict (the old key `bfloat16`
    when `bf16` is absent; neither gives the defaults), checked as `DeepSpeedConfig` checks it."""
    section = param_dict.get("bf16", param_dict.get("bfloat16"))
    return parse_section(DeepSpeedBF16Config, section or {}, prefix="bf16")


def precision_attributes(
    fp16: DeepSpeedFP16Config, bf16: DeepSpeedBF16Config, amp: Optional[dict]
) -> dict[str, Any]:
    """Upstream's flat precision attributes of a config, by name, from its typed sections."""
    out: dict[str, Any] = {
        "fp16_enabled": fp16.enabled,
        "bfloat16_enabled": bf16.enabled,
        "fp16_auto_cast": fp16.auto_cast if fp16.enabled else False,
        "fp16_master_weights_and_grads": fp16.fp16_master_weights_and_grads,
        "bfloat16_immediate_grad_update": bf16.immediate_grad_update,
        "bfloat16_check_grad_overflow": bf16.check_grad_overflow,
    }
    # Upstream's values when fp16 is off: bf16 needs no scaling (1), plain fp32 reports 0.
    if fp16.enabled:
        out["loss_scale"] = fp16.loss_scale
        out["initial_dynamic_scale"] = 2**fp16.initial_scale_power
    else:
        out["loss_scale"] = 1.0 if bf16.enabled else 0.0
        out["initial_dynamic_scale"] = 1 if bf16.enabled else 2**16
    out["dynamic_loss_scale_args"] = None
    if fp16.enabled and fp16.loss_scale == 0:
        out["dynamic_loss_scale_args"] = {
            "init_scale": 2**fp16.initial_scale_power,
            "scale_window": fp16.loss_scale_window,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": fp16.min_loss_scale,
        }
    amp = amp or {}
    out["amp_enabled"] = bool(amp.get("enabled", False))
    out["amp_params"] = {k: v for k, v in amp.items() if k != "enabled"} if out["amp_enabled"] else None
    return out
