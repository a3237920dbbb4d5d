"""`Monitor`, the interface of one monitor, and what every monitor shares.

An event is upstream's tuple `(name, value, step)`: a name such as
"Train/Samples/train_loss", a number, and the x-axis position (the engine uses the global
sample count). Only global rank 0 writes: the monitors exist there alone, and
`write_events` does nothing on other ranks, so every rank may call it.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from deepspeed import comm as dist


class Monitor(ABC):
    """One destination for events (upstream's base class)."""

    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: list) -> None:
        """Write each `(name, value, step)` of `event_list`."""

    def close(self) -> None:
        """Flush and release what the monitor holds open (files, a run); later writes may reopen."""
        return None  # a monitor that holds nothing open has nothing to release


def require_package(module: str, pip_name: str, config_key: str) -> None:
    """Raise an ImportError naming `module` and the pip command when it is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f'the "{config_key}" monitor is enabled but the package {module!r} is not installed: '
            f'pip install {pip_name} (or set "{config_key}": {{"enabled": false}})'
        )


def global_rank() -> int:
    """This process's global rank; 0 outside a distributed run (a script's own MonitorMaster)."""
    return dist.get_rank() if dist.is_initialized() else 0


def checked_events(event_list: Iterable) -> list:
    """`event_list` as `(str, float, int)` tuples; a 0-d tensor value becomes its number."""
    events = []
    for event in event_list:
        if not isinstance(event, (tuple, list)) or len(event) != 3 or not isinstance(event[0], str):
            raise TypeError(
                f"monitor.write_events: each event must be a (name: str, value, step: int) tuple, got {event!r}"
            )
        name, value, step = event
        try:
            value = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"monitor.write_events: the value of {name!r} must be a number, got {value!r}"
            ) from None
        if isinstance(step, bool) or not isinstance(step, int):
            if hasattr(step, "item"):
                step = step.item()  # a 0-d integer tensor
            if isinstance(step, bool) or not isinstance(step, int):
                raise TypeError(
                    f"monitor.write_events: the step of {name!r} must be an int, got {event[2]!r}"
                )
        events.append((name, value, step))
    return events
