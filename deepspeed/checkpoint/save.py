"""Saving a checkpoint: what each rank writes (see [Note: checkpoint layout] in layout.py).

The engine is read only through the `CheckpointEngine` interface; the ranks keep in step
through `rank_phases.py` ([Note: every rank raises, none hangs]).
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from typing import Any, Optional

import torch

from deepspeed.checkpoint import layout, rank_phases
from deepspeed.checkpoint.atomic_write import atomic_torch_save
from deepspeed.checkpoint.errors import CheckpointArgumentError, CheckpointError, CheckpointTagMismatch
from deepspeed.checkpoint.interface import CheckpointEngine
from deepspeed.checkpoint.layout import ParamMeta
from deepspeed.checkpoint.safe_load import TRUST_ENV, refused_globals
from deepspeed.checkpoint.upstream import UPSTREAM_ENGINE_KEYS
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.utils.logging import log_dist, logger
from deepspeed.version import __version__

# Top-level keys of a model-states file that an engine writes (upstream's, and our own
# metadata's); client state may not use them, or upstream's tools would misread the file.
_MODEL_FILE_KEYS = UPSTREAM_ENGINE_KEYS | {layout.OWN_KEY}


def persistent_buffers(module: torch.nn.Module) -> list:
    """`(qualified name, tensor)` of the buffers `module.state_dict()` would contain."""
    out = []
    for prefix, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def _shared_params(module: torch.nn.Module) -> list:
    """`[alias, canonical]` for each extra name of a tied parameter."""
    first: dict = {}
    aliases = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.append([name, first[id(p)]])
        else:
            first[id(p)] = name
    return aliases


def _flatten(tensors: list, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A new flat tensor holding `tensors` one after another (a copy, safe to save)."""
    if not tensors:
        return torch.empty(0, dtype=dtype or torch.float32)
    flat = torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])
    return flat.to(dtype) if dtype is not None else flat


def _views(flat: torch.Tensor, names: list, partition: dict) -> dict:
    """`{name: its slice of flat}`: saved with `flat`, these views add no bytes to the file."""
    out, offset = {}, 0
    for name in names:
        out[name] = flat[offset : offset + partition[name]]
        offset += partition[name]
    return out


def _is_sharded_state(value: Any, partition_size: int) -> bool:
    """Optimizer state cut like the master (Adam's moments) rather than shared (its `step`)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == partition_size


def split_optimizer_state(state: dict, partition_size: int) -> tuple:
    """`(sharded, replicated)` halves of one master's optimizer state."""
    sharded = {k: v for k, v in state.items() if _is_sharded_state(v, partition_size)}
    replicated = {k: v for k, v in state.items() if k not in sharded}
    return sharded, replicated


def _warn_if_load_needs_trust(model_path: str) -> None:
    """Warn at save time when the client state holds types the loader refuses by default.

    The save succeeds (a failing save would lose the training run); the warning names the
    types and the opt-ins (see [Note: loading untrusted checkpoints] in safe_load.py).
    """
    try:
        refused = refused_globals(model_path)
    except Exception as err:  # the scan is advisory: the file itself was written
        logger.warning(f"{model_path}: could not check the client state's types for loading: {err}")
        return
    if refused:
        logger.warning(
            f"{model_path}: client_state holds {', '.join(refused)}, outside the checkpoint loader's "
            "allowlist (plain Python values, tensors, argparse.Namespace and paths are in it). Loading "
            f"this checkpoint will need trust_checkpoint=True or {TRUST_ENV}=1, or "
            "torch.serialization.add_safe_globals([...]) for these types; store plain values to avoid "
            "that (see 'Loading untrusted checkpoints' in docs/checkpoints.md)"
        )


def model_states_path(engine: CheckpointEngine, save_dir: str, tag: Any) -> str:
    """This rank's model-states file of the save `save_dir/tag`."""
    rank, _ = engine.checkpoint_rank_and_world()
    return os.path.join(save_dir, str(tag), layout.model_states_name(rank))


def optim_states_path(engine: CheckpointEngine, save_dir: str, tag: Any) -> str:
    """This rank's optimizer-states file (its fp32 master and optimizer-state shards)."""
    rank, _ = engine.checkpoint_rank_and_world()
    return os.path.join(save_dir, str(tag), layout.optim_states_name(rank))


def make_executable(path: str) -> None:
    """Make the saved `zero_to_fp32.py` executable. A file system that refuses (a shared
    mount, a file owned by another user) only costs the convenience of running it as
    `./zero_to_fp32.py`: logged, not raised."""
    try:
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as err:
        logger.info(
            f"could not make {path} executable ({err}); run it with `python {os.path.basename(path)}`"
        )


