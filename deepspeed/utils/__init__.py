"""Utilities: the package logger, process groups and checkpoint conversion.

`groups` sits above the comm layer while `logging` sits below it, so `groups` is imported
lazily here to keep `deepspeed.comm` -> `deepspeed.utils.logging` free of a cycle.
"""

import importlib

from deepspeed.utils.logging import log_dist, logger

__all__ = ["groups", "log_dist", "logger", "zero_to_fp32"]


def __getattr__(name):
    if name in ("groups", "zero_to_fp32"):
        module = importlib.import_module(f"deepspeed.utils.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'deepspeed.utils' has no attribute {name!r}")
