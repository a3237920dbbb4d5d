"""ZeRO++ qwZ and qgZ: block-wise int8 parameter all-gathers and gradient reduce-scatters.

[Note: block-wise int8]
A tensor is flattened, zero-padded to a multiple of `BLOCK` (256) elements and cut into
blocks of `BLOCK`. Each block `b` gets one fp32 scale `s_b = max|b| / 127` (symmetric, no
zero point) and each element becomes `q = round(x / s_b)`, an int8 in [-127, 127]; an
all-zero block has scale 0 and codes 0. Dequantized, `x' = q * s_b` in fp32, so every
element obeys `|x - x'| <= s_b / 2` (round to nearest), i.e. at most `max|block| / 254`, up
to fp32 rounding of the division and the product (a relative 1e-4 of the bound covers it,
as `|x| <= 127 s_b`). Cast to bf16/fp16 afterwards, the
parameter's own rounding is added. The payload is 1 byte per element plus 4 bytes per
block: `padded + 4 * ceil(n / 256)` bytes for `n` elements (qwZ: per parameter shard), about 0.26x of fp32 and 0.51x
of bf16.

qwZ (`zero_optimization.zero_quantized_weights`, stage 3): every gather for compute from the
primary shards (the hooks' `gather.fetch_states(..., quantized=True)`: forward, backward,
prefetch) quantizes this rank's flat shard input, all-gathers one int8 payload (codes then
scales, the scales' bytes viewed as int8) and dequantizes every rank's part, its own
included, so all ranks install the same working copy. The shards and the optimizer's fp32
masters are never quantized: only the gathered copy carries the error, and it reaches
training only through the gradients computed on it. Each parameter's shard is quantized on
its own (blocks never span two parameters), so a parameter's gathered value does not depend
on which others share its collective, and a resumed run equals an uninterrupted one bit for
bit. Exact, not quantized: `GatheredParameters` (with or without `modifier_rank`; a
modifier's write-back from a quantized copy would quantize the shard and the master for
good), `param.all_gather()`, persistent parameters (small by definition) and the refresh
after a step or a load of whatever stays gathered; hpZ's secondary gathers copy the values
the primary gather gave within a node (quantized ones serve only quantized gathers).

qgZ (`zero_optimization.zero_quantized_gradients`, stage 3): a gradient bucket's rank-major
send buffer `[world, total]` (prescaled as usual) has each row, the slice bound for one rank,
quantized block-wise; one `all_to_all_single` delivers to each rank every other rank's
quantized slice of its shard, which it dequantizes and sums in fp32. Bound: the received sum
differs from the exact sum by at most `sum_r s_{r,b} / 2` per element, `s_{r,b}` the scale of
rank r's block. Under `overlap_comm` a bucket's (first) all-to-all is issued asynchronously
and backward goes on; it joins grad_reducer's queue of buckets in flight ([Note:
overlap_comm] there) and is finished, in issue order on every rank, when waited on.

The quantizing itself (`deepspeed.ops.quantizer.int8`) runs a native kernel on CPU tensors:
one pass quantizes a shard or a send row straight into its payload slice, one dequantizes
into the gather's destination, one dequantizes and sums the received rows; it equals the
torch path (which runs on other devices and where the op cannot be built) bit for bit.

Two hops (`TwoHopReduce`), when the parameters' group is the whole world and the node layout
(`groups.node_layout()`) has `n > 1` nodes of `p > 1` ranks each: first within the node, each
rank sends its local peer `j` the `n` slices bound for the ranks at position `j` of every
node (quantized); peer `j` dequantizes and sums the `p` it receives into `n` partial sums,
re-quantizes them and sends partial sum `i`, in an all-to-all among the `n` ranks at position
`j`, to node `i`'s rank. Only the second hop crosses nodes: `(n - 1)` payloads per rank
instead of `(n - 1) * p`. The second hop needs the first's output: it is issued when the
reducer finds the first over (`_TwoHopWork.advance`, at its next bucket), or when the bucket
is waited on. Bound: the first hop's `sum_r s_r / 2` plus the second hop's
`sum_i s'_i / 2`, `s'_i` the scale of node i's partial-sum block.

`zero_quantized_nontrainable_weights` ([Note: frozen weights stored quantized]): parameters
with `requires_grad=False` when the engine is built keep their shard only as int8 codes and
fp32 scales (`QuantizedShard`, the packed payload a qwZ gather sends, made once): the
full-precision shard is freed, about 0.254x the bytes of an fp32 shard (1 byte per element
plus 4 per 256) and 0.508x of a bf16 one. Their compute gathers send that payload as it is
(even when `zero_quantized_weights` is off); every reader of the shard (`state.shard`, thus
GatheredParameters, `ds_tensor`, checkpoints, zero_to_fp32, `save_16bit_model`) sees the
dequantized values, off from the values the model was built with by at most
`max|block| / 254` per element, once (gathers add no error of their own). Writers re-quantize:
an edit written back by `GatheredParameters(modifier_rank=...)` and a checkpoint load go
through `state.assign_shard` / `write_back`. A checkpoint therefore holds the dequantized
values, what the model computed with; loading it re-quantizes them to the same codes. Not
stored quantized: persistent parameters (small, kept gathered in full) and a frozen parameter
gathered at the time the engine is built. A parameter unfrozen after `deepspeed.initialize`
keeps the quantized values (and, as any, has no fp32 master: the optimizer never saw it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed import comm as dist
from deepspeed.ops.quantizer import int8

# The block layout and the torch reference, re-exported: qwZ/qgZ callers and tests name them here.
from deepspeed.ops.quantizer.int8 import (  # noqa: F401
    BLOCK,
    QMAX,
    blocks_of,
    dequantize_rows,
    payload_bytes,
    quantize_rows,
)
from deepspeed.runtime.zero import gather
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from deepspeed.utils import groups


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple:
    """A tensor of any shape -> `(codes int8 [nb * block], scales fp32 [nb])`."""
    codes, scales = quantize_rows(x.reshape(1, -1), block)
    return codes.view(-1), scales.view(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    return dequantize_rows(codes.view(1, -1), scales.view(1, -1), numel).view(-1)


class QuantizedGatherBucket(gather.GatherBucketBase):
    """qwZ: one int8 all-gather for parameters of one (group, dtype), the drop-in for
    gather's `_GatherBucket` (`fetch_states` builds it when the states carry `qwz`)."""

    def __init__(self, states: list, layout: tuple = (-1, None)) -> None:
        super().__init__(states)
        self._end = layout[0]

    def _payload(self, device: torch.device) -> torch.Tensor:
        states = self.states
        if all(s.stored is None for s in states):
            return _quantize_shards(states, gather._flat_input(states, device, self._end))
        pieces = [  # frozen weights stored quantized send their codes as they are
            s.stored.payload.to(device) if s.stored is not None else _quantize_shards([s], s.shard.to(device))
            for s in states
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def issue(self, device: torch.device, inflight: bool = True) -> None:
        states = self.states
        self._dtype = states[0].shard_dtype
        payload = self._payload(device)
        world = states[0].world_size
        self._out = torch.empty(world * payload.numel(), dtype=torch.int8, device=device)
        self._issued(
            dist.all_gather_into_tensor(self._out, payload, group=states[0].group, async_op=True), inflight
        )

    def _fill(self) -> list:
        states, world = self.states, self.states[0].world_size
        buffers = [gather.FULLS.take(run, self._dtype, self._out.device) for run in gather._runs(states)]
        _dequantize_into(self._out, states, world, [d for fb in buffers for d in fb.dests])
        self._out = None
        return buffers


def _quantize_shards(states: list, flat_in: torch.Tensor) -> torch.Tensor:
    """This rank's shards of `states` (back to back in `flat_in`) -> one int8 payload, each shard
    quantized on its own, straight into its slice."""
    widths = [payload_bytes(s.partition_size) for s in states]
    payload = torch.empty(sum(widths), dtype=torch.int8, device=flat_in.device)
    pieces = flat_in.split([s.partition_size for s in states])
    for piece, dest in zip(pieces, payload.split(widths)):
        int8.pack_rows(piece.view(1, -1), out=dest.view(1, -1))
    return payload


def _dequantize_into(out: torch.Tensor, states: list, world: int, dests: list) -> None:
    """Fill each state's `[world, partition_size]` dest from the gathered payload `out`."""
    rows = out.view(world, -1)
    offset = 0
    for s, dest in zip(states, dests):
        width = payload_bytes(s.partition_size)
        int8.unpack_rows(rows[:, offset : offset + width], s.partition_size, out=dest)
        offset += width


def attach(states: list, config: Any) -> None:
    """Turn qwZ on for the states the config asks for (all, or the frozen ones), and store the
    frozen ones' shards quantized when `zero_quantized_nontrainable_weights` asks for it."""
    zero = config.zero_config
    old_bases = {}
    for s in states:
        if s.persist:
            continue  # small, gathered once and kept: exact (see the note)
        frozen = not s.param.requires_grad
        if zero.zero_quantized_weights or (zero.zero_quantized_nontrainable_weights and frozen):
            s.qwz = QuantizedGatherBucket
            s.qwz_frozen = frozen and zero.zero_quantized_nontrainable_weights
        # A partition that swaps to NVMe is already out of host memory: it swaps at its own
        # precision (quantized only for the gather) rather than being stored as int8 codes.
        swaps = getattr(s, "swapper", None) is not None
        if s.qwz_frozen and s.status is ZeroParamStatus.NOT_AVAILABLE and s.stored is None and not swaps:
            old_bases[id(s.shard_base)] = s.shard_base
            s.store_compressed(QuantizedShard(s.shard))
    _move_siblings(states, list(old_bases.values()))


def _move_siblings(states: list, bases: list) -> None:
    """Shards that shared a flat buffer with a now quantized one (a module's parameters lie back
    to back in one, partition_parameters.py) move to a buffer of their own, so the old buffer,
    full-precision copy of the frozen ones included, is freed. Runs before the optimizer makes
    its masters (an fp32 master may share its shard's memory)."""
    for base in bases:
        rest = [s for s in states if s.stored is None and s.shard_base is base]
        if not rest:
            continue
        flat = torch.zeros(sum(s.partition_size for s in rest), dtype=base.dtype, device=base.device)
        if base.is_pinned():
            flat = flat.pin_memory()
        for s, view in zip(rest, flat.split([s.partition_size for s in rest])):
            s.move_shard(view)


class QuantizedShard:
    """[Note: frozen weights stored quantized] One rank's shard kept as the packed int8 payload
    (codes, then fp32 scales as bytes) of `_pack`: what `state.shard` dequantizes and what a
    qwZ gather sends. `dtype`: the shard's dtype, what it dequantizes to."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.dtype = shard.dtype
        self.numel = shard.numel()
        self.store(shard)

    def store(self, values: torch.Tensor) -> None:
        """Quantize `values` (`[numel]`) into the payload."""
        self.payload = int8.pack_rows(values.reshape(1, -1)).view(-1)

    def dequantized(self) -> torch.Tensor:
        return int8.unpack_rows(self.payload.view(1, -1), self.numel).reshape(-1).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def partition_bytes(states: list) -> int:
    """Bytes this rank keeps for the shards of `states` (a storage shared by several, once)."""
    storages = {}
    for s in states:
        tensor = s.stored.payload if s.stored is not None else s.shard_base
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def check_config(config: Any) -> None:
    """Refuse the quantized keys where they are not built (stages 0-2), naming the key."""
    zero = config.zero_config
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if getattr(zero, key) and zero.stage != 3:
            raise ValueError(
                f"zero_optimization.{key}=True needs ZeRO stage 3 here (stage is {zero.stage}); "
                "set stage to 3 or the key to false"
            )


def reduce_scatter(send: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """qgZ: `send` `[world, total]` (row r: the slice for rank r) -> this rank's summed slice
    `[total]` in `send`'s dtype, through int8 all-to-all (see the note)."""
    handle, received = issue_reduce_scatter(send, group)
    handle.wait()
    return received


def issue_reduce_scatter(
    send: torch.Tensor, group: Any, two_hop: Optional[TwoHopReduce] = None, async_op: bool = False
) -> tuple:
    """Start qgZ's reduction of `send` (one hop over `group`, or `two_hop`'s two): returns
    `(handle, received)`; `received` (`[total]`, `send`'s dtype) holds this rank's summed slice
    once `handle.wait()` returned. `send` is quantized before this returns (free to reuse)."""
    if two_hop is not None:
        return two_hop.issue(send, async_op)
    total = send.shape[1]
    payload = int8.pack_rows(send)
    got = torch.empty_like(payload)
    received = torch.empty(total, dtype=send.dtype, device=send.device)
    handle = dist.all_to_all_single(got.view(-1), payload.view(-1), group=group, async_op=async_op)

    def finish(payload=payload) -> None:  # `payload` kept alive until the exchange is over
        int8.unpack_sum(got, total, out=received)

    handle.after_wait(finish)
    return handle, received


class TwoHopReduce:
    """qgZ's reduce-scatter in two hops, within the node then across (see the note)."""

    def __init__(self, nodes: int, per_node: int, within: Any, across: Any) -> None:
        self.nodes, self.per_node = nodes, per_node
        self.within = within  # this rank's node, group rank = position on the node
        self.across = across  # the ranks at this rank's position, group rank = node index

    def reduce_scatter(self, send: torch.Tensor) -> torch.Tensor:
        handle, received = self.issue(send)
        handle.wait()
        return received

    def issue(self, send: torch.Tensor, async_op: bool = False) -> tuple:
        """`(work, received)`: the first hop issued now (asynchronously with `async_op`); the
        second when the first is over, see `_TwoHopWork`."""
        n, p = self.nodes, self.per_node
        # Rows quantize independently: quantizing in rank order and reordering the int8 rows by
        # position is the same payload as reordering the floats first, at a quarter the bytes.
        payload = int8.pack_rows(send).view(n, p, -1).transpose(0, 1).reshape(p * n, -1)
        got = torch.empty_like(payload)
        first = dist.all_to_all_single(got.view(-1), payload.view(-1), group=self.within, async_op=async_op)
        work = _TwoHopWork(self, first, (payload, got), send)
        if not async_op:
            work.wait()
        return work, work.received


class _TwoHopWork:
    """One bucket's two-hop reduction in flight. `advance()` issues the second hop, without
    blocking, once the first is over; `wait()` finishes both. The reducer advances its buckets
    in issue order, so every rank issues the second hops in the same order."""

    def __init__(self, plan: TwoHopReduce, first: Any, buffers: tuple, send: torch.Tensor) -> None:
        self.plan, self.first, self.buffers = plan, first, buffers  # payload kept until sent
        self.total = send.shape[1]
        self.received = torch.empty(self.total, dtype=send.dtype, device=send.device)
        self.second: Any = None

    def advance(self, block: bool = False) -> bool:
        """Issue the second hop if the first is over (waiting for it with `block`); whether issued."""
        if self.second is not None:
            return True
        if not block and not self.first.is_completed():
            return False
        self.first.wait()
        n, p, total = self.plan.nodes, self.plan.per_node, self.total
        by_node = self.buffers[1].view(p, n, -1)
        partial = torch.empty(n, total, dtype=torch.float32, device=by_node.device)
        for i in range(n):  # node i's partial sum for (i, my position)
            int8.unpack_sum(by_node[:, i], total, out=partial[i])
        sums = int8.pack_rows(partial)
        got = torch.empty_like(sums)
        self.buffers = (sums, got)
        self.second = dist.all_to_all_single(
            got.view(-1), sums.view(-1), group=self.plan.across, async_op=True
        )
        return True

    def wait(self) -> None:
        self.advance(block=True)
        if self.buffers:
            self.second.wait()
            int8.unpack_sum(self.buffers[1], self.total, out=self.received)
            self.buffers = ()


def two_hop_reduce(config: Any, group: Any) -> Optional[TwoHopReduce]:
    """qgZ's two-hop plan for the parameters' `group` where it spans the world over `n > 1`
    nodes of `p > 1` ranks each, else None (one hop). Every rank makes the same groups."""
    world = dist.get_world_size()
    if not config.zero_config.zero_quantized_gradients or dist.get_world_size(group) != world:
        return None
    nodes = groups.node_layout()
    count = max(nodes) + 1
    p = world // count
    if count < 2 or p < 2 or nodes != tuple(r // p for r in range(world)):
        return None
    rank, within, across = dist.get_rank(), None, None
    for i in range(count):
        ranks = list(range(i * p, (i + 1) * p))
        made = dist.new_group(ranks)
        within = made if rank in ranks else within
    for j in range(p):
        ranks = [i * p + j for i in range(count)]
        made = dist.new_group(ranks)
        across = made if rank in ranks else across
    return TwoHopReduce(count, p, within, across)
