"""Capacity: the largest decoder that trains a few steps under a host-memory cap, with ZeRO-3's
parameters and optimizer state offloaded to the CPU or to NVMe (issue 44 item 6).

    python benchmarks/bench_capacity.py [--cap-gib 8] [--modes cpu,nvme] [--budget-s 1800]
        [--dir DIR] [--width 2048] [--start-layers 8] [--json out.json] [--impl ours|upstream]

Each probe is one process (1 rank, fp32, AdamW, batch 1 x `--seq` tokens, `--steps` steps)
put into a fresh cgroup-v1 memory group capped at `--cap-gib` (`memory.limit_in_bytes`, and
`memory.memsw.limit_in_bytes` where present, so swap cannot stand in for memory); the group is
removed after. The cap counts the page cache the process fills, as the kernel does: the
swap files' writes may fill it, and it is reclaimed before anything is killed. A probe
killed by the kernel's OOM killer (SIGKILL, or `oom_kill` in `memory.oom_control`) "does not
fit". Without a writable cgroup-v1 memory controller (not root, cgroup v2 only) the cap
falls back to `prlimit --as` (RLIMIT_AS: address space, not resident memory, so it refuses
sizes that would fit; the report's `cap_method` says which was used).

Sizes are searched by layers at a fixed width: doubling from `--start-layers` until a probe
fails, then bisecting between the last fit and the first failure, within `--max-probes` per
mode and `--budget-s` in all. Each probe records the parameter count, whether it fit, the
group's peak memory (`memory.max_usage_in_bytes`, page cache included) and the process's peak
RSS, the median step time, the swap bytes on disk (allocated blocks under the swap folder,
measured after the steps) and the losses. With `--checkpoint`, each probe also saves a
checkpoint before its last step and, after it, loads the checkpoint and runs that step again,
all under the cap: the record's `checkpoint` holds the save and load times, the checkpoint's
bytes and whether the repeated step's loss equals the first one's. Then the largest NVMe model that fit runs again
under a looser guard (`--reference-gib`, default 10: never an unbounded process on a shared
machine) to check the capped run's losses against it: the same config, the same math.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MARK = "@@capacity@@"
PHASE = "@@phase@@"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GIB = 1 << 30
# --impl upstream: DeepSpeed 0.19.8 in setup_upstream.sh's venv, its ops JIT-built into the
# cache bench_train_step uses (async_io needs libaio-dev: `apt-get install libaio-dev`).
UPSTREAM_PYTHON = HERE / ".venv-upstream" / "bin" / "python"
EXTENSIONS_DIR = HERE / ".cache" / "torch_extensions"


# ----------------------------------------------------------------------------- the worker


def decoder_spec(width: int, layers: int, seq: int = 16, vocab: int = 512) -> dict:
    """The train-step decoder's spec (benchmarks/_train_workers.py), sized by width and layers."""
    return {"model": "decoder", "vocab": vocab, "seq": seq, "width": width, "layers": layers}


def param_count(width: int, layers: int, seq: int = 16, vocab: int = 512) -> int:
    """Exact parameter count of `_train_workers.Decoder` (untied head)."""
    per_block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width)
    per_block += (4 * width * width + 4 * width) + (4 * width * width + width)
    return vocab * width + seq * width + layers * per_block + 2 * width + width * vocab


