"""One object owns each ZeRO-3 parameter's state; the upstream `ds_*` attributes are views over it.

[Note: shard math]
For a partition group of size `ws`, a parameter of `numel` elements is padded to a multiple
of `ws`: `padding = (ws - numel % ws) % ws`, `partition_size = (numel + padding) // ws`.
Rank `r` owns flat elements `[r * partition_size, (r + 1) * partition_size)`; elements at
or beyond `numel` are padding (zeros, never read back into the parameter).

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
transitions switch the class with the status: `make_zero_param`, `all_to_available`,
`all_to_released`. On a GPU, where a step's kernels are fast, a forward through a gathered
model paid this dispatch on every operation that read a weight.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Optional

import torch
from torch import nn


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # the full tensor is in param.data
    NOT_AVAILABLE = 2  # param.data is empty; only this rank's shard exists
    INFLIGHT = 3  # an all-gather into param.data was issued and not yet waited on


class ZeroParamType(enum.Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3  # the shard lives off the compute device (remote_device="cpu")


def shard_sizes(numel: int, world_size: int) -> tuple:
    """`(partition_size, padding)` for `numel` elements over `world_size` ranks (see the note)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    padding = (world_size - numel % world_size) % world_size
    return (numel + padding) // world_size, padding


class _IdCounter:
    """Hands out `ds_id`s; equal on all ranks because construction order is. One owner, resettable."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def next(self) -> int:
        return next(self._counter)

    def reset(self) -> None:
        self._counter = itertools.count()


PARAM_IDS = _IdCounter()


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


ACCESS_HOOK = _AccessHook()


def _empty_like_data(param: torch.Tensor) -> torch.Tensor:
    # A shape-[0] placeholder with the parameter's dtype and device, as upstream leaves it.
    return torch.empty(0, dtype=param.dtype, device=param.device)


class ZeroParamState:
    """Everything ZeRO knows about one parameter. Status changes only through the `to_*` methods."""

    param: nn.Parameter
    ds_id: int
    shape: torch.Size
    numel: int
    group: Any  # the partition process group (None: the world)
    world_size: int
    rank: int  # this process's rank within `group`
    partition_size: int  # elements per rank, padding included
    padding: int  # elements added to reach a multiple of world_size
    shard: torch.Tensor  # 1D, [partition_size], this rank's slice (padding zero-filled)
    shard_base: torch.Tensor  # 1D contiguous tensor `shard` is a view of (`shard` itself if none)
    shard_offset: int  # where `shard` starts in `shard_base`, in elements (see gather.py's coalescing note)
    status: ZeroParamStatus
    holds: dict  # owner -> holds it took on the gathered tensor (see gather.py's refcount note)
    persist: bool  # small parameters that stay gathered (stage3_param_persistence_threshold)
    active_sub_modules: set  # ids of submodules currently running with this parameter
    pending: Optional[Any]  # the gather bucket that will materialize an INFLIGHT parameter
    full_buffer: Optional[Any]  # while AVAILABLE from a gather: the buffer its data is a view of (gather.py)
    param_type: ZeroParamType
    sanity_checks: bool  # detect edits discarded by a modifier_rank=None gather
    shard_version: int  # counts write-backs of edits, so the optimizer can refresh its master
    external_owners: list  # modules this parameter is registered with as external

    def __init__(
        self,
        param: nn.Parameter,
        group: Any,
        world_size: int,
        rank: int,
        remote_device=None,
        shard_out: Optional[torch.Tensor] = None,
    ) -> None:
        self.param = param
        self.ds_id = PARAM_IDS.next()
        self.shape = param.shape
        self.numel = param.numel()
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.partition_size, self.padding = shard_sizes(self.numel, world_size)
        self._set_shard(self._make_shard(param.data, remote_device, shard_out))
        # What param.data holds while partitioned: shape [0], the parameter's dtype and device.
        self.placeholder = _empty_like_data(param.data)
        self.status = ZeroParamStatus.AVAILABLE
        self.holds = {}
        self.persist = False
        self.active_sub_modules = set()
        self.pending = None
        self.full_buffer = None
        self.param_type = ZeroParamType.REMOTE if remote_device is not None else ZeroParamType.PARTITIONED
        self.sanity_checks = False
        self.external_owners = []
        self.shard_version = 0  # bumped by every write-back of an edit into the shard

    @classmethod
    def copy_for(cls, source: ZeroParamState, param: nn.Parameter) -> ZeroParamState:
        """State for a deep copy of `source`'s parameter: a new ds_id, a cloned shard, partitioned.

        Deep copies happen in the same order on every rank (e.g. `nn.TransformerEncoder`
        cloning its layer under Init), so the new ds_ids agree across ranks.
        """
        state = cls.__new__(cls)
        state.__dict__.update(source.__dict__)
        state.param = param
        state.ds_id = PARAM_IDS.next()
        state._set_shard(source.shard.clone())
        state.placeholder = _empty_like_data(source.placeholder)
        state.status = ZeroParamStatus.NOT_AVAILABLE
        state.holds = {}
        state.active_sub_modules = set()
        state.pending = None
        state.full_buffer = None
        state.external_owners = []
        return state

    # ------------------------------------------------------------------ shard I/O

    def _make_shard(
        self, full: torch.Tensor, remote_device, shard_out: Optional[torch.Tensor]
    ) -> torch.Tensor:
        if shard_out is None:
            device = torch.device(remote_device) if remote_device is not None else full.device
            shard = torch.zeros(self.partition_size, dtype=full.dtype, device=device)
        else:
            shard = shard_out  # a zeroed view into a flat buffer shared with sibling parameters
        self._copy_own_slice(full, shard)
        return shard

    def _set_shard(self, shard: torch.Tensor) -> None:
        """Make `shard` the shard, recording which flat tensor it is a view of, and where."""
        base = shard._base
        if base is None or base.dim() != 1 or not base.is_contiguous() or not shard.is_contiguous():
            base = shard
        self.shard = shard
        self.shard_base = base
        self.shard_offset = shard.storage_offset() - base.storage_offset()

    def own_slice_bounds(self) -> tuple:
        """`[start, end)` of this rank's real (non-padding) elements in the flat tensor."""
        start = self.rank * self.partition_size
        return min(start, self.numel), min(start + self.partition_size, self.numel)

    def _copy_own_slice(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        start, end = self.own_slice_bounds()
        if end > start:
            shard[: end - start].copy_(full.reshape(-1)[start:end])

    def write_back(self) -> None:
        """Copy this rank's slice of the gathered tensor into the shard (has_been_updated=True)."""
        self._require(ZeroParamStatus.AVAILABLE, "write_back")
        self._copy_own_slice(self.param.data, self.shard)
        self.shard_version += 1  # tells the optimizer its fp32 master is stale

    def retype_shard(self, out: torch.Tensor) -> None:
        """Move the shard into `out` (a zeroed `[partition_size]` tensor of another dtype)."""
        self._require(ZeroParamStatus.NOT_AVAILABLE, "retype_shard")
        assert not self.holds, (
            f"[rank {self.rank}] ds_id={self.ds_id} re-typed while held by {list(self.holds)}"
        )
        out.copy_(self.shard)
        self._set_shard(out)
        self.placeholder = torch.empty(0, dtype=out.dtype, device=self.placeholder.device)
        with torch._C.DisableTorchFunctionSubclass():  # internal: skip ZeroParameter's dispatch
            self.param.data = self.placeholder
        self.shard_version += 1  # an fp32 master made before this must be rebuilt

    # ------------------------------------------------------------------ status transitions

    def _require(self, expected: ZeroParamStatus, action: str) -> None:
        assert self.status is expected, (
            f"[rank {self.rank}] ds_id={self.ds_id}: {action} needs status {expected.name}, found {self.status.name}"
        )

    # ------------------------------------------------------------------ holders

    @property
    def holders(self) -> int:
        """How many holds are live, over all owners."""
        return sum(self.holds.values())

    def hold(self, owner: object) -> None:
        self.holds[owner] = self.holds.get(owner, 0) + 1

    def unhold(self, owner: object) -> bool:
        """Drop one of `owner`'s holds; True when nobody holds the tensor any more."""
        count = self.holds.get(owner, 0)
        assert count > 0, f"[rank {self.rank}] ds_id={self.ds_id} released by {owner!r}, which holds none"
        if count == 1:
            del self.holds[owner]
        else:
            self.holds[owner] = count - 1
        return not self.holds

    def summary(self) -> dict:
        return {
            "id": self.ds_id,
            "status": self.status.name,
            "numel": self.numel,
            "ds_numel": self.numel,
            "shape": tuple(self.shape),
            "ds_shape": tuple(self.shape),
            "requires_grad": self.param.requires_grad,
            "grad_shape": tuple(self.param.grad.shape) if self.param.grad is not None else None,
            "persist": self.persist,
            "active_sub_modules": sorted(self.active_sub_modules),
            "holders": self.holders,
            "held_by": [repr(owner) for owner in self.holds],
            "partition_size": self.partition_size,
            "padding": self.padding,
        }


# ---------------------------------------------------------------------- bulk transitions
# [Note: bulk transitions]
# A gather moves a whole bucket of parameters at once, so the hot path (every submodule's
# forward and backward, every GatheredParameters) does these in one pass per list instead of
# one method call per parameter. Each does what the per-state method of the same name does,
# checking the same precondition on every state before it changes any.


def hold_all(states: list, owner: object) -> tuple:
    """One hold for `owner` on each state; returns `(not_available, pending_buckets)` among them."""
    missing, pending = [], {}
    for s in states:
        holds = s.holds
        holds[owner] = holds.get(owner, 0) + 1
        status = s.status
        if status is ZeroParamStatus.NOT_AVAILABLE:
            missing.append(s)
        elif status is ZeroParamStatus.INFLIGHT:
            pending[id(s.pending)] = s.pending
    return missing, list(pending.values())


def unhold_all(states: list, owner: object) -> list:
    """Drop one of `owner`'s holds on each state; returns those nobody holds any more, persistent ones aside."""
    unheld = []
    for s in states:
        holds = s.holds
        count = holds.get(owner, 0)
        if count == 1:
            del holds[owner]
            if not holds and not s.persist:
                unheld.append(s)
        else:
            assert count > 0, f"[rank {s.rank}] ds_id={s.ds_id} released by {owner!r}, which holds none"
            holds[owner] = count - 1
    return unheld


def all_to_inflight(states: list, bucket: Any) -> None:
    for s in states:
        if s.status is not ZeroParamStatus.NOT_AVAILABLE:
            s._require(ZeroParamStatus.NOT_AVAILABLE, "to_inflight")
    for s in states:
        s.pending = bucket
        s.status = ZeroParamStatus.INFLIGHT


def all_to_available(
    states: list, fulls: list, buffers: list, expected: ZeroParamStatus = ZeroParamStatus.INFLIGHT
) -> None:
    """Install each gathered tensor (shape `state.shape`) as its parameter's data.

    `buffers[i]` is what `fulls[i]`'s memory belongs to, kept in `full_buffer` (see gather.py).
    `expected` is NOT_AVAILABLE for a gather its caller waited on at once (never INFLIGHT).
    """
    available = ZeroParamStatus.AVAILABLE
    for s in states:
        if s.status is not expected:
            s._require(expected, "to_available")
    with torch._C.DisableTorchFunctionSubclass():  # internal: skip ZeroParameter's dispatch
        for s, full, buffer in zip(states, fulls, buffers):
            s.param.data = full
            s.param.__class__ = GatheredZeroParameter  # [Note: a gathered parameter skips the dispatch]
            s.full_buffer = buffer
            s.pending = None
            s.status = available


def all_to_released(states: list) -> list:
    """Free the gathered tensors; only the shards remain. Returns their `full_buffer`s, now cleared."""
    available, released = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE
    for s in states:
        if s.status is not available or s.holds:
            s._require(available, "to_released")
            assert not s.holds, f"[rank {s.rank}] ds_id={s.ds_id} released while held by {list(s.holds)}"
    buffers = [s.full_buffer for s in states]
    with torch._C.DisableTorchFunctionSubclass():  # internal: skip ZeroParameter's dispatch
        for s in states:
            s.param.data = s.placeholder
            s.param.__class__ = ZeroParameter
            s.full_buffer = None
            s.status = released
    return buffers


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
            return func(*args, **kwargs)

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
            from deepspeed.runtime.zero import gather

            gather.release_unheld([state])

    @property
    def ds_process_group(self) -> Any:
        """The group the parameter is partitioned over; the world group when Init was given none,
        as upstream's attribute holds it (`p.ds_process_group == dist.get_world_group()`)."""
        group = self._zero_state.group
        if group is None:
            from deepspeed import comm as dist

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
        return self._zero_state.summary()

    def all_gather(self, param_list: Optional[list] = None, async_op: bool = False):
        """Gather `param_list` (default: this parameter) until `partition()`; as upstream, a
        parameter gathered this way already stays gathered once, not once per call."""
        from deepspeed.runtime.zero import gather

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
        from deepspeed.runtime.zero import gather

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
        from deepspeed.runtime.zero import gather

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
        from deepspeed.runtime.zero import gather

        gather.release_api_holds(param_list or [self], has_been_updated=has_been_updated)

    def __repr__(self) -> str:
        state = self._zero_state
        return f"ZeroParameter(ds_id={state.ds_id}, shape={tuple(state.shape)}, status={state.status.name})"

    def __deepcopy__(self, memo: dict) -> ZeroParameter:
        if id(self) in memo:
            return memo[id(self)]
        copy = nn.Parameter(_empty_like_data(self), requires_grad=self.requires_grad)
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
    state = ZeroParamState(param, group, world_size, rank, remote_device, shard_out)
    param.__class__ = GatheredZeroParameter  # its status starts AVAILABLE
    param._zero_state = state
    return param
