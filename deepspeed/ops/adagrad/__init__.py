"""Adagrad for offloaded optimizer state (upstream's import path)."""

from deepspeed.ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
