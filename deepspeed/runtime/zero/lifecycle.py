"""The ZeRO-3 parameter state machine: the status, the per-parameter state, every transition.

NOT_AVAILABLE -> INFLIGHT (skipped by a gather waited on at once) -> AVAILABLE -> NOT_AVAILABLE,
only through the transitions at the end of this file; gather.py and parameter.py call them.

[Note: shard math]
For a partition group of size `ws`, a parameter of `numel` elements is padded to a multiple
of `ws`: `padding = (ws - numel % ws) % ws`, `partition_size = (numel + padding) // ws`.
Rank `r` owns flat elements `[r * partition_size, (r + 1) * partition_size)`; elements at
or beyond `numel` are padding (zeros, never read back into the parameter).

[Note: the class follows the status]
A ZeRO parameter has one class while AVAILABLE and another otherwise (parameter.py says why);
the transitions switch it with the status. Each state is handed both classes when made.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Optional

import torch
from torch import nn

from deepspeed import process_state


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # the full tensor is in param.data
    NOT_AVAILABLE = 2  # param.data is empty; only this rank's shard exists
    INFLIGHT = 3  # an all-gather into param.data was issued and not yet waited on


class ZeroParamType(enum.Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3  # the shard lives off the compute device (remote_device "cpu" or "nvme")


def shard_sizes(numel: int, world_size: int) -> tuple:
    """`(partition_size, padding)` for `numel` elements over `world_size` ranks (see the note)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    padding = (world_size - numel % world_size) % world_size
    return (numel + padding) // world_size, padding


# Hands out `ds_id`s, equal on all ranks because construction order is; unique for the life of
# the process (optimizer state and checkpoints key by them), so never reset.
PARAM_IDS = process_state.register("deepspeed.runtime.zero.lifecycle.PARAM_IDS", itertools.count())


