"""The engine's checkpoint methods, under upstream's names, each delegating to this package.

`DeepSpeedEngine` inherits `CheckpointMethods`; every method reads the engine only through
the `CheckpointEngine` interface (interface.py), which the engine implements. Upstream's
private names (`_get_ckpt_name`, ...) are kept because code written for upstream calls or
patches them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from deepspeed.checkpoint import export_16bit, layout, load, save


class CheckpointMethods:
    """`save_checkpoint`, `load_checkpoint`, `save_16bit_model` and upstream's file-name methods."""

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: Optional[dict] = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write this rank's shard files under `save_dir/tag`, then (all ranks done) `latest`.

        Every rank must call it. `tag` defaults to `global_step{global_steps}`;
        `client_state` is returned by `load_checkpoint`. Returns True.
        """
        # NVMe: swapped masters and state are copied a group at a time, not read into memory
        # (nvme_optimizer.py's [Note: checkpoints of swapped state]).
        return save.save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Optional[Callable] = None,
        trust_checkpoint: bool = False,
    ) -> tuple:
        """Load `load_dir/tag` (default: the tag in `load_dir/latest`), saved on any number of ranks.

        Returns `(path, client_state)`, or `(None, None)` when there is no such checkpoint.
        Every rank must call it. Errors raise `CheckpointError` on every rank, and leave the
        engine unchanged. Files are unpickled through an allowlist: one that names anything
        else raises `UnsafeCheckpointError` on every rank, unless `trust_checkpoint=True` (or
        `DEEPSPEED_TRUST_CHECKPOINT=1`) says its source is trusted (see [Note: loading
        untrusted checkpoints] in safe_load.py).
        """
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported by this engine")
        return load.load_checkpoint(  # NVMe: written to the swap files a group at a time (as above)
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            trust_checkpoint,
        )

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Gather the full weights in the model dtype and have rank 0 write them with `torch.save`.

        Every rank must call it. At stage 3 it returns False, writing nothing, when the config's
        `stage3_gather_16bit_weights_on_model_save` is off, as upstream does; at stages 0-2 the
        parameters are whole on every rank, so it always saves, as upstream does too.
        """
        return export_16bit.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """The older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Optional[dict]:
        """The module's full state dict in the model dtype on rank 0 (None on other ranks);
        every rank must call it (see `export_16bit.consolidated_16bit_state_dict`)."""
        return export_16bit.consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    # Upstream's names for the files of one save (code written for it calls or patches them).

    def _get_ckpt_name(self, checkpoints_path: str, tag: Any, mp_placeholder: Any = None) -> str:
        """This rank's model-states file of the save `checkpoints_path/tag`."""
        return save.model_states_path(self, checkpoints_path, tag)

    def _get_zero_ckpt_name(self, checkpoints_path: str, tag: Any) -> str:
        """This rank's optimizer-states file (its fp32 master and optimizer-state shards)."""
        return save.optim_states_path(self, checkpoints_path, tag)

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: Any, expp_rank: int = 0) -> str:
        """The file upstream keeps an optimizer's states in when ZeRO does not shard them
        (expert-parallel rank `expp_rank`). Here ZeRO shards every optimizer at every stage,
        so its states are in the `_get_zero_ckpt_name` files and this one is never written
        or read: a module-only load, which reads no optimizer state, never asks for it."""
        return os.path.join(checkpoints_path, str(tag), layout.upstream_optimizer_only_name(expp_rank))

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """Make the saved `zero_to_fp32.py` executable (upstream's method name); a refusal is logged."""
        save.make_executable(dst)
