"""A clean-room, drop-in implementation of DeepSpeed's ZeRO package.

`import deepspeed` stays light: the engine, ZeRO and the comm layer are imported on first
use through module-level ``__getattr__`` (PEP 562), so clients that only probe the version
(HF transformers, accelerate, Lightning) pay nothing for them.
"""

import importlib

from deepspeed.version import __version__

__all__ = [
    "__version__",
    "initialize",
    "init_distributed",
    "DeepSpeedEngine",
    "DeepSpeedConfig",
    "zero",
    "comm",
    "accelerator",
    "utils",
    "runtime",
    "ops",
    "checkpoint",
]

# attribute name -> (module, attribute in that module or None for the module itself)
_LAZY = {
    "initialize": ("deepspeed.runtime.initialize", "initialize"),
    "init_distributed": ("deepspeed.comm", "init_distributed"),
    "DeepSpeedEngine": ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    "DeepSpeedConfig": ("deepspeed.runtime.config", "DeepSpeedConfig"),
    "zero": ("deepspeed.zero", None),
    "comm": ("deepspeed.comm", None),
    "accelerator": ("deepspeed.accelerator", None),
    "utils": ("deepspeed.utils", None),
    "runtime": ("deepspeed.runtime", None),
    "ops": ("deepspeed.ops", None),
    "checkpoint": ("deepspeed.checkpoint", None),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
