"""The printed profile: a summary, the top module types per depth, the annotated model tree.

The layout follows upstream's (section titles, one `label: value` line per figure, the
`depth d:` blocks, each module's figures after its name), so logs read the same. With an
engine (`FlopsProfiler(model, ds_engine=engine)`), the summary adds the engine's world
sizes and batch size, and reads the forward, backward and step latency of the profiled
micro-step from the engine's timers (`wall_clock_breakdown`, which an enabled
`flops_profiler` block switches on, as upstream); without one, the forward latency is the
model's forward as the hooks timed it and the backward and step lines are left out.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from torch import nn

from deepspeed.profiling.flops_profiler.formatting import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from deepspeed.utils.timer import BACKWARD_MICRO_TIMER, FORWARD_MICRO_TIMER, STEP_MICRO_TIMER

_RULE = "-" * 78


def write_profile(profiler: Any, profile_step: int, module_depth: int, top_modules: int, detailed: bool,
                  output_file: Optional[str]) -> None:  # fmt: skip
    """Print the whole profile to stdout, or write it to `output_file`."""
    lines = summary_lines(profiler, profile_step)
    lines += ["", "-" * 29 + " Aggregated Profile per GPU " + "-" * 29]
    lines += aggregated_lines(profiler, module_depth, top_modules)
    if detailed:
        lines += ["", "-" * 30 + " Detailed Profile per GPU " + "-" * 30]
        lines += [
            "Each module's figures follow its name: params, share of the total params, MACs, share of the",
            "total MACs, fwd latency, share of the total fwd latency, fwd FLOPS (flops / latency).",
            "Figures include the module's children; work a module does outside its children (a functional",
            "call, a loss) is what its own figures exceed their sum by. Flops are counted from operator",
            "shapes, so a FLOPS figure can exceed what the hardware sustains.",
            "",
        ]
        lines += tree_lines(profiler, profiler.model)
    lines.append(_RULE)
    text = "\n".join(lines) + "\n"
    if not output_file:
        sys.stdout.write(text)
        return
    folder = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(folder, exist_ok=True)
    with open(output_file, "w") as stream:
        stream.write(text)


def _line(label: str, value: Any) -> str:
    return f"{label:<70}  {value}"


def _engine_latencies(engine: Any) -> Optional[tuple]:
    """(fwd, bwd, step) seconds of the last micro-step from the engine's timers, if it ran them."""
    timers = getattr(engine, "timers", None)
    if timers is None or not engine.wall_clock_breakdown():
        return None
    known = timers.get_timers()
    names = (FORWARD_MICRO_TIMER, BACKWARD_MICRO_TIMER, STEP_MICRO_TIMER)
    if not all(name in known for name in names):
        return None
    return tuple(known[name].elapsed(reset=False) / 1000.0 for name in names)


def summary_lines(profiler: Any, profile_step: int) -> list:
    engine, factor = profiler.ds_engine, 2.0 + profiler.recompute_fwd_factor
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    mp_size = engine.mp_world_size if engine is not None else 1
    lines = [
        "",
        "-" * 26 + " DeepSpeed Flops Profiler " + "-" * 26,
        f"Profile Summary at step {profile_step}:",
        "Notations: dp_size / mp_size: data / model parallel size; params: parameters;",
        "MACs: multiply-accumulate operations; flops: floating-point operations; FLOPS: flops per second;",
        "fwd / bwd / step latency: the forward, backward and optimizer step's wall time;",
        "iter latency: their sum.",
        "",
    ]
    if engine is not None:
        lines += [
            _line("world size:", engine.world_size),
            _line("data parallel size:", engine.dp_world_size),
            _line("model parallel size:", mp_size),
            _line("batch size per GPU:", engine.train_micro_batch_size_per_gpu()),
        ]
    lines += [
        _line("params per GPU:", params_to_string(params)),
        _line("params of model = params per GPU * mp_size:", params_to_string(params * mp_size)),
        _line("fwd MACs per GPU:", macs_to_string(macs)),
        _line("fwd flops per GPU:", number_to_string(flops)),
        _line("fwd flops of model = fwd flops per GPU * mp_size:", number_to_string(flops * mp_size)),
    ]
    latencies = _engine_latencies(engine) if engine is not None else None
    fwd = latencies[0] if latencies else profiler.get_total_duration()
    lines += [
        _line("fwd latency:", duration_to_string(fwd)),
        _line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency:", _rate(flops, fwd)),
    ]
    if latencies:
        lines += _backward_and_step_lines(engine, flops, factor, *latencies)
    return lines


