"""What each operator costs, and the dispatch mode that counts the operators a forward runs.

[Note: counting at the dispatcher]
The profiler counts ATen operators as a `TorchDispatchMode` sees them, the level at which
`torch.utils.flop_counter.FlopCounterMode` counts too, rather than by swapping functions of
`torch.nn.functional` for the length of a forward (upstream). At that level every route to a
matrix product arrives as one of a few operators (`mm`, `addmm`, `bmm`, `baddbmm`,
`convolution`, the fused attention kernels): `F.linear`, `x @ w`, `torch.einsum`, HF's
`Conv1D` (`torch.addmm`), the ZeRO-3 memory-efficient linear (`runtime/zero/linear.py`, an
autograd Function whose forward calls `addmm`), `nn.MultiheadAttention`'s internal
projections, and a ZeRO-3 parameter (a `ZeroParameter`, whose `__torch_function__` runs
above the dispatcher and has handed over the gathered tensor by then). Nothing global is
replaced: entering the mode pushes it on this thread's mode stack and leaving pops it.

Conventions (each a choice, stated so the numbers can be checked by hand):
- a matrix product of `(m, k) x (k, n)` is `m*k*n` MACs and twice that in flops; a batch
  multiplies both; the bias of `addmm` / `baddbmm` / a convolution is not counted (as
  FlopCounterMode; upstream adds it for convolutions and `torch.addmm`, not for `F.linear`);
- a convolution is `prod(weight.shape)` MACs per output position (per input position for a
  transposed one), per batch element;
- attention (`F.scaled_dot_product_attention`, whichever kernel runs) is the two products
  `q k^T` and `p v` over the full `s_q x s_k` square, with or without a causal mask, with
  the query heads' count (as FlopCounterMode); the softmax inside a fused kernel is not
  counted; when torch falls back to the math path the products, softmax and mask add are
  counted as the separate operators they become;
- elementwise arithmetic and activations: one flop per output element (upstream counts
  `torch.add` / `torch.mul` calls this way and misses the `+` / `*` operators; here every
  arithmetic operator counts); reductions (`sum`, `mean`) and pooling: one per input element (upstream's rule for pools); softmax
  and log-softmax: one per element (upstream's);
- norms (upstream's estimates): layer norm and group norm 5 flops per element with an
  affine weight, 4 without; batch norm 5 / 4 in training, 2 / 1 in evaluation; RMS norm
  (`F.rms_norm`) 4 / 3 where a fused kernel runs it (upstream has no rule for it); where torch
  decomposes it (the CPU), and for a model's own RMS norm written with `pow`, `mean`, `rsqrt`
  and `*` (HF Llama's), its operators count one by one: 4 per element and 2 per row;
- an elementwise operator or reduction on integer or bool tensors: 0 (not floating-point work);
- embeddings, copies, views, indexing, comparisons, `where`, dropout's mask draw: 0 (a
  training-mode dropout's scaling multiplies are elementwise and count, upstream counts 0).
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCost", "CountingMode", "op_cost"]

OpCost = tuple  # (flops, macs)

_ZERO: OpCost = (0, 0)


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 0


def _float_numel(value: Any) -> int:
    """Elements of a floating-point (or complex) tensor; 0 for integer and bool ones: index and
    mask arithmetic (positions, a step counter) is not floating-point work."""
    if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
        return 0
    return value.numel()


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _product(mat1: torch.Tensor, mat2: torch.Tensor) -> OpCost:
    # (..., m, k) x (..., k, n): the leading dimensions are the batch
    macs = math.prod(mat1.shape) * mat2.shape[-1]
    return 2 * macs, macs


def _mm(args: tuple, out: Any) -> OpCost:
    return _product(args[0], args[1])


def _addmm(args: tuple, out: Any) -> OpCost:
    return _product(args[1], args[2])  # args[0] is the bias / the added matrix


def _convolution(args: tuple, out: Any) -> OpCost:
    # aten.convolution(input, weight, bias, stride, padding, dilation, transposed, ...)
    weight, transposed = args[1], bool(args[6]) if len(args) > 6 else False
    positions = args[0] if transposed else _first_tensor(out)
    # batch x spatial positions of the input (transposed) or the output (direct)
    per_sample = math.prod(positions.shape[2:]) if positions.dim() > 2 else 1
    macs = math.prod(weight.shape) * positions.shape[0] * per_sample
    return 2 * macs, macs


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads_last: bool) -> OpCost:
    if heads_last:  # (batch, seq, heads, dim): the _flash / _efficient kernels' own layout
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    *lead, s_q, d_qk = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    rows = math.prod(lead) * s_q * s_k
    macs = rows * d_qk + rows * d_v
    return 2 * macs, macs


def _sdpa(args: tuple, out: Any) -> OpCost:
    return _attention(args[0], args[1], args[2], heads_last=False)


def _attention_kernel(args: tuple, out: Any) -> OpCost:
    return _attention(args[0], args[1], args[2], heads_last=True)


def _per_output(args: tuple, out: Any) -> OpCost:
    target = _first_tensor(out)
    return _float_numel(target if target is not None else (args[0] if args else None)), 0


def _per_input(args: tuple, out: Any) -> OpCost:
    return _float_numel(args[0]), 0


def _norm(affine_at: int, with_affine: int, without: int) -> Callable:
    def cost(args: tuple, out: Any) -> OpCost:
        affine = len(args) > affine_at and args[affine_at] is not None
        return _numel(args[0]) * (with_affine if affine else without), 0

    return cost


def _batch_norm(training_at: Optional[int], training: bool = False) -> Callable:
    """Batch norm's rule; `training_at`: the argument saying so, else `training` fixed."""

    def cost(args: tuple, out: Any) -> OpCost:
        is_training = bool(args[training_at]) if training_at is not None else training
        affine = len(args) > 1 and args[1] is not None
        factor = (5 if affine else 4) if is_training else (2 if affine else 1)
        return _numel(args[0]) * factor, 0

    return cost


