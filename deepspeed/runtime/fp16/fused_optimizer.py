"""Upstream's name for its fp16 wrapper; see `UnbuiltMixedPrecisionWrapper` for why it is a name only."""

from deepspeed.runtime.base_optimizer import UnbuiltMixedPrecisionWrapper

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer(UnbuiltMixedPrecisionWrapper):  # noqa: N801 - upstream's name
    """fp16 loss scaling over flat fp32 masters at stage 0 upstream; here the ZeRO optimizer does it."""
