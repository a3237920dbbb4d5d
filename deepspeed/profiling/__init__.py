"""Profiling tools: the FLOPs profiler (`deepspeed.profiling.flops_profiler`) and its config
section (`deepspeed.profiling.config`). Nothing is imported until a submodule is asked for."""
