"""`deepspeed.ops.aio`: asynchronous tensor file I/O (the `async_io` op; see docs/nvme.md).

`AsyncIOBuilder().load()` compiles the op on first use (cached in $TORCH_EXTENSIONS_DIR) and
returns the module holding `aio_handle` and `AsyncIOError`.
"""

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
