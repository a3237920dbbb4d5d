"""The `cpu_adagrad` op, `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`: element-wise torch ops on state in CPU memory (upstream: C++).

Nothing is compiled: see torch_ops.py.
"""

from deepspeed.ops.op_builder.torch_ops import TorchOpBuilder


class CPUAdagradBuilder(TorchOpBuilder):
    NAME = "cpu_adagrad"
    MODULE = "deepspeed.ops.adagrad.cpu_adagrad"
