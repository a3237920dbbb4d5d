"""`zero.Init` and `zero.GatheredParameters`, each with public `start()` / `stop()`.

[Note: start()/stop() are the implementation, `with` is sugar]
Both classes keep `__enter__` / `__exit__`, which only call `start()` / `stop()`, so that the
`with` block and explicit calls run one gather/partition implementation. That lets model
code write a gathered block once for ZeRO-3 and plain runs:

    gather = GatheredParameters(old.weight, modifier_rank=0, enabled=zero3).start()
    new.weight.data[:n] = old.weight.data[:n]
    gather.stop()

A per-instance `StartStopTracker` makes unbalanced calls raise even when `enabled=False`.

This module also keeps the upstream names clients import: `ZeroParamStatus`,
`zero_wrapper_for_fp_tensor_constructor` (looked up here by name each time an Init starts,
so a client may swap it) and the `_orig_torch_*` factories.
"""

from __future__ import annotations

import operator
import os
import sys
import warnings
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed import process_state
from deepspeed.accelerator import get_accelerator  # noqa: F401 - an upstream name clients read here
from deepspeed.runtime.agreement import check_agreement, describe_parameters
from deepspeed.runtime.config_loading import load_config_dict
from deepspeed.runtime.zero import edits, gather, param_swap
from deepspeed.runtime.zero.external_params import (  # noqa: F401 - upstream names, re-exported
    external_parameters,
    named_external_parameters,
    register_external_parameter,
    unregister_external_parameter,
)
from deepspeed.runtime.zero.gather import MultipleAllGatherHandles  # noqa: F401 - upstream name
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus, ZeroParamType, shard_sizes
from deepspeed.runtime.zero.linear import TORCH_LINEAR_MARK
from deepspeed.runtime.zero.parameter import IN_PLACE_INIT, ZeroParameter, is_zero_param, make_zero_param
from deepspeed.runtime.zero.patching import (  # noqa: F401 - upstream names, re-exported
    PATCHES,
    _orig_torch_arange,
    _orig_torch_empty,
    _orig_torch_eye,
    _orig_torch_full,
    _orig_torch_ones,
    _orig_torch_randn,
    _orig_torch_tensor,
    _orig_torch_zeros,
    zero_wrapper_for_fp_tensor_constructor,
)
from deepspeed.runtime.zero.start_stop import StartStopTracker, live_contexts
from deepspeed.utils.groups import mics_layout_for

