"""NVMe parameter swapping (ZeRO-Infinity, stage 3): each partition lives in a file when not in use.

[Note: a swapped shard]
A parameter whose partition swaps has a `SwappedParamState`, whose `shard` (and `shard_base`)
is a property: it returns the partition resident in host memory, reading it from its file
first when it was swapped out. Every reader and writer of shards (the gather, the optimizer,
checkpoints, `GatheredParameters`' write-back, `safe_set_*`) goes through that property, so
none of them needs to know about NVMe and none can see a partition that is not there. Only
partitions swap: a gathered parameter is what it would be without NVMe.

What stays resident is capped by `max_in_cpu` elements, least recently used out first. An
evicted partition is written to its file only if it changed since it was read or written:
its tensor's version counter (bumped by every in-place op on it or a view of it) tells.
A write through `.data` bumps no counter, so code outside this package must write a shard
with an in-place op on the tensor itself (`param.ds_tensor.copy_(x)`), as ours does.

Every transfer goes through a `PinnedBufferPool` of `buffer_count` aligned buffers, each
sized to the largest partition (at most `buffer_size` elements): reads land in a buffer and
are copied out into the partition's own tensor, writes are copied into a buffer and written
from there, so the files are read and written whole, 4096-aligned (O_DIRECT where the file
system has it). The prefetcher calls `read_ahead` with the fetch trace: reads of partitions
the next modules use are issued into free buffers while the current module computes; the
gather that needs one waits for the reads in flight (`resident_tensor`). At most one write
per file is in flight, and a read of a file waits for its write.

Files are scratch (swap_store.py): set-up reserves each partition's file, so a full disk is
a `SwapSpaceError` naming the path and the bytes while the model is built, and
`check_setup` makes every rank raise it (the others naming the failing rank), never a hang.

[Note: a failed write]
Writing an evicted partition can fail mid-step (EIO). Raising there would raise on this rank
only, inside a forward or backward whose next collective the other ranks already wait in.
So the error is kept (`io_error`) and the partition stays in memory: a write that could not
be issued leaves it resident, one that failed when waited for is copied back from its staging
buffer, and after the first failure nothing more is evicted. The ZeRO optimizer's step hands
the error (`take_io_error`) to its one flag all-reduce per step (nvme_optimizer's
`agree_on_step`, shared with the optimizer's swapper), which raises it on this rank and an
error naming the count on the others. No value was lost, so the step itself ran everywhere.
"""

from __future__ import annotations

import collections
import errno
from typing import Any, Optional

import torch

from deepspeed import comm as dist
from deepspeed.runtime.swap_tensor.swap_store import AioSettings, PinnedBufferPool, SwapSpaceError, SwapStore
from deepspeed.runtime.zero.lifecycle import ZeroParamState

__all__ = ["ParamSwapper", "SwapSetup", "SwappedParamState", "check_setup", "read_ahead", "retype_targets"]


class SwappedParamState(ZeroParamState):
    """A `ZeroParamState` whose partition swaps to NVMe ([Note: a swapped shard])."""

    swapper: ParamSwapper
    resident: Optional[torch.Tensor]  # the partition in host memory, or None while swapped out
    clean_version: Optional[int]  # `resident._version` when it last equalled the file; None: never
    swap_dtype: torch.dtype  # the partition's dtype, known while it is swapped out

    @property
    def shard(self) -> torch.Tensor:
        return self.swapper.resident_tensor(self)

    @property
    def shard_base(self) -> torch.Tensor:
        return self.swapper.resident_tensor(self)  # an own tensor: no flat buffer to share

    @property
    def shard_dtype(self) -> torch.dtype:
        return self.swap_dtype  # known without reading a swapped-out partition in

    def _set_shard(self, shard: torch.Tensor) -> None:
        self.shard_offset = 0
        self.swapper.install(self, shard)


def _key(state: ZeroParamState) -> str:
    return f"param_{state.ds_id}"


