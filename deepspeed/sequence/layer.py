"""Ulysses attention: an all-to-all turns sequence-sharded q, k, v into head-sharded ones, the
local attention runs over the whole sequence for its heads, and a second all-to-all turns the
output back into sequence shards.

[Note: the sequence all-to-all]
`seq_all_to_all(x, scatter_dim, gather_dim, group)` cuts `x` into `P` equal blocks along
`scatter_dim` (P = the group's size), sends block i to the group's rank i, and joins what it
receives along `gather_dim` in rank order. With q of shape [s/P, b, h, d] (sequence first,
upstream's `DistributedAttention` layout), scatter 2 and gather 0 give [s, b, h/P, d]: rank i
holds heads [i h/P, (i+1) h/P) of every position, in sequence order because the sequence-
parallel ranks hold consecutive shards in rank order. The inverse swaps the two dimensions,
and it is also the gradient: an all-to-all only moves elements, so the gradient of each moved
element goes back along the same route. One `all_to_all_single` carries every block (gloo,
nccl and the CPU backends all have it in torch 2.13); the blocks are made contiguous first.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from deepspeed import comm as dist


def _check_divisible(x: torch.Tensor, dim: int, parts: int, what: str) -> None:
    if x.shape[dim] % parts != 0:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} has {x.shape[dim]} entries, "
            f"not divisible by the sequence-parallel size {parts}; the heads (and for sequence shards "
            "the local sequence) must split evenly over the sequence-parallel ranks"
        )


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """[Note: the sequence all-to-all], without autograd."""
    parts = dist.get_world_size(group)
    if parts == 1:
        return x
    _check_divisible(x, scatter_dim, parts, "seq_all_to_all")
    send = torch.stack(torch.chunk(x, parts, dim=scatter_dim)).contiguous()  # [P, ...block]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
        ctx.dims = (scatter_dim, gather_dim)
        ctx.group = group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def seq_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """Scatter `x` along `scatter_dim` over `group`'s ranks, gather along `gather_dim`; autograd
    sends gradients back the same way ([Note: the sequence all-to-all])."""
    ndim = x.dim()
    return _SeqAllToAll.apply(x, scatter_dim % ndim, gather_dim % ndim, group)


class DistributedAttention(nn.Module):
    """Upstream's Ulysses layer: `local_attention(q, k, v, *args, **kwargs)` over the whole
    sequence for this rank's heads.

    q, k, v arrive sequence-sharded; `scatter_idx` is their heads dimension and `gather_idx`
    their sequence dimension (defaults 2 and 0: the [s/P, b, h, d] layout). The output of
    `local_attention` must keep that layout with the heads split ([s, b, h/P, d]); it is
    returned sequence-sharded with all heads ([s/P, b, h, d]). The heads of q, k and v must be
    divisible by the group's size. A keyword `batch_dim_idx` (newer upstream callers pass it)
    is accepted and not needed: the layout follows from the two indices.
    """

    def __init__(
        self,
        local_attention: Callable,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
    ) -> None:
        super().__init__()
        if scatter_idx == gather_idx:
            raise ValueError(
                f"DistributedAttention: scatter_idx and gather_idx are both {scatter_idx}; they must name the "
                "heads and the sequence dimensions"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        kwargs.pop("batch_dim_idx", None)
        q, k, v = (
            seq_all_to_all(t, self.scatter_idx, self.gather_idx, self.spg) for t in (query, key, value)
        )
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.gather_idx, self.scatter_idx, self.spg)


class _AllGatherStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # Every rank's copy of x_r got a gradient: x_r's is their sum. One all-to-all brings
        # rank j's grad[r] to rank r, which adds them in rank order (the same sum on any run).
        send = grad.contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=ctx.group)
        return received.sum(dim=0), None


def all_gather_differentiable(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`x` of every rank of `group`, stacked in rank order ([P, *x.shape]); the gradient of each
    rank's `x` is the sum of the gradients all ranks give its copy. For the sequence-parallel
    loss (docs/sequence_parallel.md). torch.distributed.nn.functional.all_gather does the same
    but, on gloo in torch 2.13, its backward fails in a group that does not hold rank 0 (it
    passes group ranks as global ones), as with sp=2, dp=2."""
    return _AllGatherStack.apply(x, group)


def token_weighted_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group: Any) -> torch.Tensor:
    """The loss of the whole sequences from each sp rank's token mean `loss` over its shard:
    `sum_r n_r * loss_r / sum_r n_r`, with `n_r` rank r's labels other than -100
    (docs/sequence_parallel.md). A shard without such labels has a NaN mean (0 / 0): it counts
    for nothing, and its gradient is zero, not NaN. Every rank of `group` returns the same value;
    if no rank has a label, the result is 0."""
    count = (shift_labels != -100).sum().to(loss.dtype)
    losses = all_gather_differentiable(loss, group)
    counts = all_gather_differentiable(count.detach(), group)
    safe = torch.where(counts > 0, losses, torch.zeros_like(losses))
    return (safe * counts).sum() / counts.sum().clamp(min=1)
