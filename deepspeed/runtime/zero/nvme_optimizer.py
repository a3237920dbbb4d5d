"""`offload_optimizer.device: "nvme"`: fp32 masters and optimizer state in swap files, stepped in sub-groups.

[Note: optimizer swapping]
With NVMe offload the fp32 master shards and every optimizer state tensor shaped like them
(Adam's `exp_avg` and `exp_avg_sq`; whatever a torch optimizer keeps per element) live in
scratch files under `nvme_path` (`SwapStore`). Between steps host memory holds none of them,
only the gradient shards (as with CPU offload) and small state such as Adam's `step`. The
masters are cut into sub-groups of at most `sub_group_size` elements (a larger master is a
group of its own); each group's tensors of one kind (the masters, or one state key) sit back
to back in one file, and one pool buffer holds one such file while it is used. A step runs
the group loop:

    read group i (issued earlier when pipeline_read) -> step it on the CPU -> write it back

With `pipeline_read` the read of group i+1 is issued before group i steps; with
`pipeline_write` the write of group i is waited for only after group i+1 has stepped. So a
step needs `kinds x (1 + pipeline_read + pipeline_write)` buffers, and `buffer_count` below
that is an error naming the minimum. The optimizer steps one group at a time: its param
groups are narrowed to the group's masters around its `step()` (every torch optimizer
skips nothing else and updates each tensor on its own, so the result is bit for bit the
one step over all of them); after each group the masters are cast into the training-dtype
shards, as the unswapped step does once at its end.

[Note: a swapped-out tensor]
A master or state tensor keeps its identity while swapped out (the optimizer's state dict
and param groups name it), its shape and dtype, so gradients can still be assigned to a
master. Its data is a one-element NaN broadcast to its shape (stride 0): it holds no memory,
an in-place write to it raises, and a read shows NaN rather than stale numbers. A state
tensor the optimizer made as a view (of a larger buffer) is replaced in its state dict by a
new one instead: a view keeps its base, and so the old values' memory, alive. Code that
must see the values (a checkpoint save or load, the optimizer's `state_dict`) runs inside
`resident()`, which reads everything into ordinary host memory and writes it back after.

[Note: optimizer state kinds]
Torch optimizers create their state in their first step, but files are reserved at set-up
(a full disk is an error there, naming the path and the bytes, not in step one). So which
state tensors the optimizer keeps is learnt by stepping a copy of it (its class and the first
group's hyperparameters) once on a small probe tensor: every state entry shaped like the
probe is swapped; anything else (a step count, a factored second moment) stays in memory.

[Note: checkpoints of swapped state]
A checkpoint of a model that needs NVMe must not need the memory the NVMe saved. Saving, the
flat fp32 masters and flat state the checkpoint file holds (save.py) are made by `flatten`
in scratch files mapped into memory (`SwapStore.scratch_tensor`): their pages are page
cache, which the kernel writes out and drops as it needs, and each swap file is read once
into one pool buffer. Loading, the checkpoint file is itself mapped (safe_load.py), and
`stage` takes each master's loaded values and swapped state, writing a group's files once
all of its masters are staged: no step of either holds the state in anonymous memory.
`engine.optimizer.state_dict()` returns its copies of swapped state the same way (`copy_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed.runtime.swap_tensor.swap_store import AioSettings, PinnedBufferPool, SwapStore, io_size

__all__ = ["OptimizerSwapper", "agree_on_step", "minimum_buffer_count", "state_kinds"]

_MASTER = "fp32_master"  # the masters' kind, next to the optimizer's state keys
_PROBE_NUMEL = 13  # an odd size no scalar or factored state has
_TENSOR_ALIGN = 64  # bytes between tensors in a file: every dtype, and cache lines


def _aligned(nbytes: int) -> int:
    return (nbytes + _TENSOR_ALIGN - 1) // _TENSOR_ALIGN * _TENSOR_ALIGN


def state_kinds(optimizer: torch.optim.Optimizer) -> list:
    """`[(state key, dtype or None for the master's)]` the optimizer keeps per element (see the note)."""
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    probe = nn.Parameter(torch.zeros(_PROBE_NUMEL))
    probe.grad = torch.full_like(probe, 1e-3)
    try:
        twin = type(optimizer)([dict(hyper, params=[probe])])
        twin.step()
    except Exception as err:
        raise TypeError(
            f"offload_optimizer.device 'nvme' could not learn which state {type(optimizer).__name__} keeps: "
            f"building it on one probe tensor with its first param group's settings and stepping it raised "
            f"{type(err).__name__}: {err}; use a torch.optim optimizer or the config's optimizer block, or "
            "offload_optimizer.device 'cpu'"
        ) from err
    kinds = []
    for key, value in twin.state.get(probe, {}).items():
        if torch.is_tensor(value) and value.shape == probe.shape:
            kinds.append((key, None if value.dtype == probe.dtype else value.dtype))
    return kinds


def _swapped_out(sentinel: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A new tensor of `shape` on the one-element sentinel's storage (stride 0), not a view of it."""
    return torch.empty(0, dtype=sentinel.dtype).set_(sentinel.untyped_storage(), 0, shape, (0,) * len(shape))


