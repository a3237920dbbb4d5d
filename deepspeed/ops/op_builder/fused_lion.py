"""The `fused_lion` op, `deepspeed.ops.lion.FusedLion`: element-wise torch ops on the parameters' device (upstream: a CUDA kernel).

Nothing is compiled: see torch_ops.py.
"""

from deepspeed.ops.op_builder.torch_ops import TorchOpBuilder


class FusedLionBuilder(TorchOpBuilder):
    NAME = "fused_lion"
    MODULE = "deepspeed.ops.lion.lion"
