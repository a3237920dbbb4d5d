"""Learning-rate schedules with DeepSpeed's names, parameters and stepping rules.

Each schedule takes the optimizer first, then keyword parameters named as in the
`"scheduler": {"type": ..., "params": {...}}` block of a DeepSpeed config. The engine
builds one with `build_lr_scheduler(name, optimizer, params)` and calls `step()` after
every optimizer step.

[Note: iteration numbering]
`last_batch_iteration` counts finished optimizer steps minus one, so a new schedule sits
at -1. Constructing a schedule with `last_batch_iteration=-1` already writes its
iteration -1 learning rate into the optimizer (the warmup minimum, the cycle minimum,
...), so the first optimizer step never runs at the optimizer's own configured lr. Each
`step()` then moves to the next iteration and writes that iteration's lr. A schedule
constructed with any other `last_batch_iteration` (a resume) leaves the optimizer alone
until its first `step()`. `load_state_dict()` restores the iteration only: the lr itself
comes back with the optimizer's own state dict, as in DeepSpeed.

[Note: departures from upstream]
Where DeepSpeed warns and carries on with a value it cannot act on (an unknown
`warmup_type`) or accepts input silently (negative step counts, min above max), we raise
`ValueError` naming the value. A `total_num_steps` shorter than the warmup is different: the
schedule is still defined (the run ends before the decay starts, or meets it at its floor),
and HF Trainer writes one whenever `warmup_steps` exceeds the run's steps, so both decay
schedules warn, as DeepSpeed does, and train. `WarmupCosineLR` holds its floor once `total_num_steps`
have passed instead of climbing back up the cosine. `OneCycle` honours its stair counts
(DeepSpeed's documented intent; older releases ignored them).
"""

from __future__ import annotations

import argparse
import inspect
import math
import types
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from deepspeed.utils.logging import logger

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# Parameter names, as they appear in a config's "params" block.
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MOMENTUM = "cycle_momentum"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"
VALID_WARMUP_TYPES = [WARMUP_LOG_RATE, WARMUP_LINEAR_RATE]

# OneCycle writes (momentum, this) into Adam-style `betas`, as DeepSpeed does; see OneCycle.
_ONE_CYCLE_BETA2 = 0.99

# Slack for floor() on float progress, so k/N * N does not land just under k.
_STAIR_EPS = 1e-9

Value = Union[float, Sequence[float]]


# --------------------------------------------------------------------------- validation


