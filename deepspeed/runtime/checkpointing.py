"""Engine checkpoint methods (save/load, 16-bit export), mixed into `DeepSpeedEngine`.

The file format, crash-safe writes and resharding live in `runtime/zero/checkpoint_io.py`;
this module decides what each rank writes and keeps the ranks in step.

[Note: every rank raises, none hangs]
A save or load runs in phases (write the rank files; publish `latest` / resolve the tag;
open and check every file; apply). Each phase ends with one `all_gather_object` of the
ranks' error messages, which doubles as the barrier between phases. If any rank failed,
every rank raises the same `CheckpointError` listing each failed rank's message (a missing
or truncated file is named there), so no rank waits in a collective its peers never join.
A load checks every file and the fit to the model before it changes anything, so an error
leaves the engine as it was.
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from deepspeed import comm as dist
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.zero import checkpoint_io as ckpt_io
from deepspeed.runtime.zero.checkpoint_io import CheckpointError, ParamMeta, ShardedCheckpoint
from deepspeed.runtime.zero.checkpoint_upstream import UPSTREAM_ENGINE_KEYS
from deepspeed.runtime.zero.stage3 import copy_cast
from deepspeed.utils.logging import log_dist, logger
from deepspeed.version import __version__

# Top-level keys of a model-states file that an engine writes (upstream's, and our own
# metadata's); client state may not use them, or upstream's tools would misread the file.
_MODEL_FILE_KEYS = UPSTREAM_ENGINE_KEYS | {ckpt_io.OWN_KEY}

# Param-group keys that choose how torch's optimizers compute a step, not what it computes:
# they stay as this run built its optimizer (a checkpoint saved with torch's per-tensor loop
# does not turn the fused kernel off, nor the other way round).
_KERNEL_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _on_all_ranks(what: str, fn: Callable, *args: Any, agree: bool = False) -> Any:
    """Run `fn(*args)` here; raise on every rank if it raised on any (see the note).

    With `agree=True` the (small, picklable) results are compared too: ranks that reached
    different answers (e.g. saw different files) also fail everywhere.
    """
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn(*args)
    except Exception as err:  # reported to every rank below, then re-raised as the cause
        error = err
    message = None if error is None else _describe(error)
    outcomes = [(message, result if agree else None)]
    if _world_size() > 1:
        outcomes = [None] * _world_size()
        dist.all_gather_object(outcomes, (message, result if agree else None))
    failed = [(r, m) for r, (m, _) in enumerate(outcomes) if m is not None]
    if failed:
        lines = "; ".join(f"rank {r}: {m}" for r, m in failed)
        # A refused file raises `UnsafeCheckpointError` on the ranks that refused it.
        kind = type(error) if isinstance(error, CheckpointError) else CheckpointError
        raise kind(f"{what} failed on {len(failed)} of {len(outcomes)} rank(s): {lines}") from error
    if agree and any(res != outcomes[0][1] for _, res in outcomes):
        answers = ", ".join(f"rank {r}: {res!r}" for r, (_, res) in enumerate(outcomes))
        raise CheckpointError(
            f"{what}: the ranks disagree ({answers}); is the directory shared by all ranks?"
        )
    return result


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def _persistent_buffers(module: torch.nn.Module) -> list:
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


def _place_state(key: str, value: Any, master: torch.Tensor, group: dict) -> Any:
    """Where torch keeps optimizer state: `step` on the CPU unless capturable/fused, else by the master."""
    if not torch.is_tensor(value):
        return value
    if key == "step" and value.dim() == 0 and not (group.get("capturable") or group.get("fused")):
        return value
    return value.to(master.device)


def _warn_if_load_needs_trust(model_path: str) -> None:
    """Warn at save time when the client state holds types the loader refuses by default.

    The save succeeds (a failing save would lose the training run); the warning names the
    types and the opt-ins (see [Note: loading untrusted checkpoints] in checkpoint_io.py).
    """
    try:
        refused = ckpt_io.refused_globals(model_path)
    except Exception as err:  # the scan is advisory: the file itself was written
        logger.warning(f"{model_path}: could not check the client state's types for loading: {err}")
        return
    if refused:
        logger.warning(
            f"{model_path}: client_state holds {', '.join(refused)}, outside the checkpoint loader's "
            "allowlist (plain Python values, tensors, argparse.Namespace and paths are in it). Loading "
            f"this checkpoint will need trust_checkpoint=True or {ckpt_io.TRUST_ENV}=1, or "
            "torch.serialization.add_safe_globals([...]) for these types; store plain values to avoid "
            "that (see 'Loading untrusted checkpoints' in docs/checkpoints.md)"
        )


class CheckpointMixin:
    """Checkpoint methods of `DeepSpeedEngine`; they use only the engine's public state."""

    # ================================================================== save

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
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        self._settle_live_gathers()  # a live modifier gather's edits go into the shards first
        if self.optimizer is not None:
            # An edit written back since the last step is in the shard, not yet in a 16-bit
            # training's fp32 master, which is what the files (and zero_to_fp32) hold.
            self.optimizer.refresh_edited_masters()
        header = self._save_header(tag)  # collective: before anything that can fail on one rank
        ckpt_dir = os.path.join(save_dir, tag)
        _on_all_ranks(
            "save_checkpoint",
            self._write_rank_files,
            save_dir,
            header,
            tag,
            client_state or {},
            exclude_frozen_parameters,
        )
        # [Note: crash-safe writes] in checkpoint_io.py: `latest` moves only now.
        _on_all_ranks("save_checkpoint", self._publish_save, save_dir, ckpt_dir, tag, save_latest)
        log_dist(f"saved checkpoint {ckpt_dir} on {_world_size()} rank(s)", ranks=[0])
        return True

    def _save_header(self, tag: str) -> dict:
        agreed = [(ckpt_io.new_save_id(), tag)]
        if _world_size() > 1:
            dist.broadcast_object_list(agreed, src=0)
        save_id, rank0_tag = agreed[0]
        return {
            "format": ckpt_io.FORMAT,
            "format_version": ckpt_io.FORMAT_VERSION,
            "ds_version": __version__,
            "save_id": save_id,
            "tag": rank0_tag,
            "rank": _rank(),
            "world_size": _world_size(),
        }

    # Upstream's names for the files of one save (code written for it calls or patches them).

    def _get_ckpt_name(self, checkpoints_path: str, tag: Any, mp_placeholder: Any = None) -> str:
        """This rank's model-states file of the save `checkpoints_path/tag`."""
        return os.path.join(checkpoints_path, str(tag), ckpt_io.model_states_name(_rank()))

    def _get_zero_ckpt_name(self, checkpoints_path: str, tag: Any) -> str:
        """This rank's optimizer-states file (its fp32 master and optimizer-state shards)."""
        return os.path.join(checkpoints_path, str(tag), ckpt_io.optim_states_name(_rank()))

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: Any, expp_rank: int = 0) -> str:
        """The file upstream keeps an optimizer's states in when ZeRO does not shard them
        (expert-parallel rank `expp_rank`). Here ZeRO shards every optimizer at every stage,
        so its states are in the `_get_zero_ckpt_name` files and this one is never written
        or read: a module-only load, which reads no optimizer state, never asks for it."""
        return os.path.join(checkpoints_path, str(tag), f"expp_rank_{expp_rank}_mp_rank_00_optim_states.pt")

    def _write_rank_files(
        self, save_dir: str, header: dict, tag: str, client_state: dict, exclude_frozen: bool
    ) -> None:
        ckpt_io.check_tag(tag)
        if header["tag"] != tag:
            raise ValueError(f"checkpoint tag {tag!r} differs from rank 0's {header['tag']!r}; pass one tag")
        entries = self._checkpoint_entries(exclude_frozen)
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        model_path = self._get_ckpt_name(save_dir, tag)
        ckpt_io.atomic_torch_save(self._model_states(entries, header, client_state), model_path)
        if client_state and header["rank"] == 0:
            _warn_if_load_needs_trust(model_path)
        if self.optimizer is not None:
            optim_path = self._get_zero_ckpt_name(save_dir, tag)
            ckpt_io.atomic_torch_save(self._optim_states(entries, header), optim_path)

    def _publish_save(self, save_dir: str, ckpt_dir: str, tag: str, save_latest: bool) -> None:
        # `checkpoint.use_node_local_storage` (HF's save_on_each_node): each node's storage is
        # its own, so the first rank of every node publishes there; otherwise rank 0 alone.
        if self._config.use_node_local_storage:
            if dist.get_local_rank() != 0:
                return
        elif _rank() != 0:
            return
        removed = ckpt_io.remove_stale_rank_files(ckpt_dir, _world_size())
        if removed:
            logger.info(f"removed {len(removed)} rank files of an older save from {ckpt_dir}")
        self._change_recovery_script_permissions(ckpt_io.write_recovery_script(save_dir))
        if save_latest:
            ckpt_io.write_latest(save_dir, tag)

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """Make the saved `zero_to_fp32.py` executable (upstream's method name). A file system
        that refuses (a shared mount, a file owned by another user) only costs the convenience
        of running it as `./zero_to_fp32.py`: logged, not raised."""
        try:
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        except OSError as err:
            logger.info(
                f"could not make {dst} executable ({err}); run it with `python {os.path.basename(dst)}`"
            )

    def _checkpoint_entries(self, exclude_frozen: bool) -> list:
        """`(name, ZeroParamState, ParamMeta)` per saved parameter, in named_parameters order."""
        masters = self.optimizer.masters if self.optimizer is not None else {}
        entries = []
        for name, param in self.module.named_parameters():
            state = self._shard_state_of(param)
            if state is None:
                raise CheckpointError(
                    f"parameter {name!r} has no shard on this rank; it was added to the model after "
                    "deepspeed.initialize, which checkpoints do not support"
                )
            if state.world_size != _world_size():
                raise CheckpointError(
                    f"parameter {name!r} is partitioned over {state.world_size} ranks, not the world's "
                    f"{_world_size()}; checkpoints support partitioning over the whole world only"
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

    def _checkpoint_groups(self, entries: list) -> list:
        """Names of the saved parameters with an fp32 master, per optimizer param group.

        These are the `param_shapes` groups, each matching one flat tensor of
        `fp32_flat_groups` (see [Note: checkpoint layout] in checkpoint_io.py).
        """
        if self.optimizer is None:
            return []
        masters = self.optimizer.masters
        name_of = {id(masters[s.ds_id]): name for name, s, meta in entries if meta.has_master}
        groups, placed = [], set()
        for group in self.optimizer.optimizer.param_groups:
            names = [name_of[id(p)] for p in group["params"] if id(p) in name_of]
            groups.append(names)
            placed.update(names)
        rest = [name for name, _, meta in entries if meta.has_master and name not in placed]
        if rest:
            groups.append(rest)
        return groups

    def _model_states(self, entries: list, header: dict, client_state: dict) -> dict:
        reserved = sorted(set(client_state) & _MODEL_FILE_KEYS)
        if reserved:
            raise ValueError(
                f"client_state keys {reserved} are names the checkpoint itself uses at the top level of "
                "*_model_states.pt (as upstream DeepSpeed does); rename them"
            )
        rank0 = header["rank"] == 0
        scheduler = self.lr_scheduler
        meta_of = {name: meta for name, _, meta in entries}
        buffers = OrderedDict(_persistent_buffers(self.module)) if rank0 else OrderedDict()
        own = {
            **header,
            # The stage trained at; every stage saves the same layout (this rank's slice of every
            # parameter), so a checkpoint loads at any stage and any world size.
            "zero_stage": self.zero_optimization_stage(),
            "dtype": str(self.dtype),
            "params": [meta.to_dict() for _, _, meta in entries],
            "has_optimizer": self.optimizer is not None,
            "micro_steps": self.micro_steps,
            "client_state_keys": list(client_state),
        }
        # Upstream's key names first: its zero_to_fp32 and Lightning read them.
        sd = {
            "module": buffers,
            "buffer_names": list(buffers),
            "optimizer": None,
            "param_shapes": [
                OrderedDict((n, torch.Size(meta_of[n].shape)) for n in names)
                for names in self._checkpoint_groups(entries)
            ],
            "frozen_param_shapes": OrderedDict(
                (name, torch.Size(meta.shape)) for name, _, meta in entries if not meta.has_master
            ),
            "frozen_param_fragments": {name: s.shard for name, s, meta in entries if not meta.has_master},
            "shared_params": dict(_shared_params(self.module)),
            "lr_scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict") else None,
            "skipped_steps": int(getattr(self, "skipped_steps", 0) or 0),
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "dp_world_size": header["world_size"],
            "mp_world_size": 1,
            "ds_config": self._config._param_dict,
            "ds_version": __version__,
            ckpt_io.OWN_KEY: own,
        }
        sd = clone_tensors_for_torch_save(sd)
        sd.update(clone_tensors_for_torch_save(dict(client_state)))  # at the top level, as upstream
        return sd

    def _optim_states(self, entries: list, header: dict) -> dict:
        opt = self.optimizer
        torch_state = opt.optimizer.state
        masters = {name: opt.masters[s.ds_id] for name, s, meta in entries if meta.has_master}
        groups = self._checkpoint_groups(entries)
        partition = {name: meta.partition_size for name, _, meta in entries}
        flats, flat_state, shards, sharded, replicated = [], {}, {}, {}, {}
        for g, names in enumerate(groups):
            # [Note: checkpoint layout]: one flat fp32 tensor per group, per-name views into it.
            flat = _flatten([masters[n].detach() for n in names], torch.float32)
            flats.append(flat)
            shards.update(_views(flat, names, partition))
            states = {n: torch_state.get(masters[n], {}) for n in names}
            cut = {n: ckpt_io.split_optimizer_state(states[n], partition[n]) for n in names}
            keys = set.intersection(*(set(cut[n][0]) for n in names)) if names else set()
            flat_state[g] = {k: _flatten([cut[n][0][k] for n in names], None) for k in sorted(keys)}
            views = {key: _views(flat_value, names, partition) for key, flat_value in flat_state[g].items()}
            for n in names:
                # A key only some of the group's parameters have stays per parameter.
                sharded[n] = {k: v.detach().clone() for k, v in cut[n][0].items() if k not in keys}
                sharded[n].update({key: views[key][n] for key in keys})
                if header["rank"] == 0:
                    replicated[n] = clone_tensors_for_torch_save(cut[n][1])
            first = cut[names[0]][1] if names else {}
            flat_state[g].update(clone_tensors_for_torch_save(first))
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
            "ds_config": self._config._param_dict,
            "ds_version": __version__,
            ckpt_io.OWN_KEY: own,
        }

    # ================================================================== load

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
        untrusted checkpoints] in checkpoint_io.py).
        """
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported by this engine")
        ckpt_dir = _on_all_ranks("load_checkpoint", self._resolve_checkpoint_dir, load_dir, tag, agree=True)
        if ckpt_dir is None:
            return None, None
        load_optim = self.optimizer is not None and load_optimizer_states and not load_module_only
        load_sched = load_lr_scheduler_states and not load_module_only

        def open_and_apply() -> ShardedCheckpoint:  # this rank's reads: no collective inside
            ckpt = self._open_checkpoint(ckpt_dir, load_optim, load_module_strict, trust_checkpoint)
            self._apply_checkpoint(ckpt, load_optim, load_sched, load_module_only)
            return ckpt

        ckpt = _on_all_ranks("load_checkpoint", self._in_loading_turns, open_and_apply)
        self._refresh_full_params(after_load=True)  # gathered (stage 3) or full (0-2) tensors
        rank = _rank()
        log_dist(f"loaded checkpoint {ckpt_dir} (saved on {ckpt.world_size} rank(s))", ranks=[0])
        return ckpt.model_file(rank if rank < ckpt.world_size else 0), ckpt.client_state(rank)

    def _in_loading_turns(self, load: Callable[[], Any]) -> Any:
        """Run `load`, under `zero_optimization.pipeline_loading_checkpoint` one local rank
        of each node after another (local rank 0 first), so a node holds one rank's loaded
        files in host memory at a time instead of all of them at once.

        Every rank takes part in every turn's barrier, also one whose own load raised (its
        error is raised after the last turn), so a failure cannot leave the others waiting.
        """
        if not self._config.zero_config.pipeline_loading_checkpoint:
            return load()
        if self.zero_optimization_stage() != 3:
            raise ValueError(
                "zero_optimization.pipeline_loading_checkpoint loads rank by rank at stage 3 only, as "
                f"upstream; this engine runs stage {self.zero_optimization_stage()}: remove the key"
            )
        if _world_size() == 1:
            return load()
        local_ranks = [0] * _world_size()
        dist.all_gather_object(local_ranks, dist.get_local_rank())
        result, error = None, None
        for turn in range(max(local_ranks) + 1):
            if turn == dist.get_local_rank():
                try:
                    result = load()
                except Exception as err:  # raised after the turns, as _on_all_ranks reports it
                    error = err
            dist.barrier()
        if error is not None:
            raise error
        return result

    def _resolve_checkpoint_dir(self, load_dir: str, tag: Any) -> Optional[str]:
        if tag is None:
            tag = ckpt_io.read_latest(load_dir)
            if tag is None:
                if _rank() == 0:
                    logger.warning(
                        f"Unable to find latest file at {os.path.join(load_dir, ckpt_io.LATEST_FILE)}; "
                        "pass tag= to load a specific checkpoint. Nothing was loaded."
                    )
                return None
        ckpt_dir = os.path.join(load_dir, str(tag))
        if not os.path.isdir(ckpt_dir):
            if _rank() == 0:
                logger.warning(f"Checkpoint {ckpt_dir} does not exist; nothing was loaded")
            return None
        return ckpt_dir

    def _open_checkpoint(
        self, ckpt_dir: str, load_optim: bool, strict: bool, trust: bool
    ) -> ShardedCheckpoint:
        ckpt = ShardedCheckpoint.open(ckpt_dir, trust)
        shapes = {name: tuple(self._shard_state_of(p).shape) for name, p in self.module.named_parameters()}
        ckpt_io.check_against_model(ckpt, shapes, strict)
        self._check_buffers_fit(ckpt, strict)
        if load_optim:
            self._check_optimizer_fits(ckpt)
        return ckpt

    def _check_buffers_fit(self, ckpt: ShardedCheckpoint, strict: bool) -> None:
        saved = ckpt.engine_entry("buffers") or {}
        ours = dict(_persistent_buffers(self.module))
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

    def _master_names(self) -> dict:
        """id(master) -> parameter name, for the optimizer's fp32 masters."""
        masters = self.optimizer.masters
        ids = {name: self._shard_state_of(p).ds_id for name, p in self.module.named_parameters()}
        return {id(masters[i]): name for name, i in ids.items() if i in masters}

    def _check_optimizer_fits(self, ckpt: ShardedCheckpoint) -> None:
        where = ckpt.model_file(0)
        if not ckpt.has_optimizer:
            raise CheckpointError(
                f"{where}: saved without optimizer states (by an engine without an optimizer); pass "
                "load_optimizer_states=False to load only the weights"
            )
        names = self._master_names()
        for name in names.values():
            meta = ckpt.params.get(name)
            if meta is not None and not meta.has_master:
                raise CheckpointError(
                    f"{where}: parameter {name!r} was frozen when saved, so it has no optimizer state; pass "
                    "load_optimizer_states=False to load only the weights"
                )
        saved_groups = ckpt.optimizer_entry("param_groups")
        groups = self.optimizer.optimizer.param_groups
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
                    f"{ckpt.optim_file(0)}: parameters {ckpt_io._names(moved)} are in param group {i} of the "
                    "engine but in another group in the checkpoint"
                )

    def _apply_checkpoint(
        self, ckpt: ShardedCheckpoint, load_optim: bool, load_sched: bool, module_only: bool
    ) -> None:
        # What can still refuse its input (scheduler, loss scaler) goes first: nothing is changed yet.
        saved_scheduler = ckpt.engine_entry("lr_scheduler")
        if load_sched and self.lr_scheduler is not None and saved_scheduler is not None:
            self.lr_scheduler.load_state_dict(saved_scheduler)
        if load_optim:
            self.optimizer.loss_scaler.load_state_dict(ckpt.optimizer_entry("loss_scaler"))
            self.optimizer.overflow = bool(ckpt.optimizer_entry("overflow"))
            for saved, group in zip(
                ckpt.optimizer_entry("param_groups"), self.optimizer.optimizer.param_groups
            ):
                group.update({k: v for k, v in saved.items() if k != "params" and k not in _KERNEL_CHOICES})
        self._apply_weights(ckpt, load_optim)
        saved_buffers = ckpt.engine_entry("buffers") or {}
        with torch.no_grad():
            for name, buf in _persistent_buffers(self.module):
                if name in saved_buffers:
                    buf.copy_(saved_buffers[name])
        if not module_only:
            self.global_steps = ckpt.engine_entry("global_steps")
            self.global_samples = ckpt.engine_entry("global_samples")
            if self.optimizer is not None:  # the engine's skipped_steps is the optimizer's count
                self.optimizer.skipped_steps = int(ckpt.engine_entry("skipped_steps") or 0)
        if self.optimizer is not None:
            self.optimizer.zero_grad()  # gradients of the interrupted step are not in the checkpoint
        # With those gradients gone, the next micro-step starts an accumulation (as upstream,
        # which never restores the count): the saved count would put the boundary wherever the
        # old run was, or under another gradient_accumulation_steps, anywhere.
        self.micro_steps = 0

    @torch.no_grad()
    def _apply_weights(self, ckpt: ShardedCheckpoint, load_optim: bool) -> None:
        """Cut this rank's shard of every saved parameter (see [Note: elastic resharding])."""
        masters = self.optimizer.masters if self.optimizer is not None else {}
        group_of = {}
        if load_optim:
            for group in self.optimizer.optimizer.param_groups:
                group_of.update({id(p): group for p in group["params"]})
        for name, param in self.module.named_parameters():
            if name not in ckpt.params:
                continue  # load_module_strict=False: the model keeps its own values
            state = self._shard_state_of(param)
            weights = ckpt.resharded_weight(name, state.world_size, state.rank)
            master = masters.get(state.ds_id)
            if master is None:
                state.shard.copy_(weights)
                continue
            master.data.copy_(weights)
            copy_cast(state.shard, master.data)  # as the optimizer's write-back casts it
            self.optimizer.mark_master_current(state)  # an edit made before the load is gone
            if load_optim:
                saved = ckpt.resharded_optimizer_state(name, state.world_size, state.rank)
                group = group_of[id(master)]
                placed = {k: _place_state(k, v, master, group) for k, v in saved.items()}
                if placed:
                    self.optimizer.optimizer.state[master] = placed
                else:
                    self.optimizer.optimizer.state.pop(master, None)
        if not load_optim:
            return
        # The states were placed directly, past the optimizer's own load_state_dict, so what that
        # does last is done here: its __setstate__ puts the states in its own form (torch's Adam
        # turns an int `step`, as DeepSpeedCPUAdam saves it, into the tensor it steps with), and
        # one that lays out its state itself (DeepSpeedCPUAdam's huge pages) moves it there.
        inner = self.optimizer.optimizer
        inner.__setstate__({"state": inner.state, "param_groups": inner.param_groups})
        relayout = getattr(inner, "move_states_into_huge_pages", None)
        if relayout is not None:
            relayout()

    # ================================================================== 16-bit export

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `zero_optimization.stage3_gather_16bit_weights_on_model_save`."""
        return bool(self._config.zero_config.gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Optional[dict]:
        """The module's full state dict in the model dtype on rank 0 (None on other ranks).

        Every rank must call it. Parameters are gathered one module at a time, so no more than
        one module's parameters are whole at once; tied parameters share one tensor, and
        persistent buffers are included, in `module.state_dict()` order.
        """
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        rank0 = _rank() == 0
        out: Optional[OrderedDict] = OrderedDict() if rank0 else None
        seen: dict = {}  # id(param) -> the key it was stored under
        for prefix, module in self.module.named_modules(remove_duplicate=False):
            key = (prefix + ".") if prefix else ""
            own = [
                (key + n, p)
                for n, p in module._parameters.items()
                if p is not None and (p.requires_grad or not exclude_frozen_parameters)
            ]
            fresh = [p for _, p in own if id(p) not in seen]
            gathered = GatheredParameters(fresh).start()
            try:
                for full_name, p in own:
                    if id(p) in seen:
                        value = out[seen[id(p)]] if rank0 else None
                    else:
                        seen[id(p)] = full_name
                        value = p.data.detach().to("cpu", copy=True) if rank0 else None
                    if rank0:
                        out[full_name] = value
            finally:
                gathered.stop()
            if rank0:
                for n, buf in module._buffers.items():
                    if buf is not None and n not in module._non_persistent_buffers_set:
                        out[key + n] = buf.detach().to("cpu", copy=True)
        return out

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Gather the full weights in the model dtype and have rank 0 write them with `torch.save`.

        Every rank must call it. At stage 3 it returns False, writing nothing, when the config's
        `stage3_gather_16bit_weights_on_model_save` is off, as upstream does; at stages 0-2 the
        parameters are whole on every rank, so it always saves, as upstream does too.
        """
        path = os.path.join(save_dir, save_filename)
        if self.partitions_weights and not self.zero_gather_16bit_weights_on_model_save():
            log_dist(
                f"Did not save the model {path} because `stage3_gather_16bit_weights_on_model_save` is False",
                ranks=[0],
            )
            return False
        state_dict = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

        def write() -> None:
            if state_dict is not None:
                os.makedirs(save_dir, exist_ok=True)
                ckpt_io.atomic_torch_save(state_dict, path)

        _on_all_ranks("save_16bit_model", write)
        return True

    def save_fp16_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """The older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)
