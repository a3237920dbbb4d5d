"""`deepspeed.utils.safe_get_*` / `safe_set_*`: read and write the optimizer's view of a parameter.

[Note: full and local]
Under ZeRO each rank keeps only its shard of a parameter's fp32 master, of its gradient and
of its optimizer states (see optimizer.py's master-shards note):
- *full* functions gather (or scatter) the whole tensor, shaped like the parameter. Getters
  are collectives over the parameter's group: call them on every rank, in the same order.
  Setters take the full value on every rank and keep this rank's slice (no communication,
  but call them on every rank so every shard changes).
- *local* functions act on this rank's shard only: a 1-D tensor of `partition_numel()`
  elements (padding included, as `param.ds_tensor`), never communicating.
Values are fp32. Gradients exist between `engine.backward()` and `engine.step()` (the
step consumes and frees them); they are returned unscaled (divided by the fp16 loss scale)
and, with gradient accumulation, hold the sum so far of the micro-steps' averaged
gradients; at stages 0-1, whose gradients are reduced only at the accumulation boundary,
`safe_get_full_grad` between micro-steps returns this rank's unreduced sum so far (as
upstream returns `param.grad`). Getters return None where nothing exists (a frozen
parameter, no gradient yet, an optimizer state not yet created); setters raise instead,
naming what is missing.
Setting a parameter's fp32 value also updates its training-dtype shard and, if the
parameter is currently gathered, its gathered tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch

from deepspeed import comm as dist
from deepspeed.runtime.base_optimizer import owner_of

__all__ = [
    "fragment_address",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_update_full_grad_vectorized",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]


@dataclasses.dataclass
class fragment_address:  # noqa: N801 - upstream's name, pickled in its files under this path
    """Where a parameter's slice lies in a flat partition (upstream's stage 0-2 optimizer files
    pickle one per parameter; its `zero_to_fp32.py` unpickles them by this path)."""

    numel: int
    start: int


def _owner(param: Any, action: str, required: bool) -> Optional[tuple]:
    found = owner_of(param)
    if found is None and required:
        raise ValueError(
            f"{action}: the parameter (shape {tuple(getattr(param, 'ds_shape', param.shape))}) has no fp32 master "
            "in any live DeepSpeed optimizer: it is frozen, in no optimizer param group, or its engine was "
            "built without an optimizer"
        )
    return found


def _in_memory(optimizer: Any) -> Any:
    """The optimizer's masters and state in host memory for the block: NVMe-swapped ones are
    read in, and written back after (a whole rank's state, so these calls are slow there)."""
    resident = getattr(optimizer, "resident", None)
    return resident() if resident is not None else contextlib.nullcontext()


def _detached(optimizer: Any, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`tensor` itself, or a copy where it is swapped out again after `_in_memory`'s block."""
    swapped = getattr(optimizer, "swapper", None) is not None
    return tensor.clone() if swapped and tensor is not None else tensor


def _gather_full(shard: torch.Tensor, state: Any) -> torch.Tensor:
    """The full tensor, shaped like the parameter, from every rank's 1-D padded `shard`."""
    world = getattr(state, "world_size", 1)
    shard = shard.detach().float()
    if world > 1:
        from deepspeed.accelerator import get_accelerator

        device = torch.device(get_accelerator().current_device_name())  # NCCL needs device tensors
        out = torch.empty(world * shard.numel(), dtype=torch.float32, device=device)
        dist.all_gather_into_tensor(out, shard.to(device).contiguous(), group=state.group)
        flat = out.to(shard.device)
    else:
        flat = shard.clone()
    return flat[: state.numel].view(state.shape)


def _own_slice(full: torch.Tensor, state: Any, action: str) -> torch.Tensor:
    """This rank's padded 1-D slice of `full` (a tensor with the parameter's number of elements)."""
    full = torch.as_tensor(full)
    if full.numel() != state.numel:
        raise ValueError(
            f"{action}: value has {full.numel()} elements (shape {tuple(full.shape)}); the parameter has "
            f"{state.numel} (shape {tuple(state.shape)})"
        )
    out = torch.zeros(state.partition_size, dtype=torch.float32)
    start = state.rank * state.partition_size
    end = min(start + state.partition_size, state.numel)
    if end > start:
        out[: end - start].copy_(full.detach().reshape(-1)[start:end].float())
    return out


def _check_local(value: torch.Tensor, state: Any, action: str) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.numel() != state.partition_size:
        raise ValueError(
            f"{action}: value has {value.numel()} elements; this rank's shard has {state.partition_size} "
            "(param.partition_numel(), padding included)"
        )
    return value.detach().reshape(-1).float()


# ============================================================================ fp32 parameters


def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's full fp32 master (collective; see the module note)."""
    found = _owner(param, "safe_get_full_fp32_param", required=False)
    if found is None:
        return None
    optimizer, state = found
    with _in_memory(optimizer):
        optimizer.refresh_edited_masters()  # edits written back through GatheredParameters
        return _gather_full(optimizer.masters[state.ds_id].data, state)


def safe_get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's shard of the fp32 master (1-D, padded)."""
    found = _owner(param, "safe_get_local_fp32_param", required=False)
    if found is None:
        return None
    optimizer, state = found
    with _in_memory(optimizer):
        optimizer.refresh_edited_masters()
        return _detached(optimizer, optimizer.masters[state.ds_id].data)


@torch.no_grad()
def _set_master(optimizer: Any, state: Any, local: torch.Tensor) -> None:
    from deepspeed.runtime.zero import gather

    with _in_memory(optimizer):
        optimizer.refresh_edited_masters()  # an older pending edit must not overwrite this value later
        master = optimizer.masters[state.ds_id]
        master.data.copy_(local.to(master.device))
        shard = state.shard
        if shard.data_ptr() != master.data_ptr():
            shard.copy_(master.data.to(shard.dtype))
        optimizer.mark_master_current(state)
    # A gathered copy (persistent parameter, live holder) must not keep the old value. The
    # status is the same on every rank, so every rank joins the same re-gathers.
    gather.refresh_gathered([state])


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master (and its training-dtype shard) from a full value."""
    optimizer, state = _owner(param, "safe_set_full_fp32_param", required=True)
    _set_master(optimizer, state, _own_slice(value, state, "safe_set_full_fp32_param"))


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's shard of the fp32 master (1-D, padded)."""
    optimizer, state = _owner(param, "safe_set_local_fp32_param", required=True)
    _set_master(optimizer, state, _check_local(value, state, "safe_set_local_fp32_param"))


# ============================================================================ gradients


def _local_grad(optimizer: Any, state: Any) -> Optional[torch.Tensor]:
    grad = optimizer.masters[state.ds_id].grad
    if grad is None:
        return None
    scale = float(getattr(optimizer, "loss_scale", 1.0) or 1.0)
    return grad.detach() / scale if scale != 1.0 else grad.detach()


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's full fp32 gradient, between backward and step (collective)."""
    found = owner_of(param)
    if found is None:
        grad = getattr(param, "grad", None)  # not ZeRO-managed: the plain gradient, as upstream
        return None if grad is None else grad.detach().float()
    optimizer, state = found
    # Stages 0-1 between the micro-steps of an accumulation: the gradient so far is still whole
    # (param.grad and, for bf16/fp16, its fp32 sum), not yet reduced; this rank's, as upstream
    # returns it (unscaled here).
    pending = _whole_grad(state) if _is_replicated(state) else None
    local = None if pending is not None else _local_grad(optimizer, state)
    # Every rank must join the gather, so where the gradient is is decided together: MAX of
    # (kind, -kind) gives the largest and smallest kind any rank has.
    kind = 2.0 if pending is not None else (0.0 if local is None else 1.0)
    kinds = torch.tensor([kind, -kind])
    if getattr(state, "world_size", 1) > 1:
        from deepspeed.accelerator import get_accelerator

        kinds = kinds.to(get_accelerator().current_device_name())
        dist.all_reduce(kinds, op=dist.ReduceOp.MAX, group=state.group)
    most, least = kinds[0].item(), -kinds[1].item()
    if most != least:
        raise RuntimeError(
            f"safe_get_full_grad: the ranks disagree on where this parameter's gradient is (kinds "
            f"{least:.0f}..{most:.0f}: 0 none, 1 reduced shard, 2 unreduced param.grad); a parameter "
            "used on some ranks only has no full gradient (see docs/engine.md)"
        )
    if most == 2.0:
        scale = float(getattr(optimizer, "loss_scale", 1.0) or 1.0)
        return pending.detach().float() / scale
    if most == 0.0:
        return None
    return _gather_full(local, state)


def _whole_grad(state: Any) -> Optional[torch.Tensor]:
    from deepspeed.runtime.zero.stage_1_and_2 import whole_grad

    return whole_grad(state)


def _is_replicated(state: Any) -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import ReplicatedShard

    return isinstance(state, ReplicatedShard)


def safe_get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's fp32 gradient shard (1-D, padded), between backward and step."""
    found = owner_of(param)
    if found is None:
        return None
    return _local_grad(*found)


def _set_grad(optimizer: Any, state: Any, local: torch.Tensor) -> None:
    master = optimizer.masters[state.ds_id]
    scale = float(getattr(optimizer, "loss_scale", 1.0) or 1.0)
    value = local.to(master.device) * scale  # stored scaled, as the reducer accumulates it
    if master.grad is None:
        master.grad = value
    else:
        master.grad.copy_(value)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the parameter's gradient (full value on every rank) before the step."""
    optimizer, state = _owner(param, "safe_set_full_grad", required=True)
    _set_grad(optimizer, state, _own_slice(value, state, "safe_set_full_grad"))


def safe_update_full_grad_vectorized(param_list: list, update_func: Any) -> None:
    """Replace each parameter's full gradient by `update_func(full gradient, param)`.

    Reads as `safe_get_full_grad` and writes back where that read: the reduced shards, or at
    stages 0-1 between the micro-steps of an accumulation the whole gradient so far. A
    collective: call it on every rank with the same list. Parameters without a gradient are
    skipped (upstream's name; the updates run one parameter after another).
    """
    for param in param_list:
        grad = safe_get_full_grad(param)
        if grad is None:
            continue
        value = update_func(grad, param)
        found = owner_of(param)
        if found is None:
            param.grad.copy_(value)  # not ZeRO-managed: its own gradient, as the getter read it
            continue
        optimizer, state = found
        if _is_replicated(state) and _whole_grad(state) is not None:
            _set_whole_grad(optimizer, state, value)
        else:
            _set_grad(optimizer, state, _own_slice(value, state, "safe_update_full_grad_vectorized"))


def _set_whole_grad(optimizer: Any, state: Any, value: torch.Tensor) -> None:
    """Stages 0-1 between micro-steps: the whole gradient so far becomes `value` (unscaled)."""
    scale = float(getattr(optimizer, "loss_scale", 1.0) or 1.0)
    scaled = value.detach().reshape(state.shape).to(torch.float32) * scale
    if state.param.dtype == torch.float32:
        state.param.grad, state.accumulated = scaled.to(state.param.device), None
    else:  # low-precision gradients accumulate in fp32 (stage_1_and_2.py's note)
        state.param.grad, state.accumulated = None, scaled.to(state.param.device)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's gradient shard (1-D, padded) before the step."""
    optimizer, state = _owner(param, "safe_set_local_grad", required=True)
    _set_grad(optimizer, state, _check_local(value, state, "safe_set_local_grad"))


# ============================================================================ optimizer states


def _opt_state(optimizer: Any, state: Any, key: str) -> Optional[torch.Tensor]:
    per_param = optimizer.optimizer.state.get(optimizer.masters[state.ds_id], {})
    value = per_param.get(key)
    return value if isinstance(value, torch.Tensor) and value.numel() == state.partition_size else None


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """The full tensor of optimizer state `optim_state_key` ("exp_avg", "exp_avg_sq", ...) (collective)."""
    found = _owner(param, "safe_get_full_optimizer_state", required=False)
    if found is None:
        return None
    optimizer, state = found
    with _in_memory(optimizer):
        local = _detached(optimizer, _opt_state(optimizer, state, optim_state_key))
    present = torch.tensor([0.0 if local is None else 1.0])
    if getattr(state, "world_size", 1) > 1:
        from deepspeed.accelerator import get_accelerator

        present = present.to(get_accelerator().current_device_name())
        dist.all_reduce(present, op=dist.ReduceOp.MIN, group=state.group)
    if present.item() == 0.0:
        return None
    return _gather_full(local, state)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's shard of optimizer state `optim_state_key` (1-D, padded)."""
    found = _owner(param, "safe_get_local_optimizer_state", required=False)
    if found is None:
        return None
    with _in_memory(found[0]):
        return _detached(found[0], _opt_state(*found, optim_state_key))


@torch.no_grad()
def _set_opt_state(optimizer: Any, state: Any, key: str, local: torch.Tensor, action: str) -> None:
    with _in_memory(optimizer):
        target = _opt_state(optimizer, state, key)
        if target is None:
            raise ValueError(
                f"{action}: the optimizer has no state {key!r} for this parameter yet; states are created by "
                "the first step (call it after a step, or load a checkpoint)"
            )
        target.copy_(local.to(target.device, target.dtype))


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set optimizer state `optim_state_key` from a full value (on every rank)."""
    action = "safe_set_full_optimizer_state"
    optimizer, state = _owner(param, action, required=True)
    _set_opt_state(optimizer, state, optim_state_key, _own_slice(value, state, action), action)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's shard (1-D, padded) of optimizer state `optim_state_key`."""
    action = "safe_set_local_optimizer_state"
    optimizer, state = _owner(param, action, required=True)
    _set_opt_state(optimizer, state, optim_state_key, _check_local(value, state, action), action)
