"""The `async_io` op (NVMe reads and writes for ZeRO-Infinity): not built in this package.

Upstream's tests and tools ask `AsyncIOBuilder().is_compatible()` (or
`deepspeed.ops.__compatible_ops__["async_io"]`) before they try NVMe offload, and skip when
it is False; here it always is, with the reason, and `load()` raises naming the feature.
"""

from deepspeed.ops.op_builder.builder import OpBuilder

NVME_NOT_BUILT = (
    "NVMe offload (async_io, offload_param/offload_optimizer device 'nvme') is not built in this "
    "package; offload to 'cpu' instead"
)


class AsyncIOBuilder(OpBuilder):
    """The `async_io` op; it has no sources here, so it is never compatible."""

    NAME = "async_io"

    def sources(self) -> list[str]:
        return []

    def incompatibility_reasons(self) -> list[str]:
        return [NVME_NOT_BUILT]
