"""Progress bars on the long jobs a person waits for: consolidating a ZeRO checkpoint
(`zero_to_fp32`), reading the files of a checkpoint saved on many ranks, writing a
consolidated model in shards, the benchmark suite.

A bar is drawn (on stderr, with tqdm) only when all of these hold:

- stderr is a terminal: logs redirected to a file, CI and tests get no control characters;
- the caller did not ask for quiet (`--quiet` of the command-line tools, and every rank
  but global rank 0 inside a distributed job: one bar per job, not one per rank);
- `DEEPSPEED_DISABLE_TQDM` is unset or 0 (1 turns every bar off; any other value raises,
  naming it) and tqdm's own `TQDM_DISABLE` is not set.

tqdm is a dependency, but nothing here needs it to work: without it the job runs barless.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, Optional

DISABLE_ENV = "DEEPSPEED_DISABLE_TQDM"


def bars_enabled(quiet: bool = False) -> bool:
    """Whether a bar would be drawn now (see the module docstring)."""
    raw = os.environ.get(DISABLE_ENV, "0")
    if raw not in ("", "0", "1"):
        raise ValueError(
            f"{DISABLE_ENV}={raw!r} is neither 0 nor 1; set {DISABLE_ENV}=1 to turn progress bars off, "
            "or 0 (the default) to draw them when stderr is a terminal"
        )
    if quiet or raw == "1" or os.environ.get("TQDM_DISABLE", "") not in ("", "0"):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _tqdm() -> Optional[Any]:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def progress(items: Iterable, desc: str, unit: str = "it", total: Optional[int] = None, quiet: bool = False):
    """`items`, wrapped in a bar when `bars_enabled(quiet)`; else `items` itself."""
    tqdm = _tqdm() if bars_enabled(quiet) else None
    if tqdm is None:
        return items
    return tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr, dynamic_ncols=True)


class _NoBar:
    """What `progress_bar` returns when no bar is drawn: the same calls, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress_bar(total: int, desc: str, unit: str = "it", quiet: bool = False):
    """A bar advanced by hand (`update(n)`), for work whose steps are not one loop; use it as
    a context manager so it is closed on errors too."""
    tqdm = _tqdm() if bars_enabled(quiet) else None
    if tqdm is None:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
