"""Optimizers backed by native ops. Importing compiles nothing; the first optimizer does."""

from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
