"""`deepspeed.runtime.comm.coalesced_collectives`: a list of tensors reduce-scattered in one
collective, each split as ZeRO splits a parameter, checked against every rank's inputs."""

import math

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, reduce_scatter_coalesced
from tests.unit.common import DistributedTest

NUMELS = (6, 3, 1, 0, 11)


def _inputs(rank):
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(n, generator=gen) for n in NUMELS]


def _expected(world, rank):
    """Each tensor averaged over the ranks, then this rank's ceil(n / world) piece."""
    out = []
    for i, n in enumerate(NUMELS):
        mean = sum(_inputs(r)[i] for r in range(world)) / world
        size = math.ceil(n / world)
        out.append(mean[rank * size : (rank + 1) * size])
    return out


class TestCoalescedCollectives(DistributedTest):
    world_size = [1, 2]

    def test_each_rank_gets_its_averaged_piece_of_every_tensor(self):
        world, rank = dist.get_world_size(), dist.get_rank()
        got = reduce_scatter_coalesced(_inputs(rank), dist.get_world_group())
        for a, b in zip(got, _expected(world, rank)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        quantized = all_to_all_quant_reduce(_inputs(rank), {})
        for a, b in zip(quantized, _expected(world, rank)):
            assert a.shape == b.shape
            # int8 blocks: each rank's share is off by at most half a step of its block's scale.
            assert a.numel() == 0 or (a - b).abs().max() <= 3.0 / 127

    def test_misuse_is_refused_by_name(self):
        with pytest.raises(ValueError, match="one dtype and device"):
            reduce_scatter_coalesced([torch.ones(2), torch.ones(2, dtype=torch.float64)])
        with pytest.raises(ValueError, match=r"groups=\['local_0'\] asks for upstream's two-hop"):
            all_to_all_quant_reduce([torch.ones(2)], {"local_0": None})
