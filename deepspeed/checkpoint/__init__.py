"""Checkpoints: save and load through the interface an engine implements (interface.py), the
sharded format (layout.py, sharded.py), upstream's files (upstream.py) and `zero_to_fp32`.

docs/checkpoints.md describes the format and the guarantees; `deepspeed.checkpoint.utils`
keeps upstream's helpers.
"""

from deepspeed.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["CheckpointError", "UnsafeCheckpointError", "clone_tensors_for_torch_save"]
