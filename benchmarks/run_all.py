"""Every benchmark in one go: train step, gather, init memory, scaling, CPU Adam, rank agreement, GPT-2 small,
sequence parallelism, multi-node ZeRO (hierarchical), async I/O bandwidth.

    python benchmarks/run_all.py                       # ~20 min on 2 shared cores (make bench)
    python benchmarks/run_all.py --quick --skip-upstream --out-dir /tmp/r   # a ~2.5 min smoke run

Sections (each reuses the functions of the script named, nothing is re-implemented here):
  train_step  bench_train_step.py: decoder and MLP, fp32 and bf16, ours / upstream DeepSpeed
              0.19.8 / FSDP2 / DDP / single, 2 ranks, plus ours and upstream at ZeRO stages 1
              and 2 in the same rounds; headline: decoder fp32
  gather      bench_gather.py: P = 1, 10, 100, start/stop vs with vs one raw all-gather, vs
              raw + copy-out into preallocated per-parameter buffers, vs FSDP2, plus
              upstream's `with GatheredParameters` on the same shapes (_gather_upstream.py,
              run with the upstream venv's python); headline: P = 100
  init        bench_init_memory.py: peak RSS under Init vs S/N + L at world sizes 1, 2, 4
              (glibc's default malloc); headline: the max over world sizes and ranks
  scaling     the decoder (fp32) at world sizes 1, 2, 4, ours (ZeRO-3, -1, -2) and FSDP2: step
              time and the per-rank live tensor bytes between steps (parameters + grads +
              optimizer state); at 2 ranks ZeRO-2 with offload_optimizer, bytes by device
  cpu_adam    bench_cpu_adam.py: ours / torch foreach / torch fused / upstream / memory floor
  agreement   bench_agreement.py: the rank-agreement collectives per Init and per step, and
              Init and step time with the checks on and off
  gpt2_small  bench_gpt2_small.py: a GPT-2-small-sized decoder (124M parameters, fp32): ours /
              upstream / FSDP2 / DDP at 2 ranks in alternating rounds (step time, live bytes,
              peak RSS, collectives), ours at world sizes 1, 2, 4 against 16 B/param / N
  sequence_parallel  bench_sequence_parallel.py: Ulysses' activation bytes per rank at sp = 1, 2,
              4, with and without tiling, over sp = 1's; all-to-all bytes per layer against the
              formula; the longest sequence trained within an RSS cap per rank (sp = 1, 2)
  hierarchical  bench_hierarchical.py: 4 ranks as 2 nodes x 2, plain ZeRO-3 / MiCS / hpZ /
              hpZ+qwZ+qgZ: one step's cross-node and within-node bytes (summed over ranks) and
              the median step time, each over plain ZeRO-3's
  aio         bench_aio.py: deepspeed.ops.aio's read and write bandwidth (io_uring and thread-pool
              backends) on a 512 MiB file against dd with O_DIRECT on the same file size and
              folder; headline: engine / dd for the backend a default handle gets here
  nvme_optimizer  bench_train_step.py's decoder (fp32, 2 ranks, ZeRO-2): offload_optimizer nvme
              (swap files in a temporary folder, pipelines on) against offload_optimizer cpu, in
              the same rounds; headline: the step-time ratio nvme / cpu
  capacity    bench_capacity.py (NOT in the default list: ~25 min, ask with --only capacity):
              the largest decoder (width 2048, fp32, ZeRO-3, AdamW, 1 rank) that trains 2 steps
              in an 8 GiB cgroup, offload_param + offload_optimizer nvme and cpu; headline:
              its parameters, and its 16 B/param of fp32 state over the cap

Writes `<out-dir>/latest.json`, `latest.md` (the headline tables, also printed) and
`latest.png` (when matplotlib is installed). `--skip-upstream` reports upstream as null.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _launch  # noqa: E402 - the benchmarks folder is not a package
import _report  # noqa: E402
import bench_agreement  # noqa: E402
import bench_aio  # noqa: E402
import bench_capacity  # noqa: E402
import bench_cpu_adam  # noqa: E402
import bench_gather  # noqa: E402
import bench_gpt2_small  # noqa: E402
import bench_hierarchical  # noqa: E402
import bench_init_memory  # noqa: E402
import bench_sequence_parallel  # noqa: E402
import bench_train_step  # noqa: E402

from deepspeed.utils.progress import progress_bar  # noqa: E402

GATHER_UPSTREAM = HERE / "_gather_upstream.py"
GATHER_MARK = "@@gather@@"
SCALING_ROUNDS = 3  # the scaling section's rounds, whatever --rounds says (see run_scaling)
HEADLINE_TRAIN = ("ours_s", "upstream_deepspeed_s", "fsdp2_s", "ddp_s", "single_s")
HEADLINE_TRAIN += ("ratio_vs_upstream", "ratio_vs_fsdp2")
# ZeRO stages 1 and 2 (ours and upstream's same stage, beside DDP in the same rounds).
HEADLINE_TRAIN += ("ours_stage1_s", "upstream_stage1_s", "ours_stage2_s", "upstream_stage2_s")
# Ratios whose target holds for every case: each also reported as `<key>_worst`.
WORST_CASE_RATIOS = (
    "ratio_vs_ddp",  # ZeRO-3
    "stage1_ratio_vs_ddp",
    "stage2_ratio_vs_ddp",
    "stage1_ratio_vs_upstream",
    "stage2_ratio_vs_upstream",
)
HEADLINE_TRAIN += WORST_CASE_RATIOS


def _section(title: str) -> float:
    print(f"\n#### {title}  (load average {os.getloadavg()[0]:.2f})", flush=True)
    return time.monotonic()


# ----------------------------------------------------------------------------- train step


def _train_args(opts, impls: str, world_size: int = 2) -> argparse.Namespace:
    """bench_train_step's own arguments, for the size of run `opts` asks for."""
    argv = ["--impls", impls, "--world-size", str(world_size)]
    if opts.quick:
        argv.append("--quick")
    else:
        argv += ["--rounds", str(opts.rounds), "--steps", "2", "--warmup", "2"]
    targs = bench_train_step.parse_args(argv)
    if opts.quick:
        targs.rounds = 1
    targs.upstream_python = opts.upstream_python
    return targs