def _zero(args: tuple, out: Any) -> OpCost:
    return _ZERO


_ELEMENTWISE = frozenset(
    """add sub rsub mul div true_divide floor_divide remainder fmod pow neg reciprocal rsqrt sqrt
    exp exp2 expm1 log log2 log10 log1p abs sign sin cos tan tanh sinh cosh asin acos atan atan2
    sigmoid erf erfc erfinv maximum minimum clamp clamp_min clamp_max lerp addcmul addcdiv square
    relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus
    softshrink hardshrink logsigmoid glu _prelu_kernel prelu threshold _softmax _safe_softmax
    _log_softmax upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d
    upsample_bilinear2d upsample_bicubic2d upsample_trilinear3d _upsample_nearest_exact2d""".split()
)
# one flop per input element: reductions, and pooling (upstream's rule for pools)
_REDUCTIONS = frozenset(
    """sum mean var std norm linalg_vector_norm amax amin prod logsumexp avg_pool1d avg_pool2d
    avg_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d adaptive_max_pool2d adaptive_max_pool3d
    max_pool2d_with_indices max_pool3d_with_indices max_pool1d max_pool2d max_pool3d""".split()
)

# name of the ATen operator (its packet, the trailing `_` of an in-place variant removed) -> cost
_RULES = {
    "mm": _mm,
    "bmm": _mm,
    "addmm": _addmm,
    "baddbmm": _addmm,
    "_scaled_mm": _mm,
    "convolution": _convolution,
    "_convolution": _convolution,
    "convolution_overrideable": _convolution,
    "_scaled_dot_product_flash_attention": _sdpa,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa,
    "_scaled_dot_product_efficient_attention": _sdpa,
    "_scaled_dot_product_cudnn_attention": _sdpa,
    "_scaled_dot_product_fused_attention_overrideable": _sdpa,
    "_flash_attention_forward": _attention_kernel,
    "_efficient_attention_forward": _attention_kernel,
    "native_layer_norm": _norm(2, 5, 4),  # (input, normalized_shape, weight, bias, eps)
    "native_group_norm": _norm(1, 5, 4),  # (input, weight, bias, N, C, HxW, group, eps)
    "_fused_rms_norm": _norm(2, 4, 3),  # (input, normalized_shape, weight, eps)
    "rms_norm": _norm(2, 4, 3),
    "native_batch_norm": _batch_norm(5),  # (input, weight, bias, mean, var, training, ...)
    "_native_batch_norm_legit": _batch_norm(5),
    "_native_batch_norm_legit_no_training": _batch_norm(None, training=False),
    "_batch_norm_with_update": _batch_norm(None, training=True),
    "_batch_norm_no_update": _batch_norm(None, training=False),
    "cudnn_batch_norm": _batch_norm(5),
    "miopen_batch_norm": _batch_norm(5),
    "embedding": _zero,
    **{name: _per_output for name in _ELEMENTWISE},
    **{name: _per_input for name in _REDUCTIONS},
}
_RULES = types.MappingProxyType(_RULES)  # read-only from here on


def op_name(func: Any) -> str:
    """`aten.mm` for `aten.mm.default`: the name counts are reported under."""
    packet = getattr(func, "overloadpacket", func)
    return str(packet)


def op_cost(func: Any, args: tuple, out: Any) -> Optional[OpCost]:
    """(flops, MACs) of one call of the ATen operator `func`; None for an operator no rule covers."""
    namespace = getattr(func, "namespace", None)
    if namespace != "aten":
        return None
    name = func.overloadpacket.__name__
    rule = _RULES.get(name) or (_RULES.get(name[:-1]) if name.endswith("_") else None)
    if rule is None:
        return None
    flops, macs = rule(args, out)
    return int(flops), int(macs)


class CountingMode(TorchDispatchMode):
    """Calls `on_op(name, flops, macs)` for every ATen operator a rule prices (see the note)."""

    def __init__(self, on_op: Callable[[str, int, int], None]) -> None:
        super().__init__()
        self._on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cost = op_cost(func, args, out)
        if cost is not None:
            self._on_op(op_name(func), cost[0], cost[1])
        return out
