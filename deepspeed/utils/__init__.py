"""Utilities: the package logger, process groups, checkpoint conversion, ZeRO-3 helpers.

`groups` sits above the comm layer while `logging` sits below it, so everything but the
logger is imported lazily here, which keeps `deepspeed.comm` -> `deepspeed.utils.logging`
free of a cycle and `import deepspeed.utils` light.
"""

import importlib
import importlib.util

from deepspeed.utils.logging import log_dist, logger

_LEAF = "deepspeed.utils.z3_leaf_module"
_FRAGMENT = "deepspeed.utils.tensor_fragment"

# public name -> the module that defines it
_LAZY = {
    "is_initialized": "deepspeed.comm",
    "set_z3_leaf_modules": _LEAF,
    "unset_z3_leaf_modules": _LEAF,
    "get_z3_leaf_modules": _LEAF,
    "z3_leaf_module": _LEAF,
    "z3_leaf_parameter": _LEAF,
    "set_z3_leaf_module": _LEAF,
    **{
        f"safe_{verb}_{scope}_{what}": _FRAGMENT
        for verb in ("get", "set")
        for scope in ("full", "local")
        for what in ("fp32_param", "grad", "optimizer_state")
    },
}

__all__ = ["groups", "log_dist", "logger", "zero_to_fp32", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'deepspeed.utils' has no attribute {name!r}")
    globals()[name] = value
    return value
