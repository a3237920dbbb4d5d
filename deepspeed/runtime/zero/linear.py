"""`nn.Linear` under ZeRO-3 without autograd holding its gathered weight from forward to backward.

[Note: what autograd keeps of a gathered weight]
torch's `F.linear` multiplies by `weight.t()` and autograd saves that view for backward. A
view shares the gathered tensor's storage, so releasing the parameter after its module's
forward (swapping `param.data` back to the empty placeholder) frees nothing: every Linear's
full weight stays alive until its backward, and at the end of the forward a rank holds the
whole model's Linear weights at once (measured: 8 layers of 512x512 on 2 ranks, all 8
gathered buffers still referenced after the forward with `stage3_max_reuse_distance: 0`).
Convolutions and norms save the parameter itself, whose data the release swaps out, so they
do not have the problem.

`LinearSavingParameter` computes the same `addmm` as `F.linear` but saves the parameters
themselves; the engine gathers them again around the module's backward (hooks.py), which is
when autograd reads them. The ZeRO-3 engine routes every `nn.Linear` whose `forward` is
torch's through it (`route_linears`), and every `nn.MultiheadAttention` whose `forward` is
torch's runs with `torch.nn.functional.linear` pointing at it for the length of its forward
(its projections call that function with the parameters, not the module; a cross-attention
projection of one chunk of `in_proj_weight` still saves that chunk, a view). The same role as
upstream's `mem_efficient_linear`, which replaces `torch.nn.functional.linear` for the whole
process; here only the engine's own modules change. Forward results are bitwise those of
`F.linear`; the gradients are the same products, summed in the order the matmuls choose.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from deepspeed.runtime.zero.parameter import ACCESS_HOOK, is_zero_param

# Set (to True, in the module's __dict__) on modules built under
# `zero.Init(mem_efficient_linear=False)`: `route_linears` leaves them on torch's forward.
TORCH_LINEAR_MARK = "_ds_torch_linear"


class LinearSavingParameter(torch.autograd.Function):
    """`y = x W^T + b`, saving `x`, `W` and `b` themselves (not a view of `W`) for backward."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)
        if bias is None:
            return input.matmul(weight.t())
        if input.dim() == 2:
            return torch.addmm(bias, input, weight.t())
        flat = input.reshape(-1, input.shape[-1])
        return torch.addmm(bias, flat, weight.t()).view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2]):
            grads = grad_output.reshape(-1, grad_output.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_weight = grads.t().matmul(input.reshape(-1, input.shape[-1]))
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grads.sum(0)
        return grad_input, grad_weight, grad_bias


TORCH_LINEAR = nn.functional.linear  # torch's own, captured before anything swaps it


def linear_saving_parameter(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` through `LinearSavingParameter`."""
    if torch.is_autocast_enabled(input.device.type):
        # Autocast casts F.linear's operands and saves the casts; this Function would save the
        # uncast input and run its backward outside autocast, so torch's path is kept there.
        return TORCH_LINEAR(input, weight, bias)
    for param in (weight, bias):
        # A parameter its module's fetch did not gather (a persistent one after
        # `empty_partition_cache()`) is gathered by the engine's access hook when a torch
        # function first touches it; F.linear is such a function, but `apply` records each
        # input's shape before its forward touches anything, so the hook runs here first:
        # recorded as the partitioned [0], the weight's gradient would be refused.
        if is_zero_param(param) and param._zero_state.status is not ZeroParamStatus.AVAILABLE:
            if ACCESS_HOOK.hook is not None:
                ACCESS_HOOK.hook(param)
    return LinearSavingParameter.apply(input, weight, bias)


def _linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return linear_saving_parameter(input, self.weight, self.bias)


def _attention_forward(self: nn.MultiheadAttention, *args, **kwargs):
    previous = nn.functional.linear
    nn.functional.linear = linear_saving_parameter  # what F.multi_head_attention_forward calls
    try:
        return nn.MultiheadAttention.forward(self, *args, **kwargs)
    finally:
        nn.functional.linear = previous


_ROUTES = ((nn.Linear, _linear_forward), (nn.MultiheadAttention, _attention_forward))


def route_linears(module: nn.Module) -> int:
    """Route each `nn.Linear` and `nn.MultiheadAttention` in `module` whose forward is torch's
    through `LinearSavingParameter` (see the note); returns how many. A subclass with its own
    forward (a quantized Linear), and a module built under `Init(mem_efficient_linear=False)`,
    are left alone."""
    count = 0
    for sub in module.modules():
        if vars(sub).get(TORCH_LINEAR_MARK):
            continue  # its Init asked for torch's F.linear (mem_efficient_linear=False)
        for cls, forward in _ROUTES:
            if isinstance(sub, cls) and type(sub).forward is cls.forward and "forward" not in vars(sub):
                # A partial of a module-level function, not a bound method: it pickles by name
                # (torch.save of the whole module) and deep-copies onto the copy.
                sub.forward = functools.partial(forward, sub)
                count += 1
    return count
