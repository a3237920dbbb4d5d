"""Native ops and the optimizers built on them.

Submodules load on first attribute access (`deepspeed.ops.adam`), and nothing is compiled
until an op is used, so `import deepspeed.ops` stays light. `__compatible_ops__` (upstream's
name: op -> whether it can be built here) is computed on first access too.
"""

import importlib

__all__ = ["adam", "op_builder"]


def __getattr__(name):
    if name == "__compatible_ops__":
        value = importlib.import_module("deepspeed.git_version_info").compatible_ops
    elif name in __all__:
        value = importlib.import_module(f"deepspeed.ops.{name}")
    else:
        raise AttributeError(f"module 'deepspeed.ops' has no attribute {name!r}")
    globals()[name] = value
    return value
