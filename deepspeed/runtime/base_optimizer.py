"""Base classes of the optimizers an engine wraps (`isinstance` checks in clients rely on them).

Lightning's `Fabric.load` asks `isinstance(obj, (torch.optim.Optimizer, DeepSpeedOptimizer))`
to decide whether optimizer states are requested; `engine.optimizer` is a `ZeROOptimizer`.

[Note: finding a parameter's optimizer]
`deepspeed.utils.safe_get_full_fp32_param(param)` and friends take only a parameter, as
upstream. Rather than attach the optimizer to every parameter (upstream's
`param._z3_optimizer`), each ZeRO optimizer registers itself, weakly, when it is created, and
`owner_of(param)` asks the live ones which holds a master for the parameter.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

from deepspeed import process_state


class DeepSpeedOptimizer:
    """Marker base of every optimizer wrapper an engine builds (not a `torch.optim.Optimizer`)."""


class UnbuiltMixedPrecisionWrapper(DeepSpeedOptimizer):
    """Base of upstream's stage-0 mixed-precision wrappers (`FP16_Optimizer`,
    `FP16_UnfusedOptimizer`, `BF16_Optimizer`), kept as names for imports and `isinstance`.

    Here the engine wraps the optimizer in the ZeRO optimizer at every stage, stage 0
    included, with fp16 loss scaling and bf16 master weights built in, so `engine.optimizer`
    is never one of these; constructing one directly says so instead of half-working.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} is not built in this package: deepspeed.initialize wraps the "
            "optimizer in the ZeRO optimizer at every stage, with fp16/bf16 taken from the config "
            '("fp16": {"enabled": true} or "bf16": {"enabled": true}); pass the config instead'
        )


class ZeROOptimizer(DeepSpeedOptimizer):
    """Base of the ZeRO optimizers (every stage); live instances are findable (see the note).

    A subclass's `step()` returns False when it skipped the update (an fp16 overflow); the
    base records that outcome for the engine's `skipped_steps` and `was_step_applied()`.
    """

    skipped_steps: int = 0  # steps skipped for overflow since training began (a checkpoint load restores it)
    last_step_applied: bool = False  # whether the latest step() changed the parameters

    def __new__(cls, *args: Any, **kwargs: Any):
        instance = super().__new__(cls)
        _LIVE_OPTIMIZERS.add(instance)
        return instance

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("step")
        if step is not None and not getattr(step, "_records_outcome", False):
            cls.step = _recording_outcome(step)


def _recording_outcome(step: Any) -> Any:
    @functools.wraps(step)
    def recorded(self, *args: Any, **kwargs: Any) -> Any:
        result = step(self, *args, **kwargs)
        applied = result is not False
        self.last_step_applied = applied
        if not applied:
            self.skipped_steps += 1
        return result

    recorded._records_outcome = True
    return recorded


# The one owner; an entry vanishes with its optimizer, so there is nothing to reset.
_LIVE_OPTIMIZERS: weakref.WeakSet = process_state.register(
    "deepspeed.runtime.base_optimizer._LIVE_OPTIMIZERS", weakref.WeakSet()
)


def owner_of(param: Any) -> Optional[tuple]:
    """`(optimizer, shard_state)` of the live ZeRO optimizer holding a master for `param`, or None.

    The state is whatever the optimizer keys its masters by (`optimizer.state_of(param)`,
    a `ZeroParamState` at stage 3).
    """
    for optimizer in list(_LIVE_OPTIMIZERS):
        state_of = getattr(optimizer, "state_of", None)
        if state_of is not None:
            state = state_of(param)
        else:
            state = getattr(param, "_zero_state", None)
        if state is None:
            continue
        masters = getattr(optimizer, "masters", {})
        if state.ds_id in masters and any(s is state for s in getattr(optimizer, "states", ())):
            return optimizer, state
    return None
