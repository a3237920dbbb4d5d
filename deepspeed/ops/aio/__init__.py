"""`deepspeed.ops.aio`: where upstream users import `AsyncIOBuilder` from (see op_builder/async_io.py)."""

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