def run_train(opts, log_dir: Path) -> dict:
    began = _section("train step")
    names = [
        i for i in bench_train_step.DEFAULT_IMPLS if not (opts.skip_upstream and i.startswith("upstream"))
    ]
    if opts.quick:  # a smoke run: the sharded peers and DDP are enough (the others report null)
        names = [i for i in names if i in ("ours", "upstream", "fsdp2", "ddp", "ours_z1", "ours_z2")]
    targs = _train_args(opts, ",".join(names))
    impls = bench_train_step.chosen_impls(targs)
    bench_train_step.EXTENSIONS_DIR.mkdir(parents=True, exist_ok=True)
    models = ["decoder"] if opts.quick else ["decoder", "mlp"]
    dtypes = ["fp32"] if opts.quick else ["fp32", "bf16"]
    cases = {}
    for model in models:
        for dtype in dtypes:
            cases[f"{model}_{dtype}"] = bench_train_step.measure(model, dtype, targs, impls, log_dir)
    headline = cases["decoder_fp32"]
    out = {key: headline[key] for key in HEADLINE_TRAIN}
    # The DDP and stage 1/2 targets hold for every case: the worst case over models and dtypes.
    for key in WORST_CASE_RATIOS:
        values = [case[key] for case in cases.values() if case[key] is not None]
        out[key + "_worst"] = max(values) if values else None
    out.update(headline_case="decoder_fp32", world_size=targs.world_size, cases=cases)
    out["wall_s"] = round(time.monotonic() - began, 1)
    return out


def run_nvme_optimizer(opts, log_dir: Path) -> dict:
    began = _section("nvme_optimizer: offload_optimizer nvme vs cpu, decoder fp32, ZeRO-2")
    targs = _train_args(opts, f"{bench_train_step.OFFLOAD_IMPL},{bench_train_step.NVME_IMPL}")
    entry = bench_train_step.measure("decoder", "fp32", targs, bench_train_step.chosen_impls(targs), log_dir)
    keys = ("ours_stage2_offload_s", "ours_stage2_nvme_s", "nvme_ratio_vs_cpu_offload")
    out = {key: entry[key] for key in keys}
    out.update(sub_group_size=bench_train_step.NVME_SUB_GROUP, swap_folder=str(log_dir), case=entry)
    out["wall_s"] = round(time.monotonic() - began, 1)
    return out