# ============================================================================ the phases


def save_checkpoint(
    engine: CheckpointEngine,
    save_dir: str,
    tag: Any,
    client_state: Optional[dict],
    save_latest: bool,
    exclude_frozen_parameters: bool,
) -> bool:
    """`engine.save_checkpoint` (see its docstring): every rank writes, then `latest` moves."""
    rank_phases.on_all_ranks("save_checkpoint", _check_save_dir, save_dir)
    if tag is None:
        tag = f"global_step{engine.checkpoint_counters()['global_steps']}"
    tag = str(tag)
    engine.settle_before_save()  # a live modifier gather's edits go into the shards first
    header = _save_header(engine, tag)  # collective: before anything that can fail on one rank
    tag = _tag_to_save_under(engine, header["tag"], tag)
    ckpt_dir = os.path.join(save_dir, tag)
    rank_phases.on_all_ranks(
        "save_checkpoint",
        _write_rank_files,
        engine,
        save_dir,
        header,
        tag,
        client_state or {},
        exclude_frozen_parameters,
    )
    # [Note: crash-safe writes] in atomic_write.py: `latest` moves only now.
    rank_phases.on_all_ranks("save_checkpoint", _publish_save, engine, save_dir, ckpt_dir, tag, save_latest)
    log_dist(f"saved checkpoint {ckpt_dir} on {rank_phases.world_size()} rank(s)", ranks=[0])
    return True


def _check_save_dir(save_dir: Any) -> None:
    if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
        raise CheckpointArgumentError(
            f"save_checkpoint(save_dir={save_dir!r}): pass the folder to save into (it is created if missing)"
        )


def _tag_to_save_under(engine: CheckpointEngine, rank0_tag: str, tag: str) -> str:
    """Rank 0's tag, where this rank's differs and `checkpoint.tag_validation` lets the save go
    on: "warn" (upstream's default) says so, "ignore" does not. One folder holds the save
    either way (upstream would write each rank's files under its own tag, a checkpoint no
    load can read). "fail" keeps this rank's tag, which the write phase refuses on every rank."""
    if tag == rank0_tag:
        return tag
    mode = engine.checkpoint_tag_validation()
    if mode == "fail":
        return tag
    if mode == "warn":
        logger.warning(
            f"checkpoint tag {tag!r} on rank {engine.checkpoint_rank_and_world()[0]} differs from rank 0's "
            f"{rank0_tag!r}: saving under {rank0_tag!r} (checkpoint.tag_validation 'Warn'; 'Fail' refuses)"
        )
    return rank0_tag


def _save_header(engine: CheckpointEngine, tag: str) -> dict:
    save_id, rank0_tag = rank_phases.broadcast_from_rank0((layout.new_save_id(), tag))
    rank, world = engine.checkpoint_rank_and_world()
    return {
        "format": layout.FORMAT,
        "format_version": layout.FORMAT_VERSION,
        "ds_version": __version__,
        "save_id": save_id,
        "tag": rank0_tag,
        "rank": rank,
        "world_size": world,
    }


def _write_rank_files(
    engine: CheckpointEngine, save_dir: str, header: dict, tag: str, client_state: dict, exclude_frozen: bool
) -> None:
    layout.check_tag(tag)
    if header["tag"] != tag:
        raise CheckpointTagMismatch(
            f"checkpoint tag {tag!r} differs from rank 0's {header['tag']!r} (checkpoint.tag_validation "
            "'Fail'); pass the same tag on every rank"
        )
    if not engine.checkpoint_writes_files():
        _refuse_replicas_on_node_local_storage(engine)
        return  # a MiCS replica: the first replica writes these shards
    entries = _checkpoint_entries(engine, exclude_frozen)
    model_states = _model_states(engine, entries, header, client_state)  # refuses bad client_state keys
    os.makedirs(os.path.join(save_dir, tag), exist_ok=True)  # only then: a refused save leaves no folder
    model_path = model_states_path(engine, save_dir, tag)
    atomic_torch_save(model_states, model_path)
    del model_states
    if client_state and header["rank"] == 0:
        _warn_if_load_needs_trust(model_path)
    if engine.checkpoint_optimizer() is not None:
        optim_path = optim_states_path(engine, save_dir, tag)
        atomic_torch_save(_optim_states(engine, entries, header), optim_path)


