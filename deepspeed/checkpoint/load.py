"""Loading a checkpoint into an engine, saved on any number of ranks and at any stage.

Every file is opened and checked against the model before anything changes (see [Note:
every rank raises, none hangs] in rank_phases.py); then each rank cuts its shards out of the
saved ones ([Note: elastic resharding] in sharded.py). The engine is read and changed only
through the `CheckpointEngine` interface.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from deepspeed.checkpoint import layout, rank_phases
from deepspeed.checkpoint.errors import CheckpointError
from deepspeed.checkpoint.interface import CheckpointEngine
from deepspeed.checkpoint.save import persistent_buffers
from deepspeed.checkpoint.sharded import ShardedCheckpoint, check_against_model, name_list
from deepspeed.runtime.zero.stage3 import copy_cast
from deepspeed.utils.logging import log_dist, logger

# Param-group keys that choose how torch's optimizers compute a step, not what it computes:
# they stay as this run built its optimizer (a checkpoint saved with torch's per-tensor loop
# does not turn the fused kernel off, nor the other way round).
_KERNEL_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})


def _place_state(key: str, value: Any, master: torch.Tensor, group: dict) -> Any:
    """Where torch keeps optimizer state: `step` on the CPU unless capturable/fused, else by the master."""
    if not torch.is_tensor(value):
        return value
    if key == "step" and value.dim() == 0 and not (group.get("capturable") or group.get("fused")):
        return value
    return value.to(master.device)


def load_checkpoint(
    engine: CheckpointEngine,
    load_dir: str,
    tag: Any,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    trust_checkpoint: bool,
) -> tuple:
    """`engine.load_checkpoint` (see its docstring): `(path, client_state)` or `(None, None)`."""
    ckpt_dir = rank_phases.on_all_ranks(
        "load_checkpoint", _resolve_checkpoint_dir, engine, load_dir, tag, agree=True
    ).ckpt_dir
    if ckpt_dir is None:
        return None, None
    load_optim = engine.checkpoint_optimizer() is not None and load_optimizer_states and not load_module_only
    load_sched = load_lr_scheduler_states and not load_module_only

    def open_and_apply() -> ShardedCheckpoint:  # this rank's reads: no collective inside
        ckpt = _open_checkpoint(engine, ckpt_dir, load_optim, load_module_strict, trust_checkpoint)
        _apply_checkpoint(engine, ckpt, load_optim, load_sched, load_module_only)
        return ckpt

    ckpt = rank_phases.on_all_ranks("load_checkpoint", _in_loading_turns, engine, open_and_apply)
    engine.refresh_after_load()  # gathered (stage 3) or full (0-2) tensors
    rank, _ = engine.checkpoint_rank_and_world()
    log_dist(f"loaded checkpoint {ckpt_dir} (saved on {ckpt.world_size} rank(s))", ranks=[0])
    return ckpt.model_file(rank if rank < ckpt.world_size else 0), ckpt.client_state(rank)


def _in_loading_turns(engine: CheckpointEngine, load) -> Any:
    """`load()`, under `zero_optimization.pipeline_loading_checkpoint` one local rank of each
    node after another (see `rank_phases.in_turns_per_node`)."""
    if not engine.loads_in_turns():
        return load()
    return rank_phases.in_turns_per_node(load)


@dataclasses.dataclass(frozen=True)
class _Resolved:
    """Where a rank's `load_checkpoint` arguments led. The ranks must agree on the folder only
    (one may name the tag `latest` names); a disagreement prints `asked` too, naming each tag."""

    ckpt_dir: Optional[str]
    asked: Any = dataclasses.field(compare=False)


def _resolve_checkpoint_dir(engine: CheckpointEngine, load_dir: str, tag: Any) -> _Resolved:
    asked, rank0 = tag, engine.checkpoint_rank_and_world()[0] == 0
    if not os.path.isdir(load_dir):
        if rank0:
            logger.warning(f"Checkpoint folder {load_dir} does not exist; nothing was loaded")
        return _Resolved(None, asked)
    if tag is None:
        tag = layout.read_latest(load_dir)
        if tag is None:
            if rank0:
                logger.warning(
                    f"Unable to find latest file at {os.path.join(load_dir, layout.LATEST_FILE)}; "
                    "pass tag= to load a specific checkpoint. Nothing was loaded."
                )
            return _Resolved(None, asked)
    ckpt_dir = os.path.join(load_dir, str(tag))
    if not os.path.isdir(ckpt_dir):
        if rank0:
            logger.warning(f"Checkpoint {ckpt_dir} does not exist; nothing was loaded")
        return _Resolved(None, asked)
    return _Resolved(ckpt_dir, asked)


def _open_checkpoint(
    engine: CheckpointEngine, ckpt_dir: str, load_optim: bool, strict: bool, trust: bool
) -> ShardedCheckpoint:
    rank, _ = engine.checkpoint_rank_and_world()
    ckpt = ShardedCheckpoint.open(ckpt_dir, trust, quiet=rank != 0)  # one bar per job, on a terminal
    module = engine.checkpoint_module()
    shapes = {name: tuple(engine.checkpoint_shard_of(p).shape) for name, p in module.named_parameters()}
    check_against_model(ckpt, shapes, strict)
    _check_buffers_fit(module, ckpt, strict)
    if load_optim:
        _check_optimizer_fits(engine, ckpt)
    return ckpt


def _check_buffers_fit(module: torch.nn.Module, ckpt: ShardedCheckpoint, strict: bool) -> None:
    saved = ckpt.engine_entry("buffers") or {}
    ours = dict(persistent_buffers(module))
    problems = [
        f"buffer {n!r} is {tuple(saved[n].shape)} in the checkpoint, {tuple(b.shape)} in the model"
        for n, b in ours.items()
        if n in saved and saved[n].shape != b.shape
    ]
    if strict:
        problems += [f"buffer {n!r} is missing from the checkpoint" for n in ours if n not in saved]
        problems += [f"buffer {n!r} is not in the model" for n in saved if n not in ours]
    if problems:
        raise CheckpointError(f"{ckpt.model_file(0)}: does not match the model: {'; '.join(problems)}")


def _master_names(engine: CheckpointEngine) -> dict:
    """id(master) -> parameter name, for the optimizer's fp32 masters."""
    masters = engine.checkpoint_optimizer().masters
    module = engine.checkpoint_module()
    ids = {name: engine.checkpoint_shard_of(p).ds_id for name, p in module.named_parameters()}
    return {id(masters[i]): name for name, i in ids.items() if i in masters}


