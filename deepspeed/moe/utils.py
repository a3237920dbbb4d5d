"""Parameter-group helpers for models with `deepspeed.moe.layer.MoE` layers (upstream's names).

An expert's parameters carry upstream's marks, `allreduce = False` and `group_name` (the
expert-parallel group, "ep_size_1" here), set by `Experts`. Upstream's MoE tutorial builds
its optimizer with `split_params_into_different_moe_groups_for_optimizer`, which moves them
into groups of their own (`"moe": True`, `"name"`: the group name), each keeping the
hyperparameters of the group it came from. With `ep_size=1` every rank holds every expert,
so the engine treats those groups like any other; they exist so the tutorial's code runs.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

_DEFAULT_MAX_GROUP_SIZE = 178956971  # upstream's default cap on a MoE group's elements


def has_moe_layers(m: nn.Module) -> tuple:
    """`(whether `m` holds a MoE layer, the number of experts of the first one)`, as upstream."""
    from deepspeed.moe.layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` is an expert's parameter (upstream's mark: `allreduce` is False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: list) -> tuple:
    """`(shared parameters, expert parameters)` of `params`, in order."""
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group: list) -> tuple:
    """`(shared gradients, expert gradients)` of the parameters in `group` that have one."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad)
    return shared, expert


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: Union[dict, tuple, list],
    max_group_size: Optional[Union[int, float]] = _DEFAULT_MAX_GROUP_SIZE,
) -> list:
    """Param groups with each group's expert parameters moved into groups of their own.

    `param_groups` is one group (a dict), or a list or tuple of them, each with `"params"`
    (and, as upstream's tutorial writes it, a `"name"`). Every expert parameter moves to a new
    group per (source group, expert group name), a copy of its source group's settings with
    `"moe": True` and `"name"` the expert group's; the source groups keep the rest. With
    `max_group_size` (elements; None: no cap) a new group is split where it would exceed it.
    The given dicts are updated in place (their `"params"` lose the experts), as upstream.
    """
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(
            f"split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict or a list or "
            f"tuple of dicts, got {type(param_groups).__name__}"
        )
    moe_groups: list = []
    for group in groups:
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(
                "split_params_into_different_moe_groups_for_optimizer: every param group must be a dict with "
                f"'params', got {group!r:.80}"
            )
        params = list(group["params"])
        by_name: dict = {}  # expert group name -> its parameters, in order
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name, experts in by_name.items():
            for chunk in _chunks(experts, max_group_size):
                moe_groups.append({**group, "name": name, "moe": True, "params": chunk})
    return groups + moe_groups


def _chunks(params: list, max_elements: Optional[Union[int, float]]) -> list:
    if max_elements is None:
        return [params]
    chunks, current, size = [], [], 0
    for p in params:
        numel = getattr(p, "ds_numel", None) or p.numel()
        if current and size + numel > max_elements:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += numel
    if current:
        chunks.append(current)
    return chunks


def configure_moe_param_groups(model_parameters: Any) -> Any:
    """`model_parameters` (parameters or param groups) with expert parameters in their own groups."""
    params = list(model_parameters)
    if not params or isinstance(params[0], dict):
        return split_params_into_different_moe_groups_for_optimizer(params)
    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})
