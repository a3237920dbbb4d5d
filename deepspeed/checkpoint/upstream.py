"""Reading checkpoint files written by upstream DeepSpeed (0.19, ZeRO stage 3), without its classes.

`sharded.ShardedCheckpoint.open` calls `normalize_upstream` when a tag folder holds
upstream's files; the result has the layout of this package's own files (see
[Note: checkpoint layout] in layout.py), so loading, resharding to any number of
ranks and `zero_to_fp32` need no second code path.

[Note: upstream's pickled classes]
Upstream pickles a few of its own objects into the files: the ZeRO stage as an `IntEnum`
(`deepspeed.runtime.zero.config.ZeroStageEnum`) and the loss scaler object
(`deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler`). Some of those paths
exist in this package too, with other meanings, so a plain unpickle would build the wrong
object. `UPSTREAM_GLOBALS` maps each such path to a small stand-in here that turns into plain
data (an int; a dict of the scaler's attributes). The one loader of checkpoint files,
`safe_load.load_checkpoint_file`, allowlists these stand-ins (under upstream's names) for
`torch.load(weights_only=True)`: an upstream file goes through the same allowlist as ours,
its classes are never imported, and even an opted-in trusted load maps them here, never to
the classes of the same name in this package (see [Note: loading untrusted checkpoints] in
safe_load.py).

[Note: upstream's stage-3 layout]
Saved on N ranks, rank r's `*_optim_states.pt` holds `optimizer_state_dict` with
`zero_stage` 3, `partition_count` N and `fp32_flat_groups`: one flat fp32 tensor per
sub-group, the concatenation of rank r's shard of each parameter named (in order) in the
matching entry of the model file's `param_shapes`. A parameter of `numel` elements has
`ceil(numel / N)` elements per rank, the last rank's tail zero padding: the same shard math as
ours, so a slice of the flat group is exactly our per-parameter shard. The wrapped torch
optimizer's state is keyed by sub-group (its params are the flat groups), so Adam's moments
are flat like the weights and are cut the same way; the scalar `step` is shared by the
sub-group's parameters. Frozen parameters are in the model files: `frozen_param_shapes`
and rank r's `frozen_param_fragments`. Buffers are in rank 0's `module` under `buffer_names`;
tied parameters in `shared_params` (alias -> name). Everything else at the top level of a
model file that upstream did not write itself is the client state.
"""

from __future__ import annotations

import math
import os
import types
from collections import OrderedDict
from typing import Any, Optional

import torch

from deepspeed.checkpoint.constants import (
    BF16_ZERO_FILE_PREFIX,
    FP16_ZERO_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    OPTIM_FILE_SUFFIX,
    ZERO_FILE_PREFIX,
)

# What upstream's engine writes at the top level of a model-states file; the rest is client state.
UPSTREAM_ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "frozen_param_fragments",
        "shared_params",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
    }
)


# ============================================================================ stand-ins


def _zero_stage(value: Any) -> int:
    """Stand-in for upstream's `ZeroStageEnum(value)`: the plain int."""
    return int(value)


class _PickledState:
    """Stand-in for an upstream object pickled by attributes: keeps them, as a dict, in `state`."""

    state: dict

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            merged = dict(state[0] or {})
            merged.update(state[1] or {})
            state = merged
        self.state = dict(state) if isinstance(state, dict) else {"value": state}


class UpstreamLossScaler(_PickledState):
    """Stand-in for upstream's `LossScaler` / `DynamicLossScaler`."""


class UpstreamFragmentAddress(_PickledState):
    """Stand-in for upstream's `fragment_address` (numel, start), in its stage 0-2 files."""


UPSTREAM_GLOBALS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "deepspeed.utils.tensor_fragment.fragment_address": UpstreamFragmentAddress,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": UpstreamLossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": UpstreamLossScaler,
    "deepspeed.runtime.fp16.loss_scaler.LossScalerBase": UpstreamLossScaler,
}
UPSTREAM_GLOBALS = types.MappingProxyType(UPSTREAM_GLOBALS)  # read-only from here on


