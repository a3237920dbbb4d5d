"""Parameters a module's forward uses that another module owns (upstream's
`register_external_parameter`): the engine gathers them around that module's forward and
backward too (hooks.py). Registrations live in the module's `__dict__` (`_external_params`,
by `ds_id`) and, on the parameter's state, as `external_owners`.
"""

from __future__ import annotations

import torch
from torch import nn

from deepspeed.runtime.zero.parameter import is_zero_param


def register_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """Tell the engine that `module`'s forward uses `parameter`, owned by another module.

    The engine then gathers it around `module`'s forward and backward. A parameter that is
    not partitioned (not ZeRO-3) needs nothing and is accepted as a no-op.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}"
        )
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            f"register_external_parameter: parameter must be an nn.Parameter, got {type(parameter).__name__}"
        )
    if not is_zero_param(parameter):
        return
    external = module.__dict__.setdefault("_external_params", {})
    external[parameter.ds_id] = parameter
    owners = parameter._zero_state.external_owners
    if not any(m is module for m in owners):
        owners.append(module)


def unregister_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    external = module.__dict__.get("_external_params", {})
    if not is_zero_param(parameter) or parameter.ds_id not in external:
        raise ValueError(
            f"unregister_external_parameter: {parameter!r} is not registered with {type(module).__name__}"
        )
    del external[parameter.ds_id]
    owners = parameter._zero_state.external_owners
    owners[:] = [m for m in owners if m is not module]


def external_parameters(module: nn.Module) -> list:
    return list(module.__dict__.get("_external_params", {}).values())


def named_external_parameters(module: nn.Module) -> list:
    """`module.ds_external_parameters()`, upstream's name: (key, parameter) pairs, the way
    `named_parameters` yields them, so callers (TRL) can chain the two."""
    return [(str(key), param) for key, param in module.__dict__.get("_external_params", {}).items()]
