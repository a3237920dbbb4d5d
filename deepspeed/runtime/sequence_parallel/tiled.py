"""Tiled compute along the sequence (ALST): run a token-wise function on slices of the sequence
so that its large intermediates (an MLP's [b, s, 4h] activations, the [b, s, vocab] logits)
exist for one slice at a time, in forward and in backward.

[Note: tiling and its backward]
Forward runs `fn` on each slice without autograd and keeps only the input. Backward runs `fn`
again on each slice with autograd, back-propagates that slice's part of the incoming gradient
(`torch.autograd.backward`), and writes the slice's input gradient into its place. The
parameters' gradients accumulate over the slices as autograd always accumulates them, so they
are the untiled gradients up to the order of the additions. Under ZeRO-3 each slice's
recomputation is a forward inside backward, which the stage-3 coordinator handles as it does
activation checkpointing (hooks.py), and each accumulation into a trained parameter's `.grad`
hands the engine that slice's part, which it reduces: linear, so the same sum, at the cost of
one reduction per slice for the tiled parameters (`compute_params` is accepted as upstream's
argument; nothing needs it here). `fn` must be token-wise along the sequence (an MLP, a norm,
the logits and their loss): attention is not. Slices are `torch.tensor_split`'s, each made contiguous
(HF losses `.view` their inputs): lengths that `shards` does not divide give slices one token
apart, never dropped tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch


def _slices(length: int, shards: int) -> list:
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"tiled compute: shards must be a positive integer, got {shards!r}")
    bounds = torch.tensor_split(torch.arange(length), min(shards, max(length, 1)))
    return [slice(int(b[0]), int(b[-1]) + 1) for b in bounds if b.numel()]


def _take(t: torch.Tensor, window: slice, dim: int) -> torch.Tensor:
    index = [slice(None)] * t.dim()
    index[dim] = window
    return t[tuple(index)]


class SequenceTiledCompute(torch.autograd.Function):
    """The general tiled function behind `sequence_tiled_compute` ([Note: tiling and its backward])."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable,
        seqlen: int,
        shards: int,
        keys_to_shard: tuple,
        keys_to_pass: tuple,
        grad_key: Optional[str],
        output_dim: int,
        output_reduction: Optional[str],
        *tensors: Any,
    ) -> torch.Tensor:
        sharded = dict(zip(keys_to_shard, tensors[: len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, tensors[len(keys_to_shard) :]))
        ctx.fn, ctx.passed, ctx.grad_key = fn, passed, grad_key
        ctx.keys, ctx.output_dim, ctx.reduction = keys_to_shard, output_dim, output_reduction
        ctx.windows = _slices(seqlen, shards)
        ctx.save_for_backward(*sharded.values())
        with torch.no_grad():
            outputs = [
                fn(**{k: v[:, w].contiguous() for k, v in sharded.items()}, **passed) for w in ctx.windows
            ]
        if output_reduction is None:
            return torch.cat(outputs, dim=output_dim)
        weights = [(w.stop - w.start) / seqlen for w in ctx.windows] if output_reduction == "mean" else None
        if weights is None:
            return torch.stack(outputs).sum(0)
        return sum(o * wt for o, wt in zip(outputs, weights))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        sharded = dict(zip(ctx.keys, ctx.saved_tensors))
        target = sharded.get(ctx.grad_key)
        input_grad = None if target is None or not target.requires_grad else torch.zeros_like(target)
        seqlen = sum(w.stop - w.start for w in ctx.windows)
        for window in ctx.windows:
            pieces = {k: v[:, window].detach().contiguous() for k, v in sharded.items()}
            if input_grad is not None:
                pieces[ctx.grad_key].requires_grad_(True)
            with torch.enable_grad():
                out = ctx.fn(**pieces, **ctx.passed)
            if ctx.reduction is None:
                part = _take(grad, window, ctx.output_dim)
            else:
                part = grad * ((window.stop - window.start) / seqlen if ctx.reduction == "mean" else 1.0)
            torch.autograd.backward(out, part)
            if input_grad is not None:
                input_grad[:, window] = pieces[ctx.grad_key].grad
        n = len(ctx.keys) + len(ctx.passed)
        grads = [None] * n
        if input_grad is not None:
            grads[list(ctx.keys).index(ctx.grad_key)] = input_grad
        return (None,) * 8 + tuple(grads)


def sequence_tiled_compute(
    fn: Callable,
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict,
    kwargs_to_pass: dict,
    grad_requiring_tensor_key: Optional[str],
    compute_params: Optional[Sequence] = None,
    output_unshard_dimension: int = 1,
    output_reduction: Optional[str] = None,
) -> torch.Tensor:
    """`fn(**kwargs_to_shard sliced along dim 1, **kwargs_to_pass)` over `shards` slices of the
    sequence (upstream's arguments). The output is the slices' outputs joined along
    `output_unshard_dimension`, or with `output_reduction` "sum" their sum, "mean" their mean
    weighted by slice length (the whole sequence's mean when `fn` returns a per-token mean).
    Only `kwargs_to_shard[grad_requiring_tensor_key]` gets an input gradient; parameters get
    theirs ([Note: tiling and its backward])."""
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(
            f"sequence_tiled_compute: output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}"
        )
    for key, value in kwargs_to_shard.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"sequence_tiled_compute: kwargs_to_shard[{key!r}] must be a [b, {seqlen}, ...] tensor, got {shape}"
            )
    if grad_requiring_tensor_key is not None and grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"sequence_tiled_compute: grad_requiring_tensor_key={grad_requiring_tensor_key!r} is not one of "
            f"kwargs_to_shard's keys {sorted(kwargs_to_shard)}"
        )
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        tuple(kwargs_to_shard),
        tuple(kwargs_to_pass),
        grad_requiring_tensor_key,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, module, x, shards, compute_params)`: `fn(module, x)` on `shards` slices
    of x's sequence dimension (dim -2: [b, s, h] or [s, h]), as upstream's; the output has
    fn's shape ([Note: tiling and its backward])."""

    @staticmethod
    def forward(
        ctx: Any, fn: Callable, module: Any, x: torch.Tensor, shards: int, compute_params: Any
    ) -> torch.Tensor:
        ctx.fn, ctx.module = fn, module
        ctx.windows = _slices(x.shape[-2], shards)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, _take(x, w, -2).contiguous()) for w in ctx.windows], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        x_grad = torch.zeros_like(x) if x.requires_grad else None
        for window in ctx.windows:
            piece = _take(x, window, -2).detach().contiguous().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, piece)
            torch.autograd.backward(out, _take(grad, window, -2))
            if x_grad is not None:
                _take(x_grad, window, -2).copy_(piece.grad)
        return None, None, x_grad, None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)`:
    `fn(module, x_slice, y_slice)` returns a slice's loss (e.g. the logits and their
    cross-entropy, so the [b, s, vocab] logits exist one slice at a time). "mean" weights each
    slice by its tokens (its true entries in `mask` [b, s], if given: a loss meaning over those),
    "sum" adds the slices' losses ([Note: tiling and its backward]).

    [Note: uncounted slices]
    A slice without a counted token adds nothing, but `fn` still runs on it, forward and
    backward (with a zero gradient): under ZeRO-3 each call of the head gathers its parameters
    and each backward reduces their gradients, collectives that every rank must join the same
    number of times, also the sequence-parallel rank whose whole shard has no label. `fn`'s
    backward must then give zero gradients for a zero incoming one (torch's cross_entropy
    does, even as a mean over no token)."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable,
        module: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: Optional[torch.Tensor],
        shards: int,
        compute_params: Any,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(
                f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got {output_reduction!r}"
            )
        ctx.fn, ctx.module = fn, module
        ctx.windows = _slices(x.shape[1], shards)
        if output_reduction == "sum":
            ctx.weights = [1.0] * len(ctx.windows)
        else:
            counts = [
                float(mask[:, w].sum()) if mask is not None else float(w.stop - w.start) for w in ctx.windows
            ]
            total = sum(counts) or 1.0
            ctx.weights = [c / total for c in counts]
        ctx.save_for_backward(x, y)
        losses = []
        with torch.no_grad():  # every slice runs, counted or not: [Note: uncounted slices]
            for w, wt in zip(ctx.windows, ctx.weights):
                loss = fn(module, x[:, w].contiguous(), y[:, w].contiguous())
                if wt:
                    losses.append(loss * wt)
        return torch.stack(losses).sum() if losses else x.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, y = ctx.saved_tensors
        x_grad = torch.zeros_like(x) if x.requires_grad else None
        for window, weight in zip(ctx.windows, ctx.weights):
            piece = x[:, window].detach().contiguous().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, piece, y[:, window].contiguous())
            # An uncounted slice's loss may be NaN (a mean over no token): it gets a zero gradient.
            torch.autograd.backward(loss, grad * weight if weight else torch.zeros_like(loss))
            if x_grad is not None:
                x_grad[:, window] = piece.grad
        return None, None, x_grad, None, None, None, None, None