def run_capacity(opts, log_dir: Path) -> dict:
    """bench_capacity.py: the largest decoder trained under the memory cap (--quick: width 256,
    2 layers, a 1.5 GiB cap, one probe per mode, each also saving, loading and resuming a
    checkpoint), swap files in this run's temporary folder."""
    began = _section("capacity: the largest decoder trained under a memory cap, cpu vs nvme offload")
    if opts.quick:
        argv = ["--cap-gib", "1.5", "--width", "256", "--start-layers", "cpu=2,nvme=2", "--max-probes", "1"]
        argv += ["--reference-gib", "3", "--steps", "2", "--checkpoint"]  # save, load, resume under the cap
    else:
        argv = ["--cap-gib", "8", "--start-layers", "nvme=22,cpu=4", "--max-probes", "3", "--steps", "2"]
        argv += ["--budget-s", "1800", "--modes", "nvme,cpu"]
    out = bench_capacity.main([*argv, "--dir", str(log_dir)])
    out["wall_s"] = round(time.monotonic() - began, 1)
    return out


# ----------------------------------------------------------------------------- gather


def run_gather(opts) -> dict:
    began = _section("gather")
    gargs = bench_gather.parse_args(["--quick"] if opts.quick else ["--reps", "200"])
    cfg = bench_gather.run_config(gargs)
    ours = _launch.run_ranks(bench_gather.rank_worker, gargs.world_size, args=(cfg,))[0]
    print(bench_gather.format_table(ours, gargs.world_size))
    upstream = None if opts.skip_upstream else gather_upstream(cfg, gargs.world_size, opts.upstream_python)
    for key, row in ours.items():
        up = (upstream or {}).get(key) or {}
        row["upstream_with_s"] = up.get("with_s")
        row["upstream_raw_allgather_s"] = up.get("raw_allgather_s")
        row["ratio_vs_upstream_with"] = row["with_s"] / up["with_s"] if up.get("with_s") else None
    head = ours[f"P={max(cfg['counts'])}"]
    worst = bench_gather.summary(ours)  # bench_gather.WORST_OVER_P, each the worst P
    return {
        **{key: worst[key] for key in bench_gather.WORST_OVER_P},
        "start_stop_vs_with": head["start_stop_vs_with"],
        "worst_case": worst["worst_case"],
        "upstream_with_s": {key: row["upstream_with_s"] for key, row in ours.items()},
        "headline_case": f"P={max(cfg['counts'])}",
        "world_size": gargs.world_size,
        "cases": ours,
        "wall_s": round(time.monotonic() - began, 1),
    }


def _rank_env(rank: int, world_size: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=str(bench_train_step.EXTENSIONS_DIR),
        CUDA_VISIBLE_DEVICES="",
    )
    return env


def gather_upstream(cfg: dict, world_size: int, python: Path, timeout_s: float = 300.0):
    """Upstream's `with GatheredParameters` on bench_gather's shapes; None when it cannot run."""
    if not python.exists():
        print(
            f"upstream gather: {python} is missing (bash benchmarks/setup_upstream.sh); null", file=sys.stderr
        )
        return None
    cases = {f"P={c}": bench_gather.param_shapes(c, cfg["total_elems"]) for c in cfg["counts"]}
    spec = json.dumps({"cases": cases, "reps": cfg["reps"], "warmup": cfg["warmup"]})
    port = _launch.free_port()
    with tempfile.TemporaryFile("w+") as errors:
        procs = [
            subprocess.Popen(
                [str(python), str(GATHER_UPSTREAM), "--spec", spec],
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                stderr=errors,
                env=_rank_env(r, world_size, port),
                text=True,
                cwd=str(HERE),
            )
            for r in range(world_size)
        ]
        try:
            stdout, _ = procs[0].communicate(timeout=timeout_s)
            for p in procs[1:]:
                p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stdout = ""
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        errors.seek(0)
        log = errors.read()
    return _parse_upstream_gather(stdout, log, [p.returncode for p in procs])


