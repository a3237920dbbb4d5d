"""Builder for the `async_io` op (`csrc/aio/`): asynchronous reads and writes of CPU tensors.

`AsyncIOBuilder().load().aio_handle(block_size, queue_depth, single_submit, overlap_events,
thread_count)` gives a handle with `async_pread` / `async_pwrite` / `sync_pread` /
`sync_pwrite` / `wait` (see docs/nvme.md). The backend is a pool of `thread_count` worker
threads issuing pread/pwrite in `block_size` chunks, with O_DIRECT when the buffer, size and
offset are 4096-byte aligned. No io_uring or libaio backend is built yet; `backend_note()`
says so, and `ds_report` prints it.
"""

from deepspeed.ops.op_builder.builder import OpBuilder

BACKEND = "thread_pool"


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

    def backend_note(self) -> str:
        """Which backend a build uses here, and why (one line for ds_report)."""
        return (
            f"{BACKEND}: worker threads doing pread/pwrite in block_size chunks, O_DIRECT when "
            "4096-byte aligned (no io_uring/libaio backend is built in this package)"
        )
