"""ZeRO stage 3: partitioned parameters, Init, GatheredParameters, and the stage-3 optimizer.

Kept empty of imports so that light submodules (``zero.config``) import without the heavy
ones; the public names (`deepspeed.runtime.zero.GatheredParameters`, ...) and submodules
resolve on first attribute access.
"""

import importlib
import importlib.util

_PUBLIC = {
    "Init": "deepspeed.runtime.zero.partition_parameters",
    "GatheredParameters": "deepspeed.runtime.zero.partition_parameters",
    "register_external_parameter": "deepspeed.runtime.zero.partition_parameters",
    "unregister_external_parameter": "deepspeed.runtime.zero.partition_parameters",
    "ZeroParamStatus": "deepspeed.runtime.zero.param_state",
}


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
