"""Upstream's name for its per-tensor fp16 wrapper; see `UnbuiltMixedPrecisionWrapper` for why it is a name only."""

from deepspeed.runtime.base_optimizer import UnbuiltMixedPrecisionWrapper

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer(UnbuiltMixedPrecisionWrapper):  # noqa: N801 - upstream's name
    """fp16 loss scaling over per-tensor fp32 masters (LAMB) upstream; here the ZeRO optimizer does it."""
