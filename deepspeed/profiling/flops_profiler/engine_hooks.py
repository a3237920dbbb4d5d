"""What the engine calls to run the `flops_profiler` config section (engine.py, three places).

At global step `profile_step` (the value of `engine.global_steps` while that step's forward
runs), rank 0 profiles each forward of the step; the step() that ends it (the accumulation
boundary) prints the profile of the last micro-batch's forward, with that micro-step's
backward and step latency from the engine's timers, to stdout or `output_file`, and ends
profiling. Other ranks and other steps pay nothing but a comparison.
"""

from __future__ import annotations

from typing import Any, Optional

from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler

__all__ = ["engine_profiler", "profile_forward_begins", "profile_step_ends"]


def engine_profiler(engine: Any) -> Optional[FlopsProfiler]:
    """The engine's `flops_profiler` (upstream's attribute): a profiler of its module, or None
    when the config leaves the profiler off."""
    if not engine.flops_profiler_enabled():
        return None
    return FlopsProfiler(
        engine.module, ds_engine=engine, recompute_fwd_factor=engine.flops_profiler_recompute_fwd_factor()
    )


def profile_forward_begins(engine: Any) -> bool:
    """Start profiling if this forward is one to profile; True if so (then stop it after)."""
    profiler = engine.flops_profiler
    if (
        profiler is None
        or engine.global_steps != engine.flops_profiler_profile_step()
        or engine.global_rank != 0
    ):
        return False
    profiler.start_profile()
    return True


def profile_step_ends(engine: Any, boundary: bool) -> None:
    """At the boundary step() of the profiled step: print (or write) the profile and end it."""
    profiler = engine.flops_profiler
    if profiler is None or not boundary or not profiler.started:
        return
    profiler.print_model_profile(
        profile_step=engine.flops_profiler_profile_step(),
        module_depth=engine.flops_profiler_module_depth(),
        top_modules=engine.flops_profiler_top_modules(),
        detailed=engine.flops_profiler_detailed(),
        output_file=engine.flops_profiler_output_file(),
    )
    profiler.end_profile()
