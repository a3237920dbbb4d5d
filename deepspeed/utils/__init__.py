"""Utilities: the package logger, process groups, checkpoint conversion, ZeRO-3 helpers.

`groups` sits above the comm layer while `logging` sits below it, so everything but the
logger is imported lazily here, which keeps `deepspeed.comm` -> `deepspeed.utils.logging`
free of a cycle and `import deepspeed.utils` light.
"""

import types as _types

from deepspeed import _lazy_attributes
from deepspeed.utils.logging import get_log_level_from_string, log_dist, logger, set_log_level_from_string

# Imported eagerly (the module imports nothing heavy): the function `z3_leaf_module` shares its
# module's name, and importing the submodule binds that name in this package to the module,
# which a lazy attribute would never replace (upstream imports them eagerly too).
from deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

_FRAGMENT = "deepspeed.utils.tensor_fragment"

# public name -> the module that defines it
_LAZY = {
    "is_initialized": "deepspeed.comm",
    "RepeatingLoader": "deepspeed.runtime.dataloader",
    "OnDevice": "deepspeed.utils.init_on_device",
    "safe_update_full_grad_vectorized": _FRAGMENT,
    **{
        f"safe_{verb}_{scope}_{what}": _FRAGMENT
        for verb in ("get", "set")
        for scope in ("full", "local")
        for what in ("fp32_param", "grad", "optimizer_state")
    },
}
_LAZY = _types.MappingProxyType(_LAZY)  # read-only from here on

__all__ = [
    "groups",
    "get_log_level_from_string",
    "log_dist",
    "logger",
    "set_log_level_from_string",
    "zero_to_fp32",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    *_LAZY,
]


__getattr__ = _lazy_attributes(__name__, globals(), {name: (module, name) for name, module in _LAZY.items()})
