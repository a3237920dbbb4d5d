"""The native block-wise int8 quantizer (csrc/quantizer/) against its torch fallback.

deepspeed/ops/quantizer/int8.py promises the two agree bit for bit on finite data, on every
instruction set the CPU has ([Note: native kernel or torch]); these tests hold it to that on
random data of very different magnitudes, zeros, the largest and smallest (subnormal) floats,
lengths that are not multiples of 256, and payload rows with a stride. Without a compiler
the op cannot load and the library runs the torch path everywhere; the kernel cases skip.
"""

from __future__ import annotations

import pytest
import torch

from deepspeed.ops.op_builder import ALL_OPS
from deepspeed.ops.quantizer import int8

FMAX = torch.finfo(torch.float32).max
TINY = torch.finfo(torch.float32).smallest_normal


def _op():
    op = int8.native()
    if op is None:
        pytest.skip("the quantizer op cannot be built here (the torch path is what runs)")
    return op


def _cases() -> list:
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows, n in [(1, 1), (3, 255), (4, 256), (2, 257), (5, 1000), (2, 70_001)]:
        spread = torch.logspace(-30, 30, n)[torch.randperm(n, generator=gen)]
        out.append(torch.randn(rows, n, generator=gen) * spread)
    x = torch.zeros(3, 700)  # an all-zero row; blocks of zeros, of subnormals, of the extremes
    x[1, 300:310] = 1e-44  # max / 127 rounds to a scale of 0
    x[1, 520:530] = TINY / 3  # subnormal block: a subnormal scale
    x[2, 0], x[2, 1], x[2, 300] = FMAX, -FMAX, -TINY
    out.append(x)
    out.append(torch.full((2, 300), -0.5))  # every value on a rounding tie: x / scale = -127
    halves = torch.arange(-127, 128, dtype=torch.float32) + 0.5  # ties to even after scaling
    out.append(torch.cat([halves.clamp(max=127), torch.tensor([127.0])]).view(1, -1))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_kernel_equals_torch_on_every_isa():
    op = _op()
    isas = op.available_isas()
    assert "scalar" in isas and op.isa() == isas[0]  # the widest available is the default
    previous = op.isa()
    try:
        for isa in isas:
            op.set_isa(isa)
            for x in _cases():
                n = x.shape[1]
                payload = int8.pack_rows(x)
                assert torch.equal(payload, int8.pack_rows_torch(x)), (isa, x.shape)
                values = int8.unpack_rows(payload, n)
                assert torch.equal(_bits(values), _bits(int8.unpack_rows_torch(payload, n))), (isa, x.shape)
                total = int8.unpack_sum(payload, n)
                assert torch.equal(_bits(total), _bits(int8.unpack_sum_torch(payload, n))), (isa, x.shape)
    finally:
        op.set_isa(previous)
    with pytest.raises(RuntimeError, match="instruction set 'sve9' is not available"):
        op.set_isa("sve9")


def test_strided_rows_out_and_dtypes():
    """Payload slices of a wider buffer (qwZ's per-parameter columns), bf16 in, bf16 out."""
    _op()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 600, generator=gen)
    wide = torch.zeros(4, 3 * int8.payload_bytes(600), dtype=torch.int8)
    width = int8.payload_bytes(600)
    part = wide[:, width : 2 * width]
    int8.pack_rows(x, out=part)
    assert torch.equal(part, int8.pack_rows_torch(x)) and wide[:, :width].eq(0).all()
    dest = torch.empty(4, 600)
    int8.unpack_rows(part, 600, out=dest)
    assert torch.equal(dest, int8.unpack_rows_torch(part, 600))
    by_row = wide.view(2, 2, -1)[:, 1, width : 2 * width]  # rows 1 and 3: a row stride of 2 rows
    assert torch.equal(int8.unpack_sum(by_row, 600), int8.unpack_sum_torch(by_row, 600))
    half = x.to(torch.bfloat16)
    assert torch.equal(int8.pack_rows(half), int8.pack_rows_torch(half))
    low = torch.empty(4, 600, dtype=torch.bfloat16)
    assert torch.equal(int8.unpack_rows(part, 600, out=low), dest.to(torch.bfloat16))


def test_non_finite_blocks_stay_non_finite():
    """inf or NaN in a block: its scale and values are not finite (an overflow is still seen)."""
    _op()
    x = torch.randn(2, 512)
    x[0, 3], x[1, 300] = float("inf"), float("nan")
    back = int8.unpack_rows(int8.pack_rows(x), 512)
    assert not back[0, :256].isfinite().all() and not back[1, 256:].isfinite().all()
    assert back[0, 256:].isfinite().all() and back[1, :256].isfinite().all()


def test_bad_shapes_are_refused():
    op = _op()
    with pytest.raises(RuntimeError, match=r"payload for x \[2, 300\] must be \[2, 520\]"):
        op.quantize_into(torch.zeros(2, 300), torch.zeros(2, 300, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="x must be Float"):
        op.quantize_into(torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, 260, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="a multiple of 260 bytes"):
        op.dequantize_sum_into(torch.zeros(2, 261, dtype=torch.int8), torch.zeros(10))


def test_torch_path_off_the_cpu_and_without_the_op(monkeypatch):
    """Non-CPU tensors never reach the kernel (meta stands in for a GPU here), and where the op
    cannot load the CPU runs the torch path."""

    def refuse():
        raise AssertionError("the native op was asked for")

    monkeypatch.setattr(int8, "native", refuse)
    x = torch.randn(2, 300, device="meta")
    payload = int8.pack_rows(x)
    assert payload.device.type == "meta" and payload.shape == (2, int8.payload_bytes(300))
    assert int8.unpack_sum(payload, 300).shape == (300,)
    assert int8.unpack_rows(payload, 300).shape == (2, 300)
    monkeypatch.undo()
    monkeypatch.setattr(ALL_OPS["quantizer"], "try_load", lambda: None)
    y = torch.randn(3, 500)
    assert torch.equal(int8.pack_rows(y), int8.pack_rows_torch(y))
    assert torch.equal(int8.unpack_sum(int8.pack_rows(y), 500), int8.unpack_sum_torch(int8.pack_rows(y), 500))
