"""Which collective moves ZeRO's bytes fastest on CPU? The choices `deepspeed.comm` makes.

    python benchmarks/bench_collectives.py                  # 2 and 4 gloo CPU ranks
    python benchmarks/bench_collectives.py --quick          # seconds; what the smoke test runs

For each output size, each repetition times these back to back (rotating the order), on
one torch thread per rank, after a barrier; a repetition's time is the max over ranks and
the figure is the median over repetitions:

  all_gather_native     torch.distributed.all_gather_single (all_gather_into_tensor)
  all_gather_broadcast  one asynchronous broadcast per rank into its chunk of the output
  all_gather_ours       deepspeed.comm.all_gather_into_tensor (on one host: through shared
                        memory; DEEPSPEED_SHM_COMM=0: the faster of the two above)
  reduce_scatter_native torch.distributed.reduce_scatter_single
  all_reduce            torch.distributed.all_reduce of the whole input (what a reduce-scatter
                        that keeps its slice of an all-reduce pays)
  all_to_all_sum        torch.distributed.all_to_all_single, then the received rows added
  reduce_scatter_ours   deepspeed.comm.reduce_scatter_tensor (on one host: through shared
                        memory; DEEPSPEED_SHM_COMM=0: the all-to-all and sum)
  all_to_all_native     torch.distributed.all_to_all_single (equal slices), what qgZ's two hops
                        and Ulysses' sequence parallelism send
  all_to_all_ours       deepspeed.comm.all_to_all_single (on one host: through shared memory)

These are collective choices for CPU tensors on a gloo group; on nccl `deepspeed.comm` uses
the native all-gather and reduce-scatter (see [Note: shared-memory collectives] in
deepspeed/comm/shm.py, [Note: all-gather on gloo] and [Note: reduce-scatter on gloo] in
deepspeed/comm/comm.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402 - the benchmarks folder is not a package

VARIANTS = (
    "all_gather_native",
    "all_gather_broadcast",
    "all_gather_ours",
    "reduce_scatter_native",
    "all_reduce",
    "all_to_all_sum",
    "reduce_scatter_ours",
    "all_to_all_native",
    "all_to_all_ours",
)
_ALL_GATHER = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def _bodies(numel: int, world: int, rank: int) -> dict:
    from deepspeed import comm as dist

    out = torch.empty(numel)
    mine = torch.full((numel // world,), float(rank))
    full = torch.ones(numel)
    received = torch.empty(numel)

    def all_to_all_sum() -> None:
        tdist.all_to_all_single(received, full)
        rows = received.view(world, -1)
        mine.copy_(rows[0])
        for row in rows[1:]:
            mine.add_(row)

    def broadcast_each() -> None:
        out.view(-1).chunk(world)[rank].copy_(mine)
        works = [tdist.broadcast(c, src=i, async_op=True) for i, c in enumerate(out.chunk(world))]
        for w in works:
            w.wait()

    return {
        "all_gather_native": lambda: _ALL_GATHER(out, mine),
        "all_gather_broadcast": broadcast_each,
        "all_gather_ours": lambda: dist.all_gather_into_tensor(out, mine),
        "reduce_scatter_native": lambda: _REDUCE_SCATTER(mine, full),
        "all_reduce": lambda: tdist.all_reduce(full),
        "all_to_all_sum": all_to_all_sum,
        "reduce_scatter_ours": lambda: dist.reduce_scatter_tensor(mine, full, scratch=received),
        "all_to_all_native": lambda: tdist.all_to_all_single(received, full),
        "all_to_all_ours": lambda: dist.all_to_all_single(received, full),
    }


def _timed(fn) -> float:
    tdist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rank_worker(rank: int, world_size: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    results = {}
    for size_kb in cfg["sizes_kb"]:
        numel = (size_kb * 1024 // 4) // world_size * world_size
        bodies = _bodies(numel, world_size, rank)
        for _ in range(cfg["warmup"]):
            for name in VARIANTS:
                bodies[name]()
        local = []
        for rep in range(cfg["reps"]):
            order = [VARIANTS[(rep + k) % len(VARIANTS)] for k in range(len(VARIANTS))]
            times = {name: _timed(bodies[name]) for name in order}
            local.extend(times[name] for name in VARIANTS)
        worst = _launch.max_over_ranks(local)
        row = {name: statistics.median(worst[i :: len(VARIANTS)]) * 1e3 for i, name in enumerate(VARIANTS)}
        results[f"{size_kb}KB"] = {k + "_ms": round(v, 3) for k, v in row.items()}
    return results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes-kb", default="64,256,1024,4096,25600", help="output sizes, KB of fp32")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.sizes_kb, args.reps, args.warmup = "2", "64,512", 3, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = {"sizes_kb": [int(s) for s in args.sizes_kb.split(",")], "reps": args.reps, "warmup": args.warmup}
    report = {}
    for world in [int(w) for w in args.world_sizes.split(",")]:
        rows = _launch.run_ranks(rank_worker, world, args=(cfg,))[0]
        report[f"world_{world}"] = rows
        print(f"\n{world} gloo CPU ranks, median ms (max over ranks)")
        print(f"{'size':>8} " + " ".join(f"{v:>22}" for v in VARIANTS))
        for size, row in rows.items():
            print(f"{size:>8} " + " ".join(f"{row[v + '_ms']:>22.3f}" for v in VARIANTS))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
