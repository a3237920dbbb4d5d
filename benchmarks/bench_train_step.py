"""One training step (forward + backward + optimizer) on 2 CPU ranks: ours vs upstream vs FSDP2 vs DDP.

    python benchmarks/bench_train_step.py                  # decoder + MLP, fp32, ~6 min on 2 cores
    python benchmarks/bench_train_step.py --quick          # a smoke run, about a minute
    python benchmarks/bench_train_step.py --json out.json --dtype both --profile
    python benchmarks/bench_train_step.py --models decoder --impls ddp --rounds 1 \
        --profile --profile-impls ours_z1,ours_z2,ddp      # where a ZeRO-1/2 step spends its time

Implementations, each on the same model (seed 0), the same per-rank batches and AdamW(lr=1e-3):
  ours         our deepspeed.initialize, ZeRO stage 3
  upstream     DeepSpeed 0.19.8 ZeRO stage 3, same config, in benchmarks/.venv-upstream
               (create it with `bash benchmarks/setup_upstream.sh`; without it: reported null)
  fsdp2        torch.distributed.fsdp.fully_shard on each block and on the root
  ddp          torch DistributedDataParallel
  single       one process, one rank's batch, no communication (the compute floor)
  ours_z1/_z2  ours at ZeRO stage 1 / 2 (full parameters on every rank), same config otherwise
  upstream_z1/_z2  upstream 0.19.8 at stage 1 / 2, same config
  ours_z2_off  ours at stage 2 with offload_optimizer to the CPU (not in the default set)
  ours_z2_nvme ours at stage 2 with offload_optimizer to NVMe: swap files in the run's temporary
               folder, sub-groups of NVME_SUB_GROUP elements, pipeline_read and pipeline_write on
               (not in the default set; run_all's `nvme_optimizer` section sets it against ours_z2_off)

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
# ZeRO stages 1 and 2, ours and upstream, same config as the stage-3 pair except the stage.
STAGE_IMPLS = ("ours_z1", "upstream_z1", "ours_z2", "upstream_z2")
# Ours at stage 2 with offload_optimizer to the CPU (DeepSpeedCPUAdam): the memory-by-device check.
OFFLOAD_IMPL = "ours_z2_off"
# The same with the optimizer state in swap files (docs/nvme.md), in sub-groups of this many
# elements: the decoder's 1.85M master elements per rank make 8 groups, so the pipelines overlap.
NVME_IMPL = "ours_z2_nvme"
NVME_SUB_GROUP = 250_000
ALL_IMPLS = IMPLS + STAGE_IMPLS + (OFFLOAD_IMPL, NVME_IMPL)
DEFAULT_IMPLS = IMPLS + STAGE_IMPLS
NAMES = {
    "ours": "ours (ZeRO-3)",
    "upstream": "upstream DeepSpeed 0.19.8 ZeRO-3",
    "fsdp2": "FSDP2 fully_shard",
    "ddp": "DDP",
    "single": "single process (no comm)",
    "ours_z1": "ours ZeRO-1",
    "upstream_z1": "upstream 0.19.8 ZeRO-1",
    "ours_z2": "ours ZeRO-2",
    "upstream_z2": "upstream 0.19.8 ZeRO-2",
    "ours_z2_off": "ours ZeRO-2 + offload_optimizer cpu",
    "ours_z2_nvme": "ours ZeRO-2 + offload_optimizer nvme",
}
# JSON key of each implementation's median seconds per step.
TIME_KEYS = {
    "ours": "ours_s",
    "upstream": "upstream_deepspeed_s",
    "fsdp2": "fsdp2_s",
    "ddp": "ddp_s",
    "single": "single_s",
    "ours_z1": "ours_stage1_s",
    "upstream_z1": "upstream_stage1_s",
    "ours_z2": "ours_stage2_s",
    "upstream_z2": "upstream_stage2_s",
    "ours_z2_off": "ours_stage2_offload_s",
    "ours_z2_nvme": "ours_stage2_nvme_s",
}

MODELS = {
    "decoder": dict(model="decoder", vocab=1024, seq=128, width=256, layers=4, heads=4, batch=4),
    "mlp": dict(model="mlp", width=1024, layers=6, batch=128),
}
# --quick: a tiny decoder, so a smoke run is dominated by process start-up.
QUICK_DECODER = dict(MODELS["decoder"], seq=64, width=128, layers=2, batch=2)
# The same ZeRO-3 sizes for ours and upstream (elements).
# Stages 1 and 2 get the same reduce_bucket_size, and allgather_bucket_size for the
# all-gather of updated slices after a step.
ZERO_SIZES = dict(reduce_bucket_size=1_000_000, prefetch_bucket_size=1_000_000, persistence_threshold=10_000)
ZERO_SIZES.update(allgather_bucket_size=1_000_000)


class WorkerGroup:
    """The processes of one implementation; rank 0 reports on stdout, lines marked with MARK."""

    def __init__(self, impl: str, python: str, world: int, spec: dict, log_dir: Path, instrument: bool):
        self.impl = impl
        self.world = world
        name = f"{impl}{'-prof' if instrument else ''}"
        # One log per rank (stderr; rank > 0 also stdout), then rank 0's unmarked stdout lines.
        self.logs = [log_dir / f"{name}-rank{r}.log" for r in range(world)]
        self.logs.append(log_dir / f"{name}-rank0-stdout.log")
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
            CUDA_VISIBLE_DEVICES="",
        )
        if self.impl.startswith("upstream"):  # its one-off JIT build (ours keeps the user's cache)
            env["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS_DIR)
        else:  # ours is this checkout's package, whichever one the environment installed
            env["PYTHONPATH"] = str(HERE.parent)
        with open(self.logs[rank], "w") as log:  # the child keeps its own copy of the descriptor
            stdout = subprocess.PIPE if rank == 0 else log
            return subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=stdout, stderr=log, env=env, text=True, cwd=str(HERE)
            )

    def _read_rank0(self) -> None:
        with open(self.logs[-1], "w") as log:
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
    return str(upstream_python) if impl.startswith("upstream") else sys.executable


def start_groups(impls: list, spec: dict, args, log_dir: Path) -> tuple:
    """Start and warm up each group in turn (one at a time, so warm-ups do not compete)."""
    groups, infos, errors = {}, {}, {}
    for impl in impls:
        world = 1 if impl == "single" else args.world_size
        print(f"  starting {impl} ({world} process{'es' if world > 1 else ''}) ...", flush=True)
        began = time.monotonic()
        group = WorkerGroup(impl, interpreter(impl, args.upstream_python), world, spec, log_dir, False)
        try:
            infos[impl] = group.wait_event(args.start_timeout)
            groups[impl] = group
            print(f"    ready in {time.monotonic() - began:.1f} s (build + {spec['warmup']} warm-up steps)")
        except RuntimeError as exc:
            errors[impl] = str(exc)
            print(f"  {impl} failed to start; reported as null:\n{exc}", file=sys.stderr, flush=True)
            group.close()
    return groups, infos, errors


def run_rounds(groups: dict, rounds: int, steps: int) -> tuple:
    """Rotate through the groups `rounds` times, `steps` timed steps each turn."""
    times = {impl: [] for impl in groups}
    cpu = {impl: [] for impl in groups}
    faults = {impl: [] for impl in groups}
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
            cpu[impl].extend(event["cpu"])
            faults[impl].extend(event["faults"])
            losses[impl] = event["loss"]
        print(f"  round {r + 1}/{rounds}: " + ", ".join(_median_text(times, i) for i in order), flush=True)
    return times, cpu, faults, losses, errors


def count_collectives(groups: dict, failed: dict) -> dict:
    """Rank 0's collectives during one more (untimed) step of each group, by kind.

    `{impl: {"requested": {c10d op: calls}, "executed": {gloo kind: {"calls", "bytes"}}}}`:
    what the library asked torch.distributed for, and what gloo ran for it (on gloo a
    reduce-scatter runs as an all-reduce of the whole input, so the two can differ); see
    `_train_workers.count_collectives`. A group that fails here is left out, not fatal.
    """
    out = {}
    for impl, group in groups.items():
        if impl in failed or impl == "single":
            continue
        try:
            out[impl] = group.command({"cmd": "collectives"}, timeout_s=600)["collectives"]
        except RuntimeError as exc:
            print(f"  {impl}: counting collectives failed:\n{exc}", file=sys.stderr, flush=True)
    return out


def print_collectives(collectives: dict) -> None:
    """Calls per step on rank 0 by c10d op, and what ran: gloo's kinds (calls and MB it was
    handed) and ours through shared memory (`shm:` kinds, calls and MB produced)."""
    if not collectives:
        return
    print("  collectives in one step, rank 0 (asked for: c10d op x calls; ran: kind calls/MB):")
    for impl, counts in collectives.items():
        asked = ", ".join(
            f"{op.removeprefix('c10d::')} x{n}" for op, n in sorted(counts["requested"].items())
        )
        ran = ", ".join(
            f"{kind} {row['calls']}/{row['bytes'] / 2**20:.1f}"
            for kind, row in sorted(counts["executed"].items())
        )
        print(f"    {NAMES.get(impl, impl):34s} {asked or 'none'}; ran: {ran or 'none'}")


def _median_text(times: dict, impl: str) -> str:
    return f"{impl} {statistics.median(times[impl]):.3f}s" if times.get(impl) else f"{impl} -"


def _quantile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_ratio(cpu: dict, a: str, b: str):
    if not cpu.get(a) or not cpu.get(b):
        return None
    return statistics.median(cpu[a]) / statistics.median(cpu[b])


def summarize(times: dict, cpu: dict, faults: dict, losses: dict, infos: dict, errors: dict) -> dict:
    """The JSON entry for one (model, dtype): medians, ratios, spread, final losses."""
    med = {impl: (statistics.median(times[impl]) if times.get(impl) else None) for impl in ALL_IMPLS}

    def ratio(a: str, b: str):
        return med[a] / med[b] if med[a] and med[b] else None

    entry = {TIME_KEYS[impl]: med[impl] for impl in ALL_IMPLS}
    entry.update(
        ratio_vs_upstream=ratio("ours", "upstream"),
        ratio_vs_fsdp2=ratio("ours", "fsdp2"),
        ratio_vs_ddp=ratio("ours", "ddp"),
        # ZeRO stages 1 and 2: ours against DDP and against upstream's same stage.
        stage1_ratio_vs_ddp=ratio("ours_z1", "ddp"),
        stage2_ratio_vs_ddp=ratio("ours_z2", "ddp"),
        stage1_ratio_vs_upstream=ratio("ours_z1", "upstream_z1"),
        stage2_ratio_vs_upstream=ratio("ours_z2", "upstream_z2"),
        nvme_ratio_vs_cpu_offload=ratio("ours_z2_nvme", "ours_z2_off"),
        cpu_ratio_vs_upstream=_cpu_ratio(cpu, "ours", "upstream"),
        cpu_ratio_vs_fsdp2=_cpu_ratio(cpu, "ours", "fsdp2"),
        cpu_stage1_ratio_vs_ddp=_cpu_ratio(cpu, "ours_z1", "ddp"),
        cpu_stage2_ratio_vs_ddp=_cpu_ratio(cpu, "ours_z2", "ddp"),
        cpu_stage1_ratio_vs_upstream=_cpu_ratio(cpu, "ours_z1", "upstream_z1"),
        cpu_stage2_ratio_vs_upstream=_cpu_ratio(cpu, "ours_z2", "upstream_z2"),
        timed_steps={impl: len(times.get(impl, [])) for impl in ALL_IMPLS},
        p25_p75_s={i: [_quantile(t, 0.25), _quantile(t, 0.75)] for i, t in times.items() if t},
        min_s={i: min(t) for i, t in times.items() if t},
        # CPU seconds per step summed over ranks: robust to other jobs on a shared machine.
        cpu_s={i: statistics.median(c) for i, c in cpu.items() if c},
        # Minor page faults per step, summed over ranks: memory given back to the kernel and
        # faulted in again, zero-filled (host_malloc.py's note).
        minor_faults_per_step={i: statistics.median(f) for i, f in faults.items() if f},
        final_loss=losses,
        params=next((info["params"] for info in infos.values()), None),
        errors=errors,
        error_reasons={impl: error_reason(text) for impl, text in errors.items()},
    )
    return entry


def error_reason(text: str) -> str:
    """The last exception line of a failed group's log tails (what to record when a case cannot run)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("---")]
    found = [ln for ln in lines if "Error" in ln.split(":")[0] or "Exception" in ln.split(":")[0]]
    return (found or lines or [""])[-1][:300]


