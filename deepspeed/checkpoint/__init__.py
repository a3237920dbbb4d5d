"""Checkpoint helpers (`deepspeed.checkpoint.utils`); the sharded format is in runtime/zero."""

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
