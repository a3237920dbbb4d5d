"""`ZeroParameter`: a ZeRO-3 parameter as callers see it, and the interception of torch functions on it.

The state it shows lives in lifecycle.py; gathering in gather.py. Above both sit upstream's
parameter API (`param.all_gather()`, `partition()`, `ds_summary()`, the `ds_*` attributes) and
`__torch_function__`, which serves Init's in-place hook and the engine's access hook.

[Note: why a Parameter subclass]
Callers read `param.ds_status`, `param.ds_tensor`, ... and call `param.all_gather()`.
Rather than glue closures and loose attributes onto each parameter (upstream), a converted
parameter's class becomes `ZeroParameter`, whose properties and methods read and act on the
single `ZeroParamState` stored in `param._zero_state`. It is still an `nn.Parameter`.

[Note: a gathered parameter skips the dispatch]
`ZeroParameter.__torch_function__` runs in Python for every torch function that takes the
parameter, only to serve a partitioned or in-flight one: Init's in-place hook, the access
hook, shape queries answered from the full shape. A gathered parameter needs none of that,
so while its status is AVAILABLE its class is `GatheredZeroParameter`, which disables the
dispatch exactly as `nn.Parameter` does (torch then never calls into Python). The status
transitions (lifecycle.py) switch the class with the status; `make_zero_param` hands them
both classes. On a GPU, where a step's kernels are fast, a forward through a gathered model
paid this dispatch on every operation that read a weight.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed import process_state
from deepspeed.runtime.zero import gather
from deepspeed.runtime.zero.lifecycle import ZeroParamState, ZeroParamStatus, ZeroParamType, empty_placeholder


class _InPlaceInitHook:
    """Where Init puts its hook for in-place ops on partitioned parameters.

    [Note: a parent initializing a child's partitioned parameter]
    A module's parameters are partitioned when its own `__init__` returns, but its parent may
    initialize them afterwards: `nn.MultiheadAttention` builds `out_proj` and then zeroes
    `out_proj.bias` through `nn.init.constant_`; a ViT re-initializes every Linear with
    `trunc_normal_`, a chain of `uniform_`, `erfinv_`, `mul_`, `add_` and `clamp_`. On a
    partitioned parameter each of those would act on an empty tensor and be lost. While an
    Init is active, every in-place op (a name ending in one underscore, see `is_in_place`)
    whose target is a partitioned parameter gathers it, applies the op, and keeps rank 0's
    result; `nn.init` functions that dispatch through `__torch_function__` are taken whole,
    so a `uniform_` costs one gather. Outside Init the hook is None: such a call acts on
    whatever `param.data` holds, as upstream.
    """

    # Methods with a trailing underscore that change metadata or autograd flags, not values.
    NOT_VALUE_OPS = frozenset(
        ["requires_grad_", "share_memory_", "retain_grad_", "detach_", "set_", "resize_"]
    )

    def __init__(self) -> None:
        self.hook: Optional[Any] = None  # hook(param, func, args, kwargs) -> the func's result

    def is_in_place(self, name: str) -> bool:
        return name.endswith("_") and not name.endswith("__") and name not in self.NOT_VALUE_OPS


IN_PLACE_INIT = _InPlaceInitHook()
# Set only while an Init is active; _INIT_STACK's reset (partition_parameters.py) clears it.
process_state.register("deepspeed.runtime.zero.parameter.IN_PLACE_INIT", IN_PLACE_INIT)


class _AccessHook:
    """Where engines put their hooks for partitioned parameters used outside their module.

    [Note: parameters used outside their owning module]
    The engine gathers a submodule's parameters around that submodule's forward. Some
    modules read a child's parameters without calling the child: `nn.MultiheadAttention`
    passes `out_proj.weight` straight to `F.multi_head_attention_forward`. While an engine
    runs a forward, any torch function that receives a parameter that is not gathered,
    positionally, by keyword or inside a list (`torch.cat([w1, w2])`), calls this hook first
    (through `ZeroParameter.__torch_function__`); the engine gathers it, registers it as an
    external parameter of the submodule that is running, so later passes gather (and
    prefetch) it up front, and releases it with that submodule. Engines nest (a teacher's
    forward inside a student's), so the hooks form a stack and the innermost running engine
    answers. Outside every engine's forward the stack is empty and such a use sees the
    empty tensor, as upstream.

    Reading an attribute goes through `__torch_function__` as `__get__`. Most attributes
    (`data`, `grad`, `dtype`, `device`, `requires_grad`) say nothing about the values and
    never gather; the ones that are values (`T`, `mT`, `H`, `mH`, `real`, `imag`) are uses
    like any other. Shape queries (`.shape`, `size()`, `dim()`, `numel()`, `stride()`) inside an engine's
    forward answer the parameter's full shape without a gather: upstream gathers a parameter
    as soon as a forward looks it up on its module, so code written for it reads real shapes
    there (peft's DoRA sizes an identity matrix by `lora_A.weight.shape[1]` before calling
    `lora_A`), and a shape costs no collective, so a rank that alone asks cannot hang the
    others. Outside a forward they answer the placeholder's shape [0], which is how clients
    tell a partitioned parameter (as upstream).
    """

    # Functions that read metadata or storage handles: never worth a gather.
    NO_FETCH = frozenset(
        ["__get__", "__set__", "__delete__", "numel", "size", "dim", "element_size", "__repr__", "__format__",
         "is_floating_point", "data_ptr", "stride", "is_contiguous", "__len__", "untyped_storage", "__reduce_ex__",
         "register_hook", "register_post_accumulate_grad_hook", "__hash__", "__eq__"]
    )  # fmt: skip
    # Attributes whose read (`__get__`) is a use of the values (see the note).
    VALUE_ATTRIBUTES = frozenset(["T", "mT", "H", "mH", "real", "imag"])

    def __init__(self) -> None:
        self.hook: Optional[Any] = None  # the innermost engine's hook(param) -> None; makes `param` available
        self._stack: list = []

    def push(self, hook: Any) -> None:
        self._stack.append(hook)
        self.hook = hook

    def pop(self, hook: Any) -> None:
        assert self._stack and self._stack[-1] == hook, "access hooks must be removed innermost first"
        self._stack.pop()
        self.hook = self._stack[-1] if self._stack else None

    def clear(self) -> None:
        """Forget every pushed hook (process_state.reset(): a forward that raised past its pop)."""
        self._stack.clear()
        self.hook = None


ACCESS_HOOK = _AccessHook()
# Pushed and popped around each forward by the coordinator (hooks.py); empty between passes.
process_state.register("deepspeed.runtime.zero.parameter.ACCESS_HOOK", ACCESS_HOOK, ACCESS_HOOK.clear)

_NOT_INTERCEPTED = object()


def zero_params_in(value: Any, found: list) -> list:
    """The ZeroParameters among `value`, looking inside tuples, lists and dict values."""
    if type(value) in _ZERO_PARAM_TYPES:  # is_zero_param, inlined: this recursion runs per argument
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            zero_params_in(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            zero_params_in(v, found)
    return found


def _intercept(func, args: tuple, kwargs: dict) -> Any:
    """Route `func` through Init's in-place hook or the engine's access hook (see both notes)."""
    name = getattr(func, "__name__", "")
    init_hook = IN_PLACE_INIT.hook
    if init_hook is not None and IN_PLACE_INIT.is_in_place(name):
        target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        if is_zero_param(target) and target._zero_state.status is ZeroParamStatus.NOT_AVAILABLE:
            return init_hook(target, func, args, kwargs)
    access_hook = ACCESS_HOOK.hook
    if access_hook is None:
        return _NOT_INTERCEPTED
    if name in _AccessHook.NO_FETCH:
        target = args[0] if args else None
        if is_zero_param(target) and target._zero_state.status is not ZeroParamStatus.AVAILABLE:
            return _full_shape_query(func, name, target._zero_state.shape, args, kwargs)
        return _NOT_INTERCEPTED
    for param in zero_params_in((args, kwargs), []):
        if param._zero_state.status is not ZeroParamStatus.AVAILABLE:
            access_hook(param)
    return _NOT_INTERCEPTED


def _full_shape_query(func, name: str, shape: torch.Size, args: tuple, kwargs: dict) -> Any:
    """Inside an engine's forward: a shape query answered from the full shape, a value
    attribute read as a use (the access hook gathers first), the rest as it is (see the note)."""
    if name == "__get__":
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        if attribute == "shape":
            return shape
        if attribute in _AccessHook.VALUE_ATTRIBUTES:
            ACCESS_HOOK.hook(args[0])
        return _NOT_INTERCEPTED
    if name == "size":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return shape if dim is None else shape[dim]
    if name == "dim":
        return len(shape)
    if name == "numel":
        return shape.numel()
    if name == "stride":  # a gathered parameter is a contiguous view of its buffer
        strides = _contiguous_strides(shape)
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return strides if dim is None else strides[dim]
    return _NOT_INTERCEPTED


def _contiguous_strides(shape: torch.Size) -> tuple:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _note_partitioned(err: RuntimeError, args: tuple, kwargs: dict) -> None:
    """Name the cause when a torch function failed on a partitioned parameter: the kernel's own
    message ("mat2 must be a matrix, got 1-D tensor") says nothing of ZeRO. The error keeps
    its type and message; the note is added where Python has notes (3.11+)."""
    partitioned = [
        a
        for a in (*args, *kwargs.values())
        if isinstance(a, ZeroParameter) and a._zero_state.status is ZeroParamStatus.NOT_AVAILABLE
    ]
    if partitioned and hasattr(err, "add_note"):
        shapes = ", ".join(f"ds_id={a.ds_id} {tuple(a.ds_shape)}" for a in partitioned)
        err.add_note(
            f"ZeRO-3: partitioned here (data: the [0] placeholder): {shapes}; call the model through "
            "the engine deepspeed.initialize returns, or gather with deepspeed.zero.GatheredParameters"
        )


class _ItemRead:
    """The owner of the hold `ZeroParameter.item()` takes for the length of one read."""

    def __repr__(self) -> str:
        return "param.item()"


class ZeroParameter(nn.Parameter):
    """An `nn.Parameter` whose upstream `ds_*` attributes are read-only views of its state."""

    _zero_state: ZeroParamState

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if IN_PLACE_INIT.hook is not None or ACCESS_HOOK.hook is not None:
            result = _intercept(func, args, kwargs)
            if result is not _NOT_INTERCEPTED:
                return result
        # As nn.Parameter does: run the function without subclass dispatch, results are plain tensors.
        with torch._C.DisableTorchFunctionSubclass():
            try:
                return func(*args, **kwargs)
            except RuntimeError as err:
                _note_partitioned(err, args, kwargs)
                raise

    @property
    def ds_id(self) -> int:
        return self._zero_state.ds_id

    @property
    def ds_status(self) -> ZeroParamStatus:
        return self._zero_state.status

    @property
    def ds_shape(self) -> torch.Size:
        return self._zero_state.shape

    @property
    def ds_numel(self) -> int:
        return self._zero_state.numel

    @property
    def ds_tensor(self) -> torch.Tensor:
        return self._zero_state.shard

    @property
    def ds_persist(self) -> bool:
        return self._zero_state.persist

    @ds_persist.setter
    def ds_persist(self, value: bool) -> None:
        """Upstream's switch: a persistent parameter stays gathered once gathered (the next
        gather keeps it); switching it off frees a gathered one nobody holds."""
        state = self._zero_state
        state.persist = bool(value)
        if not state.persist and state.status is ZeroParamStatus.AVAILABLE and not state.holds:
            gather.release_unheld([state])

    @property
    def ds_process_group(self) -> Any:
        """The group the parameter is partitioned over; the world group when Init was given none,
        as upstream's attribute holds it (`p.ds_process_group == dist.get_world_group()`)."""
        group = self._zero_state.group
        if group is None:
            group = dist.get_world_group()
        return group

    @property
    def ds_active_sub_modules(self) -> set:
        return self._zero_state.active_sub_modules

    @property
    def ds_param_type(self) -> ZeroParamType:
        return self._zero_state.param_type

    def partition_numel(self) -> int:
        return self._zero_state.partition_size

    def padding_size(self) -> int:
        return self._zero_state.padding

    def ds_summary(self) -> dict:
        state = self._zero_state
        return {
            "id": state.ds_id,
            "status": state.status.name,
            "numel": state.numel,
            "ds_numel": state.numel,
            "shape": tuple(state.shape),
            "ds_shape": tuple(state.shape),
            "requires_grad": state.param.requires_grad,
            "grad_shape": tuple(state.param.grad.shape) if state.param.grad is not None else None,
            "persist": state.persist,
            "active_sub_modules": sorted(state.active_sub_modules),
            "holders": state.holders,
            "held_by": [repr(owner) for owner in state.holds],
            "partition_size": state.partition_size,
            "padding": state.padding,
        }

    def all_gather(self, param_list: Optional[list] = None, async_op: bool = False):
        """Gather `param_list` (default: this parameter) until `partition()`; as upstream, a
        parameter gathered this way already stays gathered once, not once per call."""
        handle = gather.fetch_once(param_list or [self], gather.PARAM_API, async_op=True)
        if async_op:
            return handle
        handle.wait()
        return None

    def item(self) -> Any:
        """The value of a one-element parameter, gathered first when it is partitioned, as
        upstream's `param.item()` is (a collective then: every rank of its group calls it)."""
        if self._zero_state.status is ZeroParamStatus.AVAILABLE:
            return super().item()
        holder = _ItemRead()
        gather.fetch([self], holder)
        try:
            return super().item()
        finally:
            gather.release_states([self._zero_state], holder)

    def all_gather_coalesced(self, params: list, safe_mode: bool = False, quantize: bool = False):
        """Issue one coalesced gather of `params` and return its handle (call `wait()`)."""
        del safe_mode  # a debugging aid upstream; our state transitions always check themselves
        if quantize:
            raise ValueError("all_gather_coalesced(quantize=True): quantized gathers are not supported")
        return gather.fetch_once(params, gather.PARAM_API, async_op=True)

    def partition(
        self, param_list: Optional[list] = None, has_been_updated: bool = False, free_data: bool = True
    ):
        """Drop the hold taken by `all_gather()`; `has_been_updated=True` first writes edits back.

        Holds that others took (the engine, a live GatheredParameters) are never dropped here.
        `free_data=False` (upstream: mark the parameter partitioned but leave the full tensor
        in `param.data` for the caller to free) is refused: here the last holder's release
        frees the gathered tensor (gather.py's refcount note), and a full tensor left behind a
        partitioned status would go stale at the next step.
        """
        if not free_data:
            raise NotImplementedError(
                "partition(free_data=False) is not supported: releasing the last hold frees the gathered "
                "tensor; to keep it, keep the hold (do not call partition() yet, or use GatheredParameters)"
            )
        gather.release_api_holds(param_list or [self], has_been_updated=has_been_updated)

    def __repr__(self) -> str:
        state = self._zero_state
        return f"ZeroParameter(ds_id={state.ds_id}, shape={tuple(state.shape)}, status={state.status.name})"

    def __deepcopy__(self, memo: dict) -> ZeroParameter:
        if id(self) in memo:
            return memo[id(self)]
        copy = nn.Parameter(empty_placeholder(self), requires_grad=self.requires_grad)
        copy.__class__ = ZeroParameter
        copy._zero_state = ZeroParamState.copy_for(self._zero_state, copy)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol):
        # Pickle (and deepcopy) as a plain Parameter holding the gathered-or-empty data.
        return (nn.Parameter, (self.data.detach().clone(), self.requires_grad))


