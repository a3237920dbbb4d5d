"""Reduce-scatter full gradients to the ranks that own them, in buckets (ZeRO-3 gradients).

[Note: gradient buckets]
When autograd has accumulated a parameter's full gradient, `add()` takes it (and frees
`param.grad` at once). Gradients of one (group, dtype) are collected until the bucket holds
`reduce_bucket_size` elements, then one `reduce_scatter_tensor` sends each rank the sum of
its slices. The input is laid out rank-major like the gather's output,
`[rank 0: g0 slice, g1 slice, ...][rank 1: ...]`, so each rank receives its slices of all
the bucket's gradients contiguously. The result is averaged over ranks and added to the
parameter's fp32 gradient shard, which accumulates over micro-steps. `flush()` sends what is
left at the end of backward. Hooks fire in the same order on every rank (the graph is
the same), so every rank forms the same buckets.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from deepspeed import comm as dist
from deepspeed.runtime.zero.param_state import ZeroParamState


class GradientReducer:
    """Owns the pending buckets; `grad_shard(state)` returns where a state's reduced slice goes."""

    def __init__(
        self, bucket_elems: int, grad_shard: Callable, comm_dtype: Optional[torch.dtype] = None
    ) -> None:
        self.bucket_elems = max(1, int(bucket_elems))
        self.grad_shard = grad_shard  # state -> fp32 tensor [partition_size] to accumulate into
        self.comm_dtype = comm_dtype  # None: reduce in the gradient's own dtype
        self._pending: dict = {}  # (id(group), dtype) -> list of (state, grad)
        self._pending_elems: dict = {}
        self.reduce_calls = 0  # collectives issued, for tests and benchmarks

    def add(self, state: ZeroParamState, grad: torch.Tensor) -> None:
        dtype = self.comm_dtype or grad.dtype
        key = (id(state.group), dtype)
        self._pending.setdefault(key, []).append((state, grad))
        self._pending_elems[key] = self._pending_elems.get(key, 0) + state.world_size * state.partition_size
        if self._pending_elems[key] >= self.bucket_elems:
            self._reduce(key)

    def flush(self) -> None:
        for key in list(self._pending):
            self._reduce(key)

    def _reduce(self, key: tuple) -> None:
        items = self._pending.pop(key)
        self._pending_elems.pop(key)
        dtype = key[1]
        states = [state for state, _ in items]
        world, total = states[0].world_size, sum(s.partition_size for s in states)
        send = torch.empty(world, total, dtype=dtype, device=items[0][1].device)
        offset = 0
        for state, grad in items:
            flat = grad.reshape(-1).to(dtype)
            if state.padding:
                flat = F.pad(flat, (0, state.padding))
            send[:, offset : offset + state.partition_size].copy_(flat.view(world, state.partition_size))
            offset += state.partition_size
        del items, grad, flat  # the full gradients are packed: free them before the collective
        received = torch.empty(total, dtype=dtype, device=send.device)
        dist.reduce_scatter_tensor(received, send.view(-1), group=states[0].group, input_reusable=True)
        self.reduce_calls += 1
        offset = 0
        for state in states:
            piece = received[offset : offset + state.partition_size]
            target = self.grad_shard(state)
            target.add_(piece.to(device=target.device, dtype=torch.float32), alpha=1.0 / world)
            offset += state.partition_size
