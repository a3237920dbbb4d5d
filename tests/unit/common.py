"""Multi-process test harness: each test method of a `DistributedTest` runs on N spawned ranks.

    class TestThing(DistributedTest):
        world_size = [1, 2, 4]      # an int, or a list: the method runs once per size

        def test_sum(self, tmp_path):   # fixtures resolve in the parent; values must pickle
            ...                         # runs on every rank, torch.distributed initialized

        @world_size(4)              # a per-method override
        def test_big(self): ...

[Note: why ranks are pooled]
Spawning ranks and importing torch costs seconds per rank on a 2-core machine. Ranks are
kept in a pool per (world size, backend) and reused by later tests, the way one spawned
group runs a grid of cases. A pool is thrown away after any failure or timeout, since a
failed collective can leave the survivors out of step. A class that must start from a
fresh process (it initializes torch.distributed itself, or destroys it) sets
`reuse_dist_env = False` and `init_distributed = False`.

[Note: why a hang becomes a failure with tracebacks]
Each rank registers faulthandler on SIGUSR1. When a test outlives `timeout_s`, or when one
rank failed and the others do not finish within `peer_grace_s` (they are likely blocked in
a collective the failed rank never joined), the parent signals every live rank, collects
the stacks they dump, kills the pool and fails the test with every rank's traceback.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import importlib
import inspect
import logging
import multiprocessing
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import pytest

DEFAULT_TIMEOUT_S = 180.0
STARTUP_TIMEOUT_S = 180.0  # spawning ranks and importing torch, on a loaded 2-core machine
PEER_GRACE_S = 10.0
# A collective waits this long for a dead peer before it raises (DEEPSPEED_TIMEOUT, minutes).
RANK_COLLECTIVE_TIMEOUT_MIN = "2"


def get_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    """`DS_TEST_BACKEND` if set, else the accelerator's (gloo on CPU, nccl on CUDA)."""
    if os.environ.get("DS_TEST_BACKEND"):
        return os.environ["DS_TEST_BACKEND"]
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def max_ranks(backend: str) -> Optional[int]:
    """The most ranks `backend` can run on this machine: nccl needs a GPU per rank; gloo has no limit."""
    if backend != "nccl":
        return None
    import torch

    return torch.cuda.device_count()


def fit_world_size(size: int) -> int:
    """`size`, or as many ranks as the default backend can run here if fewer (one GPU: 1 rank).
    For suites whose checks hold at any world size, such as the zoo's parity tests."""
    limit = max_ranks(default_backend())
    return size if limit is None else max(1, min(size, limit))


def world_size(*sizes: int):
    """Decorator: run this test method at these world sizes instead of the class's."""

    def mark(fn):
        fn._ds_world_size = list(sizes)
        return fn

    return mark


# ----------------------------------------------------------------------------- the rank side


def _set_rank_env(rank: int, size: int, port: int) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DEEPSPEED_TIMEOUT": os.environ.get("DEEPSPEED_TIMEOUT", RANK_COLLECTIVE_TIMEOUT_MIN),
            "OMP_NUM_THREADS": "1",
        }
    )


# Fixtures that cannot cross a process boundary; each rank makes its own for the test.
_RANK_LOCAL_FIXTURES = ("monkeypatch",)


def _reset_process_state() -> None:
    """Global state a test (or a client library it drives) may change, back to its default.

    Ranks are pooled (see the note), so without this one test's changes would leak into the
    next: transformers, for one, sets the deepspeed logger's level to its own process log
    level, which hides the warnings later tests check for. `deepspeed.process_state` lists
    that state and puts it back.
    """
    from deepspeed import process_state

    process_state.reset()


def _run_task(task: tuple) -> None:
    module_name, class_name, method_name, kwargs = task
    _reset_process_state()
    cls = getattr(importlib.import_module(module_name), class_name)
    original = cls._ds_originals[method_name]
    wanted = inspect.signature(original).parameters
    with pytest.MonkeyPatch.context() as monkeypatch:
        local = {"monkeypatch": monkeypatch}
        kwargs = {**kwargs, **{k: v for k, v in local.items() if k in wanted}}
        original(cls(), **kwargs)


def _rank_main(rank, size, port, backend, init_dist, tasks, results, stack_path):
    _set_rank_env(rank, size, port)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import torch

    torch.set_num_threads(1)
    try:
        if init_dist:
            import deepspeed.comm as dist

            dist.init_distributed(dist_backend=backend, verbose=False)
    except BaseException:
        results.put((rank, "error", "init_distributed failed:\n" + traceback.format_exc()))
        return
    results.put((rank, "ready", ""))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the test session was killed without stopping its pool: do not linger
            continue
        if task is None:
            return
        try:
            _run_task(task)
            results.put((rank, "ok", ""))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


# ----------------------------------------------------------------------------- the parent side


