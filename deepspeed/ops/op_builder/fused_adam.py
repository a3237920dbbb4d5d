"""The `fused_adam` op: `deepspeed.ops.adam.FusedAdam`, which here needs nothing built.

Upstream compiles a multi-tensor CUDA kernel for it, and callers ask
`deepspeed.ops.__compatible_ops__["fused_adam"]` (or this builder) before choosing it. Here
`FusedAdam` runs torch's multi-tensor `_foreach_*` ops on any device, so the op is always
compatible and always built, and `load()` returns its Python module.
"""

import importlib
from types import ModuleType

from deepspeed.ops.op_builder.builder import OpBuilder


class FusedAdamBuilder(OpBuilder):
    """The `fused_adam` op; pure torch, so there is nothing to compile."""

    NAME = "fused_adam"

    def absolute_name(self) -> str:
        return "deepspeed.ops.adam.fused_adam"

    def sources(self) -> list[str]:
        return []

    def incompatibility_reasons(self) -> list[str]:
        return []

    def is_built(self) -> bool:
        return True

    def load(self, verbose: bool = False) -> ModuleType:
        return importlib.import_module(self.absolute_name())
