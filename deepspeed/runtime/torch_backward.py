"""`loss.backward()` on what `engine(...)` returned: the engine's backward without `engine.backward`.

[Note: torch-style backward]
Upstream DeepSpeed 0.19 lets a training loop call `loss.backward()` (or `out.backward(grad)`)
on what the engine's forward returned, then `engine.step()`, as with a plain module; at
stages 1-3 the result equals `engine.backward(loss)`'s, bit for bit. So the engine's forward
hooks every tensor it returns that requires a gradient (`watch`). When a gradient first
reaches one of them in an autograd run that `engine.backward` did not start (a new graph
task, `torch._C._current_graph_task_id()`), the engine does what `engine.backward` does
before autograd (`_backward_prologue`) and queues, on that graph task, a callback that does
what it does after (`_backward_epilogue`: the last buckets reduced, stages 0-1's reduction
at the boundary). Each output's gradient is divided by `gradient_accumulation_steps` on its
way, as `engine.backward` divides the loss. Here this holds at stage 0 too (upstream refuses
it there).

A loss scale cannot be applied on the way: a gradient that reaches an output in fp16 has
underflowed already. So with fp16's loss scale the loss must be scaled where it is computed,
`engine.scale(loss).backward()`; a plain `loss.backward()` then raises before any gradient
is computed, naming both fixes (as upstream, which raises after).

While any engine's `engine.backward` runs, the hooks pass gradients through untouched: its
loss is scaled already, and another engine whose outputs that loss went through (a GAN's
discriminator under the generator's loss) must not take those gradients as its own backward.
Its parameters' gradients stay what they were, a backward from outside, refused at its next
backward or step or discarded by its `zero_grad()` (engine.py's `_refuse_stray_grads`).

A gradient that reaches the parameters other than through the returned tensors (an auxiliary
loss a module kept on itself) is not divided by the accumulation steps, as upstream.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed import process_state

__all__ = ["TorchStyleBackward", "engine_backward_running"]


class _EngineBackwards:
    """How many `engine.backward` calls are running in this process (nested: one per engine)."""

    def __init__(self) -> None:
        self.depth = 0

    def reset(self) -> None:
        self.depth = 0


_RUNNING = _EngineBackwards()
process_state.register("deepspeed.runtime.torch_backward._RUNNING", _RUNNING, _RUNNING.reset)


class engine_backward_running:
    """`with engine_backward_running():` around `engine.backward`'s autograd run."""

    def __enter__(self) -> None:
        _RUNNING.depth += 1

    def __exit__(self, *exc: Any) -> None:
        _RUNNING.depth -= 1


def _tensors(value: Any, depth: int = 0):
    """The tensors in `value`, found inside tuples, lists and dicts (an HF ModelOutput is a dict)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)


class TorchStyleBackward:
    """One engine's side of [Note: torch-style backward]."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._task: Optional[int] = None  # the graph task of the torch-style backward under way
        self._scaled_by_caller = False  # engine.scale(loss) applied the loss scale for the next one

    def watch(self, outputs: Any) -> None:
        """Hook the tensors of a forward's `outputs` that will get gradients."""
        if not torch.is_grad_enabled():
            return
        for tensor in _tensors(outputs):
            if tensor.requires_grad:
                tensor.register_hook(self._on_output_grad)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`engine.scale(loss)`: the loss times the loss scale, for the caller's `.backward()`."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError(
                f"engine.scale(loss) takes a one-element loss tensor computed from the engine's outputs (with a "
                f"grad_fn), got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + "; for a non-scalar output call out.backward(grad) directly (bf16 and fp32 need no scale)"
            )
        scale = self._engine.optimizer.loss_scale
        if scale == 1.0:
            return loss
        self._scaled_by_caller = True
        return loss.float() * scale

    def close_abandoned(self) -> None:
        """A torch-style backward that raised never reached its end: undo its start."""
        if self._task is not None:
            self._task = None
            self._engine._autograd_over(abandoned=True)

    def _on_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if _RUNNING.depth and self._task is None:
            return grad  # engine.backward's run (see the note): its loss is scaled already
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self.close_abandoned()
            self._begin(task)
        steps = self._engine.gradient_accumulation_steps()
        return grad if steps == 1 or grad is None else grad / steps

    def _begin(self, task: int) -> None:
        engine = self._engine
        scaled, self._scaled_by_caller = self._scaled_by_caller, False
        if engine.optimizer.loss_scale != 1.0 and not scaled:
            raise RuntimeError(
                f"loss.backward() on this engine's outputs needs the loss scaled first (fp16, loss scale "
                f"{engine.optimizer.loss_scale}): call engine.backward(loss), or engine.scale(loss).backward()"
            )
        engine._backward_prologue("loss.backward()")
        self._task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._task = None
        self._engine._autograd_over()
        self._engine._backward_epilogue()
