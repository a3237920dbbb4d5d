"""Builders for the ops that are plain torch here, with nothing to compile.

Upstream compiles a native kernel for each of these (`fused_adam`, `fused_lion`: CUDA;
`cpu_adagrad`, `cpu_lion`: C++), and callers ask `deepspeed.ops.__compatible_ops__[NAME]`
(or the builder) before choosing one. Here their classes are written in torch ops that run on
any device, so each op is always compatible and always built, and `load()` returns the Python
module that holds its classes.
"""

import importlib
from types import ModuleType

from deepspeed.ops.op_builder.builder import OpBuilder


class TorchOpBuilder(OpBuilder):
    """An op written in torch: `MODULE` holds its classes; there is nothing to compile."""

    MODULE: str = ""

    def absolute_name(self) -> str:
        return self.MODULE

    def sources(self) -> list[str]:
        return []

    def incompatibility_reasons(self) -> list[str]:
        return []

    def is_built(self) -> bool:
        return True

    def load(self, verbose: bool = False) -> ModuleType:
        return importlib.import_module(self.MODULE)
