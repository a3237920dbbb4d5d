"""Builder for the fused CPU Adam/AdamW kernel (`csrc/adam/cpu_adam.cpp`)."""

from deepspeed.ops.op_builder.builder import OpBuilder


class CPUAdamBuilder(OpBuilder):
    """The `cpu_adam` op: `adam_update` and `adam_update_copy` on fp32 CPU tensors."""

    NAME = "cpu_adam"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def sources(self) -> list[str]:
        return ["adam/cpu_adam.cpp"]
