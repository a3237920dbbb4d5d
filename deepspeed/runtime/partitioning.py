"""Splitting a sequence into contiguous parts, and a tensor across a group's ranks.

Upstream keeps these in `deepspeed.runtime.utils` (re-exported there): pipeline code splits
layers into stages with `partition_uniform` (by count) or `partition_balanced` (by weight,
such as parameter counts), and `PartitionedTensor` holds one rank's slice of a tensor that
`full()` gathers back.

A partition of N items into P parts is a list of P + 1 boundaries, `parts[0] == 0`,
`parts[P] == N`, non-decreasing: part p is `items[parts[p]:parts[p + 1]]`.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Optional

import torch

from deepspeed import comm as dist

__all__ = ["PartitionedTensor", "partition_balanced", "partition_uniform", "prefix_sum_inc"]


def prefix_sum_inc(weights: list) -> list:
    """Inclusive prefix sums: `[3, 4, 5]` -> `[3, 7, 12]`."""
    return list(itertools.accumulate(weights))


def partition_uniform(num_items: int, num_parts: int) -> list:
    """`num_items` split into `num_parts` parts whose sizes differ by at most one (the larger
    ones first); with fewer items than parts, one item each and empty parts after."""
    _check_parts(num_parts)
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, larger = divmod(num_items, num_parts)
    return [p * size + min(p, larger) for p in range(num_parts + 1)]


def partition_balanced(weights: list, num_parts: int) -> list:
    """Contiguous parts whose heaviest is as light as it can be (weights >= 0).

    The least feasible bottleneck is found by bisection over the sums of contiguous runs (the
    only values it can take); the parts are then filled greedily from the left, each taking
    items while it stays within that bottleneck, and any parts left over stay empty at the end.
    """
    _check_parts(num_parts)
    n = len(weights)
    if any(w < 0 for w in weights):
        raise ValueError(f"partition_balanced: weights must be >= 0, got {min(weights)}")
    if n == 0:
        return [0] * (num_parts + 1)
    prefix = [0, *prefix_sum_inc(weights)]
    # Every run's sum, computed as the greedy fill computes it (a difference of prefix sums),
    # so float comparisons agree.
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo = bisect.bisect_left(candidates, max(weights))  # no bottleneck below the heaviest item
    hi = len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_fill(prefix, candidates[mid])) - 1 <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    parts = _fill(prefix, candidates[lo])
    return parts + [n] * (num_parts + 1 - len(parts))


def _fill(prefix: list, bottleneck: Any) -> list:
    """Boundaries of the greedy left-to-right fill within `bottleneck` (as many parts as it takes)."""
    n = len(prefix) - 1
    parts, start = [0], 0
    while start < n:
        end = start + 1  # every part takes at least one item (each weighs <= bottleneck)
        while end < n and prefix[end + 1] - prefix[start] <= bottleneck:
            end += 1
        parts.append(end)
        start = end
    return parts


def _check_parts(num_parts: int) -> None:
    if not isinstance(num_parts, int) or isinstance(num_parts, bool) or num_parts < 1:
        raise ValueError(f"num_parts must be a positive int, got {num_parts!r}")


class PartitionedTensor:
    """This rank's slice of a tensor split across `group` (flattened, `partition_uniform`
    slices); `full()` gathers the whole tensor back on every rank (a collective)."""

    def __init__(
        self, tensor: torch.Tensor, group: Any, partition_meta: Optional[torch.Tensor] = None
    ) -> None:
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = tuple(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, end = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().reshape(-1)[start:end].clone()

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any, device: Any = None):
        """The PartitionedTensor `to_meta()` described, around this rank's `local_part`."""
        values = [int(v) for v in meta.tolist()]
        ndim = values[0]
        obj = cls.__new__(cls)
        obj.group = group
        obj.orig_size = tuple(values[1 : 1 + ndim])
        obj.num_parts = values[1 + ndim]
        obj.partition = values[2 + ndim :]
        obj.rank = dist.get_rank(group=group)
        if obj.num_parts != dist.get_world_size(group=group) or len(obj.partition) != obj.num_parts + 1:
            raise ValueError(
                f"PartitionedTensor.from_meta: the meta describes {obj.num_parts} parts, but the group has "
                f"{dist.get_world_size(group=group)} ranks"
            )
        obj.local_data = local_part
        obj.orig_device = local_part.device if device is None else torch.device(device)
        return obj

    def to_meta(self) -> torch.Tensor:
        """A 1D int64 tensor describing the split (shape and boundaries), for `from_meta`."""
        return torch.tensor(
            [len(self.orig_size), *self.orig_size, self.num_parts, *self.partition],
            dtype=torch.long,
            device=self.local_data.device,
        )

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def data(self) -> torch.Tensor:
        return self.local_data

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's slice (call on every rank of the group)."""
        sizes = [self.partition[p + 1] - self.partition[p] for p in range(self.num_parts)]
        longest = max(sizes)
        piece = torch.zeros(longest, dtype=self.local_data.dtype, device=self.local_data.device)
        piece[: self.local_data.numel()] = self.local_data.reshape(-1)
        gathered = torch.empty(longest * self.num_parts, dtype=piece.dtype, device=piece.device)
        dist.all_gather_into_tensor(gathered, piece, group=self.group)
        rows = gathered.view(self.num_parts, longest)
        flat = torch.cat([rows[p, : sizes[p]] for p in range(self.num_parts)])
        out = flat.view(self.orig_size)
        return out if device is None else out.to(device)