def _parse_upstream_gather(stdout: str, log: str, codes: list):
    lines = [line for line in stdout.splitlines() if line.startswith(GATHER_MARK)]
    if not lines or any(codes):
        tail = "\n".join((stdout + log).splitlines()[-30:])
        print(f"upstream gather failed (exit codes {codes}); reported as null:\n{tail}", file=sys.stderr)
        return None
    result = json.loads(lines[-1][len(GATHER_MARK) :])
    print("upstream DeepSpeed `with GatheredParameters` (median ms): ", end="")
    print(", ".join(f"{k} {1e3 * v['with_s']:.3f}" for k, v in result["cases"].items()))
    return result["cases"]


# ----------------------------------------------------------------------------- init memory


def run_init(opts) -> dict:
    began = _section("init memory")
    iargs = bench_init_memory.parse_args(["--quick"] if opts.quick else [])
    layers, layer_bytes = bench_init_memory.layer_plan(int(iargs.size_mb * 2**20), iargs.width)
    cfg = {
        "width": iargs.width,
        "layers": layers,
        "layer_bytes": layer_bytes,
        "size_bytes": layers * layer_bytes,
    }
    world_sizes = [1, 2] if opts.quick else [1, 2, 4]
    runs = [bench_init_memory.run_world(n, "default", cfg) for n in world_sizes]
    print(bench_init_memory.format_table(runs, cfg))
    return {
        "peak_rss_ratio_to_ideal": max(run["peak_rss_ratio_to_ideal"] for run in runs),
        "malloc": "default",
        "size_bytes": cfg["size_bytes"],
        "largest_layer_bytes": layer_bytes,
        "layers": layers,
        "width": iargs.width,
        "cases": {str(run["world_size"]): run for run in runs},
        "wall_s": round(time.monotonic() - began, 1),
    }


# ----------------------------------------------------------------------------- scaling


def _scaling_one(impls: list, targs, log_dir: Path) -> dict:
    spec = bench_train_step.model_spec("decoder", "fp32", targs)
    groups, infos, errors = bench_train_step.start_groups(impls, spec, targs, log_dir)
    memory = {}
    try:
        times, cpu, faults, losses, run_errors = bench_train_step.run_rounds(
            groups, targs.rounds, targs.steps
        )
        for impl, group in groups.items():
            memory[impl] = group.command({"cmd": "memory"}, timeout_s=120)
    finally:
        for group in groups.values():
            group.close()
    errors.update(run_errors)
    entry = bench_train_step.summarize(times, cpu, faults, losses, infos, errors)
    params = entry["params"] or 0
    n = targs.world_size

    def per_rank(impl: str):
        return max(memory[impl]["state_bytes"]) if impl in memory else None

    case = {
        "world_size": n,
        "ours_s": entry["ours_s"],
        "fsdp2_s": entry["fsdp2_s"],
        "ours_stage1_s": entry["ours_stage1_s"],
        "ours_stage2_s": entry["ours_stage2_s"],
        "ratio_vs_fsdp2": entry["ratio_vs_fsdp2"],
        "ours_state_bytes_per_rank": per_rank("ours"),
        "fsdp2_state_bytes_per_rank": per_rank("fsdp2"),
        "ours_stage1_state_bytes_per_rank": per_rank("ours_z1"),
        "ours_stage2_state_bytes_per_rank": per_rank("ours_z2"),
        # fp32 parameters, grads and AdamW's two moments, split evenly: 16 bytes per parameter.
        "ideal_zero3_bytes_per_rank": 16 * params / n,
        # Stages 1 and 2: full fp32 parameters (4 B) plus this rank's 1/N of the fp32 master
        # (shared with the parameter's slice in fp32) and the two moments: 4 + 12/N bytes/param.
        "ideal_zero12_bytes_per_rank": (4 + 12 / n) * params,
        "state_bytes_by_rank": {impl: m["state_bytes"] for impl, m in memory.items()},
        "live_bytes_by_device": {impl: m.get("live_by_device") for impl, m in memory.items()},
        "optimizer_bytes_by_device": {impl: m.get("optimizer_by_device") for impl, m in memory.items()},
        # Ours' shared-memory transport buffers, left out of the state bytes (_train_workers).
        "shm_segment_bytes": {impl: m.get("shm_segment_bytes") for impl, m in memory.items()},
        "params": params,
        "timed_steps": entry["timed_steps"],
        "final_loss": losses,
        "errors": errors,
    }
    off = bench_train_step.OFFLOAD_IMPL
    if off in memory:
        case["offload"] = offload_summary(
            memory[off], memory.get("ours_z2"), n, entry["ours_stage2_offload_s"]
        )
    return case


