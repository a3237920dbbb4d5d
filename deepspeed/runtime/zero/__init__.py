"""ZeRO stage 3: partitioned parameters, Init, GatheredParameters, and the stage-3 optimizer.

Kept empty of imports so that light submodules (``zero.config``) import without the heavy
ones; the public names (`deepspeed.runtime.zero.GatheredParameters`, ...) and submodules
resolve on first attribute access.
"""

import types as _types

from deepspeed import _lazy_attributes

_PUBLIC = {  # name -> the module that defines it
    "Init": "deepspeed.runtime.zero.partition_parameters",
    "MiCS_Init": "deepspeed.runtime.zero.mics",
    "GatheredParameters": "deepspeed.runtime.zero.partition_parameters",
    "register_external_parameter": "deepspeed.runtime.zero.partition_parameters",
    "unregister_external_parameter": "deepspeed.runtime.zero.partition_parameters",
    "ZeroParamStatus": "deepspeed.runtime.zero.lifecycle",
    "ZeroParamType": "deepspeed.runtime.zero.lifecycle",
    "unwrap_model_for_generation": "deepspeed.runtime.zero.stage3",
    "TiledLinear": "deepspeed.runtime.zero.tiling",
    "TiledLinearReturnBias": "deepspeed.runtime.zero.tiling",
}
_PUBLIC = _types.MappingProxyType(_PUBLIC)  # read-only from here on


__getattr__ = _lazy_attributes(
    __name__, globals(), {name: (module, name) for name, module in _PUBLIC.items()}
)
