"""Native op builders. `ALL_OPS` maps an op's name to its shared builder instance.

Importing this package compiles nothing; `ALL_OPS[name].load()` builds on first use. The
ops written in torch (torch_ops.py) have nothing to build.
"""

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
from deepspeed.ops.op_builder.builder import OpBuilder
from deepspeed.ops.op_builder.cpu_adagrad import CPUAdagradBuilder
from deepspeed.ops.op_builder.cpu_adam import CPUAdamBuilder
from deepspeed.ops.op_builder.cpu_lion import CPULionBuilder
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder
from deepspeed.ops.op_builder.fused_lion import FusedLionBuilder
from deepspeed.ops.op_builder.quantizer import QuantizerBuilder
from deepspeed.ops.op_builder.shm_copy import ShmCopyBuilder

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "FusedAdamBuilder",
    "FusedLionBuilder",
    "OpBuilder",
    "QuantizerBuilder",
    "ShmCopyBuilder",
]

ALL_OPS: dict[str, OpBuilder] = {
    builder.NAME: builder
    for builder in (
        AsyncIOBuilder(),
        CPUAdagradBuilder(),
        CPUAdamBuilder(),
        CPULionBuilder(),
        FusedAdamBuilder(),
        FusedLionBuilder(),
        QuantizerBuilder(),
        ShmCopyBuilder(),
    )
}
