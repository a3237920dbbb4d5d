"""Names DeepSpeed's `deepspeed.runtime.zero.utils` gives callers to catch."""

from __future__ import annotations

from deepspeed.runtime.zero.parameter import is_zero_param  # noqa: F401 - upstream's import path


class ZeRORuntimeException(Exception):
    """A ZeRO setup that cannot run, by upstream's name (code that catches it keeps working)."""


class ZeROOffloadOptimizerError(ZeRORuntimeException, ValueError):
    """`offload_optimizer` with a client optimizer that does not step on the CPU.

    Both a `ZeRORuntimeException`, as upstream raises here, and a `ValueError`, as the
    misconfiguration it is.
    """