def minimum_buffer_count(kinds: int, pipeline_read: bool, pipeline_write: bool) -> int:
    """Buffers one step needs: each group in use holds one per kind (see the note)."""
    return kinds * (1 + int(pipeline_read) + int(pipeline_write))


@dataclass
class _Group:
    """One sub-group: its masters (in order) and, per kind, each one's byte offset in its file."""

    index: int
    masters: list  # nn.Parameter
    offsets: dict = field(default_factory=dict)  # kind -> [byte offset per master]
    nbytes: dict = field(default_factory=dict)  # kind -> bytes of the file
    written: set = field(default_factory=set)  # kinds the file holds values of
    buffers: dict = field(default_factory=dict)  # kind -> (pool index or None, uint8 buffer) while in use

    def key(self, kind: str) -> str:
        return f"group{self.index}.{kind}"


class OptimizerSwapper:
    """The masters and state of one rank's `optimizer` in swap files (see the module notes)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: list,
        offload: Any,
        sub_group_size: int,
        aio: AioSettings,
        name: str,
        initial_value: Optional[Callable[[nn.Parameter], torch.Tensor]] = None,
    ) -> None:
        """`initial_value(master)`: the master's first values, read as its sub-group is first
        written (the engine's masters hold none yet: see `_make_master`); default its data."""
        if offload.nvme_path is None:
            raise ValueError(
                "zero_optimization.offload_optimizer.nvme_path is required with device 'nvme': set it to a "
                "folder on the drive to swap optimizer state to"
            )
        self.optimizer = optimizer
        self.pipeline_read = offload.pipeline_read
        self.pipeline_write = offload.pipeline_write
        dtypes = {kind: dtype or torch.float32 for kind, dtype in state_kinds(optimizer)}
        self.kinds = {_MASTER: torch.float32, **dtypes}  # kind -> dtype
        needed = minimum_buffer_count(len(self.kinds), self.pipeline_read, self.pipeline_write)
        if offload.buffer_count < needed:
            raise ValueError(
                f"zero_optimization.offload_optimizer.buffer_count={offload.buffer_count} is too few: "
                f"{type(optimizer).__name__} keeps {len(self.kinds) - 1} state tensors per master "
                f"({', '.join(k for k in self.kinds if k != _MASTER) or 'none'}), so each sub-group uses "
                f"{len(self.kinds)} buffers, and pipeline_read={self.pipeline_read}, "
                f"pipeline_write={self.pipeline_write} need at least {needed}; raise buffer_count to {needed}"
            )
        self.groups = self._cut(masters, max(int(sub_group_size), 1))
        self._sentinels = {
            dtype: torch.full((1,), float("nan") if dtype.is_floating_point else 0, dtype=dtype)
            for dtype in set(self.kinds.values())
        }
        self._resident_depth = 0
        self._staged: dict = {}  # group index -> {id(master): {kind: values}} loaded, not yet written
        self._group_index: Optional[dict] = None  # id(master) -> its group, made when first asked
        self._initial_value = initial_value or (lambda master: master.data)
        self.store = SwapStore(offload.nvme_path, name, aio)
        try:
            self.store.reserve_many({g.key(k): n for g in self.groups for k, n in g.nbytes.items()})
            largest = max((n for g in self.groups for n in g.nbytes.values()), default=1)
            self.pool = PinnedBufferPool(needed, largest, aio)
            for group in self.groups:  # the masters' initial values go to their files
                self._attach_new(group)
                self._detach_and_write(group, async_op=False)
                self._give_back(group)
        except BaseException:
            self.store.close()  # a set-up that failed leaves no scratch behind
            raise

    def _cut(self, masters: list, limit: int) -> list:
        groups, current, size = [], [], 0
        for master in masters:
            if current and size + master.numel() > limit:
                groups.append(current)
                current, size = [], 0
            current.append(master)
            size += master.numel()
        if current:
            groups.append(current)
        out = []
        for index, members in enumerate(groups):
            group = _Group(index, members)
            for kind, dtype in self.kinds.items():
                offsets, at = [], 0
                for master in members:
                    offsets.append(at)
                    at += _aligned(master.numel() * dtype.itemsize)
                group.offsets[kind], group.nbytes[kind] = offsets, max(at, 1)
            out.append(group)
        return out

    # ---- what callers ask ------------------------------------------------------------------
    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is swapped out now (its data is a sentinel, see the note)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr == s.untyped_storage().data_ptr() for s in self._sentinels.values())

    @property
    def is_resident(self) -> bool:
        """Inside `resident()`: every tensor is in memory."""
        return self._resident_depth > 0

    def disk_bytes(self) -> int:
        return self.store.reserved_bytes()

    def buffer_bytes(self) -> int:
        return self.pool.nbytes * len(self.pool._buffers)

    def close(self) -> None:
        self.store.close()

    # ---- moving one group ------------------------------------------------------------------
    def _views(self, group: _Group, kind: str) -> list:
        _, buffer = group.buffers[kind]
        dtype = self.kinds[kind]
        return [
            buffer[at : at + master.numel() * dtype.itemsize].view(dtype).view(master.shape)
            for master, at in zip(group.masters, group.offsets[kind])
        ]

    def _take_buffers(self, group: _Group, plain: bool) -> None:
        for kind in self.kinds:
            if plain:  # resident(): ordinary memory, no pool buffer held
                group.buffers[kind] = (None, torch.empty(io_size(group.nbytes[kind]), dtype=torch.uint8))
            else:
                group.buffers[kind] = self.pool.acquire(group.nbytes[kind])

    def _give_back(self, group: _Group) -> None:
        for index, _ in group.buffers.values():
            if index is not None:
                self.pool.release(index)
        group.buffers = {}

    def _issue_read(self, group: _Group, plain: bool = False, async_op: bool = True) -> None:
        self._take_buffers(group, plain)
        for kind in group.written:
            _, buffer = group.buffers[kind]
            # The whole block-rounded file: a pool buffer's transfer can then go O_DIRECT.
            self.store.read(group.key(kind), buffer[: io_size(group.nbytes[kind])], async_op=async_op)

    @torch.no_grad()
    def _attach(self, group: _Group) -> None:
        """Point the group's masters and swapped state at its (landed) buffers."""
        state = self.optimizer.state
        for kind in group.written:
            for master, view in zip(group.masters, self._views(group, kind)):
                if kind == _MASTER:
                    master.data = view
                elif kind in state.get(master, {}):
                    state[master][kind].set_(view)

    def _attach_new(self, group: _Group) -> None:
        """Set-up: the masters' first values go into fresh buffers."""
        self._take_buffers(group, plain=False)
        for master, view in zip(group.masters, self._views(group, _MASTER)):
            view.copy_(self._initial_value(master))
            master.data = view
        group.written.add(_MASTER)

    @torch.no_grad()
    def _detach_and_write(self, group: _Group, async_op: bool) -> None:
        """Whatever the step left (in the buffers, or state it created elsewhere) goes to the
        group's buffers, every tensor becomes a sentinel again, and the buffers are written."""
        state = self.optimizer.state
        for kind, dtype in self.kinds.items():
            sentinel = self._sentinels[dtype]
            for master, view in zip(group.masters, self._views(group, kind)):
                current = master.data if kind == _MASTER else state.get(master, {}).get(kind)
                if not torch.is_tensor(current) or current.shape != master.shape:
                    continue  # no such state yet (a master the optimizer skipped)
                if current.data_ptr() != view.data_ptr():
                    view.copy_(current)  # state the optimizer created or replaced this time
                if kind == _MASTER:
                    master.data = sentinel.expand(master.shape)
                elif current._base is not None:
                    # A view keeps its base alive whatever its own storage becomes: the
                    # optimizer's entry is replaced instead, or the base would stay in memory.
                    state[master][kind] = _swapped_out(sentinel, master.shape)
                else:
                    current.set_(sentinel.expand(master.shape))
                group.written.add(kind)
        for kind in group.written:
            _, buffer = group.buffers[kind]
            self.store.write(group.key(kind), buffer[: io_size(group.nbytes[kind])], async_op=async_op)

    # ---- the step ----------------------------------------------------------------------------
    def step(self, step_group: Callable[[list], None]) -> Optional[Exception]:
        """Run `step_group(masters)` on each sub-group with its tensors in memory (see the note).

        Returns the step's error instead of raising it: the caller raises it on every rank
        through `agree_on_step`, together with the parameter swappers' errors."""
        error: Optional[Exception] = None
        try:
            if self.groups:
                self._step_groups(step_group)
        except Exception as err:
            error = err
            # Settle queued I/O and free the pool, so the error is this step's alone; the
            # groups that did not finish keep their files' values from before the step.
            for wait in (self.store.wait_reads, self.store.wait_writes):
                with contextlib.suppress(OSError):
                    wait()
            for group in self.groups:
                self._give_back(group)
        return error

    def _step_groups(self, step_group: Callable[[list], None]) -> None:
        groups = self.groups
        self._issue_read(groups[0])
        writing: Optional[_Group] = None
        for i, group in enumerate(groups):
            self.store.wait_reads()  # only group i's read is pending here
            following = groups[i + 1] if i + 1 < len(groups) else None
            if self.pipeline_read and following is not None:
                self._issue_read(following)
            self._attach(group)
            step_group(group.masters)
            if self.pipeline_write:
                self._finish_write(writing)
                self._detach_and_write(group, async_op=True)
                writing = group
            else:
                self._detach_and_write(group, async_op=False)
                self._give_back(group)
            if not self.pipeline_read and following is not None:
                self._issue_read(following)
        self._finish_write(writing)

    def _finish_write(self, group: Optional[_Group]) -> None:
        if group is None:
            return  # nothing queued: the first group, or serial writes
        self.store.wait_writes()
        self._give_back(group)

    # ---- checkpoints, a group at a time ([Note: checkpoints of swapped state]) -----------------
    def _locations(self) -> dict:
        """id(master or swapped state tensor) -> (its group, kind, index in the group)."""
        out = {}
        for group in self.groups:
            for i, master in enumerate(group.masters):
                out[id(master)] = (group, _MASTER, i)
                per = self.optimizer.state.get(master, {})
                for kind in self.kinds:
                    value = per.get(kind)
                    if kind != _MASTER and torch.is_tensor(value):
                        out[id(value)] = (group, kind, i)
        return out

    def flatten(self, tensors: list, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """`tensors` (this optimizer's masters and state tensors, swapped out or not, or any
        other tensor) one after another in a new 1D tensor of `dtype` (the first one's when
        None) whose memory is a scratch file, not RAM. Each file a swapped one lives in is
        read once, through one pool buffer."""
        dtype = dtype or (tensors[0].dtype if tensors else torch.float32)
        out = self.store.scratch_tensor(sum(t.numel() for t in tensors), dtype)
        where = self._locations()
        reads: dict = {}  # (group index, kind) -> (group, kind, [(start in out, index in group, numel)])
        at = 0
        for tensor in tensors:
            n, place = tensor.numel(), where.get(id(tensor))
            if place is not None and self.holds(tensor):
                group, kind, i = place
                reads.setdefault((group.index, kind), (group, kind, []))[2].append((at, i, n))
            else:
                out[at : at + n].copy_(tensor.detach().reshape(-1))
            at += n
        for key in sorted(reads):
            group, kind, places = reads[key]
            index, buffer = self.pool.acquire(group.nbytes[kind])
            try:
                self.store.read(group.key(kind), buffer[: io_size(group.nbytes[kind])])
                typed = self.kinds[kind]
                for start, i, n in places:
                    offset = group.offsets[kind][i]
                    out[start : start + n].copy_(buffer[offset : offset + n * typed.itemsize].view(typed))
            finally:
                self.pool.release(index)
        return out

    def copy_state(self, state: dict) -> dict:
        """`state` (an optimizer `state_dict()`'s, naming this optimizer's state tensors) with
        every tensor copied: the swapped ones into one scratch-file-backed flat per dtype
        (`flatten`), the others cloned, so the copy neither changes with later steps nor
        needs the state's memory."""
        swapped: dict = {}  # dtype -> [(key, name, tensor)]
        out = {key: dict(per) for key, per in state.items()}
        for key, per in out.items():
            for name, value in per.items():
                if not torch.is_tensor(value):
                    continue
                if self.holds(value):
                    swapped.setdefault(value.dtype, []).append((key, name, value))
                else:
                    per[name] = value.clone()
        for dtype, entries in swapped.items():
            flat, at = self.flatten([value for _, _, value in entries], dtype), 0
            for key, name, value in entries:
                out[key][name] = flat[at : at + value.numel()].view(value.shape)
                at += value.numel()
        return out

    def stage(self, master: nn.Parameter, values: torch.Tensor, state: Optional[dict]) -> None:
        """Loading: `values` become `master`'s, and every swapped kind in `state` (the master's
        new optimizer state, to be placed in `optimizer.state`) its state's, in their files;
        those entries of `state` are replaced by swapped-out tensors. A group's files are
        written once every master in it is staged, the rest at `finish_staged()`."""
        group = self._group_of(master)
        staged = {_MASTER: values}
        for kind in self.kinds:
            value = None if state is None else state.get(kind)
            if kind != _MASTER and torch.is_tensor(value) and value.numel() == master.numel():
                staged[kind] = value
                state[kind] = _swapped_out(self._sentinels[self.kinds[kind]], master.shape)
        pending = self._staged.setdefault(group.index, {})
        pending[id(master)] = staged
        if len(pending) == len(group.masters):
            self._write_staged(group)

    def finish_staged(self) -> None:
        for index in sorted(self._staged):
            self._write_staged(self.groups[index])

    def _group_of(self, master: nn.Parameter) -> _Group:
        if self._group_index is None:
            self._group_index = {id(m): g for g in self.groups for m in g.masters}
        return self._group_index[id(master)]

    @torch.no_grad()
    def _write_staged(self, group: _Group) -> None:
        staged = self._staged.pop(group.index)
        self._issue_read(group, async_op=False)  # what is not staged keeps its file's values
        try:
            for kind in self.kinds:
                for master, view in zip(group.masters, self._views(group, kind)):
                    value = staged.get(id(master), {}).get(kind)
                    if value is not None:
                        view.copy_(value.reshape(view.shape))
                        group.written.add(kind)
            for kind in group.written:
                _, buffer = group.buffers[kind]
                self.store.write(group.key(kind), buffer[: io_size(group.nbytes[kind])])
        finally:
            self._give_back(group)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every master and state tensor in ordinary host memory for the block, written back
        to its file at the end (a checkpoint save or load; see [Note: a swapped-out tensor])."""
        if self._resident_depth:
            self._resident_depth += 1
            try:
                yield
            finally:
                self._resident_depth -= 1
            return
        for group in self.groups:
            self._issue_read(group, plain=True, async_op=False)
            self._attach(group)
        self._resident_depth = 1
        try:
            yield
        finally:
            self._resident_depth = 0
            for group in self.groups:
                self._detach_and_write(group, async_op=False)
                group.buffers = {}


def step_only(optimizer: torch.optim.Optimizer, masters: list) -> None:
    """`optimizer.step()` over `masters` alone: its param groups narrowed around the call."""
    chosen = {id(m) for m in masters}
    kept = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in chosen]
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, kept):
            group["params"] = params


def agree_on_step(error: Optional[Exception]) -> None:
    """One small all-reduce per step: an I/O error on one rank (EIO, a volume that could not
    honour its reservation) raises on every rank, instead of leaving the others waiting in the
    step's next collective. `error`: this rank's, from the optimizer's swapper or a parameter
    swapper's kept write error (param_swap.py's [Note: a failed write]); every rank calls it
    once per step whenever anything swaps to NVMe."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        from deepspeed.accelerator import get_accelerator

        flag = torch.tensor([0.0 if error is None else 1.0], device=get_accelerator().current_device_name())
        dist.all_reduce(flag)
        failed = int(flag.item())
    else:
        failed = 0 if error is None else 1
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"NVMe swapping failed in this step on {failed} other rank(s) (their error says why); this rank's "
            "own step finished, but the ranks' parameters may now differ: load the last checkpoint"
        )


def agree_on_setup(what: str, build: Callable[[], Any], group: Any = None) -> Any:
    """`build()` on every rank; when it raised on any, raise on all, naming each failed rank's
    error, so a full disk on one rank is an error everywhere instead of a hang in the next
    collective the others enter."""
    result, error = None, None
    try:
        result = build()
    except Exception as err:  # shared with the other ranks below, then re-raised
        error = err
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages = [message]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        messages = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return result
    if result is not None and hasattr(result, "close"):
        result.close()  # built here, but another rank failed: its scratch goes too
    if error is not None:
        raise error  # this rank's own error (the others name it)
    lines = "; ".join(f"rank {rank}: {m}" for rank, m in failed)
    raise RuntimeError(f"{what} failed on {len(failed)} of {len(messages)} rank(s): {lines}") from error
