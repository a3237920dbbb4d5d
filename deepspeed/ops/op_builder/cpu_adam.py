"""Builder for the fused CPU Adam/AdamW kernel (`csrc/adam/`).

One library holds every vector path (AVX-512, AVX2, NEON, scalar), each compiled for its
own instruction set with a per-function target attribute; the library picks the widest one
the CPU supports when it loads (``DS_CPU_ADAM_ISA`` overrides, ``set_isa`` switches). On
Intel CPUs the loop starts out prefetching 512 elements ahead in software, elsewhere not
(``prefetch``/``set_prefetch`` read and change the distance; see csrc/adam/adam_kernel.h
for why); ``DeepSpeedCPUAdam`` then times both on its first large steps and keeps the faster
(``deepspeed/ops/adam/cpu_adam.py``, ``DS_CPU_ADAM_PREFETCH`` fixes it).
"""

from deepspeed.ops.op_builder.builder import OpBuilder


class CPUAdamBuilder(OpBuilder):
    """The `cpu_adam` op: `adam_step` (a whole param group per call) and friends."""

    NAME = "cpu_adam"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def sources(self) -> list[str]:
        return [
            "adam/cpu_adam.cpp",
            "adam/adam_avx512.cpp",
            "adam/adam_avx2.cpp",
            "adam/adam_neon.cpp",
            "adam/adam_scalar.cpp",
        ]

    def headers(self) -> list[str]:
        return ["adam/adam_span.h", "adam/adam_kernel.h", "common/isa_registry.h"]
