"""`loss.backward()` on what `engine(...)` returned: the engine's backward without `engine.backward`.

[Note: torch-style backward]
Upstream DeepSpeed 0.19 lets a training loop call `loss.backward()` (or `out.backward(grad)`)
on what the engine's forward returned, then `engine.step()`, as with a plain module; the
result equals `engine.backward(loss)`'s. Here every trainable parameter carries a tensor
hook (`on_param_grad`), which sees each gradient a backward brings to the parameter before
autograd adds it to `param.grad`. When such a gradient arrives while no backward of this
engine is under way and no `engine.backward` runs, the engine does what `engine.backward` does
before autograd (`_backward_prologue`), before that first gradient is accumulated, and queues
on the autograd run (its graph task) a callback that does what it does after (`_backward_epilogue`: the last buckets reduced, stages 0-1's reduction at the
boundary). Each gradient is divided by `gradient_accumulation_steps` where it reaches its
parameter, as `engine.backward` divides the loss: so a loss computed from several returned
tensors (an HF model's `loss` and the `logits` it came from), an auxiliary loss a module kept
on itself, or a call of `engine.module(x)` directly, all get their gradients divided exactly
once, and gradients with respect to inputs (`torch.autograd.grad`, a gradient penalty) are
not divided at all, as in plain PyTorch. This holds at every stage (upstream: 1-3). (So
`torch.autograd.grad(loss, params)` returns gradients divided by the accumulation steps too,
like everything a backward brings to the parameters.)
Reentrant activation checkpointing runs each segment's backward as a graph task of its own,
nested in the outer one; gradients arriving there belong to the backward under way. When the
first gradient of a backward arrives inside such a segment (a segment reached before any other
parameter), the end is queued on the segment's task, which ends first: the engine then
reduces what came so far, and the rest of the backward begins again and reduces the rest;
the same sums (stage 0-1 rounding aside), one more round of collectives.

A loss scale cannot be applied on the way: a gradient that reaches a parameter in fp16 has
underflowed already. So with fp16's loss scale the loss must be scaled where it is computed,
`engine.scale(loss).backward()`; a plain `loss.backward()` then raises before any gradient
is accumulated, naming both fixes (as upstream, which raises after). `engine.scale` is good
for the next torch-style backward only: `engine.backward` and `engine.step` clear it.

While any engine's `engine.backward` runs, the hooks pass gradients through untouched: its
loss is scaled already, and another engine whose parameters that loss reached (a GAN's
discriminator under the generator's loss) must not take those gradients as its own backward.
They stay what they were, a backward from outside, refused at that engine's next backward
or step or discarded by its `zero_grad()` (engine.py's `_refuse_stray_grads`).
"""

from __future__ import annotations

import weakref
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


class TorchStyleBackward:
    """One engine's side of [Note: torch-style backward]."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._active = False  # a torch-style backward is under way (its end is queued)
        self._scaled_by_caller = False  # engine.scale(loss) applied the loss scale for the next one
        self._last_scaled: Optional[weakref.ref] = None  # what engine.scale returned last

    def hook(self, params: list) -> list:
        """Hook each of `params` (the trainable ones); returns the handles."""
        return [p.register_hook(self.on_param_grad) for p in params]

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`engine.scale(loss)`: the loss times the loss scale, for the caller's `.backward()`."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "engine.scale(loss) takes a one-element loss tensor, got "
                + (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__)
                + "; for a non-scalar output call out.backward(grad) directly (bf16 and fp32 need no scale)"
            )
        if loss.grad_fn is None:
            raise ValueError(
                "engine.scale(loss): the loss has no grad_fn (it was detached, or computed under no_grad), so "
                "no backward can run from it; compute it from the engine's outputs with gradients enabled"
            )
        if self._last_scaled is not None and self._last_scaled() is loss:
            raise ValueError("engine.scale(loss): this loss is scaled already; scale the unscaled loss once")
        scale = self._engine.optimizer.loss_scale
        if scale == 1.0:
            return loss
        scaled = loss.float() * scale
        self._scaled_by_caller = True
        self._last_scaled = weakref.ref(scaled)
        return scaled

    def is_scaled(self, loss: Any) -> bool:
        """Whether `loss` is what `scale()` returned last (engine.backward would scale it again)."""
        return self._last_scaled is not None and self._last_scaled() is loss

    def forget_scale(self) -> None:
        """engine.backward or engine.step ran: an unused `scale()` must not vouch for a later backward."""
        self._scaled_by_caller = False

    def close_abandoned(self) -> None:
        """A torch-style backward that raised never reached its end: undo its start (the engine
        calls this at its next forward, backward or step)."""
        if self._active:
            self._active = False
            self._engine._autograd_over(abandoned=True)

    def on_param_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient on its way into a parameter's `.grad` (see the note)."""
        if not self._active:
            if _RUNNING.depth:
                return grad  # an engine.backward's run: its loss is scaled already
            self._begin()
        # Else this backward is under way: in its own graph task, or in one nested inside it
        # (reentrant activation checkpointing runs a backward of its own for each segment).
        steps = self._engine.gradient_accumulation_steps()
        return grad if steps == 1 else grad / steps

    def _begin(self) -> None:
        engine = self._engine
        scaled, self._scaled_by_caller = self._scaled_by_caller, False
        if engine.optimizer.loss_scale != 1.0 and not scaled:
            raise RuntimeError(
                f"loss.backward() through this engine's parameters needs the loss scaled first (fp16, loss scale "
                f"{engine.optimizer.loss_scale}): call engine.backward(loss), or engine.scale(loss).backward()"
            )
        engine._backward_prologue("loss.backward()")
        self._active = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._active = False
        self._engine._autograd_over()
        self._engine._backward_epilogue()
