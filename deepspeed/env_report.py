"""`ds_report`: what this installation of DeepSpeed sees, for bug reports.

Prints the native op table (can each op be built here, is it already built) and the
general environment: versions and install paths of deepspeed and torch, torch's CUDA
version, and the accelerator with its communication backend.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
from collections.abc import Sequence
from typing import Optional

LABEL_WIDTH = 34
RULE = "-" * 60


def _line(label: str, value: object) -> str:
    return f"{label} {'.' * max(3, LABEL_WIDTH - len(label))} {value}"


def _yes_no(flag: bool) -> str:
    return "[YES]" if flag else "[NO]"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ds_report", description="Report the DeepSpeed environment.")
    parser.add_argument(
        "--hide_operator_status",
        action="store_true",
        help="do not report which native ops are compatible/built",
    )
    parser.add_argument(
        "--hide_errors_and_warnings",
        action="store_true",
        help="do not print why an op is incompatible, or why the accelerator is unavailable",
    )
    return parser.parse_args(argv)


def op_report(hide_errors: bool = False) -> list[str]:
    """The native op table: name, compatible, built; then why the incompatible ones are."""
    from deepspeed.ops.op_builder import ALL_OPS

    ninja = shutil.which("ninja")
    lines = [
        RULE,
        "DeepSpeed native op report",
        RULE,
        "Ops that are not built are compiled just-in-time (JIT) on first use; 'compatible'",
        "means this machine has what a JIT build needs (a C++ compiler, ninja, the sources).",
        RULE,
        _line("ninja", "[OKAY]" if ninja else "[MISSING] (pip install ninja)"),
        RULE,
        f"{'op name':<20} {'compatible':<12} built",
        RULE,
    ]
    problems = []
    for name, builder in sorted(ALL_OPS.items()):
        reasons = builder.incompatibility_reasons()
        built = not reasons and builder.is_built()
        lines.append(f"{name:<20} {_yes_no(not reasons):<12} {_yes_no(built)}")
        problems.extend(f"{name}: {reason}" for reason in reasons)
    if "async_io" in ALL_OPS and not ALL_OPS["async_io"].incompatibility_reasons():
        lines += [RULE, _line("async_io backend", ALL_OPS["async_io"].backend_note())]
    if problems and not hide_errors:
        lines += [RULE, "Why some ops are not compatible:"] + [f"  {p}" for p in problems]
    return lines


def _accelerator_lines(hide_errors: bool) -> list[str]:
    try:
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        return [
            _line("accelerator", accel._name),
            _line("communication backend", accel.communication_backend_name()),
            _line("device count", accel.device_count()),
        ] + _half_precision_lines(accel)
    except Exception as exc:  # a report should still print when the accelerator is broken
        detail = "" if hide_errors else f" ({type(exc).__name__}: {exc})"
        return [_line("accelerator", f"unavailable{detail}")]


def _half_precision_lines(accel) -> list[str]:
    """bf16 / fp16 with the accelerator's answer (the one clients such as accelerate act on).

    On the CPU that answer is about *native* half-precision math, so a bare `False` for fp16
    reads as "fp16 does not work" while fp16 training runs (torch emulates the ops): say both.
    """
    bf16, fp16 = accel.is_bf16_supported(), accel.is_fp16_supported()
    if accel._name != "cpu":
        return [_line("bf16 supported", bf16), _line("fp16 supported", fp16)]
    import torch

    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native_bf16 = False

    def line(name: str, answer: bool, native: bool) -> str:
        how = "native math" if native else "no native math: torch emulates it, slower"
        return _line(f"{name} supported", f"{answer} ({how}; {name} training still runs on this CPU)")

    return [line("bf16", bf16, native_bf16), line("fp16", fp16, fp16)]


def _extensions_dir() -> str:
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return f"{configured} (TORCH_EXTENSIONS_DIR)"
    from torch.utils.cpp_extension import get_default_build_root

    return f"{get_default_build_root()} (torch's default; set TORCH_EXTENSIONS_DIR to change)"


def general_report(hide_errors: bool = False) -> list[str]:
    """Versions, install paths, torch's CUDA/HIP versions and the accelerator."""
    import torch

    import deepspeed

    lines = [
        RULE,
        "DeepSpeed general environment info:",
        _line("deepspeed version", deepspeed.__version__),
        _line("deepspeed install path", os.path.dirname(os.path.abspath(deepspeed.__file__))),
        _line("torch version", torch.__version__),
        _line("torch install path", os.path.dirname(os.path.abspath(torch.__file__))),
        _line("torch cuda version", torch.version.cuda),
        _line("torch hip version", getattr(torch.version, "hip", None)),
        _line("python version", platform.python_version()),
        _line("native op cache", _extensions_dir()),
    ]
    return lines + _accelerator_lines(hide_errors) + [RULE]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    lines = [] if args.hide_operator_status else op_report(args.hide_errors_and_warnings)
    lines += general_report(args.hide_errors_and_warnings)
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
