"""Lion (upstream's import path): `DeepSpeedCPULion` for offloaded optimizer state, `FusedLion` otherwise."""

from deepspeed.ops.lion.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
