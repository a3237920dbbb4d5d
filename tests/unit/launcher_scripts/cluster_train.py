"""A rank of the fake-cluster tests: join the job through `deepspeed.init_distributed`, report.

    cluster_train.py --out DIR [--mode allreduce|train|fail] [--fail_rank R]

Each rank writes DIR/rank<R>.json: what it was told (RANK, LOCAL_RANK, WORLD_SIZE, ...,
the fake host it runs on, a variable from .deepspeed_env) and, by mode:
allreduce  the sum of every rank's `rank + 1` over gloo (imports torch and deepspeed.comm only,
           which keeps a run of the whole grid of runners cheap);
train      the losses of 3 ZeRO-3 steps, averaged over the ranks, so that every run of the
           same world size reports the same numbers;
fail       rank R exits with code 7 once the job is up, while the others block in a collective
           it never joins (each records its pid first, so the test can check it is gone).
"""

import argparse
import json
import os
import sys
import time

import torch

import deepspeed.comm as dist

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
}
STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default="allreduce", choices=["allreduce", "train", "fail"])
    parser.add_argument("--fail_rank", type=int, default=-1)
    parser.add_argument("--hang", default="sleep", choices=["sleep", "collective"])
    args = parser.parse_args()
    dist.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    report.update(
        {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")},
        host=os.environ.get("FAKE_CLUSTER_HOST", "local"),
        mark=os.environ.get("FAKE_CLUSTER_MARK"),
        local_rank_arg=args.local_rank,
        rank=rank,
        world=world,
        pid=os.getpid(),
    )
    if args.mode == "fail":
        with open(os.path.join(args.out, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        dist.barrier()
        if rank == args.fail_rank:
            time.sleep(0.5)  # let the others enter the collective below first
            sys.exit(7)
        if args.hang == "collective":
            dist.all_reduce(torch.ones(1))  # gloo fails here once the failed rank's connections close
        # A hang the failed rank never ends (NCCL waits for its timeout): only the launchers help.
        time.sleep(120)
        return
    if args.mode == "allreduce":
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        report["sum"] = total.item()
    else:
        report["losses"] = train(rank, world)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()  # rank 0 hosts the store: leave together, not mid-teardown


def train(rank: int, world: int) -> list[float]:
    from torch import nn

    import deepspeed  # the engine and ZeRO-3: only this mode pays for importing them

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    data = torch.randn(STEPS, world, 2, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(STEPS):
        loss = engine(data[step, rank]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


if __name__ == "__main__":
    main()