__all__ = [
    "GatheredParameters",
    "MultipleAllGatherHandles",
    "partitioned_param_data_shape",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "ZeroParameter",
    "is_zero_param",
    "live_contexts",
    "register_external_parameter",
    "restore_init_context",
    "shutdown_init_context",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

# The shape of `param.data` while a parameter is partitioned (upstream's constant).
partitioned_param_data_shape = [0]

_SUPPORTED_REMOTE_DEVICES = (None, "none", "cpu", "nvme")
# Freeing at least this much after converting a module is worth asking the allocator to trim.
_TRIM_AFTER_BYTES = 1 << 20


# ============================================================================ Init settings


class _InitConfig:
    """What `zero.Init` reads of a DeepSpeed config: the training dtype and the typed
    `zero_optimization` section. The engine's `DeepSpeedConfig` gives both as it parsed them;
    a dict or a JSON file has its zero section parsed once, when first needed, with
    ``strict=False`` (HF enters Init before it resolves the config's "auto" values)."""

    def __init__(self, dtype: torch.dtype, zero: Any = None, raw: Optional[dict] = None) -> None:
        self.dtype = dtype
        self._zero = zero  # a DeepSpeedZeroConfig, or None until parsed from `raw`
        self._raw = raw

    def zero(self) -> Any:
        if self._zero is None:
            from deepspeed.runtime.zero.config import get_zero_config

            self._zero = get_zero_config(self._raw, strict=False)
        return self._zero


def _load_config(config_dict_or_path: Any) -> _InitConfig:
    from deepspeed.runtime.config import DeepSpeedConfig

    if isinstance(config_dict_or_path, DeepSpeedConfig):
        config = config_dict_or_path
        dtype = _train_dtype(config.bfloat16_enabled, config.fp16_enabled)
        return _InitConfig(dtype, zero=config.zero_config, raw=config._param_dict)
    cfg = _read_config_dict(config_dict_or_path)
    bf16 = cfg.get("bf16", cfg.get("bfloat16", {})) or {}  # the `enabled` switches as written
    return _InitConfig(
        _train_dtype(bf16.get("enabled", False), (cfg.get("fp16") or {}).get("enabled", False)), raw=cfg
    )


def _train_dtype(bf16: Any, fp16: Any) -> torch.dtype:
    """bf16, else fp16, else fp32, as the engine will train the model."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def _read_config_dict(config_dict_or_path: Any) -> dict:
    if config_dict_or_path is None:
        return {}
    if isinstance(config_dict_or_path, dict):
        return config_dict_or_path
    if hasattr(config_dict_or_path, "_param_dict"):  # another config object holding the dict
        return config_dict_or_path._param_dict
    if isinstance(
        config_dict_or_path, (str, os.PathLike)
    ):  # a file (JSON or HJSON) or base64, as initialize reads
        return load_config_dict(config_dict_or_path)
    raise TypeError(
        f"zero.Init: config_dict_or_path must be a dict, a JSON path or a DeepSpeedConfig, "
        f"got {type(config_dict_or_path).__name__}"
    )


class _InitSettings:
    """What an active Init applies to modules built under it (the innermost one governs)."""

    dtype: torch.dtype
    device: torch.device  # where parameters are created and gathered
    remote_device: Optional[str]  # where shards live; None: on `device`
    swapper: Any  # NVMe: the ParamSwapper the shards swap through (param_swap.py), else None
    pin_memory: bool
    group: Any  # the partition process group (None: the world)
    broadcast_group: Any  # whose rank 0 gives every initial value (the group, or the world for MiCS)
    world_size: int
    rank: int
    sanity_checks: bool
    override_module_apply: bool  # False: leave nn.Module.apply unpatched
    mem_efficient_linear: bool  # False: the engine leaves these modules on torch's F.linear

    def __init__(self, init: Init) -> None:

        accelerator = get_accelerator()
        self.dtype = init.dtype
        self.device = torch.device(accelerator.current_device_name())
        self.swapper = init._swap.swapper() if init._swap is not None else None  # resident shards: CPU
        self.remote_device = None if init.remote_device in (None, "none") else "cpu"
        self.pin_memory = bool(init.pin_memory) and self.remote_device == "cpu"
        # MiCS (docs/hierarchical.md): a shard group; every replica starts from rank 0's values.
        mics = mics_layout_for(init.mics_config) if init.group is None else None
        self.group = init.group if mics is None else mics.shard_group
        self.broadcast_group = self.group if mics is None else None
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.sanity_checks = init.sanity_checks
        self.override_module_apply = init.override_module_apply
        self.mem_efficient_linear = init.mem_efficient_linear


# ============================================================================ the Init stack


class _InitStack:
    """The one owner of which Inits are active; it installs and removes the patches.

    [Note: nested Init]
    Module-class patches are installed when the first Init starts and removed when the last
    stops; tensor factories are re-bound to the innermost active Init's dtype each time the
    stack changes, so the innermost Init governs what is built (as nested `torch.device`
    contexts do). Stops must be last-in-first-out.
    """

    def __init__(self) -> None:
        self.active: list = []  # (Init, _InitSettings), outermost first
        self.paused = False  # shutdown_init_context() while the engine is built

    def innermost(self) -> Optional[_InitSettings]:
        return self.active[-1][1] if self.active else None

    def push(self, init: Init, settings: _InitSettings) -> None:
        self.active.append((init, settings))
        try:
            self.sync_patches()
        except BaseException:
            self.active.pop()
            raise

    def check_top(self, init: Init) -> None:
        top = self.active[-1][0] if self.active else None
        if top is not init:
            raise RuntimeError(
                f"{init._describe()}.stop() was called while the inner {top._describe()} "
                f"(started at {top._tracker.start_site}) is still active; stop the inner Init first "
                "(Init stops are last-in-first-out)"
            )

    def pop(self, init: Init) -> None:
        self.active.pop()
        self.sync_patches()

    def sync_patches(self) -> None:
        """Make the installed patches match the stack; on any error, remove them all."""
        try:
            settings = self.innermost()
            if settings is None or self.paused:
                IN_PLACE_INIT.hook = None
                PATCHES.remove_all()
                return
            if not PATCHES.modules.installed:
                PATCHES.modules.install(_convert_built_module, None)
                IN_PLACE_INIT.hook = _gathered_in_place
            # The innermost Init's `override_module_apply` decides, like its dtype.
            PATCHES.modules.set_apply_hook(_gathered_apply if settings.override_module_apply else None)
            # Looked up by name at each start: a client may have swapped the wrapper.
            PATCHES.factories.bind(
                globals()["zero_wrapper_for_fp_tensor_constructor"], settings.dtype, settings.device
            )
        except BaseException:
            IN_PLACE_INIT.hook = None
            PATCHES.remove_all()
            raise

    def reset(self) -> None:
        """For tests: forget every active Init and undo every patch."""
        self.active.clear()
        self.paused = False
        IN_PLACE_INIT.hook = None
        PATCHES.remove_all()


_INIT_STACK = _InitStack()
process_state.register(
    "deepspeed.runtime.zero.partition_parameters._INIT_STACK", _INIT_STACK, _INIT_STACK.reset
)


def shutdown_init_context() -> None:
    """Pause every active Init's patches (the engine calls this while it is built)."""
    _INIT_STACK.paused = True
    _INIT_STACK.sync_patches()


def restore_init_context() -> None:
    """Undo `shutdown_init_context()`."""
    _INIT_STACK.paused = False
    _INIT_STACK.sync_patches()


def _convert_built_module(module: nn.Module) -> None:
    """The module-patch hook: runs when a module's outermost `__init__` returns."""
    settings = _INIT_STACK.innermost()
    if settings is not None:
        _convert_module_with(module, settings)


def _convert_module_with(module: nn.Module, settings: _InitSettings) -> None:
    # A parameter on the meta device (`torch.nn.utils.skip_init`, `device="meta"`) has no
    # values to broadcast or shard: it stays as it is until materialised. `to_empty` under
    # an active Init partitions it then (patching.py); otherwise the engine partitions it at
    # `deepspeed.initialize` like any plain parameter.
    own = [
        (name, p)
        for name, p in module._parameters.items()
        if p is not None and not is_zero_param(p) and p.device.type != "meta"
    ]
    if own:
        convert_params([p for _, p in own], settings, own, type(module).__name__)
    if not settings.mem_efficient_linear:
        module.__dict__[TORCH_LINEAR_MARK] = True  # read by zero/linear.py's route_linears


def convert_params(
    params: list, settings: _InitSettings, named: Optional[list] = None, owner: str = ""
) -> None:
    """Cast, place, broadcast from group rank 0, and partition `params` (plain Parameters).

    The ranks first check that they hold the same parameters (names, shapes, dtypes): the
    broadcast's sizes come from the model code, and a rank-dependent width would otherwise
    abort one rank and hand the others garbage (see runtime/agreement.py's note).
    """
    if settings.world_size > 1:
        check_agreement(
            f"zero.Init: the parameters of a {owner or 'module'}",
            describe_parameters(named or [(str(i), p) for i, p in enumerate(params)]),
            settings.group,
            "Every rank must build the same model; check sizes read from per-rank files or environment.",
        )
    for p in params:
        data = p.data.to(settings.device)
        if data.is_floating_point() and data.dtype != settings.dtype:
            data = data.to(settings.dtype)
        p.data = data
    if dist.get_world_size(settings.broadcast_group) > 1:
        # Ranks may have drawn different random initial values: rank 0's are the model.
        src = dist.get_global_rank(settings.broadcast_group, 0)
        edits.broadcast_coalesced([p.data for p in params], src, settings.broadcast_group)

    accelerator = get_accelerator()
    shard_views = _flat_shard_views(params, settings, accelerator)
    for p, view in zip(params, shard_views):
        make_zero_param(p, settings.group, settings.world_size, settings.rank, settings.remote_device, view)
        if settings.swapper is not None:
            settings.swapper.adopt(p._zero_state)  # [Note: a swapped shard] in param_swap.py
        p._zero_state.sanity_checks = settings.sanity_checks
        gather.partition_new_state(p._zero_state)
    if sum(p.ds_numel * p.element_size() for p in params) >= _TRIM_AFTER_BYTES:
        accelerator.empty_cache()  # hand the freed full tensors back (glibc keeps them otherwise)


def _flat_shard_views(params: list, settings: _InitSettings, accelerator) -> list:
    """Zeroed shard tensors for `params`, adjacent views of one flat buffer per dtype.

    A module's shards then sit next to each other, so gathering the module (what the engine
    does) feeds the all-gather a view instead of concatenating (see gather.py).
    """
    if settings.swapper is not None:
        return [None] * len(params)  # own tensors: each partition swaps alone
    device = torch.device(settings.remote_device) if settings.remote_device else settings.device
    sizes = [shard_sizes(p.numel(), settings.world_size)[0] for p in params]
    views: list = [None] * len(params)
    by_dtype: dict = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        flat = torch.zeros(sum(sizes[i] for i in indices), dtype=dtype, device=device)
        if settings.pin_memory:
            flat = accelerator.pin_memory(flat)
        for i, piece in zip(indices, torch.split(flat, [sizes[i] for i in indices])):
            views[i] = piece
    return views


def cast_partitioned(module: nn.Module, dtype: torch.dtype) -> None:
    """Re-type the floating-point shards of `module`'s ZeRO parameters to `dtype`.

    An engine trains in one dtype; a model built under an Init of another one (fp32 when
    Init had no config) would otherwise train parameters of one dtype beside buffers of
    another. Each module's shards stay back to back in one flat buffer (see gather.py).
    """
    for sub in module.modules():
        states = [
            p._zero_state
            for p in sub._parameters.values()
            if p is not None and is_zero_param(p) and p.dtype.is_floating_point and p.dtype != dtype
        ]
        states = gather.zero_states(s.param for s in states)  # tied parameters once
        if not states:
            continue
        busy = [s.ds_id for s in states if s.status is not ZeroParamStatus.NOT_AVAILABLE or s.holds]
        if busy:
            raise RuntimeError(
                f"cannot cast parameters ds_id={busy} of {type(sub).__name__} to {dtype}: they are gathered; "
                "stop every GatheredParameters over the model before deepspeed.initialize"
            )
        for s, view in zip(states, param_swap.retype_targets(states, dtype)):
            s.retype_shard(view)


def _gathered_apply(module: nn.Module, fn) -> nn.Module:
    """`Module.apply` under Init: each module's own parameters are gathered around `fn`.

    Children first, then the module itself, as torch does; `fn`'s edits on rank 0 are what
    every rank keeps (`modifier_rank=0`).
    """
    for child in module.children():
        child.apply(fn)
    own = [p for p in module._parameters.values() if p is not None]
    with GatheredParameters(own, modifier_rank=0):
        fn(module)
    return module


def _gathered_in_place(param: ZeroParameter, func, args: tuple, kwargs: dict) -> Any:
    """An in-place op on a partitioned parameter while Init is active (see parameter.py's note).

    Every rank runs it, keeping RNG streams in step with a plain run; rank 0's result is kept.
    """
    with GatheredParameters(param, modifier_rank=0):
        result = func(*args, **kwargs)
    return param if result is param else result


# ============================================================================ Init


class Init:
    """Build modules with their parameters partitioned across ranks as they are created.

    Constructing it does no work: `start()` (or `with`) installs the patches, `stop()`
    removes them. `module=` converts an already-built model at construction, as upstream.
    """

    def __init__(
        self,
        module: Optional[nn.Module] = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: Optional[str] = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: Optional[torch.dtype] = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        # mem_efficient_linear: upstream replaces F.linear for the whole process with a variant
        # that saves the parameter, not a view of its gathered tensor, for backward. Here the
        # ZeRO-3 engine routes its own nn.Linear modules through such a function (zero/linear.py);
        # False marks the modules this Init builds to keep torch's F.linear, whose saved view
        # keeps each gathered weight alive until its backward (same results, more memory).
        self.mem_efficient_linear = bool(mem_efficient_linear)
        if zero_param_parallel_group is not None:
            raise NotImplementedError(
                "zero.Init: zero_param_parallel_group (ZeRO++ hpZ's group) is not supported; pass None (parameters are "
                "partitioned over the data-parallel group; hpZ comes from zero_optimization.zero_hpz_partition_size)"
            )
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise NotImplementedError(
                "zero.Init: quantized weights (ZeRO++ qwZ) are not supported as Init arguments; pass False "
                "(the engine quantizes gathers from zero_optimization.zero_quantized_weights / "
                "zero_quantized_nontrainable_weights)"
            )
        if param_swapper is not None:
            raise NotImplementedError(
                "zero.Init: param_swapper is not supported; pass None (NVMe swapping comes from remote_device='nvme' "
                "with the config's zero_optimization.offload_param block)"
            )
        if remote_device not in _SUPPORTED_REMOTE_DEVICES:
            raise ValueError(
                f"zero.Init: remote_device={remote_device!r} is not supported; use None (shards on the "
                "compute device), 'cpu' or 'nvme'"
            )
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"zero.Init: dtype={dtype!r} must be a floating torch.dtype such as torch.bfloat16"
            )
        cfg = _load_config(config_dict_or_path if config_dict_or_path is not None else config)
        if remote_device is None:
            remote_device, pin_memory = param_swap.offload_from_config(cfg.zero(), pin_memory)
        self.enabled = enabled
        self.dtype = dtype if dtype is not None else cfg.dtype
        self.remote_device = remote_device
        self.pin_memory = pin_memory
        zero = cfg.zero() if enabled else None
        self._swap = param_swap.SwapSetup.of(zero, cfg._raw, remote_device)  # None unless "nvme"
        self.sanity_checks = bool(zero.enable_sanity_checks) if zero is not None else False
        self.override_module_apply = bool(zero.override_module_apply) if zero is not None else True
        self.group = self._choose_group(data_parallel_group, mpu, sequence_data_parallel_group)
        self.mics_config = zero if mpu is None else None  # its mics_shard_size, where no group is given
        self._tracker = StartStopTracker(self, self._describe())
        if module is not None and enabled:
            self._convert_existing(module)

    @staticmethod
    def _choose_group(data_parallel_group, mpu, sequence_data_parallel_group):
        if sequence_data_parallel_group is not None:
            if data_parallel_group is not None:  # as upstream: which one would win is a guess
                raise ValueError(
                    "zero.Init: both data_parallel_group and sequence_data_parallel_group were given; pass only "
                    "data_parallel_group (sequence_data_parallel_group is upstream's deprecated name for it)"
                )
            return sequence_data_parallel_group
        if data_parallel_group is not None:
            return data_parallel_group
        if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_group"):
            return mpu.get_sequence_data_parallel_group()  # sequence parallelism: partition over every rank
        if mpu is not None:
            return mpu.get_data_parallel_group()
        return None

    def _describe(self) -> str:
        state = "" if self.enabled else ", enabled=False"
        return f"zero.Init(dtype={self.dtype}{state})"

    def _convert_existing(self, module: nn.Module) -> None:
        dist.init_distributed(verbose=False)
        settings = _InitSettings(self)
        for sub in module.modules():
            _convert_module_with(sub, settings)
        if self._swap is not None:  # every rank raises a swap set-up failure, none hangs
            self._swap.check(self.group)

    def start(self) -> Init:
        """Start partitioning modules as they are built; returns `self`."""
        self._tracker.begin()
        if not self.enabled:
            return self  # a no-op that still tracks start/stop
        try:
            dist.init_distributed(verbose=False)
            _INIT_STACK.push(self, _InitSettings(self))
        except BaseException:
            self._tracker.end()
            raise
        return self

    def stop(self) -> None:
        """Stop partitioning; the last active Init removes every patch."""
        if self._tracker.active and self.enabled:
            _INIT_STACK.check_top(self)
        self._tracker.end()
        if self.enabled:
            _INIT_STACK.pop(self)
        if self._swap is not None and sys.exc_info()[0] is None:  # not while a `with` body's error
            self._swap.check(self.group)  # propagates: the other ranks may be elsewhere

    def __enter__(self) -> Init:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()


# ============================================================================ GatheredParameters


def _as_param_list(params: Any) -> list:
    """`params` as a list of tensors and Nones (`gather.zero_states` keeps the ZeRO parameters).

    Any other entry raises: upstream keeps what has a `ds_id` and drops the rest, so a module
    or `named_parameters()`'s pairs gathered nothing, and the body then read `[0]` tensors.
    """
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if not isinstance(params, Iterable) or isinstance(params, (str, bytes)):
        raise TypeError(
            f"GatheredParameters: params must be a tensor or an iterable of tensors (module.parameters(), "
            f"a list), got {type(params).__name__}"
        )
    items = list(params)
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, torch.Tensor):
            pair = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            hint = "module.parameters(), not named_parameters()" if pair else "tensors (module.parameters())"
            raise TypeError(f"GatheredParameters: params[{i}] is a {type(item).__name__}; pass {hint}")
    return items


