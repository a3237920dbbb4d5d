"""Named wall-clock timers, as upstream's `deepspeed.utils.timer`, and the engine's timer names.

`SynchronizedWallClockTimer` keeps one `Timer` per name; `timers("fwd").start()` /
`.stop()` accumulate, `elapsed()` reads milliseconds, `log(names)` prints them on rank 0.
"Synchronized": start and stop wait for the accelerator (`synchronize()`), so a timer covers
the device work the region queued, not just its launch; on the CPU that wait is free.

The engine times its calls with these when the config sets `wall_clock_breakdown: true`
(see `EngineTimers`): each region under a per-micro-step name and a per-step name, the
micro-step ones printed and reset after every `engine.step()`, the step ones at every
accumulation boundary.
"""

from __future__ import annotations

import time
from typing import Optional

from deepspeed.utils.logging import print_dist

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"


def _synchronize() -> None:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


class SynchronizedWallClockTimer:
    """Timers by name, made on first use."""

    class Timer:
        """Accumulates the time between `start()` and `stop()` calls until `reset()`."""

        def __init__(self, name: str) -> None:
            self.name = name
            self.started = False
            self._started_at = 0.0
            self._total = 0.0  # seconds since the last reset
            self._intervals: list = []  # seconds of each recorded start-stop since the last reset, for mean()

        def start(self) -> None:
            if self.started:
                raise RuntimeError(f"timer {self.name!r} was started twice; stop() it first")
            _synchronize()
            self._started_at = time.perf_counter()
            self.started = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """End the interval; `reset` drops what came before it; `record` also keeps the
            interval for `mean()` (as upstream's timers keep only recorded intervals there)."""
            if not self.started:
                raise RuntimeError(f"timer {self.name!r} was stopped without being started")
            _synchronize()
            interval = time.perf_counter() - self._started_at
            if reset:
                self._total, self._intervals = 0.0, []
            self._total += interval
            if record:
                self._intervals.append(interval)
            self.started = False

        def reset(self) -> None:
            self.started = False
            self._total, self._intervals = 0.0, []

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds accumulated (a running interval counts up to now); `reset` clears them
            and a running timer carries on from now."""
            running = self.started
            if running:
                self.stop()
            total_ms = self._total * 1000.0
            if reset:
                self.reset()
            if running:
                self.start()
            return total_ms

        def mean(self) -> float:
            """Mean seconds per recorded interval (`stop(record=True)`) since the last reset; 0 without one."""
            return sum(self._intervals) / len(self._intervals) if self._intervals else 0.0

    def __init__(self) -> None:
        self.timers: dict = {}

    def get_timers(self) -> dict:
        return self.timers

    def __call__(self, name: str) -> SynchronizedWallClockTimer.Timer:
        timer = self.timers.get(name)
        if timer is None:
            timer = self.timers[name] = self.Timer(name)
        return timer

    def log(
        self,
        names: list,
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: Optional[list] = None,
    ) -> None:
        """Print `time (ms) | name: value | ...` for the named timers that exist, on `ranks`
        (default rank 0), each divided by `normalizer`; `memory_breakdown` appends the
        accelerator's memory (`memory_usage()`)."""
        if normalizer <= 0:
            raise ValueError(f"SynchronizedWallClockTimer.log: normalizer={normalizer} must be positive")
        parts = [
            f"{name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
            for name in names
            if name in self.timers
        ]
        line = " | ".join(["time (ms)", *parts])
        if memory_breakdown:
            line += self.memory_usage()
        print_dist(line, ranks=ranks or [0])

    @staticmethod
    def memory_usage() -> str:
        """` | mem_allocated: X GB | max_mem_allocated: ... | cache_allocated: ... | max_cache_allocated: ...`"""
        from deepspeed.accelerator import get_accelerator

        acc, gib = get_accelerator(), float(1 << 30)
        readings = (
            ("mem_allocated", acc.memory_allocated()),
            ("max_mem_allocated", acc.max_memory_allocated()),
            ("cache_allocated", acc.memory_reserved()),
            ("max_cache_allocated", acc.max_memory_reserved()),
        )
        return "".join(f" | {name}: {value / gib:.4f} GB" for name, value in readings)

    def get_mean(self, names: list, normalizer: float = 1.0, reset: bool = True) -> dict:
        """`{name: mean milliseconds per interval / normalizer}` for the named timers that exist."""
        if normalizer <= 0:
            raise ValueError(f"SynchronizedWallClockTimer.get_mean: normalizer={normalizer} must be positive")
        means = {}
        for name in names:
            if name in self.timers:
                means[name] = self.timers[name].mean() * 1000.0 / normalizer
                if reset:
                    self.timers[name].reset()
        return means


class EngineTimers:
    """Which timer names the engine starts and stops around each region, and which it logs.

    Both sets exist only with `wall_clock_breakdown`; otherwise every list is empty and the
    engine's timing calls do nothing.
    """

    def __init__(self, enabled: bool) -> None:
        pairs = {
            "forward": (FORWARD_MICRO_TIMER, FORWARD_GLOBAL_TIMER),
            "backward": (BACKWARD_MICRO_TIMER, BACKWARD_GLOBAL_TIMER),
            "backward_inner": (BACKWARD_INNER_MICRO_TIMER, BACKWARD_INNER_GLOBAL_TIMER),
            "backward_reduce": (BACKWARD_REDUCE_MICRO_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER),
            "step": (STEP_MICRO_TIMER, STEP_GLOBAL_TIMER),
        }
        self.regions = {region: list(names) if enabled else [] for region, names in pairs.items()}
        self.micro_timers = [micro for micro, _ in pairs.values()] if enabled else []
        self.global_timers = [whole for _, whole in pairs.values()] if enabled else []

    def active_timers(self) -> list:
        return self.micro_timers + self.global_timers


class ThroughputTimer:
    """Samples per second over training, as upstream's `engine.tput_timer`.

    The engine calls `start()` at each forward and `stop(global_step=...)` at each
    `engine.step()`, `global_step` true at an accumulation boundary. Time is counted only from
    global step `start_step` on (2 by default), so the first steps' one-off costs (allocation,
    kernel builds, first gathers) stay out of the average. A `stop()` without a `start()`
    does nothing; the step's time is `step_elapsed_time`, the total `total_elapsed_time`
    (seconds), and `avg_samples_per_sec()` their throughput in samples of `batch_size` a step.
    Unlike the named timers it does not wait for the accelerator: it runs at every forward
    and step whether or not anyone reads it, and over many steps the queue's lag cancels out.
    """

    def __init__(self, batch_size: int, start_step: int = 2) -> None:
        if batch_size < 1 or start_step < 0:
            raise ValueError(
                f"ThroughputTimer needs batch_size >= 1 and start_step >= 0, got {batch_size} and {start_step}"
            )
        self.batch_size = batch_size
        self.start_step = start_step
        self.initialized = False  # a start() was seen
        self.started = False  # between a start() and its stop()
        self.start_time = 0.0  # 0 until timing begins at start_step
        self.end_time = 0.0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.step_elapsed_time = 0.0  # the current accumulation's time so far
        self.total_elapsed_time = 0.0  # every timed step since start_step

    def _timing(self) -> bool:
        return self.global_step_count >= self.start_step

    def start(self) -> None:
        self.initialized = True
        self.started = True
        if self._timing():
            self.start_time = time.time()

    def stop(self, global_step: bool = False) -> None:
        if not self.started:
            return  # nothing was started: nothing to count
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0  # the next accumulation starts from zero

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the global steps timed so far; 0.0 before any."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return timed_steps * self.batch_size / self.total_elapsed_time