class ParamSwapper:
    """The files, the staging pool and the resident set of one Init's swapped partitions."""

    def __init__(
        self, nvme_path, buffer_count: int, buffer_size: int, max_in_cpu: int, aio: AioSettings
    ) -> None:
        if buffer_count < 1 or buffer_size < 1:
            raise ValueError(
                f"zero_optimization.offload_param: buffer_count={buffer_count} and buffer_size={buffer_size} "
                "must both be >= 1 with device 'nvme'"
            )
        self.buffer_count, self.buffer_size, self.max_in_cpu, self.aio = (
            buffer_count,
            buffer_size,
            max_in_cpu,
            aio,
        )
        self.failure: Optional[OSError] = None  # a set-up error, raised on every rank by check_setup
        # A write that failed after set-up (EIO mid-step): kept until the step's agreement
        # (`take_io_error`) raises it on every rank ([Note: a failed write]).
        self.io_error: Optional[OSError] = None
        self.store: Optional[SwapStore] = None
        try:
            self.store = SwapStore(nvme_path, "params", aio)
        except OSError as e:  # a folder missing on one node only must not hang the others
            self.failure = e
        self.pool: Optional[PinnedBufferPool] = None  # made at the first transfer, grown as needed
        self.resident: collections.OrderedDict = collections.OrderedDict()  # ds_id -> state, LRU first
        self.resident_elems = 0
        self.reading: dict = {}  # ds_id -> (state, buffer index): reads in flight
        self.writing: dict = {}  # ds_id -> (state, buffer index): writes in flight
        self.stats = (
            collections.Counter()
        )  # reads, writes, read_ahead, bytes_read/_written, peak_resident_elems

    # ---- set-up -------------------------------------------------------------------------
    def adopt(self, state: ZeroParamState) -> None:
        """Make `state`'s partition swap: its class changes, its file is reserved."""
        assert state.stored is None, "a partition stored as int8 codes is never swapped (quantized.attach)"
        shard = state.__dict__.pop("_shard")
        state.__dict__.pop("shard_base", None)
        state.__class__ = SwappedParamState
        state.swapper, state.resident, state.clean_version = self, None, None
        state._set_shard(shard)

    def install(self, state: SwappedParamState, tensor: torch.Tensor) -> None:
        """Make `tensor` (1D, `partition_size`) the partition, unwritten; reserve a file that holds it."""
        if state.partition_size > self.buffer_size:
            raise ValueError(
                f"zero_optimization.offload_param.buffer_size={self.buffer_size} elements cannot stage a partition "
                f"of {state.partition_size} elements (parameter of shape {tuple(state.shape)}); set buffer_size to "
                f"at least {state.partition_size}"
            )
        if tensor._base is not None or tensor.device.type != "cpu":
            tensor = tensor.to("cpu", copy=True)  # a view would keep its whole flat buffer alive
        self._forget(state)
        nbytes = state.partition_size * tensor.element_size()
        if self.failure is None and self.store.capacity(_key(state)) < nbytes:
            try:
                self.store.release(_key(state))
                self.store.reserve(_key(state), nbytes)
            except OSError as e:  # kept resident; check_setup raises it on every rank
                self.failure = e
        state.resident, state.clean_version, state.swap_dtype = tensor, None, tensor.dtype
        self._add_resident(state)
        self._enforce_cap(keep=state)

    def disk_bytes(self) -> int:
        return self.store.reserved_bytes() if self.store is not None else 0

    def host_bytes(self) -> int:
        """Bytes of partitions resident now plus the staging pool."""
        pool = self.pool.nbytes * self.buffer_count if self.pool is not None else 0
        return pool + sum(s.resident.numel() * s.resident.element_size() for s in self.resident.values())

    # ---- residency ------------------------------------------------------------------------
    def resident_tensor(self, state: SwappedParamState) -> torch.Tensor:
        """`state`'s partition in host memory, read from its file first if it was swapped out."""
        tensor = state.resident
        if tensor is not None:
            self.resident.move_to_end(state.ds_id)
            return tensor
        if state.ds_id in self.reading:
            self.finish_reads()  # its read was issued ahead; the gather waits for it here
        else:
            self._read_now(state)
        tensor = state.resident
        self._enforce_cap(keep=state)
        return tensor

    def overwrite(self, state: SwappedParamState, values: torch.Tensor) -> None:
        """Set the partition to `values` (cast) without reading the old one (the step's write-back)."""
        if state.resident is not None:
            state.resident.copy_(values)
            self.resident.move_to_end(state.ds_id)
            return
        if state.ds_id in self.reading:
            self.finish_reads()
            state.resident.copy_(values)
            return
        tensor = torch.empty(state.partition_size, dtype=state.swap_dtype)
        tensor.copy_(values)
        state.resident, state.clean_version = tensor, None
        self._add_resident(state)
        self._enforce_cap(keep=state)

    def _add_resident(self, state: SwappedParamState) -> None:
        self.resident[state.ds_id] = state
        self.resident_elems += state.partition_size
        if self.resident_elems > self.stats["peak_resident_elems"]:  # the cap is enforced just after
            self.stats["peak_resident_elems"] = self.resident_elems

    def _forget(self, state: SwappedParamState) -> None:
        """Drop whatever `state` has in memory or in flight (it is being replaced)."""
        if state.ds_id in self.reading:
            self.finish_reads()
        if state.ds_id in self.writing:
            self.finish_writes()  # its file may be replaced (a larger dtype) before the write lands
        if self.resident.pop(state.ds_id, None) is not None:
            self.resident_elems -= state.partition_size
        state.resident = None

    def _enforce_cap(self, keep: SwappedParamState) -> None:
        if self.failure is not None:
            return  # set-up failed: nothing can be written; check_setup will raise
        while self.resident_elems > self.max_in_cpu and self.io_error is None:
            victim = next((s for s in self.resident.values() if s is not keep), None)
            if victim is None:
                return
            self._evict(victim)

    def _evict(self, state: SwappedParamState) -> None:
        tensor = state.resident
        if state.clean_version != tensor._version and not self._write(state, tensor):
            return  # its file does not hold it: it stays resident ([Note: a failed write])
        self.resident.pop(state.ds_id)
        self.resident_elems -= state.partition_size
        state.resident = None

    # ---- transfers ------------------------------------------------------------------------
    def _acquire(self, state: SwappedParamState) -> tuple:
        nbytes = self.store.capacity(_key(state))
        if self.pool is None or self.pool.nbytes < nbytes:
            self._grow_pool(nbytes, state.swap_dtype.itemsize)
        if self.pool.free == 0:
            self.finish_writes()
        if self.pool.free == 0:
            self.finish_reads()
        return self.pool.acquire(nbytes)

    def _grow_pool(self, nbytes: int, itemsize: int) -> None:
        # Buffers fit the largest partition seen, doubling up to buffer_size elements, so a
        # small model does not lock buffer_count x buffer_size bytes it never needs.
        self.finish_writes()
        self.finish_reads()
        old = self.pool.nbytes if self.pool is not None else 0
        self.pool = None  # its locked buffers go before the new ones are made
        self.pool = PinnedBufferPool(
            self.buffer_count, max(nbytes, min(2 * old, self.buffer_size * itemsize)), self.aio
        )

    def _read_now(self, state: SwappedParamState) -> None:
        key = _key(state)
        if state.ds_id in self.writing:
            self.finish_writes()  # the file must hold the last write before it is read
            if state.resident is not None:
                return  # the write failed: taken back from its buffer ([Note: a failed write])
        index, buf = self._acquire(state)
        try:
            self.store.read(key, buf[: self.store.capacity(key)])
            self._take_read(state, buf)
        finally:
            self.pool.release(index)

    def _take_read(self, state: SwappedParamState, buf: torch.Tensor) -> None:
        tensor = torch.empty(state.partition_size, dtype=state.swap_dtype)
        tensor.copy_(PinnedBufferPool.as_tensor(buf, state.partition_size, state.swap_dtype))
        state.resident, state.clean_version = tensor, tensor._version
        self._add_resident(state)
        self.stats["reads"] += 1
        self.stats["bytes_read"] += tensor.numel() * tensor.element_size()

    def _write(self, state: SwappedParamState, tensor: torch.Tensor) -> bool:
        """Issue `state`'s write; False (the error kept in `io_error`) when it could not be issued."""
        key = _key(state)
        if state.ds_id in self.writing:
            self.finish_writes()  # one write per file in flight: their order is not guaranteed
        index, buf = self._acquire(state)
        PinnedBufferPool.as_tensor(buf, state.partition_size, state.swap_dtype).copy_(tensor)
        try:
            self.store.write(key, buf[: self.store.capacity(key)], async_op=True)
        except OSError as e:
            self.pool.release(index)
            self.io_error = self.io_error or e
            return False
        self.writing[state.ds_id] = (state, index)
        self.stats["writes"] += 1
        self.stats["bytes_written"] += tensor.numel() * tensor.element_size()
        return True

    def finish_writes(self) -> None:
        if not self.writing:
            return
        try:
            self.store.wait_writes()
        except OSError as e:
            # [Note: a failed write] The files may not hold these partitions: take each back
            # into memory from its staging buffer, unwritten, so no value is lost.
            for state, index in self.writing.values():
                if state.resident is None:
                    self._restore(state, self.pool.buffer(index))
            self.io_error = self.io_error or e
        finally:
            for _, index in self.writing.values():
                self.pool.release(index)
            self.writing.clear()

    def _restore(self, state: SwappedParamState, buf: torch.Tensor) -> None:
        tensor = torch.empty(state.partition_size, dtype=state.swap_dtype)
        tensor.copy_(PinnedBufferPool.as_tensor(buf, state.partition_size, state.swap_dtype))
        state.resident, state.clean_version = tensor, None
        self._add_resident(state)

    def take_io_error(self) -> Optional[OSError]:
        """The write error kept since the last call (None if none), cleared: swapping goes on."""
        error, self.io_error = self.io_error, None
        return error

    def finish_reads(self) -> None:
        if not self.reading:
            return
        try:
            self.store.wait_reads()
            for state, index in self.reading.values():
                self._take_read(state, self.pool.buffer(index))
        finally:
            for _, index in self.reading.values():
                self.pool.release(index)
            self.reading.clear()

    def read_ahead(self, state: SwappedParamState) -> bool:
        """Issue `state`'s read into a free buffer if it is swapped out; False once none is free."""
        if state.resident is not None or state.ds_id in self.reading or state.ds_id in self.writing:
            return True
        if self.failure is not None or self.pool is None:
            return False
        if self.pool.free == 0 and self.writing:
            self.finish_writes()  # evictions' writes hold the buffers; reads ahead matter more
        if self.pool.free == 0:
            return False
        key = _key(state)
        if self.store.capacity(key) > self.pool.nbytes:
            return True
        index, buf = self.pool.acquire(self.store.capacity(key))
        self.store.read(key, buf[: self.store.capacity(key)], async_op=True)
        self.reading[state.ds_id] = (state, index)
        self.stats["read_ahead"] += 1
        return True

    def swap_out_all(self) -> None:
        """Write every changed resident partition to its file, wait, and free them all."""
        self.finish_reads()
        for state in list(self.resident.values()):
            self._evict(state)
        self.finish_writes()

    def close(self) -> None:
        self.finish_reads()
        self.finish_writes()
        if self.store is not None:
            self.store.close()