def ds_config(
    mode: str, width: int, swap_dir: str, param_buffers: int = 4, optimizer_buffers: int = 9
) -> dict:
    """Stage 3, fp32, AdamW (DeepSpeedCPUAdam), parameters and optimizer offloaded to `mode`
    ("cpu", "nvme", or "nvme_optimizer": the optimizer to NVMe, the parameters to the CPU)."""
    biggest = 4 * width * width  # the MLP's weights: the largest partition at 1 rank
    zero: dict = {
        "stage": 3,
        "stage3_prefetch_bucket_size": 3 * width * width,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 13 * width * width,
        "reduce_bucket_size": 4 * width * width,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    }
    if mode not in ("cpu", "nvme", "nvme_optimizer"):
        raise ValueError(f"mode={mode!r}; use 'cpu', 'nvme' or 'nvme_optimizer'")
    if mode == "nvme":
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": swap_dir,
            "buffer_count": param_buffers,
            "buffer_size": biggest,
            "max_in_cpu": 13 * width * width,  # about one block's partitions
        }
    if mode in ("nvme", "nvme_optimizer"):  # nvme_optimizer: parameters stay on the CPU
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": swap_dir,
            "buffer_count": optimizer_buffers,
            "pipeline_read": True,
            "pipeline_write": True,
        }
        zero["sub_group_size"] = biggest  # 9 buffers x 4 bytes x this: 0.6 GB at width 2048
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }


def disk_bytes(folder: str) -> int:
    """Blocks allocated under `folder` (the swap files are reserved at full size)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _phase(name: str) -> None:
    """Where the worker got to, and its RSS then: the controller keeps the last one of a probe
    that was killed (`killed_after`)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(PHASE, name, rss, flush=True)


