"""The one gather/release path for ZeRO-3 parameters, shared by GatheredParameters and the engine.

[Note: why release is refcounted, and why every hold has an owner]
A parameter can be wanted by several holders at once: two overlapping GatheredParameters
blocks, a GatheredParameters around a forward pass, the engine's hooks for each submodule
that uses it. Each holder is an owner object (the GatheredParameters, one submodule's
forward or backward, the prefetcher, `param.all_gather()`) that calls `fetch_states()` and
`release_states()` once each, naming itself. `fetch_states()` takes a hold and gathers only
parameters that are not yet gathered or in flight; `release_states()` drops that owner's
hold, and the last holder frees the gathered tensor. Because holds are named, a release by
an owner that holds nothing is an error rather than a silently dropped hold of someone
else's, a leaked hold can be traced to its owner (`ds_summary()["held_by"]`), and the
engine can find the gathers that are live at `step()`. Writing changes back is per holder:
a holder that modified the tensor (`has_been_updated=True`, or a broadcast from a modifier
rank) copies its slice into the shard when it releases, even if others still hold it.

[Note: coalescing]
All parameters asked for in one `fetch()` that share a (process group, dtype) go into one
all-gather: their shards are concatenated into one input (a view, when Init put them back
to back: each state records the flat buffer its shard is a view of), and the output is laid
out rank by rank, `[rank 0: p0 shard, p1 shard, ...][rank 1: ...]`. One fused copy moves
each parameter's column block into its full tensor (see `_FullPool` for where those live);
a single parameter needs no copy, as the output is its full tensor. Through shared memory
there is no rank-major buffer: each rank writes its pieces where the module's blocks lie in
the shared segment, and every rank reads them back in one contiguous copy into the
module's full buffer (shm.py's [Note: the block layout of a gather]): the copies a raw
all-gather makes, with the pieces on the cheap side. DeepSpeed's shard math fixes which
elements each rank holds, so no output layout of one collective makes every parameter
contiguous; FSDP1's flat layout would, with other shard math; the layouts measured are in
benchmarks/README.md, "Gathers without copy-out".
Every rank issues the same collectives in the same order because parameters are sorted by
`ds_id`, which is equal on all ranks. State changes go a bucket at a time (see
lifecycle.py's bulk transitions).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Optional

import torch

from deepspeed import comm as dist
from deepspeed import process_state
from deepspeed.accelerator import get_accelerator
from deepspeed.comm.shm import BlockPlan
from deepspeed.runtime.zero.lifecycle import (
    ZeroParamState,
    ZeroParamStatus,
    all_keep_secondary,
    all_to_available,
    all_to_inflight,
    all_to_released,
    hold_all,
    secondary_size,
    unhold_all,
)


def zero_states(params: Iterable) -> list:
    """The states of the ZeRO parameters among `params`, de-duplicated and sorted by ds_id.

    A ZeRO parameter is one that carries a state: parameter.py's `make_zero_param` attaches it
    as it switches the class, which is what `is_zero_param` tests above this layer.
    """
    seen = {s.ds_id: s for p in params if (s := getattr(p, "_zero_state", None)) is not None}
    ids = list(seen)
    if ids == sorted(ids):
        return list(seen.values())  # already in order (a module's parameters usually are)
    return [seen[k] for k in sorted(ids)]


_DEVICES: dict = {}  # device name -> torch.device: each gather asks, and making one costs more than the lookup
process_state.register("deepspeed.runtime.zero.gather._DEVICES", _DEVICES, _DEVICES.clear)


def _compute_device() -> torch.device:
    name = get_accelerator().current_device_name()  # asked each time: set_device may change it
    device = _DEVICES.get(name)
    if device is None:
        device = _DEVICES[name] = torch.device(name)
    return device


def _buckets_by_group_and_dtype(states: list) -> list:
    """Split `states` (sorted by ds_id) into lists sharing a (group, dtype), order preserved."""
    first = states[0]
    base, group = getattr(first, "shard_base", None), first.group
    if base is not None and all(s.shard_base is base and s.group is group for s in states):
        return [states]  # one module's parameters: one flat shard buffer, so one dtype
    buckets: dict = {}
    for s in states:
        buckets.setdefault((id(s.group), s.shard_dtype), []).append(s)
    return list(buckets.values())


def _back_to_back(states: list) -> tuple:
    """`(end, key)` when the shards of `states` (one group) lie back to back in one flat buffer; else `(-1, None)`.

    `end`: where they end in it; `key`: their ds_ids, which name the run for `FULLS`. Init
    puts each module's shards back to back, and the states record which flat buffer their
    shard is a view of, so this needs no tensor call per shard: one pass over the states,
    the only one between taking the holds and the collective (see `fetch_states`).
    """
    first = states[0]
    base, group, end = first.shard_base, first.group, first.shard_offset
    ids = []
    for s in states:
        if s.shard_base is not base or s.group is not group or s.shard_offset != end:
            return -1, None
        end += s.partition_size
        ids.append(s.ds_id)
    return end, tuple(ids)


def _flat_input(states: list, device: torch.device, end: Optional[int] = None) -> torch.Tensor:
    """This rank's shards of `states` (one group and dtype), back to back in one 1D tensor on `device`.

    A view of their flat buffer when they lie back to back in one (`end`, see `_back_to_back`),
    else a concatenation.
    """
    if end is None:
        end = _back_to_back(states)[0]
    if end < 0:
        return torch.cat([t.shard.to(device, non_blocking=True) for t in states])
    first = states[0]
    base = first.shard_base
    if len(states) == 1:
        flat = first.shard
    elif first.shard_offset == 0 and end == base.shape[0]:
        flat = base
    else:
        flat = base[first.shard_offset : end]
    # Shards usually live where they are gathered: skip the call (each torch call on this
    # path costs several microseconds once a collective has flushed the caches).
    return flat if flat.device == device else flat.to(device, non_blocking=True)


class _ScratchPool:
    """Reusable all-gather outputs: memory that lives from a collective's issue to its copy-out.

    [Note: why the all-gather output is pooled]
    A coalesced gather needs two buffers at once: the rank-major output and the full
    tensors it is copied into. Freeing the output right after the copy, gather after
    gather, costs on the CPU: glibc hands a large free block at the top of its heap back to
    the kernel, and the next gather's fresh pages fault in again (2 gloo ranks, 4 MB in 100
    parameters: 8.0 ms per all-gather and copy-out with both buffers fresh, 5.1 ms with a
    fresh output buffer only, 4.2 ms with neither; medians of 80, side by side). So outputs
    go back here once copied out, and the next gather of at most that size reuses one. On an
    accelerator the caching allocator does the same; reuse is stream-ordered either way, as
    a collective waits for the work queued before it. At most `KEEP` buffers per (dtype,
    device) are kept; `clear()` frees them.
    """

    KEEP = 2
    # A run reuses a buffer at most this many times its size: a bias laid out in a whole MLP
    # weight's buffer would hold all of it for as long as the bias stays gathered.
    SLACK = 2

    def __init__(self) -> None:
        self._free: dict = {}  # (dtype, device) -> [1D tensor], smallest first

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D tensor of `numel` elements (garbage-filled), reused when a kept one is large enough."""
        free = self._free.get((dtype, device))
        if free:
            for i, buf in enumerate(free):
                if buf.shape[0] >= numel:
                    del free[i]
                    return buf if buf.shape[0] == numel else buf[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, tensor: torch.Tensor) -> None:
        base = tensor if tensor._base is None else tensor._base
        free = self._free.setdefault((base.dtype, base.device), [])
        free.append(base)
        free.sort(key=lambda t: t.shape[0])
        if len(free) > self.KEEP:
            del free[0]  # keep the largest: they serve every smaller gather too

    def clear(self) -> None:
        self._free.clear()


