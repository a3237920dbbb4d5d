"""Which all-gather layout lands a module's parameters in their full tensors fastest?

    python benchmarks/bench_gather_layouts.py            # 2 gloo CPU ranks, P = 1, 10, 100
    python benchmarks/bench_gather_layouts.py --quick    # seconds; what the smoke test runs

The measurement behind gather.py's coalescing note (benchmarks/README.md, "Gathers without
copy-out"). For the parameter shapes of bench_gather.py (about `--total-mb` MB of fp32 in P
parameters, odd sizes) each repetition times, back to back in a fresh order (seeded by the
repetition, so every rank agrees), after a `dist.barrier()`:

  raw          `deepspeed.comm.all_gather_into_tensor` of this rank's shards into one
               rank-major buffer (shared memory on one host): the lower bound
  flat         the same collective where the output IS the parameters' storage: FSDP1's flat
               layout, each rank's shard a slice of the concatenated parameters (other shard
               math than DeepSpeed's, so this is the collective alone)
  split        `all_gather_into_columns` into `[world, partition_size]` blocks laid back to
               back, one copy per block and rank out of the shared slots
  blocks       the same with a kept `shm.BlockPlan`: each rank writes its pieces where the
               blocks lie in the segment, every rank reads them back in one copy (gather.py's
               path)
  copy_floor   `raw`, then `torch.split_with_sizes_copy` into per-parameter buffers
  gloo_raw     gloo's own all-gather into one buffer (no shared memory)
  gloo_list    gloo's all-gather into a list of per-rank views of one buffer
  gloo_coal    one gloo all-gather per parameter into its own buffer, coalesced
               (`torch.distributed._coalescing_manager`)
  start_stop   `GatheredParameters(params).start(); .stop()`: ours, bookkeeping included

A repetition's time is the slowest rank's; the table gives the median over repetitions.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.comm import shm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402 - the benchmarks folder is not a package
from bench_gather import ParamBank, interleaved_medians, param_shapes, run_config  # noqa: E402

VARIANTS = (
    "raw",
    "flat",
    "split",
    "blocks",
    "copy_floor",
    "gloo_raw",
    "gloo_list",
    "gloo_coal",
    "start_stop",
)


def _bodies(params: list, world: int) -> dict:
    import torch.distributed as tdist  # gloo's own paths, past deepspeed.comm's shared memory

    sizes = [p.partition_numel() for p in params]
    n = sum(sizes)
    inp, out = torch.randn(n), torch.empty(world * n)
    rows = out.view(world, n)
    full = torch.empty(world * n)  # blocks laid out parameter by parameter, as gather.py's buffers
    blocks = [b.view(world, s) for b, s in zip(full.split([world * s for s in sizes]), sizes)]
    plans = [shm.BlockPlan(full, sizes)]
    per_param = [torch.empty(world, s) for s in sizes]
    per_param_flat = [t.view(-1) for t in per_param]
    shards = list(inp.split(sizes))
    gloo = tdist.new_group(backend="gloo")  # collective: every rank makes it here
    chunks = list(out.chunk(world))

    def copy_floor() -> None:
        dist.all_gather_into_tensor(out, inp)
        torch.split_with_sizes_copy(rows, sizes, dim=1, out=per_param)

    def gloo_coal() -> None:
        with tdist._coalescing_manager(group=gloo, async_ops=True) as manager:
            for o, i in zip(per_param_flat, shards):
                tdist.all_gather_into_tensor(o, i, group=gloo)
        manager.wait()

    def start_stop() -> None:
        deepspeed.zero.GatheredParameters(params).start().stop()

    return {
        "raw": lambda: dist.all_gather_into_tensor(out, inp),
        "flat": lambda: dist.all_gather_into_tensor(full, inp),
        "split": lambda: dist.all_gather_into_columns(blocks, sizes, inp),
        "blocks": lambda: dist.all_gather_into_columns(blocks, sizes, inp, plans=plans),
        "copy_floor": copy_floor,
        "gloo_raw": lambda: tdist.all_gather_into_tensor(out, inp, group=gloo),
        "gloo_list": lambda: tdist.all_gather(chunks, inp, group=gloo),
        "gloo_coal": gloo_coal,
        "start_stop": start_stop,
    }


def measure_one(count: int, cfg: dict, world: int) -> dict:
    with deepspeed.zero.Init():
        model = ParamBank(param_shapes(count, cfg["total_elems"]))
    bodies = _bodies(list(model.parameters()), world)
    return interleaved_medians(bodies, list(VARIANTS), cfg["warmup"], cfg["reps"])


def rank_worker(rank: int, world: int, cfg: dict) -> dict:
    del rank  # every rank returns the same (max-reduced) figures
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames its all-gather
    return {count: measure_one(count, cfg, world) for count in cfg["counts"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--params", default="1,10,100", help="comma-separated parameter counts P")
    parser.add_argument("--total-mb", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few reps (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.total_mb, args.reps, args.warmup = 0.25, 3, 1
    cfg = run_config(args)
    results = _launch.run_ranks(rank_worker, args.world_size, args=(cfg,))[0]
    print(
        f"all-gather layouts, {args.world_size} gloo CPU ranks, ms (x raw), median of per-repetition max over ranks"
    )
    print(f"{'P':>5} " + " ".join(f"{name:>14}" for name in VARIANTS))
    for count, row in results.items():
        cells = " ".join(f"{row[n] * 1e3:>7.3f} ({row[n] / row['raw']:.2f})" for n in VARIANTS)
        print(f"{count:>5} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
