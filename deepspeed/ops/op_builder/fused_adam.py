"""The `fused_adam` op, `deepspeed.ops.adam.FusedAdam`: torch's multi-tensor `_foreach_*` ops on any device (upstream: a CUDA kernel).

Nothing is compiled: see torch_ops.py.
"""

from deepspeed.ops.op_builder.torch_ops import TorchOpBuilder


class FusedAdamBuilder(TorchOpBuilder):
    NAME = "fused_adam"
    MODULE = "deepspeed.ops.adam.fused_adam"
