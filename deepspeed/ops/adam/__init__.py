"""Adam optimizers. Importing compiles nothing; the first `DeepSpeedCPUAdam` does."""

from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from deepspeed.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
