"""Native ops and the optimizers built on them.

Submodules load on first attribute access (`deepspeed.ops.adam`), and nothing is compiled
until an op is used, so `import deepspeed.ops` stays light.
"""

import importlib

__all__ = ["adam", "op_builder"]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module 'deepspeed.ops' has no attribute {name!r}")
    module = importlib.import_module(f"deepspeed.ops.{name}")
    globals()[name] = module
    return module