# ------------------------------------------------------------------ what Init and the engine call


def offload_from_config(zero: Any, pin_memory: bool) -> tuple:
    """`(remote_device, pin_memory)` from `zero_optimization.offload_param`, as upstream reads it:
    `pin_memory` keeps the argument's value unless the block sets it; "nvme" pins nothing (its
    staging buffers are the aio engine's locked ones)."""
    offload = zero.offload_param
    if offload is None or offload.device not in ("cpu", "nvme"):
        return None, pin_memory
    if offload.device == "nvme":
        return "nvme", False
    return "cpu", bool(offload.pin_memory) if "pin_memory" in offload.model_fields_set else pin_memory


class SwapSetup:
    """An Init's NVMe settings, checked when the Init is made; the `ParamSwapper` is made at first use."""

    def __init__(self, zero: Any, aio_block: Optional[dict]) -> None:
        offload = zero.offload_param if zero is not None else None
        if offload is None or offload.nvme_path is None:
            raise ValueError(
                "zero.Init: remote_device='nvme' needs zero_optimization.offload_param.nvme_path in the config "
                "(config_dict_or_path); set it to a folder on the drive to swap parameters to"
            )
        self.offload = offload
        self.aio = AioSettings.from_block(aio_block)
        self._swapper: Optional[ParamSwapper] = None

    @classmethod
    def of(cls, zero: Any, raw: Optional[dict], remote_device: Optional[str]) -> Optional[SwapSetup]:
        """The setup of an Init whose partitions go to NVMe (zero: its typed section), else None."""
        if zero is None or remote_device != "nvme":
            return None
        return cls(zero, (raw or {}).get("aio"))

    def check(self, group: Any) -> None:
        """Raise on every rank of `group` if this Init's swapping failed to set up on any."""
        check_setup([self.swapper()], group)

    def swapper(self) -> ParamSwapper:
        if self._swapper is None:
            o = self.offload
            self._swapper = ParamSwapper(o.nvme_path, o.buffer_count, o.buffer_size, o.max_in_cpu, self.aio)
        return self._swapper