def print_table(title: str, entry: dict) -> None:
    print(f"\n{title}  ({entry['params']:,} parameters)")
    head = f"{'median s':>9s} {'p25..p75 s':>15s} {'min s':>7s} {'cpu s':>7s} {'faults':>7s} {'steps':>5s} {'loss':>8s}"
    print(f"  {'implementation':34s} {head}")
    for impl in ALL_IMPLS:
        value = entry[TIME_KEYS[impl]]
        if value is None and impl not in entry["errors"] and impl not in DEFAULT_IMPLS:
            continue
        spread = entry["p25_p75_s"].get(impl)
        loss = entry["final_loss"].get(impl)
        cells = [
            f"{value:9.4f}" if value else f"{'null':>9s}",
            f"{spread[0]:.3f}..{spread[1]:.3f}".rjust(15) if spread else " " * 15,
            f"{entry['min_s'][impl]:7.3f}" if impl in entry["min_s"] else " " * 7,
            f"{entry['cpu_s'][impl]:7.3f}" if impl in entry["cpu_s"] else " " * 7,
            f"{entry['minor_faults_per_step'][impl]:7.0f}"
            if impl in entry["minor_faults_per_step"]
            else " " * 7,
            f"{entry['timed_steps'][impl]:5d}",
            f"{loss:8.4f}" if loss is not None else " " * 8,
        ]
        print(f"  {NAMES[impl]:34s} " + " ".join(cells))
    for key, label in (
        ("ratio_vs_upstream", "ours / upstream"),
        ("ratio_vs_fsdp2", "ours / FSDP2"),
        ("ratio_vs_ddp", "ours / DDP"),
        ("stage1_ratio_vs_ddp", "ours ZeRO-1 / DDP"),
        ("stage2_ratio_vs_ddp", "ours ZeRO-2 / DDP"),
        ("stage1_ratio_vs_upstream", "ours ZeRO-1 / upstream ZeRO-1"),
        ("stage2_ratio_vs_upstream", "ours ZeRO-2 / upstream ZeRO-2"),
    ):
        value = entry[key]
        text = f"{value:.2f}x" if value else "n/a"
        cpu_value = entry.get("cpu_" + key)
        cpu_text = f", CPU time {cpu_value:.2f}x" if cpu_value else ""
        print(f"  {label}: {text}{cpu_text}  (below 1: ours is faster)")
    for impl, text in entry["errors"].items():
        print(f"  {NAMES.get(impl, impl)} could not run: {error_reason(text)}")