class GatherHold:
    """The owner of the holds one `GatheredParameters` takes, and what its live gather needs.

    The parameters' hold tables refer to this object, not to the `GatheredParameters`, so one
    that is started and dropped without `stop()` can still be garbage-collected and reported
    (a `ResourceWarning` naming where it started, see start_stop.py). Its parameters then stay
    gathered, held by this object, and the engine keeps writing back a `modifier_rank`'s edits
    at each step, exactly as while the dropped object was alive.
    """

    __slots__ = ("states", "modifier_rank", "handle", "enabled")

    def __init__(self, states: list, modifier_rank: Optional[int], enabled: bool) -> None:
        self.states = states
        self.modifier_rank = modifier_rank
        self.handle: Optional[gather.GatherHandle] = None  # set while gathered
        self.enabled = enabled

    def write_back_edits(self) -> None:
        """Broadcast the modifier rank's tensors and write them into every rank's shards."""
        if self.modifier_rank is None or self.handle is None:
            return
        self.handle.wait()
        edits.broadcast_full(self.states, self.modifier_rank)
        for s in self.states:
            s.write_back()

    def __repr__(self) -> str:
        # Made when a message asks (the tracker's, a hold table's), not on every gather.
        flags = "" if self.enabled else ", enabled=False"
        return (
            f"GatheredParameters({len(self.states)} ZeRO params, modifier_rank={self.modifier_rank}{flags})"
        )


