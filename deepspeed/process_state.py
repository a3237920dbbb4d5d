"""The one list of what in deepspeed is truly per process, and the one `reset()` tests call.

[Note: what is per process]
Most state belongs to an engine, an Init or a context, and lives on that object. What is left
belongs to the process: the accelerator chosen at first use, the patches an active Init put
in force, the once-per-process warnings, the optimizers alive (for `safe_get_*`), the logger's
level, the collectives' exit hook and shared-memory channels. Each module that owns such state
registers it here when it is imported: a name, the object, and how to put it back as the
import left it (or None where it cannot be put back while the process lives, such as the
exit hook registered with `atexit`). `owned()` lists the entries; `reset()` runs every reset, in
the order the modules registered them. Tests call `reset()` between two tests run by the same
pooled rank (tests/unit/common.py), and tests/unit/test_process_state.py checks that every
module-level container or state object in the package is registered here or is a constant.

This module imports nothing from deepspeed, so any module may register (layer 0 in
docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

__all__ = ["Entry", "owned", "register", "reset"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One piece of per-process state."""

    name: str  # where it lives, "module.attribute" (or a description for state held elsewhere)
    obj: Any  # the object holding the state
    # Puts the state back as the import left it; None: it lives as long as the process.
    reset: Optional[Callable[[], None]]


class _Registry:
    """The entries, by name; registering a name again (a reloaded module) replaces its entry."""

    def __init__(self) -> None:
        self.entries: dict = {}  # name -> Entry, in registration order

    def register(self, name: str, obj: Any, reset: Optional[Callable[[], None]]) -> None:
        self.entries[name] = Entry(name, obj, reset)

    def reset_all(self) -> None:
        for entry in list(self.entries.values()):
            if entry.reset is not None:
                entry.reset()


_REGISTRY = _Registry()


def register(name: str, obj: Any, reset: Optional[Callable[[], None]] = None) -> Any:
    """Record `obj` as per-process state named `name`, put back by `reset()`; returns `obj`."""
    _REGISTRY.register(name, obj, reset)
    return obj


def owned() -> tuple:
    """Every registered `Entry`, in registration order."""
    return tuple(_REGISTRY.entries.values())


def reset() -> None:
    """Put every registered state that can be put back as its import left it."""
    _REGISTRY.reset_all()
