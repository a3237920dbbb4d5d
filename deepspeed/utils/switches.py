"""On/off environment switches (`DEEPSPEED_SHM_COMM`, `DEEPSPEED_HOST_MALLOC`): 0 or 1, nothing else."""

from __future__ import annotations

import os
from typing import Optional


def switch_error(name: str, off: str, on: str) -> Optional[str]:
    """What is wrong with environment variable `name`, if anything: unset, 0 and 1 are the
    only values it takes. `off` and `on` say what 0 and 1 (the default) do, for the message."""
    raw = os.environ.get(name)
    if raw is None or raw in ("0", "1"):
        return None
    return f"{name}={raw!r} is neither 0 nor 1; set {name}=0 to {off}, or 1 (the default) to {on}"


def switched_off(name: str) -> bool:
    return os.environ.get(name, "1") == "0"
