"""How much does `GatheredParameters` cost over one raw all-gather of the same bytes?

    python benchmarks/bench_gather.py                 # 2 CPU ranks on gloo, P = 1, 10, 100
    python benchmarks/bench_gather.py --json out.json --world-size 4
    python benchmarks/bench_gather.py --quick         # seconds; what the smoke test runs

For each parameter count P a model of P parameters (odd sizes, 1D and 2D, about
`--total-mb` MB of fp32 in all) is built under `deepspeed.zero.Init`. Each repetition then
times the variants back to back, in a fresh order each repetition (seeded by the
repetition, so every rank agrees), so that machine drift and position hit all of them alike:

  (a) start_stop  `g = GatheredParameters(params).start(); g.stop()`
  (b) with        `with GatheredParameters(params): pass`
  (c) raw         one `deepspeed.comm.all_gather_into_tensor` of this rank's total shard
                  size (padding included) into a preallocated output: the lower bound.
  (d) copy_floor  (c), then one `torch.split_with_sizes_copy` of the rank-major output into
                  preallocated `[world, partition_size]` buffers, one per parameter: what a
                  gather that hands out one tensor per parameter pays at least (the copy is
                  timed at P = 1 too, where ours needs none: the output is the parameter).
  (e) fsdp2       `unshard()` then `reshard()` of the same shapes under PyTorch FSDP2
                  (`fully_shard` on a CPU device mesh, gloo), built outside Init.
  (f) swap_floor  (c), then `p.data = <a view of the output>` for each of P plain
                  `nn.Parameter`s of the same shapes, and back to an empty tensor: the least
                  a gather pays that makes each parameter's data its full tensor for a while
                  (as ours, FSDP and upstream do), without any bookkeeping.

Each timed region starts after a `dist.barrier()`; a repetition's time is the max over
ranks, and the figure reported is the median over repetitions (after warm-up). Each
variant gathers from and into buffers of its own, touched once per repetition as ours are
(see `_variants`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import deepspeed
from deepspeed import comm as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402 - the benchmarks folder is not a package

VARIANTS = ("start_stop", "with", "raw_allgather", "copy_floor", "fsdp2", "swap_floor")


def param_shapes(count: int, total_elems: int) -> list:
    """`count` shapes of odd element counts (so shards are padded), alternately 1D and 2D."""
    per = max(total_elems // count, 16)
    shapes = []
    for i in range(count):
        numel = (per + (i % 7) * 3 - 9) | 1
        if i % 2 == 0:
            shapes.append((numel,))
        else:
            rows = 3 + (i % 5) * 2
            shapes.append((rows, max(numel // rows, 1) | 1))
    return shapes


class ParamBank(nn.Module):
    """A module owning one parameter per shape (converted by Init when its __init__ returns)."""

    def __init__(self, shapes: list) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(*shape)))


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(bodies: dict, names: list, warmup: int, reps: int) -> dict:
    """{name: median over `reps` of the slowest rank's time of `bodies[name]()`} (collective).

    Interleaved, in a fresh order each repetition (the same on every rank: the seed is the
    repetition), so that neither drift, nor "who runs right after the barrier", nor "who runs
    right after FSDP2 freed its memory" favours one variant. A plain rotation keeps each
    variant's predecessor fixed.
    """
    for _ in range(warmup):
        for name in names:
            bodies[name]()
    local = []
    for rep in range(reps):
        order = random.Random(rep).sample(names, len(names))
        times = {name: _timed(bodies[name]) for name in order}
        local.extend(times[name] for name in names)
    worst = _launch.max_over_ranks(local)  # per repetition and variant: the slowest rank
    return {name: statistics.median(worst[i :: len(names)]) for i, name in enumerate(names)}


def _fsdp2_bank(shapes: list, world_size: int):
    """The same shapes as one FSDP2 module (`fully_shard` on a CPU mesh); None without FSDP2."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return None
    bank = ParamBank(shapes)
    fully_shard(bank, mesh=init_device_mesh("cpu", (world_size,)))
    return bank


def _variants(params: list, shapes: list, world_size: int) -> dict:
    """The timed bodies for one model.

    Each body gathers from and into memory of its own, as ours does (its shards and its
    pooled full buffer): a buffer shared by several bodies is touched several times per
    repetition and stays in cache, which made the raw all-gather 1.3x faster at P = 100
    than the same call on buffers of its own (2 ranks, 4 MB, Zen 4; 1.07x at P = 1).
    """
    sizes = [p.partition_numel() for p in params]
    shard_elems = sum(sizes)

    def buffers() -> tuple:
        return torch.randn(shard_elems), torch.empty(world_size * shard_elems)

    raw_in, raw_out = buffers()
    copy_in, copy_out = buffers()
    swap_in, swap_out = buffers()
    rows = copy_out.view(world_size, shard_elems)
    per_param = [torch.empty(world_size, n) for n in sizes]
    fsdp2 = _fsdp2_bank(shapes, world_size)
    plain = [nn.Parameter(torch.empty(0)) for _ in shapes]
    empty = torch.empty(0)
    offsets = [0]
    for shape in shapes:
        offsets.append(offsets[-1] + torch.Size(shape).numel())
    views = [swap_out[a:b].view(shape) for a, b, shape in zip(offsets, offsets[1:], shapes)]
    swaps = list(zip(plain, views))

    def start_stop() -> None:
        g = deepspeed.zero.GatheredParameters(params).start()
        g.stop()

    def with_form() -> None:
        with deepspeed.zero.GatheredParameters(params):
            pass

    def raw() -> None:
        dist.all_gather_into_tensor(raw_out, raw_in)

    def copy_floor() -> None:
        dist.all_gather_into_tensor(copy_out, copy_in)
        torch.split_with_sizes_copy(rows, sizes, dim=1, out=per_param)

    def fsdp2_unshard() -> None:
        fsdp2.unshard()
        fsdp2.reshard()

    def swap_floor() -> None:
        dist.all_gather_into_tensor(swap_out, swap_in)
        for p, view in swaps:
            p.data = view
        for p, _ in swaps:
            p.data = empty

    return {
        "start_stop": start_stop,
        "with": with_form,
        "raw_allgather": raw,
        "copy_floor": copy_floor,
        "fsdp2": fsdp2_unshard if fsdp2 is not None else None,
        "swap_floor": swap_floor,
        "shard_elems": shard_elems,
    }


def _check_gather(params: list, shapes: list) -> None:
    """Outside the timed loop: the gather must really produce every full tensor."""
    with deepspeed.zero.GatheredParameters(params):
        got = [tuple(p.data.shape) for p in params]
    if got != [tuple(s) for s in shapes]:
        raise RuntimeError(f"gathered shapes {got[:3]}... differ from the built shapes {shapes[:3]}...")
    if any(p.data.numel() != 0 for p in params):
        raise RuntimeError("parameters are still gathered after GatheredParameters stopped")


def measure_one(count: int, cfg: dict, world_size: int) -> dict:
    """Build a P=`count` model under Init and time the three variants, interleaved."""
    shapes = param_shapes(count, cfg["total_elems"])
    with deepspeed.zero.Init():
        model = ParamBank(shapes)
    params = list(model.parameters())
    _check_gather(params, shapes)
    bodies = _variants(params, shapes, world_size)
    names = [name for name in VARIANTS if bodies[name] is not None]
    medians = dict.fromkeys(VARIANTS)
    medians.update(interleaved_medians(bodies, names, cfg["warmup"], cfg["reps"]))
    numel = sum(p.ds_numel for p in params)
    ours = medians["start_stop"]
    return {
        "params": count,
        "bytes": numel * 4,
        "shard_bytes_per_rank": bodies["shard_elems"] * 4,
        "start_stop_s": ours,
        "with_s": medians["with"],
        "raw_allgather_s": medians["raw_allgather"],
        "copy_floor_s": medians["copy_floor"],
        "fsdp2_s": medians["fsdp2"],
        "swap_floor_s": medians["swap_floor"],
        "ratio_vs_raw_allgather": ours / medians["raw_allgather"],
        "swap_floor_vs_raw_allgather": medians["swap_floor"] / medians["raw_allgather"],
        "ratio_vs_swap_floor": ours / medians["swap_floor"],
        "start_stop_vs_with": ours / medians["with"],
        "ratio_vs_copy_floor": ours / medians["copy_floor"],
        "ratio_vs_fsdp2": ours / medians["fsdp2"] if medians["fsdp2"] else None,
        "reps": cfg["reps"],
    }


def summary(results: dict) -> dict:
    """The headline ratios over every P: the worst (largest) of each, None where unmeasured."""
    out = {}
    for key in WORST_OVER_P:
        values = [row[key] for row in results.values() if row[key] is not None]
        out[key] = max(values) if values else None
    out["worst_case"] = {
        key: max(results, key=lambda k: results[k][key] or 0.0) if out[key] is not None else None
        for key in WORST_OVER_P
    }
    return out


# The ratios `summary` reports as their worst over P.
WORST_OVER_P = (
    "ratio_vs_raw_allgather",
    "ratio_vs_copy_floor",
    "ratio_vs_fsdp2",
    "swap_floor_vs_raw_allgather",
    "ratio_vs_swap_floor",
)


def rank_worker(rank: int, world_size: int, cfg: dict) -> dict:
    del rank  # every rank returns the same (max-reduced) figures
    return {f"P={count}": measure_one(count, cfg, world_size) for count in cfg["counts"]}


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def format_table(results: dict, world_size: int) -> str:
    lines = [
        f"GatheredParameters vs raw all_gather_into_tensor, copy floor and FSDP2, {world_size} gloo CPU "
        "ranks (median of per-repetition max over ranks)",
        f"{'P':>5} {'bytes':>10} {'start/stop ms':>14} {'with ms':>9} {'raw ms':>8} {'floor ms':>9} "
        f"{'fsdp2 ms':>9} {'swap floor ms':>14} {'start_stop/raw':>15} {'start_stop/with':>16} "
        f"{'start_stop/floor':>17} {'start_stop/fsdp2':>17} {'swap floor/raw':>15} {'start_stop/swap floor':>22}",
    ]
    for row in results.values():
        fsdp2 = row["ratio_vs_fsdp2"]
        lines.append(
            f"{row['params']:>5} {row['bytes']:>10} {_ms(row['start_stop_s']):>14} {_ms(row['with_s']):>9} "
            f"{_ms(row['raw_allgather_s']):>8} {_ms(row['copy_floor_s']):>9} {_ms(row['fsdp2_s']):>9} "
            f"{_ms(row['swap_floor_s']):>14} {row['ratio_vs_raw_allgather']:>15.2f} {row['start_stop_vs_with']:>16.3f} "
            f"{row['ratio_vs_copy_floor']:>17.3f} {'-' if fsdp2 is None else f'{fsdp2:.3f}':>17} "
            f"{row['swap_floor_vs_raw_allgather']:>15.2f} {row['ratio_vs_swap_floor']:>22.2f}"
        )
    head = summary(results)
    lines.append(
        f"worst P: start/stop / raw {head['ratio_vs_raw_allgather']:.2f} (target <= 1.15; the swap floor "
        f"alone {head['swap_floor_vs_raw_allgather']:.2f}), start/stop / copy floor "
        f"{head['ratio_vs_copy_floor']:.3f} (target <= 1.1), "
        f"start/stop / FSDP2 {head['ratio_vs_fsdp2'] or float('nan'):.3f} (target <= 0.6)"
    )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks to spawn (default 2)")
    parser.add_argument("--params", default="1,10,100", help="comma-separated parameter counts P")
    parser.add_argument("--total-mb", type=float, default=4.0, help="fp32 MB of parameters per model")
    parser.add_argument("--reps", type=int, default=60, help="timed repetitions per variant (>= 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few reps (smoke test)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.total_mb, args.reps, args.warmup = 0.25, 5, 1
    return args


def run_config(args: argparse.Namespace) -> dict:
    """What the rank workers take from the parsed arguments (this file's and bench_gather_layouts')."""
    return {
        "counts": [int(c) for c in args.params.split(",") if c.strip()],
        "total_elems": int(args.total_mb * 2**20 / 4),
        "reps": args.reps,
        "warmup": args.warmup,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = run_config(args)
    results = _launch.run_ranks(rank_worker, args.world_size, args=(cfg,))[0]
    print(format_table(results, args.world_size))
    if args.json:
        report = {
            **summary(results),
            "gather": results,
            "world_size": args.world_size,
            "backend": "gloo",
            "machine": _launch.machine_info(),
            "torch": _launch.machine_info()["torch"],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
