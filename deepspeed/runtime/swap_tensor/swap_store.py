"""Scratch files on NVMe holding tensors, for ZeRO-Infinity's parameter and optimizer swapping.

`SwapStore` is the one place that touches swap files: it owns a private folder under
`nvme_path`, reserves each tensor's file up front with `posix_fallocate` (so a full disk is an
error at set-up naming the path and the bytes, never a failure half-way through a step), and
moves bytes through two `deepspeed.ops.aio` handles, one for reads and one for writes, so a
read of the next group can run while the previous one is written back. `PinnedBufferPool` is a
bounded set of page-aligned host buffers the I/O goes through (`O_DIRECT` needs the
alignment), so staging memory is fixed by `buffer_count` x `buffer_size` whatever the model.

Swap files are scratch: they are never part of a checkpoint, and the folder is removed when the
store is closed or the process exits normally. A folder left by a killed process is named
after its host and pid; `SwapStore` removes such folders of dead processes on this host when
it starts, and never touches a live one.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import socket
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from deepspeed.runtime.config_utils import DeepSpeedConfigError

__all__ = ["AioSettings", "PinnedBufferPool", "SwapSpaceError", "SwapStore", "io_size"]

# Direct I/O needs the buffer, the byte count and the file offset on this boundary; files are
# reserved in multiples of it so every whole-file transfer of a pool buffer can go direct.
_ALIGN = 4096
_SWAP_DIR = "zero_swap"


class SwapSpaceError(OSError):
    """The disk under `nvme_path` lacks room for the swap files (or a write ran out of it)."""


@dataclass(frozen=True)
class AioSettings:
    """The `aio` config block, as the handles take it (upstream's keys and defaults)."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    @classmethod
    def from_block(cls, block: Optional[dict]) -> AioSettings:
        """The settings of the config's `aio` block; a value of the wrong type, or below 1,
        raises `DeepSpeedConfigError` naming its key (the config checked the key names)."""
        block = dict(block or {})
        for key, value in block.items():
            if key in ("single_submit", "overlap_events", "use_gds"):
                if not isinstance(value, bool):
                    raise DeepSpeedConfigError(f"aio.{key}={value!r} must be true or false")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DeepSpeedConfigError(f"aio.{key}={value!r} must be a whole number >= 1")
        # `intra_op_parallelism` is upstream's name since 0.15; `thread_count`, the older one,
        # counts where it is the only one.
        threads = block.pop("intra_op_parallelism", None)
        older = block.pop("thread_count", None)
        if threads is not None and older is not None and threads != older:
            raise DeepSpeedConfigError(
                f"aio.intra_op_parallelism={threads} and aio.thread_count={older} set the same thing "
                "(thread_count is its older name); keep intra_op_parallelism only"
            )
        block.pop("use_gds", None)  # refused by the config when true; False changes nothing
        return cls(thread_count=threads or older or 1, **block)

    def handle(self):
        from deepspeed.ops.aio import AsyncIOBuilder

        aio = AsyncIOBuilder().load()
        return aio.aio_handle(
            self.block_size, self.queue_depth, self.single_submit, self.overlap_events, self.thread_count
        )


def _round_up(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def io_size(nbytes: int) -> int:
    """`nbytes` rounded up to the direct-I/O block: what a key's file holds, and the length a
    transfer of a whole pool buffer may use so that it can go `O_DIRECT`."""
    return _round_up(nbytes)


def _remove_dead_folders(root: Path) -> None:
    """Remove swap folders this host's killed processes left behind (named host-pid-token)."""
    host = socket.gethostname()
    for folder in root.glob(f"{host}-*-*"):
        try:
            pid = int(folder.name[len(host) + 1 :].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


class SwapStore:
    """Tensors by key in preallocated files under ``<nvme_path>/zero_swap/<host>-<pid>-<token>/<name>``.

    `reserve(key, nbytes)` creates a key's file at its full (4096-rounded) size; `write` /
    `read` move a contiguous CPU tensor of at most that size, synchronously or queued
    (`async_op=True`) until `wait_writes()` / `wait_reads()`. A write must not be changed and
    a read's buffer not used before the matching wait.
    """

    def __init__(self, nvme_path, name: str, aio: AioSettings = AioSettings()):
        root = Path(nvme_path)
        if not root.is_dir():
            raise FileNotFoundError(
                f"nvme_path {str(root)!r} is not an existing directory; create it or point "
                "nvme_path at a folder on the drive to swap to"
            )
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(f"nvme_path {str(root)!r} is not writable by this process")
        try:
            (root / _SWAP_DIR).mkdir(exist_ok=True)
        except OSError as exc:  # writable by mode, refused anyway (/sys, a read-only mount)
            raise type(exc)(
                exc.errno,
                f"nvme_path {str(root)!r}: cannot create the swap folder {_SWAP_DIR!r} in it "
                f"({exc.strerror}); point nvme_path at a folder on the drive to swap to",
            ) from exc
        _remove_dead_folders(root / _SWAP_DIR)
        self.folder = root / _SWAP_DIR / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}" / name
        self.folder.mkdir(parents=True)
        self._reads = aio.handle()
        self._writes = aio.handle()
        self._capacity: dict[str, int] = {}
        self._pending_reads = 0
        self._pending_writes = 0
        # Remove the folder at close() or, failing that, when the interpreter exits.
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder.parent, True)
        atexit.register(self._finalizer)

    # ---- files --------------------------------------------------------------------------
    def path(self, key: str) -> str:
        return str(self.folder / f"{key}.swp")

    def reserve(self, key: str, nbytes: int) -> None:
        """Create `key`'s file with room for `nbytes`; raise SwapSpaceError if the disk lacks it."""
        if key in self._capacity:
            raise KeyError(f"swap key {key!r} is already reserved in {self.folder}")
        size = _round_up(max(nbytes, 1))
        free = shutil.disk_usage(self.folder).free
        if size > free:
            raise self._space_error(size, free)
        fd = os.open(self.path(key), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._space_error(size, shutil.disk_usage(self.folder).free) from e
            if e.errno == errno.EFBIG:  # RLIMIT_FSIZE (`ulimit -f`), or the file system's own cap
                raise SwapSpaceError(
                    errno.EFBIG,
                    f"NVMe swap file {self.path(key)!r} needs {size} bytes, more than this process may "
                    "write to one file (ulimit -f, or the file system's largest file); raise the limit",
                ) from e
            raise
        finally:
            os.close(fd)
        self._capacity[key] = size

    def capacity(self, key: str) -> int:
        """Bytes reserved for `key` (a multiple of 4096), 0 when it has no file."""
        return self._capacity.get(key, 0)

    def release(self, key: str) -> None:
        """Remove `key`'s file (its tensor changed size); wait for any I/O on it first."""
        if self._capacity.pop(key, None) is not None:
            os.remove(self.path(key))

    def reserve_many(self, sizes: dict) -> None:
        """`reserve` each `key: nbytes`, after checking the disk has room for all of them, so a
        full disk is named with the whole amount before any file is made."""
        total = sum(_round_up(max(n, 1)) for n in sizes.values())
        free = shutil.disk_usage(self.folder).free
        if total > free:
            raise self._space_error(total, free)
        for key, nbytes in sizes.items():
            self.reserve(key, nbytes)

    def scratch_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor whose memory is a file here rather than RAM (its pages are page cache:
        written out and dropped under memory pressure), for copies larger than memory, such as
        a checkpoint's flat optimizer state. The file is reserved whole first, so a full disk
        is a SwapSpaceError naming the bytes, never a SIGBUS on a page that had no room, and it
        is unlinked at once: nothing is left behind, however the process ends."""
        nbytes = max(numel * dtype.itemsize, 1)
        fd, path = tempfile.mkstemp(prefix="scratch-", suffix=".swp", dir=self.folder)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG):
                    raise self._space_error(nbytes, shutil.disk_usage(self.folder).free) from e
                raise
            return torch.from_file(path, shared=True, size=numel, dtype=dtype)
        finally:
            os.close(fd)
            os.remove(path)

    def reserved_bytes(self) -> int:
        return sum(self._capacity.values())

    def _space_error(self, needed: int, free: int) -> SwapSpaceError:
        return SwapSpaceError(
            errno.ENOSPC,
            f"NVMe swap needs {needed} more bytes under {str(self.folder)!r} but the disk has {free} "
            f"free (this store holds {self.reserved_bytes()} bytes already); free space there or "
            "point nvme_path at a larger drive",
        )

    def _check(self, key: str, tensor: torch.Tensor) -> None:
        if key not in self._capacity:
            raise KeyError(f"swap key {key!r} was never reserved in {self.folder}; call reserve() first")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self._capacity[key]:
            raise ValueError(f"{nbytes} bytes do not fit swap key {key!r} ({self._capacity[key]} reserved)")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                "swap I/O needs a contiguous CPU tensor (stage through a PinnedBufferPool buffer)"
            )

    # ---- transfers ----------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, async_op: bool = False) -> None:
        self._check(key, tensor)
        if async_op:
            self._writes.async_pwrite(tensor, self.path(key))
            self._pending_writes += 1
        else:
            self._guard_space(lambda: self._writes.sync_pwrite(tensor, self.path(key)))

    def read(self, key: str, tensor: torch.Tensor, async_op: bool = False) -> None:
        self._check(key, tensor)
        if async_op:
            self._reads.async_pread(tensor, self.path(key))
            self._pending_reads += 1
        else:
            self._reads.sync_pread(tensor, self.path(key))

    def wait_writes(self) -> int:
        done, self._pending_writes = self._pending_writes, 0
        if done:
            self._guard_space(self._writes.wait)
        return done

    def wait_reads(self) -> int:
        done, self._pending_reads = self._pending_reads, 0
        if done:
            self._reads.wait()
        return done

    def _guard_space(self, call) -> None:
        # Files are preallocated, so ENOSPC here means the file system could not honour that
        # (a thin-provisioned or copy-on-write volume); say so with the path rather than errno.
        try:
            call()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._space_error(0, shutil.disk_usage(self.folder).free) from e
            raise

    def close(self) -> None:
        """Wait for queued I/O, then remove this store's folder (its files are scratch)."""
        try:
            self.wait_reads()
            self.wait_writes()
        finally:
            self._finalizer()
            atexit.unregister(self._finalizer)


class PinnedBufferPool:
    """`count` page-aligned host buffers of `nbytes` each, handed out and given back by index.

    The buffers are the aio handle's locked tensors, so whole-buffer transfers can use
    O_DIRECT. `acquire()` raises when every buffer is out: the caller must `release()` one
    (after the I/O through it is waited for) rather than block, since nothing else runs.
    """

    def __init__(self, count: int, nbytes: int, aio: AioSettings = AioSettings()):
        if count < 1 or nbytes < 1:
            raise ValueError(
                f"a buffer pool needs buffer_count >= 1 and buffer_size >= 1, got {count} x {nbytes}"
            )
        handle = aio.handle()
        size = _round_up(nbytes)
        self.nbytes = size
        self._buffers = [
            handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8)) for _ in range(count)
        ]
        self._free = list(range(count - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(index, whole buffer) of a free buffer that holds `nbytes`; view it with `as_tensor`."""
        if nbytes > self.nbytes:
            raise ValueError(
                f"a tensor of {nbytes} bytes does not fit one swap buffer of {self.nbytes} bytes; raise buffer_size"
            )
        if not self._free:
            raise RuntimeError(
                f"all {len(self._buffers)} swap buffers are in use; raise buffer_count or release one first"
            )
        index = self._free.pop()
        return index, self._buffers[index]

    def buffer(self, index: int) -> torch.Tensor:
        """The whole buffer `index` (out of the pool), as `acquire` handed it out."""
        return self._buffers[index]

    def release(self, index: int) -> None:
        if index in self._free or not 0 <= index < len(self._buffers):
            raise ValueError(f"swap buffer {index} is not out of the pool")
        self._free.append(index)

    @staticmethod
    def as_tensor(buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `numel` elements of `buffer` seen as `dtype` (shares its memory)."""
        typed = buffer.view(dtype)  # buffers are 4096-byte multiples: every dtype divides them
        if numel > typed.numel():
            raise ValueError(
                f"{numel} elements of {dtype} do not fit a swap buffer of {buffer.numel()} bytes"
            )
        return typed[:numel]
