"""`deepspeed.zero`: the public ZeRO-3 API (`Init`, `GatheredParameters`, external parameters, `TiledLinear`)."""

from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from deepspeed.runtime.zero.mics import MiCS_Init
from deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)
from deepspeed.runtime.zero.start_stop import live_contexts
from deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "TiledLinear",
    "TiledLinearReturnBias",
    "ZeroParamStatus",
    "live_contexts",
    "register_external_parameter",
    "unregister_external_parameter",
]