SCRATCH = _ScratchPool()
process_state.register("deepspeed.runtime.zero.gather.SCRATCH", SCRATCH, SCRATCH.clear)


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # absent from some torch versions


class _FullBuffer:
    """The full tensors of one run of parameters (see the note in `_FullPool`): a buffer and views of it."""

    buf: torch.Tensor  # 1D, at least [rows * sum(sizes)] of the run it is laid out for
    key: tuple  # the ds_ids of that run (and "secondary" for hpZ's layout)
    base: Any  # weakref to the run's shard base: ds_ids alone are reset by tests
    flat: torch.Tensor  # 1D, [rows * sum(sizes)]: the run's part of `buf`
    sizes: list  # each parameter's columns: its partition_size (its secondary size for hpZ's layout)
    dests: list  # [rows, size] views: the targets of the copy out of a rank-major output
    plan: BlockPlan  # how `dests` travel through shared memory, kept with them ([Note: the block layout of a gather])
    fulls: list  # each parameter's full tensor (its shape), a view of `buf`
    refs: int  # `storage_refs()` when only this object holds views of `buf`
    live: int  # how many of the run's parameters have one of `fulls` as their data
    pool_key: tuple  # (dtype, device): where `_FullPool` keeps it
    _storage: Any  # `buf`'s untyped storage, kept so that counting its users makes no object

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.live = 0
        self.pool_key = (buf.dtype, buf.device)
        self._storage = buf.untyped_storage()

    def storage_refs(self) -> int:
        """How many tensors (and storage handles, this object's own included) share `buf`'s
        memory; -1 where this torch cannot say. One call: every release asks."""
        count = _STORAGE_USE_COUNT
        return -1 if count is None else count(self._storage._cdata)

    def lay_out(self, run: list, key: tuple, rows: int, sizes: list) -> None:
        """Make the views for `run`: parameter by parameter, a `[rows, sizes[i]]` block each,
        its full tensor the block's first `numel` elements (the padding at its end)."""
        self.sizes = sizes
        numel = rows * sum(sizes)
        self.key, self.base = key, weakref.ref(run[0].shard_base)
        self.flat = self.buf if self.buf.shape[0] == numel else self.buf[:numel]
        self.dests, self.fulls = _views(self.flat, run, rows, sizes)
        self.plan = BlockPlan(self.flat, self.sizes)
        self.refs = self.storage_refs()  # no temporaries left: only our views count