def live_modifier_gathers(states: list) -> list:
    """The live gathers holding any of `states` whose edits a `modifier_rank` writes back, each
    once, in the order of `states` (by ds_id: the same on every rank, so their collectives match)."""
    writers: dict = {}
    for state in states:
        for owner in state.holds:
            if isinstance(owner, GatherHold) and owner.modifier_rank is not None:
                writers.setdefault(id(owner), owner)
    return list(writers.values())


class GatheredParameters:
    """Gather ZeRO-3 parameters between `start()` and `stop()` (or inside a `with` block).

    `params`: one tensor or any iterable; None entries and non-ZeRO tensors are dropped,
    duplicates removed, the rest ordered by `ds_id`. `modifier_rank=k`: on stop, group
    rank k's tensors are broadcast and every rank keeps its slice; `None`: edits are
    discarded (and detected, with `zero_optimization.enable_sanity_checks`). Overlapping
    gathers of one parameter are reference-counted (see gather.py).
    """

    def __init__(
        self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None, enabled: bool = True
    ):
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        candidates = _as_param_list(params)  # validated even when disabled: misuse is loud
        self._states = gather.zero_states(candidates) if enabled else []
        self._exception_at_start: Optional[BaseException] = None
        self._sanity_checks = False  # read by start() for stop() (an engine may turn them on in between)
        if self._states:
            self.modifier_rank = modifier_rank = self._checked_modifier_rank(modifier_rank)
            if fwd_module is not None:
                for s in self._states:
                    register_external_parameter(fwd_module, s.param)
        self._hold = GatherHold(self._states, modifier_rank, enabled)  # see GatherHold
        self._tracker = StartStopTracker(self, self._hold)  # the hold's repr names this object

    def _describe(self) -> str:
        return repr(self._hold)

    def _checked_modifier_rank(self, modifier_rank: Any) -> Optional[int]:
        """`modifier_rank` as an int (an integer-like such as numpy.int64 too), after checking it."""
        if modifier_rank is None:
            return None
        try:
            rank = None if isinstance(modifier_rank, bool) else operator.index(modifier_rank)
        except TypeError:
            rank = None
        if rank is None:
            raise TypeError(
                f"GatheredParameters: modifier_rank={modifier_rank!r} must be an int rank or None"
            )
        for s in self._states:
            if not 0 <= rank < s.world_size:
                raise ValueError(
                    f"GatheredParameters: modifier_rank={rank} is outside parameter ds_id={s.ds_id}'s "
                    f"group of {s.world_size} ranks; pass a rank in [0, {s.world_size}) or None"
                )
        return rank

    @property
    def params(self) -> list:
        return [s.param for s in self._states]

    def start(self, async_op: bool = False) -> GatheredParameters:
        """Gather the parameters and return `self`; with `async_op=True`, `wait()` completes it."""
        self._tracker.begin()
        # An exception already being handled around start() is not the body's (see stop's note).
        self._exception_at_start = sys.exc_info()[1]
        if not self._states:
            return self  # disabled, or no ZeRO parameter: nothing to gather
        try:
            # A list: faster than a generator.
            self._sanity_checks = any([s.sanity_checks for s in self._states])
            if self._sanity_checks:
                # The all-gather's sizes come from the caller's list: ranks must pass the same one.
                check_agreement(
                    "GatheredParameters.start(): the parameters to gather",
                    [str(s.ds_id) for s in self._states],
                    self._states[0].group,
                    "Every rank must gather the same parameters, in any order.",
                )
            self._hold.handle = gather.fetch_states(self._states, self._hold, async_op=async_op)
        except BaseException:
            self._tracker.end()
            raise
        return self

    def wait(self) -> None:
        """Complete an asynchronous `start(async_op=True)`."""
        if not self._tracker.active:
            raise RuntimeError(
                f"{self._describe()}.wait() was called while it is not active; call start() first"
            )
        if self._hold.handle is not None:
            self._hold.handle.wait()

    def stop(self) -> None:
        """Write back (modifier_rank) or discard edits, then release the parameters.

        [Note: a body that raised on some ranks only]
        With `modifier_rank`, stop broadcasts the modifier's tensors. If the body raised on
        some ranks and not on others, the ranks would go separate ways after the broadcast and
        the next collective would hang. So the ranks first agree, in one small all-reduce,
        whether the body raised anywhere; if it did, every rank discards the edits and the
        ranks whose body succeeded raise an error naming the ranks that failed. Called by
        `__exit__` (a `with`, an ExitStack), stop reads the exception `__exit__` was given,
        from its frame: `__exit__` only calls `stop()` (the two forms share one path). Called
        by hand, it counts the body as failed when an exception is being handled that was
        not at `start()`: Python tells a `finally` that an exception passes through from an
        `except` block that caught it in no way, so a `stop()` inside an `except` block
        discards the edits too, and warns so.
        """
        caller = sys._getframe(1)
        told = caller.f_code is _WITH_EXIT
        if told:
            raised = caller.f_locals["exc"]
        else:
            raised = sys.exc_info()[1]
            raised = None if raised is self._exception_at_start else raised
        self._tracker.end()
        if not self._states:
            return
        failed_here = raised is not None
        states, updated = self._states, False
        try:
            self._hold.handle.wait()
            if self.modifier_rank is not None:
                # A tensor of another shape or dtype put in place of a gathered one cannot be
                # broadcast into the others (their collective would not match): a failure too.
                replaced = [
                    f"ds_id={s.ds_id} {tuple(s.param.data.shape)} {s.param.data.dtype} (gathered as "
                    f"{tuple(s.shape)} {s.shard_dtype})"
                    for s in states
                    if s.param.data.shape != s.shape or s.param.data.dtype != s.shard_dtype
                ]
                failed = edits.ranks_that_failed(states, failed_here or bool(replaced))
                if not failed:
                    edits.broadcast_full(states, self.modifier_rank)
                    updated = True
                elif replaced and not failed_here:
                    raise ValueError(
                        f"{self._describe()}: the body replaced parameters with tensors of another shape "
                        f"or dtype: {'; '.join(replaced)}; edit them in place (p.data[...] = ..., "
                        "p.data.copy_(...)); the edits were discarded on every rank"
                    )
                elif not failed_here:
                    raise RuntimeError(
                        f"{self._describe()}: the body raised or replaced a parameter on rank(s) {failed}; "
                        "the edits were discarded on every rank (see the error on those ranks)"
                    )
                elif not told:  # maybe an exception the caller handled: say what was dropped
                    warnings.warn(
                        f"{self._describe()}.stop() ran while {raised!r} was being raised or handled, so the "
                        "body counts as failed and its edits were discarded on every rank; if that exception "
                        "was handled (stop() inside an `except` block), call stop() after the block, or use "
                        "the `with` form, which tells the two apart",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            elif self._sanity_checks:
                self._raise_on_discarded_edits(states)
        finally:
            self._hold.handle = None
            gather.release_states(states, self._hold, has_been_updated=updated)

    def write_back_edits(self) -> None:
        """Make the modifier rank's edits so far every rank's and write them into the shards.

        The parameters stay gathered. `engine.step()` calls this for a live gather with a
        `modifier_rank`, so edits made before the step are what the optimizer steps from.
        """
        if self._tracker.active:
            self._hold.write_back_edits()

    @staticmethod
    def _raise_on_discarded_edits(states: list) -> None:
        changed = edits.find_discarded_edits(states)
        if changed:
            raise RuntimeError(
                f"GatheredParameters(modifier_rank=None) would discard edits to parameters with ds_id "
                f"{changed}; pass modifier_rank=<the rank that edits> to keep them"
            )

    def __enter__(self) -> GatheredParameters:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()


_WITH_EXIT = GatheredParameters.__exit__.__code__  # how stop() knows `__exit__` called it
