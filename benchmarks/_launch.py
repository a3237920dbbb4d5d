"""Spawn N CPU ranks on gloo for a benchmark, collect what each returns, propagate failures.

    results = run_ranks(worker, world_size=2, args=(cfg,), env={"MALLOC_ARENA_MAX": "2"})

`worker(rank, world_size, *args)` runs in a fresh (spawned) process with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and LOCAL_RANK set, one torch thread, and the default process group
already joined through `deepspeed.comm.init_distributed(dist_backend="gloo")`. It must be a
module-level function (it is pickled by name) and return something picklable. `run_ranks`
returns the per-rank results in rank order, or raises `RuntimeError` with every failed
rank's traceback. `env` is applied before the processes start, so variables read at process
start-up (glibc's `MALLOC_*`, `OMP_NUM_THREADS`) take effect in the children.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Sequence
from typing import Callable, Optional

# After one rank failed, how long the others get to finish before they are killed (they are
# probably blocked in a collective the failed rank never joined).
PEER_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(target: Callable, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import torch

        torch.set_num_threads(1)
        from deepspeed import comm as dist

        dist.init_distributed(dist_backend="gloo", verbose=False)
        value = target(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        with contextlib.suppress(Exception):
            leave_distributed()


def leave_distributed() -> None:
    """Destroy the default process group, if any, after a short sleep: call before exiting.

    gloo's worker thread lets go of a finished collective after the caller's `wait()`
    returned, and letting go takes the GIL; one still waiting for it when the interpreter
    finalizes aborts the process ("terminate called without an active exception"). That
    once threw away a complete upstream gather report (its rank 0 had printed it). The
    sleep releases the GIL first; ours does the same at exit (`_destroy_at_exit` in
    deepspeed/comm/comm.py), upstream and plain torch do not.
    """
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        time.sleep(0.05)
        tdist.destroy_process_group()


@contextlib.contextmanager
def _environment(env: Optional[dict], unset: Sequence[str] = ()):
    """Set `env` and remove `unset` in os.environ (inherited by spawned children); restore after."""
    env = env or {}
    saved = {k: os.environ.get(k) for k in [*env, *unset]}
    for key in unset:
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _collect(procs: list, results, timeout_s: float) -> dict:
    """Read every rank's report while they run; stop waiting on failure, timeout or exit."""
    reports: dict = {}
    deadline = time.monotonic() + timeout_s
    failed_at: Optional[float] = None
    while len(reports) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.2)
            reports[rank] = (status, value)
            if status != "ok" and failed_at is None:
                failed_at = time.monotonic()
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reports]
        if dead and failed_at is None:
            failed_at = now
            for r in dead:
                reports[r] = ("error", f"exited with code {procs[r].exitcode} without a report")
        if now > deadline or (failed_at is not None and now - failed_at > PEER_GRACE_S):
            break
        if all(p.exitcode is not None for p in procs) and results.empty():
            break
    return reports


def run_ranks(
    target: Callable,
    world_size: int,
    args: tuple = (),
    env: Optional[dict] = None,
    timeout_s: float = 600.0,
    child_env_unset: Sequence[str] = (),
) -> list:
    """Run `target(rank, world_size, *args)` on `world_size` spawned gloo ranks; results in rank order.

    `env` is set, and `child_env_unset` removed, in the children's environment (not ours).
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size={world_size} must be >= 1")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with _environment(env, child_env_unset):
        procs = [
            ctx.Process(target=_rank_main, args=(target, r, world_size, port, args, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    try:
        reports = _collect(procs, results, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    return _results_or_raise(reports, world_size, timeout_s)


def _results_or_raise(reports: dict, world_size: int, timeout_s: float) -> list:
    problems = []
    for r in range(world_size):
        status, value = reports.get(r, ("error", f"no report within {timeout_s:.0f} s (hung or killed)"))
        if status != "ok":
            problems.append(f"--- rank {r} of {world_size} ---\n{value}")
    if problems:
        raise RuntimeError("benchmark ranks failed:\n" + "\n".join(problems))
    return [reports[r][1] for r in range(world_size)]


def max_over_ranks(values: list) -> list:
    """Element-wise max over ranks of a list of floats (call on every rank; a collective)."""
    import torch

    from deepspeed import comm as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def machine_info() -> dict:
    import platform

    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        # Other jobs on the machine make timings noisy: record how busy it was.
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