def _views(flat: torch.Tensor, run: list, rows: int, sizes: list) -> tuple:
    """`([rows, sizes[i]] views, full tensors)` of `run`'s parameters, back to back in `flat`."""
    dests, fulls = [], []
    for s, n, piece in zip(run, sizes, flat.split([rows * n for n in sizes])):
        dests.append(piece.view(rows, n))
        full = piece if piece.shape[0] == s.numel else piece[: s.numel]
        fulls.append(full if len(s.shape) == 1 else full.view(s.shape))
    return dests, fulls


class _FullPool:
    """Full-tensor buffers of released runs, kept for the next gather (with their views, when it is the same run).

    [Note: one buffer per module, reused]
    Parameters whose shards Init put in one flat buffer (one module's) form a run; each run
    gathered gets one buffer for its full tensors, laid out parameter by parameter with each
    one's padding at its end, and the parameters' data are views of it. A module's gathered
    memory is thus one allocation, freed when its last parameter is released, as it would
    be with one allocation per parameter. When the run is released, its buffer comes back
    here, unless a tensor other than the pool's views still shares it (a caller kept
    `p.data`, autograd saved a view): then it stays that tensor's, untouched. The next
    gather of the same run takes its buffer back with the views already made, so a
    repeated gather of a module makes no tensor per parameter, allocates nothing and
    touches no fresh page (on the CPU, fresh pages cost about as much as the copy out
    itself, see `_ScratchPool`). Another run of at most that size, and at least half of it
    (`SLACK`), reuses the memory with new views. At most `KEEP` buffers per (dtype, device) are kept, the largest; `clear()`
    frees them.
    """

    KEEP = 2
    # A run reuses a buffer at most this many times its size: a bias laid out in a whole MLP
    # weight's buffer would hold all of it for as long as the bias stays gathered.
    SLACK = 2

    def __init__(self) -> None:
        self._free: dict = {}  # (dtype, device) -> [_FullBuffer], smallest buffer first

    def take(
        self,
        run: list,
        dtype: torch.dtype,
        device: torch.device,
        key: Optional[tuple] = None,
        secondary: bool = False,
    ) -> _FullBuffer:
        """A buffer for `run`'s full tensors; `key`: its ds_ids, when the caller has them.
        `secondary`: laid out for hpZ's gather of the secondary slices (`_SecondaryBucket`)."""
        if key is None:
            key = tuple(s.ds_id for s in run)
        if secondary:
            key = ("secondary", *key)
            rows, sizes = run[0].hpz.size, [secondary_size(s) for s in run]
        else:
            rows, sizes = run[0].world_size, [s.partition_size for s in run]
        free = self._free.get((dtype, device))
        if free:
            base = run[0].shard_base
            for i, fb in enumerate(free):
                if fb.key == key and fb.base() is base:
                    del free[i]
                    return fb  # the same run: its views are ready
            numel = rows * sum(sizes)
            for i, fb in enumerate(free):  # smallest first; at most twice the run's size
                if numel <= fb.buf.shape[0] <= self.SLACK * numel:
                    del free[i]
                    fb.lay_out(run, key, rows, sizes)
                    return fb
        fb = _FullBuffer(torch.empty(rows * sum(sizes), dtype=dtype, device=device))
        fb.lay_out(run, key, rows, sizes)
        return fb

    def give_back(self, fb: _FullBuffer) -> None:
        if fb.refs < 0 or fb.storage_refs() != fb.refs:
            return  # someone else still holds one of its tensors: the memory stays theirs
        free = self._free.setdefault(fb.pool_key, [])
        free.append(fb)
        free.sort(key=lambda f: f.buf.shape[0])
        if len(free) > self.KEEP:
            del free[0]

    def clear(self) -> None:
        self._free.clear()