def _check_optimizer_fits(engine: CheckpointEngine, ckpt: ShardedCheckpoint) -> None:
    where = ckpt.model_file(0)
    if not ckpt.has_optimizer:
        raise CheckpointError(
            f"{where}: saved without optimizer states (by an engine without an optimizer); pass "
            "load_optimizer_states=False to load only the weights"
        )
    names = _master_names(engine)
    for name in names.values():
        meta = ckpt.params.get(name)
        if meta is not None and not meta.has_master:
            raise CheckpointError(
                f"{where}: parameter {name!r} was frozen when saved, so it has no optimizer state; pass "
                "load_optimizer_states=False to load only the weights"
            )
    saved_groups = ckpt.optimizer_entry("param_groups")
    groups = engine.checkpoint_optimizer().optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"{ckpt.optim_file(0)}: has {len(saved_groups)} optimizer param groups, the engine has {len(groups)}"
        )
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        members = set(saved["params"])
        moved = [names[id(p)] for p in group["params"] if names[id(p)] in ckpt.params]
        moved = [n for n in moved if n not in members]
        if moved:
            raise CheckpointError(
                f"{ckpt.optim_file(0)}: parameters {name_list(moved)} are in param group {i} of the "
                "engine but in another group in the checkpoint"
            )


def _apply_checkpoint(
    engine: CheckpointEngine, ckpt: ShardedCheckpoint, load_optim: bool, load_sched: bool, module_only: bool
) -> None:
    optimizer = engine.checkpoint_optimizer()
    scheduler = engine.checkpoint_lr_scheduler()
    # What can still refuse its input (scheduler, loss scaler) goes first: nothing is changed yet.
    saved_scheduler = ckpt.engine_entry("lr_scheduler")
    if load_sched and scheduler is not None and saved_scheduler is not None:
        scheduler.load_state_dict(saved_scheduler)
    if load_optim:
        optimizer.loss_scaler.load_state_dict(ckpt.optimizer_entry("loss_scaler"))
        optimizer.overflow = bool(ckpt.optimizer_entry("overflow"))
        for saved, group in zip(ckpt.optimizer_entry("param_groups"), optimizer.optimizer.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params" and k not in _KERNEL_CHOICES})
    _apply_weights(engine, ckpt, load_optim)
    saved_buffers = ckpt.engine_entry("buffers") or {}
    with torch.no_grad():
        for name, buf in persistent_buffers(engine.checkpoint_module()):
            if name in saved_buffers:
                buf.copy_(saved_buffers[name])
    if not module_only:
        engine.restore_checkpoint_counters(
            ckpt.engine_entry("global_steps"),
            ckpt.engine_entry("global_samples"),
            int(ckpt.engine_entry("skipped_steps") or 0),
        )
    # The gradients of the interrupted step are not in the checkpoint; with them gone, the
    # next micro-step starts an accumulation (as upstream, which never restores the count):
    # the saved count would put the boundary wherever the old run was, or under another
    # gradient_accumulation_steps, anywhere.
    engine.restart_accumulation()


@torch.no_grad()
def _apply_weights(engine: CheckpointEngine, ckpt: ShardedCheckpoint, load_optim: bool) -> None:
    """Cut this rank's shard of every saved parameter (see [Note: elastic resharding])."""
    optimizer = engine.checkpoint_optimizer()
    masters = optimizer.masters if optimizer is not None else {}
    # NVMe: masters and swapped state go to their files a group at a time, never all in
    # memory (nvme_optimizer.py's [Note: checkpoints of swapped state]).
    swapper = getattr(optimizer, "swapper", None)
    if swapper is not None and swapper.is_resident:
        swapper = None  # inside resident(): everything is in memory, loaded as without NVMe
    group_of = {}
    if load_optim:
        for group in optimizer.optimizer.param_groups:
            group_of.update({id(p): group for p in group["params"]})
    for name, param in engine.checkpoint_module().named_parameters():
        if name not in ckpt.params:
            continue  # load_module_strict=False: the model keeps its own values
        state = engine.checkpoint_shard_of(param)
        weights = ckpt.resharded_weight(name, state.world_size, state.rank)
        master = masters.get(state.ds_id)
        if master is None:
            state.assign_shard(weights)  # re-quantized when stored quantized (zero/quantized.py)
            continue
        if swapper is None:
            master.data.copy_(weights)
            weights = master.data
        else:
            weights = weights.to(torch.float32)
        copy_cast(state.shard, weights)  # as the optimizer's write-back casts it
        optimizer.mark_master_current(state)  # an edit made before the load is gone
        placed = None
        if load_optim:
            saved = ckpt.resharded_optimizer_state(name, state.world_size, state.rank)
            group = group_of[id(master)]
            placed = {k: _place_state(k, v, master, group) for k, v in saved.items()}
        if swapper is not None:
            swapper.stage(master, weights, placed)  # `placed` keeps swapped-out stand-ins
        if load_optim:
            if placed:
                optimizer.optimizer.state[master] = placed
            else:
                optimizer.optimizer.state.pop(master, None)
    if swapper is not None:
        swapper.finish_staged()
    if load_optim:
        _finish_optimizer_load(optimizer.optimizer)


def _finish_optimizer_load(inner: torch.optim.Optimizer) -> None:
    """The states were placed directly, past the optimizer's own load_state_dict, so what that
    does last is done here: its __setstate__ puts the states in its own form (torch's Adam
    turns an int `step`, as DeepSpeedCPUAdam saves it, into the tensor it steps with), and one
    that lays out its state itself (DeepSpeedCPUAdam's huge pages) moves it there."""
    inner.__setstate__({"state": inner.state, "param_groups": inner.param_groups})
    relayout = getattr(inner, "move_states_into_huge_pages", None)
    if relayout is not None:
        relayout()