def offload_summary(off: dict, plain, world_size: int, step_s) -> dict:
    """Where ZeRO-2 + offload_optimizer keeps its bytes, by device, next to plain ZeRO-2 (rank 0).

    On a machine whose accelerator is the CPU every byte is on `cpu` with or without
    offload, so "no optimizer state on the accelerator" cannot be told apart from the
    default there: the summary says so instead of reporting a figure it did not measure.
    """
    accelerator = off.get("accelerator") or "cpu"
    opt = off.get("optimizer_by_device") or {}
    on_accel = None if accelerator == "cpu" else sum(v for d, v in opt.items() if d != "cpu")
    note = (
        "CPU-only machine: the accelerator is the CPU, so offloaded and non-offloaded optimizer state "
        "both live on `cpu` and the accelerator-resident figure cannot be measured here; the by-device "
        "split shows where every byte is"
        if accelerator == "cpu"
        else f"accelerator {accelerator}: optimizer bytes there should be 0 with offload"
    )
    return {
        "world_size": world_size,
        "accelerator": accelerator,
        "live_bytes_by_device": off.get("live_by_device"),
        "optimizer_bytes_by_device": opt,
        "optimizer_bytes_on_accelerator": on_accel,
        "state_bytes_per_rank": max(off["state_bytes"]),
        "plain_stage2_live_bytes_by_device": (plain or {}).get("live_by_device"),
        "plain_stage2_optimizer_bytes_by_device": (plain or {}).get("optimizer_by_device"),
        "step_s": step_s,
        "note": note,
    }


def run_scaling(opts, log_dir: Path) -> dict:
    began = _section("scaling: decoder fp32, ours (ZeRO-3, -1, -2) and FSDP2")
    world_sizes = [1, 2] if opts.quick else [1, 2, 4]
    # Offload (ZeRO-2 + offload_optimizer) at 2 ranks only. A smoke run: FSDP2 reported null,
    # stages 1 and 2 at 2 ranks only.
    impls = ["ours", "fsdp2", "ours_z1", "ours_z2"]
    cases = {}
    for world_size in world_sizes:
        group = [i for i in impls if not (opts.quick and (i == "fsdp2" or (i != "ours" and world_size != 2)))]
        group += [bench_train_step.OFFLOAD_IMPL] if world_size == 2 else []
        targs = _train_args(opts, ",".join(group), world_size)
        if not opts.quick:
            targs.rounds = SCALING_ROUNDS  # its figures are memory; world size 4 steps are slow
        print(f"  world size {world_size}", flush=True)
        cases[str(world_size)] = _scaling_one(group, targs, log_dir)
    print(_report.scaling_table(cases))
    offload = cases.get("2", {}).get("offload")
    if offload:
        print(_report.offload_text(offload))
    return {
        "model": "decoder",
        "dtype": "fp32",
        "cases": cases,
        "offload": offload,
        "wall_s": round(time.monotonic() - began, 1),
    }


# ----------------------------------------------------------------------------- cpu adam


def run_cpu_adam(opts) -> dict:
    """bench_cpu_adam.py: 1M, 8M and 64M params, fp32 and bf16, 1 and 2 threads."""
    _section("cpu adam: ours / torch foreach / torch fused / upstream / memory floor")
    print(bench_cpu_adam.format_header(), flush=True)
    if opts.quick:
        sizes, dtypes, threads, rounds = [2**20], ["fp32"], [2], 2
    else:
        sizes, dtypes, threads, rounds = [2**20, 8 * 2**20, 64 * 2**20], ["fp32", "bf16"], [1, 2], 7
    upstream = None if opts.skip_upstream else opts.upstream_python
    return bench_cpu_adam.run(sizes, dtypes, threads, rounds, 3, upstream)


