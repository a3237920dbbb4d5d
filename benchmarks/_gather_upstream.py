"""Upstream DeepSpeed's `with deepspeed.zero.GatheredParameters(params)`, timed like bench_gather.py.

    benchmarks/.venv-upstream/bin/python benchmarks/_gather_upstream.py --spec '{...}'

Run by run_all.py with the upstream venv's interpreter, once per rank (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment, DS_ACCELERATOR=cpu). It imports only torch and
upstream deepspeed. The spec holds, per parameter count P, the exact shapes bench_gather.py
builds (computed by the caller), plus `reps` and `warmup`. Each repetition times, back to
back and in alternating order, `with GatheredParameters(params): pass` and one raw
`all_gather_into_tensor` of this rank's total shard size; each timed region starts after a
barrier, a repetition's time is the slowest rank's and the figure is the median. Rank 0
prints one line `@@gather@@ {json}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _launch import leave_distributed
from torch import nn

import deepspeed
from deepspeed import comm as dist

MARK = "@@gather@@"


class ParamBank(nn.Module):
    """One parameter per shape, partitioned by upstream's Init when __init__ returns."""

    def __init__(self, shapes: list) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(*shape)))


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(shapes: list, reps: int, warmup: int) -> dict:
    with deepspeed.zero.Init():
        model = ParamBank(shapes)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        got = [tuple(p.shape) for p in params if p.data.numel() == p.ds_numel]
    if len(got) != len(shapes):
        raise RuntimeError(f"upstream gathered {len(got)} of {len(shapes)} parameters in full")
    shard_elems = sum(p.ds_tensor.numel() for p in params)
    raw_in = torch.randn(shard_elems)
    raw_out = torch.empty(dist.get_world_size() * shard_elems)

    def with_form() -> None:
        with deepspeed.zero.GatheredParameters(params):
            pass

    def raw() -> None:
        dist.all_gather_into_tensor(raw_out, raw_in)

    bodies = (with_form, raw)
    for _ in range(warmup):
        for body in bodies:
            body()
    local = []
    for rep in range(reps):
        order = bodies if rep % 2 == 0 else bodies[::-1]
        times = {body: _timed(body) for body in order}
        local.extend(times[body] for body in bodies)
    worst = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst = worst.tolist()
    return {
        "params": len(shapes),
        "bytes": sum(p.ds_numel for p in params) * 4,
        "shard_bytes_per_rank": shard_elems * 4,
        "with_s": statistics.median(worst[0::2]),
        "raw_allgather_s": statistics.median(worst[1::2]),
        "reps": reps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--spec", required=True, help='JSON: {"cases": {"P=1": shapes, ...}, "reps", "warmup"}'
    )
    spec = json.loads(parser.parse_args().spec)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    results = {key: measure(shapes, spec["reps"], spec["warmup"]) for key, shapes in spec["cases"].items()}
    if dist.get_rank() == 0:
        payload = {"cases": results, "deepspeed_version": deepspeed.__version__, "torch": torch.__version__}
        print(MARK, json.dumps(payload), flush=True)
    dist.barrier()
    leave_distributed()


if __name__ == "__main__":
    main()