FULLS = _FullPool()
process_state.register("deepspeed.runtime.zero.gather.FULLS", FULLS, FULLS.clear)


def drop_pooled_buffers() -> None:
    """Free what `SCRATCH` and `FULLS` keep for the next gather.

    The engine calls this at the end of each pass and after each step: reuse pays within a
    pass (each module's buffers serve the next module's gather), and between steps a rank
    then holds nothing but its shards, optimizer state and persistent parameters, as ZeRO-3
    promises (16 bytes per parameter / N), not two more copies of its largest module.
    """
    SCRATCH.clear()
    FULLS.clear()


def _runs(states: list) -> list:
    """`states` cut into runs whose shards share a flat buffer (one module's, as Init lays them out)."""
    runs, current = [], [states[0]]
    for s in states[1:]:
        if s.shard_base is current[-1].shard_base:
            current.append(s)
        else:
            runs.append(current)
            current = [s]
    runs.append(current)
    return runs


class GatherBucketBase:
    """What every gather bucket shares (plain, hpZ's secondary, qwZ's quantized): `issue()`
    starts one collective and marks the states INFLIGHT; `wait()` waits for it once, has the
    subclass fill the full buffers (`_fill`), installs them and, for a gather from the primary
    shards under hpZ, keeps the secondary slices ([Note: hpZ, the secondary shard] in hpz.py)."""

    keeps_secondary = True  # False for hpZ's own secondary gather

    def __init__(self, states: list) -> None:
        self.states = states  # ZeroParamState, sorted by ds_id
        self._work = None
        self._expected = ZeroParamStatus.INFLIGHT  # the states' status until wait() installs them
        self.done = False

    def _issued(self, work: Any, inflight: bool) -> None:
        """The collective is under way: `inflight=False` (the caller waits at once) skips INFLIGHT."""
        self._work = work
        self._expected = ZeroParamStatus.INFLIGHT if inflight else ZeroParamStatus.NOT_AVAILABLE
        if inflight:
            all_to_inflight(self.states, self)

    def _fill(self) -> list:
        """After the collective: the `_FullBuffer`s holding the states' full tensors."""
        raise NotImplementedError

    def wait(self) -> None:
        if self.done:
            return  # another holder waited on this bucket already
        self._work.wait()
        self._work = None  # its tensors would count as holders of the buffers (see _FullPool)
        _install(self.states, self._fill(), self._expected)
        if self.keeps_secondary and self.states[0].hpz is not None:
            all_keep_secondary(self.states)
        self.done = True