def run_agreement(opts) -> dict:
    """bench_agreement.py: what the rank-agreement checks cost Init and a step (on vs off)."""
    _section("rank agreement checks: Init and a train step, checks on vs off")
    return bench_agreement.main(["--layers", "4", "--rounds", "2"] if opts.quick else [])


# ----------------------------------------------------------------------------- gpt2 small


def run_gpt2_small(opts, log_dir: Path) -> dict:
    """bench_gpt2_small.py: GPT-2 small side by side at 2 ranks, ours at 1, 2, 4 ranks."""
    _section("gpt2_small: 124M-parameter decoder, ours / upstream / FSDP2 / DDP, ours at 1, 2, 4 ranks")
    argv = ["--quick"] if opts.quick else []
    gopts = bench_gpt2_small.parse_args(argv + (["--skip-upstream"] if opts.skip_upstream else []))
    gopts.upstream_python = opts.upstream_python
    return bench_gpt2_small.run(gopts, log_dir)


# ----------------------------------------------------------------------------- sequence parallel


def run_sequence_parallel(opts) -> dict:
    """bench_sequence_parallel.py: activation ratios, all-to-all bytes, and L_max under a cap.

    --quick: the small shape at sp = 1 and 2 in one 2-rank run, and no L_max search (null,
    with the reason)."""
    began = _section("sequence_parallel: Ulysses activation bytes, all-to-all bytes, longest sequence")
    bsp = bench_sequence_parallel
    shape, length = (bsp.QUICK_SHAPE, 512) if opts.quick else (bsp.SHAPE, 4096)
    rows = bsp.activation_rows(shape, length, sps=(1, 2) if opts.quick else (1, 2, 4))
    print(bsp.format_table(rows, shape, length))
    out = {"shape": shape, "length": length, **bsp.summary(rows, shape["layers"])}
    for key, value in out.pop("activation_ratio").items():
        out[f"activation_ratio_{key}"] = value
    out["activation_ratio_sp4"] = out.get("activation_ratio_sp4")  # null in --quick
    out["activation_ratio_sp4_tiled"] = out.get("activation_ratio_sp4_tiled")
    if opts.quick:
        out["lmax"], out["lmax_cap_bytes"] = None, None
        out["lmax_note"] = "--quick: not searched (the full run does, in about 90 s)"
    else:
        cap = bsp.LMAX_CAP_BYTES
        out["lmax"] = bsp.longest_sequences(bsp.SHAPE, cap, bsp.LMAX_PLAN)
        out["lmax_cap_bytes"] = cap
        out["lmax_note"] = bsp.LMAX_NOTE
        print(bsp.format_lmax(out["lmax"], cap))
    out["rows"] = rows
    out["wall_s"] = round(time.monotonic() - began, 1)
    return out


# ----------------------------------------------------------------------------- multi-node ZeRO


def run_hierarchical(opts) -> dict:
    """bench_hierarchical.py: cross-node bytes and step time of MiCS, hpZ, hpZ+qwZ+qgZ vs ZeRO-3.

    --quick: a tiny decoder and one round (2 timed steps per layout)."""
    began = _section("hierarchical: 4 ranks as 2 nodes x 2, cross-node bytes and step time per layout")
    bh = bench_hierarchical
    out = bh.measure(bh.QUICK_SPEC if opts.quick else bh.SPEC, 1 if opts.quick else bh.ROUNDS)
    print(bh.format_table(out))
    out["wall_s"] = round(time.monotonic() - began, 1)
    return out


# ----------------------------------------------------------------------------- async I/O


def run_aio(opts) -> dict:
    """bench_aio.py: engine read/write bandwidth per backend over dd's with O_DIRECT (--quick: 16 MiB)."""
    began = _section("aio: deepspeed.ops.aio bandwidth per backend against dd with O_DIRECT")
    out = bench_aio.run(bench_aio.parse_args(["--quick"] if opts.quick else []))
    out["wall_s"] = round(time.monotonic() - began, 1)
    return out


# ----------------------------------------------------------------------------- main


