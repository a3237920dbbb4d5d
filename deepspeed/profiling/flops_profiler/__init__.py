"""The FLOPs profiler: `FlopsProfiler`, `get_model_profile` and the number formatting helpers
(upstream's import path; see profiler.py)."""

from deepspeed.profiling.flops_profiler.formatting import (
    DEFAULT_PRECISION,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from deepspeed.profiling.flops_profiler.profiler import (
    FlopsProfiler,
    get_model_profile,
    get_module_duration,
    get_module_flops,
    get_module_macs,
)

__all__ = [
    "DEFAULT_PRECISION",
    "FlopsProfiler",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "get_module_duration",
    "get_module_flops",
    "get_module_macs",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