def to_plain(value: Any) -> Any:
    """Replace stand-ins (anywhere in dicts, lists and tuples) by their plain data."""
    if isinstance(value, _PickledState):
        return {k: to_plain(v) for k, v in value.state.items()}
    if isinstance(value, OrderedDict):
        return OrderedDict((k, to_plain(v)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_plain(v) for v in value)
    return value


# ============================================================================ detection


def is_upstream_model_states(sd: Any) -> bool:
    return isinstance(sd, dict) and "param_shapes" in sd and "module" in sd and "zero3_checkpoint" not in sd


def upstream_optim_path(directory: str, rank: int) -> Optional[str]:
    """Rank `rank`'s optim-states file: `zero_pp_rank_*`, or the `bf16_` / `fp16_` prefixed names."""
    for prefix in (ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX):
        path = os.path.join(directory, f"{prefix}{rank}_{MODEL_FILE_PREFIX}00{OPTIM_FILE_SUFFIX}")
        if os.path.isfile(path):
            return path
    return None


# ============================================================================ conversion


class UpstreamFormatError(ValueError):
    """An upstream file this reader cannot use; the message names the file and the key."""


def _meta(name: str, shape: Any, world_size: int, trainable: bool) -> dict:
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    return {
        "name": name,
        "shape": shape,
        "numel": numel,
        "ds_id": -1,  # upstream does not record it; parameters are matched by name
        "partition_size": -(-numel // world_size),
        "requires_grad": trainable,
        "has_master": trainable,
    }


def _param_metas(model_sd: dict, world_size: int, where: str) -> tuple:
    """`(metas in module order, trainable names per sub-group)` of one rank's model file."""
    groups = model_sd.get("param_shapes")
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list):
        raise UpstreamFormatError(f"{where}: 'param_shapes' is {type(groups).__name__}, expected a list")
    metas, names_per_group = {}, []
    for shapes in groups:
        names_per_group.append(list(shapes))
        for name, shape in shapes.items():
            metas[name] = _meta(name, shape, world_size, trainable=True)
    for name, shape in (model_sd.get("frozen_param_shapes") or {}).items():
        metas[name] = _meta(name, shape, world_size, trainable=False)
    order = {name: i for i, name in enumerate(model_sd.get("module") or {})}
    ordered = sorted(metas.values(), key=lambda m: order.get(m["name"], len(order)))
    return ordered, names_per_group


def _state_index_per_group(torch_sd: dict, n_groups: int, where: str) -> list:
    """The torch optimizer's state index of each sub-group (its params are the flat groups, in order)."""
    indices = [i for group in torch_sd.get("param_groups", []) for i in group["params"]]
    if len(indices) != n_groups:
        raise UpstreamFormatError(
            f"{where}: the optimizer has {len(indices)} flat parameters for {n_groups} 'fp32_flat_groups'"
        )
    return indices


def _split_flat(flat: torch.Tensor, names: list, metas: dict, where: str, what: str) -> dict:
    """Per-parameter views of one rank's flat sub-group tensor (see the note)."""
    flat = flat.reshape(-1)
    need = sum(metas[n]["partition_size"] for n in names)
    if flat.numel() < need:
        raise UpstreamFormatError(
            f"{where}: {what} has {flat.numel()} elements, the {len(names)} parameters of its "
            f"'param_shapes' group need {need}"
        )
    out, offset = {}, 0
    for name in names:
        size = metas[name]["partition_size"]
        out[name] = flat[offset : offset + size]
        offset += size
    return out


def _optim_states(optim_sd: dict, names_per_group: list, metas: dict, rank: int, world_size: int, where: str):
    """Our optim-states dict (fp32 shards, cut optimizer state, named groups) from upstream's."""
    zero_sd = optim_sd.get("optimizer_state_dict")
    if not isinstance(zero_sd, dict) or "fp32_flat_groups" not in zero_sd:
        stage = zero_sd.get("zero_stage") if isinstance(zero_sd, dict) else None
        raise UpstreamFormatError(
            f"{where}: not a ZeRO stage-3 optimizer file (zero_stage={stage!r}); only upstream "
            "stage-3 checkpoints can be loaded"
        )
    flats = zero_sd["fp32_flat_groups"]
    if len(flats) != len(names_per_group):
        raise UpstreamFormatError(
            f"{where}: {len(flats)} 'fp32_flat_groups' but {len(names_per_group)} 'param_shapes' groups"
        )
    torch_sd = zero_sd.get("optimizer_state_dict") or {"state": {}, "param_groups": []}
    index_of = _state_index_per_group(torch_sd, len(flats), where)
    masters, sharded, replicated = {}, {}, {}
    for k, names in enumerate(names_per_group):
        masters.update(_split_flat(flats[k], names, metas, where, f"fp32_flat_groups[{k}]"))
        state = torch_sd["state"].get(index_of[k], {})
        for name in names:
            sharded[name], replicated[name] = {}, {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == flats[k].numel():
                for name, piece in _split_flat(value, names, metas, where, f"state {key!r}").items():
                    sharded[name][key] = piece
            else:
                for name in names:
                    replicated[name][key] = value.clone() if torch.is_tensor(value) else value
    group_of_index = {i: k for k, i in enumerate(index_of)}
    groups = []
    for group in torch_sd.get("param_groups", []):
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["params"] = [n for i in group["params"] for n in names_per_group[group_of_index[i]]]
        groups.append(hyper)
    scaler = zero_sd.get("loss_scaler")
    return {
        "rank": rank,
        "world_size": world_size,
        "save_id": "upstream",
        "fp32_master_shards": masters,
        "optimizer_state": sharded,
        "replicated_optimizer_state": replicated,
        "param_groups": groups,
        "loss_scaler": scaler if isinstance(scaler, dict) else {"cur_scale": 1.0},
        "overflow": bool(zero_sd.get("overflow", False)),
    }


def _dtype_of(model_sd: dict) -> str:
    cfg = model_sd.get("ds_config") or {}
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled"):
            return str(dtype)
    return str(torch.float32)


def _model_states(
    model_sd: dict, metas: list, rank: int, world_size: int, where: str, has_optim: bool
) -> dict:
    frozen = {}
    for meta in metas:
        if meta["has_master"]:
            continue
        piece = (model_sd.get("frozen_param_fragments") or {}).get(meta["name"])
        if piece is None:
            raise UpstreamFormatError(f"{where}: no 'frozen_param_fragments' entry for {meta['name']!r}")
        frozen[meta["name"]] = piece.reshape(-1)
    module = model_sd.get("module") or {}
    buffers = {n: module[n] for n in model_sd.get("buffer_names") or [] if n in module}
    cfg = model_sd.get("ds_config") or {}
    gas = cfg.get("gradient_accumulation_steps", 1)
    global_steps = int(model_sd.get("global_steps", 0))
    return {
        "rank": rank,
        "world_size": world_size,
        "save_id": "upstream",
        "dtype": _dtype_of(model_sd),
        "params": metas,
        "has_optimizer": has_optim,
        "shared_params": [[a, c] for a, c in (model_sd.get("shared_params") or {}).items()],
        "frozen_param_shards": frozen,
        "buffers": buffers,
        "global_steps": global_steps,
        "global_samples": int(model_sd.get("global_samples", 0)),
        "skipped_steps": int(model_sd.get("skipped_steps", 0) or 0),
        "micro_steps": global_steps * (gas if isinstance(gas, int) else 1),
        "lr_scheduler": model_sd.get("lr_scheduler"),
        "client_state": {k: v for k, v in model_sd.items() if k not in UPSTREAM_ENGINE_KEYS},
        "ds_version": model_sd.get("ds_version"),
    }


def normalize_upstream(directory: str, model_sds: list, optim_sds: Optional[list], paths: list) -> tuple:
    """`(model_states, optim_states)` in this package's layout from upstream's per-rank dicts.

    `paths[r]` names rank r's files for messages. Raises `UpstreamFormatError`.
    """
    world_size = len(model_sds)
    model_states, optim_states = [], None if optim_sds is None else []
    for r, model_sd in enumerate(model_sds):
        metas, names_per_group = _param_metas(model_sd, world_size, paths[r][0])
        by_name = {m["name"]: m for m in metas}
        model_states.append(_model_states(model_sd, metas, r, world_size, paths[r][0], optim_sds is not None))
        if optim_sds is not None:
            optim_states.append(
                _optim_states(optim_sds[r], names_per_group, by_name, r, world_size, paths[r][1])
            )
    if optim_sds is None:
        # Without optimizer files, trainable weights have nowhere to come from.
        trainable = [m["name"] for m in model_states[0]["params"] if m["has_master"]]
        if trainable:
            raise UpstreamFormatError(
                f"{directory}: upstream checkpoint without '*_optim_states.pt' files: the fp32 weights of "
                f"{len(trainable)} trainable parameters are in those files"
            )
    return model_states, optim_states


# ============================================================================ stages 0-2

# [Note: upstream's stage 0-2 layout]
# Saved on N ranks at stage 0, 1 or 2, upstream writes one model file for every rank,
# `mp_rank_00_model_states.pt`, whose `module` is the whole state dict in the model dtype
# (frozen parameters and buffers included), and per rank r an optim-states file whose
# `optimizer_state_dict` holds, per param group g, `single_partition_of_fp32_groups[g]`:
# rank r's equal part of the group's flattened fp32 parameters. Put back to back over the
# ranks, the parts are the group's flat vector: each parameter of `param_shapes[g]` in turn,
# followed by its `param_alignment_paddings[g][i]` elements (zero when absent), then the
# group's tail padding. Both lists are in the flat order, also with `round_robin_gradients`
# (upstream writes them from its reordered groups). At stage 0 upstream writes no optim
# files (the whole torch optimizer state sits in the model file); that layout is refused. The wrapped torch optimizer's state (`base_optimizer_state`, keyed by
# group, its params the flat parts) is cut the same way. `stage_0_to_2_as_stage_3` rewrites
# these dicts into the stage-3 layout above (each parameter's shard per rank under the
# stage-3 shard math, frozen parameters as fragments), so `normalize_upstream` and
# everything after it stay one code path.


def _shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s stage-3 shard of the flat `full` (zero-padded to a multiple of `world_size`)."""
    size = -(-full.numel() // world_size)
    piece = full[rank * size : (rank + 1) * size]
    if piece.numel() < size:
        piece = torch.cat([piece, full.new_zeros(size - piece.numel())])
    return piece


def _group_pieces(flat: torch.Tensor, shapes: dict, paddings: list, where: str) -> dict:
    """Each parameter's flat slice of one group's whole flat vector (see the note above)."""
    out, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(int(d) for d in shape)
        if offset + numel > flat.numel():
            raise UpstreamFormatError(
                f"{where}: the group's flat vector has {flat.numel()} elements; its parameters up to "
                f"{name!r} need {offset + numel}"
            )
        out[name] = flat[offset : offset + numel]
        offset += numel + (int(paddings[i]) if i < len(paddings) else 0)
    return out


def stage_0_to_2_as_stage_3(model_sd: dict, optim_sds: list, paths: list) -> tuple:
    """`(model_sds, optim_sds)` per saving rank in upstream's stage-3 layout from a stage 0-2 save.

    `model_sd`: the one `mp_rank_00_model_states.pt`; `optim_sds[r]`: rank r's optim file;
    `paths[r]`: its path, for messages. Raises `UpstreamFormatError`.
    """
    world = len(optim_sds)
    zero_sds = []
    for r, sd in enumerate(optim_sds):
        zero_sd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(zero_sd, dict) or "single_partition_of_fp32_groups" not in zero_sd:
            raise UpstreamFormatError(
                f"{paths[r]}: no 'single_partition_of_fp32_groups' (not a stage 0-2 file)"
            )
        counts = zero_sd.get("partition_count", world)
        counts = counts if isinstance(counts, (list, tuple)) else [counts]
        if any(int(c) != world for c in counts):
            raise UpstreamFormatError(
                f"{paths[r]}: partitioned over {counts} ranks, but {world} optim files exist"
            )
        zero_sds.append(zero_sd)
    groups = model_sd.get("param_shapes")
    groups = [groups] if isinstance(groups, dict) else groups
    if not isinstance(groups, list) or len(groups) != len(zero_sds[0]["single_partition_of_fp32_groups"]):
        raise UpstreamFormatError(f"{paths[0]}: 'param_shapes' does not match the optimizer's param groups")
    paddings = zero_sds[0].get("param_alignment_paddings") or [[] for _ in groups]
    base = [sd.get("base_optimizer_state") for sd in zero_sds]
    if not all(isinstance(b, dict) and "state" in b and "param_groups" in b for b in base):
        raise UpstreamFormatError(
            f"{paths[0]}: 'base_optimizer_state' is not a torch optimizer state dict (an elastic "
            "stage 0-2 checkpoint?); save it again with zero_optimization.elastic_checkpoint false"
        )
    # Whole flat vectors per group: the fp32 weights and each per-element optimizer state.
    fp32 = {}  # name -> full flat fp32
    state_full: dict = {}  # name -> {key: full flat}
    scalars: list = []  # per group: {key: value} of state that is not per element
    for g, shapes in enumerate(groups):
        where = f"{paths[0]} (param group {g})"
        parts = [sd["single_partition_of_fp32_groups"][g].reshape(-1) for sd in zero_sds]
        fp32.update(_group_pieces(torch.cat(parts), shapes, paddings[g], where))
        index = base[0]["param_groups"][g]["params"][0]
        per_key, plain = {}, {}
        for key, value in base[0]["state"].get(index, {}).items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == parts[0].numel():
                whole = torch.cat([b["state"][index][key].reshape(-1) for b in base])
                per_key[key] = _group_pieces(whole, shapes, paddings[g], where)
            else:
                plain[key] = value
        scalars.append(plain)
        for name in shapes:
            state_full[name] = {key: pieces[name] for key, pieces in per_key.items()}
    trainable = {name for shapes in groups for name in shapes}
    module = model_sd.get("module") or {}
    buffers = set(model_sd.get("buffer_names") or [])
    shared = set((model_sd.get("shared_params") or {}).keys())
    frozen = {n: t for n, t in module.items() if n not in trainable and n not in buffers and n not in shared}
    model_sds, stage3_optim = [], []
    for r in range(world):
        sd = dict(model_sd)
        sd["frozen_param_shapes"] = OrderedDict((n, t.shape) for n, t in frozen.items())
        sd["frozen_param_fragments"] = {n: _shard(t.reshape(-1), r, world) for n, t in frozen.items()}
        sd["dp_world_size"] = world
        model_sds.append(sd)
        flats, state = [], {}
        for g, shapes in enumerate(groups):
            flats.append(torch.cat([_shard(fp32[n], r, world) for n in shapes]))
            keys = state_full[next(iter(shapes))].keys() if shapes else []
            entry = {k: torch.cat([_shard(state_full[n][k], r, world) for n in shapes]) for k in keys}
            entry.update(scalars[g])
            state[g] = entry
        param_groups = []
        for g, group in enumerate(base[r]["param_groups"]):
            hyper = {k: v for k, v in group.items() if k != "params"}
            hyper["params"] = [g]
            param_groups.append(hyper)
        stage3_optim.append(
            {
                "optimizer_state_dict": {
                    "zero_stage": 3,
                    "partition_count": world,
                    "fp32_flat_groups": flats,
                    "optimizer_state_dict": {"state": state, "param_groups": param_groups},
                    "loss_scaler": zero_sds[r].get("loss_scaler"),
                    "overflow": zero_sds[r].get("overflow", False),
                }
            }
        )
    return model_sds, stage3_optim
