"""One tag folder read back: its files checked to belong together, its tensors cut for any world size.

[Note: elastic resharding]
Saved on N ranks, a parameter of `numel` elements is N shards of `ps_N` elements each (the
shard math of zero/lifecycle.py). Loaded on M ranks, rank r needs the flat elements
`[r * ps_M, (r + 1) * ps_M)` clipped to `numel`, then zero padding up to `ps_M`.
`flat_slice` reads only the parts of the saved shards that overlap that range, and files
are memory-mapped, so loading never materializes a full parameter or another rank's data.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch

from deepspeed.checkpoint.errors import CheckpointError
from deepspeed.checkpoint.layout import (
    UPSTREAM_REPLICATED_MODEL_FILE,
    ParamMeta,
    model_states_name,
    optim_states_name,
    own_layout,
)
from deepspeed.checkpoint.safe_load import load_file
from deepspeed.checkpoint.upstream import (
    UpstreamFormatError,
    is_upstream_model_states,
    normalize_upstream,
    stage_0_to_2_as_stage_3,
    upstream_optim_path,
)
from deepspeed.runtime.zero.lifecycle import shard_sizes
from deepspeed.utils.progress import progress_bar


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
    def open(cls, directory: str, trust: bool = False, quiet: bool = True) -> ShardedCheckpoint:
        """Read every file of the tag folder `directory` (see [Note: loading untrusted checkpoints]).

        `trust=True` loads files that name globals outside the allowlist: only for
        checkpoints whose source you trust. `quiet=False` shows a bar over the files read
        (utils/progress.py: on a terminal only).
        """
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: no such checkpoint directory")
        reader = _FileReader(trust, quiet)
        try:
            return cls._open(directory, reader)
        finally:
            reader.close()

    @classmethod
    def _open(cls, directory: str, read: _FileReader) -> ShardedCheckpoint:
        first_path = os.path.join(directory, model_states_name(0))
        replicated = os.path.join(directory, UPSTREAM_REPLICATED_MODEL_FILE)
        if not os.path.isfile(first_path) and os.path.isfile(replicated):
            return cls._open_upstream_replicated(directory, replicated, read)
        raw = read(first_path, "model states of rank 0")
        if is_upstream_model_states(raw):
            return cls._open_upstream(directory, raw, read)
        first = own_layout(raw, first_path, "model")
        world = first.get("world_size")
        if not isinstance(world, int) or world < 1:
            raise CheckpointError(f"{first_path}: invalid saving world_size {world!r}")
        read.expect(world * (2 if first.get("has_optimizer") else 1))
        model_states = [first]
        for r in range(1, world):
            path = os.path.join(directory, model_states_name(r))
            model_states.append(own_layout(read(path, f"model states of rank {r}"), path, "model"))
        optim_states = None
        if first.get("has_optimizer"):
            optim_states = []
            for r in range(world):
                path = os.path.join(directory, optim_states_name(r))
                optim_states.append(own_layout(read(path, f"optimizer states of rank {r}"), path, "optim"))
        ckpt = cls(directory, model_states, optim_states)
        ckpt._check_headers()
        ckpt._check_shards()
        return ckpt

    @classmethod
    def _open_upstream(cls, directory: str, first: dict, read: _FileReader) -> ShardedCheckpoint:
        """A tag folder written by upstream DeepSpeed at stage 3 (see upstream.py)."""
        world = _upstream_saving_world(first, os.path.join(directory, model_states_name(0)))
        model_sds = [first]
        for r in range(1, world):
            path = os.path.join(directory, model_states_name(r))
            model_sds.append(read(path, f"model states of rank {r}"))
        optim_paths = [upstream_optim_path(directory, r) for r in range(world)]
        read.expect(world * (2 if any(optim_paths) else 1))
        optim_sds = None
        if any(optim_paths):
            optim_sds = []
            for r, path in enumerate(optim_paths):
                path = path or os.path.join(directory, optim_states_name(r))
                optim_sds.append(read(path, f"optimizer states of rank {r}"))
                optim_paths[r] = path
        paths = [(os.path.join(directory, model_states_name(r)), optim_paths[r]) for r in range(world)]
        return cls._from_upstream(directory, model_sds, optim_sds, optim_paths, paths)

    @classmethod
    def _open_upstream_replicated(
        cls, directory: str, model_path: str, read: _FileReader
    ) -> ShardedCheckpoint:
        """A tag folder written by upstream DeepSpeed at stage 0, 1 or 2 (see [Note: upstream's
        stage 0-2 layout] in upstream.py): read as the stage-3 files it amounts to."""
        model_sd = read(model_path, "model states (upstream stage 0-2)")
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
        read.expect(1 + world)
        optim_sds = [read(path, f"optimizer states of rank {r}") for r, path in enumerate(optim_paths)]
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


class _FileReader:
    """Loads the files of one tag folder, advancing one bar over them once `expect` has told
    how many there are (the first file read says the saving world)."""

    def __init__(self, trust: bool, quiet: bool) -> None:
        self.trust = trust
        self.quiet = quiet
        self.done = 0
        self.bar: Any = None

    def expect(self, files: int) -> None:
        self.bar = progress_bar(files, "Reading checkpoint files", unit="file", quiet=self.quiet)
        self.bar.update(self.done)

    def __call__(self, path: str, what: str) -> Any:
        loaded = load_file(path, what, self.trust)
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        return loaded

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
        problems.append(f"parameters not in the model: {name_list(unexpected)}")
    if strict and missing:
        problems.append(f"model parameters missing from the checkpoint: {name_list(missing)}")
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


def name_list(names: list, limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