def worker(args) -> None:
    import torch
    from _train_workers import build_model, make_batches

    import deepspeed

    spec = decoder_spec(args.width, args.layers, args.seq)
    spec.update(heads=max(1, args.width // 128), batch=1)
    cfg = ds_config(args.mode, args.width, args.swap_dir, args.param_buffers, args.optimizer_buffers)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    start = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=cfg):  # partitions leave as each module is built
        model = build_model(spec)
    _phase("built")
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    _phase("initialized")
    setup_s = time.perf_counter() - start
    batches = make_batches(spec, 0)
    losses, times = [], []
    resumed: dict = {}
    for i in range(args.steps):
        x, y = batches[i % len(batches)]
        if args.checkpoint_dir and i == args.steps - 1:  # the last step runs twice, around a load
            began = time.perf_counter()
            engine.save_checkpoint(args.checkpoint_dir, tag="probe")
            resumed["save_s"] = time.perf_counter() - began
            _phase("checkpoint saved")
        began = time.perf_counter()
        loss = engine(x, y)
        _phase(f"step {i} forward")
        engine.backward(loss)
        _phase(f"step {i} backward")
        engine.step()
        _phase(f"step {i} optimizer")
        times.append(time.perf_counter() - began)
        losses.append(float(loss.detach()))
    if resumed:
        began = time.perf_counter()
        engine.load_checkpoint(args.checkpoint_dir, tag="probe")
        resumed["load_s"] = time.perf_counter() - began
        _phase("checkpoint loaded")
        x, y = batches[(args.steps - 1) % len(batches)]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        _phase("resumed step")
        resumed["loss"] = float(loss.detach())
        resumed["equal"] = resumed["loss"] == losses[-1]  # the same step from the loaded state
        resumed["bytes"] = disk_bytes(args.checkpoint_dir)
    report = {
        "checkpoint": resumed or None,
        "params": sum(p.ds_numel for p in engine.module.parameters()),
        "setup_s": setup_s,
        "step_s": times,
        "losses": losses,
        "worker_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "disk_bytes": disk_bytes(args.swap_dir) - (resumed or {}).get("bytes", 0),  # the swap files
        "deepspeed_file": deepspeed.__file__,
    }
    print(MARK, json.dumps(report), flush=True)
    if args.impl == "upstream":
        # Upstream 0.19.8 with NVMe aborts in its interpreter teardown ("terminate called
        # without an active exception": its async_io handle's threads), after the report is
        # out; leave without the teardown so the exit status says how the probe went.
        sys.stderr.flush()
        os._exit(0)


# ----------------------------------------------------------------------------- the cap


def cgroup_unavailable_reason() -> str:
    """'' when a cgroup-v1 memory group can be made here, else why not."""
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup-v1 memory controller at {CGROUP_ROOT}"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (needs root)"
    return ""


class MemoryGroup:
    """A child memory cgroup capped at `limit` bytes; `command` wraps a command to run in it."""

    def __init__(self, limit: int) -> None:
        self.path = CGROUP_ROOT / f"ds_capacity_{os.getpid()}_{time.monotonic_ns()}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        memsw = self.path / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # the memory limit must be set first: memsw >= memory
            memsw.write_text(str(limit))

    def command(self, argv: list) -> list:
        # The shell joins the group, then becomes the worker: nothing runs uncapped.
        procs = str(self.path / "cgroup.procs")
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def oom_kills(self) -> int:
        for line in self.read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        for _ in range(50):  # the group empties a moment after its last process is reaped
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def worker_command(
    impl: str,
    mode: str,
    layers: int,
    width: int,
    seq: int,
    steps: int,
    swap_dir: str,
    param_buffers: int = 4,
    optimizer_buffers: int = 9,
) -> tuple:
    """`(argv, env)` of one worker: this checkout's package (ours) or upstream's venv."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    python = sys.executable
    if impl == "upstream":
        python = str(UPSTREAM_PYTHON)
        env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR))
    elif impl == "ours":
        env["PYTHONPATH"] = str(HERE.parent)
    else:
        raise ValueError(f"--impl {impl!r}; use 'ours' or 'upstream'")
    argv = [python, str(Path(__file__).resolve()), "--worker", "--impl", impl, "--mode", mode]
    argv += ["--param-buffers", str(param_buffers), "--optimizer-buffers", str(optimizer_buffers)]
    argv += ["--layers", str(layers), "--width", str(width), "--seq", str(seq)]
    argv += ["--steps", str(steps), "--swap-dir", swap_dir]
    return argv, env


def warm_up(impl: str) -> None:
    """One tiny uncapped run per mode, so that a JIT build (upstream's cpu_adam and async_io)
    happens before any probe: its compiler would otherwise count against the cap."""
    from _launch import free_port

    for mode in ("cpu", "nvme"):
        swap_dir = tempfile.mkdtemp(prefix="ds_capacity_warm_")
        try:
            argv, env = worker_command(impl, mode, 1, 256, 16, 1, swap_dir)
            env["MASTER_PORT"] = str(free_port())
            done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        finally:
            shutil.rmtree(swap_dir, ignore_errors=True)
        if done.returncode != 0:
            raise RuntimeError(f"bench_capacity: the {impl} warm-up ({mode}) failed:\n{done.stdout[-3000:]}")


def run_probe(mode: str, layers: int, cap: int, opts) -> dict:
    """One capped training process; returns its record (fits, memory, times, disk)."""
    from _launch import free_port

    swap_dir = tempfile.mkdtemp(prefix="ds_capacity_", dir=opts.dir)
    argv, env = worker_command(
        opts.impl,
        mode,
        layers,
        opts.width,
        opts.seq,
        opts.steps,
        swap_dir,
        opts.param_buffers,
        opts.optimizer_buffers,
    )
    if opts.checkpoint:  # inside the swap folder: removed with it
        argv += ["--checkpoint-dir", os.path.join(swap_dir, "checkpoint")]
    env["MASTER_PORT"] = str(free_port())
    if opts.mmap_threshold:  # see --mmap-threshold; a threshold the caller set is kept
        for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
            env.setdefault(key, str(opts.mmap_threshold))
    record: dict = {"impl": opts.impl, "mode": mode, "layers": layers, "width": opts.width, "cap_bytes": cap}
    record["param_buffers"], record["optimizer_buffers"] = opts.param_buffers, opts.optimizer_buffers
    record["params"] = param_count(opts.width, layers, opts.seq)
    record["load_before"] = os.getloadavg()
    group: Optional[MemoryGroup] = None
    if opts.cap_method == "cgroup":
        group = MemoryGroup(cap)
        record["cgroup"] = str(group.path)
        argv = group.command(argv)
    else:
        argv = ["prlimit", f"--as={cap}", *argv]
    began = time.perf_counter()
    try:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=opts.probe_timeout_s)
            record["timed_out"] = False
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            record["timed_out"] = True
        record["returncode"] = proc.returncode
        if group is not None:
            record["group_peak_bytes"] = int(group.read("memory.max_usage_in_bytes"))
            record["failcnt"] = int(group.read("memory.failcnt"))
            record["oom_kills"] = group.oom_kills()
    finally:
        if group is not None:
            group.remove()
        shutil.rmtree(swap_dir, ignore_errors=True)
    record["wall_s"] = time.perf_counter() - began
    record["load_after"] = os.getloadavg()
    killed = proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) or record.get("oom_kills", 0) > 0
    lines = [ln for ln in out.splitlines() if ln.startswith(MARK)]
    if lines and proc.returncode == 0:
        result = json.loads(lines[-1][len(MARK) :])
        record.update(result, fits=True, median_step_s=statistics.median(result["step_s"]))
    else:
        record["fits"] = False
        record["failure"] = (
            "out of memory (killed)" if killed else ("timeout" if record["timed_out"] else "error")
        )
        if not killed:
            record["output_tail"] = out[-3000:]
    phases = [ln.split()[1:] for ln in out.splitlines() if ln.startswith(PHASE)]
    record["phases"] = [(" ".join(p[:-1]), int(p[-1])) for p in phases]  # (where, RSS bytes)
    if not record["fits"]:
        record["killed_after"] = record["phases"][-1][0] if phases else "start"
    return record


# ----------------------------------------------------------------------------- the search


def search(probe, start: int, max_probes: int, deadline: float, log) -> list:
    """`probe(layers)` from `start` layers, doubling until a probe runs out of memory, then
    bisecting between the largest fit and the smallest failure; at most `max_probes`, and no
    new probe after `deadline` (time.monotonic). An error or a timeout ends the search: it
    bounds nothing."""
    probes: list = []
    fit, fail = 0, 0  # layers: largest that fit, smallest that did not (0: none yet)
    layers = start
    while len(probes) < max_probes and time.monotonic() < deadline:
        record = probe(layers)
        probes.append(record)
        log(record)
        if record["fits"]:
            fit = max(fit, layers)
        else:
            if record["failure"] not in ("out of memory (killed)",):
                break  # an error or a timeout is no size bound: stop rather than guess
            fail = layers if not fail else min(fail, layers)
        if fail and fail - fit <= 1:
            break
        if not fail:
            layers *= 2
        elif not fit:
            layers = max(1, layers // 2)
            if layers == fail:
                break
        else:
            layers = (fit + fail) // 2
    return probes


def largest(probes: list) -> Optional[dict]:
    fitting = [p for p in probes if p["fits"]]
    return max(fitting, key=lambda p: p["params"]) if fitting else None


def summarize(result: dict) -> str:
    """The probes as a markdown table."""
    rows = [
        "| impl | mode | layers | params | fits | group peak GiB | worker peak RSS GiB | median step s | disk GB |"
    ]
    rows.append("|---|---|---:|---:|---|---:|---:|---:|---:|")
    for p in result["probes"]:
        peak = p.get("group_peak_bytes")
        cells = [
            p.get("impl", "ours"),
            p["mode"],
            str(p["layers"]),
            f"{p['params'] / 1e9:.3f} B",
            "yes" if p["fits"] else p["failure"],
        ]
        cells.append("-" if peak is None else f"{peak / GIB:.2f}")
        if p["fits"]:
            cells += [
                f"{p['worker_max_rss_bytes'] / GIB:.2f}",
                f"{p['median_step_s']:.1f}",
                f"{p['disk_bytes'] / 1e9:.2f}",
            ]
        else:
            cells += ["-", "-", "-"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="nvme")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--swap-dir", default="")
    parser.add_argument("--checkpoint-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="each probe also saves a checkpoint before its last step, loads it after, and runs "
        "that step again: its loss must equal the first run's (all under the cap)",
    )
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument(
        "--reference-gib", type=float, default=10.0, help="guard of the reference run (0: skip it)"
    )
    parser.add_argument("--modes", default="cpu,nvme")
    parser.add_argument("--impl", default="ours", choices=("ours", "upstream"))
    parser.add_argument(
        "--param-buffers",
        type=int,
        default=4,
        help="offload_param.buffer_count (NVMe): ours copies a partition out of its buffer; upstream "
        "0.19.8 computes from its buffers and asserts 'Not enough buffers' below what a step holds",
    )
    parser.add_argument(
        "--optimizer-buffers",
        type=int,
        default=9,
        help="offload_optimizer.buffer_count (NVMe): 9 is what ours needs for AdamW with both pipelines; "
        "upstream 0.19.8's pipelined swapper asserts it 'ran out of swap buffers' with 9 on this model",
    )
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--start-layers", default="cpu=8,nvme=16", help="first probe's layers per mode")
    parser.add_argument("--max-probes", type=int, default=4, help="per mode")
    parser.add_argument("--budget-s", type=float, default=1800.0, help="no new probe after this")
    parser.add_argument("--probe-timeout-s", type=float, default=900.0)
    parser.add_argument("--dir", default=None, help="folder for the swap files (default: the temp folder)")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=1 << 20,
        help="MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ of each probe (0: glibc's dynamic ones): "
        "with the dynamic threshold the heap kept the swapped sub-groups' freed buffers, 12 B/param",
    )
    opts = parser.parse_args(argv)
    if opts.worker:
        worker(opts)
        return {}
    return run(opts)


def run(opts) -> dict:
    reason = cgroup_unavailable_reason()
    opts.cap_method = "prlimit_as" if reason else "cgroup"
    if reason:
        print(
            f"bench_capacity: {reason}; capping with prlimit --as (RLIMIT_AS, address space: stricter than RSS)"
        )
    opts.start_layers = {k: int(v) for k, v in (kv.split("=") for kv in opts.start_layers.split(","))}
    cap = int(opts.cap_gib * GIB)
    deadline = time.monotonic() + opts.budget_s
    log = lambda r: print(json.dumps({k: v for k, v in r.items() if k != "output_tail"}), flush=True)  # noqa: E731
    result: dict = {"cap_bytes": cap, "cap_method": opts.cap_method, "cap_unavailable_reason": reason}
    result["mmap_threshold"] = opts.mmap_threshold
    result["machine"] = {"cpus": os.cpu_count(), "load_start": os.getloadavg()}
    result["probes"] = []
    result["impl"] = opts.impl
    warm_up(opts.impl)
    for mode in opts.modes.split(","):
        probe = lambda layers, mode=mode: run_probe(mode, layers, cap, opts)  # noqa: E731
        probes = search(probe, opts.start_layers[mode], opts.max_probes, deadline, log)
        result["probes"] += probes
        best = largest(probes)
        result[f"largest_{mode}"] = (
            None if best is None else {"params": best["params"], "layers": best["layers"]}
        )
    best = largest([p for p in result["probes"] if p["mode"] == "nvme"])
    if best is not None:
        result["nvme_state_bytes_formula"] = 16 * best["params"]  # fp32 params 4 + masters 4 + Adam 8
        result["nvme_disk_bytes"] = best["disk_bytes"]
        result["nvme_state_over_cap"] = 16 * best["params"] / cap
        if opts.reference_gib and time.monotonic() < deadline:
            ref = run_probe("nvme", best["layers"], int(opts.reference_gib * GIB), opts)
            log(ref)
            result["reference"] = ref
            result["losses_equal"] = ref["fits"] and ref["losses"] == best["losses"]
    result["machine"]["load_end"] = os.getloadavg()
    print(summarize(result))
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
