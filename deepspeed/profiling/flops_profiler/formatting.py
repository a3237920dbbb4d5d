"""Numbers as the printed profile shows them: `'1.23 M'`, `'81.9 TFLOPS'`, `'76.67 ms'`
(upstream's helpers, part of its public API)."""

from __future__ import annotations

from typing import Optional

__all__ = [
    "DEFAULT_PRECISION",
    "number_to_string",
    "flops_to_string",
    "macs_to_string",
    "params_to_string",
    "duration_to_string",
    "bytes_to_string",
]

DEFAULT_PRECISION = 2


_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))


def number_to_string(num: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """`1234567` -> `'1.23 M'`; `units` forces a prefix (T, G, M, K, m, u; anything else: none)."""
    if units is None:
        units, scale = next(
            ((prefix, scale) for prefix, scale in _PREFIXES if num >= scale or (num == 0 and scale == 1.0)),
            ("u", 1e-6),
        )
    else:
        scale = dict(_PREFIXES).get(units, 1.0)
    return f"{round(num / scale, precision):g} {units}"


def flops_to_string(flops: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """A rate: `'81.9 TFLOPS'`."""
    return number_to_string(flops, units, precision) + "FLOPS"


def macs_to_string(macs: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """`'3.14 GMACs'`."""
    return number_to_string(macs, units, precision) + "MACs"


def bytes_to_string(num_bytes: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """`'1.5 GB'` (decimal prefixes)."""
    return number_to_string(num_bytes, units, precision) + "B"


def params_to_string(params: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """`'336.23 M'`; billions read `B` (`'7.0 B'`), and `units='B'` asks for them."""
    units = "G" if units == "B" else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(
    seconds: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION
) -> str:
    """`'76.67 ms'`."""
    return number_to_string(seconds, units, precision) + "s"
