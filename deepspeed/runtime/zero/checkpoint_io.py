"""The former home of the checkpoint errors, kept because docs/checkpoints.md named it for
catching them; the checkpoint code is `deepspeed/checkpoint/`."""

from deepspeed.checkpoint.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["CheckpointError", "UnsafeCheckpointError"]
