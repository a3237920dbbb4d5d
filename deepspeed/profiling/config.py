"""The `flops_profiler` section of a DeepSpeed config (upstream's module path and class name)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

__all__ = ["DeepSpeedFlopsProfilerConfig"]


class DeepSpeedFlopsProfilerConfig(DeepSpeedConfigModel):
    """`flops_profiler`: profile one training step's forward on rank 0 and print the profile
    (deepspeed/profiling/flops_profiler). Enabling it also turns on `wall_clock_breakdown`,
    whose timers give the backward and step latency, as upstream."""

    enabled: bool = False
    """Profile the forward of global step `profile_step` and print the profile at its step()."""

    recompute_fwd_factor: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the forward that activation checkpointing recomputes in backward (0.0 to 1.0):
    the backward is counted as (2 + factor) forward flops."""

    profile_step: int = Field(1, ge=0)
    """The global step (`engine.global_steps` during its forward) that is profiled."""

    module_depth: int = Field(-1, ge=-1)
    """The deepest module depth the aggregated profile lists; -1: all."""

    top_modules: int = Field(1, ge=1)
    """How many module types the aggregated profile lists per depth."""

    detailed: bool = True
    """Also print the model tree with every module's figures."""

    output_file: Optional[str] = None
    """Write the profile to this file (its folder created) instead of stdout."""
