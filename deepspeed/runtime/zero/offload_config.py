"""Typed `offload_param` and `offload_optimizer` blocks of `zero_optimization`.

Key names and defaults are upstream DeepSpeed's, so existing JSON configs validate unchanged.
"""

import enum
from pathlib import Path
from typing import ClassVar, Optional

from pydantic import Field, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel, Unsupported

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]


class OffloadDeviceEnum(str, enum.Enum):
    """Where offloaded tensors live. A `str` enum, so ``device == "cpu"`` also works."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """Kinds of engine state that `engine.offload_states()` can move (upstream names)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    """`zero_optimization.offload_param`: keep partitioned parameters off the accelerator.

    Valid only with stage 3. `device` "cpu" and `pin_memory` are acted on by `zero.Init` (which
    the engine also runs on a model built without it); ``device: "nvme"`` swaps each partition
    to a file under `nvme_path` (runtime/zero/param_swap.py; docs/nvme.md), staged through
    `buffer_count` buffers of at most `buffer_size` elements, with at most `max_in_cpu`
    partition elements resident in host memory.
    """

    _unsupported: ClassVar[dict[str, Unsupported]] = {}
    _no_effect: ClassVar[dict[str, str]] = {}

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    """Where parameter shards live: "none" (the accelerator), "cpu" or "nvme"."""

    nvme_path: Optional[Path] = None
    """Directory on the NVMe drive used when `device` is "nvme" (required then); the swap files
    go in a private folder under `<nvme_path>/zero_swap/`, removed when the process ends."""

    buffer_count: int = Field(5, ge=0)
    """NVMe: staging buffers in the pool every partition read and write goes through (>= 1);
    reads ahead of use are issued while one is free."""

    buffer_size: int = Field(int(1e8), ge=0)
    """NVMe: the most elements one staging buffer holds; a partition larger than this is an
    error naming the size needed. Buffers are sized to the largest partition, up to this."""

    max_in_cpu: int = Field(int(1e9), ge=0)
    """NVMe: the most partition elements kept resident in host memory (least recently used
    are written out first; 0 keeps only what is in use)."""

    pin_memory: bool = True
    """Use page-locked CPU memory where the accelerator pins: faster copies, at the cost of
    pinned host memory (upstream's default, True). "nvme" pins only its staging buffers."""

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> "DeepSpeedZeroOffloadParamConfig":
        if self.device == OffloadDeviceEnum.nvme and self.nvme_path is None:
            raise ValueError(
                "zero_optimization.offload_param.device='nvme' needs zero_optimization.offload_param.nvme_path: "
                "set it to a folder on the drive to swap parameters to"
            )
        return self


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    """`zero_optimization.offload_optimizer`: keep optimizer state (and its step) off the accelerator.

    Valid with stages 1, 2 and 3. With ``device: "cpu"`` the fp32 master slices, their
    gradients and the optimizer state live on the CPU (pinned with `pin_memory`, where the
    accelerator pins) and the step runs there, with `DeepSpeedCPUAdam` for Adam/AdamW
    configs; the accelerator then holds only the training-dtype parameters. With
    ``device: "nvme"`` the masters and the optimizer state live in swap files under
    `nvme_path` and stream through the CPU step in sub-groups (docs/nvme.md); the NVMe keys
    below tune that and change nothing with "cpu" or "none" (as upstream).
    """

    _unsupported: ClassVar[dict[str, Unsupported]] = {
        "ratio": Unsupported("partial optimizer offload (ratio < 1) is not implemented; use 1.0"),
        "super_offload": Unsupported("SuperOffload is not implemented; remove the key"),
        "cpuadam_cores_perc": Unsupported("SuperOffload's CPU core split is not implemented; remove the key"),
    }
    _no_effect: ClassVar[dict[str, str]] = {
        "fast_init": "upstream's switch to skip initialising the swapped optimizer state at set-up; here "
        "that state is never initialised at set-up (the optimizer creates it in its first step, and set-up "
        "only reserves the files and writes the masters), so true and false both start as fast",
    }

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    """Where optimizer state lives: "none" (the accelerator), "cpu" or "nvme"."""

    nvme_path: Optional[Path] = None
    """Directory on the NVMe drive used when `device` is "nvme" (required then); swap files go
    under `<nvme_path>/zero_swap/` and are removed when the process ends."""

    buffer_count: int = Field(4, ge=0)
    """Bound on the host buffers NVMe swapping stages through: a sub-group uses one per swapped
    kind (the masters and each state tensor: Adam 3), times 1 + pipeline_read + pipeline_write."""

    pin_memory: bool = True
    """Use page-locked CPU memory where the accelerator pins: faster copies, at the cost of
    pinned host memory (upstream's default, True)."""

    pipeline_read: bool = False
    """NVMe: read the next sub-group's state while the current one steps (else read it after)."""

    pipeline_write: bool = False
    """NVMe: write a sub-group back while the next one steps (else wait for the write)."""

    fast_init: bool = False
    """NVMe: initialise the swapped optimizer state quickly."""

    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of optimizer state offloaded; below 1.0 needs stage 3 (partial offload)."""

    super_offload: bool = False
    """Upstream's SuperOffload mode for superchips."""

    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    """Upstream SuperOffload: fraction of CPU cores given to CPU Adam."""

    @model_validator(mode="after")
    def _nvme_needs_a_path(self):
        if self.device == OffloadDeviceEnum.nvme and self.nvme_path is None:
            raise ValueError(
                "zero_optimization.offload_optimizer.device='nvme' needs nvme_path: set it to a folder on "
                "the drive to swap the optimizer state to"
            )
        return self

    @property
    def pipeline(self) -> bool:
        """True when either NVMe pipelining direction is on (upstream reads this name)."""
        return self.pipeline_read or self.pipeline_write
