"""Core lists for binding ranks to CPU cores (upstream's module path for its parser).

`--bind_core_list "0,2-4,8-9"` names the cores the launcher splits among a node's ranks; each
rank is then bound with `os.sched_setaffinity` (launcher/launch.py), not with numactl.
"""

from __future__ import annotations

__all__ = ["parse_range_list"]


def parse_range_list(text: str) -> list[int]:
    """`"0,2-4,8-9"` -> `[0, 2, 3, 4, 8, 9]`: cores and inclusive ranges, in ascending order
    without overlap (a list out of order or overlapping is refused, as upstream: it is most
    likely a typo, and a core named twice would bind two ranks to it)."""
    cores: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
            else:
                low = high = int(part)
        except ValueError:
            raise ValueError(
                f"bad core list {text!r}: {part!r} is not a core or a range; expected e.g. '0,2-4,8-9'"
            ) from None
        if high < low:
            raise ValueError(f"bad core list {text!r}: the range {part!r} runs backwards; write {high}-{low}")
        if cores and low <= cores[-1]:
            raise ValueError(
                f"bad core list {text!r}: {part!r} does not come after core {cores[-1]}; list cores and "
                "ranges in ascending order, each once"
            )
        cores.extend(range(low, high + 1))
    return cores
