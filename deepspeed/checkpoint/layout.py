"""The on-disk layout of a checkpoint: file names, `latest`, the tag, the per-file metadata.

No collectives and no tensors' contents here: names, the folder's small text files and the
version-independent view of one file. `save.py` decides what each rank writes,
`sharded.py` reads a tag folder back.

[Note: checkpoint layout]
    save_dir/
      latest              the newest complete tag, as plain text
      zero_to_fp32.py     a shim that runs `deepspeed.utils.zero_to_fp32`
      <tag>/              `global_step{N}` unless the caller names it
        zero_pp_rank_{r}_mp_rank_00_model_states.pt   one per saving rank r
        zero_pp_rank_{r}_mp_rank_00_optim_states.pt   one per saving rank r (training engines)

Since format version 2 the files are laid out as upstream DeepSpeed's stage-3 files, so
that upstream's `zero_to_fp32` and Lightning's `convert_zero_checkpoint_to_fp32_state_dict`
read them, and this package's own metadata sits under one key, `zero3_checkpoint`:

  *_model_states.pt   upstream's keys: `module` (rank 0: the persistent buffers), `buffer_names`,
                      `param_shapes` (one ordered {name: shape} per optimizer param group),
                      `frozen_param_shapes`, `frozen_param_fragments` (this rank's shards of the
                      parameters without an fp32 master), `shared_params` {alias: name},
                      `lr_scheduler`, `global_steps`, `global_samples`, `skipped_steps`,
                      `dp_world_size`, `mp_world_size`, `ds_config`, `ds_version`; the client
                      state's keys at the top level too (refused if they collide with these);
                      `zero3_checkpoint`: header, `ParamMeta` list in named_parameters() order,
                      dtype, `micro_steps`, `client_state_keys`.
  *_optim_states.pt   `optimizer_state_dict`: `zero_stage` 3, `partition_count`, `loss_scaler`,
                      `overflow`, `fp32_flat_groups` (per group, this rank's fp32 master shards
                      one after another in `param_shapes` order) and the torch optimizer's
                      `state` / `param_groups` keyed by group with flat moments; `zero3_checkpoint`:
                      header, `fp32_master_shards` and `optimizer_state` per name (views into the
                      flat tensors, so stored once), replicated state such as Adam's `step`
                      (rank 0), param groups with parameter names, loss scaler, overflow.

All files of one save carry the same random `save_id`. Version-1 files (everything at the
top level, client state under `client_state`) still load; so do upstream DeepSpeed's own
stage-3 files, through `upstream.normalize_upstream`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from typing import Any, Optional

from deepspeed.checkpoint.atomic_write import atomic_write_text
from deepspeed.checkpoint.constants import (
    MODEL_FILE_PREFIX,
    MODEL_FILE_SUFFIX,
    OPTIM_FILE_SUFFIX,
    ZERO_FILE_PREFIX,
)
from deepspeed.checkpoint.errors import CheckpointError

FORMAT = "deepspeed-zero3-sharded"
FORMAT_VERSION = 2
OWN_KEY = "zero3_checkpoint"  # this package's metadata inside a file laid out as upstream's
LATEST_FILE = "latest"
RECOVERY_SCRIPT = "zero_to_fp32.py"
# Upstream DeepSpeed's model file at stages 0-2: one for every rank (the whole module).
UPSTREAM_REPLICATED_MODEL_FILE = f"{MODEL_FILE_PREFIX}00{MODEL_FILE_SUFFIX}"

_RANK_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_(model|optim)_states\.pt$")

# The script runs whichever deepspeed is installed: this package's `zero_to_fp32` command, or
# upstream's, which reads these files too (the same module path and arguments; its module is a
# command with a `__main__` block and no `main()`).
_RECOVERY_SCRIPT_TEXT = '''#!/usr/bin/env python
"""Consolidate the ZeRO checkpoints in this folder into one fp32 state dict.

    python zero_to_fp32.py . pytorch_model.bin            # the tag named in `latest`
    python zero_to_fp32.py . out_dir --safe_serialization # out_dir/model.safetensors

It runs the installed deepspeed's `python -m deepspeed.utils.zero_to_fp32` with these arguments.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    command = importlib.import_module("deepspeed.utils.zero_to_fp32")
    if hasattr(command, "main"):
        sys.exit(command.main())  # non-zero, with the message on stderr, when the checkpoint cannot be read
    sys.modules.pop(command.__name__)  # run afresh as __main__ (upstream DeepSpeed's module)
    runpy.run_module(command.__name__, run_name="__main__", alter_sys=True)
