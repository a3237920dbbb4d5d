"""Native ops and the optimizers built on them.

Submodules load on first attribute access (`deepspeed.ops.adam`), and nothing is compiled
until an op is used, so `import deepspeed.ops` stays light. `__compatible_ops__` (upstream's
name: op -> whether it can be built here) is computed on first access too.
"""

from deepspeed import _lazy_attributes

__all__ = ["adagrad", "adam", "lion", "op_builder"]


__getattr__ = _lazy_attributes(
    __name__, globals(), {"__compatible_ops__": ("deepspeed.git_version_info", "compatible_ops")}
)
