"""One training step (forward + backward + optimizer) on 2 CPU ranks: ours vs upstream vs FSDP2.

    python benchmarks/bench_train_step.py                  # decoder + MLP, fp32, ~5 min on 2 cores
    python benchmarks/bench_train_step.py --quick          # a smoke run, under a minute
    python benchmarks/bench_train_step.py --json out.json --dtype both --profile

Implementations, each on the same model (seed 0), the same per-rank batches and AdamW(lr=1e-3):
  ours      our deepspeed.initialize, ZeRO stage 3
  upstream  DeepSpeed 0.19.8 ZeRO stage 3, same config, in benchmarks/.venv-upstream
            (create it with `bash benchmarks/setup_upstream.sh`; without it: reported null)
  fsdp2     torch.distributed.fsdp.fully_shard on each block and on the root
  ddp       torch DistributedDataParallel
  single    one process, one rank's batch, no communication (the compute floor)

Every rank runs one torch thread (2 ranks on 2 cores). Each implementation runs in its own
group of processes (`_train_workers.py`), started once and warmed up; the groups then take
turns in rounds of `--steps` timed steps, the order rotating each round, so machine drift
hits all alike while the idle groups wait on a pipe. A step's time is the max over ranks
(after a barrier); the figure reported is the median over all timed steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _launch import free_port, machine_info  # noqa: E402 - the benchmarks folder is not a package

WORKER = HERE / "_train_workers.py"
MARK = "@@train@@"
UPSTREAM_PYTHON = HERE / ".venv-upstream" / "bin" / "python"
EXTENSIONS_DIR = HERE / ".cache" / "torch_extensions"
IMPLS = ("ours", "upstream", "fsdp2", "ddp", "single")

MODELS = {
    "decoder": dict(model="decoder", vocab=1024, seq=128, width=256, layers=4, heads=4, batch=4),
    "mlp": dict(model="mlp", width=1024, layers=6, batch=64),
}
# The same ZeRO-3 sizes for ours and upstream (elements).
ZERO_SIZES = dict(reduce_bucket_size=1_000_000, prefetch_bucket_size=1_000_000, persistence_threshold=10_000)


class WorkerGroup:
    """The processes of one implementation; rank 0 reports on stdout, lines marked with MARK."""

    def __init__(self, impl: str, python: str, world: int, spec: dict, log_dir: Path, instrument: bool):
        self.impl = impl
        self.world = world
        self.logs = [log_dir / f"{impl}{'-prof' if instrument else ''}-rank{r}.log" for r in range(world)]
        self.events: queue.Queue = queue.Queue()
        port = free_port()
        cmd = [python, str(WORKER), "--impl", impl, "--spec", json.dumps(spec)]
        if instrument:
            cmd.append("--instrument")
        self.procs = [self._spawn(cmd, r, port) for r in range(world)]
        threading.Thread(target=self._read_rank0, daemon=True).start()

    def _spawn(self, cmd: list, rank: int, port: int) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world),
            LOCAL_WORLD_SIZE=str(self.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            DS_ACCELERATOR="cpu",
            TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR),
            CUDA_VISIBLE_DEVICES="",
        )
        log = open(self.logs[rank], "w")  # noqa: SIM115 - closed with the process in close()
        stdout = subprocess.PIPE if rank == 0 else log
        return subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=stdout, stderr=log, env=env, text=True, cwd=str(HERE)
        )

    def _read_rank0(self) -> None:
        with open(self.logs[0], "a") as log:
            for line in self.procs[0].stdout:
                if line.startswith(MARK):
                    self.events.put(json.loads(line[len(MARK) :]))
                else:
                    log.write(line)
                    log.flush()
        self.events.put(None)  # rank 0's stdout closed: it exited

    def wait_event(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                if any(p.poll() not in (None, 0) for p in self.procs):
                    raise RuntimeError(self._failure("a rank exited")) from None
                continue
            if event is None:
                raise RuntimeError(self._failure("rank 0 exited"))
            return event
        raise RuntimeError(self._failure(f"no answer within {timeout_s:.0f} s"))

    def _failure(self, why: str) -> str:
        tails = []
        for path in self.logs:
            text = path.read_text(errors="replace") if path.exists() else ""
            tails.append(f"--- {path.name} (last lines) ---\n" + "\n".join(text.splitlines()[-25:]))
        return f"{self.impl}: {why}\n" + "\n".join(tails)

    def command(self, cmd: dict, timeout_s: float) -> dict:
        for p in self.procs:
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        return self.wait_event(timeout_s)

    def close(self) -> None:
        for p in self.procs:
            try:
                if p.poll() is None:
                    p.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def interpreter(impl: str, upstream_python: Path) -> str:
    return str(upstream_python) if impl == "upstream" else sys.executable


def start_groups(impls: list, spec: dict, args, log_dir: Path) -> tuple:
    """Start and warm up each group in turn (one at a time, so warm-ups do not compete)."""
    groups, infos, errors = {}, {}, {}
    for impl in impls:
        world = 1 if impl == "single" else args.world_size
        print(f"  starting {impl} ({world} process{'es' if world > 1 else ''}) ...", flush=True)
        group = WorkerGroup(impl, interpreter(impl, args.upstream_python), world, spec, log_dir, False)
        try:
            infos[impl] = group.wait_event(args.start_timeout)
            groups[impl] = group
        except RuntimeError as exc:
            errors[impl] = str(exc)
            print(f"  {impl} failed to start; reported as null:\n{exc}", file=sys.stderr, flush=True)
            group.close()
    return groups, infos, errors


def run_rounds(groups: dict, rounds: int, steps: int) -> tuple:
    """Rotate through the groups `rounds` times, `steps` timed steps each turn."""
    times = {impl: [] for impl in groups}
    losses, errors = {}, {}
    for r in range(rounds):
        order = list(groups)
        order = order[r % len(order) :] + order[: r % len(order)]
        for impl in order:
            if impl in errors:
                continue
            try:
                event = groups[impl].command({"cmd": "run", "steps": steps}, timeout_s=600)
            except RuntimeError as exc:
                errors[impl] = str(exc)
                print(f"  {impl} failed; reported as null:\n{exc}", file=sys.stderr, flush=True)
                continue
            times[impl].extend(event["times"])
            losses[impl] = event["loss"]
        print(f"  round {r + 1}/{rounds}: " + ", ".join(_median_text(times, i) for i in order), flush=True)
    return times, losses, errors


def _median_text(times: dict, impl: str) -> str:
    return f"{impl} {statistics.median(times[impl]):.3f}s" if times.get(impl) else f"{impl} -"