'''


def model_states_name(rank: int) -> str:
    return f"{ZERO_FILE_PREFIX}{rank}_{MODEL_FILE_PREFIX}00{MODEL_FILE_SUFFIX}"


def optim_states_name(rank: int) -> str:
    return f"{ZERO_FILE_PREFIX}{rank}_{MODEL_FILE_PREFIX}00{OPTIM_FILE_SUFFIX}"


def upstream_optimizer_only_name(expp_rank: int) -> str:
    """Upstream's file for an optimizer ZeRO does not shard; never written or read here (every
    stage shards the optimizer, into the `optim_states_name` files)."""
    return f"expp_rank_{expp_rank}_mp_rank_00_optim_states.pt"


def new_save_id() -> str:
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class ParamMeta:
    """What a checkpoint records about one parameter (stored as a plain dict)."""

    name: str  # as in module.named_parameters()
    shape: tuple
    numel: int
    ds_id: int  # informational: parameters are matched by name, ds_ids may differ between runs
    partition_size: int  # elements per saving rank, padding included
    requires_grad: bool
    has_master: bool  # its weights (fp32) and optimizer state are in the optim-states files

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ParamMeta:
        return cls(**{**d, "shape": tuple(d["shape"])})


def write_latest(save_dir: str, tag: str) -> None:
    """Point `save_dir/latest` at `tag` (call only once every rank's files are written)."""
    atomic_write_text(os.path.join(save_dir, LATEST_FILE), str(tag))


def write_recovery_script(save_dir: str) -> str:
    """Write `save_dir/zero_to_fp32.py`; returns its path."""
    path = os.path.join(save_dir, RECOVERY_SCRIPT)
    atomic_write_text(path, _RECOVERY_SCRIPT_TEXT)
    return path


def remove_stale_rank_files(ckpt_dir: str, world_size: int) -> list:
    """Delete rank files numbered `world_size` or more: leftovers of an older, larger save."""
    removed = []
    for name in sorted(os.listdir(ckpt_dir)):
        match = _RANK_FILE.match(name)
        if match and int(match.group(1)) >= world_size:
            os.remove(os.path.join(ckpt_dir, name))
            removed.append(name)
    return removed


def check_tag(tag: Any) -> str:
    """`tag` as a directory name; a path separator or an empty name is refused."""
    text = str(tag)
    if not text or text in (".", "..") or "/" in text or (os.sep in text) or "\n" in text:
        raise ValueError(f"checkpoint tag {text!r} must be a plain directory name (no '/', not empty)")
    return text


def read_latest(load_dir: str) -> Optional[str]:
    """The tag `load_dir/latest` names, or None when there is no such file.

    The tag must be a plain folder name inside `load_dir`: a `latest` that points elsewhere
    (`../x`, an absolute path) is refused, so it cannot redirect a load to other files.
    """
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        tag = f.read().strip()
    if not tag:
        raise CheckpointError(f"{path}: the 'latest' file is empty; pass tag= to choose a checkpoint")
    try:
        return check_tag(tag)
    except ValueError:
        raise CheckpointError(
            f"{path}: names {tag[:200]!r}, not a tag folder inside {load_dir}; 'latest' may not point "
            "elsewhere; pass tag= to choose a checkpoint"
        ) from None


def own_layout(obj: Any, path: str, kind: str) -> dict:
    """The reader's view of one of this package's files (`kind` "model" or "optim"), any version.

    Version 2 keeps upstream's key names at the top level (see [Note: checkpoint layout]) and
    this package's own metadata under `zero3_checkpoint`; version 1 had everything at the top
    level and the client state under `client_state`.
    """
    inner = obj.get(OWN_KEY) if isinstance(obj, dict) else None
    flat = inner if isinstance(inner, dict) else obj
    if not isinstance(flat, dict) or flat.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a sharded ZeRO-3 checkpoint file of this package or of upstream DeepSpeed "
            f"(format={_get(flat, 'format')!r})"
        )
    if flat.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {flat['format_version']} is newer than this package reads "
            f"({FORMAT_VERSION}); upgrade deepspeed"
        )
    if flat is obj or kind == "optim":
        return flat
    shared = obj.get("shared_params") or {}
    return {
        **inner,
        "buffers": obj.get("module") or {},
        "frozen_param_shards": obj.get("frozen_param_fragments") or {},
        "shared_params": [[a, c] for a, c in shared.items()],
        "lr_scheduler": obj.get("lr_scheduler"),
        "global_steps": obj.get("global_steps"),
        "global_samples": obj.get("global_samples"),
        "skipped_steps": obj.get("skipped_steps"),
        "client_state": {k: obj[k] for k in inner.get("client_state_keys", ()) if k in obj},
    }


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else type(obj).__name__
