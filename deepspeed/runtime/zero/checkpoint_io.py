"""The sharded ZeRO-3 checkpoint format: file names, crash-safe writes, reading and resharding.

No collectives live here: this module writes and reads files and cuts tensors. The engine
(`deepspeed/runtime/checkpointing.py`) decides what each rank writes and makes the ranks
agree; `deepspeed/utils/zero_to_fp32.py` reads the same files with no process group.

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
stage-3 files, through `checkpoint_upstream.normalize_upstream`.

[Note: crash-safe writes]
Each file is written under a temporary name in its final directory, flushed, fsync'd, and
then `os.replace`d onto its name: under its real name a file is complete or absent. The
engine replaces `latest` the same way, and only after every rank has reported its files
written. A save interrupted at any point therefore leaves `latest` naming the previous
complete tag. Overwriting one tag in place can mix files of two saves if interrupted; the
`save_id` check on load refuses such a mix instead of loading it.

[Note: elastic resharding]
Saved on N ranks, a parameter of `numel` elements is N shards of `ps_N` elements each (the
shard math of param_state.py). Loaded on M ranks, rank r needs the flat elements
`[r * ps_M, (r + 1) * ps_M)` clipped to `numel`, then zero padding up to `ps_M`.
`flat_slice` reads only the parts of the saved shards that overlap that range, and files
are memory-mapped, so loading never materializes a full parameter or another rank's data.

[Note: loading untrusted checkpoints]
A checkpoint file is a pickle, and unpickling calls whatever the pickle names: a planted
`*_states.pt` that names `os.system` runs a command the moment a plain `torch.load` opens it.
Every checkpoint file this package reads therefore goes through one function,
`load_checkpoint_file`: `torch.load(weights_only=True)`, whose restricted unpickler builds
only allowlisted globals, with this allowlist:
  - torch's own weights_only set: tensors and storages, dict / OrderedDict / list / tuple /
    set, numbers, strings, bytes, `torch.dtype`, `torch.Size`, `torch.device`. Our own files
    hold nothing else (the loss scaler, the stage, parameter metadata are plain dicts);
  - upstream DeepSpeed's pickled classes, under their names but as the plain-data stand-ins
    of `checkpoint_upstream.UPSTREAM_GLOBALS` (see [Note: upstream's pickled classes]);
  - `CLIENT_STATE_GLOBALS`: `argparse.Namespace` and POSIX paths, value types client state
    often holds (training arguments, hyperparameters) whose rebuilding runs no code of the file;
  - whatever the user allowlisted with `torch.serialization.add_safe_globals`.
The file's pickle is first scanned without running it (`torch.serialization.
get_unsafe_globals_in_checkpoint`), so a refusal (`UnsafeCheckpointError`) names the file and
every refused global at once; the restricted unpickler stays the guard either way.
Client state (`save_checkpoint(client_state=...)`) sits at the top level of the model-states
file, as upstream puts it (Lightning's converter reads it there). A save whose client state
holds a type outside the allowlist still succeeds but warns, naming the types: loading it
needs an explicit opt-in, `trust_checkpoint=True` (`load_checkpoint`, the zero_to_fp32 API),
`--trust_checkpoint` (zero_to_fp32 command line) or `DEEPSPEED_TRUST_CHECKPOINT=1` (for
clients such as Lightning that call `load_checkpoint` themselves). Opted in, the globals the
scan found are imported and allowlisted for that one load: the file is trusted, so the
classes and functions it names run (a `subprocess.call` too). It still goes through torch's
restricted unpickler, which reads only the pickle instructions `torch.save` writes and refuses
the modules torch blocks outright (`os`, `posix`, `nt`, `sys`) even then; the classes it
builds objects of without the file naming them (numpy's dtypes) are allowed with what names
them (`_classes_built_unnamed`). Upstream's class paths still map to the stand-ins.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import contextlib
import dataclasses
import importlib
import os
import pathlib
import pickle
import re
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch

from deepspeed.runtime.zero.checkpoint_upstream import (
    UPSTREAM_GLOBALS,
    UpstreamFormatError,
    is_upstream_model_states,
    normalize_upstream,
    stage_0_to_2_as_stage_3,
    to_plain,
    upstream_optim_path,
)
from deepspeed.runtime.zero.lifecycle import shard_sizes

FORMAT = "deepspeed-zero3-sharded"
FORMAT_VERSION = 2
OWN_KEY = "zero3_checkpoint"  # this package's metadata inside a file laid out as upstream's
LATEST_FILE = "latest"
RECOVERY_SCRIPT = "zero_to_fp32.py"
TRUST_ENV = "DEEPSPEED_TRUST_CHECKPOINT"  # "1": load checkpoints that name non-allowlisted globals
# Plain value types client state often holds; rebuilding them runs no code of the file.
CLIENT_STATE_GLOBALS = (argparse.Namespace, pathlib.PurePosixPath, pathlib.PosixPath)

_RANK_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_(model|optim)_states\.pt$")

_RECOVERY_SCRIPT_TEXT = '''#!/usr/bin/env python
"""Consolidate the ZeRO-3 checkpoints in this folder into one fp32 state dict.

    python zero_to_fp32.py . pytorch_model.bin            # the tag named in `latest`
    python zero_to_fp32.py . out_dir --safe_serialization # out_dir/model.safetensors