class GatheredZeroParameter(ZeroParameter):
    """A `ZeroParameter` while gathered: no Python dispatch ([Note: a gathered parameter skips
    the dispatch]); everything else, `ds_*` attributes included, as `ZeroParameter`."""

    __torch_function__ = torch._C._disabled_torch_function_impl


# The classes a ZeRO parameter has (the status transitions switch between them). A membership
# test of `type(tensor)` here is what `is_zero_param` runs: `isinstance` against an
# `nn.Parameter` subclass calls torch's metaclass `__instancecheck__` in Python, about 1 us,
# and the hooks ask this for every parameter of every submodule in every pass.
_ZERO_PARAM_TYPES = frozenset((ZeroParameter, GatheredZeroParameter))
_CLASSES = (ZeroParameter, GatheredZeroParameter)  # (partitioned, gathered): what each state switches between


def is_zero_param(tensor: Any) -> bool:
    return type(tensor) in _ZERO_PARAM_TYPES


def make_zero_param(
    param: nn.Parameter,
    group: Any,
    world_size: int,
    rank: int,
    remote_device=None,
    shard_out: Optional[torch.Tensor] = None,
) -> ZeroParameter:
    """Attach state to `param` and switch its class (see the note); its full data stays in place.

    `shard_out`, when given, is a zeroed `[partition_size]` tensor to hold the shard.
    """
    state = ZeroParamState(param, group, world_size, rank, _CLASSES, remote_device, shard_out)
    param.__class__ = GatheredZeroParameter  # its status starts AVAILABLE
    param._zero_state = state
    return param
