"""Reduce-scatter a list of tensors in one collective, each split as ZeRO splits a parameter.

Each tensor of n elements is cut into `world` pieces of `ceil(n / world)` elements (rank r
gets elements `[r * size, (r + 1) * size)`, the last pieces shorter or empty), and every rank
receives its piece of each tensor averaged over the group's ranks. All the pieces travel in
one `reduce_scatter_tensor` (each rank's share divided by the world size before the sum, as
the engine's reducer divides: an fp16 sum of finite shares cannot overflow then).
`all_to_all_quant_reduce` does the same through qgZ's int8 all-to-all (block-wise quantized,
zero/quantized.py), over the whole group in one hop.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from deepspeed import comm as dist
from deepspeed.runtime.zero import quantized

__all__ = ["all_to_all_quant_reduce", "reduce_scatter_coalesced"]


def _rows(tensors: list, world: int, where: str) -> tuple:
    """`(send, sizes)`: `send` `[world, sum(sizes)]`, row r holding rank r's piece of each tensor."""
    if not tensors:
        raise ValueError(f"{where}: no tensors given")
    first = tensors[0]
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{where}: every tensor must share one dtype and device; got {first.dtype} on {first.device} "
                f"and {t.dtype} on {t.device} (call it once per dtype)"
            )
    sizes = [math.ceil(t.numel() / world) for t in tensors]
    blocks = [F.pad(t.reshape(-1), (0, world * n - t.numel())).view(world, n) for t, n in zip(tensors, sizes)]
    return torch.cat(blocks, dim=1), sizes


def _pieces(received: torch.Tensor, tensors: list, sizes: list, rank: int) -> list:
    """This rank's piece of each tensor out of the received row, without the padding."""
    out, at = [], 0
    for t, n in zip(tensors, sizes):
        mine = max(0, min(n, t.numel() - rank * n))
        out.append(received[at : at + mine])
        at += n
    return out


def reduce_scatter_coalesced(tensors: list, group: Optional[Any] = None) -> list:
    """This rank's piece of each of `tensors`, averaged over `group` (see the module note)."""
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    send, sizes = _rows(tensors, world, "reduce_scatter_coalesced")
    send.mul_(1.0 / world)
    received = torch.empty(sum(sizes), dtype=send.dtype, device=send.device)
    dist.reduce_scatter_tensor(received, send.reshape(-1), group=group)
    return _pieces(received, tensors, sizes, rank)


def all_to_all_quant_reduce(tensors: list, groups: Optional[dict] = None) -> list:
    """`reduce_scatter_coalesced` over the world through int8 block-wise quantization (qgZ).

    Upstream's `groups` maps node-local and cross-node groups for a two-hop exchange; here the
    exchange is one hop over the world, so only an empty `groups` is taken (the engine's
    `zero_quantized_gradients` does the two-hop reduction across nodes itself).
    """
    if groups:
        raise ValueError(
            f"all_to_all_quant_reduce: groups={sorted(groups)!r} asks for upstream's two-hop exchange, which "
            "this function does not do; pass {} (one hop over the world), or let the engine reduce with "
            "zero_optimization.zero_quantized_gradients"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    send, sizes = _rows(tensors, world, "all_to_all_quant_reduce")
    received = quantized.reduce_scatter(send, None).mul_(1.0 / world)
    return _pieces(received, tensors, sizes, rank)