def empty_placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """A shape-[0] tensor with `tensor`'s dtype and device: a partitioned `param.data`, as upstream leaves it."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device)


class ZeroParamState:
    """Everything ZeRO knows about one parameter. Its status changes only through the transitions below."""

    param: nn.Parameter
    ds_id: int
    shape: torch.Size
    numel: int
    group: Any  # the partition process group (None: the world)
    world_size: int
    rank: int  # this process's rank within `group`
    partition_size: int  # elements per rank, padding included
    padding: int  # elements added to reach a multiple of world_size
    _shard: Optional[torch.Tensor]  # what `shard` returns; None while the shard is `stored` compressed
    stored: Any  # a shard kept compressed (quantized.QuantizedShard; see `store_compressed`), or None
    shard_base: torch.Tensor  # 1D contiguous tensor `shard` is a view of (`shard` itself if none)
    shard_offset: int  # where `shard` starts in `shard_base`, in elements (see gather.py's coalescing note)
    placeholder: torch.Tensor  # what param.data holds while partitioned (`empty_placeholder`)
    status: ZeroParamStatus
    holds: dict  # owner -> holds it took on the gathered tensor (see gather.py's refcount note)
    persist: bool  # small parameters that stay gathered (stage3_param_persistence_threshold)
    active_sub_modules: set  # ids of submodules currently running with this parameter
    pending: Optional[Any]  # the gather bucket that will materialize an INFLIGHT parameter
    full_buffer: Optional[Any]  # while AVAILABLE from a gather: the buffer its data is a view of (gather.py)
    param_type: ZeroParamType
    sanity_checks: bool  # detect edits discarded by a modifier_rank=None gather
    shard_version: int  # counts write-backs of edits, so the optimizer can refresh its master
    external_owners: list  # modules this parameter is registered with as external
    partitioned_class: type  # param's class unless AVAILABLE (see the note)
    gathered_class: type  # param's class while AVAILABLE
    hpz: Any  # hpZ's HpzLayout (utils/groups.py) when the engine turned hpZ on, else None
    secondary: Optional[torch.Tensor]  # hpZ: this rank's slice of the secondary partition, or None
    qwz: Any  # qwZ: the quantized gather's bucket class (quantized.py) when it is on, else None
    qwz_frozen: bool  # zero_quantized_nontrainable_weights: its shard is `stored` as int8 codes
    swapper: Any = None  # NVMe: the ParamSwapper its partition swaps through (param_swap.py)

    def __init__(
        self,
        param: nn.Parameter,
        group: Any,
        world_size: int,
        rank: int,
        classes: tuple,  # (partitioned_class, gathered_class)
        remote_device=None,
        shard_out: Optional[torch.Tensor] = None,
    ) -> None:
        self.param = param
        self.ds_id = next(PARAM_IDS)
        self.shape = param.shape
        self.numel = param.numel()
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.partition_size, self.padding = shard_sizes(self.numel, world_size)
        self.stored = None
        self._set_shard(self._make_shard(param.data, remote_device, shard_out))
        self.placeholder = empty_placeholder(param.data)
        self.status = ZeroParamStatus.AVAILABLE
        self.holds = {}
        self.persist = False
        self.active_sub_modules = set()
        self.pending = None
        self.full_buffer = None
        self.param_type = ZeroParamType.REMOTE if remote_device is not None else ZeroParamType.PARTITIONED
        self.sanity_checks = False
        self.external_owners = []
        self.shard_version = 0  # bumped by every write-back of an edit into the shard
        self.partitioned_class, self.gathered_class = classes
        self.hpz = None
        self.secondary = None
        self.qwz = None
        self.qwz_frozen = False

    @classmethod
    def copy_for(cls, source: ZeroParamState, param: nn.Parameter) -> ZeroParamState:
        """State for a deep copy of `source`'s parameter: a new ds_id, a cloned shard, partitioned.
        Deep copies happen in the same order on every rank (`nn.TransformerEncoder` cloning its
        layer under Init), so the new ds_ids agree across ranks."""
        state = type(source).__new__(type(source))  # a swapped state's copy swaps too
        state.__dict__.update(source.__dict__)
        state.param = param
        state.ds_id = next(PARAM_IDS)
        state.stored = None
        state._set_shard(source.shard.clone())
        state.placeholder = empty_placeholder(source.placeholder)
        state.status = ZeroParamStatus.NOT_AVAILABLE
        state.holds = {}
        state.active_sub_modules = set()
        state.pending = None
        state.full_buffer = None
        state.external_owners = []
        state.secondary = None
        return state

    def _make_shard(
        self, full: torch.Tensor, remote_device, shard_out: Optional[torch.Tensor]
    ) -> torch.Tensor:
        if shard_out is None:
            device = torch.device(remote_device) if remote_device is not None else full.device
            shard = torch.zeros(self.partition_size, dtype=full.dtype, device=device)
        else:
            shard = shard_out  # a zeroed view into a flat buffer shared with sibling parameters
        self._copy_own_slice(full, shard)
        return shard

    @property
    def shard(self) -> torch.Tensor:
        """This rank's slice, 1D `[partition_size]` (padding zero-filled). A shard `stored`
        compressed reads as a fresh dequantized copy: writing into it changes nothing, so every
        writer goes through `assign_shard` (or `write_back`)."""
        stored = self.stored
        return self._shard if stored is None else stored.dequantized()

    @property
    def shard_dtype(self) -> torch.dtype:
        """`shard.dtype` without dequantizing a stored shard."""
        stored = self.stored
        return self._shard.dtype if stored is None else stored.dtype

    def assign_shard(self, values: torch.Tensor) -> None:
        """Set the whole shard (`[partition_size]`) in place, re-compressing a stored one."""
        if self.stored is None:
            self.shard.copy_(values)  # through the property: a swapped shard reads itself in
        else:
            self.stored.store(values)

    def store_compressed(self, stored: Any) -> None:
        """Keep the shard only as `stored`, which has `dequantized()`, `store(values)`, `dtype`
        and `payload` (its one tensor, also `shard_base`); the full-precision shard is dropped."""
        self._require(ZeroParamStatus.NOT_AVAILABLE, "store_compressed")
        self.stored = stored
        self._shard = None
        self.shard_base, self.shard_offset = stored.payload, 0

    def move_shard(self, out: torch.Tensor) -> None:
        """Move the shard into `out` (a `[partition_size]` tensor of its dtype), so its old
        buffer can be freed."""
        out.copy_(self.shard)
        self._set_shard(out)

    def _set_shard(self, shard: torch.Tensor) -> None:
        """Make `shard` the shard, recording which flat tensor it is a view of, and where."""
        base = shard._base
        if base is None or base.dim() != 1 or not base.is_contiguous() or not shard.is_contiguous():
            base = shard
        self.stored = None
        self._shard = shard
        self.shard_base = base
        self.shard_offset = shard.storage_offset() - base.storage_offset()

    def own_slice_bounds(self) -> tuple:
        """`[start, end)` of this rank's real (non-padding) elements in the flat tensor."""
        start = self.rank * self.partition_size
        return min(start, self.numel), min(start + self.partition_size, self.numel)

    def _copy_own_slice(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        start, end = self.own_slice_bounds()
        if end > start:
            shard[: end - start].copy_(full.reshape(-1)[start:end])

    def write_back(self) -> None:
        """Copy this rank's slice of the gathered tensor into the shard (has_been_updated=True)."""
        self._require(ZeroParamStatus.AVAILABLE, "write_back")
        shard = self.shard  # a dequantized copy when stored compressed: stored again below
        self._copy_own_slice(self.param.data, shard)
        if self.stored is not None:
            self.stored.store(shard)
        self.shard_version += 1  # tells the optimizer its fp32 master is stale
        all_drop_secondary([self])  # hpZ: the secondary slice would be stale

    def retype_shard(self, out: torch.Tensor) -> None:
        """Move the shard into `out` (a zeroed `[partition_size]` tensor of another dtype)."""
        self._require(ZeroParamStatus.NOT_AVAILABLE, "retype_shard")
        assert not self.holds, (
            f"[rank {self.rank}] ds_id={self.ds_id} re-typed while held by {list(self.holds)}"
        )
        if self.stored is None:
            out.copy_(self.shard)
            self._set_shard(out)
        else:
            self.stored.dtype = out.dtype  # the codes stay; they dequantize to the new dtype
        self.placeholder = torch.empty(0, dtype=out.dtype, device=self.placeholder.device)
        with torch._C.DisableTorchFunctionSubclass():  # internal: skip ZeroParameter's dispatch
            self.param.data = self.placeholder
        self.shard_version += 1  # an fp32 master made before this must be rebuilt
        all_drop_secondary([self])

    def _require(self, expected: ZeroParamStatus, action: str) -> None:
        assert self.status is expected, (
            f"[rank {self.rank}] ds_id={self.ds_id}: {action} needs status {expected.name}, found {self.status.name}"
        )

    @property
    def holders(self) -> int:
        """How many holds are live, over all owners."""
        return sum(self.holds.values())

    def hold(self, owner: object) -> None:
        self.holds[owner] = self.holds.get(owner, 0) + 1

    def unhold(self, owner: object) -> bool:
        """Drop one of `owner`'s holds; True when nobody holds the tensor any more."""
        count = self.holds.get(owner, 0)
        assert count > 0, f"[rank {self.rank}] ds_id={self.ds_id} released by {owner!r}, which holds none"
        if count == 1:
            del self.holds[owner]
        else:
            self.holds[owner] = count - 1
        return not self.holds


# ------------------------------------------------- the transitions [Note: bulk transitions]
# A gather moves a whole bucket of parameters at once, so on the hot path (every submodule's
# forward and backward, every GatheredParameters) each transition makes one pass over a list,
# not one method call per parameter. Each checks every state before it changes any.


def hold_all(states: list, owner: object) -> tuple:
    """One hold for `owner` on each state; returns `(not_available, pending_buckets)` among them."""
    missing, pending = [], {}
    for s in states:
        holds = s.holds
        holds[owner] = holds.get(owner, 0) + 1
        status = s.status
        if status is ZeroParamStatus.NOT_AVAILABLE:
            missing.append(s)
        elif status is ZeroParamStatus.INFLIGHT:
            pending[id(s.pending)] = s.pending
    return missing, list(pending.values())


def unhold_all(states: list, owner: object) -> list:
    """Drop one of `owner`'s holds on each state; returns those nobody holds any more, persistent ones aside."""
    unheld = []
    for s in states:
        holds = s.holds
        count = holds.get(owner, 0)
        if count == 1:
            del holds[owner]
            if not holds and not s.persist:
                unheld.append(s)
        else:
            assert count > 0, f"[rank {s.rank}] ds_id={s.ds_id} released by {owner!r}, which holds none"
            holds[owner] = count - 1
    return unheld


def all_to_inflight(states: list, bucket: Any) -> None:
    """NOT_AVAILABLE -> INFLIGHT: `bucket` (its `wait()`) will install the gathered tensors."""
    for s in states:
        if s.status is not ZeroParamStatus.NOT_AVAILABLE:
            s._require(ZeroParamStatus.NOT_AVAILABLE, "to_inflight")
    for s in states:
        s.pending = bucket
        s.status = ZeroParamStatus.INFLIGHT


def all_to_available(
    states: list, fulls: list, buffers: list, expected: ZeroParamStatus = ZeroParamStatus.INFLIGHT
) -> None:
    """`expected` -> AVAILABLE: install each gathered tensor (shape `state.shape`) as its parameter's data.
    `buffers[i]` is what `fulls[i]`'s memory belongs to, kept in `full_buffer` (see gather.py).
    `expected` is NOT_AVAILABLE for a gather its caller waited on at once (never INFLIGHT)."""
    available = ZeroParamStatus.AVAILABLE
    for s in states:
        if s.status is not expected:
            s._require(expected, "to_available")
    with torch._C.DisableTorchFunctionSubclass():  # internal: skip ZeroParameter's dispatch
        for s, full, buffer in zip(states, fulls, buffers):
            s.param.data = full
            s.param.__class__ = s.gathered_class  # [Note: the class follows the status]
            s.full_buffer = buffer
            s.pending = None
            s.status = available


def all_to_released(states: list) -> list:
    """AVAILABLE and unheld -> NOT_AVAILABLE: free the gathered tensors. Returns their `full_buffer`s, now cleared."""
    available, released = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE
    buffers = []
    for s in states:
        if s.status is not available or s.holds:
            s._require(available, "to_released")
            assert not s.holds, f"[rank {s.rank}] ds_id={s.ds_id} released while held by {list(s.holds)}"
        buffers.append(s.full_buffer)
    with torch._C.DisableTorchFunctionSubclass():  # internal: skip ZeroParameter's dispatch
        for s in states:
            s.param.data = s.placeholder
            s.param.__class__ = s.partitioned_class
            s.full_buffer = None
            s.status = released
    return buffers


def secondary_size(state: ZeroParamState) -> int:
    """hpZ: elements of each rank's secondary slice, `ceil(numel / hpz.size)` (padding included)."""
    return shard_sizes(state.numel, state.hpz.size)[0]


def all_keep_secondary(states: list) -> None:
    """hpZ, AVAILABLE after a gather from the primary shards: keep this rank's slice of each
    gathered tensor, cut over its secondary group ([Note: hpZ, the secondary shard] in hpz.py).

    The slices of one bucket (one dtype) are views of one buffer, back to back in the order
    of `states`, so their next gather sends them as one view (gather.py's
    `_secondaries_input`). The buffer lives while any of them does: a slice dropped alone (an
    edit written back) frees its memory with the last of its siblings."""
    for s in states:
        s._require(ZeroParamStatus.AVAILABLE, "keep_secondary")
    data = states[0].param.data
    if any([s.param.data.dtype != data.dtype for s in states]):  # not from one gather bucket
        for dtype in {s.param.data.dtype for s in states}:
            all_keep_secondary([s for s in states if s.param.data.dtype == dtype])
        return
    sizes = [secondary_size(s) for s in states]
    flat = torch.empty(sum(sizes), dtype=data.dtype, device=data.device)
    for s, size, piece in zip(states, sizes, flat.split(sizes)):
        start = s.hpz.rank * size
        full = s.param.data.reshape(-1)
        real = max(0, min(size, s.numel - start))  # the rest is padding past the tensor's end
        if real:
            piece[:real].copy_(full[start : start + real])
        if real < size:
            piece[real:].zero_()
        s.secondary = piece


def all_drop_secondary(states: list) -> None:
    """hpZ: forget the secondary slices (the shards changed: a step, a load, an edit)."""
    for s in states:
        s.secondary = None
