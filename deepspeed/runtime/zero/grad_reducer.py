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

[Note: overlap_comm]
With ``zero_optimization.overlap_comm`` (the stage-3 default) a bucket's reduce-scatter is
issued asynchronously and backward goes on computing while it runs; its result is added to
the gradient shards when it is waited on. At most `MAX_IN_FLIGHT` buckets are in flight (a
new one first completes the oldest), so the extra memory is one more bucket's buffers, and
`flush()` waits on everything, in issue order, so shards accumulate in the same order as the
synchronous path and the results are bitwise equal. qgZ's quantized buckets (quantized.py)
go through the same queue: quantized at issue, their all-to-all in flight (a two-hop one's
second hop issued by `_advance` once the first is over), dequantized and summed when waited
on. On a group whose collectives complete on issue (shared memory, comm/shm.py) there is
nothing to overlap: each bucket is packed straight into this rank's slot and reduced at
once, whatever `overlap_comm` says.

[Note: gradient scaling around the reduction]
Upstream's ``prescale_gradients`` and ``gradient_predivide_factor``: by default (factor 1),
and with prescaling, each rank divides its gradients by the world size before the sum, as
upstream's reduce-scatter paths do; with a factor `f` other than 1 it divides by `f` before
and multiplies by ``f / world_size`` after. Either way the result is the average, up to
rounding; with ``gradient_allreduce_op: "sum"`` it is then multiplied by the world size, the
sum. Dividing first is what keeps an fp16 sum from overflowing where each rank's
gradient is finite: summing first made the loss scale and the skipped steps depend on the
number of ranks (two ranks' 49152 overflowed fp16; their average does not).

[Note: the replica all-reduce]
Under MiCS (zero/mics.py) the reduce-scatter runs within a shard group; each received shard
is then divided by the number of replicas (not with ``gradient_allreduce_op: "sum"``) and
all-reduced over the replica group, before it is added to the gradient shard, so every
replica adds the average over the whole world. Every rank completes its buckets in issue
order, so the replica all-reduces pair up across the groups.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from deepspeed import comm as dist
from deepspeed.runtime.zero import quantized
from deepspeed.runtime.zero.lifecycle import ZeroParamState

MAX_IN_FLIGHT = 2  # asynchronous reduce-scatters outstanding at once (see [Note: overlap_comm])


class _InFlight:
    """One issued reduce-scatter: its handle, its buffers, and where the result goes."""

    __slots__ = ("handle", "buffers", "received", "states", "world")

    def __init__(self, handle: Any, buffers: tuple, received: torch.Tensor, states: list, world: int):
        self.handle = handle
        self.buffers = buffers  # the send buffer and the collective's scratch, alive until it finished
        self.received = received  # 1D [sum of the states' partition sizes]
        self.states = states
        self.world = world


class GradientReducer:
    """Owns the pending buckets; `accumulate(state, reduced, alpha)` adds a state's reduced slice
    (times `alpha`) to its fp32 gradient shard."""

    def __init__(
        self,
        bucket_elems: int,
        accumulate: Callable,
        comm_dtype: Optional[torch.dtype] = None,
        *,
        overlap_comm: bool = False,
        prescale_gradients: bool = False,
        predivide_factor: float = 1.0,
        sum_over_ranks: bool = False,
        settle: Optional[Callable] = None,
        replica_group: Any = None,
        quantized: bool = False,
    ) -> None:
        if predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {predivide_factor}")
        self.bucket_elems = max(1, int(bucket_elems))
        self.accumulate = accumulate  # (state, reduced slice, alpha) -> None
        # () -> None, after the last accumulate of a flush: the accumulator's copies that may
        # still be in flight must land before anyone reads the shards (optimizer.py's note on
        # offloaded gradients).
        self.settle = settle
        self.comm_dtype = comm_dtype  # None: reduce in the gradient's own dtype
        # torch_autocast: each parameter's own (ds_id -> dtype), which replaces `comm_dtype`.
        self.comm_dtypes: dict = {}
        self.overlap_comm = overlap_comm
        self.prescale_gradients = prescale_gradients
        self.predivide_factor = float(predivide_factor)
        self.sum_over_ranks = sum_over_ranks  # gradient_allreduce_op "sum": the sum, not the average
        # MiCS: the ranks holding the same shards ([Note: the replica all-reduce]); None: no replicas.
        self.replica_group = replica_group
        self.replicas = 1 if replica_group is None else dist.get_world_size(replica_group)
        self.quantized = quantized  # qgZ: int8 all-to-all ([Note: block-wise int8] in quantized.py)
        self.two_hop = None  # qgZ: a quantized.TwoHopReduce for the parameters' group, or None
        self._pending: dict = {}  # (id(group), dtype) -> list of (state, grad)
        self._pending_elems: dict = {}
        self._in_flight: list = []  # _InFlight, oldest first
        self._spare: list = []  # send and scratch buffers of completed buckets, for the next ones
        self.reduce_calls = 0  # collectives issued, for tests and benchmarks
        self.async_calls = 0  # of which asynchronous (overlap_comm)

    @classmethod
    def from_config(
        cls, config: Any, accumulate: Callable, settle: Optional[Callable] = None, replica_group: Any = None
    ) -> GradientReducer:
        """A reducer set up from a `DeepSpeedConfig`: bucket size, dtype, overlap and scaling."""
        zero = config.zero_config
        return cls(
            zero.reduce_bucket_size,
            accumulate,
            config.communication_data_type,
            settle=settle,
            overlap_comm=bool(zero.overlap_comm),
            prescale_gradients=config.prescale_gradients,
            predivide_factor=config.gradient_predivide_factor,
            sum_over_ranks=config.gradient_allreduce_op == "sum",
            replica_group=replica_group,
            quantized=bool(zero.zero_quantized_gradients),
        )

    def scales(self, world: int) -> tuple:
        """(before, after) the sum; see [Note: gradient scaling around the reduction]."""
        if self.prescale_gradients or self.predivide_factor == 1.0:
            before, after = 1.0 / world, 1.0
        else:
            before, after = 1.0 / self.predivide_factor, self.predivide_factor / world
        if self.sum_over_ranks:
            after *= world  # divided first all the same: the fp16 headroom does not depend on the op
        return before, after

    def dtype_for(self, state: Any, grad: torch.Tensor) -> torch.dtype:
        """The dtype `state`'s gradient is reduced in."""
        return self.comm_dtypes.get(state.ds_id) or self.comm_dtype or grad.dtype

    def add(self, state: ZeroParamState, grad: torch.Tensor) -> None:
        dtype = self.dtype_for(state, grad)
        key = (id(state.group), dtype)
        self._pending.setdefault(key, []).append((state, grad))
        self._pending_elems[key] = self._pending_elems.get(key, 0) + state.world_size * state.partition_size
        if self._pending_elems[key] >= self.bucket_elems:
            self._reduce(key)

    def flush(self) -> None:
        """Reduce what is left and wait for every bucket in flight (the end of backward)."""
        for key in list(self._pending):
            self._reduce(key)
        self.wait_all()

    def discard_pending(self) -> None:
        """Drop the gradients added but not yet sent (a `zero_grad` after a backward outside
        engine.backward, which does not flush); what was sent is waited on, as `wait_all`."""
        self._pending.clear()
        self._pending_elems.clear()
        self.wait_all()

    def wait_all(self) -> None:
        while self._in_flight:
            self._complete(self._in_flight.pop(0))
        self._spare.clear()  # between backwards, no buffer outlives its bucket
        if self.settle is not None:
            self.settle()

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D buffer of at least `numel` elements: an earlier bucket's of this backward if big enough.

        On the CPU every fresh multi-MB buffer costs page faults on first touch (a third of a
        pack's time, measured); reusing the buffers of completed buckets avoids them without
        holding more than the buckets in flight already hold.
        """
        for i, spare in enumerate(self._spare):
            if spare.dtype == dtype and spare.device == device and spare.numel() >= numel:
                return self._spare.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def _reduce(self, key: tuple) -> None:
        items = self._pending.pop(key)
        self._pending_elems.pop(key)
        dtype = key[1]
        states = [state for state, _ in items]
        world, total = states[0].world_size, sum(s.partition_size for s in states)
        # Each gradient's rank-major column block (a padded gradient is padded with zeros
        # first: its last rank's slice runs past its end).
        blocks = []
        for state, grad in items:
            flat = grad.reshape(-1).to(dtype)
            if state.padding:
                flat = F.pad(flat, (0, state.padding))
            blocks.append(flat.view(world, state.partition_size))
        del items, grad, flat
        before, _ = self.scales(world)
        group = states[0].group
        if self.quantized:  # qgZ: quantized into its payload at issue, so `send` is free at once
            send_base = self._buffer(world * total, dtype, blocks[0].device)
            send = send_base[: world * total].view(world, total)
            torch.cat(blocks, dim=1, out=send)
            del blocks
            if before != 1.0:
                send.mul_(before)
            self._make_room()
            self._advance()
            handle, received = quantized.issue_reduce_scatter(send, group, self.two_hop, self.overlap_comm)
            self._spare.append(send_base)  # quantized already: the next bucket may pack into it
            self.reduce_calls += 1
            self._track(_InFlight(handle, (), received, states, world))
            return
        if dist.completes_on_issue(group, blocks[0]):
            # Shared memory: the reduction is over when the call returns, so there is nothing
            # to overlap, and the blocks go straight into this rank's slot: no send buffer
            # (whose fresh pages cost as much as the copy on the CPU).
            received = torch.empty(total, dtype=dtype, device=blocks[0].device)
            dist.reduce_scatter_columns(received, blocks, group=group, prescale=before)
            del blocks
            self.reduce_calls += 1
            self._complete(_InFlight(dist.CommHandle(), (), received, states, world))
            return
        send_base = self._buffer(world * total, dtype, blocks[0].device)
        send = send_base[: world * total].view(world, total)
        torch.cat(blocks, dim=1, out=send)  # one fused copy packs every block
        del blocks  # the full gradients are packed: free them before the collective
        if before != 1.0:
            send.mul_(before)
        received = torch.empty(total, dtype=dtype, device=send.device)
        self._make_room()
        # gloo receives every rank's slices before summing them ([Note: reduce-scatter on gloo]);
        # nccl reduces in place and needs no scratch.
        on_gloo = dist.get_backend(group) == "gloo"
        scratch = self._buffer(world * total, dtype, send.device) if on_gloo else None
        handle = dist.reduce_scatter_tensor(
            received,
            send.view(-1),
            group=group,
            async_op=self.overlap_comm,
            input_reusable=True,
            scratch=scratch,
        )
        self.reduce_calls += 1
        self._track(
            _InFlight(handle, (send_base, scratch) if on_gloo else (send_base,), received, states, world)
        )

    def _make_room(self) -> None:
        """With overlap_comm, complete the oldest buckets until another may be issued."""
        if self.overlap_comm:
            while len(self._in_flight) >= MAX_IN_FLIGHT:
                self._complete(self._in_flight.pop(0))

    def _advance(self) -> None:
        """Let buckets in flight take their next step without blocking (qgZ's second hop, once
        the first is over), oldest first, stopping at the first that cannot."""
        for work in self._in_flight:
            advance = getattr(work.handle, "advance", None)
            if advance is None or not advance():
                return

    def _track(self, work: _InFlight) -> None:
        """An issued bucket: in flight with overlap_comm (backward goes on), else completed now."""
        if self.overlap_comm:
            self.async_calls += 1
            self._in_flight.append(work)
        else:
            self._complete(work)

    def _complete(self, work: _InFlight) -> None:
        work.handle.wait()
        self._spare.extend(work.buffers)
        _, after = self.scales(work.world)
        if self.replicas > 1:
            if not self.sum_over_ranks:
                work.received.mul_(1.0 / self.replicas)
            dist.all_reduce(work.received, group=self.replica_group)
        # Each state gets its own disjoint view of `received`, which the accumulator may keep.
        pieces = torch.split(work.received, [s.partition_size for s in work.states])
        for state, piece in zip(work.states, pieces):
            self.accumulate(state, piece, after)