def _check_number(value: Any, name: str, minimum: Optional[float] = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return float(value)


def _check_steps(value: Any, name: str, minimum: int = 0) -> int:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value != int(value):
        raise ValueError(f"{name} must be a whole number of steps, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _check_ordered(low: Sequence[float], high: Sequence[float], low_name: str, high_name: str) -> None:
    for lo, hi in zip(low, high):
        if lo > hi:
            raise ValueError(f"{low_name}={lo!r} is greater than {high_name}={hi!r}; swap them")


def _check_warmup_type(warmup_type: Any) -> str:
    if warmup_type not in VALID_WARMUP_TYPES:
        raise ValueError(f"{WARMUP_TYPE}={warmup_type!r} is not one of {VALID_WARMUP_TYPES}")
    return warmup_type


def _check_iteration(value: Any) -> int:
    return _check_steps(value, "last_batch_iteration", minimum=-1)


# --------------------------------------------------------------------------- helpers


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The object whose `param_groups` the schedule writes.

    A torch optimizer is used as is; a wrapper holding one in `.optimizer` (DeepSpeed's fp16
    and ZeRO optimizers) is unwrapped, as DeepSpeed does; anything else with a
    `param_groups` list of dicts is used as is.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return optimizer
    raise TypeError(
        f"{type(optimizer).__name__} is not an optimizer: pass a torch.optim.Optimizer or an "
        "object with a `param_groups` list of dicts"
    )


def _per_group(optimizer: Any, value: Value, name: str, minimum: Optional[float] = 0.0) -> list[float]:
    """One value per param group: a scalar is repeated, a list must have one per group."""
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {count} param groups; "
                "give one value, or one per group"
            )
        return [_check_number(v, name, minimum) for v in value]
    return [_check_number(value, name, minimum)] * count


def _set_group_value(group: dict, key: str, value: Any) -> None:
    # A tensor lr (capturable / compiled optimizers) must be updated in place, or the
    # optimizer's captured reference goes stale.
    current = group.get(key)
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    else:
        group[key] = value


def _group_lr(group: dict) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def _warmup_progress(iteration: int, num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at `iteration` (0 at iteration 0, 1 at `num_steps`)."""
    if warmup_type == WARMUP_LOG_RATE:
        # log(it + 1) / log(N): fast early growth, reaching 1 at it = N - 1.
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


# --------------------------------------------------------------------------- base


class _Schedule:
    """Step counting, lr writing and state for every schedule (see [Note: iteration numbering])."""

    optimizer: Any  # the object whose param_groups are written
    last_batch_iteration: int  # -1 before the first step()
    _last_lr: Optional[list[float]]  # the lrs last written, one per param group

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _unwrap_optimizer(optimizer)
        self.last_batch_iteration = _check_iteration(last_batch_iteration)
        self._last_lr = None

    def get_lr(self) -> list[float]:
        """The lr of each param group at `last_batch_iteration`."""
        raise NotImplementedError

    def step(
        self, last_batch_iteration: Optional[int] = None, *, batch_iteration: Optional[int] = None
    ) -> None:
        """Move to the next iteration (or to the one given) and write its lr.

        `batch_iteration` is the name DeepSpeed's OneCycle and LRRangeTest use for the same
        argument; either spelling is accepted by every schedule.
        """
        if batch_iteration is not None:
            if last_batch_iteration is not None and last_batch_iteration != batch_iteration:
                raise TypeError(
                    f"step() got last_batch_iteration={last_batch_iteration} and "
                    f"batch_iteration={batch_iteration}; pass one"
                )
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _check_iteration(last_batch_iteration)
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            _set_group_value(group, "lr", lr)
        self._last_lr = list(lrs)

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__} has not written a learning rate yet (it was built to resume "
                f"at iteration {self.last_batch_iteration}); call step() first"
            )
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        if "last_batch_iteration" not in sd:
            raise ValueError(f"scheduler state has no 'last_batch_iteration' (keys: {sorted(sd)})")
        self.last_batch_iteration = _check_iteration(sd["last_batch_iteration"])
        # What the optimizer ran with at that iteration; the optimizer's state restores it.
        self._last_lr = self.get_lr()


# --------------------------------------------------------------------------- warmup family


class WarmupLR(_Schedule):
    """Warm the lr up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold.

    lr(it) = min + (max - min) * g(it), with g = log(it + 1) / log(N) ('log') or it / N
    ('linear') for it < N, and 1 afterwards. N is at least 2 (DeepSpeed's clamp: the log
    form divides by log N). Min and max may be one value or one per param group.
    """

    min_lrs: list[float]
    max_lrs: list[float]
    delta_lrs: list[float]  # max_lrs - min_lrs
    warmup_num_steps: int  # >= 2
    warmup_type: str  # 'log' or 'linear'

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: Value = 0.0,
        warmup_max_lr: Value = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, WARMUP_MIN_LR)
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, WARMUP_MAX_LR)
        _check_ordered(self.min_lrs, self.max_lrs, WARMUP_MIN_LR, WARMUP_MAX_LR)
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = max(2, _check_steps(warmup_num_steps, WARMUP_NUM_STEPS))
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _get_gamma(self) -> float:
        """Fraction of the way from min to max at `last_batch_iteration`."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_progress(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then a linear decay from `warmup_max_lr` back to `warmup_min_lr`.

    After the warmup, g(it) = (T - it) / (T - N), reaching 0 (lr = warmup_min_lr) at
    it = T = `total_num_steps` and staying there.
    """

    total_num_steps: int

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: Value = 0.0,
        warmup_max_lr: Value = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        # Set before the base constructor, which already computes the iteration -1 lr.
        self.total_num_steps = _check_steps(total_num_steps, TOTAL_NUM_STEPS)
        warmup = _check_steps(warmup_num_steps, WARMUP_NUM_STEPS)
        _warn_if_decay_unreached(self.total_num_steps, warmup)
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._get_gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, remaining / span)


class WarmupCosineLR(_Schedule):
    """Warmup, then a cosine decay, both as ratios of each param group's own lr.

    During warmup the ratio goes from `warmup_min_ratio` to 1 (log or linear, as in
    `WarmupLR`); then ratio = c + (1 - c) * (1 + cos(pi * k / (T - N))) / 2 with
    c = `cos_min_ratio` and k = it - N + 1, which reaches c at it = T - 1 and holds there.
    The base lrs are read from the optimizer when the schedule is built.
    """

    total_num_steps: int
    warmup_min_ratio: float
    warmup_num_steps: int  # >= 2, as in WarmupLR
    cos_min_ratio: float
    warmup_type: str
    org_lrs: list[float]  # each param group's lr at construction: the ratio-1 lr

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _check_steps(total_num_steps, TOTAL_NUM_STEPS)
        warmup = _check_steps(warmup_num_steps, WARMUP_NUM_STEPS)
        _warn_if_decay_unreached(self.total_num_steps, warmup)
        self.warmup_num_steps = max(2, warmup)
        self.warmup_min_ratio = _check_ratio(warmup_min_ratio, WARMUP_MIN_RATIO)
        self.cos_min_ratio = _check_ratio(cos_min_ratio, COS_MIN_RATIO)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.org_lrs = [_group_lr(group) for group in self.optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        """The ratio of the base lr at `last_batch_iteration`."""
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            progress = _warmup_progress(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + progress * (1.0 - self.warmup_min_ratio)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so the ratio holds at its floor after the last step (see module note).
        done = min(it - self.warmup_num_steps + 1, span)
        cosine = (1.0 + math.cos(math.pi * done / span)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            # DeepSpeed's iteration -1 lr is 0: the first optimizer step is a no-op step.
            return [0.0] * len(self.org_lrs)
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


def _warn_if_decay_unreached(total_num_steps: int, warmup_num_steps: int) -> None:
    """A run shorter than its warmup never decays: worth a warning, not an error (see the note)."""
    if total_num_steps < warmup_num_steps:
        logger.warning(
            f"{TOTAL_NUM_STEPS}={total_num_steps} is less than {WARMUP_NUM_STEPS}={warmup_num_steps}: the lr "
            f"warms up for the whole run and never decays; lower {WARMUP_NUM_STEPS} (HF: warmup_steps) if that "
            "is not what you meant"
        )


def _check_ratio(value: Any, name: str) -> float:
    ratio = _check_number(value, name)
    if ratio > 1.0:
        raise ValueError(f"{name} is a fraction of the base lr and must be in [0, 1], got {value!r}")
    return ratio


# --------------------------------------------------------------------------- OneCycle


class OneCycle(_Schedule):
    """The 1cycle policy: lr up then down once, then an optional slow decay.

    Over `cycle_first_step_size` iterations the lr climbs linearly from `cycle_min_lr` to
    `cycle_max_lr` (the peak is written by the `cycle_first_step_size`-th `step()`), then it
    falls back over `cycle_second_step_size` (default: the same). Momentum, when cycled,
    moves the other way between `cycle_max_mom` and `cycle_min_mom`. With a stair count N
    in a phase, the phase is cut into N equal stairs and each holds the value at its start.

    After the cycle, with `decay_step_size` > 0, the lr is min_lr / (1 + decay_lr_rate * d /
    decay_step_size) and the momentum max_mom * (1 + decay_mom_rate * d / decay_step_size),
    d counting iterations since the cycle ended; otherwise they stay at min_lr / max_mom.

    Momentum is cycled only for optimizers with Adam-style `betas`; as in DeepSpeed, the
    second beta is then set to 0.99 whatever it was.
    """

    min_lrs: list[float]
    max_lrs: list[float]
    decay_lr_rate: float
    total_size: float  # first + second step size, in iterations
    step_ratio: float  # first step size / total_size: where the peak sits in the cycle
    first_stair_count: int  # 0: continuous
    second_stair_count: int
    decay_step_size: float
    cycle_momentum: bool  # False if asked, or if the optimizer has no betas
    min_moms: list[tuple[float, float]]  # (beta1, beta2) per group, empty if not cycling
    max_moms: list[tuple[float, float]]
    decay_mom_rate: float

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: Value,
        cycle_max_lr: Value,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: Optional[int] = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: Optional[int] = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._init_cycle(
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
            decay_step_size,
        )
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, CYCLE_MIN_LR)
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, CYCLE_MAX_LR)
        _check_ordered(self.min_lrs, self.max_lrs, CYCLE_MIN_LR, CYCLE_MAX_LR)
        self.decay_lr_rate = _check_number(decay_lr_rate, DECAY_LR_RATE)
        self._init_momentum(bool(cycle_momentum), cycle_min_mom, cycle_max_mom, decay_mom_rate)
        if self.last_batch_iteration == -1:
            self._apply_initial()

    def _init_cycle(self, first_size, second_size, first_stairs, second_stairs, decay_size) -> None:
        first = float(_check_steps(first_size, CYCLE_FIRST_STEP_SIZE, minimum=1))
        second = first if second_size is None else float(_check_steps(second_size, CYCLE_SECOND_STEP_SIZE, 1))
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _check_steps(first_stairs, CYCLE_FIRST_STAIR_COUNT)
        self.second_stair_count = (
            self.first_stair_count
            if second_stairs is None
            else _check_steps(second_stairs, CYCLE_SECOND_STAIR_COUNT)
        )
        self.decay_step_size = float(_check_steps(decay_size, DECAY_STEP_SIZE))

    def _init_momentum(self, enabled: bool, min_mom: float, max_mom: float, decay_rate: float) -> None:
        self.cycle_momentum = enabled
        self.min_moms, self.max_moms = [], []
        self.decay_mom_rate = _check_number(decay_rate, DECAY_MOM_RATE)
        if not enabled:
            return
        if not _has_betas(self.optimizer):
            logger.warning(
                f"cycle_momentum is disabled: {type(self.optimizer).__name__} has no 'betas' to cycle"
            )
            self.cycle_momentum = False
            return
        low = _check_number(min_mom, CYCLE_MIN_MOM)
        high = _check_number(max_mom, CYCLE_MAX_MOM)
        _check_ordered([low], [high], CYCLE_MIN_MOM, CYCLE_MAX_MOM)
        count = len(self.optimizer.param_groups)
        self.min_moms = [(low, _ONE_CYCLE_BETA2)] * count
        self.max_moms = [(high, _ONE_CYCLE_BETA2)] * count

    def _apply_initial(self) -> None:
        # DeepSpeed starts at the cycle minimum for both lr and momentum (the first step()
        # then moves momentum to the top of its range).
        for group, lr in zip(self.optimizer.param_groups, self.min_lrs):
            _set_group_value(group, "lr", lr)
        self._last_lr = list(self.min_lrs)
        for group, betas in zip(self.optimizer.param_groups, self.min_moms):
            group["betas"] = betas

    def _scale_factor(self) -> float:
        """Height within the cycle, 0 at the ends and 1 at the peak."""
        position = (self.last_batch_iteration + 1) / self.total_size
        x = position - math.floor(position)  # fraction of the current cycle done
        if x <= self.step_ratio:
            return _stairs(x / self.step_ratio, self.first_stair_count)
        return 1.0 - _stairs((x - self.step_ratio) / (1.0 - self.step_ratio), self.second_stair_count)

    def _decay_interval(self) -> Optional[float]:
        """Decay steps since the cycle ended, or None while the cycle runs."""
        if self.last_batch_iteration < self.total_size:
            return None
        if self.decay_step_size == 0:
            return 0.0
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        interval = self._decay_interval()
        if interval is None:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        return [lo / (1.0 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def get_mom(self) -> Optional[list[tuple[float, float]]]:
        """(beta1, beta2) per param group, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        interval = self._decay_interval()
        if interval is None:
            scale = self._scale_factor()
            return [(hi - (hi - lo) * scale, b2) for (lo, b2), (hi, _) in zip(self.min_moms, self.max_moms)]
        factor = 1.0 + self.decay_mom_rate * interval
        return [(hi * factor, b2) for hi, b2 in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        momentums = self.get_mom()
        if momentums is None:
            return
        for group, betas in zip(self.optimizer.param_groups, momentums):
            group["betas"] = betas


def _has_betas(optimizer: Any) -> bool:
    defaults = getattr(optimizer, "defaults", None)
    if isinstance(defaults, dict):
        return "betas" in defaults
    return bool(optimizer.param_groups) and all("betas" in group for group in optimizer.param_groups)


def _stairs(progress: float, count: int) -> float:
    """`progress` in [0, 1], held flat on each of `count` equal stairs (0: no stairs)."""
    if count <= 0:
        return progress
    return min(1.0, math.floor(progress * count + _STAIR_EPS) / count)


# --------------------------------------------------------------------------- LRRangeTest


class LRRangeTest(_Schedule):
    """The LR range test: grow the lr from `lr_range_test_min_lr` without bound.

    lr(it) = min_lr * (1 + step_rate * (it + 1) / step_size), with the interval floored
    to whole `step_size`s when `lr_range_test_staircase` is set.
    """

    min_lr: list[float]
    step_size: float
    step_rate: float
    staircase: bool

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: Value = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, LR_RANGE_TEST_MIN_LR)
        self.step_size = float(_check_steps(lr_range_test_step_size, LR_RANGE_TEST_STEP_SIZE, minimum=1))
        self.step_rate = _check_number(lr_range_test_step_rate, LR_RANGE_TEST_STEP_RATE)
        self.staircase = bool(lr_range_test_staircase)
        if self.last_batch_iteration == -1:
            # DeepSpeed writes the plain minimum here, not the formula at iteration -1.
            for group, lr in zip(self.optimizer.param_groups, self.min_lr):
                _set_group_value(group, "lr", lr)
            self._last_lr = list(self.min_lr)

    def _interval(self) -> float:
        interval = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(interval)) if self.staircase else interval

    def get_lr(self) -> list[float]:
        increase = 1.0 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


# --------------------------------------------------------------------------- factory

_SCHEDULES: dict[str, type] = {
    LR_RANGE_TEST: LRRangeTest,
    ONE_CYCLE: OneCycle,
    WARMUP_LR: WarmupLR,
    WARMUP_DECAY_LR: WarmupDecayLR,
    WARMUP_COSINE_LR: WarmupCosineLR,
}
_SCHEDULES = types.MappingProxyType(_SCHEDULES)  # read-only from here on


def build_lr_scheduler(name: str, optimizer: Any, params: Optional[dict] = None) -> _Schedule:
    """Build the schedule a config names, e.g. `{"type": "WarmupLR", "params": {...}}`.

    Raises `ValueError` naming an unknown schedule, an unknown parameter or a missing one.
    """
    if name not in _SCHEDULES:
        raise ValueError(f"unknown LR schedule {name!r}; valid schedules are {VALID_LR_SCHEDULES}")
    cls = _SCHEDULES[name]
    params = dict(params or {})
    signature = inspect.signature(cls.__init__).parameters
    accepted = [key for key in signature if key not in ("self", "optimizer")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for LR schedule {name}; allowed: {accepted}")
    missing = [
        key for key in accepted if signature[key].default is inspect.Parameter.empty and key not in params
    ]
    if missing:
        raise ValueError(f"LR schedule {name} needs parameter(s) {missing}")
    return cls(optimizer, **params)


# --------------------------------------------------------------------------- command-line arguments
# Upstream's command-line route to a schedule (bing_bert and Megatron-style scripts):
# `add_tuning_arguments` adds the flags, `get_config_from_args` turns them into a "scheduler"
# block. The flags, their defaults and which ones each schedule takes are upstream's.

_ARG_KEYS = {
    LR_RANGE_TEST: (LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE),
    # `--cycle_momentum` is not among them (upstream's choice): OneCycle keeps its default, on.
    ONE_CYCLE: (
        CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT,
        DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE, CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE,
    ),
    WARMUP_LR: (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE),
    # It scales each group's own lr, so it takes ratios and no warmup_min_lr / warmup_max_lr.
    WARMUP_COSINE_LR: (WARMUP_NUM_STEPS, WARMUP_TYPE, WARMUP_MIN_RATIO, COS_MIN_RATIO),
}  # fmt: skip
_ARG_KEYS[WARMUP_DECAY_LR] = _ARG_KEYS[WARMUP_LR]  # (its total_num_steps has no flag)
_ARG_KEYS = types.MappingProxyType(_ARG_KEYS)  # read-only from here on


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the schedule flags (`--lr_schedule WarmupLR --warmup_max_lr 1e-3 ...`) to `parser`."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help=f"one of {VALID_LR_SCHEDULES}")
    group.add_argument("--lr_range_test_min_lr", type=float, default=0.001, help="LRRangeTest: first lr")
    group.add_argument(
        "--lr_range_test_step_rate", type=float, default=1.0, help="LRRangeTest: growth per interval"
    )
    group.add_argument(
        "--lr_range_test_step_size", type=int, default=1000, help="LRRangeTest: steps per interval"
    )
    group.add_argument(
        "--lr_range_test_staircase", default=False, action="store_true", help="LRRangeTest: grow in stairs"
    )
    group.add_argument("--cycle_first_step_size", type=int, default=1000, help="OneCycle: rising steps")
    group.add_argument(
        "--cycle_first_stair_count", type=int, default=-1, help="OneCycle: stairs while rising"
    )
    group.add_argument("--cycle_second_step_size", type=int, default=-1, help="OneCycle: falling steps")
    group.add_argument(
        "--cycle_second_stair_count", type=int, default=-1, help="OneCycle: stairs while falling"
    )
    group.add_argument(
        "--decay_step_size", type=int, default=1000, help="OneCycle: steps per decay after the cycle"
    )
    group.add_argument("--cycle_min_lr", type=float, default=0.01, help="OneCycle: lowest lr")
    group.add_argument("--cycle_max_lr", type=float, default=0.1, help="OneCycle: highest lr")
    group.add_argument("--decay_lr_rate", type=float, default=0.0, help="OneCycle: lr decay after the cycle")
    group.add_argument(
        "--cycle_momentum", default=False, action="store_true", help="OneCycle: cycle the momentum too"
    )
    group.add_argument("--cycle_min_mom", type=float, default=0.8, help="OneCycle: lowest momentum")
    group.add_argument("--cycle_max_mom", type=float, default=0.9, help="OneCycle: highest momentum")
    group.add_argument(
        "--decay_mom_rate", type=float, default=0.0, help="OneCycle: momentum decay after the cycle"
    )
    group.add_argument("--warmup_min_lr", type=float, default=0, help="WarmupLR: first lr")
    group.add_argument("--warmup_max_lr", type=float, default=0.001, help="WarmupLR: lr after the warmup")
    group.add_argument("--warmup_num_steps", type=int, default=1000, help="warmup steps")
    group.add_argument(
        "--warmup_type", type=str, default=WARMUP_LOG_RATE, help=f"one of {VALID_WARMUP_TYPES}"
    )
    group.add_argument("--warmup_min_ratio", type=float, default=0.01, help="WarmupCosineLR: first lr / lr")
    group.add_argument("--cos_min_ratio", type=float, default=0.01, help="WarmupCosineLR: last lr / lr")
    return parser


def parse_arguments() -> tuple:
    """`(schedule args, the other command-line arguments)` from `sys.argv`."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _copy_given(args: Any, params: dict, schedule: str) -> None:
    """Copy into `params` each of `schedule`'s flags that `args` has and that is not None."""
    for key in _ARG_KEYS[schedule]:
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value


def override_lr_range_test_params(args: Any, params: dict) -> None:
    _copy_given(args, params, LR_RANGE_TEST)


def override_1cycle_params(args: Any, params: dict) -> None:
    _copy_given(args, params, ONE_CYCLE)


def override_warmupLR_params(args: Any, params: dict) -> None:  # noqa: N802 - upstream's name
    _copy_given(args, params, WARMUP_LR)


def override_warmupCosineLR_params(args: Any, params: dict) -> None:  # noqa: N802 - upstream's name
    _copy_given(args, params, WARMUP_COSINE_LR)


def override_params(args: Any, params: dict) -> None:
    """Every schedule's flags that `args` carries, into `params`."""
    for schedule in (LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_COSINE_LR):
        _copy_given(args, params, schedule)


def get_config_from_args(args: Any) -> tuple:
    """`({"type": ..., "params": {...}}, None)` from `--lr_schedule` and its flags, or
    `(None, why not)` when `--lr_schedule` is missing or unknown."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule; use one of {VALID_LR_SCHEDULES}"
    params: dict = {}
    _copy_given(args, params, schedule)
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: dict) -> tuple:
    """`(the lr a "scheduler" block peaks at, "")`, or `(None, why not)`: WarmupCosineLR
    scales each group's own lr, so its block names none."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == WARMUP_COSINE_LR:
        return (
            None,
            f"{WARMUP_COSINE_LR} scales the optimizer learning rate by a ratio, so its params define no lr",
        )
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(schedule, WARMUP_MAX_LR)
    return params[key], ""