def _publish_save(
    engine: CheckpointEngine, save_dir: str, ckpt_dir: str, tag: str, save_latest: bool
) -> None:
    # `checkpoint.use_node_local_storage` (HF's save_on_each_node): each node's storage is
    # its own, so the first rank of every node publishes there; otherwise rank 0 alone.
    rank, world = engine.checkpoint_rank_and_world()
    if not engine.checkpoint_writes_files():
        return
    if engine.publishes_on_every_node():
        if not rank_phases.is_first_on_node():
            return
    elif rank != 0:
        return
    removed = layout.remove_stale_rank_files(ckpt_dir, world)
    if removed:
        logger.info(f"removed {len(removed)} rank files of an older save from {ckpt_dir}")
    make_executable(layout.write_recovery_script(save_dir))
    if save_latest:
        layout.write_latest(save_dir, tag)


def _refuse_replicas_on_node_local_storage(engine: CheckpointEngine) -> None:
    if engine.publishes_on_every_node():
        raise CheckpointError(
            "checkpoint.use_node_local_storage with MiCS: only the first replica writes the shards, so the "
            "other nodes' storage would lack them; save to storage every node shares, or set it to false"
        )


# ============================================================================ the files


def _checkpoint_entries(engine: CheckpointEngine, exclude_frozen: bool) -> list:
    """`(name, ParamShard, ParamMeta)` per saved parameter, in named_parameters order."""
    optimizer = engine.checkpoint_optimizer()
    masters = optimizer.masters if optimizer is not None else {}
    _, world = engine.checkpoint_rank_and_world()
    entries = []
    for name, param in engine.checkpoint_module().named_parameters():
        state = engine.checkpoint_shard_of(param)
        if state is None:
            raise CheckpointError(
                f"parameter {name!r} has no shard on this rank; it was added to the model after "
                "deepspeed.initialize, which checkpoints do not support"
            )
        if state.world_size != world:
            raise CheckpointError(
                f"parameter {name!r} is partitioned over {state.world_size} ranks, not the world's "
                f"{world}; checkpoints support partitioning over the whole world only"
            )
        if exclude_frozen and not param.requires_grad:
            continue
        meta = ParamMeta(
            name=name,
            shape=tuple(state.shape),
            numel=state.numel,
            ds_id=state.ds_id,
            partition_size=state.partition_size,
            requires_grad=param.requires_grad,
            has_master=state.ds_id in masters,
        )
        entries.append((name, state, meta))
    return entries


def _checkpoint_groups(engine: CheckpointEngine, entries: list) -> list:
    """Names of the saved parameters with an fp32 master, per optimizer param group.

    These are the `param_shapes` groups, each matching one flat tensor of
    `fp32_flat_groups` (see [Note: checkpoint layout] in layout.py).
    """
    optimizer = engine.checkpoint_optimizer()
    if optimizer is None:
        return []
    masters = optimizer.masters
    name_of = {id(masters[s.ds_id]): name for name, s, meta in entries if meta.has_master}
    groups, placed = [], set()
    for group in optimizer.optimizer.param_groups:
        names = [name_of[id(p)] for p in group["params"] if id(p) in name_of]
        groups.append(names)
        placed.update(names)
    rest = [name for name, _, meta in entries if meta.has_master and name not in placed]
    if rest:
        groups.append(rest)
    return groups


def _model_states(engine: CheckpointEngine, entries: list, header: dict, client_state: dict) -> dict:
    reserved = sorted(set(client_state) & _MODEL_FILE_KEYS)
    if reserved:
        raise ValueError(
            f"client_state keys {reserved} are names the checkpoint itself uses at the top level of "
            "*_model_states.pt (as upstream DeepSpeed does); rename them"
        )
    rank0 = header["rank"] == 0
    module = engine.checkpoint_module()
    scheduler = engine.checkpoint_lr_scheduler()
    record = engine.checkpoint_record()
    counters = engine.checkpoint_counters()
    meta_of = {name: meta for name, _, meta in entries}
    buffers = OrderedDict(persistent_buffers(module)) if rank0 else OrderedDict()
    own = {
        **header,
        # The stage trained at; every stage saves the same layout (this rank's slice of every
        # parameter), so a checkpoint loads at any stage and any world size.
        "zero_stage": record["zero_stage"],
        "dtype": str(record["dtype"]),
        "params": [meta.to_dict() for _, _, meta in entries],
        "has_optimizer": engine.checkpoint_optimizer() is not None,
        "micro_steps": counters["micro_steps"],
        "client_state_keys": list(client_state),
    }
    # Upstream's key names first: its zero_to_fp32 and Lightning read them.
    sd = {
        "module": buffers,
        "buffer_names": list(buffers),
        "optimizer": None,
        "param_shapes": [
            OrderedDict((n, torch.Size(meta_of[n].shape)) for n in names)
            for names in _checkpoint_groups(engine, entries)
        ],
        "frozen_param_shapes": OrderedDict(
            (name, torch.Size(meta.shape)) for name, _, meta in entries if not meta.has_master
        ),
        "frozen_param_fragments": {name: s.shard for name, s, meta in entries if not meta.has_master},
        "shared_params": dict(_shared_params(module)),
        "lr_scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict") else None,
        "skipped_steps": int(counters["skipped_steps"] or 0),
        "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"],
        "dp_world_size": header["world_size"],
        "mp_world_size": 1,
        "ds_config": record["ds_config"],
        "ds_version": __version__,
        layout.OWN_KEY: own,
    }
    sd = clone_tensors_for_torch_save(sd)
    sd.update(clone_tensors_for_torch_save(dict(client_state)))  # at the top level, as upstream
    return sd


