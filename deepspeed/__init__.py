"""A clean-room, drop-in implementation of DeepSpeed's ZeRO package.

`import deepspeed` stays light: the engine, ZeRO and the comm layer are imported on first
use through module-level ``__getattr__`` (PEP 562), so clients that only probe the version
(HF transformers, accelerate, Lightning) pay nothing for them. Every subpackage resolves the
same way (`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` works after a bare
`import deepspeed`): a name a client reaches must not depend on what else was imported.
"""

import importlib
import importlib.util
import types as _types
from typing import Optional

from deepspeed.version import __version__, __version_major__, __version_minor__, __version_patch__

__all__ = [
    "__version__",
    "__version_major__",
    "__version_minor__",
    "__version_patch__",
    "initialize",
    "init_distributed",
    "init_inference",
    "tp_model_init",
    "add_config_arguments",
    "DeepSpeedEngine",
    "DeepSpeedConfig",
    "DeepSpeedOptimizer",
    "zero",
    "comm",
    "accelerator",
    "get_accelerator",
    "utils",
    "runtime",
    "ops",
    "checkpoint",
    "checkpointing",
    "launcher",
    "pipe",
    "moe",
    "git_version_info",
    "DeepSpeedConfigError",
    "DeepSpeedDataLoader",
    "PipelineModule",
    "PipelineEngine",
    "logger",
    "log_dist",
    "OnDevice",
    "git_hash",
    "git_branch",
]

# attribute name -> (module, attribute in that module or None for the module itself)
_LAZY = {
    "initialize": ("deepspeed.runtime.initialize", "initialize"),
    "init_distributed": ("deepspeed.comm", "init_distributed"),
    "init_inference": ("deepspeed.runtime.not_provided", "init_inference"),
    "tp_model_init": ("deepspeed.runtime.not_provided", "tp_model_init"),
    "add_config_arguments": ("deepspeed.runtime.arguments", "add_config_arguments"),
    "DeepSpeedEngine": ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    "DeepSpeedConfig": ("deepspeed.runtime.config", "DeepSpeedConfig"),
    "DeepSpeedOptimizer": ("deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer"),
    "get_accelerator": ("deepspeed.accelerator", "get_accelerator"),  # upstream exports it here too
    # Upstream's alias for the activation-checkpointing API.
    "checkpointing": ("deepspeed.runtime.activation_checkpointing.checkpointing", None),
    # Other names upstream's package exports at the top level, which user scripts reach there.
    "DeepSpeedConfigError": ("deepspeed.runtime.config", "DeepSpeedConfigError"),
    "DeepSpeedDataLoader": ("deepspeed.runtime.dataloader", "DeepSpeedDataLoader"),
    "PipelineModule": ("deepspeed.pipe", "PipelineModule"),
    "PipelineEngine": ("deepspeed.runtime.pipe.engine", "PipelineEngine"),
    "logger": ("deepspeed.utils", "logger"),
    "log_dist": ("deepspeed.utils", "log_dist"),
    "OnDevice": ("deepspeed.utils.init_on_device", "OnDevice"),
    "git_hash": ("deepspeed.git_version_info", "git_hash"),
    "git_branch": ("deepspeed.git_version_info", "git_branch"),
    "__git_hash__": ("deepspeed.git_version_info", "git_hash"),
    "__git_branch__": ("deepspeed.git_version_info", "git_branch"),
}
_LAZY = _types.MappingProxyType(_LAZY)  # read-only from here on


def _lazy_attributes(package: str, namespace: dict, names: Optional[dict] = None):
    """A package's `__getattr__`: listed names and submodules import on first access.

    [Note: lazy package attributes]
    `import deepspeed` stays light (it loads only `deepspeed` and `deepspeed.version`), yet
    clients reach names through attribute chains after a bare import
    (`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`). Every package of ours builds its
    `__getattr__` here: a name in `names` (attribute -> (module, attribute in it, or None for
    the module itself)) imports from its module; any other non-dunder name that is a
    submodule imports as one; the result is cached in the package's namespace.
    """
    names = names or {}

    def __getattr__(name):
        if name in names:
            module_name, attr = names[name]
            module = importlib.import_module(module_name)
            value = module if attr is None else getattr(module, attr)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")  # a subpackage or submodule
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return __getattr__


__getattr__ = _lazy_attributes(__name__, globals(), _LAZY)


def __dir__():
    return sorted(set(globals()) | set(__all__))
