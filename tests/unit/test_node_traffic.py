"""Cross-node and within-node bytes per step (issue 43 item 5): plain ZeRO-3 against MiCS.

The counter (deepspeed/comm/node_traffic.py, [Note: counting cross-node bytes]) counts the
bytes each rank receives from ranks of other nodes and of its own, from each collective's
group and the node layout. These tests check one step's tally exactly against the formula.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import groups
from tests.unit.common import DistributedTest

NUMELS = ((60, 10), (40,))  # the model's parameters, module by module
F32 = 4
# The step's one bookkeeping all-reduce over the parameters' group: the squared gradient norm and
# the reduce-order signature (optimizer.py), three float64s.
BOOKKEEPING = 3 * 8


def traffic_config(shard: int = -1, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "mics_shard_size": shard,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,  # one gather per module and pass
            "reduce_bucket_size": 10**8,  # every gradient in one reduce-scatter
            **zero,
        },
    }


def one_step(config: dict) -> dict:
    """This rank's tally of one training step (forward, backward, optimizer step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4, bias=False))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, 6, device=engine.device)
    dist.count_node_traffic(groups.node_layout())
    try:
        engine.backward(engine(x).sum())
        engine.step()
        return dist.node_traffic_totals()
    finally:
        dist.count_node_traffic(None)


def expected(world: int, per_node: int, shard: int) -> dict:
    """(cross, within) bytes this rank receives per step, by collective, under the direct-
    exchange model: `shard` = world is plain ZeRO-3; a shard group within a node is MiCS."""
    group = shard
    cross_members = max(group - per_node, 0)  # the group's members on other nodes
    within_members = min(group, per_node) - 1
    parts = [sum(math.ceil(n / group) for n in module) for module in NUMELS]
    gathered = 2 * sum(parts) * F32  # every module gathered in forward and again in backward
    want = {
        "gather": (cross_members * gathered, within_members * gathered),
        "reduce_scatter": (cross_members * sum(parts) * F32, within_members * sum(parts) * F32),
    }
    norm = 2 * BOOKKEEPING // group  # an all-reduce: a reduce-scatter and an all-gather
    want["all_reduce"] = (cross_members * norm, within_members * norm)
    replicas = world // shard
    if replicas > 1:  # the replicas' all-reduce of one shard of every gradient
        per_member = 2 * sum(parts) * F32 // replicas
        on_node = per_node // shard - 1 if shard <= per_node else 0
        cross, within = want["all_reduce"]
        want["all_reduce"] = (cross + (replicas - 1 - on_node) * per_member, within + on_node * per_member)
    return want


def by_kind(tally: dict) -> dict:
    out: dict = {}
    for op, row in tally.items():
        kind = "gather" if op.startswith("all_gather") else op.split("_tensor")[0].split("_columns")[0]
        cross, within = out.get(kind, (0, 0))
        out[kind] = (cross + row["cross_bytes"], within + row["within_bytes"])
    return {k: v for k, v in out.items() if v != (0, 0)}


def check_layout(per_node: int, shards: tuple) -> dict:
    """Each shard size's step against the formula; returns {label: (cross, within)} summed over ranks."""
    world = dist.get_world_size()
    os.environ[groups.RANKS_PER_NODE_ENV] = str(per_node)
    groups._TOPOLOGY.reset()
    try:
        assert groups.node_layout() == tuple(r // per_node for r in range(world))
        sums = {}
        for shard in shards:
            tally = by_kind(one_step(traffic_config(-1 if shard == world else shard)))
            want = {k: v for k, v in expected(world, per_node, shard).items() if v != (0, 0)}
            assert tally == want, (shard, tally, want)
            mine = torch.tensor([sum(v[0] for v in tally.values()), sum(v[1] for v in tally.values())])
            dist.all_reduce(mine)
            sums["zero3" if shard == world else f"mics{shard}"] = tuple(mine.tolist())
        return sums
    finally:
        del os.environ[groups.RANKS_PER_NODE_ENV]
        groups._TOPOLOGY.reset()


class TestNodeTrafficTwoRanks(DistributedTest):
    world_size = 2

    def test_two_nodes_of_one(self):
        sums = check_layout(1, (2, 1))
        assert sums["mics1"][0] < sums["zero3"][0]
        if dist.get_rank() == 0:
            print(f"bytes per step (cross, within), all ranks, 2 nodes of 1: {sums}")
        with pytest.raises(ValueError, match="3 node indices for a world of 2"):
            dist.count_node_traffic((0, 0, 1))
        # all-to-all (Ulysses): from the other rank, the slice of the output it fills
        rank = dist.get_rank()
        dist.count_node_traffic((0, 1))
        try:
            out = torch.empty(8)
            dist.all_to_all_single(out, torch.arange(8.0))  # equal slices: 4 floats from the other rank
            splits = [1, 2] if rank == 0 else [2, 3]  # rows of 3 floats each rank sends to ranks 0, 1
            rows_in = [1, 2] if rank == 0 else [2, 3]  # rows it receives from ranks 0, 1
            uneven = torch.empty(sum(rows_in), 3)
            dist.all_to_all_single(uneven, torch.ones(sum(splits), 3), rows_in, splits)
            tally = dist.node_traffic_totals()["all_to_all_single"]
        finally:
            dist.count_node_traffic(None)
        from_other = rows_in[1 - rank] * 3 * F32
        assert tally == {"count": 2, "cross_bytes": 4 * F32 + from_other, "within_bytes": 0}, tally


@pytest.mark.slow
class TestNodeTrafficFourRanks(DistributedTest):
    world_size = 4

    def test_two_nodes_of_two(self):
        sums = check_layout(2, (4, 2, 1))
        assert sums["mics2"][0] < sums["zero3"][0]
        if dist.get_rank() == 0:
            print(f"bytes per step (cross, within), all ranks, 2 nodes of 2: {sums}")