class _GatherBucket(GatherBucketBase):
    """One coalesced all-gather for parameters of one (group, dtype); `wait()` installs them."""

    flat_out: Optional[torch.Tensor]  # 1D, [world_size * sum(partition_size)], rank-major

    def __init__(self, states: list, layout: tuple = (-1, None)) -> None:
        super().__init__(states)
        self.flat_out = None
        self._single: Optional[_FullBuffer] = None  # one parameter: gathered straight into its buffer
        self._filled: Optional[list] = None  # the _FullBuffers a gather that completed on issue filled
        # `_back_to_back(states)`: where their shards end in one flat buffer (-1: not one run) and the run's key.
        self._end, self._key = layout

    def issue(self, device: torch.device, inflight: bool = True) -> None:
        """Start the all-gather. `inflight=False`: the caller waits at once, so states skip INFLIGHT."""
        states = self.states
        flat_in = _flat_input(states, device, self._end)
        group = states[0].group
        if len(states) == 1:
            # The output is the parameter's full tensor: no copy out.
            self._single = FULLS.take(states, flat_in.dtype, device, self._key)
            self.flat_out = self._single.flat
            work = dist.all_gather_into_tensor(self.flat_out, flat_in, group=group, async_op=True)
        elif dist.completes_on_issue(group, flat_in):
            # Shared memory: the gather is over when the call returns, so nothing overlaps it
            # and the blocks go from the segment straight into the full buffers, with no
            # rank-major buffer between (one copy out instead of two).
            self._filled = self._full_buffers(flat_in.dtype, device)
            if len(self._filled) == 1:  # one run: its full tensors lie back to back in one buffer
                fb = self._filled[0]
                dist.all_gather_into_columns(fb.dests, fb.sizes, flat_in, group=group, plans=[fb.plan])
            else:
                dests = [d for fb in self._filled for d in fb.dests]
                sizes = [n for fb in self._filled for n in fb.sizes]
                plans = [fb.plan for fb in self._filled]
                dist.all_gather_into_columns(dests, sizes, flat_in, group=group, plans=plans)
            work = dist.CommHandle()
        else:
            self.flat_out = SCRATCH.take(states[0].world_size * flat_in.shape[0], flat_in.dtype, device)
            work = dist.all_gather_into_tensor(self.flat_out, flat_in, group=group, async_op=True)
        self._issued(work, inflight)

    def _full_buffers(self, dtype: torch.dtype, device: torch.device) -> list:
        """One `_FullBuffer` per run of the states (one module's shards), to hold their full tensors."""
        if self._end >= 0:
            return [FULLS.take(self.states, dtype, device, self._key)]
        return [FULLS.take(run, dtype, device) for run in _runs(self.states)]

    def _fill(self) -> list:
        if self._single is not None:
            buffers = [self._single]
        elif self._filled is not None:
            buffers, self._filled = self._filled, None
        else:
            buffers = self._full_buffers(self.flat_out.dtype, self.flat_out.device)
            _copy_out(self.flat_out, buffers, self.states[0].world_size)
            SCRATCH.give_back(self.flat_out)
        self.flat_out = None
        return buffers


def _install(states: list, buffers: list, expected: ZeroParamStatus) -> None:
    """Make the full tensors of `buffers` (`_FullBuffer`s, filled) the data of `states`."""
    if len(buffers) == 1:
        fb = buffers[0]
        fb.live = len(fb.fulls)
        all_to_available(states, fb.fulls, [fb] * fb.live, expected)
        return
    fulls, owners = [], []
    for fb in buffers:
        fb.live = len(fb.fulls)
        fulls.extend(fb.fulls)
        owners.extend([fb] * fb.live)
    all_to_available(states, fulls, owners, expected)


