"""`deepspeed.runtime.utils`: the helpers user scripts import from upstream's module of that name."""

import math

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import clip_grad_norm_, move_to_device, see_memory_usage, set_random_seed
from tests.unit.common import DistributedTest


def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage("before the model")
    assert capsys.readouterr().out == ""
    see_memory_usage("before the model", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "before the model"
    assert lines[1].startswith("MA ") and "Max_MA" in lines[1] and "Max_CA" in lines[1], lines
    assert lines[2].startswith("CPU Virtual Memory:  used = "), lines


def test_move_to_device_keeps_structure_and_moves_matching_tensors_in_place():
    """On an accelerator the move is real; on a CPU-only machine the target is the CPU, which
    still checks the structure and that a matching tensor comes back as the same object."""
    device = torch.device(get_accelerator().current_device_name())
    held = torch.ones(2)
    other = torch.zeros(3)
    batch = {"ids": [held, (other, 7)], "name": "x", "mask": None}
    moved = move_to_device(batch, device, criterion_func=lambda t: t is held)
    assert set(moved) == {"ids", "name", "mask"} and moved["name"] == "x" and moved["mask"] is None
    assert isinstance(moved["ids"], list) and isinstance(moved["ids"][1], tuple) and moved["ids"][1][1] == 7
    assert moved["ids"][0] is held and held.device == device  # in place: every holder sees it
    assert moved["ids"][1][0].device == device and torch.equal(moved["ids"][1][0].cpu(), torch.zeros(3))
    assert move_to_device(torch.ones(1), device).device == device  # no criterion: .to(device)
    if device.type != "cpu":
        assert other.device.type == "cpu"  # not matching: copied, the original untouched


def test_set_random_seed_repeats_every_generator():
    import random

    np = pytest.importorskip("numpy")
    draws = []
    for _ in range(2):
        set_random_seed(2**70 + 5)  # wider than numpy's and torch's seeds: reduced, not refused
        draws.append((random.random(), float(np.random.rand()), torch.rand(1).item()))
    assert draws[0] == draws[1]


def test_clip_grad_norm_refuses_model_parallelism():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="mpu .* not supported"):
        clip_grad_norm_([p], 1.0, mpu=object())


class TestClipGradNorm(DistributedTest):
    world_size = [1, 2]

    def test_ranks_scale_by_the_same_coefficient(self):
        """Each rank's own gradients (different on each rank) are scaled by the coefficient of
        the norm averaged over ranks; at one rank that is torch's clip_grad_norm_."""
        rank, world = dist.get_rank(), dist.get_world_size()
        for norm_type in (2.0, 1.0, math.inf):
            gen = torch.Generator().manual_seed(10 + rank)
            params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 7, 3)]
            for p in params[:2]:
                p.grad = torch.randn(p.shape, generator=gen) * (rank + 1)
            expected_grads = [p.grad.clone() for p in params[:2]]
            mine = torch.linalg.vector_norm(torch.cat(expected_grads), norm_type)
            gathered = [torch.zeros(()) for _ in range(world)]
            dist.all_gather(gathered, mine)
            average = sum(gathered) / world
            total = clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
            torch.testing.assert_close(total, average, rtol=1e-6, atol=0)
            coefficient = min(1.0, 0.5 / (average.item() + 1e-6))
            for p, g in zip(params, expected_grads):
                torch.testing.assert_close(p.grad, g * coefficient, rtol=1e-6, atol=0)
            assert params[2].grad is None
            if world == 1:
                twins = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected_grads]
                for t, g in zip(twins, expected_grads):
                    t.grad = g.clone()
                torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(twins, 0.5, norm_type))
                for t, p in zip(twins, params):
                    torch.testing.assert_close(t.grad, p.grad, rtol=1e-6, atol=1e-7)