"""

import sys

from deepspeed.utils.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())  # non-zero, with the message on stderr, when the checkpoint cannot be read
'''


def model_states_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_states_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def new_save_id() -> str:
    return uuid.uuid4().hex


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the problem."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names globals outside the loader's allowlist; nothing of it was run.

    See [Note: loading untrusted checkpoints]. The message names the file, the globals and
    how to opt in.
    """


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


# ============================================================================ writing


def fsync_dir(directory: str) -> None:
    """Make a rename inside `directory` durable (best effort: not every OS can open a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save_to_path(path: str, save: Callable[[str], None]) -> None:
    """Run `save(tmp)` for a temporary name beside `path`, fsync it, then rename it onto `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Crash-safe write through `write(binary_file)` (see [Note: crash-safe writes])."""

    def save(tmp: str) -> None:
        with open(tmp, "xb") as f:
            write(f)

    atomic_save_to_path(path, save)


def atomic_torch_save(obj: Any, path: str) -> None:
    """`torch.save(obj, path)`, crash-safe (see [Note: crash-safe writes])."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_bytes(path: str, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


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


# ============================================================================ reading


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


# ---------------------------------------------------------------------------- the one loader


def trust_from_env() -> bool:
    """`DEEPSPEED_TRUST_CHECKPOINT` set to 1 / true / yes / on."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _allowlist() -> list:
    """What `load_checkpoint_file` adds to torch's weights_only set (see the note)."""
    standins = [(standin, name) for name, standin in UPSTREAM_GLOBALS.items()]
    return standins + list(CLIENT_STATE_GLOBALS)


def refused_globals(path: str) -> list:
    """The globals `path`'s pickle names that the loader refuses, found without running it.

    Raises `pickle.UnpicklingError` for a pickle instruction the restricted unpickler does
    not read (torch.save never writes one), `ValueError` / `EOFError` / `RuntimeError` for a
    file that is not a complete `torch.save` archive.
    """
    with torch.serialization.safe_globals(_allowlist()):
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))


def _classes_built_unnamed(refused: list) -> list:
    """Classes a trusted file's objects can have without its pickle naming them.

    The restricted unpickler builds state only into instances of allowlisted classes, and
    the scan sees only the names the pickle holds. A numpy array or scalar names
    `numpy.dtype`, whose call returns an instance of a subclass (`numpy.dtypes.Int64DType`)
    the file never names; without these, a trusted load of client state holding
    `np.arange(3)` or `np.random.get_state()` was refused after all.
    """
    if not any(name.startswith("numpy") for name in refused):
        return []
    import numpy

    dtypes = getattr(numpy, "dtypes", None)  # numpy >= 1.25; older dtypes are numpy.dtype itself
    if dtypes is None:
        return []
    return [cls for cls in vars(dtypes).values() if isinstance(cls, type) and issubclass(cls, numpy.dtype)]


def _refusal(path: str, refused: list) -> UnsafeCheckpointError:
    names = ", ".join(refused[:8]) + (f" and {len(refused) - 8} more" if len(refused) > 8 else "")
    return UnsafeCheckpointError(
        f"{path}: refused to load: it names {names}, outside the checkpoint loader's allowlist "
        "(unpickling such a name can run code; nothing from this file was run). If you trust where "
        "this checkpoint came from, opt in with load_checkpoint(..., trust_checkpoint=True), "
        f"zero_to_fp32 --trust_checkpoint (trust_checkpoint=True in Python) or {TRUST_ENV}=1, or "
        "allowlist just these types with torch.serialization.add_safe_globals([...]); see "
        "'Loading untrusted checkpoints' in docs/checkpoints.md"
    )


def _resolve_global(qualified: str) -> tuple:
    """`(object, qualified)` for a global a trusted file names: its module is imported.

    Pickle protocol 2 (torch.save's) writes Python 2 names for some objects (`subprocess` as
    `commands`); they are mapped back the way `pickle` itself does on load.
    """
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module, attrs = ".".join(parts[:cut]), parts[cut:]
        if len(attrs) == 1 and (module, attrs[0]) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, attrs[0])]
            attrs = name.split(".")
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        try:
            obj: Any = importlib.import_module(module)
        except ImportError:
            continue
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj, qualified
    raise ImportError(f"cannot import {qualified}, which the (trusted) checkpoint names")


def _torch_reason(err: BaseException) -> str:
    """The restricted unpickler's own reason, without torch's advice to drop weights_only."""
    text = str(err)
    for marker in ("WeightsUnpickler error:", "from a trusted source."):
        if marker in text:
            text = text.split(marker, 1)[1]
    return " ".join(text.split())[:400]


def load_checkpoint_file(path: str, trust: bool = False) -> Any:
    """Unpickle one checkpoint file through the allowlist, memory-mapped on the CPU.

    The only way this package reads checkpoint data (see [Note: loading untrusted
    checkpoints]). Raises `UnsafeCheckpointError` naming the file and the refused globals
    unless `trust` or `DEEPSPEED_TRUST_CHECKPOINT=1`; upstream's pickled classes come back as
    plain data either way.
    """
    trusted = trust or trust_from_env()
    allow = _allowlist()
    try:
        refused = refused_globals(path)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{path}: refused to load: its pickle holds an instruction the restricted unpickler does not "
            f"read ({_torch_reason(err)}); torch.save does not write it, so the file was not written by "
            "DeepSpeed or was altered; nothing from it was run"
        ) from None
    except (ValueError, EOFError, RuntimeError, OSError):
        refused = []  # not a complete torch.save archive: torch.load below says what is wrong
    if refused and not trusted:
        raise _refusal(path, refused)
    allow += [_resolve_global(name) for name in refused] + _classes_built_unnamed(refused)
    try:
        with torch.serialization.safe_globals(allow):
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        # Also when trusted: torch blocks the modules os, posix, nt and sys outright.
        raise UnsafeCheckpointError(
            f"{path}: refused to load: torch's restricted unpickler stopped at {_torch_reason(err)!r}; "
            "nothing the file names past that point was run"
        ) from None
    return to_plain(obj)


# Upstream DeepSpeed's model file at stages 0-2: one for every rank (the whole module).
UPSTREAM_REPLICATED_MODEL_FILE = "mp_rank_00_model_states.pt"


def _upstream_saving_world(model_sd: Any, path: str) -> int:
    """The data-parallel size an upstream model file was saved on; refuses model parallelism."""
    world = model_sd.get("dp_world_size") if isinstance(model_sd, dict) else None
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{path}: invalid 'dp_world_size' {world!r} (upstream DeepSpeed file)")
    if model_sd.get("mp_world_size", 1) != 1:
        raise CheckpointError(
            f"{path}: saved with model parallelism ({model_sd['mp_world_size']} ranks); only "
            "data-parallel ZeRO checkpoints can be loaded"
        )
    return world


def load_file(path: str, what: str, trust: bool = False) -> Any:
    """`load_checkpoint_file`, or raise `CheckpointError` naming the file and `what` it is."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing ({what}); the checkpoint is incomplete")
    try:
        return load_checkpoint_file(path, trust)
    except CheckpointError:
        raise
    except ImportError as err:
        raise CheckpointError(f"{path}: cannot read the {what}: {err}") from err
    except Exception as err:  # torch raises RuntimeError, EOFError, ...
        raise CheckpointError(
            f"{path}: cannot read the {what}: the file is truncated or corrupt ({type(err).__name__}: {err})"
        ) from err


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


def flat_slice(shards: Sequence[torch.Tensor], partition_size: int, start: int, end: int) -> torch.Tensor:
    """Flat elements `[start, end)` of a tensor given as rank-ordered shards of `partition_size`.

    The result is a fresh tensor: only the overlapping parts of the shards are read.
    """
    pieces = []
    pos = start
    while pos < end:
        k, offset = divmod(pos, partition_size)
        take = min(partition_size - offset, end - pos)
        pieces.append(shards[k].reshape(-1)[offset : offset + take])
        pos += take
    if not pieces:
        return torch.empty(0, dtype=shards[0].dtype, device=shards[0].device)
    return torch.cat(pieces)


def reshard(
    shards: Sequence[torch.Tensor], partition_size: int, numel: int, world_size: int, rank: int
) -> torch.Tensor:
    """Rank `rank`'s shard for `world_size` ranks, cut from shards saved on `len(shards)` ranks."""
    new_size, _ = shard_sizes(numel, world_size)
    out = torch.zeros(new_size, dtype=shards[0].dtype, device=shards[0].device)
    start = min(rank * new_size, numel)
    end = min(start + new_size, numel)
    if end > start:
        out[: end - start].copy_(flat_slice(shards, partition_size, start, end))
    return out


def _is_sharded_state(value: Any, partition_size: int) -> bool:
    """Optimizer state cut like the master (Adam's moments) rather than shared (its `step`)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == partition_size


def split_optimizer_state(state: dict, partition_size: int) -> tuple:
    """`(sharded, replicated)` halves of one master's optimizer state."""
    sharded = {k: v for k, v in state.items() if _is_sharded_state(v, partition_size)}
    replicated = {k: v for k, v in state.items() if k not in sharded}
    return sharded, replicated


class ShardedCheckpoint:
    """The files of one tag directory, memory-mapped and checked to belong together.

    `open()` raises `CheckpointError` naming the file for a missing, truncated or corrupt
    file, for files of different saves, and for metadata that disagrees between ranks.
    """

    directory: str
    world_size: int  # ranks that saved it
    dtype: str  # the saving engine's model dtype, e.g. "torch.bfloat16"
    params: OrderedDict  # name -> ParamMeta, in named_parameters() order
    model_states: list  # one dict per saving rank
    optim_states: Optional[list]  # one dict per saving rank; None if saved without an optimizer

    def __init__(
        self,
        directory: str,
        model_states: list,
        optim_states: Optional[list],
        optim_paths: Optional[list] = None,
        origin: str = "deepspeed (this package)",
    ) -> None:
        self.directory = directory
        self.model_states = model_states
        self.optim_states = optim_states
        self.origin = origin
        first = model_states[0]
        self.world_size = first["world_size"]
        self.dtype = first["dtype"]
        self.params = OrderedDict((d["name"], ParamMeta.from_dict(d)) for d in first["params"])
        self._optim_paths = optim_paths

    @classmethod
    def open(cls, directory: str, trust: bool = False) -> ShardedCheckpoint:
        """Read every file of the tag folder `directory` (see [Note: loading untrusted checkpoints]).

        `trust=True` loads files that name globals outside the allowlist: only for
        checkpoints whose source you trust.
        """
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: no such checkpoint directory")
        first_path = os.path.join(directory, model_states_name(0))
        replicated = os.path.join(directory, UPSTREAM_REPLICATED_MODEL_FILE)
        if not os.path.isfile(first_path) and os.path.isfile(replicated):
            return cls._open_upstream_replicated(directory, replicated, trust)
        raw = load_file(first_path, "model states of rank 0", trust)
        if is_upstream_model_states(raw):
            return cls._open_upstream(directory, raw, trust)
        first = own_layout(raw, first_path, "model")
        world = first.get("world_size")
        if not isinstance(world, int) or world < 1:
            raise CheckpointError(f"{first_path}: invalid saving world_size {world!r}")
        model_states = [first]
        for r in range(1, world):
            path = os.path.join(directory, model_states_name(r))
            model_states.append(
                own_layout(load_file(path, f"model states of rank {r}", trust), path, "model")
            )
        optim_states = None
        if first.get("has_optimizer"):
            optim_states = []
            for r in range(world):
                path = os.path.join(directory, optim_states_name(r))
                optim_states.append(
                    own_layout(load_file(path, f"optimizer states of rank {r}", trust), path, "optim")
                )
        ckpt = cls(directory, model_states, optim_states)
        ckpt._check_headers()
        ckpt._check_shards()
        return ckpt

    @classmethod
    def _open_upstream(cls, directory: str, first: dict, trust: bool) -> ShardedCheckpoint:
        """A tag folder written by upstream DeepSpeed at stage 3 (see checkpoint_upstream.py)."""
        world = _upstream_saving_world(first, os.path.join(directory, model_states_name(0)))
        model_sds = [first]
        for r in range(1, world):
            path = os.path.join(directory, model_states_name(r))
            model_sds.append(load_file(path, f"model states of rank {r}", trust))
        optim_paths = [upstream_optim_path(directory, r) for r in range(world)]
        optim_sds = None
        if any(optim_paths):
            optim_sds = []
            for r, path in enumerate(optim_paths):
                path = path or os.path.join(directory, optim_states_name(r))
                optim_sds.append(load_file(path, f"optimizer states of rank {r}", trust))
                optim_paths[r] = path
        paths = [(os.path.join(directory, model_states_name(r)), optim_paths[r]) for r in range(world)]
        return cls._from_upstream(directory, model_sds, optim_sds, optim_paths, paths)

    @classmethod
    def _open_upstream_replicated(cls, directory: str, model_path: str, trust: bool) -> ShardedCheckpoint:
        """A tag folder written by upstream DeepSpeed at stage 0, 1 or 2 (see [Note: upstream's
        stage 0-2 layout] in checkpoint_upstream.py): read as the stage-3 files it amounts to."""
        model_sd = load_file(model_path, "model states (upstream stage 0-2)", trust)
        world = _upstream_saving_world(model_sd, model_path)
        optim_paths = [upstream_optim_path(directory, r) for r in range(world)]
        missing = [r for r, path in enumerate(optim_paths) if path is None]
        if len(missing) == world and model_sd.get("param_shapes") is None:
            raise CheckpointError(
                f"{model_path}: upstream DeepSpeed's stage-0 layout (no ZeRO: the whole model and torch "
                "optimizer state in this one file), which this package does not read; load its 'module' "
                "state dict into the model before deepspeed.initialize (the optimizer state does not "
                "carry over), or save it again at ZeRO stage 1, 2 or 3"
            )
        if missing:
            raise CheckpointError(
                f"{directory}: upstream stage 0-2 checkpoint of {world} ranks without the optimizer states "
                f"of rank(s) {missing} (zero_pp_rank_<r>_mp_rank_00_optim_states.pt), which hold its fp32 "
                "weights; the checkpoint is incomplete"
            )
        optim_sds = [
            load_file(path, f"optimizer states of rank {r}", trust) for r, path in enumerate(optim_paths)
        ]
        try:
            model_sds, optim_sds = stage_0_to_2_as_stage_3(model_sd, optim_sds, optim_paths)
        except (UpstreamFormatError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise CheckpointError(
                f"{directory}: cannot read this upstream DeepSpeed checkpoint: {err}"
            ) from err
        paths = [(model_path, optim_paths[r]) for r in range(world)]
        return cls._from_upstream(directory, model_sds, optim_sds, optim_paths, paths)

    @classmethod
    def _from_upstream(
        cls, directory: str, model_sds: list, optim_sds: Optional[list], optim_paths: list, paths: list
    ) -> ShardedCheckpoint:
        """Our checkpoint from upstream's stage-3 dicts, one per saving rank (`paths`: their files)."""
        world = len(model_sds)
        try:
            model_states, optim_states = normalize_upstream(directory, model_sds, optim_sds, paths)
        except (UpstreamFormatError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"{directory}: cannot read this upstream DeepSpeed checkpoint: {err}"
            ) from err
        for r, sd in enumerate(optim_sds or []):
            count = sd["optimizer_state_dict"].get("partition_count", world)
            count = max(count) if isinstance(count, (list, tuple)) else count
            if count != world:
                raise CheckpointError(
                    f"{optim_paths[r]}: partitioned over {count} ranks but {world} model files say "
                    f"{world}; the files were mixed up"
                )
        version = model_sds[0].get("ds_version")
        ckpt = cls(directory, model_states, optim_states, optim_paths, origin=f"upstream DeepSpeed {version}")
        ckpt._check_headers()
        ckpt._check_shards()
        return ckpt

    # ------------------------------------------------------------------ validation

    def model_file(self, rank: int) -> str:
        return os.path.join(self.directory, model_states_name(rank))

    def optim_file(self, rank: int) -> str:
        if self._optim_paths is not None:
            return self._optim_paths[rank]
        return os.path.join(self.directory, optim_states_name(rank))

    def _check_headers(self) -> None:
        first = self.model_states[0]
        files = [(self.model_file(r), sd, r) for r, sd in enumerate(self.model_states)]
        files += [(self.optim_file(r), sd, r) for r, sd in enumerate(self.optim_states or [])]
        for path, sd, r in files:
            if sd.get("rank") != r or sd.get("world_size") != self.world_size:
                raise CheckpointError(
                    f"{path}: records rank {sd.get('rank')} of {sd.get('world_size')} ranks, expected rank "
                    f"{r} of {self.world_size} (as {self.model_file(0)} says); the files were mixed up"
                )
            if sd.get("save_id") != first["save_id"]:
                raise CheckpointError(
                    f"{path}: written by a different save than {self.model_file(0)} (save_id "
                    f"{sd.get('save_id')} != {first['save_id']}); an interrupted save overwrote this "
                    "tag in place, so load another tag"
                )
        for r, sd in enumerate(self.model_states[1:], start=1):
            if sd.get("params") != first["params"]:
                raise CheckpointError(
                    f"{self.model_file(r)}: its parameter metadata differs from {self.model_file(0)}'s"
                )

    def _check_shards(self) -> None:
        for r in range(self.world_size):
            frozen = self.model_states[r].get("frozen_param_shards", {})
            optim = self.optim_states[r] if self.optim_states is not None else None
            for meta in self.params.values():
                if meta.has_master and optim is None:
                    raise CheckpointError(
                        f"{self.model_file(0)}: parameter {meta.name!r} has an fp32 master but the "
                        "checkpoint records no optimizer-states files"
                    )
                if meta.has_master:
                    where, shard = self.optim_file(r), optim["fp32_master_shards"].get(meta.name)
                else:
                    where, shard = self.model_file(r), frozen.get(meta.name)
                _check_shard(where, meta, shard, "weights")
                if meta.has_master:
                    for key, value in optim["optimizer_state"].get(meta.name, {}).items():
                        _check_shard(self.optim_file(r), meta, value, f"optimizer state {key!r}")

    # ------------------------------------------------------------------ contents

    @property
    def has_optimizer(self) -> bool:
        return self.optim_states is not None

    def weight_shards(self, name: str) -> list:
        """The saved shards of `name`'s weights: fp32 masters, or model-dtype shards without one."""
        if self.params[name].has_master:
            return [sd["fp32_master_shards"][name] for sd in self.optim_states]
        return [sd["frozen_param_shards"][name] for sd in self.model_states]

    def resharded_weight(self, name: str, world_size: int, rank: int) -> torch.Tensor:
        """`name`'s fp32 weights as rank `rank` of `world_size` holds them (see the note)."""
        meta = self.params[name]
        shard = reshard(self.weight_shards(name), meta.partition_size, meta.numel, world_size, rank)
        return shard.float()

    def full_weight(self, name: str) -> torch.Tensor:
        """`name`'s whole fp32 tensor, in its shape."""
        meta = self.params[name]
        flat = flat_slice(self.weight_shards(name), meta.partition_size, 0, meta.numel)
        return flat.float().view(meta.shape)

    def optimizer_state_keys(self, name: str) -> set:
        return set(self.optim_states[0]["optimizer_state"].get(name, {}))

    def resharded_optimizer_state(self, name: str, world_size: int, rank: int) -> dict:
        """`name`'s optimizer state as rank `rank` of `world_size` would hold it."""
        meta = self.params[name]
        out = dict(self.optim_states[0]["replicated_optimizer_state"].get(name, {}))
        out = {k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()}
        for key in self.optimizer_state_keys(name):
            shards = [sd["optimizer_state"][name][key] for sd in self.optim_states]
            out[key] = reshard(shards, meta.partition_size, meta.numel, world_size, rank)
        return out

    def optimizer_entry(self, key: str) -> Any:
        """A value rank 0's optim-states file holds: `param_groups`, `loss_scaler`, `overflow`."""
        return self.optim_states[0][key]

    def engine_entry(self, key: str) -> Any:
        """A value rank 0's model-states file holds: counters, `lr_scheduler`, `buffers`, ..."""
        return self.model_states[0].get(key)

    def client_state(self, rank: int) -> dict:
        """The client state saved by rank `rank` (rank 0's for ranks the save did not have)."""
        source = self.model_states[rank if rank < self.world_size else 0]
        return dict(source.get("client_state") or {})

    def fp32_state_dict(
        self,
        exclude_frozen_parameters: bool = False,
        progress: Optional[Callable] = None,
        weight: Optional[Callable] = None,
    ):
        """An OrderedDict of full fp32 parameters (tied names included) and buffers.

        `weight(name)` makes each parameter's entry (default `full_weight`: the tensor;
        zero_to_fp32's lazy mode puts an object there that builds it when asked).
        """
        weight = self.full_weight if weight is None else weight
        out: OrderedDict = OrderedDict()
        metas: Iterable = list(self.params.values())
        if progress is not None:
            metas = progress(metas)
        for meta in metas:
            if exclude_frozen_parameters and not meta.requires_grad:
                continue
            out[meta.name] = weight(meta.name)
        for alias, canonical in self.engine_entry("shared_params") or []:
            if canonical in out:
                out[alias] = out[canonical]
        for name, buf in (self.engine_entry("buffers") or {}).items():
            out[name] = buf.to(torch.float32, copy=True) if buf.is_floating_point() else buf.clone()
        return out


def _check_shard(path: str, meta: ParamMeta, shard: Any, what: str) -> None:
    if shard is None:
        raise CheckpointError(f"{path}: has no {what} for parameter {meta.name!r}")
    if not torch.is_tensor(shard) or shard.numel() != meta.partition_size:
        got = tuple(shard.shape) if torch.is_tensor(shard) else type(shard).__name__
        raise CheckpointError(
            f"{path}: the {what} shard of {meta.name!r} has shape {got}, expected "
            f"({meta.partition_size},) for {meta.numel} elements over the saving ranks"
        )


def check_against_model(ckpt: ShardedCheckpoint, shapes: dict, strict: bool) -> None:
    """Raise `CheckpointError` if `ckpt` does not fit a model with these `{name: shape}`.

    Unknown and missing names fail only with `strict`; a shape mismatch always fails (as
    `nn.Module.load_state_dict` does), since no part of such a tensor could be loaded.
    """
    problems = []
    unexpected = [n for n in ckpt.params if n not in shapes]
    missing = [n for n in shapes if n not in ckpt.params]
    if strict and unexpected:
        problems.append(f"parameters not in the model: {_names(unexpected)}")
    if strict and missing:
        problems.append(f"model parameters missing from the checkpoint: {_names(missing)}")
    for name, shape in shapes.items():
        meta = ckpt.params.get(name)
        if meta is not None and tuple(meta.shape) != tuple(shape):
            problems.append(
                f"shape of {name!r} is {tuple(meta.shape)} in the checkpoint, {tuple(shape)} in the model"
            )
    if problems:
        hint = (
            " (load_module_strict=False skips unknown and missing names)"
            if strict and (unexpected or missing)
            else ""
        )
        raise CheckpointError(f"{ckpt.model_file(0)}: does not match the model: {'; '.join(problems)}{hint}")


def _names(names: list, limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
