"""Block-wise int8 quantization into one payload per row, and back (ZeRO++ qwZ and qgZ).

[Note: the int8 payload]
A row of `n` values is cut into `nb = ceil(n / BLOCK)` blocks of `BLOCK` (256), the last one
zero-padded; each block gets one fp32 scale `max|block| / QMAX` and int8 codes
`round(x / scale)` in [-127, 127] (an all-zero block: scale 0, codes 0). A payload row is the
`nb * BLOCK` codes followed by the `nb` scales' bytes: `payload_bytes(n)` int8 elements. The
error bound and how qwZ and qgZ use it are in runtime/zero/quantized.py's note.

[Note: native kernel or torch]
`pack_rows`, `unpack_rows` and `unpack_sum` run the `quantizer` native op
(csrc/quantizer/, one pass per call: quantize straight into the payload, dequantize straight
into the destination, or dequantize and sum the rows without materialising them) on CPU
tensors, and the torch functions below (`*_torch`) on any other device, or where the op
cannot be built (one warning). The two agree bit for bit on finite data, every instruction
set included (tests/unit/test_quantizer_kernel.py): each float operation is the same IEEE
operation in the same order (csrc/quantizer/quant_kernel.h says which), and `unpack_sum`
adds the rows in row order on both paths.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from deepspeed.ops.op_builder import ALL_OPS

BLOCK = 256  # elements per scale (DS_QBLOCK in csrc/quantizer/quant_kernels.h)
QMAX = 127


def blocks_of(numel: int, block: int = BLOCK) -> int:
    return -(-numel // block)


def payload_bytes(numel: int, block: int = BLOCK) -> int:
    """Bytes of the int8 payload (codes and fp32 scales) for `numel` elements."""
    nb = blocks_of(numel, block)
    return nb * block + 4 * nb


def native() -> Optional[ModuleType]:
    """The loaded `quantizer` op, or None where it cannot be built (warned once)."""
    return ALL_OPS["quantizer"].try_load()


def _on_cpu(t: torch.Tensor) -> Optional[ModuleType]:
    return native() if t.device.type == "cpu" else None


# ---- the torch path (any device) -----------------------------------------------------------


def quantize_rows(x: torch.Tensor, block: int = BLOCK) -> tuple:
    """`x` `[rows, n]` -> `(codes int8 [rows, nb * block], scales fp32 [rows, nb])`."""
    rows, n = x.shape
    nb = blocks_of(n, block)
    padded = torch.zeros(rows, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :n] = x
    blocks = padded.view(rows, nb, block)
    scales = blocks.abs().amax(dim=2) / QMAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe.unsqueeze(2)).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes.view(rows, nb * block), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """`(codes [rows, nb * block], scales [rows, nb])` -> fp32 `[rows, n]`."""
    rows, nb = scales.shape
    values = codes.reshape(rows, nb, -1).to(torch.float32) * scales.unsqueeze(2)
    return values.view(rows, -1)[:, :n]


def _split(payload: torch.Tensor) -> tuple:
    """A payload `[rows, width]` -> its `(codes, scales)`."""
    rows, width = payload.shape
    nb = width // (BLOCK + 4)
    return payload[:, : nb * BLOCK], payload[:, nb * BLOCK :].contiguous().view(torch.float32)


def pack_rows_torch(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_rows(x)
    return torch.cat([codes, scales.contiguous().view(torch.int8)], dim=1)


def unpack_rows_torch(payload: torch.Tensor, n: int) -> torch.Tensor:
    return dequantize_rows(*_split(payload), n)


def unpack_sum_torch(payload: torch.Tensor, n: int) -> torch.Tensor:
    values = unpack_rows_torch(payload, n)
    total = values[0].clone()
    for row in values[1:]:  # row order, as the kernel adds them
        total += row
    return total


# ---- dispatch ------------------------------------------------------------------------------


def pack_rows(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x` `[rows, n]` (any float dtype) -> the int8 payload `[rows, payload_bytes(n)]`, into
    `out` when given (rows of it may be strided, e.g. a slice of a larger payload)."""
    op = _on_cpu(x)
    if op is None:
        payload = pack_rows_torch(x)
        return payload if out is None else out.copy_(payload)
    if out is None:
        out = torch.empty(x.shape[0], payload_bytes(x.shape[1]), dtype=torch.int8)
    src = x if x.dtype == torch.float32 else x.float()
    op.quantize_into(src if src.stride(-1) == 1 else src.contiguous(), out)
    return out


def unpack_rows(payload: torch.Tensor, n: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A payload `[rows, width]` -> its values `[rows, n]`, fp32, or into `out` (any float dtype)."""
    op = _on_cpu(payload)
    if op is None:
        values = unpack_rows_torch(payload, n)
        return values if out is None else out.copy_(values)
    if out is not None and out.dtype == torch.float32 and out.stride(-1) == 1:
        op.dequantize_into(payload, out)
        return out
    values = torch.empty(payload.shape[0], n, dtype=torch.float32)
    op.dequantize_into(payload, values)
    return values if out is None else out.copy_(values)


def unpack_sum(payload: torch.Tensor, n: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A payload `[rows, width]` -> `[n]`: its rows' values summed in row order, in fp32 (then
    into `out`, any float dtype, when given)."""
    op = _on_cpu(payload)
    if op is None:
        total = unpack_sum_torch(payload, n)
        return total if out is None else out.copy_(total)
    if out is not None and out.dtype == torch.float32 and out.is_contiguous():
        op.dequantize_sum_into(payload, out)
        return out
    total = torch.empty(n, dtype=torch.float32)
    op.dequantize_sum_into(payload, total)
    return total if out is None else out.copy_(total)
