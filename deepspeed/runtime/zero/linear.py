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
torch's through a copy of that forward whose `F.linear` is this one ([Note: attention's
projections]). The same role as upstream's `mem_efficient_linear`, which replaces
`torch.nn.functional.linear` for the whole process; here only the engine's own modules
change. Forward results are bitwise those of `F.linear`; the gradients are the same products,
summed in the order the matmuls choose.

[Note: attention's projections]
`nn.MultiheadAttention` never calls its projections as modules: `F.multi_head_attention_forward`
(and the `_in_projection*` helpers it calls) pass the weights to `linear`, a name they look up
in `torch.nn.functional`'s globals at each call (a cross-attention projection of one chunk of
`in_proj_weight` saves that chunk, a view). Assigning `torch.nn.functional.linear` for the
length of the forward reaches them, but for every thread of the process at once, and it
would outlive the forward if a signal landed between the two assignments. So a routed
attention runs copies of those functions instead: the same code objects, bound to a
namespace (`_NamespaceWith`) that answers `linear` with `linear_saving_parameter` and every
other name from the module itself at the time of the lookup, so nothing global changes and
a later patch of another `F` function is still seen. Two other routes were tried and do not
work: a `TorchFunctionMode` entered around the forward is suspended while it handles
`multi_head_attention_forward` (which dispatches torch functions itself), so the `linear`
calls inside are never seen, and an active mode turns off attention's inference fast path;
`ZeroParameter.__torch_function__` is not called for gathered parameters, which a running
attention's are.
"""

from __future__ import annotations

import builtins
import functools
import sys
import types
from typing import Any

import torch
from torch import nn

from deepspeed import process_state
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


class _NamespaceWith(dict):
    """The globals of `module` as copies of its functions see them ([Note: attention's
    projections]): the names given are replaced; any other name is read from the module when it
    is looked up, and a function of the module comes back as a copy bound here, so that what
    it calls sees the replacements too."""

    def __init__(self, module: types.ModuleType, replaced: dict) -> None:
        super().__init__(replaced)
        self._module_globals = vars(module)
        # function name -> (the module's function, its copy bound here); a function the
        # module rebinds later is copied again
        self._copies: dict = {}

    def __missing__(self, name: str) -> Any:
        value = self._module_globals.get(name, _ABSENT)
        if value is _ABSENT:
            return vars(builtins)[name]  # what the lookup would find next (KeyError if none)
        return self.bind(value) if isinstance(value, types.FunctionType) else value

    def bind(self, function: types.FunctionType) -> types.FunctionType:
        """`function`'s copy bound here; `function` itself when it is not the module's."""
        if function.__globals__ is not self._module_globals:
            return function
        cached = self._copies.get(function.__name__)
        if cached is None or cached[0] is not function:
            copy = types.FunctionType(
                function.__code__, self, function.__name__, function.__defaults__, function.__closure__
            )
            copy.__kwdefaults__ = function.__kwdefaults__
            copy.__qualname__ = function.__qualname__
            cached = self._copies[function.__name__] = (function, copy)
        return cached[1]


class _ModuleView:
    """Attribute access over a `_NamespaceWith`: what `F.name` reads in a copied function."""

    def __init__(self, namespace: _NamespaceWith) -> None:
        self._namespace = namespace

    def __getattr__(self, name: str) -> Any:
        try:
            return self._namespace[name]
        except KeyError:
            raise AttributeError(name) from None


_ABSENT = object()
_FUNCTIONAL = _NamespaceWith(nn.functional, {"linear": linear_saving_parameter})
# nn.MultiheadAttention.forward reaches the functional module as `F`.
_ATTENTION_MODULE = sys.modules[nn.MultiheadAttention.__module__]
_ATTENTION = _NamespaceWith(_ATTENTION_MODULE, {"F": _ModuleView(_FUNCTIONAL)})
# Per process, with nothing to reset: each caches copies of torch's functions, and a function
# torch's module rebinds is copied again at its next lookup.
process_state.register("deepspeed.runtime.zero.linear._FUNCTIONAL", _FUNCTIONAL)
process_state.register("deepspeed.runtime.zero.linear._ATTENTION", _ATTENTION)


def _attention_forward(self: nn.MultiheadAttention, *args, **kwargs):
    return _ATTENTION.bind(nn.MultiheadAttention.forward)(self, *args, **kwargs)


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


# ---------------------------------------------------------------- upstream's names


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """Upstream's name for the Function: `LinearFunctionForZeroStage3.apply(input, weight, bias=None)`,
    `LinearSavingParameter` with the bias optional."""

    @staticmethod
    def forward(
        ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        ctx.bias_given = bias is not None
        return LinearSavingParameter.forward(ctx, input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grads = LinearSavingParameter.backward(ctx, grad_output)
        return grads if ctx.bias_given else grads[:2]  # one gradient per input given


def zero3_linear_wrap(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Upstream's `F.linear` replacement under `mem_efficient_linear`: `linear_saving_parameter`."""
    return linear_saving_parameter(input, weight, bias)


class LinearModuleForZeroStage3(nn.Linear):
    """Upstream's Linear module that saves its parameters, not a view of the weight, for
    backward: an `nn.Linear` (same parameters and initialisation) whose forward is
    `linear_saving_parameter`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear_saving_parameter(input, self.weight, self.bias)
