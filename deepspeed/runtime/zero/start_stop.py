"""The start()/stop() tracker shared by `zero.Init` and `zero.GatheredParameters`.

[Note: why a tracker object, not flags on the context]
Both context classes split `__enter__`/`__exit__` into public `start()`/`stop()` so that a
gathered block can be written once for ZeRO and non-ZeRO runs. Misuse must be loud in a
plain single-process run too, so the tracker counts even when the context is disabled or
holds no ZeRO parameter. It holds no reference to its owner: a weak reference's callback on the
owner can then report an object that was started and dropped without `stop()`.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Optional

from deepspeed import process_state


def _caller_site(skip_files: tuple) -> Optional[tuple]:
    """`(code, line)` of the first frame outside this package's context code; None if none.

    A walk over the live frames, which reads no source file and formats nothing: `start()`
    records this on every call (a `GatheredParameters` in a loop), and only a message reads
    it (`_format_site`). The code object keeps no frame, so no caller's locals, alive.
    """
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.endswith(skip_files):
            return code, frame.f_lineno
        frame = frame.f_back
    return None


def _format_site(site: Optional[tuple]) -> str:
    """`file:line in function` for a `_caller_site` result."""
    if site is None:
        return "<unknown>"
    code, line = site
    return f"{code.co_filename}:{line} in {code.co_name}"


# Frames from these files are skipped when recording where start() was called from.
_INTERNAL_FILES = ("zero/start_stop.py", "zero/partition_parameters.py")


class _LiveRegistry:
    """The one owner of the set of started-but-not-stopped trackers (for `live_contexts()`)."""

    def __init__(self) -> None:
        # id(the tracker's weak reference to its owner) -> tracker; trackers hold no reference to owners
        self._live: dict = {}

    def add(self, tracker: StartStopTracker) -> None:
        self._live[id(tracker.owner_ref)] = tracker

    def discard(self, tracker: StartStopTracker) -> None:
        self._live.pop(id(tracker.owner_ref), None)

    def pop_for(self, owner_ref: weakref.ref) -> Optional[StartStopTracker]:
        """The active tracker whose owner `owner_ref` referred to, now no longer live; None if none is active."""
        return self._live.pop(id(owner_ref), None)

    def snapshot(self) -> list:
        return [(str(t.description), t.start_site) for t in self._live.values()]

    def reset(self) -> None:
        self._live.clear()


_REGISTRY = _LiveRegistry()
process_state.register("deepspeed.runtime.zero.start_stop._REGISTRY", _REGISTRY, _REGISTRY.reset)


def live_contexts() -> list:
    """`(description, where start() was called)` for every started, not yet stopped context.

    A debugging helper: call it where you expect no gather or Init to be active.
    """
    return _REGISTRY.snapshot()


class StartStopTracker:
    """idle -> active -> idle; `begin()` and `end()` check the transition and raise on misuse."""

    # Names the owner in messages, e.g. "GatheredParameters(3 params)": a str, or an object
    # whose str() is one, made only when a message needs it (GatheredParameters' hold).
    description: object
    active: bool
    _site: Optional[tuple]  # where the current (or last) start() was called from (`_caller_site`)
    starts: int  # how many times the owner was started, for debugging
    owner_ref: weakref.ref  # to the owner; the key of this tracker in the registry while active

    def __init__(self, owner: object, description: object) -> None:
        self.description = description
        self.active = False
        self._site = None
        self.starts = 0
        # A weak reference with a module-level callback, not `weakref.finalize` (a registry
        # entry per object, several times the cost, on every GatheredParameters) nor a bound
        # method (a cycle through this tracker). While the tracker is active, the registry
        # keeps it, and so this reference, alive: the callback then fires and reports.
        self.owner_ref = weakref.ref(owner, _owner_collected)

    def begin(self) -> None:
        if self.active:
            raise RuntimeError(
                f"{self.description}.start() was called while it is already active "
                f"(started at {self.start_site}); call stop() before starting it again, "
                "or create a second object"
            )
        self.active = True
        self.starts += 1
        self._site = _caller_site(_INTERNAL_FILES)
        _REGISTRY.add(self)

    @property
    def start_site(self) -> str:
        """`file:line in function` where the current (or last) start() was called."""
        return _format_site(self._site)

    def end(self) -> None:
        if not self.active:
            never = " (it was never started)" if self.starts == 0 else ""
            raise RuntimeError(
                f"{self.description}.stop() was called while it is not active{never}; "
                "every stop() must follow a start() on the same object"
            )
        self.active = False
        _REGISTRY.discard(self)


def _owner_collected(owner_ref: weakref.ref) -> None:
    """An owner was garbage-collected: warn if its tracker was still active (started, never stopped)."""
    if _REGISTRY is None:  # interpreter shutdown cleared this module's globals before the owner
        return
    tracker = _REGISTRY.pop_for(owner_ref)
    if tracker is not None:
        warnings.warn(
            f"{tracker.description} was started at {tracker.start_site} and garbage-collected "
            "without stop(); its parameters stay gathered or its patches installed. "
            "Call stop() (or use a `with` block)",
            ResourceWarning,
            stacklevel=2,
        )
