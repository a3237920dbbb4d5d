"""Builder for the fused block-wise int8 quantizer (`csrc/quantizer/`, ZeRO++ qwZ and qgZ).

One library holds every vector path (AVX-512, AVX2, NEON, scalar): the same loops compiled
per instruction set with a target pragma; the widest one the CPU supports runs
(``DS_QUANTIZER_ISA`` overrides, ``set_isa`` switches). deepspeed/ops/quantizer/int8.py
calls it on CPU tensors and falls back to torch, with equal results, when it cannot load.
"""

from deepspeed.ops.op_builder.builder import OpBuilder


class QuantizerBuilder(OpBuilder):
    """The `quantizer` op: `quantize_into`, `dequantize_into`, `dequantize_sum_into`."""

    NAME = "quantizer"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.quantizer.{self.NAME}_op"

    def sources(self) -> list[str]:
        return [
            "quantizer/quantizer.cpp",
            "quantizer/quant_avx512.cpp",
            "quantizer/quant_avx2.cpp",
            "quantizer/quant_neon.cpp",
            "quantizer/quant_scalar.cpp",
        ]

    def headers(self) -> list[str]:
        return ["quantizer/quant_kernels.h", "quantizer/quant_kernel.h", "common/isa_registry.h"]
