"""Block-wise int8 quantization (ZeRO++ qwZ and qgZ): a native CPU kernel with a torch fallback.
Importing compiles nothing; the first quantization of a CPU tensor does."""

from deepspeed.ops.quantizer.int8 import (
    BLOCK,
    QMAX,
    blocks_of,
    dequantize_rows,
    native,
    pack_rows,
    payload_bytes,
    quantize_rows,
    unpack_rows,
    unpack_sum,
)

__all__ = [
    "BLOCK",
    "QMAX",
    "blocks_of",
    "dequantize_rows",
    "native",
    "pack_rows",
    "payload_bytes",
    "quantize_rows",
    "unpack_rows",
    "unpack_sum",
]
