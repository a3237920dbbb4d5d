"""`FlopsProfiler` and `get_model_profile`: the flops, MACs, parameters and latency of a forward,
per module (upstream's `deepspeed.profiling.flops_profiler` API).

[Note: how a forward is attributed to modules]
`start_profile()` registers a forward pre-hook and a forward hook on every submodule and
enters a `CountingMode` (counting.py, [Note: counting at the dispatcher]). The hooks keep
the set of modules whose forward is running; every priced operator is added to each of
them, so a module's figures are inclusive: everything its forward ran, its children's
included, each call added up (a module called twice counts twice). A module never called
itself (an `nn.ModuleList`) shows the sum of its children, as upstream. The latency of a
module is the wall time between its two hooks, with the accelerator synchronized at each.
Parameters are counted per module over `module.parameters()` (children included, shared
ones once), a ZeRO-3 parameter at its full size (`ds_numel`), whatever this rank holds.

`stop_profile()` leaves the mode, removes the hooks and writes the figures onto each module
as upstream's attributes (`__flops__`, `__macs__`, `__params__`, `__duration__`; here each
is inclusive, so `get_module_flops(module)` reads it as it is and gives upstream's number);
`end_profile()` removes them. Nothing outside the model is touched: no function of
`torch` or `torch.nn.functional` is replaced at any point.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from deepspeed.accelerator import get_accelerator
from deepspeed.profiling.flops_profiler.counting import CountingMode
from deepspeed.profiling.flops_profiler.formatting import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from deepspeed.profiling.flops_profiler.report import aggregated_lines, write_profile
from deepspeed.utils.logging import logger

__all__ = [
    "FlopsProfiler",
    "get_model_profile",
    "get_module_flops",
    "get_module_macs",
    "get_module_duration",
    "number_to_string",
    "flops_to_string",
    "macs_to_string",
    "params_to_string",
    "duration_to_string",
    "bytes_to_string",
]

_ATTRIBUTES = ("__flops__", "__macs__", "__params__", "__duration__")


@dataclasses.dataclass
class ModuleRecord:
    """What one module's forward calls ran while profiling (inclusive of its children)."""

    flops: int = 0
    macs: int = 0
    duration: float = 0.0  # seconds, all calls
    calls: int = 0
    depth: int = 0  # nested calls of this module now running
    started_at: float = 0.0  # the outermost running call's start


