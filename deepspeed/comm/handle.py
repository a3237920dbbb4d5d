"""`CommHandle`: what every collective of `deepspeed.comm` returns (comm.py)."""

from __future__ import annotations

from typing import Any, Optional


class CommHandle:
    """The result of a collective: `wait()` blocks until it finished (idempotent)."""

    __slots__ = ("_work", "_on_complete")

    def __init__(self, work: Optional[Any] = None, on_complete: Optional[Any] = None) -> None:
        self._work = work  # a torch Work object, or None when the call was synchronous
        self._on_complete = on_complete  # runs once, after the work finished

    def wait(self) -> None:
        if self._work is None:
            return  # synchronous call, or already waited on
        self._work.wait()
        self._work = None
        if self._on_complete is not None:
            self._on_complete()
            self._on_complete = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def after_wait(self, fn: Any) -> None:
        """Run `fn()` once the work finished: in `wait()`, after its own completion (now if done)."""
        if self._work is None:
            fn()
            return
        first = self._on_complete
        self._on_complete = fn if first is None else lambda: (first(), fn())


class AllWorks:
    """Several torch Work objects waited on as one (a collective built from several)."""

    __slots__ = ("_works",)

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def handle_of(work: Optional[Any], async_op: bool) -> CommHandle:
    """The handle a collective returns: `work` to wait on when `async_op`, else a complete one."""
    return CommHandle(work if async_op else None)