class _RankPool:
    """`size` spawned ranks sharing one process group, fed tasks through per-rank queues."""

    def __init__(self, size: int, backend: str, init_dist: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.size = size
        port = get_free_port()
        self.results = ctx.Queue()
        self.task_queues = [ctx.Queue() for _ in range(size)]
        self.stack_dir = tempfile.mkdtemp(prefix="ds_test_stacks_")
        self.stack_paths = [os.path.join(self.stack_dir, f"rank{r}.txt") for r in range(size)]
        self.procs = []
        for rank in range(size):
            args = (
                rank,
                size,
                port,
                backend,
                init_dist,
                self.task_queues[rank],
                self.results,
                self.stack_paths[rank],
            )
            proc = ctx.Process(target=_rank_main, args=args, daemon=True)
            proc.start()
            self.procs.append(proc)
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Block until every rank has started and joined its group, so task timeouts exclude start-up."""
        outcomes = self._collect(STARTUP_TIMEOUT_S)
        failed = {r: text for r, (status, text) in outcomes.items() if status != "ready"}
        if failed or len(outcomes) < self.size:
            missing = sorted(set(range(self.size)) - set(outcomes))
            self.close()
            raise AssertionError(
                self._report(("start-up", "rank pool", "init"), failed, missing, STARTUP_TIMEOUT_S)
            )

    def run(self, task: tuple, timeout_s: float) -> None:
        for q in self.task_queues:
            q.put(task)
        outcomes = self._collect(timeout_s)
        errors = {rank: text for rank, (status, text) in outcomes.items() if status == "error"}
        if len(outcomes) < self.size or errors:
            missing = sorted(set(range(self.size)) - set(outcomes))
            raise AssertionError(self._report(task, errors, missing, timeout_s))

    def _collect(self, timeout_s: float) -> dict:
        outcomes: dict = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.size:
            if any(status == "error" for status, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, text = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in outcomes]
                for r in dead:
                    code = self.procs[r].exitcode
                    outcomes[r] = ("error", f"rank {r} process died with exit code {code}")
                continue
            outcomes[rank] = (status, text)
        return outcomes

    def _report(self, task: tuple, errors: dict, missing: list, timeout_s: float) -> str:
        lines = [f"{task[1]}.{task[2]} failed at world size {self.size}"]
        for rank in sorted(errors):
            lines.append(f"--- rank {rank} raised:\n{errors[rank]}")
        if missing:
            lines.append(
                f"--- ranks {missing} did not finish (timeout {timeout_s:.0f}s or peer failure); stacks:"
            )
            for rank in missing:
                lines.append(f"rank {rank}:\n{self._dump_stack(rank)}")
        return "\n".join(lines)

    def _dump_stack(self, rank: int) -> str:
        proc = self.procs[rank]
        if not proc.is_alive():
            return f"(process exited with code {proc.exitcode})"
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
        with open(self.stack_paths[rank]) as f:
            return f.read() or "(no stack dumped)"

    def close(self) -> None:
        for q in self.task_queues:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


class _PoolCache:
    """Owns the reusable rank pools of this pytest process (see the note on pooling)."""

    def __init__(self) -> None:
        self.pools: dict = {}

    def get(self, size: int, backend: str) -> _RankPool:
        key = (size, backend)
        if key not in self.pools:
            # Pools of every size stay alive (7 idle ranks for sizes 1, 2, 4): pytest runs a
            # method's sizes back to back, so closing one pool per switch would respawn often.
            self.pools[key] = _RankPool(size, backend, init_dist=True)
        return self.pools[key]

    def discard(self, size: int, backend: str) -> None:
        pool = self.pools.pop((size, backend), None)
        if pool is not None:
            pool.close()

    def close_all(self) -> None:
        for key in list(self.pools):
            self.discard(*key)


_POOLS = _PoolCache()
atexit.register(_POOLS.close_all)


def _run_distributed(cls, method_name: str, size: int, kwargs: dict) -> None:
    backend = cls.backend or default_backend()
    limit = max_ranks(backend)
    if limit is not None and size > limit:
        pytest.skip(f"{size} ranks on {backend} need {size} GPUs; this machine has {limit}")
    task = (cls.__module__, cls.__name__, method_name, kwargs)
    if not cls.reuse_dist_env:
        pool = _RankPool(size, backend, init_dist=cls.init_distributed)
        try:
            pool.run(task, cls.timeout_s)
        finally:
            pool.close()
        return
    pool = _POOLS.get(size, backend)
    try:
        pool.run(task, cls.timeout_s)
    except BaseException:
        _POOLS.discard(size, backend)
        raise


def _wrap_method(cls, name: str, fn) -> Any:
    sizes = getattr(fn, "_ds_world_size", None) or cls.world_size
    sizes = [sizes] if isinstance(sizes, int) else list(sizes)
    params = [  # drop `self`, and fixtures each rank makes for itself
        p for p in list(inspect.signature(fn).parameters.values())[1:] if p.name not in _RANK_LOCAL_FIXTURES
    ]
    ws_param = inspect.Parameter("_ds_world_size", inspect.Parameter.KEYWORD_ONLY)

    @functools.wraps(fn)
    def run_on_ranks(self, *args, _ds_world_size: int, **kwargs):
        call_kwargs = dict(zip([p.name for p in params], args))
        call_kwargs.update(kwargs)
        _run_distributed(type(self), name, _ds_world_size, call_kwargs)

    del run_on_ranks.__wrapped__  # pytest must see the wrapper's signature, not the original's
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    run_on_ranks.__signature__ = inspect.Signature([self_param, *params, ws_param])
    ids = [f"ws{s}" for s in sizes]
    return pytest.mark.parametrize("_ds_world_size", sizes, ids=ids)(run_on_ranks)


class DistributedTest:
    """Base class: every `test_*` method runs on `world_size` spawned ranks (see module doc)."""

    world_size: Any = 2
    backend: Optional[str] = None  # default: the accelerator's (gloo on CPU, nccl on CUDA)
    timeout_s: float = DEFAULT_TIMEOUT_S
    reuse_dist_env: bool = True
    init_distributed: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._ds_originals = dict(getattr(cls, "_ds_originals", {}))
        for name, fn in list(vars(cls).items()):
            if name.startswith("test") and callable(fn):
                cls._ds_originals[name] = fn
                setattr(cls, name, _wrap_method(cls, name, fn))


class LogRecords(logging.Handler):
    """The messages a logger emits at `level` or above, as text (add it to the deepspeed
    logger, which does not propagate to pytest's capture)."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.messages: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
