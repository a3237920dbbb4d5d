"""`deepspeed.zero`: the public ZeRO-3 API (`Init`, `GatheredParameters`, external parameters)."""

from deepspeed.runtime.zero.lifecycle import live_contexts
from deepspeed.runtime.zero.param_state import ZeroParamStatus
from deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "live_contexts",
    "register_external_parameter",
    "unregister_external_parameter",
]