def _versions(opts) -> dict:
    import torch

    import deepspeed

    upstream = None
    if not opts.skip_upstream and opts.upstream_python.exists():
        query = "from importlib.metadata import version as v; print(v('deepspeed'), v('torch'))"
        proc = subprocess.run([str(opts.upstream_python), "-I", "-c", query], capture_output=True, text=True)
        if proc.returncode == 0:
            ds, th = proc.stdout.split()
            upstream = {"deepspeed": ds, "torch": th}
    return {"torch": torch.__version__, "ours": deepspeed.__version__, "upstream": upstream}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps: a smoke run")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar (drawn on a terminal only)"
    )
    parser.add_argument("--skip-upstream", action="store_true", help="leave out upstream DeepSpeed (null)")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results", help="where latest.* go")
    # 25: a decoder step's time moves by 10-15% from step to step on this 2-core machine
    # (quartiles), so the median of 20 steps moved by about 6% and a ratio of two by about
    # 8%: ZeRO-2 against upstream read 0.70-0.86 in one day's runs of 10 rounds. 50 steps
    # halve the variance for about 5 more minutes (a round of the four cases takes ~20 s).
    parser.add_argument("--rounds", type=int, default=25, help="train-step rounds of 2 timed steps per peer")
    parser.add_argument("--upstream-python", type=Path, default=bench_train_step.UPSTREAM_PYTHON)
    parser.add_argument(
        "--only",
        default="train_step,gather,init,scaling,cpu_adam,agreement,gpt2_small,sequence_parallel,hierarchical,aio,"
        "nvme_optimizer",
        help="comma list of sections to run (others null, or kept with --update)",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the sections not run from <out-dir>/latest.json (re-measure one section after a "
        "disturbed run); the header names the sections re-measured",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load_before = os.getloadavg()
    runners = {
        "train_step": lambda tmp: run_train(opts, tmp),
        "gather": lambda tmp: run_gather(opts),
        "init": lambda tmp: run_init(opts),
        "scaling": lambda tmp: run_scaling(opts, tmp),
        "cpu_adam": lambda tmp: run_cpu_adam(opts),
        "agreement": lambda tmp: run_agreement(opts),
        "gpt2_small": lambda tmp: run_gpt2_small(opts, tmp),
        "sequence_parallel": lambda tmp: run_sequence_parallel(opts),
        "hierarchical": lambda tmp: run_hierarchical(opts),
        "aio": lambda tmp: run_aio(opts),
        "nvme_optimizer": lambda tmp: run_nvme_optimizer(opts, tmp),
        "capacity": lambda tmp: run_capacity(opts, tmp),  # not in --only's default: ~25 min
    }
    only = {name for name in opts.only.split(",") if name}
    unknown = sorted(only - set(runners))
    if unknown:
        raise SystemExit(f"--only: unknown section(s) {unknown}; choose from {', '.join(runners)}")
    report: dict = dict.fromkeys(runners)
    previous = opts.out_dir / "latest.json"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    section_dates = dict.fromkeys(only, now)  # when each section in the report was measured
    if opts.update:
        if not previous.exists():
            raise SystemExit(
                f"--update keeps the other sections of {previous}, which does not exist; run without it"
            )
        kept = json.loads(previous.read_text())
        kept_dates = kept.get("section_dates") or {}
        for name in runners:
            if name not in only:
                report[name] = kept.get(name)
                if report[name] is not None:  # a section never measured has no date
                    section_dates[name] = kept_dates.get(name, kept.get("first_run_date", kept.get("date")))
    with tempfile.TemporaryDirectory(prefix="bench_all_") as tmp:
        chosen = [name for name in runners if name in only]  # the order of the report
        with progress_bar(len(chosen), "Benchmarks", unit="section", quiet=opts.quiet) as bar:
            for name in chosen:
                bar.set_postfix_str(name)  # the section running now
                report[name] = runners[name](Path(tmp))
                bar.update(1)
    report.update(
        machine=_report.machine(load_before),
        versions=_versions(opts),
        section_dates={name: section_dates[name] for name in runners if name in section_dates},
        date=now,
        quick=opts.quick,
        wall_s=round(time.monotonic() - started, 1),
    )
    _report.write_all(report, opts.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