def model_spec(model: str, dtype: str, args) -> dict:
    sizes = QUICK_DECODER if args.quick and model == "decoder" else MODELS[model]
    zero = dict(ZERO_SIZES, max_reuse_distance=args.max_reuse_distance)
    return dict(sizes, **zero, dtype=dtype, warmup=args.warmup, threads=1)


def measure(model: str, dtype: str, args, impls: list, log_dir: Path) -> dict:
    spec = model_spec(model, dtype, args)
    if NVME_IMPL in impls:  # one folder for every rank (the config must agree); each swaps in its own
        spec.update(nvme_path=str(log_dir), sub_group_size=NVME_SUB_GROUP)
    print(
        f"\n== {model}, {dtype}: {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up",
        flush=True,
    )
    load_before = round(os.getloadavg()[0], 2)
    groups, infos, errors = start_groups(impls, spec, args, log_dir)
    try:
        times, cpu, faults, losses, run_errors = run_rounds(groups, args.rounds, args.steps)
        collectives = count_collectives(groups, run_errors)
    finally:
        for group in groups.values():
            group.close()
    errors.update(run_errors)
    entry = summarize(times, cpu, faults, losses, infos, errors)
    entry["spec"] = spec
    entry["collectives"] = collectives
    # Other jobs on a shared machine slow whichever group runs beside them: record the load.
    entry["loadavg_1m"] = {"before": load_before, "after": round(os.getloadavg()[0], 2)}
    entry["versions"] = {impl: _versions(info) for impl, info in infos.items()}
    print_table(f"train step: {model}, {dtype}, {args.world_size} ranks", entry)
    print_collectives(collectives)
    return entry


