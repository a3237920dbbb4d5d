"""The events the engine writes to `engine.monitor`, under upstream's names, x-axis = global samples.

- `Train/Samples/train_loss`: at each accumulation boundary, after its backward: the mean
  over the accumulation's micro-steps of the loss the client passed to `engine.backward`
  (this rank's, rank 0's: not averaged over ranks, as upstream), at the samples seen before
  this step (the first is at 0).
- `Train/Samples/lr` (the first param group's, as upstream's `get_lr()[0]`) and, under
  fp16, `Train/Samples/loss_scale`: after each optimizer step (the scheduler's and the loss
  scaler's updates included), at the samples seen including this step.
- With `wall_clock_breakdown`, at the same point: `Train/Samples/elapsed_time_ms_forward`,
  `_backward`, `_backward_inner`, `_backward_allreduce` and `_step`, the milliseconds of the
  step's timers (`fwd`, `bwd`, `bwd_inner`, `bwd_allreduce`, `step`) summed over its micro-steps,
  and `Train/Samples/elapsed_time_ms_all_gather`, `_reduce_scatter` and `_all_reduce`: the
  milliseconds this rank spent in those collectives since the previous step (each timed with
  the accelerator synchronized, `deepspeed.comm.count_totals`; not upstream's events, named
  in their style).

`EngineEvents` is built by the engine and called at those two points; `step_events` takes
further `(name, value)` pairs to write with the step's events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from deepspeed import comm as dist
from deepspeed.utils.timer import (
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    FORWARD_GLOBAL_TIMER,
    STEP_GLOBAL_TIMER,
)

TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
# Upstream's event name for each of the engine's per-step timers.
TIMER_EVENTS = (
    ("Train/Samples/elapsed_time_ms_forward", FORWARD_GLOBAL_TIMER),
    ("Train/Samples/elapsed_time_ms_backward", BACKWARD_GLOBAL_TIMER),
    ("Train/Samples/elapsed_time_ms_backward_inner", BACKWARD_INNER_GLOBAL_TIMER),
    ("Train/Samples/elapsed_time_ms_backward_allreduce", BACKWARD_REDUCE_GLOBAL_TIMER),
    ("Train/Samples/elapsed_time_ms_step", STEP_GLOBAL_TIMER),
)
# Each collective of deepspeed.comm counts toward the event whose kind its name starts with.
COMM_EVENTS = (
    ("Train/Samples/elapsed_time_ms_all_gather", "all_gather"),
    ("Train/Samples/elapsed_time_ms_reduce_scatter", "reduce_scatter"),
    ("Train/Samples/elapsed_time_ms_all_reduce", "all_reduce"),
)


def comm_events(totals: dict) -> list:
    """`(event name, milliseconds)` of each kind in COMM_EVENTS, from a `comms_totals(mark)`
    answer; a kind with no collective in it reads 0."""
    return [
        (event, sum(v["latency_ms"] for op, v in totals.items() if op.startswith(kind)))
        for event, kind in COMM_EVENTS
    ]


def step_events(
    samples: int,
    lr: Optional[float],
    loss_scale: Optional[float],
    timer_ms: Optional[dict] = None,
    extra: Iterable = (),
) -> list:
    """The events of one optimizer step at x = `samples`.

    `lr` None (no param group) and `loss_scale` None (not fp16) write nothing; `timer_ms` is
    `{timer name: milliseconds}` of the step's timers (None without wall_clock_breakdown);
    `extra` is further `(event name, value)` pairs, such as the communication times of the
    step, written at the same x.
    """
    events = []
    if lr is not None:
        events.append((LR, lr, samples))
    if loss_scale is not None:
        events.append((LOSS_SCALE, loss_scale, samples))
    for event_name, timer in TIMER_EVENTS if timer_ms is not None else ():
        if timer in timer_ms:
            events.append((event_name, timer_ms[timer], samples))
    events.extend((name, value, samples) for name, value in extra)
    return events


class EngineEvents:
    """One engine's writer of its events; keeps the accumulation's loss until the boundary."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor  # the engine's MonitorMaster
        self._loss_sum: Optional[torch.Tensor] = None  # sum of this accumulation's losses, on device
        self._micro_steps = 0
        self._comm_mark = dist.comms_totals()  # the collectives' totals at the previous step

    def after_backward(self, loss: torch.Tensor, at_boundary: bool, samples: int) -> None:
        """After `engine.backward(loss)`: add `loss`; at the boundary write the accumulation's mean."""
        if not self.monitor.is_writer:
            return  # other ranks: nothing is written, so nothing to add up
        value = loss.detach().double().mean()  # float64: the mean matches a Python sum of the losses
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._micro_steps += 1
        if at_boundary:
            mean = self._loss_sum.item() / self._micro_steps
            self._loss_sum, self._micro_steps = None, 0
            self.monitor.write_events([(TRAIN_LOSS, mean, samples)])

    def after_step(self, engine: Any, at_boundary: bool, extra: Iterable = ()) -> None:
        """After `engine.step()`, before its timers are logged and reset: the step's events."""
        if not (at_boundary and self.monitor.is_writer):
            return
        lrs = engine.get_lr()
        loss_scale = engine.optimizer.loss_scale if engine.fp16_enabled() else None
        timer_ms = None
        if engine.wall_clock_breakdown():
            timer_ms = {timer: engine.timers(timer).elapsed(reset=False) for _, timer in TIMER_EVENTS}
            since = dist.comms_totals(self._comm_mark)
            self._comm_mark = dist.comms_totals()
            extra = [*extra, *comm_events(since)]
        events = step_events(engine.global_samples, lrs[0] if lrs else None, loss_scale, timer_ms, extra)
        self.monitor.write_events(events)
