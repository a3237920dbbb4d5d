"""Pipeline schedules: what each stage does at each step, as lists of instructions (upstream's module).

A schedule for `stages` stages and `micro_batches` micro-batches, seen from stage `stage_id`,
is iterated step by step; each step is a list of `PipeInstruction`s for that stage to run in
order. Instructions that act on a micro-batch name the buffer it lives in (`buffer_id`), a
slot reused round-robin among `num_pipe_buffers()` slots. Custom pipeline engines (and their
tests) drive themselves with these; this package's `PipelineEngine` runs one stage, whose
`TrainSchedule` is the plain loop it runs: load, forward and backward per micro-batch, then
the step.

[Note: the 1F1B train schedule]
`TrainSchedule` alternates forward and backward slots at every stage ("one forward, one
backward"), so a stage holds at most `stages - stage_id` micro-batches' activations. Micro-
batch m runs forward at stage s in step `2m + s` and backward in step `2m + 2*stages - 1 - s`:
each forward reaches the next stage one step later, each gradient the previous stage one step
later, and at the last stage a micro-batch's backward directly follows its forward. A stage's
forward slots are the steps of its own parity, its backward slots the others; a slot whose
micro-batch is out of range is idle. What a stage computed in one step is sent in the next,
when the neighbour receives it. The last step also reduces the gradients and steps the
optimizer. `2 * (micro_batches + stages - 1)` steps in all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "DataParallelSchedule",
    "ForwardPass",
    "InferenceSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
]


class PipeInstruction:
    """One thing a stage does; keyword arguments become attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer (the end of a batch)."""


class ReduceGrads(PipeInstruction):
    """Reduce the stage's gradients over its data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of weights tied across stages (embeddings)."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on the micro-batch held in buffer `buffer_id`."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch from the data iterator into the buffer (first and last stages)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers forward on the buffer's input."""


class BackwardPass(BufferOpInstruction):
    """Run the stage's layers backward from the buffer's output gradient (or loss)."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's output to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's output into the buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's input to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's output from the next stage."""


class PipeSchedule:
    """The base: `steps()` yields one list of instructions per step."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        for name, value, low in (("micro_batches", micro_batches, 1), ("stages", stages, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{type(self).__name__}: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(stage_id, int) or not 0 <= stage_id < stages:
            raise ValueError(f"{type(self).__name__}: stage_id={stage_id!r} must be in [0, {stages})")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    def steps(self) -> Iterator[list]:
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        """Buffers the stage needs at once (micro-batches whose state it holds)."""
        return self.micro_batches

    def __iter__(self) -> Iterator[list]:
        return iter(self.steps())

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} is outside [0, {self.micro_batches})")
        return micro_batch_id % self.num_pipe_buffers()


class InferenceSchedule(PipeSchedule):
    """Forward only: micro-batch m runs at stage s in step `m + s`; `micro_batches + stages - 1` steps."""

    def num_pipe_buffers(self) -> int:
        return 2  # one being computed, one being sent

    def steps(self) -> Iterator[list]:
        for step in range(self.micro_batches + self.stages - 1):
            micro = step - self.stage_id
            cmds: list = []
            if not self.is_last_stage and self._valid_micro_batch(micro - 1):
                cmds.append(SendActivation(self._buffer_idx(micro - 1)))
            if self._valid_micro_batch(micro):
                buffer = self._buffer_idx(micro)
                if self.is_first_stage or self.is_last_stage:
                    cmds.append(LoadMicroBatch(buffer))  # inputs at the first, labels at the last
                if not self.is_first_stage:
                    cmds.append(RecvActivation(buffer))
                cmds.append(ForwardPass(buffer))
            yield cmds


class TrainSchedule(PipeSchedule):
    """Forward and backward interleaved ([Note: the 1F1B train schedule])."""

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _slot(self, step: int) -> tuple:
        """`(micro-batch, is_forward)` of this stage's slot in `step` (the micro-batch may be out of range)."""
        if (step - self.stage_id) % 2 == 0:
            return (step - self.stage_id) // 2, True
        return (step - 2 * self.stages + 1 + self.stage_id) // 2, False

    def steps(self) -> Iterator[list]:
        total = 2 * (self.micro_batches + self.stages - 1)
        for step in range(total):
            micro, forward = self._slot(step)
            previous, _ = self._slot(step - 1)  # the other kind of slot
            cmds: list = []
            # Send what the previous step computed: its neighbour receives it in this step.
            if step > 0 and self._valid_micro_batch(previous):
                if forward and not self.is_first_stage:
                    cmds.append(SendGrad(self._buffer_idx(previous)))
                elif not forward and not self.is_last_stage:
                    cmds.append(SendActivation(self._buffer_idx(previous)))
            if self._valid_micro_batch(micro):
                buffer = self._buffer_idx(micro)
                if forward:
                    if self.is_first_stage or self.is_last_stage:
                        cmds.append(LoadMicroBatch(buffer))
                    if not self.is_first_stage:
                        cmds.append(RecvActivation(buffer))
                    cmds.append(ForwardPass(buffer))
                else:
                    if not self.is_last_stage:
                        cmds.append(RecvGrad(buffer))
                    cmds.append(BackwardPass(buffer))
            if step == total - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            yield cmds


class DataParallelSchedule(PipeSchedule):
    """One stage, plain data parallelism: load, forward and backward per micro-batch, then the step."""

    def num_pipe_buffers(self) -> int:
        return 1

    def steps(self) -> Iterator[list]:
        for micro in range(self.micro_batches):
            cmds: list = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if micro == self.micro_batches - 1:
                cmds.extend([ReduceGrads(), OptimizerStep()])
            yield cmds