class FlopsProfiler:
    """Measures the flops, MACs, parameters and latency of a model's forward, per module.

    `start_profile()`, run the forward, `stop_profile()`, read (`get_total_flops()`, ...,
    `print_model_profile()`), then `end_profile()`. `ds_engine` (the engine, when it drives
    the profiler) adds the engine's world sizes, batch size and its forward, backward and
    step timers to the printed summary; `recompute_fwd_factor` is the share of the forward
    that activation checkpointing runs again in backward (0.0 to 1.0), used in the backward
    FLOPS estimate (backward = (2 + factor) x forward).
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler: model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False  # start_profile() ran and end_profile() did not yet
        self.func_patched = False  # counting now (upstream's name: the mode is entered)
        self.records: dict = {}  # id(module) -> ModuleRecord, every module of the model
        self.op_counts: dict = {}  # ATen operator name -> [flops, macs, calls], all ops seen
        self._running: list = []  # records of the modules whose forward is running
        self._handles: list = []
        self._mode: Optional[CountingMode] = None
        self._synchronize: Any = None  # the accelerator's synchronize(), while profiling

    # ------------------------------------------------------------------ lifecycle

    def start_profile(self, ignore_list: Optional[list] = None) -> None:
        """Start counting (again: the figures restart from zero). Modules whose type is in
        `ignore_list` get no hooks of their own: their work counts in their parents."""
        if self.func_patched:
            raise RuntimeError("FlopsProfiler.start_profile(): already profiling; call stop_profile() first")
        self.reset_profile()
        self._synchronize = get_accelerator().synchronize  # chosen now, not inside the first timing
        _warm_up_dispatch_modes()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if type(module) in ignored:
                continue
            record = self.records[id(module)]
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(record)))
            self._handles.append(module.register_forward_hook(self._post_hook(record), always_call=True))
        self._mode = CountingMode(self._count)
        self._mode.__enter__()
        self.started = self.func_patched = True
        logger.info("Flops profiler started")

    def stop_profile(self) -> None:
        """Stop counting: leave the counting mode and remove the hooks; the figures stay."""
        if not self.func_patched:
            return
        if _get_current_dispatch_mode() is not self._mode:
            raise RuntimeError(
                "FlopsProfiler.stop_profile(): another TorchDispatchMode was entered after start_profile() "
                "and is still active; leave it first (modes must be left in the reverse order)"
            )
        mode, self._mode = self._mode, None
        self.func_patched = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._running.clear()
        mode.__exit__(None, None, None)
        self._publish()

    def reset_profile(self) -> None:
        """Zero every figure (and measure the parameters again)."""
        self.records = {id(m): ModuleRecord() for m in self.model.modules()}
        self.op_counts = {}

    def end_profile(self) -> None:
        """Stop if needed and remove the attributes profiling added to the modules."""
        if not self.started:
            return
        self.stop_profile()
        self.started = False
        for module in self.model.modules():
            for name in _ATTRIBUTES:
                module.__dict__.pop(name, None)
        logger.info("Flops profiler finished")

    # ------------------------------------------------------------------ counting

    def _count(self, name: str, flops: int, macs: int) -> None:
        entry = self.op_counts.setdefault(name, [0, 0, 0])
        entry[0] += flops
        entry[1] += macs
        entry[2] += 1
        for record in self._running:
            record.flops += flops
            record.macs += macs

    def _pre_hook(self, record: ModuleRecord):
        def hook(module: nn.Module, args: Any) -> None:
            if record.depth == 0:
                self._synchronize()
                record.started_at = time.perf_counter()
                self._running.append(record)
            record.depth += 1
            record.calls += 1

        return hook

    def _post_hook(self, record: ModuleRecord):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if record.depth == 0:
                return  # its pre-hook ran before start_profile()
            record.depth -= 1
            if record.depth == 0:
                self._synchronize()
                record.duration += time.perf_counter() - record.started_at
                self._running.remove(record)

        return hook

    def _publish(self) -> None:
        for module in self.model.modules():
            stats = self.module_stats(module)
            for name, value in zip(_ATTRIBUTES, stats):  # flops, macs, params, duration
                module.__dict__[name] = value

    # ------------------------------------------------------------------ reading

    def module_stats(self, module: nn.Module) -> tuple:
        """`(flops, macs, params, duration in seconds)` of `module`, inclusive of its children."""
        flops, macs, duration = self._inclusive(module)
        return flops, macs, module_params(module), duration

    def _inclusive(self, module: nn.Module) -> tuple:
        record = self.records.get(id(module))
        if record is None:
            return 0, 0, 0.0
        if record.calls:
            return record.flops, record.macs, record.duration
        children = [self._inclusive(child) for child in module.children()]
        return tuple(sum(parts) for parts in zip((0, 0, 0.0), *children))

    def get_total_flops(self, as_string: bool = False):
        """Floating-point operations of the model's forward."""
        flops = self._inclusive(self.model)[0]
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        """Multiply-accumulate operations of the model's forward."""
        macs = self._inclusive(self.model)[1]
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False):
        """Seconds the model's forward took (all profiled calls)."""
        duration = self._inclusive(self.model)[2]
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False):
        """Parameters of the model, ZeRO-3 ones at full size."""
        params = module_params(self.model)
        return params_to_string(params) if as_string else params

    def get_op_counts(self) -> dict:
        """`{ATen operator: (flops, macs, calls)}` over everything run while profiling."""
        return {name: tuple(entry) for name, entry in sorted(self.op_counts.items())}

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: Optional[str] = None,
    ) -> None:
        """Print the summary, the top modules per depth and (`detailed`) the annotated model;
        to `output_file` (its folder created) instead of stdout when given."""
        if not self.started:
            return
        write_profile(self, profile_step, module_depth, top_modules, detailed, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the `top_modules` module types by params, MACs and latency at each depth."""
        if not self.started:
            print("FlopsProfiler: nothing to print; call start_profile() and run a forward first")
            return
        print("\n".join(aggregated_lines(self, module_depth, top_modules)))


def _warm_up_dispatch_modes() -> None:
    """Torch imports dynamo (seconds) the first time a process runs an operator under a
    dispatch mode: pay it here, not inside the first module's timing."""
    with CountingMode(lambda name, flops, macs: None):
        torch.zeros(1).add_(1)


def module_params(module: nn.Module) -> int:
    """Parameters of `module` and its children, each once; a ZeRO-3 one at its full size."""
    return sum(int(getattr(p, "ds_numel", None) or p.numel()) for p in module.parameters())


def get_module_flops(module: nn.Module) -> int:
    """Flops of `module`'s forward, children included (after `stop_profile()`)."""
    return _read(module, "__flops__")


def get_module_macs(module: nn.Module) -> int:
    """MACs of `module`'s forward, children included (after `stop_profile()`)."""
    return _read(module, "__macs__")


def get_module_duration(module: nn.Module) -> float:
    """Seconds of `module`'s forward (after `stop_profile()`)."""
    return _read(module, "__duration__")


def _read(module: nn.Module, name: str) -> Any:
    if name not in module.__dict__:
        raise AttributeError(
            f"{type(module).__name__} has no {name}: read it between FlopsProfiler.stop_profile() and end_profile()"
        )
    return module.__dict__[name]


# ---------------------------------------------------------------------- one-call profile


def get_model_profile(
    model: nn.Module,
    input_shape: Optional[tuple] = None,
    args: Optional[list] = None,
    kwargs: Optional[dict] = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: Optional[str] = None,
    ignore_modules: Optional[list] = None,
    mode: str = "forward",
):
    """Profile one forward (`mode='forward'`) or one `model.generate(...)` (`mode='generate'`)
    of `model` in eval mode after `warm_up` unprofiled runs; returns `(flops, macs, params)`,
    as strings when `as_string`. Inputs: a random tensor of `input_shape` on the model's
    device, or `args` / `kwargs`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be an nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode={mode!r}; use 'forward' or 'generate'")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        args = [torch.ones((), device=device).new_empty(input_shape).normal_()]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    run = model.generate if mode == "generate" else model
    model.eval()
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            run(*args, **kwargs)
        finally:
            profiler.stop_profile()
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(
            profile_step=warm_up, module_depth=module_depth, top_modules=top_modules, detailed=detailed,
            output_file=output_file,
        )  # fmt: skip
    profiler.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