class _SecondaryBucket(GatherBucketBase):
    """hpZ: one all-gather of the secondary slices of `states` (one dtype) over their secondary
    group, within a node ([Note: hpZ, the secondary shard] in hpz.py); `wait()` installs them.

    The same path as a primary gather with other sizes: the slices, kept back to back
    (`all_keep_secondary`), go in as one view, and each parameter's `[h, secondary size]`
    block of its run's full buffer is filled straight from the shared-memory slots, or by one
    copy out of a rank-major output elsewhere."""

    keeps_secondary = False  # it gathers from them

    def __init__(self, states: list) -> None:
        super().__init__(states)
        self.flat_out: Optional[torch.Tensor] = None
        self._buffers: list = []

    def issue(self, device: torch.device, inflight: bool = True) -> None:
        states, hpz = self.states, self.states[0].hpz
        flat_in = _secondaries_input(states).to(device, non_blocking=True)
        self._buffers = [FULLS.take(run, flat_in.dtype, device, secondary=True) for run in _runs(states)]
        if dist.completes_on_issue(hpz.group, flat_in):
            dests = [d for fb in self._buffers for d in fb.dests]
            sizes = [n for fb in self._buffers for n in fb.sizes]
            plans = [fb.plan for fb in self._buffers]
            dist.all_gather_into_columns(dests, sizes, flat_in, group=hpz.group, plans=plans)
            work = dist.CommHandle()
        else:
            self.flat_out = SCRATCH.take(hpz.size * flat_in.shape[0], flat_in.dtype, device)
            work = dist.all_gather_into_tensor(self.flat_out, flat_in, group=hpz.group, async_op=True)
        self._issued(work, inflight)

    def _fill(self) -> list:
        buffers, self._buffers = self._buffers, []
        if self.flat_out is not None:
            _copy_out(self.flat_out, buffers, self.states[0].hpz.size)
            SCRATCH.give_back(self.flat_out)
            self.flat_out = None
        return buffers


