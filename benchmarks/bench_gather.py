"""How much does `GatheredParameters` cost over one raw all-gather of the same bytes?

    python benchmarks/bench_gather.py                 # 2 CPU ranks on gloo, P = 1, 10, 100
    python benchmarks/bench_gather.py --json out.json --world-size 4
    python benchmarks/bench_gather.py --quick         # seconds; what the smoke test runs

For each parameter count P a model of P parameters (odd sizes, 1D and 2D, about
`--total-mb` MB of fp32 in all) is built under `deepspeed.zero.Init`. Each repetition then
times the three variants back to back (rotating which goes first: abc, bca, cab, ...) so
that machine drift and position hit all three alike:

  (a) start_stop  `g = GatheredParameters(params).start(); g.stop()`
  (b) with        `with GatheredParameters(params): pass`
  (c) raw         one `deepspeed.comm.all_gather_into_tensor` of this rank's total shard
                  size (padding included) into a preallocated output: the lower bound.

Each timed region starts after a `dist.barrier()`; a repetition's time is the max over
ranks, and the figure reported is the median over repetitions (after warm-up).
"""

from __future__ import annotations

import argparse
import datetime
import json
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

VARIANTS = ("start_stop", "with", "raw_allgather")


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


def _variants(params: list, world_size: int) -> dict:
    """The three timed bodies for one model, sharing one raw buffer pair."""
    shard_elems = sum(p.partition_numel() for p in params)
    raw_in = torch.randn(shard_elems)
    raw_out = torch.empty(world_size * shard_elems)

    def start_stop() -> None:
        g = deepspeed.zero.GatheredParameters(params).start()
        g.stop()

    def with_form() -> None:
        with deepspeed.zero.GatheredParameters(params):
            pass

    def raw() -> None:
        dist.all_gather_into_tensor(raw_out, raw_in)

    return {"start_stop": start_stop, "with": with_form, "raw_allgather": raw, "shard_elems": shard_elems}


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
    bodies = _variants(params, world_size)
    for _ in range(cfg["warmup"]):
        for name in VARIANTS:
            bodies[name]()
    local = []
    for rep in range(cfg["reps"]):
        # Interleaved, and rotated each repetition (abc, bca, cab, ...) so that neither
        # drift nor "who runs right after the barrier" favours one variant.
        order = [VARIANTS[(rep + k) % len(VARIANTS)] for k in range(len(VARIANTS))]
        times = {name: _timed(bodies[name]) for name in order}
        local.extend(times[name] for name in VARIANTS)
    worst = _launch.max_over_ranks(local)  # per repetition and variant: the slowest rank
    medians = {name: statistics.median(worst[i :: len(VARIANTS)]) for i, name in enumerate(VARIANTS)}
    numel = sum(p.ds_numel for p in params)
    return {
        "params": count,
        "bytes": numel * 4,
        "shard_bytes_per_rank": bodies["shard_elems"] * 4,
        "start_stop_s": medians["start_stop"],
        "with_s": medians["with"],
        "raw_allgather_s": medians["raw_allgather"],
        "ratio_vs_raw_allgather": medians["start_stop"] / medians["raw_allgather"],
        "start_stop_vs_with": medians["start_stop"] / medians["with"],
        "reps": cfg["reps"],
    }


def rank_worker(rank: int, world_size: int, cfg: dict) -> dict:
    del rank  # every rank returns the same (max-reduced) figures
    return {f"P={count}": measure_one(count, cfg, world_size) for count in cfg["counts"]}


def format_table(results: dict, world_size: int) -> str:
    lines = [
        f"GatheredParameters vs raw all_gather_into_tensor, {world_size} gloo CPU ranks "
        "(median of per-repetition max over ranks)",
        f"{'P':>5} {'bytes':>10} {'start/stop ms':>14} {'with ms':>9} {'raw ms':>8} "
        f"{'start_stop/raw':>15} {'start_stop/with':>16}",
    ]
    for row in results.values():
        lines.append(
            f"{row['params']:>5} {row['bytes']:>10} {row['start_stop_s'] * 1e3:>14.3f} "
            f"{row['with_s'] * 1e3:>9.3f} {row['raw_allgather_s'] * 1e3:>8.3f} "
            f"{row['ratio_vs_raw_allgather']:>15.2f} {row['start_stop_vs_with']:>16.3f}"
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


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = {
        "counts": [int(c) for c in args.params.split(",") if c.strip()],
        "total_elems": int(args.total_mb * 2**20 / 4),
        "reps": args.reps,
        "warmup": args.warmup,
    }
    results = _launch.run_ranks(rank_worker, args.world_size, args=(cfg,))[0]
    print(format_table(results, args.world_size))
    if args.json:
        report = {
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
