"""Builder for the `async_io` op (`csrc/aio/`): asynchronous reads and writes of CPU tensors.

`AsyncIOBuilder().load().aio_handle(block_size, queue_depth, single_submit, overlap_events,
thread_count, backend=None)` gives a handle with `async_pread` / `async_pwrite` /
`sync_pread` / `sync_pwrite` / `wait` (see docs/nvme.md). Two backends, one chunking: an
io_uring ring per lane on the raw system calls (no liburing), or a pool of worker threads
issuing pread/pwrite; O_DIRECT when the buffer, size and offset are 4096-byte aligned. The
backend is `backend=`, else $DS_AIO_BACKEND, else "auto": io_uring when a ring can be set up
here, the thread pool otherwise (with one warning naming the reason). `backend_note()` says
which, and why; `ds_report` prints it.
"""

from __future__ import annotations

import ctypes
import errno
import os

from deepspeed.ops.op_builder.builder import OpBuilder

BACKEND_ENV = "DS_AIO_BACKEND"
BACKENDS = ("auto", "io_uring", "thread_pool")
_IO_URING_SETUP = 425  # the same number on every architecture (Linux 5.1)
_IO_URING_PARAMS_BYTES = 120  # sizeof(struct io_uring_params)


def probe_io_uring() -> str:
    """Why io_uring_setup fails in this process ("" when it succeeds), without building the op.

    ds_report's view before the op is built; once it is, the op's own probe (which also
    round-trips a no-op request) is the one that decides."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as exc:
        return f"cannot reach the C library to probe: {exc}"
    params = ctypes.create_string_buffer(_IO_URING_PARAMS_BYTES)
    fd = libc.syscall(ctypes.c_long(_IO_URING_SETUP), ctypes.c_uint(2), params)
    if fd < 0:
        code = ctypes.get_errno()
        return f"io_uring_setup failed: {os.strerror(code)} ({errno.errorcode.get(code, code)})"
    os.close(fd)
    return ""


class AsyncIOBuilder(OpBuilder):
    """The `async_io` op: the `aio_handle` class and the `AsyncIOError` exception."""

    NAME = "async_io"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.aio.{self.NAME}_op"

    def sources(self) -> list[str]:
        return ["aio/aio_engine.cpp", "aio/aio_uring.cpp", "aio/py_aio.cpp"]

    def headers(self) -> list[str]:
        return ["aio/aio_engine.h", "aio/aio_uring.h"]

    def cxx_args(self) -> list[str]:
        return ["-O2", "-pthread"]  # I/O bound: no vector or fp flags needed

    def extra_ldflags(self) -> list[str]:
        return ["-pthread"]

    def _io_uring_reason(self) -> tuple[str, str]:
        """Why io_uring is not usable here ("" when it is), and which probe said so."""
        if self.is_built():  # loading a built op is cheap; its probe is the one handles use
            return self.load().io_uring_unavailable_reason, "the op's probe"
        return probe_io_uring(), "probed from Python; the op is not built yet"

    def backend_note(self) -> str:
        """Which backend a handle with no `backend=` gets here, and why (one line for ds_report)."""
        forced = os.environ.get(BACKEND_ENV) or "auto"
        if forced not in BACKENDS:
            return f"{forced}: invalid (choose from {', '.join(BACKENDS)}) in {BACKEND_ENV}={forced}"
        if forced == "thread_pool":
            return f"thread_pool: set by {BACKEND_ENV}=thread_pool"
        reason, source = self._io_uring_reason()
        if forced == "io_uring":
            if reason:
                return f"io_uring: set by {BACKEND_ENV}=io_uring, but not usable here ({reason}; {source}): handles raise"
            return f"io_uring: set by {BACKEND_ENV}=io_uring ({source}: a ring sets up here)"
        if not reason:
            return (
                f"io_uring: a ring sets up here ({source}); {BACKEND_ENV}=thread_pool forces the thread pool"
            )
        return f"thread_pool: io_uring is not usable ({reason}; {source})"