def _secondaries_input(states: list) -> torch.Tensor:
    """This rank's secondary slices of `states`, back to back in one 1D tensor: a view of the
    buffer `all_keep_secondary` laid them out in, when they still lie there in this order."""
    pieces = [s.secondary for s in states]
    first = pieces[0]
    if len(pieces) == 1:
        return first
    base = first._base
    at, item = first.data_ptr(), first.element_size()
    for piece in pieces:
        if piece._base is not base or piece.data_ptr() != at:
            return torch.cat(pieces)
        at += piece.shape[0] * item
    start = first.storage_offset() - base.storage_offset()
    return base[start : start + (at - first.data_ptr()) // item]


def _copy_out(flat_out: torch.Tensor, buffers: list, world: int) -> None:
    """Fill `buffers` (`_FullBuffer`s) from the rank-major all-gather output of their runs, in one copy."""
    dests = [d for fb in buffers for d in fb.dests]
    sizes = [n for fb in buffers for n in fb.sizes]
    torch.split_with_sizes_copy(flat_out.view(world, -1), sizes, dim=1, out=dests)


def release_unheld(states: list) -> None:
    """Free the gathered tensors of `states` (nobody holds them); only the shards remain.

    A run whose last gathered parameter this was goes back to `FULLS`. Every release goes
    through here, so no `full_buffer` outlives its parameters' gathered data.
    """
    if not states:
        return  # the usual case when a prefetched hold is handed to the submodule that uses it
    buffers = all_to_released(states)
    first = buffers[0]
    if first is not None and first.live == len(buffers) and buffers.count(first) == len(buffers):
        first.live = 0  # the common case: one whole run released together
        FULLS.give_back(first)
        return
    for fb in buffers:
        if fb is not None:
            fb.live -= 1
            if fb.live == 0:
                FULLS.give_back(fb)


def refresh_gathered(states: list) -> None:
    """Re-gather AVAILABLE tensors from their (updated) shards, in place: one collective per bucket.

    After an optimizer step, parameters that stay gathered (persistent ones, or ones a live
    holder keeps) must see the new shards.
    """
    # Exact even under qwZ: what stays gathered across a step is persistent or a user's
    # GatheredParameters, both gathered exactly (`fetch_states`).
    gather_into_params([s for s in states if s.status is ZeroParamStatus.AVAILABLE])


def gather_into_params(states: list, bucket_elems: int = 0) -> None:
    """All-gather every rank's shards of `states` into their full `param.data`, in place.

    Stages 1 and 2 after a step (the updated slices of replicated parameters), and stage 3's
    refresh of what stays gathered.

    One collective per (group, dtype) bucket, closed once it holds `bucket_elems` gathered
    elements (`allgather_bucket_size`; 0: no limit), so the temporary output stays bounded.
    The gather runs in place: each parameter's storage, seen as `[world, partition_size]`
    when it has no padding, holds this rank's shard in row `rank` (already there for a
    replicated parameter, whose shard is that row; copied there otherwise), and
    `dist.all_gather_into_columns` fills the other rows straight from the collective. A
    padded parameter's block goes through a small buffer first, since its last rank's slice
    runs past its end.
    """
    by_key: dict = {}
    for s in states:
        by_key.setdefault((id(s.group), s.shard_dtype), []).append(s)
    for same in by_key.values():
        buckets, chunk, elems = [], [], 0
        for s in same:
            chunk.append(s)
            elems += s.world_size * s.partition_size
            if bucket_elems and elems >= bucket_elems:
                buckets.append(chunk)
                chunk, elems = [], 0
        if chunk:
            buckets.append(chunk)
        # One temporary buffer serves every bucket in turn where the collective needs one
        # (each completes before the next): a fresh multi-MB buffer per bucket costs page
        # faults on the CPU.
        first, device = same[0], _compute_device()
        scratch = None
        if not dist.completes_on_issue(first.group, first.param.data):
            capacity = max(sum(s.partition_size for s in b) for b in buckets) * first.world_size
            scratch = torch.empty(capacity, dtype=first.shard_dtype, device=device)
        for bucket in buckets:
            _gather_bucket(bucket, device, scratch)


@torch.no_grad()
def _gather_bucket(states: list, device: torch.device, scratch: Optional[torch.Tensor]) -> None:
    first = states[0]
    world, rank, sizes = first.world_size, first.rank, [s.partition_size for s in states]
    targets, padded = [], []
    for s in states:
        if _storage_is_rows(s):
            target = s.param.data.view(world, s.partition_size)
        else:  # its last rank's slice runs past its end: gathered into a small buffer first
            target = torch.empty(world, s.partition_size, dtype=s.shard_dtype, device=device)
            padded.append((s, target))
        own, shard = target[rank], s.shard
        if own.data_ptr() != shard.data_ptr():  # a copy: stage 3, padding, shared storage, new .data
            own.copy_(shard)
        targets.append(target)
    dist.all_gather_into_columns(targets, sizes, None, group=first.group, scratch=scratch)
    for s, target in padded:
        s.param.data.copy_(target.view(-1)[: s.numel].view(s.shape))


def _storage_is_rows(state: Any) -> bool:
    """Whether `state.param`'s storage can take its gathered block as a `[world, partition_size]` view."""
    data = state.param.data
    return state.padding == 0 and data.is_contiguous() and data.dtype == state.shard_dtype


class GatherHandle:
    """The result of `fetch()`: `wait()` completes every all-gather the fetch depends on."""

    def __init__(self, buckets: list) -> None:
        self._buckets = buckets  # ours plus other holders' in-flight buckets we need

    def wait(self) -> None:
        for bucket in self._buckets:
            bucket.wait()
        self._buckets = []


class MultipleAllGatherHandles:
    """Several gather handles waited on as one (upstream's name, for callers that gather in
    groups and keep one handle). `wait(**kwargs)` passes its keyword arguments, by keyword,
    to each handle's `wait`: handles differ in their signatures, and only a keyword reaches a
    keyword-only parameter (`handle_dependency`, upstream's flag) as well as a positional one."""

    def __init__(self, handles: list) -> None:
        self.handles = list(handles)

    def wait(self, **kwargs: Any) -> None:
        for handle in self.handles:
            handle.wait(**kwargs)


class _ApiHolds:
    """The owner of holds taken by `param.all_gather()`, which `param.partition()` drops."""

    def __repr__(self) -> str:
        return "param.all_gather()"


PARAM_API = _ApiHolds()


def _secondary_served(states: list, quantized: bool) -> list:
    """hpZ: the `states` a gather serves from their secondary slices. Under qwZ those hold the
    dequantized values of a quantized gather, so only a quantized gather uses them."""
    return [s for s in states if s.secondary is not None and (quantized or s.qwz is None)]


def fetch_states(
    states: list, owner: object, async_op: bool = False, quantized: bool = False
) -> GatherHandle:
    """Take one hold for `owner` on each state and gather those not available (see both notes above).

    `quantized=True` (the hooks' gathers for compute): parameters with qwZ on gather int8, and
    hpZ's secondary slices, which hold those dequantized values, serve them. Every other
    gather (GatheredParameters, `param.all_gather()`, persistence, a refresh) gives the
    exact values: an edit written back from a quantized copy would quantize the shard and the
    fp32 master for good ([Note: block-wise int8] in quantized.py)."""
    missing, in_flight = hold_all(states, owner)
    buckets = []
    near = [] if not missing or missing[0].hpz is None else _secondary_served(missing, quantized)
    if near:
        device = _compute_device()  # hpZ: gather what has a secondary slice within the node
        for same_dtype in _buckets_by_group_and_dtype(near):
            bucket = _SecondaryBucket(same_dtype)
            bucket.issue(device, inflight=async_op)
            buckets.append(bucket)
        missing = [s for s in missing if s.secondary is None or not (quantized or s.qwz is None)]
    if quantized and missing and any([s.qwz is not None for s in missing]):  # qwZ: quantized.py
        device = _compute_device()
        for same in _buckets_by_group_and_dtype([s for s in missing if s.qwz is not None]):
            bucket = same[0].qwz(same, _back_to_back(same))
            bucket.issue(device, inflight=async_op)
            buckets.append(bucket)
        missing = [s for s in missing if s.qwz is None]
    if missing:
        device = _compute_device()
        layout = _back_to_back(missing)  # one module's parameters, usually: one bucket, one run
        same = [missing] if layout[0] >= 0 else _buckets_by_group_and_dtype(missing)
        if len(same) == 1:
            plans = [(missing, layout)]
        else:
            plans = [(group_states, _back_to_back(group_states)) for group_states in same]
        for group_states, layout in plans:
            bucket = _GatherBucket(group_states, layout)
            bucket.issue(device, inflight=async_op)  # waited on below, before anyone can look
            buckets.append(bucket)
    handle = GatherHandle(buckets + in_flight)
    if not async_op:
        handle.wait()
    return handle


def fetch(params: Iterable, owner: object, async_op: bool = False) -> GatherHandle:
    return fetch_states(zero_states(params), owner, async_op=async_op)


def fetch_once(params: Iterable, owner: object, async_op: bool = False) -> GatherHandle:
    """`fetch`, taking `owner`'s hold only on parameters it does not hold yet.

    Upstream's `param.all_gather()` is idempotent: gathering an available parameter again
    does nothing, and one `param.partition()` frees it. So `PARAM_API` holds at most once;
    the handle still completes a gather of the already-held ones that is in flight.
    """
    states = zero_states(params)
    fresh = [s for s in states if owner not in s.holds]
    handle = fetch_states(fresh, owner, async_op=True)
    pending = {id(s.pending): s.pending for s in states if s.status is ZeroParamStatus.INFLIGHT}
    handle = GatherHandle(handle._buckets + [b for b in pending.values() if b not in handle._buckets])
    if not async_op:
        handle.wait()
    return handle


def wait_available(states: list) -> None:
    """Complete any gather still in flight for `states`."""
    for s in states:
        if s.status is ZeroParamStatus.INFLIGHT:
            s.pending.wait()


def release_states(states: list, owner: object, has_been_updated: bool = False) -> None:
    """Drop one of `owner`'s holds on each state; write edits back first if `has_been_updated`."""
    wait_available(states)
    if has_been_updated:
        for s in states:
            s.write_back()
    release_unheld(unhold_all(states, owner))


def release_api_holds(params: Iterable, has_been_updated: bool = False) -> None:
    """Upstream's `param.partition()`: drop a hold taken by `param.all_gather()`.

    Other owners' holds are never dropped: a parameter that someone else (the engine, a live
    GatheredParameters) holds stays gathered, with edits written back if asked. A gathered
    parameter nobody holds is written back if asked and freed.
    """
    states = zero_states(params)
    wait_available(states)
    for s in states:
        if s.status is not ZeroParamStatus.AVAILABLE:
            continue
        if has_been_updated:
            s.write_back()
        if PARAM_API in s.holds:
            if s.unhold(PARAM_API) and not s.persist:
                release_unheld([s])
        elif not s.holds and not s.persist:
            release_unheld([s])


def partition_new_state(state: ZeroParamState) -> None:
    """First partition of a freshly converted parameter: its shard exists, free the full tensor."""
    if state.holders == 0 and not state.persist:
        release_unheld([state])