def _flat_optimizer_groups(engine: CheckpointEngine, entries: list, rank0: bool) -> tuple:
    """Per group, the flat fp32 masters and flat optimizer state, and per name, views into them.

    Returns `(flats, flat_state, shards, sharded, replicated)`; see [Note: checkpoint layout].
    """
    opt = engine.checkpoint_optimizer()
    torch_state = opt.optimizer.state
    masters = {name: opt.masters[s.ds_id] for name, s, meta in entries if meta.has_master}
    partition = {name: meta.partition_size for name, _, meta in entries}
    # NVMe: the copies go to scratch files, read from the swap files a group at a time
    # (nvme_optimizer.py's [Note: checkpoints of swapped state]).
    swapper = getattr(opt, "swapper", None)
    flatten = _flatten if swapper is None or swapper.is_resident else swapper.flatten
    flats, flat_state, shards, sharded, replicated = [], {}, {}, {}, {}
    for g, names in enumerate(_checkpoint_groups(engine, entries)):
        # One flat fp32 tensor per group, per-name views into it.
        flat = flatten([masters[n] for n in names], torch.float32)
        flats.append(flat)
        shards.update(_views(flat, names, partition))
        states = {n: torch_state.get(masters[n], {}) for n in names}
        cut = {n: split_optimizer_state(states[n], partition[n]) for n in names}
        keys = set.intersection(*(set(cut[n][0]) for n in names)) if names else set()
        flat_state[g] = {k: flatten([cut[n][0][k] for n in names], None) for k in sorted(keys)}
        views = {key: _views(flat_value, names, partition) for key, flat_value in flat_state[g].items()}
        for n in names:
            # A key only some of the group's parameters have stays per parameter.
            sharded[n] = {k: flatten([v], None) for k, v in cut[n][0].items() if k not in keys}
            sharded[n].update({key: views[key][n] for key in keys})
            if rank0:
                replicated[n] = clone_tensors_for_torch_save(cut[n][1])
        first = cut[names[0]][1] if names else {}
        flat_state[g].update(clone_tensors_for_torch_save(first))
    return flats, flat_state, shards, sharded, replicated


def _optim_states(engine: CheckpointEngine, entries: list, header: dict) -> dict:
    opt = engine.checkpoint_optimizer()
    groups = _checkpoint_groups(engine, entries)
    flats, flat_state, shards, sharded, replicated = _flat_optimizer_groups(
        engine, entries, header["rank"] == 0
    )
    named_groups, torch_groups = [], []
    for g, group in enumerate(opt.optimizer.param_groups):
        hyper = clone_tensors_for_torch_save({k: v for k, v in group.items() if k != "params"})
        named_groups.append({**hyper, "params": list(groups[g]) if g < len(groups) else []})
        torch_groups.append({**hyper, "params": [g] if g < len(groups) else []})
    own = {
        **header,
        "optimizer_class": type(opt.optimizer).__name__,
        "fp32_master_shards": shards,
        "optimizer_state": sharded,
        "replicated_optimizer_state": replicated,
        "param_groups": named_groups,
        "loss_scaler": opt.loss_scaler.state_dict(),
        "overflow": bool(opt.overflow),
    }
    return {
        # Upstream's layout of a stage-3 optimizer file: its zero_to_fp32 and Lightning read it.
        # Every stage writes it (stages 0-2 shard the optimizer the same way), so it says 3.
        "optimizer_state_dict": {
            "zero_stage": 3,
            "loss_scaler": opt.loss_scaler.state_dict(),
            "dynamic_loss_scale": bool(getattr(opt.loss_scaler, "dynamic", False)),
            "overflow": bool(opt.overflow),
            "partition_count": header["world_size"],
            "optimizer_state_dict": {"state": flat_state, "param_groups": torch_groups},
            "fp32_flat_groups": flats,
        },
        "ds_config": engine.checkpoint_record()["ds_config"],
        "ds_version": __version__,
        layout.OWN_KEY: own,
    }