def swappers_of(states: list) -> list:
    """The distinct swappers of `states`, in first-seen order."""
    found: dict = {}
    for s in states:
        if s.swapper is not None:
            found.setdefault(id(s.swapper), s.swapper)
    return list(found.values())


def check_setup(swappers: list, group: Any = None) -> None:
    """Raise on every rank of `group` if setting up swapping failed on any ([Note: a swapped shard]).

    The failing rank raises its own error; the others a `SwapSpaceError` naming that rank and
    its message. Every rank of `group` must call this, with or without swappers of its own.
    """
    failure = next((s.failure for s in swappers if s.failure is not None), None)
    world = dist.get_world_size(group)
    if world > 1:
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
        flags = torch.empty(world, dtype=torch.int64)
        dist.all_gather_into_tensor(flags, flag, group=group)
        if not bool(flags.any()):
            return
        messages: list = [None] * world
        mine = None if failure is None else (isinstance(failure, SwapSpaceError), str(failure))
        dist.all_gather_object(messages, mine, group=group)
    elif failure is None:
        return
    if failure is not None:
        raise failure
    rank, (no_space, message) = next((r, m) for r, m in enumerate(messages) if m is not None)
    text = f"NVMe parameter swapping failed to set up on rank {rank}: {message}"
    raise SwapSpaceError(errno.ENOSPC, text) if no_space else RuntimeError(text)


def read_ahead(trace: list, start: int) -> None:
    """Issue reads of the swapped-out partitions that `trace` fetches from entry `start` on,
    into free staging buffers, so they overlap the compute before their gather."""
    looked = 0
    for index in range(start, len(trace)):
        for s in trace[index]:
            swapper = s.swapper
            if swapper is None:
                continue
            looked += 1
            if looked > 4 * swapper.buffer_count or not swapper.read_ahead(s):
                return


def retype_targets(states: list, dtype: torch.dtype) -> list:
    """Zeroed `[partition_size]` tensors of `dtype` for the re-typed shards of `states` (one
    module's): adjacent views of one flat buffer (see gather.py), or own tensors when they swap."""
    sizes = [s.partition_size for s in states]
    if states[0].swapper is not None:
        return [torch.zeros(n, dtype=dtype) for n in sizes]
    flat = torch.zeros(sum(sizes), dtype=dtype, device=states[0].shard.device)
    if states[0].shard.is_pinned():
        flat = flat.pin_memory()
    return list(torch.split(flat, sizes))
