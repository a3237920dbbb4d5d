"""The `cpu_lion` op, `deepspeed.ops.lion.DeepSpeedCPULion`: the same element-wise torch ops on state in CPU memory (upstream: C++).

Nothing is compiled: see torch_ops.py.
"""

from deepspeed.ops.op_builder.torch_ops import TorchOpBuilder


class CPULionBuilder(TorchOpBuilder):
    NAME = "cpu_lion"
    MODULE = "deepspeed.ops.lion.lion"
