"""Wall-clock timers around our ZeRO engine's functions, for bench_train_step.py --profile.

`install()` wraps a fixed list of functions of `deepspeed` (ours: it must be imported after
the process group exists and before `deepspeed.initialize`, because the hooks bind methods
when the engine is built) and returns a `Timers`. Each wrapped call records its inclusive
time and its exclusive time (inclusive minus the wrapped calls made inside it), so the
exclusive column adds up to the wrapped part of a step; what is left is torch compute
outside every wrapped function (the autograd engine's backward math, for instance).
Nothing in the project's files is edited: the wrappers live only in the profiled process.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import defaultdict

# (module path, owner attribute or "" for a module function, function name, label)
_TARGETS = (
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "forward", "engine.forward (module math)"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "backward", "engine.backward (autograd math)"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "step", "engine.step"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_on_grad_ready", "grad: post-accumulate hook"),
    ("deepspeed.runtime.zero.hooks", "ParameterCoordinator", "_pre_forward", "hook: pre_forward"),
    ("deepspeed.runtime.zero.hooks", "ParameterCoordinator", "_post_forward", "hook: post_forward"),
    ("deepspeed.runtime.zero.hooks", "ParameterCoordinator", "enter_backward", "hook: enter_backward"),
    ("deepspeed.runtime.zero.hooks", "ParameterCoordinator", "exit_backward", "hook: exit_backward"),
    ("deepspeed.runtime.zero.hooks", "ParameterCoordinator", "finish_backward", "hook: finish_backward"),
    ("deepspeed.runtime.zero.hooks", "ParameterCoordinator", "_release", "hook: _release"),
    ("deepspeed.runtime.zero.hooks", "ParameterCoordinator", "_on_access", "hook: _on_access (stray use)"),
    ("deepspeed.runtime.zero.hooks", "", "_module_states", "hook: _module_states"),
    ("deepspeed.runtime.zero.hooks", "_Prefetcher", "prefetch_next", "prefetch: prefetch_next"),
    ("deepspeed.runtime.zero.hooks", "_Prefetcher", "hand_over", "prefetch: hand_over"),
    ("deepspeed.runtime.zero.hooks", "_Prefetcher", "record_or_advance", "prefetch: record_or_advance"),
    ("deepspeed.runtime.zero.hooks", "_Prefetcher", "end_pass", "prefetch: end_pass"),
    ("deepspeed.runtime.zero.gather", "", "fetch_states", "gather: fetch_states"),
    ("deepspeed.runtime.zero.gather", "", "zero_states", "gather: zero_states"),
    ("deepspeed.runtime.zero.gather", "", "release_states", "gather: release_states"),
    ("deepspeed.runtime.zero.gather", "", "_copy_out", "gather: copy out into full tensors"),
    ("deepspeed.runtime.zero.gather", "_GatherBucket", "wait", "gather: bucket wait"),
    ("deepspeed.runtime.zero.gather", "", "refresh_gathered", "step: refresh persistent"),
    ("deepspeed.runtime.zero.grad_reducer", "GradientReducer", "add", "grad: reducer.add"),
    (
        "deepspeed.runtime.zero.grad_reducer",
        "GradientReducer",
        "_complete",
        "grad: wait + add into fp32 shard",
    ),
    ("deepspeed.runtime.zero.grad_reducer", "GradientReducer", "flush", "grad: reducer.flush"),
    # Stages 1 and 2 (replicated parameters): the step-time reduction (stage 1) and the
    # all-gather of the updated slices back into the full parameters.
    ("deepspeed.runtime.zero.stage", "", "reduce_accumulated_grads", "z1: reduce accumulated grads"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_refresh_full_params", "z12: refresh full params"),
    ("deepspeed.runtime.zero.gather", "", "_gather_bucket", "step: all-gather + copy into params"),
    ("deepspeed.runtime.zero.grad_reducer", "GradientReducer", "_reduce", "grad: pack+reduce+accumulate"),
    ("deepspeed.runtime.zero.optimizer", "ZeroStage3Optimizer", "step", "optim: ZeRO step"),
    (
        "deepspeed.runtime.zero.optimizer",
        "ZeroStage3Optimizer",
        "_global_norm_of_scaled_grads",
        "optim: global grad norm",
    ),
    (
        "deepspeed.runtime.zero.optimizer",
        "ZeroStage3Optimizer",
        "_write_back_masters",
        "optim: masters->shards",
    ),
    ("deepspeed.runtime.zero.optimizer", "ZeroStage3Optimizer", "zero_grad", "optim: zero_grad"),
    ("torch.optim", "AdamW", "step", "optim: torch AdamW.step"),
    ("deepspeed.comm", "", "all_gather_into_tensor", "comm: all_gather (sync or launch)"),
    ("deepspeed.comm", "", "reduce_scatter_tensor", "comm: reduce_scatter"),
    ("deepspeed.comm", "", "all_reduce", "comm: all_reduce"),
    ("deepspeed.comm", "CommHandle", "wait", "comm: handle.wait"),
)


class Timers:
    """Inclusive and exclusive seconds and call counts per label."""

    def __init__(self) -> None:
        self.incl: dict = defaultdict(float)
        self.excl: dict = defaultdict(float)
        self.calls: dict = defaultdict(int)
        self._stack: list = []  # per active wrapped call: seconds spent in wrapped children
        self.missing: list = []  # targets this version of the engine does not have

    def reset(self) -> None:
        self.incl.clear()
        self.excl.clear()
        self.calls.clear()

    def wrap(self, func, label: str):
        timers = self

        @functools.wraps(func)
        def timed(*args, **kwargs):
            timers._stack.append(0.0)
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                children = timers._stack.pop()
                timers.incl[label] += spent
                timers.excl[label] += spent - children
                timers.calls[label] += 1
                if timers._stack:
                    timers._stack[-1] += spent

        return timed

    def report(self, steps: int) -> list:
        """Rows sorted by exclusive time: label, calls per step, inclusive and exclusive ms per step."""
        rows = [
            {
                "label": label,
                "calls_per_step": self.calls[label] / steps,
                "incl_ms": 1e3 * self.incl[label] / steps,
                "excl_ms": 1e3 * self.excl[label] / steps,
            }
            for label in self.calls
        ]
        return sorted(rows, key=lambda r: r["excl_ms"], reverse=True)


def install() -> Timers:
    import importlib

    timers = Timers()
    for module_name, owner_name, attr, label in _TARGETS:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name, None) if owner_name else module
        if owner is None or not hasattr(owner, attr):
            timers.missing.append(f"{module_name}:{owner_name}.{attr}")  # the engine changed
            continue
        raw = inspect.getattr_static(owner, attr)
        if isinstance(raw, staticmethod):
            setattr(owner, attr, staticmethod(timers.wrap(raw.__func__, label)))
        else:
            setattr(owner, attr, timers.wrap(getattr(owner, attr), label))
    return timers