def _versions(info: dict) -> dict:
    keep = ("torch_version", "deepspeed_version", "deepspeed_file", "threads")
    return {k: info[k] for k in keep if k in info}


def profile_ours(model: str, dtype: str, args, log_dir: Path, impl: str = "ours") -> dict:
    """Our step on rank 0 under wall-clock timers (exclusive per function), then under cProfile."""
    spec = model_spec(model, dtype, args)
    if impl == NVME_IMPL:  # one folder for every rank (the config must agree); each swaps in its own
        spec.update(nvme_path=str(log_dir), sub_group_size=NVME_SUB_GROUP)
    print(f"\n== profile: {impl}, {model}, {dtype}, {args.profile_steps} steps", flush=True)
    group = WorkerGroup(impl, sys.executable, args.world_size, spec, log_dir, instrument=True)
    try:
        group.wait_event(args.start_timeout)
        timed = group.command({"cmd": "profile", "steps": args.profile_steps}, timeout_s=600)
        profiled = group.command({"cmd": "profile", "steps": args.profile_steps, "cprofile": True}, 600)
    finally:
        group.close()
    step_ms = 1e3 * statistics.mean(timed["times"])
    rows = timed["timers"]
    wrapped = sum(r["excl_ms"] for r in rows)
    print(f"  instrumented step: mean {step_ms:.1f} ms over ranks' max; wrapped functions {wrapped:.1f} ms")
    print(
        f"  {'function (exclusive = minus wrapped callees)':46s} {'calls/step':>10s} {'incl ms':>9s} {'excl ms':>9s}"
    )
    for r in rows[: args.profile_rows]:
        print(f"  {r['label']:46s} {r['calls_per_step']:10.1f} {r['incl_ms']:9.2f} {r['excl_ms']:9.2f}")
    print(f"  {'(rank-0 time outside the engine calls)':46s} {'':10s} {'':9s} {step_ms - wrapped:9.2f}")
    n = args.profile_steps
    print(f"  cProfile (rank 0, {n} steps; cProfile slows Python-heavy code), by cumulative time:")
    for r in profiled["cprofile_top"][: args.profile_rows]:
        print(f"    {r['func'][:60]:60s} {r['ncalls'] / n:8.1f}/step {1e3 * r['cumtime'] / n:8.2f} ms cum")
    print("  cProfile, by time inside the function itself (tottime):")
    for r in profiled["cprofile_top_self"][: args.profile_rows]:
        print(f"    {r['func'][:60]:60s} {r['ncalls'] / n:8.1f}/step {1e3 * r['tottime'] / n:8.2f} ms self")
    if timed.get("timers_missing"):
        print(f"  (not instrumented, missing in this engine: {', '.join(timed['timers_missing'])})")
    return {
        "impl": impl,
        "model": model,
        "dtype": dtype,
        "step_ms_instrumented": step_ms,
        "timers": rows,
        "cprofile_step_ms": 1e3 * statistics.mean(profiled["times"]),
        "cprofile_top": profiled["cprofile_top"],
        "cprofile_top_self": profiled["cprofile_top_self"],
        "timers_missing": timed.get("timers_missing", []),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a tiny decoder, 2 steps")
    parser.add_argument("--models", default="decoder,mlp", help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="fp32")
    parser.add_argument(
        "--impls", default=",".join(DEFAULT_IMPLS), help="comma list of: " + ", ".join(ALL_IMPLS)
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per group per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also profile our step (decoder)")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument(
        "--profile-impls", default="ours", help="which of ours, ours_z1, ours_z2, ours_z2_off to profile"
    )
    parser.add_argument("--profile-rows", type=int, default=22)
    parser.add_argument(
        "--max-reuse-distance",
        type=int,
        default=int(1e9),
        help="stage3_max_reuse_distance for ours and upstream (upstream's default 1e9 keeps a "
        "small model's parameters gathered from forward to backward; 0 re-gathers them)",
    )
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--upstream-python", type=Path, default=UPSTREAM_PYTHON)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.rounds, args.steps, args.warmup = "decoder", 2, 1, 1
        args.profile_steps = 2
    return args


def chosen_impls(args) -> list:
    impls = [i for i in args.impls.split(",") if i]
    unknown = sorted(set(impls) - set(ALL_IMPLS))
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; choose from {', '.join(ALL_IMPLS)}")
    upstream = [i for i in impls if i.startswith("upstream")]
    if upstream and not args.upstream_python.exists():
        print(
            f"upstream DeepSpeed: {args.upstream_python} is missing; create it with\n"
            "    bash benchmarks/setup_upstream.sh\n"
            "Running the others; upstream is reported as null.",
            file=sys.stderr,
        )
        impls = [i for i in impls if i not in upstream]
    return impls


def main(argv=None) -> int:
    args = parse_args(argv)
    impls = chosen_impls(args)
    EXTENSIONS_DIR.mkdir(parents=True, exist_ok=True)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    models = [m for m in args.models.split(",") if m]
    started = time.monotonic()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        log_dir = Path(tmp)
        for model in models:
            for dtype in dtypes:
                key = "train_step" + ("" if model == "decoder" else f"_{model}")
                key += "" if dtype == "fp32" else f"_{dtype}"
                results[key] = measure(model, dtype, args, impls, log_dir)
        if args.profile:
            for impl in [i for i in args.profile_impls.split(",") if i]:
                key = "profile_ours" if impl == "ours" else f"profile_{impl}"
                results[key] = profile_ours(models[0], dtypes[0], args, log_dir, impl)
    results.update(
        machine=machine_info(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        world_size=args.world_size,
        zero_config=dict(ZERO_SIZES, max_reuse_distance=args.max_reuse_distance),
        wall_s=round(time.monotonic() - started, 1),
    )
    print(f"\ntotal {results['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
