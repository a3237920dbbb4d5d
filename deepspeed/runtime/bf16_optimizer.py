"""Upstream's name for its bf16 wrapper; see `UnbuiltMixedPrecisionWrapper` for why it is a name only."""

from deepspeed.runtime.base_optimizer import UnbuiltMixedPrecisionWrapper

__all__ = ["BF16_Optimizer"]


class BF16_Optimizer(UnbuiltMixedPrecisionWrapper):  # noqa: N801 - upstream's name
    """bf16 master weights at stage 0 upstream; here the ZeRO optimizer does that at every stage."""