def _backward_and_step_lines(
    engine: Any, flops: int, factor: float, fwd: float, bwd: float, step: float
) -> list:
    """The summary's lines that need the engine's backward and step timers."""
    iteration = fwd + bwd + step
    samples = engine.train_micro_batch_size_per_gpu() * engine.world_size
    return [
        _line("bwd latency:", duration_to_string(bwd)),
        _line(
            f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency:", _rate(factor * flops, bwd)
        ),
        _line(
            f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency):",
            _rate((factor + 1) * flops, fwd + bwd),
        ),
        _line("step latency:", duration_to_string(step)),
        _line("iter latency:", duration_to_string(iteration)),
        _line(
            f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency:",
            _rate((factor + 1) * flops, iteration),
        ),
        _line("samples/second:", round(samples / iteration, DEFAULT_PRECISION) if iteration else 0),
    ]


def _rate(flops: float, seconds: float) -> str:
    return flops_to_string(flops / seconds if seconds else 0.0)


def aggregated_lines(profiler: Any, module_depth: int, top_modules: int) -> list:
    """`depth d:` blocks: the `top_modules` module types at each depth by params, MACs, latency,
    from depth 0 to `module_depth` (-1: the deepest)."""
    per_depth: list = []  # depth -> {type name: [macs, params, seconds]}

    def walk(module: nn.Module, depth: int) -> None:
        if len(per_depth) <= depth:
            per_depth.append({})
        flops, macs, params, seconds = profiler.module_stats(module)
        entry = per_depth[depth].setdefault(type(module).__name__, [0, 0, 0.0])
        entry[0] += macs
        entry[1] += params
        entry[2] += seconds
        for child in module.children():
            walk(child, depth + 1)

    walk(profiler.model, 0)
    last = len(per_depth) - 1 if module_depth < 0 else min(module_depth, len(per_depth) - 1)
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        lines += [
            f"depth {depth}:",
            f"    params      - {_top(per_depth[depth], 1, top_modules, params_to_string)}",
            f"    MACs        - {_top(per_depth[depth], 0, top_modules, macs_to_string)}",
            f"    fwd latency - {_top(per_depth[depth], 2, top_modules, duration_to_string)}",
        ]
    return lines


def _top(kinds: dict, index: int, count: int, fmt: Any) -> dict:
    """The `count` module types with the largest figure `index`, formatted."""
    ranked = sorted(kinds.items(), key=lambda item: item[1][index], reverse=True)[:count]
    return {name: fmt(values[index]) for name, values in ranked}


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole if whole else 0.0:.2f}%"


def tree_lines(profiler: Any, model: nn.Module) -> list:
    """The model as `print(model)` shows it, each module's figures first in its parentheses."""
    _, total_macs, total_params, total_time = profiler.module_stats(model)

    def figures(module: nn.Module) -> str:
        flops, macs, params, seconds = profiler.module_stats(module)
        return ", ".join(
            [
                f"{params_to_string(params)}, {_percent(params, total_params)} Params",
                f"{macs_to_string(macs)}, {_percent(macs, total_macs)} MACs",
                f"{duration_to_string(seconds)}, {_percent(seconds, total_time)} latency",
                _rate(flops, seconds),
            ]
        )

    def render(module: nn.Module, prefix: str, indent: str) -> list:
        extra = module.extra_repr()
        head = f"{indent}{prefix}{type(module).__name__}("
        children = list(module.named_children())
        if not children:
            return [head + figures(module) + (f", {extra}" if extra else "") + ")"]
        lines = [head, f"{indent}  {figures(module)}" + (f", {extra}" if extra else "") + ","]
        for name, child in children:
            lines += render(child, f"({name}): ", indent + "  ")
        return lines + [f"{indent})"]

    return render(model, "", "")
