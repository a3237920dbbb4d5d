"""What the checkpoint code needs from an engine: the interface `DeepSpeedEngine` implements.

`save.py`, `load.py` and `export_16bit.py` read and change an engine only through these
methods, so they hold no knowledge of the engine's attributes or of the ZeRO stage: where
the stage matters (are weights partitioned? may ranks load in turns?), the engine answers.
The engine's implementation is one marked block in `runtime/engine.py`.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import nn


class ParamShard(Protocol):
    """This rank's slice of one parameter (a stage-3 `ZeroParamState` or a stage 0-2
    `ReplicatedShard`): what a checkpoint saves of it and restores into."""

    ds_id: int  # the parameter's id, equal on every rank; keys the optimizer's fp32 masters
    shape: torch.Size  # the full parameter's shape
    numel: int  # the full parameter's element count
    world_size: int  # ranks the parameter is cut over
    rank: int  # this rank's index among them
    partition_size: int  # elements per rank, padding included
    shard: torch.Tensor  # 1D [partition_size], this rank's slice, in the model dtype


class CheckpointOptimizer(Protocol):
    """The ZeRO optimizer wrapper as a checkpoint sees it (`ZeroStage3Optimizer`)."""

    masters: dict  # ds_id -> this rank's fp32 master of that parameter (trainable ones only)
    optimizer: torch.optim.Optimizer  # the torch optimizer stepping the masters
    loss_scaler: Any  # state_dict() / load_state_dict(), `dynamic`
    overflow: bool  # whether the last step overflowed (fp16)

    def mark_master_current(self, state: ParamShard) -> None:
        """The shard and the master agree again: an edit made before a load is gone."""

    def resident(self) -> Any:
        """A context manager in which the masters and the optimizer state are in host memory
        (NVMe-swapped ones read in for the block and written back after); save and load run in it."""


class CheckpointEngine(Protocol):
    """An engine the checkpoint code can save and load; one line per method says what it gives."""

    def checkpoint_module(self) -> nn.Module:
        """The wrapped model: its parameters are saved by shard, its persistent buffers whole."""

    def checkpoint_shard_of(self, param: nn.Parameter) -> Optional[ParamShard]:
        """The object holding `param`'s shard on this rank; None for one added after initialize."""

    def checkpoint_optimizer(self) -> Optional[CheckpointOptimizer]:
        """The optimizer whose fp32 masters and state are saved and restored; None without one."""

    def checkpoint_lr_scheduler(self) -> Any:
        """The LR scheduler (its `state_dict` saved, `load_state_dict` on load), or None."""

    def checkpoint_rank_and_world(self) -> tuple:
        """`(rank, world size)` of the data-parallel group the shards are cut over."""

    def checkpoint_writes_files(self) -> bool:
        """Whether this rank writes its files: False on MiCS replicas but the first, whose
        shards are the same as the first's (see [Note: MiCS] in runtime/zero/mics.py)."""

    def checkpoint_record(self) -> dict:
        """What the files record about the run, never read back: `zero_stage`, `dtype`, `ds_config`."""

    def checkpoint_counters(self) -> dict:
        """`global_steps`, `global_samples`, `skipped_steps`, `micro_steps` as a save records them."""

    def restore_checkpoint_counters(self, global_steps: int, global_samples: int, skipped_steps: int) -> None:
        """Set the step counters from a loaded checkpoint (not on a module-only load)."""

    def restart_accumulation(self) -> None:
        """Drop the interrupted step's gradients; the next micro-step starts an accumulation."""

    def settle_before_save(self) -> None:
        """Make the shards and fp32 masters current (live gathers' edits written back first)."""

    def refresh_after_load(self) -> None:
        """Make every full or gathered tensor show the shards a load just wrote."""

    def saves_16bit_weights(self) -> bool:
        """Whether `save_16bit_model` writes: False where weights are partitioned and gathering
        them on save (`stage3_gather_16bit_weights_on_model_save`) is off."""

    def loads_in_turns(self) -> bool:
        """Whether the ranks of a node load one after another (`pipeline_loading_checkpoint`);
        raises ValueError where the config asks for it and the engine cannot."""

    def checkpoint_tag_validation(self) -> str:
        """`checkpoint.tag_validation`, lower case: what a save does with a tag that differs
        between ranks ("ignore", "warn" or "fail")."""

    def publishes_on_every_node(self) -> bool:
        """Whether every node's first rank writes `latest` (`use_node_local_storage`), not rank 0 alone."""
