"""Keeping the ranks in step through a save or a load: phases that fail on every rank at once.

[Note: every rank raises, none hangs]
A save or load runs in phases (write the rank files; publish `latest` / resolve the tag;
open and check every file; apply). Each phase ends with one `all_gather_object` of the
ranks' error messages, which doubles as the barrier between phases. If any rank failed,
every rank raises the same `CheckpointError` listing each failed rank's message (a missing
or truncated file is named there), so no rank waits in a collective its peers never join.
Where the first failed rank raised a subclass from errors.py (an unsafe file, a bad
argument), every rank raises that subclass, so a caller catching it sees it on every rank.
A load checks every file and the fit to the model before it changes anything, so an error
leaves the engine as it was.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from deepspeed import comm as dist
from deepspeed.checkpoint import errors
from deepspeed.checkpoint.errors import CheckpointError


def world_size() -> int:
    """The ranks taking part in the phases' collectives (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def on_all_ranks(what: str, fn: Callable, *args: Any, agree: bool = False) -> Any:
    """Run `fn(*args)` here; raise on every rank if it raised on any (see the note).

    With `agree=True` the (small, picklable) results are compared too: ranks that reached
    different answers (e.g. saw different files) also fail everywhere.
    """
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn(*args)
    except Exception as err:  # reported to every rank below, then re-raised as the cause
        error = err
    message = None if error is None else _describe(error)
    kind_name = type(error).__name__ if isinstance(error, CheckpointError) else None
    outcomes = [(message, kind_name, result if agree else None)]
    if world_size() > 1:
        outcomes = [None] * world_size()
        dist.all_gather_object(outcomes, (message, kind_name, result if agree else None))
    failed = [(r, m, k) for r, (m, k, _) in enumerate(outcomes) if m is not None]
    if failed:
        lines = "; ".join(f"rank {r}: {m}" for r, m, _ in failed)
        kind = getattr(errors, failed[0][2] or "", None)
        if not (isinstance(kind, type) and issubclass(kind, CheckpointError)):
            kind = CheckpointError
        raise kind(f"{what} failed on {len(failed)} of {len(outcomes)} rank(s): {lines}") from error
    if agree and any(res != outcomes[0][2] for _, _, res in outcomes):
        answers = ", ".join(f"rank {r}: {res!r}" for r, (_, _, res) in enumerate(outcomes))
        raise CheckpointError(
            f"{what}: the ranks disagree ({answers}); every rank must pass the same arguments and see "
            "the same files (one directory shared by all ranks)"
        )
    return result


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` (picklable) on every rank."""
    agreed = [value]
    if world_size() > 1:
        dist.broadcast_object_list(agreed, src=0)
    return agreed[0]


def in_turns_per_node(load: Callable[[], Any]) -> Any:
    """Run `load` one local rank of each node after another (local rank 0 first), so a node
    holds one rank's loaded files in host memory at a time instead of all of them at once.

    Every rank takes part in every turn's barrier, also one whose own load raised (its
    error is raised after the last turn), so a failure cannot leave the others waiting.
    """
    if world_size() == 1:
        return load()
    local_ranks = [0] * world_size()
    dist.all_gather_object(local_ranks, dist.get_local_rank())
    result, error = None, None
    for turn in range(max(local_ranks) + 1):
        if turn == dist.get_local_rank():
            try:
                result = load()
            except Exception as err:  # raised after the turns, as on_all_ranks reports it
                error = err
        dist.barrier()
    if error is not None:
        raise error
    return result


def is_first_on_node() -> bool:
    """Whether this rank is its node's local rank 0."""
    return dist.get_local_rank() == 0
