"""`deepspeed.runtime.utils`: the helpers user scripts import from upstream's module of that name."""

import itertools
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


def _brute_force_bottleneck(weights, parts):
    """The least possible heaviest part over every contiguous split (small inputs only)."""
    n = len(weights)
    best = math.inf
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def _valid(parts, n, p):
    return (
        len(parts) == p + 1
        and parts[0] == 0
        and parts[-1] == n
        and all(a <= b for a, b in zip(parts, parts[1:]))
    )


def test_partition_uniform_sizes_differ_by_at_most_one():
    from deepspeed.runtime.utils import partition_uniform

    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]  # the larger parts first
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]  # fewer items than parts
    with pytest.raises(ValueError, match="num_parts must be a positive int, got 0"):
        partition_uniform(3, 0)


def test_partition_balanced_reaches_the_least_bottleneck():
    from deepspeed.runtime.utils import partition_balanced, prefix_sum_inc

    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        n, p = 1 + trial % 7, 1 + trial % 4
        weights = (
            (torch.rand(n, generator=gen) * 10).round().tolist()
            if trial % 2
            else torch.rand(n, generator=gen).tolist()
        )
        parts = partition_balanced(weights, p)
        assert _valid(parts, n, p), (weights, parts)
        heaviest = max(sum(weights[a:b]) for a, b in zip(parts, parts[1:]))
        assert math.isclose(heaviest, _brute_force_bottleneck(weights, p), rel_tol=1e-12), (weights, p, parts)
    # Parts fill from the left up to the bottleneck (the splits upstream's tests expect).
    assert partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert partition_balanced([0.0, 1.1, 30, 3.0], 3) == [0, 2, 3, 4]
    with pytest.raises(ValueError, match="weights must be >= 0"):
        partition_balanced([1, -2], 2)


class TestPartitionedTensor(DistributedTest):
    world_size = [2]

    def test_slices_gather_back_and_travel_as_meta(self):
        from deepspeed.runtime.utils import PartitionedTensor

        full = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)  # 21 elements: 11 + 10
        part = PartitionedTensor(full, group=None)
        assert part.local_size() == torch.Size([11 - dist.get_rank()])
        assert torch.equal(part.full(), full)
        again = PartitionedTensor.from_meta(part.to_meta(), part.local_data, None)
        assert torch.equal(again.full(), full)
